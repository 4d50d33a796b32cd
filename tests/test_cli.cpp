// The attn command-line tool, driven through its command line: golden output
// of the seeds' worked examples, `sdpa` and `mha` against computations written
// out here, every experiment's figures against conditions any honest run
// satisfies, heatmaps, the tour, and exit codes for every kind of bad input.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "attn/io.hpp"
#include "testing.hpp"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using attn::io::Array;
using attn::io::DType;

#ifdef ATTN_CLI_PATH
const char* kCli = ATTN_CLI_PATH;
#else
const char* kCli = nullptr;
#endif

struct Result {
  int rc = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class Cli : public ::testing::Test {
 public:
  void SetUp() override {
    if (!kCli) GTEST_SKIP() << "the attn binary is not built (ATTN_BUILD_APPS=OFF)";
    dir_ = fs::temp_directory_path() /
           ("attn_test_cli_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& f) const { return (dir_ / f).string(); }

  // Runs `attn <args>` in the temporary directory.
  Result run(const std::string& args) const {
    const std::string cmd = "cd '" + dir_.string() + "' && '" + kCli + "' " + args + " > out.txt 2> err.txt";
    const int st = std::system(cmd.c_str());
    Result r;
    r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(dir_ / "out.txt");
    r.err = slurp(dir_ / "err.txt");
    return r;
  }

  template <class T>
  std::vector<T> write_random(const std::string& f, std::vector<int64_t> shape, std::mt19937_64& rng) {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    std::normal_distribution<double> nd;
    std::vector<T> v(static_cast<size_t>(n));
    for (auto& x : v) x = T(nd(rng));
    attn::io::write_npy(path(f), shape, v.data());
    return v;
  }

  fs::path dir_;
};

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- golden: the seeds' worked examples ------------------------------------------

TEST_F(Cli, ExplainCatReproducesTheSeedsNumbers) {
  const Result r = run("explain --example cat");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "S / sqrt(d_k) = S / 2")) << r.out;
  EXPECT_TRUE(contains(r.out, "hungry   -1.000    2.000    0.000    0.000")) << r.out;  // scaled scores
  EXPECT_TRUE(contains(r.out, "hungry    0.038    0.757    0.102    0.102")) << r.out;  // weights
  EXPECT_TRUE(contains(r.out, "Result for \"hungry\": weights 0.038 0.757 0.102 0.102  ->  output 0.76 0.20"))
      << r.out;
}

TEST_F(Cli, ExplainTwoTokensReproducesTheSeedsNumbers) {
  const Result r = run("explain --example two-tokens");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "token 1    1.414    0.000")) << r.out;  // 2 / sqrt(2), 0 / sqrt(2)
  EXPECT_TRUE(contains(r.out, "Result for \"token 1\": weights 0.80 0.20  ->  output 0.80 0.20")) << r.out;
  // Causal: token 1 may only see itself.
  const Result c = run("explain --example two-tokens --causal");
  ASSERT_EQ(c.rc, 0) << c.err;
  EXPECT_TRUE(contains(c.out, "weights 1.00 0.00  ->  output 1.00 0.00")) << c.out;
}

TEST_F(Cli, ExplainRandomShowsHeadsConcatenationAndOutputProjection) {
  const Result r = run("explain --example random --heads 2 --dim 6 --tokens 3");
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* part : {"X (token embeddings", "W_Q", "head 0", "head 1", "S_1 = Q_1 K_1^T", "A_0 = softmax",
                           "O = [Y_0 | Y_1", "W_O", "output = O W_O"})
    EXPECT_TRUE(contains(r.out, part)) << part;
  EXPECT_EQ(run("explain --example cat --dk 8").rc, 2);
  EXPECT_EQ(run("explain --example random --dim 7 --heads 2").rc, 2);
}

// ---- sdpa: files in, files out, compared with the library -------------------------

TEST_F(Cli, SdpaOnNpyFilesAgreesWithTheLibrary) {
  std::mt19937_64 rng(3);
  const int64_t B = 2, H = 2, L = 5, S = 7, E = 3, Ev = 4;
  const auto q = write_random<double>("q.npy", {B, H, L, E}, rng);
  const auto k = write_random<double>("k.npy", {B, H, S, E}, rng);
  const auto v = write_random<double>("v.npy", {B, H, S, Ev}, rng);
  const Result r = run("sdpa --q q.npy --k k.npy --v v.npy --causal --scale 0.7 --out y.npy --weights a.npy --lse lse.npy");
  ASSERT_EQ(r.rc, 0) << r.err;
  attn::SdpaArgs<double> args;
  args.q = attn::View4<const double>::bhnd(q.data(), B, H, L, E);
  args.k = attn::View4<const double>::bhnd(k.data(), B, H, S, E);
  args.v = attn::View4<const double>::bhnd(v.data(), B, H, S, Ev);
  attn::SdpaOptions opt;
  opt.causal = true;
  opt.scale = 0.7;
  attn::Tensor<double> y({B, H, L, Ev}), a({B, H, L, S}), lse({B, H, L});
  attn::scaled_dot_product_attention<double>(args, {y.view4(), a.view4(), lse.view<3>()}, opt);
  const auto fy = attn::io::read_npy<double>(path("y.npy"));
  const auto fa = attn::io::read_npy<double>(path("a.npy"));
  const auto fl = attn::io::read_npy<double>(path("lse.npy"));
  EXPECT_EQ(fy.shape, (std::vector<int64_t>{B, H, L, Ev}));
  EXPECT_EQ(fa.shape, (std::vector<int64_t>{B, H, L, S}));
  EXPECT_EQ(fl.shape, (std::vector<int64_t>{B, H, L}));
  EXPECT_EQ(fy.stored, DType::f64);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(fy.data[i], y[i]) << i;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(fa.data[i], a[i]) << i;
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_EQ(fl.data[i], lse[i]) << i;
}

