// The public boundary as a hostile caller sees it: the error kinds, views
// whose sizes overflow, views with a shape but no data, outputs that share
// memory, thread counts out of range, null data given to a writer. Each test
// names the defect of issue 11 it pins (11.5, 11.6, 11.14, 11.15).
#include <omp.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <vector>

#include "attn/io.hpp"
#include "attn/multihead.hpp"
#include "kernels/problem.hpp"
#include "sdpa_case.hpp"
#include "validate.hpp"

namespace {

using namespace attn::testing;
using attn::InvalidArgument;
using attn::Tensor;
using attn::View3;
using attn::View4;

constexpr int64_t kHuge = int64_t(1) << 40;

struct Boundary : ::testing::Test {
  std::mt19937_64 rng{7};
  SdpaCase<float> c{{2, 4, 2, 3, 5, 8, 6}, rng};  // B=2 H=4 Hkv=2 L=3 S=5 E=8 Ev=6
  Tensor<float> y{2, 4, 3, 6}, lse{2, 4, 3};
  Tensor<float> dout{2, 4, 3, 6}, dq{2, 4, 3, 8}, dk{2, 2, 5, 8}, dv{2, 2, 5, 6};
  void forward(attn::SdpaOutputs<float> o) { attn::scaled_dot_product_attention<float>(c.args, o, c.opt); }
  void backward(attn::SdpaGrads<float> g) {
    attn::scaled_dot_product_attention_backward<float>(c.args, dout.view4(), {}, g, c.opt);
  }
  attn::SdpaGrads<float> grads() { return {dq.view4(), dk.view4(), dv.view4()}; }
};

// ---- error kinds ----------------------------------------------------------

TEST(ErrorKinds, ArgumentAndFileErrorsAreSiblings) {
  std::mt19937_64 rng(1);
  SdpaCase<float> c({1, 1, 1, 2, 2, 2, 2}, rng);
  c.args.v = {};
  EXPECT_THROW(attn::scaled_dot_product_attention<float>(c.args, {c.out()}), InvalidArgument);
  try {
    attn::io::read_npy<float>("/nonexistent-attn-dir/q.npy");
    ADD_FAILURE() << "did not throw";
  } catch (const InvalidArgument&) {
    ADD_FAILURE() << "a missing file is not an invalid argument";
  } catch (const attn::FileError& e) {
    EXPECT_TRUE(e.not_found());
    EXPECT_EQ(e.error_code(), ENOENT);
    EXPECT_EQ(e.path(), "/nonexistent-attn-dir/q.npy");
    EXPECT_NE(std::string(e.what()).find("/nonexistent-attn-dir/q.npy: cannot open"), std::string::npos);
  }
  // A malformed file is a file error too, but not "not found".
  try {
    const unsigned char junk[12] = {'n', 'o', 't', ' ', 'a', 'n', 'p', 'y', 0, 0, 0, 0};
    attn::io::parse_npy<float>(junk, sizeof junk, "junk.npy");
    ADD_FAILURE() << "did not throw";
  } catch (const attn::FileError& e) {
    EXPECT_FALSE(e.not_found());
    EXPECT_EQ(e.error_code(), 0);
  }
}

// A Checker's verdict is the first failure's message, or "" (attn::dist
// collects it on every rank before any rank throws).
TEST(ErrorKinds, VerdictKeepsTheFirstFailure) {
  const attn::detail::Checker c{"f"};
  EXPECT_EQ(c.verdict([] {}), "");
  EXPECT_EQ(c.verdict([&] {
              c.fail("first");
              c.fail("second");
            }),
            "attn::f: first");
  EXPECT_EQ(c.verdict([&] { (void)c.threads(-1); }),
            "attn::f: option 'num_threads' is -1, expected 0 (the default) to " + std::to_string(attn::kMaxThreads));
}

// ---- 11.15: writers refuse null data ------------------------------------------

TEST(Writers, NullDataWithElementsIsAnArgumentError) {
  const auto dir = std::filesystem::temp_directory_path() / ("attn_boundary_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "x.npy").string();
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { attn::io::write_npy<float>(path, {2, 3}, nullptr); },
                                           {"attn::io::write_npy", "'data' is a null pointer", "(2, 3)", "6 elements"}));
  EXPECT_FALSE(std::filesystem::exists(path));
  // No elements: nothing to read, so null is fine.
  EXPECT_NO_THROW(attn::io::write_npy<float>(path, {0, 3}, nullptr));
  EXPECT_EQ(attn::io::read_npy<float>(path).shape, (std::vector<int64_t>{0, 3}));
  // A shape whose element count overflows.
  const float one = 1;
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { attn::io::write_npy<float>(path, {kHuge, kHuge}, &one); },
                                           {"attn::io::write_npy", "too large"}));
  attn::io::Array<float> a;
  a.shape = {2, 2};
  a.data = {1, 2, 3};
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { attn::io::write_npy(path, a); }, {"(2, 2)", "3 elements"}));
  std::filesystem::remove_all(dir);
}

