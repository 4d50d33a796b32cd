// The fused backend against the reference backend, forward and backward, on
// randomly sampled awkward cases (lengths that are no multiple of any tile,
// odd head sizes, GQA, layouts and strides, causal both ways, masks with
// fully masked rows, several tile sizes and thread counts); bitwise
// determinism across thread counts; huge scores; the vectorised exp.
//
// The sweep samples the cross-product rather than enumerating it. Without
// optimisation (the sanitizer Debug build) the reference is slow, so the
// sweep is smaller there (fewer cases, smaller work budget per case).
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>

#include <hwy/targets.h>

#include "kernels/fused/fused.hpp"
#include "testing.hpp"

namespace {

using attn::Backend;
using attn::CausalAlign;
using attn::View1;
using attn::View3;
using attn::View4;
using attn::detail::FusedTiles;
using attn::detail::Problem;
using attn::testing::max_abs;
using attn::testing::tolerance;

#ifdef __OPTIMIZE__
constexpr int kCases = 70;
constexpr double kWorkBudget = 3e7;  // L·S·max(E, Ev)·B·H per case
constexpr int64_t kWideE = 256;      // head size of the long corner case
#else
constexpr int kCases = 16;
constexpr double kWorkBudget = 2e6;
constexpr int64_t kWideE = 16;
#endif

// A (B, H, N, F) buffer in one of three physical layouts.
enum class Layout { bhnd, bnhd, strided };
const char* layout_name(Layout l) {
  return l == Layout::bhnd ? "bhnd" : l == Layout::bnhd ? "bnhd" : "strided";
}

struct Buffer {
  std::vector<float> data;
  View4<float> view;
  Buffer() = default;
  Buffer(int64_t B, int64_t H, int64_t N, int64_t F, Layout l) {
    if (l == Layout::strided) {
      // Padded rows and every other element: strides (H·N·R, N·R, R, 2), R = 2F + 3.
      const int64_t R = 2 * F + 3;
      data.assign(size_t(B * H * N * R), std::numeric_limits<float>::quiet_NaN());
      view = View4<float>(data.data(), {B, H, N, F}, {H * N * R, N * R, R, 2});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t n = 0; n < N; ++n)
            for (int64_t f = 0; f < F; ++f) view(b, h, n, f) = 0;
    } else {
      data.assign(size_t(B * H * N * F), 0.0f);
      view = l == Layout::bhnd ? View4<float>::bhnd(data.data(), B, H, N, F)
                               : View4<float>::bnhd(data.data(), B, N, H, F);
    }
  }
  void randomize(std::mt19937_64& rng, double stddev = 1.0) {
    std::normal_distribution<double> nd(0, stddev);
    for (int64_t b = 0; b < view.dim(0); ++b)
      for (int64_t h = 0; h < view.dim(1); ++h)
        for (int64_t n = 0; n < view.dim(2); ++n)
          for (int64_t f = 0; f < view.dim(3); ++f) view(b, h, n, f) = float(nd(rng));
  }
};

struct Case {
  int64_t B = 1, H = 1, Hkv = 1, L = 1, S = 1, E = 1, Ev = 1;
  Layout layout = Layout::bhnd;
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  int mask = 0;  // 0 none, 1 bool mask, 2 additive bias (with dbias), 3 both
  bool key_lengths = false;
  int threads = 1;
  FusedTiles tiles{};  // {0, 0}: the heuristic
  double scale = 0;    // 0: default
  uint64_t seed = 0;

  std::string str() const {
    std::ostringstream os;
    os << "B=" << B << " H=" << H << " Hkv=" << Hkv << " L=" << L << " S=" << S << " E=" << E
       << " Ev=" << Ev << " " << layout_name(layout) << (causal ? (align == CausalAlign::top_left ? " causal-tl" : " causal-br") : "")
       << " mask=" << mask << (key_lengths ? " key_lengths" : "") << " threads=" << threads
       << " tiles=" << tiles.q_block << "x" << tiles.k_block << " seed=" << seed;
    return os.str();
  }
};

// Inputs of one case, plus everything both backends write.
struct Data {
  Case c;
  Buffer q, k, v, dout;
  std::unique_ptr<bool[]> mask_store;
  View4<const bool> mask;
  Buffer bias;
  std::vector<int64_t> lengths;
  attn::SdpaArgs<float> args;
  attn::SdpaOptions opt;