// The variant flags reach the library's options and arguments.
TEST_F(Cli, SdpaVariantFlagsAgreeWithTheLibrary) {
  std::mt19937_64 rng(13);
  const int64_t H = 2, L = 6, S = 9, E = 3, Ev = 2;
  const auto q = write_random<double>("q.npy", {H, L, E}, rng);
  const auto k = write_random<double>("k.npy", {H, S, E}, rng);
  const auto v = write_random<double>("v.npy", {H, S, Ev}, rng);
  const Result r = run("sdpa --q q.npy --k k.npy --v v.npy --causal --window 2,-1 --softcap 1.5 --alibi "
                       "--sinks 0.25,-1 --position-offset 2 --out y.npy --lse lse.npy");
  ASSERT_EQ(r.rc, 0) << r.err;
  attn::SdpaArgs<double> args;
  args.q = attn::View4<const double>::bhnd(q.data(), 1, H, L, E);
  args.k = attn::View4<const double>::bhnd(k.data(), 1, H, S, E);
  args.v = attn::View4<const double>::bhnd(v.data(), 1, H, S, Ev);
  const std::vector<double> slopes = {std::exp2(-4.0), std::exp2(-8.0)}, sinks = {0.25, -1};
  args.alibi_slopes = attn::View1<const double>(slopes.data(), {H});
  args.sinks = attn::View1<const double>(sinks.data(), {H});
  attn::SdpaOptions opt;
  opt.causal = true;
  opt.window = {2, -1};
  opt.softcap = 1.5;
  opt.position_offset = 2;
  attn::Tensor<double> y({1, H, L, Ev}), lse({1, H, L});
  attn::scaled_dot_product_attention<double>(args, {y.view4(), {}, lse.view<3>()}, opt);
  const auto fy = attn::io::read_npy<double>(path("y.npy"));
  const auto fl = attn::io::read_npy<double>(path("lse.npy"));
  ASSERT_EQ(fy.data.size(), y.size());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(fy.data[i], y[i]) << i;
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_EQ(fl.data[i], lse[i]) << i;
  EXPECT_EQ(run("sdpa --q q.npy --k k.npy --v v.npy --sinks 1,2,3 --out y.npy").rc, 1);  // H = 2
  EXPECT_EQ(run("sdpa --q q.npy --k k.npy --v v.npy --window 3 --out y.npy").rc, 2);
}

TEST_F(Cli, SdpaRank2Float32WithMaskMatchesAPlainComputation) {
  std::mt19937_64 rng(4);
  const int64_t L = 4, S = 6, E = 5, Ev = 3;
  const auto q = write_random<float>("q.npy", {L, E}, rng);
  const auto k = write_random<float>("k.npy", {S, E}, rng);
  const auto v = write_random<float>("v.npy", {S, Ev}, rng);
  std::vector<float> m(static_cast<size_t>(L * S));
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < S; ++j) m[size_t(i * S + j)] = (i + j) % 3 != 0 ? 1.f : 0.f;
  attn::io::write_npy(path("m.npy"), {L, S}, m.data());
  const Result r = run("sdpa --q q.npy --k k.npy --v v.npy --mask m.npy --out y.npy");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto fy = attn::io::read_npy<double>(path("y.npy"));
  EXPECT_EQ(fy.stored, DType::f32);
  ASSERT_EQ(fy.shape, (std::vector<int64_t>{L, Ev}));
  // softmax(q kᵀ / sqrt(E)) v over the allowed keys, in double.
  for (int64_t i = 0; i < L; ++i) {
    std::vector<double> s(static_cast<size_t>(S));
    double mx = -1e300, sum = 0;
    for (int64_t j = 0; j < S; ++j) {
      double d = 0;
      for (int64_t e = 0; e < E; ++e) d += double(q[size_t(i * E + e)]) * double(k[size_t(j * E + e)]);
      s[size_t(j)] = m[size_t(i * S + j)] != 0 ? d / std::sqrt(double(E)) : -INFINITY;
      mx = std::max(mx, s[size_t(j)]);
    }
    for (auto& x : s) sum += (x = std::exp(x - mx));
    for (int64_t c = 0; c < Ev; ++c) {
      double y = 0;
      for (int64_t j = 0; j < S; ++j) y += s[size_t(j)] / sum * double(v[size_t(j * Ev + c)]);
      EXPECT_NEAR(fy.data[size_t(i * Ev + c)], y, attn::testing::tolerance<float>(S * E, 3.0)) << i << "," << c;
    }
  }
}

