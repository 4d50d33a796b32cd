// The attn tool under hostile or unlucky use (issue 11): outputs are one
// transaction, checked before any work; temporaries do not survive errors or
// signals; modes follow the umask; checkpoints are validated before anything
// is allocated; training stops on a non-finite loss; sizes over the machine's
// memory are argument errors and a real allocation failure has its own exit
// code; usage messages name what was wrong.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <thread>

#include "attn/io.hpp"
#include "cli/cli_test.hpp"

namespace attn_cli_test {
namespace {

using attn::io::Array;
using json = nlohmann::json;

// Files in the test directory whose name marks them as temporaries.
int temporaries(const fs::path& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += contains(e.path().filename().string(), ".attn-tmp.");
  return n;
}

mode_t mode_of(const std::string& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_mode & 07777;
}

class Hardening : public Cli {
 public:
  void write_qkv(int64_t L, int64_t S, int64_t E = 8, int64_t Ev = 3) {
    std::mt19937_64 rng(7);
    write_random<float>("q.npy", {L, E}, rng);
    write_random<float>("k.npy", {S, E}, rng);
    write_random<float>("v.npy", {S, Ev}, rng);
  }
  // A tiny training run's checkpoint, written to `name`.
  void tiny_checkpoint(const std::string& name, const std::string& extra = "") {
    const Result r = run("train --task reverse --length 3 --symbols 4 --layers 1 --dim 8 --heads 2 --steps 3 "
                         "--eval-examples 8 --save " + name + " " + extra);
    ASSERT_EQ(r.rc, 0) << r.err;
  }
  // Rewrites the checkpoint's stored configuration (and optionally drops tensors).
  void edit_config(const std::string& from, const std::string& to, const std::function<void(json&)>& edit,
                   const std::string& drop_prefix = "") {
    attn::io::Metadata meta;
    auto t = attn::io::read_safetensors<float>(path(from), {}, &meta);
    json c = json::parse(meta.at("config"));
    edit(c);
    meta["config"] = c.dump();
    if (!drop_prefix.empty())
      for (auto it = t.begin(); it != t.end();) it = contains(it->first, drop_prefix) ? t.erase(it) : std::next(it);
    attn::io::write_safetensors(path(to), t, meta);
  }
};

// ---- 11.9, 11.10: outputs as one transaction -------------------------------------

TEST_F(Hardening, SdpaReplacesNoOutputWhenAnyOutputCannotBeWritten) {
  write_qkv(4, 5);
  put("y.npy", "old contents");
  const Result r = run("sdpa --q q.npy --k k.npy --v v.npy --out y.npy --weights /nonexistent/a.npy");
  EXPECT_EQ(r.rc, 3) << r.err;
  EXPECT_TRUE(contains(r.err, "error: --weights /nonexistent/a.npy: cannot create a file in directory '/nonexistent'"))
      << r.err;
  EXPECT_EQ(slurp(path("y.npy")), "old contents");
  // An output path that is a directory is refused the same way, before computing.
  fs::create_directories(path("adir"));
  const Result d = run("sdpa --q q.npy --k k.npy --v v.npy --out y.npy --lse adir");
  EXPECT_EQ(d.rc, 3);
  EXPECT_TRUE(contains(d.err, "--lse adir: is a directory")) << d.err;
  EXPECT_EQ(slurp(path("y.npy")), "old contents");
  EXPECT_EQ(temporaries(dir_), 0);
  // All three written together when every path is fine.
  const Result ok = run("sdpa --q q.npy --k k.npy --v v.npy --out y.npy --weights a.npy --lse l.npy");
  ASSERT_EQ(ok.rc, 0) << ok.err;
  EXPECT_EQ(attn::io::read_npy<float>(path("a.npy")).shape, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(attn::io::read_npy<float>(path("l.npy")).shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(attn::io::read_npy<float>(path("y.npy")).shape, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(temporaries(dir_), 0);
}

TEST_F(Hardening, TwoOutputsOnOneFileAreAUsageError) {
  write_qkv(4, 5);
  for (const char* args : {"--out y.npy --weights y.npy", "--out y.npy --lse ./y.npy", "--weights w.npy --out w.npy"}) {
    const Result r = run(std::string("sdpa --q q.npy --k k.npy --v v.npy ") + args);
    EXPECT_EQ(r.rc, 2) << args;
    EXPECT_TRUE(contains(r.err, "error: ") && contains(r.err, "both name the file")) << r.err;
  }
  EXPECT_FALSE(fs::exists(path("y.npy")));
  EXPECT_FALSE(fs::exists(path("w.npy")));
  // The same file under two names (a symlink) too.
  put("real.npy", "x");
  fs::create_symlink("real.npy", path("link.npy"));
  EXPECT_EQ(run("sdpa --q q.npy --k k.npy --v v.npy --out real.npy --weights link.npy").rc, 2);
  const Result t = run("train --length 3 --symbols 4 --layers 1 --dim 8 --heads 2 --steps 2 --save c.csv --csv c.csv");
  EXPECT_EQ(t.rc, 2);
  EXPECT_TRUE(contains(t.err, "--save and --csv both name the file 'c.csv'")) << t.err;
}

TEST_F(Hardening, NewFilesFollowTheUmaskAndReplacedFilesKeepTheirMode) {
  write_qkv(4, 5);
  const mode_t old = ::umask(077);
  const Result r = run("sdpa --q q.npy --k k.npy --v v.npy --out private.npy");
  ::umask(022);
  const Result s = run("sdpa --q q.npy --k k.npy --v v.npy --out shared.npy");
  ::umask(old);
  ASSERT_EQ(r.rc, 0) << r.err;
  ASSERT_EQ(s.rc, 0) << s.err;
  EXPECT_EQ(mode_of(path("private.npy")), 0600u);
  EXPECT_EQ(mode_of(path("shared.npy")), 0644u);
  // An existing file's mode survives being replaced.
  fs::permissions(path("shared.npy"), fs::perms(0640));
  ASSERT_EQ(run("sdpa --q q.npy --k k.npy --v v.npy --out shared.npy").rc, 0);
  EXPECT_EQ(mode_of(path("shared.npy")), 0640u);
}

// ---- 11.11: train checks its outputs first -----------------------------------------

TEST_F(Hardening, TrainRefusesAnUnwritableOutputBeforeTraining) {
  const auto t0 = std::chrono::steady_clock::now();
  for (const char* out : {"--save /nonexistent/x.safetensors", "--csv /nonexistent/c.csv", "--png /nonexistent/p.png"}) {
    const Result r = run(std::string("train --steps 1000000 --length 3 --symbols 4 --layers 1 --dim 8 --heads 2 ") + out);
    EXPECT_EQ(r.rc, 3) << out;
    EXPECT_TRUE(contains(r.err, "cannot create a file in directory '/nonexistent'")) << r.err;
    EXPECT_FALSE(contains(r.out, "step")) << "trained before failing: " << r.out;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
}

// ---- 11.8: a signal removes the temporaries ------------------------------------------

TEST_F(Hardening, SigtermDuringTrainingLeavesNoTemporaryAndACompleteCheckpoint) {
  // Checkpoints every step: most of the time some temporary exists.
  const std::string cmd = "cd '" + dir_.string() + "' && exec '" + kCli +
                          "' train --length 3 --symbols 4 --layers 1 --dim 8 --heads 2 --steps 100000 --log-every 1 "
                          "--save ck.safetensors --save-every 1 --csv c.csv > out.txt 2> err.txt";
  for (int round = 0; round < 3; ++round) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    // Wait until it trains, then interrupt it.
    for (int i = 0; i < 600 && !contains(slurp(dir_ / "out.txt"), "step      5/"); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ::kill(pid, round == 1 ? SIGINT : SIGTERM);
    int st = 0;
    ASSERT_EQ(::waitpid(pid, &st, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(st)) << "status " << st;
    if (WIFSIGNALED(st)) {
      EXPECT_EQ(WTERMSIG(st), round == 1 ? SIGINT : SIGTERM);
    }
    EXPECT_EQ(temporaries(dir_), 0) << "round " << round;
    EXPECT_FALSE(fs::exists(path("c.csv")));  // written only at the end
    // The checkpoint on disk is a complete one.
    attn::io::Metadata meta;
    EXPECT_NO_THROW(attn::io::read_safetensors<float>(path("ck.safetensors"), {}, &meta));
    EXPECT_GE(std::stoi(meta.at("step")), 1);
  }
}

// ---- 11.3, 11.4: checkpoints are validated before allocating -------------------------

TEST_F(Hardening, CheckpointConfigsAreValidatedBeforeAnythingIsAllocated) {
  tiny_checkpoint("ck.safetensors");
  struct Case {
    const char* file;
    std::function<void(json&)> edit;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"long.safetensors", [](json& c) { c["length"] = 10000000; }, "length is 10000000, expected 1 to 4096"},
      {"wide.safetensors", [](json& c) { c["dim"] = 1000000000; }, "dim is 1000000000, expected 1 to 8192"},
      {"frac.safetensors", [](json& c) { c["length"] = 4.5; }, "config 'length' is 4.5, expected an integer"},
      {"neg.safetensors", [](json& c) { c["queries"] = -1; }, "queries is -1"},
      {"text.safetensors", [](json& c) { c["layers"] = "1"; }, "config 'layers' is \"1\", expected an integer"},
      // Plausible values that do not match the tensors stored.
      {"dim16.safetensors", [](json& c) { c["dim"] = 16; }, "tensor 'embed.weight' is (6, 16), the file holds (6, 8)"},
      {"two.safetensors", [](json& c) { c["layers"] = 2; }, "a tensor 'blocks.1.ln1.weight' (8,), which the file does not hold"},
  };
  for (const auto& c : cases) {
    edit_config("ck.safetensors", c.file, c.edit);
    const auto t0 = std::chrono::steady_clock::now();
    const Result h = run(std::string("heatmap --checkpoint ") + c.file + " --out h.png");
    EXPECT_EQ(h.rc, 1) << c.file << ": " << h.err;
    EXPECT_TRUE(contains(h.err, c.message)) << c.file << ": " << h.err;
    EXPECT_TRUE(contains(h.err, c.file)) << h.err;
    const Result t = run(std::string("train --length 3 --symbols 4 --layers 1 --dim 8 --heads 2 --steps 5 --resume ") +
                         c.file);
    EXPECT_EQ(t.rc, 1) << c.file << ": " << t.err;
    EXPECT_TRUE(contains(t.err, c.message)) << c.file << ": " << t.err;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0) << c.file;
  }
  EXPECT_FALSE(fs::exists(path("h.png")));
}

TEST_F(Hardening, ZeroLayerModelsAreRefusedWithAClearError) {
  const Result t = run("train --layers 0 --length 3 --symbols 4 --dim 8 --heads 2 --steps 2 --save z.safetensors");
  EXPECT_EQ(t.rc, 1) << t.err;
  EXPECT_TRUE(contains(t.err, "layers is 0, expected 1 to 64 (a model needs at least one attention layer)")) << t.err;
  EXPECT_FALSE(fs::exists(path("z.safetensors")));
  // A zero-layer checkpoint from elsewhere (an older attn wrote them): an error, not SIGFPE.
  tiny_checkpoint("ck.safetensors");
  edit_config("ck.safetensors", "zero.safetensors", [](json& c) { c["layers"] = 0; }, "blocks.");
  const Result h = run("heatmap --checkpoint zero.safetensors --out z.png");
  EXPECT_EQ(h.rc, 1) << h.err;
  EXPECT_TRUE(contains(h.err, "zero.safetensors") && contains(h.err, "layers is 0")) << h.err;
}

// ---- 11.13: a non-finite loss stops training -------------------------------------------

TEST_F(Hardening, TrainingStopsOnANonFiniteLossAndKeepsTheLastCheckpoint) {
  const std::string model = "train --length 3 --symbols 4 --layers 1 --dim 8 --heads 2 --optimizer sgd --clip 0 ";
  ASSERT_EQ(run(model + "--steps 40 --stop-at 3 --eval-examples 8 --save ck.safetensors").rc, 0);
  const std::string before = slurp(path("ck.safetensors"));
  // A learning rate that blows the parameters up within a few steps.
  const Result r = run(model + "--steps 40 --lr 1e30 --eval-examples 8 --resume ck.safetensors --save ck.safetensors");
  EXPECT_EQ(r.rc, 7) << r.err << r.out;
  EXPECT_TRUE(contains(r.err, "error: attn::nn::train: training diverged at step")) << r.err;
  EXPECT_TRUE(contains(r.err, "is nan") || contains(r.err, "is inf")) << r.err;
  EXPECT_TRUE(contains(r.err, "'ck.safetensors' is unchanged")) << r.err;
  EXPECT_EQ(slurp(path("ck.safetensors")), before);
  // With periodic checkpoints, the last one written before the divergence is kept.
  const Result p = run(model + "--steps 40 --lr 1e30 --eval-examples 8 --save p.safetensors --save-every 1");
  EXPECT_EQ(p.rc, 7) << p.err;
  EXPECT_TRUE(contains(p.err, "in 'p.safetensors' is kept")) << p.err;
  attn::io::Metadata meta;
  const auto t = attn::io::read_safetensors<float>(path("p.safetensors"), {}, &meta);
  for (const auto& [name, a] : t)
    for (float x : a.data) ASSERT_TRUE(std::isfinite(x)) << name;
}

TEST_F(Hardening, ACheckpointHoldingNanIsRefused) {
  tiny_checkpoint("ck.safetensors");
  attn::io::Metadata meta;
  auto t = attn::io::read_safetensors<float>(path("ck.safetensors"), {}, &meta);
  t.at("head.bias").data[1] = std::nanf("");
  attn::io::write_safetensors(path("nan.safetensors"), t, meta);
  const Result r = run("train --length 3 --symbols 4 --layers 1 --dim 8 --heads 2 --steps 6 --resume nan.safetensors");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "tensor 'head.bias' holds nan at flat index 1")) << r.err;
  const Result h = run("heatmap --checkpoint nan.safetensors --out h.png");
  EXPECT_EQ(h.rc, 1) << h.err;
  EXPECT_TRUE(contains(h.err, "holds nan")) << h.err;
}

// ---- 11.7: sizes over the machine's memory; out of memory ---------------------------------

TEST_F(Hardening, SizesBeyondTheMachineAreArgumentErrorsNamingTheBytes) {
  std::mt19937_64 rng(3);
  write_random<float>("q.npy", {1000000, 1}, rng);
  const Result w = run("sdpa --q q.npy --k q.npy --v q.npy --out y.npy --weights w.npy");
  EXPECT_EQ(w.rc, 1) << w.err;
  EXPECT_TRUE(contains(w.err, "--weights (B x H x L x S: 1 x 1 x 1000000 x 1000000 float32 values) would need "
                              "4000000000000 bytes (3.6 TiB), more than the"))
      << w.err;
  const Result r = run("sdpa --q q.npy --k q.npy --v q.npy --out y.npy --backend reference");
  EXPECT_EQ(r.rc, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "the reference backend materialises 1 L x S matrix(es) of doubles for q (L = 1000000) "
                              "and k (S = 1000000); that would need 8000000000000 bytes"))
      << r.err;
  EXPECT_FALSE(fs::exists(path("y.npy")));
}

#if defined(__SANITIZE_ADDRESS__)
#define ATTN_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTN_UNDER_ASAN 1
#endif
#endif

TEST_F(Hardening, AFailedAllocationIsExitCode6) {
#ifdef ATTN_UNDER_ASAN
  GTEST_SKIP() << "AddressSanitizer reserves more address space than the limit this test sets";
#else
  // 16384 x 16384 float32 weights (1 GiB) under a 512 MiB address-space
  // limit, which the tool inherits from this process for the one run.
  std::mt19937_64 rng(3);
  write_random<float>("q.npy", {16384, 1}, rng);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_AS, &old), 0);
  rlimit tight = old;
  tight.rlim_cur = rlim_t(512) << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &tight), 0);
  const Result r = run("sdpa --q q.npy --k q.npy --v q.npy --out y.npy --weights w.npy");
  ASSERT_EQ(::setrlimit(RLIMIT_AS, &old), 0);
  EXPECT_EQ(r.rc, 6) << r.err;
  EXPECT_TRUE(contains(r.err, "error: out of memory")) << r.err;
  EXPECT_FALSE(fs::exists(path("w.npy")));
  EXPECT_EQ(temporaries(dir_), 0);