  explicit Data(const Case& cs) : c(cs) {
    std::mt19937_64 rng(cs.seed);
    q = Buffer(c.B, c.H, c.L, c.E, c.layout);
    k = Buffer(c.B, c.Hkv, c.S, c.E, c.layout);
    v = Buffer(c.B, c.Hkv, c.S, c.Ev, c.layout);
    dout = Buffer(c.B, c.H, c.L, c.Ev, c.layout);
    q.randomize(rng);
    k.randomize(rng);
    v.randomize(rng);
    dout.randomize(rng);
    args.q = q.view;
    args.k = k.view;
    args.v = v.view;
    std::bernoulli_distribution coin(0.5);
    auto bshape = [&] {
      return std::array<int64_t, 4>{coin(rng) ? c.B : 1, coin(rng) ? c.H : 1, coin(rng) ? c.L : 1,
                                    coin(rng) ? c.S : 1};
    };
    if (c.mask & 1) {
      const auto s = bshape();
      const int64_t n = s[0] * s[1] * s[2] * s[3];
      mask_store.reset(new bool[size_t(n)]);
      std::bernoulli_distribution keep(0.8);
      for (int64_t i = 0; i < n; ++i) mask_store[size_t(i)] = keep(rng);
      // A fully masked query row (row 0 of every (b, h) the mask has).
      if (s[2] == c.L && c.L > 1)
        for (int64_t i = 0; i < n; i += s[2] * s[3])
          for (int64_t j = 0; j < s[3]; ++j) mask_store[size_t(i + j)] = false;
      mask = View4<const bool>(mask_store.get(), s);
      args.mask = mask;
    }
    if (c.mask & 2) {
      const auto s = bshape();
      bias = Buffer(s[0], s[1], s[2], s[3], Layout::bhnd);
      bias.randomize(rng);
      std::bernoulli_distribution ninf(0.05);
      for (auto& x : bias.data)
        if (ninf(rng)) x = -std::numeric_limits<float>::infinity();
      args.bias = bias.view;
    }
    if (c.key_lengths) {
      std::uniform_int_distribution<int64_t> len(0, c.S);
      for (int64_t b = 0; b < c.B; ++b) lengths.push_back(b == 0 && c.B > 1 ? 0 : len(rng));
      args.key_lengths = View1<const int64_t>(lengths.data(), {c.B});
    }
    opt.causal = c.causal;
    opt.causal_align = c.align;
    opt.num_threads = c.threads;
    if (c.scale > 0) opt.scale = c.scale;
  }

  Problem problem() const { return attn::detail::make_problem(args, opt); }
};

// Everything one backend produces for a case.
struct Results {
  Buffer out, weights, dq, dk, dv, dbias;
  std::vector<float> lse;
};

Results run(Data& d, Backend backend, bool with_weights = true) {
  const Case& c = d.c;
  Results r;
  r.out = Buffer(c.B, c.H, c.L, c.Ev, c.layout);
  if (with_weights) r.weights = Buffer(c.B, c.H, c.L, c.S, Layout::bhnd);
  r.lse.assign(size_t(c.B * c.H * c.L), 0.0f);
  View3<float> lse(r.lse.data(), {c.B, c.H, c.L});
  r.dq = Buffer(c.B, c.H, c.L, c.E, c.layout);
  r.dk = Buffer(c.B, c.Hkv, c.S, c.E, c.layout);
  r.dv = Buffer(c.B, c.Hkv, c.S, c.Ev, c.layout);
  attn::SdpaGrads<float> g{r.dq.view, r.dk.view, r.dv.view, {}};
  if (!d.args.bias.empty()) {
    const auto& s = d.args.bias.shape;
    r.dbias = Buffer(s[0], s[1], s[2], s[3], Layout::bhnd);
    g.dbias = r.dbias.view;
  }
  attn::SdpaOptions opt = d.opt;
  opt.backend = backend;
  if (backend == Backend::fused && c.tiles.q_block > 0) {
    const Problem p = d.problem();
    attn::detail::fused_forward_tiled(p, d.args, r.out.view, with_weights ? r.weights.view : View4<float>{}, lse,
                                      c.tiles);
    attn::detail::fused_backward_tiled(p, d.args, d.dout.view, g, r.out.view, lse, c.tiles);
    return r;
  }
  attn::scaled_dot_product_attention<float>(d.args, {r.out.view, with_weights ? r.weights.view : View4<float>{}, lse},
                                            opt);
  attn::scaled_dot_product_attention_backward<float>(d.args, d.dout.view, {r.out.view, lse}, g, opt);
  return r;
}