TEST_F(Cli, SdpaRejectsMismatchedFilesAndKeepsTheExistingOutput) {
  std::mt19937_64 rng(5);
  write_random<float>("q.npy", {4, 8}, rng);
  write_random<float>("k.npy", {6, 5}, rng);  // E = 5, q has 8
  write_random<float>("k_ok.npy", {6, 8}, rng);
  write_random<float>("v.npy", {6, 3}, rng);
  write_random<float>("v_short.npy", {5, 3}, rng);
  write_random<float>("q3.npy", {2, 4, 8}, rng);
  const std::vector<float> old = {42};
  attn::io::write_npy(path("y.npy"), {1}, old.data());
  Result r = run("sdpa --q q.npy --k k.npy --v v.npy --out y.npy");
  EXPECT_EQ(r.rc, 1);
  EXPECT_TRUE(contains(r.err, "--k k.npy has shape (6, 5) but --q q.npy has shape (4, 8)")) << r.err;
  r = run("sdpa --q q.npy --k k_ok.npy --v v_short.npy --out y.npy");
  EXPECT_EQ(r.rc, 1);
  EXPECT_TRUE(contains(r.err, "--v v_short.npy has shape (5, 3)")) << r.err;
  r = run("sdpa --q q3.npy --k k_ok.npy --v v.npy --out y.npy");
  EXPECT_EQ(r.rc, 1);
  EXPECT_TRUE(contains(r.err, "same number of axes")) << r.err;
  write_random<float>("q4.npy", {1, 4, 5, 8}, rng);
  write_random<float>("k3.npy", {1, 3, 6, 8}, rng);
  write_random<float>("v3.npy", {1, 3, 6, 2}, rng);
  r = run("sdpa --q q4.npy --k k3.npy --v v3.npy --out y.npy");  // 3 key heads do not divide 4 query heads
  EXPECT_EQ(r.rc, 1);
  EXPECT_TRUE(contains(r.err, "Hkv dividing H = 4") && contains(r.err, "k = k3.npy")) << r.err;
  write_random<float>("m.npy", {4, 7}, rng);
  r = run("sdpa --q q.npy --k k_ok.npy --v v.npy --mask m.npy --out y.npy");
  EXPECT_EQ(r.rc, 1);
  EXPECT_TRUE(contains(r.err, "--mask m.npy holds")) << r.err;  // not 0/1
  EXPECT_EQ(attn::io::read_npy<float>(path("y.npy")).data, old) << "a failed run must not touch the output";
  r = run("sdpa --q q.npy --k k_ok.npy --v v.npy --backend turbo --out y.npy");
  EXPECT_EQ(r.rc, 1);
  EXPECT_TRUE(contains(r.err, "unknown backend 'turbo'")) << r.err;
  r = run("sdpa --q q.npy --k k_ok.npy --v v.npy --out no/such/dir/y.npy");
  EXPECT_EQ(r.rc, 3);
  EXPECT_TRUE(contains(r.err, "no/such/dir/y.npy")) << r.err;
}

// ---- malformed files through the tool: exit code 3 and a message naming the file ----

TEST_F(Cli, MalformedInputFilesExitWithCode3) {
  std::mt19937_64 rng(6);
  write_random<float>("k.npy", {6, 8}, rng);
  write_random<float>("v.npy", {6, 3}, rng);
  auto put = [&](const std::string& f, const std::string& bytes) { std::ofstream(path(f), std::ios::binary) << bytes; };
  const std::string magic("\x93NUMPY\x01\x00", 8);
  auto npy = [&](const std::string& dict, const std::string& data, int len_override = -1) {
    std::string h = dict;
    while ((10 + h.size() + 1) % 16) h += ' ';
    h += '\n';
    const size_t n = len_override >= 0 ? size_t(len_override) : h.size();
    return magic + std::string(1, char(n & 0xff)) + std::string(1, char(n >> 8)) + h + data;
  };
  const std::string data(4 * 32, '\0');
  put("badmagic.npy", "PK\x03\x04 this is a zip file, not an array");
  put("liar.npy", npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 8), }", data, 60000));
  put("overflow.npy", npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4), }", data));
  put("truncated.npy", npy("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 8), }", data.substr(0, 50)));
  put("int.npy", npy("{'descr': '<i8', 'fortran_order': False, 'shape': (4, 4), }", data));
  put("empty.npy", "");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"badmagic.npy", "bad magic"},          {"liar.npy", "runs past the end of the file"},
      {"overflow.npy", "more elements than"}, {"truncated.npy", "truncated"},
      {"int.npy", "unsupported dtype '<i8'"}, {"empty.npy", "not a .npy file"},
      {"missing.npy", "cannot open"}};
  for (const auto& [file, why] : cases) {
    const Result r = run("sdpa --q " + file + " --k k.npy --v v.npy --out y.npy");
    EXPECT_EQ(r.rc, 3) << file << ": " << r.err;
    EXPECT_TRUE(contains(r.err, file) && contains(r.err, why)) << file << ": " << r.err;
  }
  EXPECT_FALSE(fs::exists(path("y.npy")));
  // safetensors: offsets outside the file, lying header length, wrong dtype.
  write_random<float>("x.npy", {3, 4}, rng);
  auto st = [&](const std::string& js, const std::string& payload, uint64_t declared) {
    std::string b(8, '\0');
    for (int i = 0; i < 8; ++i) b[size_t(i)] = char((declared >> (8 * i)) & 0xff);
    return b + js + payload;
  };
  const std::string w = R"({"in_proj_weight":{"dtype":"F32","shape":[12,4],"data_offsets":[0,192]},"out_proj.weight":{"dtype":"F32","shape":[4,4],"data_offsets":[192,99999]}})";
  put("outside.safetensors", st(w, std::string(256, '\0'), w.size()));
  put("liar.safetensors", st(w, std::string(256, '\0'), uint64_t(1) << 40));
  const std::string bf = R"({"in_proj_weight":{"dtype":"BF16","shape":[12,4],"data_offsets":[0,96]}})";
  put("bf16.safetensors", st(bf, std::string(96, '\0'), bf.size()));
  for (const auto& [file, why] : std::vector<std::pair<std::string, std::string>>{
           {"outside.safetensors", "outside the"}, {"liar.safetensors", "header length"},
           {"bf16.safetensors", "unsupported dtype 'BF16'"}}) {
    const Result r = run("mha --weights " + file + " --x x.npy --out y.npy");
    EXPECT_EQ(r.rc, 3) << file << ": " << r.err;
    EXPECT_TRUE(contains(r.err, file) && contains(r.err, why)) << file << ": " << r.err;
  }
}