// ---- 11.6: sizes never overflow --------------------------------------------------

// The overflow check's max |x| (validate.hpp): NaN left out, ±∞ counted, the
// same on rows of adjacent float32 or bfloat16 (SIMD, whole vectors and a tail) and
// strided rows, for one thread or two (the view is large enough to be
// split); against a plain loop.
TEST(Sizes, MaxAbsLeavesNaNOutOnEveryLayout) {
  std::vector<float> x(size_t(2 * 3 * 150 * 74));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i * 7919 % 1000) - 500) * 0.01f;
  for (const float special : {0.0f, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()})
    for (const size_t at : {size_t(3), x.size() - 1, size_t(74 * 7 + 40)}) {
      std::vector<float> y = x;
      y[at] = special == 0.0f ? -123.5f : special;
      float want = 0;
      for (float v : y) want = std::fabs(v) > want ? std::fabs(v) : want;
      const View4<const float> rows(y.data(), {2, 3, 150, 74}, {3 * 150 * 74, 150 * 74, 74, 1});
      const View4<const float> strided(y.data(), {2, 3, 150, 37}, {3 * 150 * 74, 150 * 74, 74, 2});
      float want_strided = 0;
      for (size_t i = 0; i < y.size(); i += 2)
        if (std::fabs(y[i]) > want_strided) want_strided = std::fabs(y[i]);  // (NaN: not greater)
      std::vector<attn::bfloat16_t> yb(y.size());  // the same as bfloat16 (the high halves)
      float want_b = 0;
      for (size_t i = 0; i < y.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, &y[i], 4);
        yb[i].bits = uint16_t(u >> 16);
        if (std::fabs(float(yb[i])) > want_b) want_b = std::fabs(float(yb[i]));
      }
      const View4<const attn::bfloat16_t> rows_b(yb.data(), {2, 3, 150, 74}, {3 * 150 * 74, 150 * 74, 74, 1});
      for (const int threads : {1, 2}) {
        EXPECT_EQ(attn::detail::max_abs(rows, threads), want) << special << " at " << at;
        EXPECT_EQ(attn::detail::max_abs(strided, threads), want_strided) << special << " at " << at;
        EXPECT_EQ(attn::detail::max_abs(rows_b, threads), want_b) << special << " at " << at;
      }
    }
}

TEST(Sizes, ViewAndTensorCountsAreChecked) {
  const View4<const float> v(nullptr, {kHuge, kHuge, 1, 1}, {0, 0, 0, 0});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { (void)v.numel(); }, {"attn::View::numel", "(1099511627776, "}));
  EXPECT_TRUE(throws_with<InvalidArgument>([] { Tensor<float> t({kHuge, kHuge}); }, {"attn::Tensor", "too large"}));
  EXPECT_TRUE(throws_with<InvalidArgument>([] { Tensor<float> t({int64_t(1) << 61}); }, {"too large"}));
  EXPECT_EQ(View4<const float>(nullptr, {kHuge, kHuge, 0, 1}).numel(), 0);  // empty, whatever the other axes
  EXPECT_EQ(Tensor<float>({kHuge, kHuge, 0}).size(), 0u);
}

TEST_F(Boundary, HugeBroadcastInputsAreRefusedNotRun) {
  // One float per row, broadcast by stride 0 to 2^80 elements.
  std::vector<float> one(8, 1.0f);
  c.args.q = View4<const float>(one.data(), {kHuge, kHuge, 1, 8}, {0, 0, 0, 1});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({y.view4()}); },
                                           {"attn::scaled_dot_product_attention", "'q'", "too large"}));
  c.args.q = View4<const float>(c.qbuf.data(), {2, 4, 3, 8});
  // Strides whose extent overflows, on an output.
  View4<float> far(y.data(), {2, 4, 3, 6}, {int64_t(1) << 62, 1, 1, 1});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({far}); }, {"'out'", "does not fit in 64 bits"}));
  View4<float> negative(y.data(), {2, 4, 3, 6}, {72, 18, 6, -1});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({negative}); }, {"'out'", "stride -1", ">= 0"}));
}

// ---- 11.14: a shape without data is an error, never "absent" -----------------------