View3<const float> lse_view(const Results& r, const Case& c) {
  return View3<const float>(r.lse.data(), {c.B, c.H, c.L});
}

void compare(Data& d, const Results& got, const Results& want) {
  const Case& c = d.c;
  const std::string at = c.str();
  // Tolerances: rounding grows with the reduction length (keys for out, the
  // larger of L and S plus the head size for the gradients) and the result's
  // magnitude.
  const double vmag = max_abs(d.args.v);
  EXPECT_TRUE(attn::testing::all_close(got.out.view, want.out.view, tolerance<float>(c.S + c.E, vmag), "out " + at));
  EXPECT_TRUE(attn::testing::all_close(lse_view(got, c), lse_view(want, c),
                                       tolerance<float>(c.S + c.E, max_abs(lse_view(want, c))), "lse " + at));
  if (!got.weights.data.empty()) {
    EXPECT_TRUE(attn::testing::all_close(got.weights.view, want.weights.view, tolerance<float>(c.S + c.E, 1.0),
                                         "weights " + at));
  }
  const int64_t n = std::max(c.L, c.S) * c.H / c.Hkv + c.E + c.Ev;
  EXPECT_TRUE(attn::testing::all_close(got.dq.view, want.dq.view, tolerance<float>(n, max_abs(want.dq.view)), "dq " + at));
  EXPECT_TRUE(attn::testing::all_close(got.dk.view, want.dk.view, tolerance<float>(n, max_abs(want.dk.view)), "dk " + at));
  EXPECT_TRUE(attn::testing::all_close(got.dv.view, want.dv.view, tolerance<float>(n, max_abs(want.dv.view)), "dv " + at));
  if (!got.dbias.data.empty()) {
    const int64_t nb = n * c.B * c.H * c.L * c.S / got.dbias.view.numel();
    EXPECT_TRUE(attn::testing::all_close(got.dbias.view, want.dbias.view,
                                         tolerance<float>(nb, max_abs(want.dbias.view)), "dbias " + at));
  }
}

Case random_case(std::mt19937_64& rng, uint64_t seed) {
  static const int64_t lengths[] = {1, 2, 3, 17, 63, 64, 65, 127, 267, 1030};
  static const int64_t dims[] = {1, 3, 8, 16, 40, 64, 80, 128, 256};
  static const FusedTiles tiles[] = {{0, 0}, {12, 16}, {7, 13}, {24, 64}, {96, 256}, {1, 1}, {36, 40}};
  static const int threads[] = {1, 2, 3, 8};
  auto pick = [&](const auto& arr) {
    return arr[std::uniform_int_distribution<size_t>(0, std::size(arr) - 1)(rng)];
  };
  Case c;
  for (;;) {
    c.seed = seed;
    c.L = pick(lengths);
    c.S = std::bernoulli_distribution(0.6)(rng) ? c.L : pick(lengths);
    c.E = pick(dims);
    c.Ev = std::bernoulli_distribution(0.5)(rng) ? c.E : pick(dims);
    c.B = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    c.Hkv = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    c.H = c.Hkv * std::uniform_int_distribution<int64_t>(1, 3)(rng);  // GQA / MQA when > Hkv
    const double work = double(c.L) * double(c.S) * double(std::max(c.E, c.Ev)) * double(c.B * c.H);
    if (work <= kWorkBudget) break;
  }
  c.layout = static_cast<Layout>(std::uniform_int_distribution<int>(0, 2)(rng));
  c.causal = std::bernoulli_distribution(0.4)(rng);
  c.align = std::bernoulli_distribution(0.5)(rng) ? CausalAlign::top_left : CausalAlign::bottom_right;
  c.mask = std::uniform_int_distribution<int>(0, 3)(rng);
  c.key_lengths = std::bernoulli_distribution(0.25)(rng);
  c.threads = pick(threads);
  c.tiles = pick(tiles);
  if (c.tiles.q_block == 1 && c.L * c.S > 100000) c.tiles = {5, 7};  // keep 1×1 tiles cheap
  if (std::bernoulli_distribution(0.2)(rng)) c.scale = 0.37;
  return c;
}