// ---- mha: PyTorch state_dict names, against a multi-head computation written out ----

struct MhaParams {
  int64_t D, H;
  std::vector<double> win, bin, wout, bout;  // [3D, D], [3D], [D, D], [D]
};

// Y = concat_h(softmax(Q_h K_hᵀ / sqrt(E)) V_h) W_outᵀ + b_out, with Q = X W_qᵀ + b_q etc.
void mha_by_hand(const MhaParams& p, const std::vector<double>& x, int64_t B, int64_t N, bool causal,
                 std::vector<double>& y, std::vector<double>& a) {
  const int64_t D = p.D, H = p.H, E = D / H;
  y.assign(size_t(B * N * D), 0);
  a.assign(size_t(B * H * N * N), 0);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> qkv(size_t(N * 3 * D));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < 3 * D; ++o) {
        double s = p.bin.empty() ? 0 : p.bin[size_t(o)];
        for (int64_t i = 0; i < D; ++i) s += x[size_t((b * N + n) * D + i)] * p.win[size_t(o * D + i)];
        qkv[size_t(n * 3 * D + o)] = s;
      }
    std::vector<double> concat(size_t(N * D), 0);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i) {
        std::vector<double> s(static_cast<size_t>(N));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < N; ++j) {
          double d = 0;
          for (int64_t e = 0; e < E; ++e) d += qkv[size_t(i * 3 * D + h * E + e)] * qkv[size_t(j * 3 * D + D + h * E + e)];
          s[size_t(j)] = (causal && j > i) ? -INFINITY : d / std::sqrt(double(E));
          mx = std::max(mx, s[size_t(j)]);
        }
        for (auto& z : s) sum += (z = std::exp(z - mx));
        for (int64_t j = 0; j < N; ++j) {
          const double w = s[size_t(j)] / sum;
          a[size_t(((b * H + h) * N + i) * N + j)] = w;
          for (int64_t e = 0; e < E; ++e) concat[size_t(i * D + h * E + e)] += w * qkv[size_t(j * 3 * D + 2 * D + h * E + e)];
        }
      }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < D; ++o) {
        double s = p.bout.empty() ? 0 : p.bout[size_t(o)];
        for (int64_t i = 0; i < D; ++i) s += concat[size_t(n * D + i)] * p.wout[size_t(o * D + i)];
        y[size_t((b * N + n) * D + o)] = s;
      }
  }
}

TEST_F(Cli, MhaWithPytorchStateDictAgreesWithAHandWrittenComputation) {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> nd(0, 0.4);
  MhaParams p{8, 2, {}, {}, {}, {}};
  auto fill = [&](std::vector<double>& v, size_t n) {
    v.resize(n);
    for (auto& z : v) z = nd(rng);
  };
  fill(p.win, size_t(3 * p.D * p.D));
  fill(p.bin, size_t(3 * p.D));
  fill(p.wout, size_t(p.D * p.D));
  fill(p.bout, size_t(p.D));
  std::map<std::string, Array<double>> sd;
  sd["in_proj_weight"] = {{3 * p.D, p.D}, p.win, DType::f64};
  sd["in_proj_bias"] = {{3 * p.D}, p.bin, DType::f64};
  sd["out_proj.weight"] = {{p.D, p.D}, p.wout, DType::f64};
  sd["out_proj.bias"] = {{p.D}, p.bout, DType::f64};
  attn::io::write_safetensors(path("w.safetensors"), sd);
  const int64_t B = 2, N = 5;
  const auto x = write_random<double>("x.npy", {B, N, p.D}, rng);
  for (bool causal : {false, true}) {
    const Result r = run(std::string("mha --weights w.safetensors --x x.npy --heads 2 --out y.npy --weights-out a.npy") +
                         (causal ? " --causal" : ""));
    ASSERT_EQ(r.rc, 0) << r.err;
    std::vector<double> y, a;
    mha_by_hand(p, x, B, N, causal, y, a);
    const auto fy = attn::io::read_npy<double>(path("y.npy"));
    const auto fa = attn::io::read_npy<double>(path("a.npy"));
    ASSERT_EQ(fy.shape, (std::vector<int64_t>{B, N, p.D}));
    ASSERT_EQ(fa.shape, (std::vector<int64_t>{B, p.H, N, N}));
    const double tol = attn::testing::tolerance<double>(3 * p.D * N, 4.0);
    for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(fy.data[i], y[i], tol) << "y " << i << " causal " << causal;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(fa.data[i], a[i], tol) << "a " << i << " causal " << causal;
  }
  // Unbatched float32 input, no biases.
  std::map<std::string, Array<float>> sf;
  sf["in_proj_weight"] = {{3 * p.D, p.D}, std::vector<float>(p.win.begin(), p.win.end()), DType::f32};
  sf["out_proj.weight"] = {{p.D, p.D}, std::vector<float>(p.wout.begin(), p.wout.end()), DType::f32};
  attn::io::write_safetensors(path("wf.safetensors"), sf);
  const auto xf = write_random<float>("xf.npy", {N, p.D}, rng);
  const Result r = run("mha --weights wf.safetensors --x xf.npy --heads 4 --out yf.npy");
  ASSERT_EQ(r.rc, 0) << r.err;
  MhaParams pf{p.D, 4, {}, {}, {}, {}};
  pf.win.assign(sf["in_proj_weight"].data.begin(), sf["in_proj_weight"].data.end());
  pf.wout.assign(sf["out_proj.weight"].data.begin(), sf["out_proj.weight"].data.end());
  std::vector<double> y, a;
  mha_by_hand(pf, std::vector<double>(xf.begin(), xf.end()), 1, N, false, y, a);
  const auto fy = attn::io::read_npy<double>(path("yf.npy"));
  EXPECT_EQ(fy.stored, DType::f32);
  ASSERT_EQ(fy.shape, (std::vector<int64_t>{N, p.D}));
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(fy.data[i], y[i], attn::testing::tolerance<float>(3 * p.D * N, 4.0)) << i;
}

