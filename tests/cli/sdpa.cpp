// `attn sdpa`: .npy files in and out, against the library and against a
// plain computation written out here.
#include "cli_test.hpp"

#include <cmath>
#include <filesystem>
#include <random>
#include <vector>

#include "attn/attn.hpp"
#include "testing.hpp"

namespace attn_cli_test {
namespace {

using attn::io::DType;

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

// NaN in an input reaches the rows it touches (exit 0, NaN in the file);
// --check-finite refuses it instead (exit 1, naming the argument), writing nothing.
TEST_F(Cli, SdpaNanPropagatesAndCheckFiniteRefusesIt) {
  std::mt19937_64 rng(5);
  const int64_t L = 3, S = 4, E = 2, Ev = 2;
  auto q = write_random<float>("q.npy", {L, E}, rng);
  write_random<float>("k.npy", {S, E}, rng);
  write_random<float>("v.npy", {S, Ev}, rng);
  q[size_t(1 * E)] = std::nanf("");  // query row 1
  attn::io::write_npy(path("q.npy"), {L, E}, q.data());
  const Result r = run("sdpa --q q.npy --k k.npy --v v.npy --out y.npy");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto fy = attn::io::read_npy<double>(path("y.npy"));
  for (int64_t i = 0; i < L; ++i)
    for (int64_t e = 0; e < Ev; ++e) EXPECT_EQ(std::isnan(fy.data[size_t(i * Ev + e)]), i == 1) << i << "," << e;
  const Result c = run("sdpa --q q.npy --k k.npy --v v.npy --out z.npy --check-finite");
  EXPECT_EQ(c.rc, 1) << c.err;
  EXPECT_NE(c.err.find("'q' contains NaN"), std::string::npos) << c.err;
  EXPECT_FALSE(std::filesystem::exists(path("z.npy")));
}

// --compute bf16: the library's call with compute_dtype bfloat16, bit for
// bit; float64 files are refused with the option's name.
TEST_F(Cli, SdpaComputeBf16IsTheLibrarysBfloat16Products) {
  std::mt19937_64 rng(6);
  const int64_t H = 2, L = 40, S = 50, E = 16, Ev = 8;
  const auto [q, k, v] = write_qkv<float>(H, L, S, E, Ev, rng);
  const Result r = run("sdpa --q q.npy --k k.npy --v v.npy --causal --compute bf16 --out y.npy");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("bfloat16 products"), std::string::npos) << r.err;
  attn::SdpaArgs<float> args;
  args.q = attn::View4<const float>::bhnd(q.data(), 1, H, L, E);
  args.k = attn::View4<const float>::bhnd(k.data(), 1, H, S, E);
  args.v = attn::View4<const float>::bhnd(v.data(), 1, H, S, Ev);
  attn::SdpaOptions opt;
  opt.causal = true;
  opt.compute_dtype = attn::Dtype::bfloat16;
  attn::Tensor<float> y({1, H, L, Ev});
  attn::scaled_dot_product_attention<float>(args, {y.view4()}, opt);
  const auto fy = attn::io::read_npy<float>(path("y.npy"));
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(fy.data[i], y[i]) << i;
  write_random<double>("q64.npy", {L, E}, rng);
  write_random<double>("k64.npy", {S, E}, rng);
  write_random<double>("v64.npy", {S, Ev}, rng);
  const Result d = run("sdpa --q q64.npy --k k64.npy --v v64.npy --compute bfloat16 --out z.npy");
  EXPECT_EQ(d.rc, 1) << d.err;
  EXPECT_NE(d.err.find("option 'compute_dtype' is bfloat16"), std::string::npos) << d.err;
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

// The variant flags reach the library's options and arguments.
TEST_F(Cli, SdpaVariantFlagsAgreeWithTheLibrary) {
  std::mt19937_64 rng(13);
  const int64_t H = 2, L = 6, S = 9, E = 3, Ev = 2;
  const auto [q, k, v] = write_qkv<double>(H, L, S, E, Ev, rng);
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
  // --chunk-size: the library's chunk rule, bit for bit.
  ASSERT_EQ(run("sdpa --q q.npy --k k.npy --v v.npy --causal --chunk-size 4 --out y.npy").rc, 0);
  attn::SdpaOptions chunked;
  chunked.causal = true;
  chunked.chunk_size = 4;
  args.alibi_slopes = {}, args.sinks = {};
  attn::scaled_dot_product_attention<double>(args, {y.view4()}, chunked);
  const auto fc = attn::io::read_npy<double>(path("y.npy"));
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(fc.data[i], y[i]) << i;
  EXPECT_EQ(run("sdpa --q q.npy --k k.npy --v v.npy --chunk-size -1 --out y.npy").rc, 2);
}

// float16 q, k, v files take the library's half call: float32 outputs equal to
// the float32 run on the exact (widened) values, bit for bit.
TEST_F(Cli, SdpaReadsFloat16Files) {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd;
  // Writes a (H, N, F) float16 .npy ('<f2') and a float32 one of the same values.
  auto write_pair = [&](const std::string& name, int64_t H, int64_t N, int64_t F) {
    std::vector<float> exact;
    std::string data;
    for (int64_t i = 0; i < H * N * F; ++i) {
      const attn::float16_t h(nd(rng));
      exact.push_back(float(h));
      data += char(h.bits & 0xFF);
      data += char(h.bits >> 8);
    }
    std::string header = "{'descr': '<f2', 'fortran_order': False, 'shape': (" + std::to_string(H) + ", " +
                         std::to_string(N) + ", " + std::to_string(F) + "), }";
    while ((10 + header.size() + 1) % 64) header += ' ';
    header += '\n';
    put(name + "16.npy", std::string("\x93NUMPY\x01\x00", 8) + char(header.size()) + char(0) + header + data);
    attn::io::write_npy(path(name + "32.npy"), {H, N, F}, exact.data());
  };
  for (int64_t L : {3, 40}) {  // the decode route and the widened one
    write_pair("q", 2, L, 8);
    write_pair("k", 2, 50, 8);
    write_pair("v", 2, 50, 6);
    const Result h = run("sdpa --q q16.npy --k k16.npy --v v16.npy --causal --out y16.npy --lse l16.npy");
    ASSERT_EQ(h.rc, 0) << h.err;
    EXPECT_TRUE(contains(h.err, "float16")) << h.err;
    ASSERT_EQ(run("sdpa --q q32.npy --k k32.npy --v v32.npy --causal --out y32.npy --lse l32.npy").rc, 0);
    const auto y16 = attn::io::read_npy<float>(path("y16.npy")), y32 = attn::io::read_npy<float>(path("y32.npy"));
    EXPECT_EQ(y16.stored, DType::f32);
    EXPECT_EQ(y16.shape, (std::vector<int64_t>{2, L, 6}));
    EXPECT_EQ(y16.data, y32.data);
    EXPECT_EQ(attn::io::read_npy<float>(path("l16.npy")).data, attn::io::read_npy<float>(path("l32.npy")).data);
  }
}

}  // namespace
}  // namespace attn_cli_test