TEST_F(Boundary, ShapeWithoutDataIsAnError) {
  c.args.mask = View4<const bool>(nullptr, {2, 4, 3, 5});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({y.view4()}); },
                                           {"'mask' has shape (2, 4, 3, 5) but no data"}));
  c.args.mask = {};
  c.args.bias = View4<const float>(nullptr, {1, 1, 3, 5});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({y.view4()}); }, {"'bias'", "no data"}));
  c.args.bias = {};
  c.args.key_lengths = attn::View1<const int64_t>(nullptr, {2});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({y.view4()}); }, {"'key_lengths'", "no data"}));
  c.args.key_lengths = {};
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({y.view4(), View4<float>(nullptr, {2, 4, 3, 5})}); },
                                           {"'weights'", "no data"}));
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({y.view4(), {}, View3<float>(nullptr, {2, 4, 3})}); },
                                           {"'lse'", "no data"}));
  EXPECT_NO_THROW(forward({y.view4()}));  // default-constructed views are absent
}

// ---- 11.14: outputs never share memory ------------------------------------------

TEST_F(Boundary, OutputsOverlappingEachOtherOrAnInputAreRefused) {
  // out written over q's buffer.
  View4<float> over_q(c.qbuf.data(), {2, 4, 3, 6}, {72, 18, 6, 1});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({over_q}); }, {"output 'out' overlaps input 'q'"}));
  // lse inside out.
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({y.view4(), {}, View3<float>(y.data() + 5, {2, 4, 3})}); },
                                           {"'out'", "overlaps output 'lse'"}));
  // An output whose own strides overlap (distinct indices, one address).
  View4<float> self_overlap(y.data(), {2, 4, 3, 6}, {1, 1, 1, 1});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({self_overlap}); }, {"'out'", "overlapping strides"}));
  // Backward: dq aliasing q, dk aliasing dv, dq over the saved out.
  auto g = grads();
  g.dq = View4<float>(c.qbuf.data(), {2, 4, 3, 8});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { backward(g); },
                                           {"attn::scaled_dot_product_attention_backward", "'dq' overlaps input 'q'"}));
  g = grads();
  g.dv = View4<float>(dk.data(), {2, 2, 5, 6});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { backward(g); }, {"'dk' overlaps output 'dv'"}));
  g = grads();
  const View4<const float> saved_out(dq.data() + 1, {2, 4, 3, 6});
  EXPECT_TRUE(throws_with<InvalidArgument>(
      [&] { attn::scaled_dot_product_attention_backward<float>(c.args, dout.view4(), {saved_out}, g, c.opt); },
      {"'dq' overlaps input 'out'"}));
}

// Interleaved but disjoint outputs are fine: dq, dk, dv as column blocks of
// one packed (B, N, 3, H, E) buffer, the layout of a fused QKV projection.
TEST(Overlap, PackedInterleavedGradientsAreAcceptedAndExact) {
  std::mt19937_64 rng(3);
  const int64_t B = 2, H = 3, N = 5, E = 4;
  SdpaCase<double> c({B, H, H, N, N, E, E}, rng);
  const Tensor<double> dout = random_tensor<double>({B, H, N, E}, rng);
  const auto want = c.backward(dout, false);
  Tensor<double> packed({B, N, 3 * H * E});
  auto block = [&](int t) { return View4<double>::bnhd(packed.data() + t * H * E, B, N, H, E); };
  View4<double> dq = block(0), dk = block(1), dv = block(2);
  for (auto* v : {&dq, &dk, &dv}) v->strides = {N * 3 * H * E, E, 3 * H * E, 1};
  attn::scaled_dot_product_attention_backward<double>(c.args, dout.view4(), {}, {dq, dk, dv}, c.opt);
  double worst = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t e = 0; e < E; ++e) {
          worst = std::max(worst, std::abs(dq(b, h, n, e) - want.dq.view4()(b, h, n, e)));
          worst = std::max(worst, std::abs(dk(b, h, n, e) - want.dk.view4()(b, h, n, e)));
          worst = std::max(worst, std::abs(dv(b, h, n, e) - want.dv.view4()(b, h, n, e)));
        }
  EXPECT_EQ(worst, 0.0);
  // Shifted by one element the blocks meet: refused.
  View4<double> dk_shifted(dk.data - 1, dk.shape, dk.strides);
  EXPECT_TRUE(throws_with<InvalidArgument>(
      [&] { attn::scaled_dot_product_attention_backward<double>(c.args, dout.view4(), {}, {dq, dk_shifted, dv}, c.opt); },
      {"'dq' overlaps output 'dk'"}));
}

// ---- 11.5: thread counts ------------------------------------------------------------