TEST(Fused, IsPickedByAutoForFloatOnly) {
  ASSERT_TRUE(attn::detail::fused_available());
  Case c;
  c.L = c.S = 5;
  c.E = c.Ev = 4;
  Data d(c);
  EXPECT_EQ(attn::resolve_backend(d.args, d.opt, true), Backend::fused);
  std::vector<double> z(20, 0.0);
  attn::SdpaArgs<double> a64;
  a64.q = a64.k = a64.v = View4<const double>::bhnd(z.data(), 1, 1, 5, 4);
  EXPECT_EQ(attn::resolve_backend(a64, {}, false), Backend::reference);
  std::printf("fused SIMD target: %s\n", attn::detail::fused_target_name());
}

TEST(Fused, MatchesReferenceOnRandomCases) {
  std::mt19937_64 rng(20261129);
  for (int i = 0; i < kCases; ++i) {
    const Case c = random_case(rng, 1000 + uint64_t(i));
    SCOPED_TRACE(c.str());
    Data d(c);
    const bool weights = c.L * c.S <= 300000;
    const Results want = run(d, Backend::reference, weights);
    const Results got = run(d, Backend::fused, weights);
    compare(d, got, want);
    if (::testing::Test::HasFailure()) break;  // one failing case is enough to read
  }
}

// The kernels are compiled for several SIMD targets and one is picked at run
// time; this machine runs only the best. Highway can pretend the CPU supports
// fewer targets, so every compiled target this CPU can execute (down to the
// portable EMU128 one) runs a smaller sweep here.
TEST(Fused, EveryCompiledTargetThisCpuRunsMatchesReference) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  std::string names;
  for (const int64_t t : targets) {
    if (t == HWY_SSSE3) continue;  // not compiled into the library (cmake/attn_kernels.cmake)
    hwy::SetSupportedTargetsForTest(t);
    hwy::GetChosenTarget().Update(hwy::SupportedTargets());
    EXPECT_STREQ(attn::detail::fused_target_name(), hwy::TargetName(t));
    names += std::string(names.empty() ? "" : ", ") + attn::detail::fused_target_name();
    std::mt19937_64 rng(77 + uint64_t(t));
    for (int i = 0; i < std::max(3, kCases / 8); ++i) {
      Case c = random_case(rng, 5000 + uint64_t(i));
      SCOPED_TRACE(std::string(hwy::TargetName(t)) + " " + c.str());
      Data d(c);
      const Results want = run(d, Backend::reference, c.L * c.S <= 300000);
      const Results got = run(d, Backend::fused, c.L * c.S <= 300000);
      compare(d, got, want);
      if (::testing::Test::HasFailure()) break;
    }
    std::vector<float> x = {-3.0f, -0.5f, 0.0f}, y(3);
    attn::detail::fused_exp2(x.data(), y.data(), 3);
    EXPECT_NEAR(y[0], 0.125f, 1e-7f);
    EXPECT_NEAR(y[1], 0.70710678f, 1e-7f);
    EXPECT_EQ(y[2], 1.0f);
  }
  hwy::SetSupportedTargetsForTest(0);  // back to what the CPU really has
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  std::printf("fused targets run: %s\n", names.c_str());
}