TEST_F(Cli, MhaRejectsWrongShapesNamesAndHeads) {
  std::mt19937_64 rng(8);
  write_random<float>("x.npy", {5, 8}, rng);
  auto save = [&](const std::string& f, std::map<std::string, std::vector<int64_t>> shapes) {
    std::map<std::string, Array<float>> sd;
    for (auto& [k, s] : shapes) {
      int64_t n = 1;
      for (auto d : s) n *= d;
      sd[k] = {s, std::vector<float>(static_cast<size_t>(n), 0.1f), DType::f32};
    }
    attn::io::write_safetensors(path(f), sd);
  };
  save("bad_shape.safetensors", {{"in_proj_weight", {24, 6}}, {"out_proj.weight", {8, 8}}});
  save("extra.safetensors", {{"in_proj_weight", {24, 8}}, {"out_proj.weight", {8, 8}}, {"encoder.w", {2}}});
  save("missing.safetensors", {{"in_proj_weight", {24, 8}}});
  save("half_bias.safetensors", {{"in_proj_weight", {24, 8}}, {"out_proj.weight", {8, 8}}, {"in_proj_bias", {24}}});
  save("ok.safetensors", {{"in_proj_weight", {24, 8}}, {"out_proj.weight", {8, 8}}});
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--weights bad_shape.safetensors --x x.npy", "tensor 'in_proj_weight' in bad_shape.safetensors has shape (24, 6)"},
      {"--weights extra.safetensors --x x.npy", "holds tensor 'encoder.w'"},
      {"--weights missing.safetensors --x x.npy", "lacks tensor 'out_proj.weight'"},
      {"--weights half_bias.safetensors --x x.npy", "only one of in_proj_bias and out_proj.bias"},
      {"--weights ok.safetensors --x x.npy --heads 3", "--heads 3 must be >= 1 and divide the model width D = 8"}};
  for (const auto& [args, why] : cases) {
    const Result r = run("mha " + args + " --out y.npy");
    EXPECT_EQ(r.rc, 1) << args << ": " << r.err;
    EXPECT_TRUE(contains(r.err, why)) << args << ": " << r.err;
  }
  EXPECT_EQ(run("mha --weights ok.safetensors --x x.npy --heads 2 --out y.npy").rc, 0);
}

// ---- experiments: conditions any honest run satisfies, for two seeds ---------------

json experiment(const Cli& t, const std::string& name, int seed) {
  const Result r = t.run("experiment " + name + " --json --seed " + std::to_string(seed));
  EXPECT_EQ(r.rc, 0) << r.err;
  return json::parse(r.out);
}

TEST_F(Cli, ExperimentVariance) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "variance", seed);
    ASSERT_EQ(j["rows"].size(), 10u);  // d_k = 1, 2, ..., 512
    for (const auto& row : j["rows"]) {
      const double dk = row[0], sd = row[2], scaled = row[4];
      if (dk >= 4) {
        EXPECT_NEAR(sd / std::sqrt(dk), 1.0, 0.10) << "d_k " << dk << " seed " << seed;
      }
      EXPECT_NEAR(scaled, 1.0, 0.10) << "d_k " << dk << " seed " << seed;
    }
  }
}

TEST_F(Cli, ExperimentSaturation) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "saturation", seed);
    const auto& rows = j["rows"];
    ASSERT_EQ(rows.size(), 5u);  // d_k = 1, 4, 16, 64, 256
    EXPECT_EQ(rows[4][0].get<int>(), 256);
    EXPECT_GT(rows[4][3].get<double>(), 0.99) << "unscaled top weight at d_k = 256";
    EXPECT_LT(rows[4][6].get<double>(), 0.9) << "scaled top weight at d_k = 256";
    EXPECT_GT(rows[4][2].get<double>(), 1000.0) << "unscaled ratio of the top two weights at d_k = 256";
    for (size_t i = 1; i < rows.size(); ++i) {
      EXPECT_GE(rows[i][3].get<double>(), rows[i - 1][3].get<double>()) << "unscaled top weight grows with d_k";
      EXPECT_GT(rows[i][6].get<double>(), 0.3);
      EXPECT_LT(rows[i][6].get<double>(), 0.75) << "scaled weights stay a blend";
    }
    // The unscaled gap grows like sqrt(d_k): 64x the head size, about 8x the gap.
    const double growth = rows[4][1].get<double>() / rows[1][1].get<double>();
    EXPECT_GT(growth, 5.0);
    EXPECT_LT(growth, 13.0);
  }
}