#endif
}

// ---- 11.16, 10 §8.1: messages and bool masks ---------------------------------------------

TEST_F(Hardening, UsageErrorsNameWhatWasWrong) {
  struct Case {
    const char* args;
    int rc;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"foo", 2, "error: unknown command 'foo' (commands: sdpa, mha, explain"},
      {"sdpa --bogus", 2, "error: attn sdpa: unknown option '--bogus'"},
      {"sdpa --q q.npy --bogus 3", 2, "error: attn sdpa: unknown option '--bogus'"},
      {"sdpa --q q.npy --k q.npy --v q.npy --out y.npy --scale abc", 2,
       "error: attn sdpa: --scale: expected a finite number > 0, got 'abc'"},
      {"sdpa --q q.npy --k q.npy --v q.npy --out y.npy --scale -2", 2, "got '-2'"},
      {"sdpa --q q.npy", 2, "error: attn sdpa: --k is required"},
      {"", 2, "error: attn: A subcommand is required"},
      {"train --lr abc", 2, "error: attn train: "},
  };
  for (const auto& c : cases) {
    const Result r = run(c.args);
    EXPECT_EQ(r.rc, c.rc) << c.args;
    EXPECT_TRUE(contains(r.err, c.message)) << c.args << " -> " << r.err;
    EXPECT_LT(r.err.size(), 300u) << c.args << ": " << r.err;  // no 309-digit range
  }
  // An empty input is named as such, not as a missing argument.
  attn::io::write_npy<float>(path("q0.npy"), {0, 8}, nullptr);
  write_qkv(4, 5);
  const Result e = run("sdpa --q q0.npy --k k.npy --v v.npy --out y.npy");
  EXPECT_EQ(e.rc, 1);
  EXPECT_TRUE(contains(e.err, "--q q0.npy has shape (0, 8): axis 0 has length 0")) << e.err;
  EXPECT_FALSE(contains(e.err, "required but was not given")) << e.err;
}

