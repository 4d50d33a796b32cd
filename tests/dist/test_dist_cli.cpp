// `mpirun -np P attn sdpa ... --context-parallel ring|ulysses` writes the same
// output file as the single-process command: this test writes .npy inputs,
// runs both through the shell and compares the files (ring: up to float32
// rounding; ulysses: bit for bit, since each head is one ordinary call), and
// checks that unsupported requests are refused with the documented exit codes.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "attn/io.hpp"

namespace {

namespace fs = std::filesystem;

class DistCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("attn_dist_cli_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& f) const { return (dir_ / f).string(); }

  // Runs `[mpirun -np P] attn <args>` in the temporary directory; returns the exit code.
  int run(int P, const std::string& args) const {
    std::string cmd = "cd '" + dir_.string() + "' && ";
    if (P > 0) cmd += std::string("'") + ATTN_MPIEXEC + "' --allow-run-as-root --oversubscribe -np " + std::to_string(P) + " ";
    cmd += std::string("'") + ATTN_CLI_PATH + "' " + args + " > out.txt 2> err.txt";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }

  // Runs `mpirun -np 1 attn <a> : -np 1 attn <b>` (two ranks with different
  // command lines) under a 60 s limit, so that a hang is exit 124.
  int run_mpmd(const std::string& a, const std::string& b) const {
    const std::string attn = std::string(" '") + ATTN_CLI_PATH + "' ";
    const std::string cmd = "cd '" + dir_.string() + "' && timeout -k 5 60 '" + ATTN_MPIEXEC +
                            "' --allow-run-as-root --oversubscribe -np 1" + attn + a + " : -np 1" + attn + b +
                            " > out.txt 2> err.txt";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::string err() const {
    std::ifstream f(path("err.txt"));
    return std::string(std::istreambuf_iterator<char>(f), {});
  }

  void write_random(const std::string& f, std::vector<int64_t> shape, std::mt19937_64& rng) {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    std::normal_distribution<float> nd;
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = nd(rng);
    attn::io::write_npy(path(f), shape, v.data());
  }

  double max_diff(const std::string& a, const std::string& b) const {
    const auto x = attn::io::read_npy<float>(path(a)), y = attn::io::read_npy<float>(path(b));
    EXPECT_EQ(x.shape, y.shape);
    double m = 0;
    for (size_t i = 0; i < x.data.size() && i < y.data.size(); ++i)
      m = std::max(m, double(std::abs(x.data[i] - y.data[i])));
    return m;
  }

  fs::path dir_;
};

TEST_F(DistCli, SameFilesAsTheSingleProcessCommand) {
  std::mt19937_64 rng(5);
  write_random("q.npy", {2, 4, 61, 8}, rng);
  write_random("k.npy", {2, 2, 61, 8}, rng);
  write_random("v.npy", {2, 2, 61, 6}, rng);
  const std::string in = "sdpa --q q.npy --k k.npy --v v.npy --backend fused";
  for (const char* causal : {"", " --causal", " --causal --window 7,-1 --alibi --sinks 0.5 --softcap 3",
                             " --window 4,9 --position-offset -5 --sinks -1,0,1,2"}) {
    ASSERT_EQ(run(0, in + causal + " --out ref.npy --lse ref_lse.npy"), 0);
    for (int P : {1, 2, 3}) {
      ASSERT_EQ(run(P, in + causal + " --context-parallel ring --out ring.npy --lse ring_lse.npy"), 0) << P;
      EXPECT_LT(max_diff("ring.npy", "ref.npy"), 1e-5) << "P = " << P << causal;
      EXPECT_LT(max_diff("ring_lse.npy", "ref_lse.npy"), 1e-5) << "P = " << P << causal;
    }
    ASSERT_EQ(run(2, in + causal + " --context-parallel ulysses --out uly.npy"), 0);
    EXPECT_EQ(max_diff("uly.npy", "ref.npy"), 0.0) << causal;
  }
  // Refused: ulysses with Hkv = 2 on 3 ranks (exit 1), weights (usage, exit 2), float64 input (exit 1).
  EXPECT_EQ(run(3, in + " --context-parallel ulysses --out x.npy"), 1);
  EXPECT_EQ(run(2, in + " --context-parallel ring --out x.npy --weights w.npy"), 2);
  std::vector<double> q64(2 * 4 * 61 * 8, 0.5);
  attn::io::write_npy(path("q64.npy"), {2, 4, 61, 8}, q64.data());
  EXPECT_EQ(run(2, "sdpa --q q64.npy --k k.npy --v v.npy --context-parallel ring --out x.npy"), 1);
  EXPECT_FALSE(fs::exists(dir_ / "x.npy"));
}

}  // namespace

namespace {

// Ranks started with different command lines: the strategy, or the lse asked
// for on one rank only. Every rank fails at once naming the difference
// (exit 1), none waits for the others.
TEST_F(DistCli, RanksThatDisagreeFailTogether) {
  std::mt19937_64 rng(6);
  write_random("q.npy", {2, 4, 21, 8}, rng);
  write_random("k.npy", {2, 2, 21, 8}, rng);
  write_random("v.npy", {2, 2, 21, 6}, rng);
  const std::string in = "sdpa --q q.npy --k k.npy --v v.npy --out y.npy";
  EXPECT_EQ(run_mpmd(in + " --context-parallel ring", in + " --context-parallel ulysses"), 1) << err();
  EXPECT_NE(err().find("ranks disagree on the call: rank 1 runs attn::dist::ulysses_attention, rank 0 "
                       "attn::dist::ring_attention"),
            std::string::npos)
      << err();
  EXPECT_EQ(run_mpmd(in + " --context-parallel ring --lse l.npy", in + " --context-parallel ring"), 1) << err();
  EXPECT_NE(err().find("ranks disagree on whether an lse output was given"), std::string::npos) << err();
  EXPECT_EQ(run_mpmd(in + " --context-parallel ring --causal", in + " --context-parallel ring"), 1) << err();
  EXPECT_FALSE(fs::exists(dir_ / "y.npy"));
  EXPECT_FALSE(fs::exists(dir_ / "l.npy"));
  // The same command on both: it runs.
  EXPECT_EQ(run_mpmd(in + " --context-parallel ulysses --lse l.npy", in + " --context-parallel ulysses --lse l.npy"), 0)
      << err();
  EXPECT_TRUE(fs::exists(dir_ / "l.npy"));
}

}  // namespace