// Hand-picked corners the random sweep may miss.
TEST(Fused, MatchesReferenceOnCorners) {
  std::vector<Case> cases;
  Case c;
  c.L = 1, c.S = 1, c.E = 1, c.Ev = 1;
  cases.push_back(c);
  c = Case{};
  c.L = 65, c.S = 17, c.E = 3, c.Ev = 80, c.causal = true, c.align = CausalAlign::top_left;
  cases.push_back(c);  // L > S, top-left: rows 17.. see every key
  c.align = CausalAlign::bottom_right;
  cases.push_back(c);  // L > S, bottom-right: the first 48 rows see nothing
  c = Case{};
  c.B = 2, c.H = 4, c.Hkv = 1, c.L = 63, c.S = 127, c.E = 40, c.Ev = 16, c.mask = 3, c.key_lengths = true;
  c.layout = Layout::bnhd, c.threads = 3;
  cases.push_back(c);  // MQA, batch 0 has no keys at all
  c = Case{};
  c.B = 1, c.H = 8, c.Hkv = 8, c.L = 127, c.S = 65, c.E = 64, c.Ev = 64, c.causal = true;
  c.align = CausalAlign::bottom_right, c.mask = 2, c.layout = Layout::strided, c.threads = 2;
  cases.push_back(c);  // B·Hkv = 8: the backward's head-owning mode
  c = Case{};
  c.L = 267, c.S = 1030, c.E = kWideE, c.Ev = 1, c.threads = 2;
  cases.push_back(c);
  uint64_t seed = 7;
  for (auto& cs : cases) {
    cs.seed = seed++;
    SCOPED_TRACE(cs.str());
    Data d(cs);
    const Results want = run(d, Backend::reference);
    const Results got = run(d, Backend::fused);
    compare(d, got, want);
  }
}

TEST(Fused, FullyMaskedRowsGiveZeroOutputMinusInfLseZeroGradient) {
  Case c;
  c.B = 2, c.H = 2, c.Hkv = 2, c.L = 17, c.S = 63, c.E = 8, c.Ev = 8, c.key_lengths = true;
  Data d(c);  // key_lengths[0] = 0: batch 0 sees no key
  std::unique_ptr<bool[]> m(new bool[size_t(c.L * c.S)]);
  for (int64_t i = 0; i < c.L * c.S; ++i) m[size_t(i)] = (i / c.S) % 2 == 0;  // odd rows fully masked
  d.args.mask = View4<const bool>(m.get(), {1, 1, c.L, c.S});
  const Results r = run(d, Backend::fused);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.L; ++i) {
        const bool dead = b == 0 || i % 2 == 1 || d.lengths[size_t(b)] == 0;
        const float l = r.lse[size_t((b * c.H + h) * c.L + i)];
        if (dead) {
          EXPECT_TRUE(std::isinf(l) && l < 0) << b << "," << h << "," << i;
          for (int64_t e = 0; e < c.Ev; ++e) EXPECT_EQ(r.out.view(b, h, i, e), 0.0f);
          for (int64_t e = 0; e < c.E; ++e) EXPECT_EQ(r.dq.view(b, h, i, e), 0.0f);
          for (int64_t j = 0; j < c.S; ++j) EXPECT_EQ(r.weights.view(b, h, i, j), 0.0f);
        } else {
          EXPECT_TRUE(std::isfinite(l));
        }
      }
  for (int64_t j = 0; j < c.S; ++j)
    for (int64_t e = 0; e < c.E; ++e) EXPECT_EQ(r.dk.view(0, 0, j, e), 0.0f);
  compare(d, r, run(d, Backend::reference));
}

TEST(Fused, HugeScoresGiveNoNanOrInf) {
  Case c;
  c.B = 1, c.H = 2, c.Hkv = 1, c.L = 65, c.S = 127, c.E = 16, c.Ev = 8, c.causal = true, c.threads = 2;
  Data d(c);
  // Scores of magnitude ~1e4: q and k of magnitude 50 with scale 1/4.
  for (auto* buf : {&d.q, &d.k})
    for (auto& x : buf->data) x *= 50.0f;
  const Results r = run(d, Backend::fused);
  EXPECT_TRUE(attn::testing::all_finite(r.out.view));
  EXPECT_TRUE(attn::testing::all_finite(View3<const float>(r.lse.data(), {c.B, c.H, c.L})));
  EXPECT_TRUE(attn::testing::all_finite(r.weights.view));
  EXPECT_TRUE(attn::testing::all_finite(r.dq.view));
  EXPECT_TRUE(attn::testing::all_finite(r.dk.view));
  EXPECT_TRUE(attn::testing::all_finite(r.dv.view));
  EXPECT_GT(max_abs(View3<const float>(r.lse.data(), {c.B, c.H, c.L})), 1000.0);
  // Nearly one-hot rows: the output matches the reference closely.
  const Results want = run(d, Backend::reference);
  EXPECT_TRUE(attn::testing::all_close(r.out.view, want.out.view, 1e-3, "out"));
}

bool bitwise_equal(const Buffer& a, const Buffer& b) {
  return a.data.size() == b.data.size() &&
         std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) == 0;
}