TEST_F(Hardening, SdpaReadsNumpyBoolMasks) {
  write_qkv(4, 5);
  // The same mask as bool (np.save of a bool array writes '|b1') and as 0/1 floats.
  const std::vector<float> m01 = {1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1};
  attn::io::write_npy(path("m01.npy"), {4, 5}, m01.data());
  std::string header = "{'descr': '|b1', 'fortran_order': False, 'shape': (4, 5), }";
  while ((10 + header.size() + 1) % 64) header += ' ';
  header += '\n';
  std::string file = std::string("\x93NUMPY\x01\x00", 8) + char(header.size()) + char(0) + header;
  for (float x : m01) file += char(x == 1);
  put("mb.npy", file);
  ASSERT_EQ(run("sdpa --q q.npy --k k.npy --v v.npy --mask mb.npy --out yb.npy").rc, 0);
  ASSERT_EQ(run("sdpa --q q.npy --k k.npy --v v.npy --mask m01.npy --out yf.npy").rc, 0);
  ASSERT_EQ(run("sdpa --q q.npy --k k.npy --v v.npy --out yn.npy").rc, 0);
  const auto yb = attn::io::read_npy<float>(path("yb.npy")).data, yf = attn::io::read_npy<float>(path("yf.npy")).data,
             yn = attn::io::read_npy<float>(path("yn.npy")).data;
  EXPECT_EQ(yb, yf);
  EXPECT_NE(yb, yn);  // the mask did something
  // A bool array where numbers are expected is refused; --help says the polarity.
  const Result q = run("sdpa --q mb.npy --k k.npy --v v.npy --out y.npy");
  EXPECT_EQ(q.rc, 1);
  EXPECT_TRUE(contains(q.err, "--q mb.npy holds bool values; expected float32 or float64")) << q.err;
  const Result h = run("sdpa --help");
  EXPECT_TRUE(contains(h.out, "True/1 = the query may attend to the key, False/0 = blocked")) << h.out;
}

}  // namespace
}  // namespace attn_cli_test