TEST_F(Boundary, ThreadCountsOutOfRangeAreArgumentErrors) {
  for (int t : {-1, attn::kMaxThreads + 1, 100000}) {
    c.opt.num_threads = t;
    EXPECT_TRUE(throws_with<InvalidArgument>([&] { forward({y.view4()}); },
                                             {"option 'num_threads' is " + std::to_string(t), "0 (the default) to 1024"}));
  }
  // Large accepted values are clamped to 4 x the processors, and the result
  // does not depend on the count.
  c.opt.backend = attn::Backend::fused;
  c.opt.num_threads = 1;
  forward({y.view4()});
  const Tensor<float> y1 = y;
  c.opt.num_threads = attn::kMaxThreads;
  EXPECT_EQ(attn::detail::make_problem(c.args, c.opt).threads, std::min(attn::kMaxThreads, 4 * omp_get_num_procs()));
  forward({y.view4()});
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], y1[i]) << i;
}

TEST_F(Boundary, MakeProblemResolvesDefaults) {
  c.opt = {};
  const auto p = attn::detail::make_problem(c.args, c.opt);
  EXPECT_EQ(p.B, 2);
  EXPECT_EQ(p.H, 4);
  EXPECT_EQ(p.Hkv, 2);
  EXPECT_EQ(p.L, 3);
  EXPECT_EQ(p.S, 5);
  EXPECT_EQ(p.E, 8);
  EXPECT_EQ(p.Ev, 6);
  EXPECT_DOUBLE_EQ(p.rules.scale, 1.0 / std::sqrt(8.0));
  EXPECT_EQ(p.threads, omp_get_max_threads());
  c.opt.scale = 0.5;
  c.opt.causal = true;
  c.opt.causal_align = attn::CausalAlign::bottom_right;
  c.opt.num_threads = 1;
  const auto q = attn::detail::make_problem(c.args, c.opt);
  EXPECT_EQ(q.rules.scale, 0.5);
  EXPECT_TRUE(q.rules.causal);
  EXPECT_EQ(q.rules.offset, std::vector<int64_t>(2, 5 - 3));  // bottom-right: S - L
  EXPECT_EQ(q.threads, 1);
}

// ---- the one softmax ---------------------------------------------------------------

TEST(Softmax, NaNPoisonsTheRowAndArgumentsAreChecked) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  double y[3];
  const double masked_nan[3] = {-inf, nan, -inf};  // not a fully masked row
  EXPECT_TRUE(std::isnan(attn::softmax(masked_nan, y, 3)));
  EXPECT_EQ(y[0], 0.0);  // masked entries stay 0, the visible one is poisoned
  EXPECT_TRUE(std::isnan(y[1]));
  EXPECT_EQ(y[2], 0.0);
  const double plus_inf[3] = {0, inf, 1};
  EXPECT_TRUE(std::isnan(attn::softmax(plus_inf, y, 3)));
  EXPECT_TRUE(std::isinf(attn::softmax<double>(nullptr, nullptr, 0)));
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { attn::softmax<double>(nullptr, y, 2); }, {"attn::softmax", "null"}));
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { attn::softmax<double>(y, y, -1); }, {"'n' is -1"}));
}

// ---- the multi-head layer shares the boundary ------------------------------------------

TEST(LayerBoundary, MasksWithoutDataAndAliasedOutputsAreRefused) {
  attn::MultiheadConfig cfg;
  cfg.embed_dim = 4;
  cfg.num_heads = 2;
  attn::MultiheadAttention<float> m(cfg, 1);
  std::mt19937_64 rng(5);
  Tensor<float> x = random_tensor<float>({2, 3, 4}, rng), y({2, 3, 4});
  const char* fn = "attn::MultiheadAttention::forward";
  // Self-attention: key and value left empty.
  auto self = [&] {
    attn::MhaArgs<float> a;
    a.query = x.view<3>();
    return a;
  };
  attn::MhaArgs<float> a = self();
  a.mask = View4<const bool>(nullptr, {1, 1, 3, 3});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { m.forward(a, {y.view<3>()}); },
                                           {fn, "'mask' has shape (1, 1, 3, 3) but no data"}));
  a = self();
  a.key_padding_mask = attn::View2<const bool>(nullptr, {2, 3});
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { m.forward(a, {y.view<3>()}); },
                                           {fn, "'key_padding_mask'", "no data"}));
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { m.forward(self(), {x.view<3>()}); },
                                           {fn, "output 'out' overlaps input 'query'"}));
  attn::MhaSaved<float> cache;
  m.forward(self(), {y.view<3>()}, {}, &cache);
  Tensor<float> dy = random_tensor<float>({2, 3, 4}, rng);
  attn::MhaGrads<float> g;
  g.dquery = dy.view<3>();
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { m.backward(cache, dy.view<3>(), g); },
                                           {"attn::MultiheadAttention::backward", "'dquery' overlaps input 'dout'"}));
  attn::MhaOptions opt;
  opt.sdpa.num_threads = 100000;
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { m.forward(self(), {y.view<3>()}, opt); },
                                           {fn, "'num_threads' is 100000"}));
}

}  // namespace