TEST_F(Cli, ExperimentJacobian) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "jacobian", seed);
    const auto& un = j["rows"][0];
    const auto& sc = j["rows"][1];
    EXPECT_EQ(un[0].get<std::string>(), "unscaled");
    EXPECT_GT(un[2].get<double>(), 50.0) << "most unscaled rows are saturated";
    EXPECT_LT(sc[2].get<double>(), 5.0) << "almost no scaled row is saturated";
    EXPECT_GT(sc[3].get<double>(), 20 * un[3].get<double>()) << "median Jacobian norm";
    EXPECT_GT(sc[5].get<double>(), 3 * un[5].get<double>()) << "median gradient per query";
    // Dropping the saturated rows' terms barely changes the unscaled dL/dW_Q.
    EXPECT_NEAR(j["unscaled_grad_wq_share_of_unsaturated_rows"].get<double>(), 1.0, 0.05);
    // A softmax Jacobian's Frobenius norm is at most 1/2 (two equal weights, the rest 0).
    EXPECT_LE(sc[4].get<double>(), 0.5);
    EXPECT_LE(un[4].get<double>(), 0.5);
  }
}

TEST_F(Cli, ExperimentEquivariance) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "equivariance", seed);
    const auto& rows = j["rows"];
    ASSERT_EQ(rows.size(), 3u);
    EXPECT_LT(rows[0][1].get<double>(), 1e-12) << "plain attention is permutation-equivariant";
    EXPECT_GT(rows[1][1].get<double>(), 1e-3) << "a causal mask breaks it";
    EXPECT_GT(rows[2][1].get<double>(), 1e-3) << "positions break it";
  }
}

TEST_F(Cli, ExperimentLookup) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "lookup", seed);
    const auto& rows = j["rows"];
    ASSERT_GE(rows.size(), 6u);
    EXPECT_LT(rows[0][2].get<double>(), 0.5) << "at c = 1 the lookup is a blur";
    for (size_t i = 1; i < rows.size(); ++i) {
      EXPECT_LE(rows[i][3].get<double>(), rows[i - 1][3].get<double>()) << "error shrinks as c grows";
      EXPECT_GE(rows[i][2].get<double>(), rows[i - 1][2].get<double>());
    }
    EXPECT_LT(rows.back()[3].get<double>(), 1e-9) << "large c: an exact lookup";
  }
}