TEST(Fused, BitwiseDeterministicAcrossThreadCounts) {
  // Two shapes: B·Hkv >= 8 (heads owned in the backward) and < 8 (split passes).
  for (int64_t Hkv : {2, 8}) {
    Case c;
    c.B = 1, c.H = 8, c.Hkv = Hkv, c.L = 267, c.S = 130, c.E = 40, c.Ev = 24, c.causal = true;
    c.align = CausalAlign::bottom_right, c.mask = 3, c.layout = Layout::bnhd, c.seed = 99;
    Results first;
    for (int t : {1, 2, 3, 8}) {
      c.threads = t;
      Data d(c);
      Results r = run(d, Backend::fused);
      if (t == 1) {
        first = std::move(r);
        continue;
      }
      SCOPED_TRACE("Hkv=" + std::to_string(Hkv) + " threads=" + std::to_string(t));
      EXPECT_TRUE(bitwise_equal(r.out, first.out));
      EXPECT_TRUE(bitwise_equal(r.weights, first.weights));
      EXPECT_EQ(std::memcmp(r.lse.data(), first.lse.data(), r.lse.size() * sizeof(float)), 0);
      EXPECT_TRUE(bitwise_equal(r.dq, first.dq));
      EXPECT_TRUE(bitwise_equal(r.dk, first.dk));
      EXPECT_TRUE(bitwise_equal(r.dv, first.dv));
      EXPECT_TRUE(bitwise_equal(r.dbias, first.dbias));
    }
  }
}

TEST(Fused, BackwardRecomputesMissingSavedState) {
  Case c;
  c.B = 2, c.H = 2, c.Hkv = 1, c.L = 64, c.S = 65, c.E = 16, c.Ev = 16, c.causal = true, c.seed = 5;
  Data d(c);
  const Results with = run(d, Backend::fused);
  Buffer dq(c.B, c.H, c.L, c.E, c.layout), dk(c.B, c.Hkv, c.S, c.E, c.layout), dv(c.B, c.Hkv, c.S, c.Ev, c.layout);
  attn::SdpaOptions opt = d.opt;
  opt.backend = Backend::fused;
  attn::scaled_dot_product_attention_backward<float>(d.args, d.dout.view, {}, {dq.view, dk.view, dv.view, {}}, opt);
  EXPECT_TRUE(bitwise_equal(dq, with.dq));
  EXPECT_TRUE(bitwise_equal(dk, with.dk));
  EXPECT_TRUE(bitwise_equal(dv, with.dv));
}

TEST(Fused, TileHeuristic) {
  for (int64_t n : {1, 17, 1030, 65536})
    for (int64_t e : {1, 64, 256}) {
      Problem p;
      p.B = p.H = p.Hkv = 1;
      p.L = p.S = n;
      p.E = p.Ev = e;
      p.threads = 1;
      const FusedTiles t = attn::detail::fused_tiles(p);
      EXPECT_GE(t.q_block, 1);
      EXPECT_GE(t.k_block, 1);
      EXPECT_LE(t.q_block, std::max<int64_t>(96, n));
      // Per-thread scratch stays small and does not grow with the sequence.
      EXPECT_LE(attn::detail::fused_scratch_bytes(p, t), 1 << 20) << n << " " << e;
      p.threads = 8;
      const FusedTiles t8 = attn::detail::fused_tiles(p);
      EXPECT_EQ(t8.q_block, t.q_block);  // never depends on the thread count
      EXPECT_EQ(t8.k_block, t.k_block);
    }
}

// Worst error of y against want(x), in units in the last place of the float
// nearest to want; all wanted values must be normal floats.
template <class Want>
std::pair<double, float> worst_ulp_error(const std::vector<float>& x, const std::vector<float>& y, Want want) {
  double worst = 0;
  float at = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double w = want(double(x[i]));
    const float wf = float(w);
    EXPECT_TRUE(std::isnormal(wf)) << x[i];
    const double ulp = double(std::nextafter(wf, std::numeric_limits<float>::infinity()) - wf);
    const double err = std::abs(double(y[i]) - w) / ulp;
    if (err > worst) worst = err, at = x[i];
  }
  return {worst, at};
}

TEST(Fused, VectorisedExpIsAccurateToAFewUlp) {
  // The kernels' exp is for softmax arguments (<= 0, or barely above after
  // rounding); tested over its whole stated range [-87.3, 88].
  std::vector<float> x;
  for (float v = -87.3f; v < 88.0f; v += 0.0137f) x.push_back(v);
  for (float v = -1.0f; v < 1.0f; v += 0.000731f) x.push_back(v);
  x.push_back(0.0f);
  x.push_back(-0.0f);
  x.push_back(1e-30f);
  x.push_back(-1e-30f);
  std::vector<float> y(x.size());
  attn::detail::fused_exp(x.data(), y.data(), int64_t(x.size()));
  const auto [worst_ulp, worst_x] = worst_ulp_error(x, y, [](double v) { return std::exp(v); });
  EXPECT_LE(worst_ulp, 4.0) << "at x = " << worst_x;
  EXPECT_EQ(y[x.size() - 4], 1.0f);  // exp(0) is exactly 1
  std::printf("vectorised exp: worst error %.2f ulp (at %g) over %zu points\n", worst_ulp, double(worst_x), x.size());
  // Masked scores and underflow: exp(−∞) and anything below −87.33 are exactly 0.
  const float neg[5] = {-std::numeric_limits<float>::infinity(), -1e4f, -200.0f, -103.0f, -87.5f};
  float out[5] = {1, 1, 1, 1, 1};
  attn::detail::fused_exp(neg, out, 5);
  for (float o : out) EXPECT_EQ(o, 0.0f);
}

TEST(Fused, VectorisedExp2IsAccurateToAFewUlp) {
  // The forward's exponential (scores in base 2), over its stated range [-126, 127].
  std::vector<float> x;
  for (float v = -126.0f; v < 127.0f; v += 0.0191f) x.push_back(v);
  for (float v = -1.0f; v < 1.0f; v += 0.000731f) x.push_back(v);
  for (int k = -126; k <= 127; ++k) x.push_back(float(k));  // exact powers of two
  std::vector<float> y(x.size());
  attn::detail::fused_exp2(x.data(), y.data(), int64_t(x.size()));
  const auto [worst_ulp, worst_x] = worst_ulp_error(x, y, [](double v) { return std::exp2(v); });
  EXPECT_LE(worst_ulp, 4.0) << "at x = " << worst_x;
  std::printf("vectorised exp2: worst error %.2f ulp (at %g) over %zu points\n", worst_ulp, double(worst_x), x.size());
  const float neg[4] = {-std::numeric_limits<float>::infinity(), -1e4f, -200.0f, -126.51f};
  float out[4] = {1, 1, 1, 1};
  attn::detail::fused_exp2(neg, out, 4);
  for (float o : out) EXPECT_EQ(o, 0.0f);
}

}  // namespace

namespace {

// The block product every fused tile goes through, against a plain loop, for
// all row counts around the micro-kernel heights and both A orientations.
TEST(Fused, BlockProductMatchesPlainLoop) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t M : {1, 5, 6, 7, 12, 13, 25})
    for (int64_t N : {16, 32, 48, 64})
      for (int64_t K : {1, 3, 64})
        for (bool transposed : {false, true})
          for (bool accumulate : {false, true}) {
            std::vector<float> A(size_t(M * K)), B(size_t(K * N)), C(size_t(M * N));
            for (auto* v : {&A, &B, &C})
              for (auto& x : *v) x = nd(rng);
            const int64_t ars = transposed ? 1 : K, aks = transposed ? M : 1;
            std::vector<double> want(size_t(M * N));
            for (int64_t r = 0; r < M; ++r)
              for (int64_t n = 0; n < N; ++n) {
                double acc = accumulate ? C[size_t(r * N + n)] : 0.0;
                for (int64_t k = 0; k < K; ++k) acc += double(A[size_t(r * ars + k * aks)]) * B[size_t(k * N + n)];
                want[size_t(r * N + n)] = acc;
              }
            attn::detail::fused_gemm(M, N, K, A.data(), ars, aks, B.data(), N, C.data(), N, accumulate);
            double worst = 0;
            for (size_t i = 0; i < C.size(); ++i) worst = std::max(worst, std::abs(C[i] - want[i]));
            EXPECT_LE(worst, tolerance<float>(K + 1, 4.0)) << M << "x" << N << "x" << K << " t=" << transposed;
          }
}

}  // namespace