TEST_F(Cli, ExperimentTablesPlotsAndErrors) {
  Result r = run("experiment variance --plot v.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "std(q.k/sqrt(d_k))"));
  const std::string png = slurp(path("v.png"));
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
  for (const char* e : {"saturation", "lookup"}) {
    r = run(std::string("experiment ") + e + " --plot p.png");
    ASSERT_EQ(r.rc, 0) << e << r.err;
    const std::string p = slurp(path("p.png"));
    ASSERT_GT(p.size(), 24u);
    EXPECT_EQ(p.substr(12, 4), "IHDR");
    EXPECT_EQ(p.substr(16, 8), std::string("\0\0\x03\x84\0\0\x02\x58", 8)) << e << ": a 900 x 600 chart";
  }
  EXPECT_EQ(run("experiment jacobian --plot j.png").rc, 2);
  EXPECT_EQ(run("experiment nonsense").rc, 2);
}

// ---- heatmap, bench, tour, help -------------------------------------------------------

TEST_F(Cli, HeatmapWritesAPngOfTheRightSize) {
  std::vector<double> w(2 * 3 * 3, 1.0 / 3);
  attn::io::write_npy(path("a.npy"), {2, 3, 3}, w.data());
  Result r = run("heatmap --weights a.npy --labels 'the cat sat' --out h.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string png = slurp(path("h.png"));
  ASSERT_GT(png.size(), 24u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
  auto be32 = [&](size_t o) {
    return uint32_t(uint8_t(png[o])) << 24 | uint32_t(uint8_t(png[o + 1])) << 16 | uint32_t(uint8_t(png[o + 2])) << 8 |
           uint32_t(uint8_t(png[o + 3]));
  };
  EXPECT_GT(be32(16), 200u);  // IHDR width: two panels side by side
  EXPECT_GT(be32(20), 100u);  // height
  r = run("heatmap --weights a.npy --labels 'too few' --out h2.png");
  EXPECT_EQ(r.rc, 1);
  EXPECT_TRUE(contains(r.err, "--labels has 2 words")) << r.err;
  EXPECT_FALSE(fs::exists(path("h2.png")));
  std::vector<double> w5(5, 0.2);
  attn::io::write_npy(path("a5.npy"), {5}, w5.data());
  EXPECT_EQ(run("heatmap --weights a5.npy --out h3.png").rc, 1);
}

// ---- train and the checkpoint heatmap -------------------------------------------------

// The CSV's rows as (step, loss).
std::vector<std::pair<int64_t, double>> curve_rows(const std::string& csv) {
  std::vector<std::pair<int64_t, double>> rows;
  std::istringstream is(csv);
  std::string line;
  std::getline(is, line);  // header
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string step, lr, loss;
    std::getline(ls, step, ',');
    std::getline(ls, lr, ',');
    std::getline(ls, loss, ',');
    rows.emplace_back(std::stoll(step), std::stod(loss));
  }
  return rows;
}

// The words after `label` on the line that starts with it (e.g. "  input").
std::vector<std::string> words_after(const std::string& text, const std::string& label) {
  std::vector<std::string> w;
  const size_t at = text.find(label);
  if (at == std::string::npos) return w;
  std::istringstream ls(text.substr(at + label.size(), text.find('\n', at) - at - label.size()));
  for (std::string x; ls >> x && x[0] != '(';) w.push_back(x);
  return w;
}

TEST_F(Cli, TrainSavesResumesAndDrawsTheCheckpointsAttention) {
  const std::string cfg =
      "train --task reverse --length 3 --symbols 4 --layers 2 --dim 8 --heads 2 --batch 4 --warmup 2 --eval-examples 8 "
      "--log-every 1 --seed 5 --steps 6";
  // Three steps of six, checkpointed; then the other three from the checkpoint.
  Result r = run(cfg + " --stop-at 3 --save c.safetensors --csv a.csv --png a.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "step      3/3")) << r.out;
  EXPECT_TRUE(contains(r.out, "steps 0..3")) << r.out;
  EXPECT_TRUE(contains(r.out, "held-out (8 examples)")) << r.out;
  EXPECT_FALSE(contains(r.out, "\r")) << "no progress bar when stdout is not a terminal";
  const auto first = curve_rows(slurp(path("a.csv")));
  ASSERT_EQ(first.size(), 3u);
  EXPECT_EQ(first[0].first, 0);
  EXPECT_EQ(first[2].first, 2);
  for (const auto& [step, loss] : first) EXPECT_TRUE(std::isfinite(loss) && loss > 0) << step;
  EXPECT_EQ(slurp(path("a.png")).substr(1, 3), "PNG");
  ASSERT_TRUE(fs::exists(path("c.safetensors")));

  r = run(cfg + " --resume c.safetensors --csv b.csv");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "steps 3..6")) << r.out;
  const auto resumed = curve_rows(slurp(path("b.csv")));
  ASSERT_EQ(resumed.size(), 3u);
  // An uninterrupted run of the same flags gives the same losses at steps 3..5.
  r = run(cfg + " --csv full.csv");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto full = curve_rows(slurp(path("full.csv")));
  ASSERT_EQ(full.size(), 6u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed[i].first, full[3 + i].first);
    EXPECT_NEAR(resumed[i].second, full[3 + i].second, 1e-6 * full[3 + i].second) << "step " << full[3 + i].first;
    EXPECT_NEAR(first[i].second, full[i].second, 1e-6 * full[i].second) << "step " << i;
  }

  // The checkpoint's attention on example 2: 2 layers x 2 heads of 7 x 7.
  r = run("heatmap --checkpoint c.safetensors --task reverse --example 2 --out h.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "reverse example 2")) << r.out;
  EXPECT_TRUE(contains(r.err, "2 layer(s) x 2 head(s) of 7 x 7")) << r.err;
  const auto in = words_after(r.out, "input"), want = words_after(r.out, "target"),
             got = words_after(r.out, "predicted");
  ASSERT_EQ(in.size(), 7u) << r.out;  // x1 x2 x3 : _ _ _
  EXPECT_EQ(in[3], ":");
  ASSERT_EQ(want.size(), 3u) << r.out;
  EXPECT_EQ(got.size(), 3u) << r.out;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(want[i], in[2 - i]) << "the target of reverse is the input backwards";
    EXPECT_EQ(in[4 + i], "_");
  }
  const std::string png = slurp(path("h.png"));
  ASSERT_GT(png.size(), 24u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
  auto be32 = [&](size_t o) {
    return uint32_t(uint8_t(png[o])) << 24 | uint32_t(uint8_t(png[o + 1])) << 16 | uint32_t(uint8_t(png[o + 2])) << 8 |
           uint32_t(uint8_t(png[o + 3]));
  };
  const uint32_t w = be32(16), h = be32(20);
  // Default task and a different example: same model, a different picture.
  r = run("heatmap --checkpoint c.safetensors --example 0 --out h0.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(slurp(path("h0.png")), png);
  // Two rows of panels (one per layer) are taller than a one-layer picture.
  r = run("train --task reverse --length 3 --symbols 4 --layers 1 --dim 8 --heads 2 --batch 2 --steps 1 "
          "--eval-examples 2 --save one.safetensors");
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("heatmap --checkpoint one.safetensors --example 2 --out h1.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string png1 = slurp(path("h1.png"));
  ASSERT_GT(png1.size(), 24u);
  EXPECT_EQ(png1.substr(16, 4), png.substr(16, 4)) << "same width: two heads side by side";
  const uint32_t h1 = uint32_t(uint8_t(png1[20])) << 24 | uint32_t(uint8_t(png1[21])) << 16 |
                      uint32_t(uint8_t(png1[22])) << 8 | uint32_t(uint8_t(png1[23]));
  EXPECT_GT(h, h1);
  EXPECT_GT(w, 200u);
}

// recall defaults to one query and a curriculum from 3 pairs; the flags override both.
TEST_F(Cli, TrainRecallDefaultsToSingleQueryWithACurriculum) {
  const std::string cfg =
      "train --task recall --length 5 --symbols 6 --layers 1 --dim 8 --heads 2 --batch 4 --eval-examples 8 "
      "--log-every 1 --stop-at 2";
  Result r = run(cfg + " --save d.safetensors");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "len 3")) << r.out;
  r = run("heatmap --checkpoint d.safetensors --example 0 --out d.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_EQ(words_after(r.out, "input").size(), 12u) << r.out;  // k v x 5, ':', one query
  EXPECT_EQ(words_after(r.out, "target").size(), 1u) << r.out;
  r = run(cfg + " --queries 0 --curriculum 0 --save m.safetensors");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_FALSE(contains(r.out, "len ")) << r.out;
  r = run("heatmap --checkpoint m.safetensors --example 0 --out m.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_EQ(words_after(r.out, "target").size(), 5u) << r.out;  // every key asked
}

TEST_F(Cli, TrainAndCheckpointHeatmapErrors) {
  Result r = run("train --task reverses --steps 1");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(contains(r.err, "--task")) << r.err;
  EXPECT_TRUE(contains(r.err, "reverses")) << r.err;
  r = run("train --positions spiral --steps 1");
  EXPECT_EQ(r.rc, 2);
  r = run("train --steps 1 --resume missing.safetensors");
  EXPECT_EQ(r.rc, 3);
  EXPECT_TRUE(contains(r.err, "--resume 'missing.safetensors': no such file")) << r.err;
  r = run("train --steps 1 --dim 8 --heads 3");
  EXPECT_EQ(r.rc, 1);
  EXPECT_TRUE(contains(r.err, "heads")) << r.err;
  r = run("heatmap --checkpoint missing.safetensors --out h.png");
  EXPECT_EQ(r.rc, 3);
  EXPECT_TRUE(contains(r.err, "--checkpoint 'missing.safetensors'")) << r.err;
  EXPECT_FALSE(fs::exists(path("h.png")));
  std::ofstream(path("junk.safetensors")) << "not a checkpoint";
  r = run("heatmap --checkpoint junk.safetensors --out h.png");
  EXPECT_EQ(r.rc, 3);  // not a safetensors file: a file error
  EXPECT_TRUE(contains(r.err, "junk.safetensors")) << r.err;
  EXPECT_EQ(run("heatmap --out h.png").rc, 2);
  EXPECT_EQ(run("heatmap --weights a.npy --checkpoint c.safetensors --out h.png").rc, 2);
  // a source's options are refused with the other source instead of being ignored
  r = run("heatmap --checkpoint c.safetensors --labels 'a b' --out h.png");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--labels"), std::string::npos) << r.err;
  EXPECT_EQ(run("heatmap --checkpoint c.safetensors --batch 1 --out h.png").rc, 2);
  r = run("heatmap --weights a.npy --example 3 --out h.png");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--example"), std::string::npos) << r.err;
  EXPECT_EQ(run("heatmap --weights a.npy --task reverse --out h.png").rc, 2);
}

TEST_F(Cli, BenchRunsAttnBenchOrSaysItIsMissing) {
  const fs::path bench = fs::path(kCli).parent_path().parent_path() / "bench" / "attn-bench";
  if (fs::exists(bench)) {
    // Built: `attn bench` hands its arguments to attn-bench.
    const Result h = run("bench --help");
    EXPECT_EQ(h.rc, 0) << h.err;
    EXPECT_TRUE(contains(h.out, "attn-bench: validate, then time")) << h.out;
    return;
  }
  const Result r = run("bench");
  EXPECT_EQ(r.rc, 4);
  EXPECT_TRUE(contains(r.err, "attn-bench is not built")) << r.err;
}

TEST_F(Cli, TourRunsEndToEnd) {
  const Result r = run("tour --quick --heatmap tour.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  for (const char* part : {"1. Attention by hand", "weights 0.038 0.757 0.102 0.102", "2. The seeds' claims, measured",
                           "[variance]", "[saturation]", "[jacobian]", "[equivariance]", "[lookup]",
                           "3. Multi-head attention on a sentence", "4. Speed", "reference", "Tour finished"})
    EXPECT_TRUE(contains(r.out, part)) << part;
  EXPECT_EQ(slurp(path("tour.png")).substr(1, 3), "PNG");
  EXPECT_FALSE(contains(r.out, "\r")) << "no progress bar when stdout is not a terminal";
}

TEST_F(Cli, HelpDocumentsExitCodesAndUsageErrorsExit2) {
  Result r = run("--help");
  EXPECT_EQ(r.rc, 0);
  EXPECT_TRUE(contains(r.out, "Exit codes: 0 success; 1 invalid input")) << r.out;
  for (const char* sub : {"sdpa", "mha", "explain", "experiment", "heatmap", "train", "tour"}) {
    r = run(std::string(sub) + " --help");
    EXPECT_EQ(r.rc, 0) << sub;
    EXPECT_TRUE(contains(r.out, "Exit codes")) << sub;
  }
  EXPECT_EQ(run("").rc, 2);
  EXPECT_EQ(run("frobnicate").rc, 2);
  EXPECT_EQ(run("sdpa --q only.npy").rc, 2);
  EXPECT_EQ(run("explain --example dog").rc, 2);
}

}  // namespace
