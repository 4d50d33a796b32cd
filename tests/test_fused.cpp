// The fused backend against the reference backend, forward and backward, on
// randomly sampled awkward cases (lengths that are no multiple of any tile,
// odd head sizes, GQA, layouts and strides, causal both ways, masks with
// fully masked rows, several tile sizes and thread counts); bitwise
// determinism across thread counts; huge scores; NaN and infinities in every
// input (the rule of docs/fused.md, checked against an oracle of its own);
// the plan's promises; the vectorised exp.
//
// The sweep samples the cross-product rather than enumerating it. Without
// optimisation (the sanitizer Debug build) the reference is slow, so the
// sweep is smaller there (fewer cases, smaller work budget per case).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>

#include <hwy/targets.h>

#include "attn/varlen.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/reference/sdpa_reference.hpp"
#include "sdpa_case.hpp"
#include "simd_targets.hpp"

namespace {

using attn::Backend;
using attn::CausalAlign;
using attn::View1;
using attn::View3;
using attn::View4;
using attn::detail::FusedPlan;
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

using attn::testing::Layout;
using Buffer = attn::testing::Strided<float>;

// A random case (tests/sdpa_case.hpp) and the fused kernel's tiles.
struct Case : attn::testing::RandomSpec {
  FusedPlan tiles{};  // q_block 0: fused_plan's choice

  std::string str() const {
    return RandomSpec::str() + " tiles=" + std::to_string(tiles.q_block) + "x" + std::to_string(tiles.k_block) +
           (tiles.own_heads ? " own-heads" : "");
  }
};

// Inputs of one case (q, k, v, dY, masks, variants drawn from c.seed).
struct Data : attn::testing::SdpaCase<float> {
  Case c;
  explicit Data(const Case& cs) : SdpaCase<float>(static_cast<const attn::testing::RandomSpec&>(cs)), c(cs) {}
  Problem problem() const { return attn::detail::make_problem(args, opt); }
};

// Everything one backend produces for a case (allocated, zeroed).
struct Results {
  Buffer out, weights, dq, dk, dv, dbias;
  std::vector<float> lse, dsinks;

  Results() = default;
  Results(const Data& d, bool with_weights) {
    const Case& c = d.c;
    out = Buffer(c.B, c.H, c.L, c.Ev, c.layout);
    if (with_weights) weights = Buffer(c.B, c.H, c.L, c.S, Layout::bhnd);
    lse.assign(size_t(c.B * c.H * c.L), 0.0f);
    dq = Buffer(c.B, c.H, c.L, c.E, c.layout);
    dk = Buffer(c.B, c.Hkv, c.S, c.E, c.layout);
    dv = Buffer(c.B, c.Hkv, c.S, c.Ev, c.layout);
    if (!d.args.bias.empty()) {
      const auto& s = d.args.bias.shape;
      dbias = Buffer(s[0], s[1], s[2], s[3], Layout::bhnd);
    }
    if (!d.args.sinks.empty()) dsinks.assign(size_t(c.H), 0.0f);
  }
  View3<float> lse_out() { return View3<float>(lse.data(), {out.view.dim(0), out.view.dim(1), out.view.dim(2)}); }
  View4<float> weights_out() { return weights.empty() ? View4<float>{} : weights.view; }
  attn::SdpaGrads<float> grads() {
    return {dq.view, dk.view, dv.view, dbias.empty() ? View4<float>{} : dbias.view,
            dsinks.empty() ? View1<float>{} : View1<float>(dsinks.data(), {int64_t(dsinks.size())})};
  }
};

Results run(Data& d, Backend backend, bool with_weights = true) {
  const Case& c = d.c;
  Results r(d, with_weights);
  const View3<float> lse = r.lse_out();
  const attn::SdpaGrads<float> g = r.grads();
  attn::SdpaOptions opt = d.opt;
  opt.backend = backend;
  if (backend == Backend::fused && c.tiles.q_block > 0) {
    const Problem p = d.problem();
    attn::detail::fused_forward_tiled(p, d.args, r.out.view, r.weights_out(), lse, c.tiles);
    attn::detail::fused_backward_tiled(p, d.args, d.doutbuf.view, g, r.out.view, lse, c.tiles);
    return r;
  }
  attn::scaled_dot_product_attention<float>(d.args, {r.out.view, r.weights_out(), lse}, opt);
  attn::scaled_dot_product_attention_backward<float>(d.args, d.doutbuf.view, {r.out.view, lse}, g, opt);
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
  if (!got.weights.empty()) {
    EXPECT_TRUE(attn::testing::all_close(got.weights.view, want.weights.view, tolerance<float>(c.S + c.E, 1.0),
                                         "weights " + at));
  }
  const int64_t n = std::max(c.L, c.S) * c.H / c.Hkv + c.E + c.Ev;
  EXPECT_TRUE(attn::testing::all_close(got.dq.view, want.dq.view, tolerance<float>(n, max_abs(want.dq.view)), "dq " + at));
  EXPECT_TRUE(attn::testing::all_close(got.dk.view, want.dk.view, tolerance<float>(n, max_abs(want.dk.view)), "dk " + at));
  EXPECT_TRUE(attn::testing::all_close(got.dv.view, want.dv.view, tolerance<float>(n, max_abs(want.dv.view)), "dv " + at));
  if (!got.dbias.empty()) {
    const int64_t nb = n * c.B * c.H * c.L * c.S / got.dbias.view.numel();
    EXPECT_TRUE(attn::testing::all_close(got.dbias.view, want.dbias.view,
                                         tolerance<float>(nb, max_abs(want.dbias.view)), "dbias " + at));
  }
  if (!got.dsinks.empty()) {
    const View1<const float> gs(got.dsinks.data(), {c.H}), ws(want.dsinks.data(), {c.H});
    EXPECT_TRUE(attn::testing::all_close(gs, ws, tolerance<float>(c.B * c.L * c.Ev, max_abs(ws)), "dsinks " + at));
  }
}

// A random spec (tests/sdpa_case.hpp) with random tiles; with `variants`,
// windows, offsets, soft-caps, ALiBi and sinks too.
Case random_case(std::mt19937_64& rng, uint64_t seed, bool variants = false) {
  static const FusedPlan tiles[] = {{0, 0}, {12, 16}, {7, 13}, {24, 64}, {96, 256}, {1, 1}, {36, 40}};
  Case c;
  static_cast<attn::testing::RandomSpec&>(c) = attn::testing::random_spec(rng, seed, kWorkBudget);
  c.tiles = tiles[std::uniform_int_distribution<size_t>(0, std::size(tiles) - 1)(rng)];
  if (c.tiles.q_block == 1 && c.L * c.S > 100000) c.tiles = {5, 7};  // keep 1×1 tiles cheap
  c.tiles.own_heads = std::bernoulli_distribution(0.5)(rng);  // both backward splits on any shape
  c.tiles.queries_once = std::bernoulli_distribution(0.5)(rng);  // and both ways to the query side
  c.tiles.keys_once = std::bernoulli_distribution(0.5)(rng);     // and to the key side
  attn::testing::random_scale_and_variants(c, rng, variants);
  return c;
}

TEST(Fused, IsPickedByAutoForFloatOnly) {
  Case c;
  c.L = c.S = 5;
  c.E = c.Ev = 4;
  Data d(c);
  EXPECT_EQ(attn::resolve_backend(d.args, d.opt), Backend::fused);
  std::vector<double> z(20, 0.0);
  attn::SdpaArgs<double> a64;
  a64.q = a64.k = a64.v = View4<const double>::bhnd(z.data(), 1, 1, 5, 4);
  EXPECT_EQ(attn::resolve_backend(a64, {}), Backend::reference);
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

// Every compiled target runs a smaller sweep against the reference.
TEST(Fused, EveryCompiledTargetThisCpuRunsMatchesReference) {
  const std::string names = attn::testing::for_each_target([](int64_t t) {
    std::mt19937_64 rng(77 + uint64_t(t));
    for (int i = 0; i < std::max(3, kCases / 8); ++i) {
      Case c = random_case(rng, 5000 + uint64_t(i));
      SCOPED_TRACE(c.str());
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
  });
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
        const bool dead = b == 0 || i % 2 == 1 || d.key_lengths[size_t(b)] == 0;
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
  for (auto* buf : {&d.qbuf, &d.kbuf})
    for (auto& x : buf->buf) x *= 50.0f;
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

// Finite q and k whose products leave float32's range (|q·k| near 1e41):
// the float32 kernels' scores overflow, and the call is computed again in
// double. Held to softmax in double computed here, for the dense kernel, the
// decode route (one query row, no weights) and bfloat16 products.
TEST(Fused, ScoresBeyondFloat32RangeAreComputedInDouble) {
  for (const int64_t L : {1, 9, 65})
    for (const bool bf16 : {false, true}) {
      Case c;
      c.B = 1, c.H = 2, c.Hkv = 1, c.L = L, c.S = 37, c.E = 16, c.Ev = 8, c.threads = 2, c.seed = uint64_t(L);
      Data d(c);
      for (auto* buf : {&d.qbuf, &d.kbuf})
        for (auto& x : buf->buf) x *= 1e20f;
      if (bf16) d.opt.compute_dtype = attn::Dtype::bfloat16;
      const std::string at = "L=" + std::to_string(L) + (bf16 ? " bfloat16 products" : "");
      const Results r = run(d, Backend::fused);
      Buffer out(c.B, c.H, c.L, c.Ev, c.layout);  // no weights, no lse: the decode route for L = 1
      attn::SdpaOptions opt = d.opt;
      opt.backend = Backend::fused;
      attn::scaled_dot_product_attention<float>(d.args, {out.view, {}, {}}, opt);
      const double scale = d.problem().rules.scale;
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.L; ++i) {
          std::vector<double> u(size_t(c.S));
          for (int64_t j = 0; j < c.S; ++j) {
            double dot = 0;
            for (int64_t e = 0; e < c.E; ++e) dot += double(d.args.q(0, h, i, e)) * double(d.args.k(0, 0, j, e));
            u[size_t(j)] = scale * dot;
          }
          const double m = *std::max_element(u.begin(), u.end());
          double sum = 0;
          for (double x : u) sum += std::exp(x - m);
          EXPECT_GT(m + std::log(sum), 1e39) << at;
          EXPECT_EQ(r.lse[size_t(h * c.L + i)], std::numeric_limits<float>::infinity()) << at;
          for (int64_t f = 0; f < c.Ev; ++f) {
            double y = 0;
            for (int64_t j = 0; j < c.S; ++j) y += std::exp(u[size_t(j)] - m) / sum * double(d.args.v(0, 0, j, f));
            EXPECT_NEAR(r.out.view(0, h, i, f), y, 1e-6) << at << " h=" << h << " i=" << i << " f=" << f;
            EXPECT_NEAR(out.view(0, h, i, f), y, 1e-6) << at << " h=" << h << " i=" << i << " f=" << f;
          }
        }
      EXPECT_TRUE(attn::testing::all_finite(r.dq.view)) << at;
      EXPECT_TRUE(attn::testing::all_finite(r.dk.view)) << at;
      EXPECT_TRUE(attn::testing::all_finite(r.dv.view)) << at;
    }
}

// The same for a packed batch: its fused path would overflow; the sequences
// run as dense calls.
TEST(Fused, VarlenScoresBeyondFloat32RangeAreComputedInDouble) {
  const int64_t H = 2, E = 16, Ev = 8, Lb[2] = {9, 5}, Sb[2] = {37, 20};
  const int64_t cq[3] = {0, 9, 14}, ck[3] = {0, 37, 57};
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> q(size_t(14 * H * E)), k(size_t(57 * E)), v(size_t(57 * Ev)), out(size_t(14 * H * Ev));
  for (auto& x : q) x = 1e20f * normal(rng);
  for (auto& x : k) x = 1e20f * normal(rng);
  for (auto& x : v) x = normal(rng);
  attn::VarlenArgs<float> a;
  a.q = View3<const float>(q.data(), {14, H, E});
  a.k = View3<const float>(k.data(), {57, 1, E});
  a.v = View3<const float>(v.data(), {57, 1, Ev});
  a.cu_seqlens_q = View1<const int64_t>(cq, {3});
  a.cu_seqlens_k = View1<const int64_t>(ck, {3});
  a.max_seqlen_q = 9, a.max_seqlen_k = 37;
  attn::varlen_attention<float>(a, {View3<float>(out.data(), {14, H, Ev}), {}}, {});
  const double scale = 1.0 / std::sqrt(double(E));
  for (int b = 0; b < 2; ++b)
    for (int64_t i = 0; i < Lb[b]; ++i)
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> u(size_t(Sb[b]));
        for (int64_t j = 0; j < Sb[b]; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += double(a.q(cq[b] + i, h, e)) * double(a.k(ck[b] + j, 0, e));
          u[size_t(j)] = scale * dot;
        }
        const double m = *std::max_element(u.begin(), u.end());
        double sum = 0;
        for (double x : u) sum += std::exp(x - m);
        for (int64_t f = 0; f < Ev; ++f) {
          double y = 0;
          for (int64_t j = 0; j < Sb[b]; ++j) y += std::exp(u[size_t(j)] - m) / sum * double(a.v(ck[b] + j, 0, f));
          EXPECT_NEAR(out[size_t(((cq[b] + i) * H + h) * Ev + f)], y, 1e-6) << "b=" << b << " i=" << i << " h=" << h;
        }
      }
}

// ---- NaN and infinities -----------------------------------------------------
//
// The rule (docs/fused.md): masked keys (causal, key_lengths, mask, bias −∞)
// never touch a row; a visible pair whose q, k or v row holds NaN or ±∞, or
// whose bias is NaN or +∞, poisons the row: every element of its output, its
// lse and its visible weights are NaN (masked weights stay 0), and so are its
// dq row, the dk/dv rows of the keys it sees and its visible dbias entries. A
// NaN or ±∞ in a dY row poisons that row's gradients the same way. Rows that
// see no key keep 0 / −∞ / zero gradient.

// Both kernels directly (the public API refuses a NaN bias before either runs).
Results run_kernels(Data& d, Backend backend) {
  const Problem p = d.problem();
  Results r(d, true);
  const View3<float> lse = r.lse_out();
  const attn::SdpaGrads<float> g = r.grads();
  if (backend == Backend::reference) {
    attn::detail::reference_forward<float>(p, d.args, r.out.view, r.weights.view, lse);
    attn::detail::reference_backward<float>(p, d.args, d.doutbuf.view, g);
  } else {
    const FusedPlan t = d.c.tiles.q_block > 0 ? d.c.tiles : attn::detail::fused_plan(p);
    attn::detail::fused_forward_tiled(p, d.args, r.out.view, r.weights.view, lse, t);
    attn::detail::fused_backward_tiled(p, d.args, d.doutbuf.view, g, r.out.view, lse, t);
  }
  return r;
}

bool row_bad(const Buffer& x, int64_t b, int64_t h, int64_t n) {
  for (int64_t f = 0; f < x.view.dim(3); ++f)
    if (!std::isfinite(x.view(b, h, n, f))) return true;
  return false;
}

// The rule, written out plainly: which rows are poisoned and which pairs are visible.
struct Oracle {
  const Data& d;
  std::vector<char> vis, fwd, bwd, keys;  // visible (b, h, i, j); poisoned rows (forward, backward); keys they see

  bool visible(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return vis[size_t(((b * d.c.H + h) * d.c.L + i) * d.c.S + j)];
  }
  bool visible_by_rule(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const Problem p = d.problem();
    if (!p.band(b).visible(i, j)) return false;  // causal, window, key length
    const auto& m = d.args.mask;
    if (!m.empty() && !m(bcast(b, m.dim(0)), bcast(h, m.dim(1)), bcast(i, m.dim(2)), bcast(j, m.dim(3)))) return false;
    return bias(b, h, i, j) != -std::numeric_limits<float>::infinity();
  }
  float bias(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const auto& x = d.args.bias;
    return x.empty() ? 0.0f : x(bcast(b, x.dim(0)), bcast(h, x.dim(1)), bcast(i, x.dim(2)), bcast(j, x.dim(3)));
  }
  static int64_t bcast(int64_t i, int64_t n) { return n == 1 ? 0 : i; }
  size_t at(int64_t b, int64_t h, int64_t i) const { return size_t((b * d.c.H + h) * d.c.L + i); }

  explicit Oracle(const Data& data) : d(data) {
    const Case& c = d.c;
    vis.assign(size_t(c.B * c.H * c.L * c.S), 0);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.L; ++i)
          for (int64_t j = 0; j < c.S; ++j) vis[size_t(((b * c.H + h) * c.L + i) * c.S + j)] = visible_by_rule(b, h, i, j);
    fwd.assign(size_t(c.B * c.H * c.L), 0);
    bwd = fwd;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.L; ++i) {
          bool sees = false, poisoned = false;
          for (int64_t j = 0; j < c.S; ++j) {
            if (!visible(b, h, i, j)) continue;
            sees = true;
            const float x = bias(b, h, i, j);
            poisoned = poisoned || row_bad(d.qbuf, b, h, i) || row_bad(d.kbuf, b, h * c.Hkv / c.H, j) ||
                       row_bad(d.vbuf, b, h * c.Hkv / c.H, j) || std::isnan(x) || x == std::numeric_limits<float>::infinity();
          }
          fwd[at(b, h, i)] = poisoned;
          bwd[at(b, h, i)] = poisoned || (sees && row_bad(d.doutbuf, b, h, i));
        }
    keys.assign(size_t(c.B * c.Hkv * c.S), 0);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.L; ++i)
          for (int64_t j = 0; bwd[at(b, h, i)] && j < c.S; ++j)
            if (visible(b, h, i, j)) keys[size_t((b * c.Hkv + h * c.Hkv / c.H) * c.S + j)] = 1;
  }
  // Whether key j of (b, hk) is seen by a row poisoned in the backward.
  bool key_poisoned(int64_t b, int64_t hk, int64_t j) const { return keys[size_t((b * d.c.Hkv + hk) * d.c.S + j)]; }
};

// Every element of x is NaN where `nan(b, h, n)` says so and otherwise close to `clean`.
template <class Nan>
void expect_nan_exactly(const Buffer& x, const Buffer& clean, Nan nan, const std::string& what) {
  int64_t wrong = 0;
  double worst = 0;
  std::string first;
  for (int64_t b = 0; b < x.view.dim(0); ++b)
    for (int64_t h = 0; h < x.view.dim(1); ++h)
      for (int64_t n = 0; n < x.view.dim(2); ++n)
        for (int64_t f = 0; f < x.view.dim(3); ++f) {
          const float g = x.view(b, h, n, f), w = clean.view(b, h, n, f);
          const bool want_nan = nan(b, h, n, f);
          if (std::isnan(g) != want_nan && wrong++ == 0)
            first = "(" + std::to_string(b) + "," + std::to_string(h) + "," + std::to_string(n) + "," +
                    std::to_string(f) + ") = " + std::to_string(g) + (want_nan ? ", expected NaN" : ", expected a number");
          if (!want_nan && !std::isnan(g)) worst = std::max(worst, double(std::abs(g - w)));
        }
  EXPECT_EQ(wrong, 0) << what << ": first wrong element " << first;
  EXPECT_LE(worst, 1e-5) << what << ": a row the NaN must not reach changed";
}

void check_nan_rule(Data& d, const Results& got, const Results& clean, const std::string& what) {
  const Case& c = d.c;
  const Oracle o(d);
  expect_nan_exactly(got.out, clean.out, [&](int64_t b, int64_t h, int64_t i, int64_t) { return bool(o.fwd[o.at(b, h, i)]); },
                     what + " out");
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.L; ++i) {
        const float l = got.lse[o.at(b, h, i)], lc = clean.lse[o.at(b, h, i)];
        if (o.fwd[o.at(b, h, i)]) EXPECT_TRUE(std::isnan(l)) << what << " lse " << b << "," << h << "," << i;
        else EXPECT_TRUE(l == lc || std::abs(l - lc) <= 1e-5) << what << " lse " << b << "," << h << "," << i << ": " << l << " vs " << lc;
      }
  expect_nan_exactly(got.weights, clean.weights,
                     [&](int64_t b, int64_t h, int64_t i, int64_t j) { return o.fwd[o.at(b, h, i)] && o.visible(b, h, i, j); },
                     what + " weights");
  expect_nan_exactly(got.dq, clean.dq, [&](int64_t b, int64_t h, int64_t i, int64_t) { return bool(o.bwd[o.at(b, h, i)]); },
                     what + " dq");
  auto key_nan = [&](int64_t b, int64_t hk, int64_t j, int64_t) { return o.key_poisoned(b, hk, j); };
  expect_nan_exactly(got.dk, clean.dk, key_nan, what + " dk");
  expect_nan_exactly(got.dv, clean.dv, key_nan, what + " dv");
  if (!got.dbias.empty()) {
    // A dbias element is NaN iff a poisoned row's visible pair broadcasts onto it.
    const auto& s = d.args.bias.shape;
    std::vector<char> want(size_t(s[0] * s[1] * s[2] * s[3]), 0);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.L; ++i)
          for (int64_t j = 0; o.bwd[o.at(b, h, i)] && j < c.S; ++j)
            if (o.visible(b, h, i, j))
              want[size_t(((Oracle::bcast(b, s[0]) * s[1] + Oracle::bcast(h, s[1])) * s[2] + Oracle::bcast(i, s[2])) * s[3] +
                          Oracle::bcast(j, s[3]))] = 1;
    expect_nan_exactly(got.dbias, clean.dbias,
                       [&](int64_t b, int64_t h, int64_t i, int64_t j) {
                         return bool(want[size_t(((b * s[1] + h) * s[2] + i) * s[3] + j)]);
                       },
                       what + " dbias");
  }
}

enum class Spot { q, k, v, bias, dout };
const char* spot_name(Spot s) {
  const char* names[] = {"q", "k", "v", "bias", "dout"};
  return names[int(s)];
}

// One non-finite value in one input: element 1 of row n of (b, h) (clipped
// to the input's shape); for the bias, the entry (b, h, 5, n).
void poison(Data& d, Spot s, int64_t b, int64_t h, int64_t n, float value) {
  Buffer* buf = s == Spot::q ? &d.qbuf : s == Spot::k ? &d.kbuf : s == Spot::v ? &d.vbuf : s == Spot::bias ? &d.bias : &d.doutbuf;
  const auto& v = buf->view;
  std::array<int64_t, 4> at = {b, h, n, 1};
  if (s == Spot::bias) at = {b, h, 5, n};
  for (int a = 0; a < 4; ++a) at[size_t(a)] = std::min(at[size_t(a)], v.dim(a) - 1);
  buf->view(at[0], at[1], at[2], at[3]) = value;
}

TEST(FusedNaN, EveryInputReachesExactlyTheOutputsItTouchesInBothBackends) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  int checked = 0;
  for (int variant = 0; variant < 4; ++variant) {
    Case c;
    c.B = 2, c.H = 4, c.Hkv = 2, c.L = 37, c.S = 45, c.E = 9, c.Ev = 11;  // GQA, no tile multiple
    c.causal = variant % 2 == 1;
    c.align = CausalAlign::bottom_right;
    c.mask = 3;  // a boolean mask (with a fully masked row) and a bias (with −∞ entries)
    c.key_lengths = variant >= 2;
    c.layout = variant == 3 ? Layout::strided : Layout::bhnd;
    c.tiles = variant % 2 == 0 ? FusedPlan{12, 16, variant == 2, variant == 0, variant == 0} : FusedPlan{};
    c.threads = variant == 3 ? 2 : 1;
    c.seed = 300 + uint64_t(variant);
    Data clean_data(c);
    const Results clean = run_kernels(clean_data, Backend::fused);
    for (Spot s : {Spot::q, Spot::k, Spot::v, Spot::bias, Spot::dout})
      for (float value : {nan, inf, -inf}) {
        if (s == Spot::bias && value == -inf) continue;  // a bias of −∞ is a mask
        // Rows/keys at the start, the middle and the end (some see the others, some not).
        for (int64_t n : {int64_t(0), int64_t(20), int64_t(44)}) {
          Data d(c);
          const int64_t b = 1, h = s == Spot::k || s == Spot::v ? 1 : 2;
          poison(d, s, b, h, n, value);
          const std::string what = std::string(spot_name(s)) + "=" + std::to_string(value) + " at n=" + std::to_string(n) +
                                   " " + c.str();
          SCOPED_TRACE(what);
          const Results fused = run_kernels(d, Backend::fused);
          const Results ref = run_kernels(d, Backend::reference);
          check_nan_rule(d, fused, clean, "fused");
          check_nan_rule(d, ref, clean, "reference");
          ++checked;
          if (::testing::Test::HasFailure()) return;
        }
      }
  }
  std::printf("NaN/Inf placements checked in both backends: %d\n", checked);
}

// The NaN rule holds on every compiled target (their max and exponentials
// treat NaN differently), and both exponentials map NaN to NaN, −∞ to 0.
TEST(FusedNaN, RuleHoldsOnEveryCompiledTarget) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::string names = attn::testing::for_each_target([&](int64_t) {
    Case c;
    c.B = 2, c.H = 2, c.Hkv = 1, c.L = 29, c.S = 31, c.E = 5, c.Ev = 7, c.causal = true, c.mask = 1, c.seed = 41;
    Data clean_data(c);
    const Results clean = run_kernels(clean_data, Backend::fused);
    Data d(c);
    poison(d, Spot::k, 0, 0, 13, nan);
    poison(d, Spot::q, 1, 1, 20, inf);
    poison(d, Spot::v, 1, 0, 30, -inf);
    poison(d, Spot::dout, 0, 1, 27, nan);
    check_nan_rule(d, run_kernels(d, Backend::fused), clean, "fused");
    const float x[3] = {nan, -inf, 0.0f};
    float y[3], y2[3];
    attn::detail::fused_exp(x, y, 3);
    attn::detail::fused_exp2(x, y2, 3);
    EXPECT_TRUE(std::isnan(y[0]) && std::isnan(y2[0]));
    EXPECT_EQ(y[1], 0.0f);
    EXPECT_EQ(y2[1], 0.0f);
    EXPECT_EQ(y[2], 1.0f);
    EXPECT_EQ(y2[2], 1.0f);
  });
  std::printf("NaN rule checked on: %s\n", names.c_str());
}

// Through the public API (auto picks the fused backend) a NaN key that only
// masked rows could see changes nothing, and one they see poisons only them.
TEST(FusedNaN, MaskedNaNKeyIsIgnoredAndFullyMaskedRowsStayZero) {
  Case c;
  c.B = 1, c.H = 2, c.Hkv = 1, c.L = 17, c.S = 17, c.E = 8, c.Ev = 8, c.causal = true, c.seed = 9;
  Data clean_data(c);
  const Results clean = run(clean_data, Backend::automatic);
  Data d(c);
  for (int64_t e = 0; e < c.E; ++e) d.kbuf.view(0, 0, 16, e) = std::numeric_limits<float>::quiet_NaN();  // last key: only row 16 sees it
  const Results r = run(d, Backend::automatic);
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t i = 0; i < c.L; ++i)
      for (int64_t e = 0; e < c.Ev; ++e) {
        if (i == 16) EXPECT_TRUE(std::isnan(r.out.view(0, h, i, e))) << h << "," << i;
        else EXPECT_EQ(r.out.view(0, h, i, e), clean.out.view(0, h, i, e)) << h << "," << i;
      }
  // A query row that sees no key (mask) stays 0 / −∞ / zero gradient even with NaN in it.
  Case m = c;
  m.causal = false;
  Data dm(m);
  std::unique_ptr<bool[]> mask(new bool[size_t(m.L * m.S)]);
  for (int64_t i = 0; i < m.L * m.S; ++i) mask[size_t(i)] = i / m.S != 3;  // row 3 sees nothing
  dm.args.mask = View4<const bool>(mask.get(), {1, 1, m.L, m.S});
  for (int64_t e = 0; e < m.E; ++e) dm.qbuf.view(0, 1, 3, e) = std::numeric_limits<float>::quiet_NaN();
  for (Backend be : {Backend::fused, Backend::reference}) {
    const Results rm = run_kernels(dm, be);
    EXPECT_TRUE(std::isinf(rm.lse[size_t(m.L + 3)]) && rm.lse[size_t(m.L + 3)] < 0);
    for (int64_t e = 0; e < m.Ev; ++e) EXPECT_EQ(rm.out.view(0, 1, 3, e), 0.0f);
    for (int64_t e = 0; e < m.E; ++e) EXPECT_EQ(rm.dq.view(0, 1, 3, e), 0.0f);
    EXPECT_TRUE(attn::testing::all_finite(rm.dk.view));
    EXPECT_TRUE(attn::testing::all_finite(rm.out.view));
  }
}

bool bitwise_equal(const Buffer& a, const Buffer& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
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

// K and V whose rows are not adjacent (the heads of a (B, S, H, E) tensor)
// are packed per key tile, or, where the units would pack them many times,
// copied dense once per call (fused.cpp, DenseKV): both give the bits of the
// same values laid out dense, forward and backward, on any thread count.
TEST(Fused, StridedKeysAndValuesGiveTheDenseLayoutsBits) {
  for (int64_t L : {40, 600}) {  // 4 query heads per kv head: packed 4 times, and at least 16
    for (int threads : {1, 2}) {
      Case dense;
      dense.B = 2, dense.H = 8, dense.Hkv = 2, dense.L = L, dense.S = L, dense.E = 24, dense.Ev = 16;
      dense.causal = true, dense.threads = threads, dense.seed = 7;
      Case strided = dense;
      strided.layout = Layout::bnhd;
      Data a(dense), b(strided);
      b.qbuf.assign_values(a.args.q);
      b.kbuf.assign_values(a.args.k);
      b.vbuf.assign_values(a.args.v);
      b.doutbuf.assign_values(a.dout());
      ASSERT_NE(b.args.k.strides[2], b.args.k.dim(3));  // rows not adjacent
      const Results ra = run(a, Backend::fused), rb = run(b, Backend::fused);
      SCOPED_TRACE("L=" + std::to_string(L) + " threads=" + std::to_string(threads));
      EXPECT_TRUE(attn::testing::all_close(rb.out.view, ra.out.view, 0.0, "out"));
      EXPECT_EQ(std::memcmp(rb.lse.data(), ra.lse.data(), ra.lse.size() * sizeof(float)), 0);
      EXPECT_TRUE(attn::testing::all_close(rb.dq.view, ra.dq.view, 0.0, "dq"));
      EXPECT_TRUE(attn::testing::all_close(rb.dk.view, ra.dk.view, 0.0, "dk"));
      EXPECT_TRUE(attn::testing::all_close(rb.dv.view, ra.dv.view, 0.0, "dv"));
      if (threads == 1) compare(b, rb, run(b, Backend::reference));
    }
  }
}

// The backward's query and key sides built once per call (plan.queries_once,
// keys_once) give the bits of packing them per tile: on dense and
// (B, L, H, E) layouts (where the owned heads also sum dQ in a dense copy),
// both backward splits, masks, biases, sinks and windows, poisoned rows and
// keys, head sizes off the lane count, one and two threads.
TEST(Fused, OperandsBuiltOnceGiveThePerTileBits) {
  std::mt19937_64 rng(20261207);
  int compared = 0;
  for (int i = 0; i < 24; ++i) {
    Case c = random_case(rng, 7000 + uint64_t(i), true);
    c.layout = i % 3 == 0 ? Layout::bhnd : i % 3 == 1 ? Layout::bnhd : Layout::strided;
    c.tiles = {i % 2 ? 12 : 16, i % 4 < 2 ? 12 : 24, i % 4 == 1 || i % 4 == 2, true, true};
    c.threads = 1 + i % 2;
    Data d(c);
    if (i % 5 == 4) {  // a bad query row, a bad dY row and a bad key
      d.qbuf.view(0, 0, c.L / 2, 0) = std::numeric_limits<float>::quiet_NaN();
      d.doutbuf.view(c.B - 1, c.H - 1, c.L - 1, c.Ev - 1) = std::numeric_limits<float>::infinity();
      d.kbuf.view(c.B - 1, c.Hkv - 1, c.S / 3, c.E - 1) = -std::numeric_limits<float>::infinity();
    }
    SCOPED_TRACE(c.str());
    const Results once = run_kernels(d, Backend::fused);
    d.c.tiles.queries_once = d.c.tiles.keys_once = false;
    const Results per_tile = run_kernels(d, Backend::fused);
    EXPECT_TRUE(bitwise_equal(once.out, per_tile.out));
    EXPECT_TRUE(bitwise_equal(once.dq, per_tile.dq));
    EXPECT_TRUE(bitwise_equal(once.dk, per_tile.dk));
    EXPECT_TRUE(bitwise_equal(once.dv, per_tile.dv));
    if (!once.dbias.empty()) {
      EXPECT_TRUE(bitwise_equal(once.dbias, per_tile.dbias));
    }
    ASSERT_EQ(once.dsinks.size(), per_tile.dsinks.size());
    if (!once.dsinks.empty()) {
      EXPECT_EQ(std::memcmp(once.dsinks.data(), per_tile.dsinks.data(), once.dsinks.size() * sizeof(float)), 0);
    }
    compared += int(c.S > c.tiles.k_block);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GE(compared, 12);  // most cases meet several key blocks
}

TEST(Fused, BackwardRecomputesMissingSavedState) {
  Case c;
  c.B = 2, c.H = 2, c.Hkv = 1, c.L = 64, c.S = 65, c.E = 16, c.Ev = 16, c.causal = true, c.seed = 5;
  Data d(c);
  const Results with = run(d, Backend::fused);
  Buffer dq(c.B, c.H, c.L, c.E, c.layout), dk(c.B, c.Hkv, c.S, c.E, c.layout), dv(c.B, c.Hkv, c.S, c.Ev, c.layout);
  attn::SdpaOptions opt = d.opt;
  opt.backend = Backend::fused;
  attn::scaled_dot_product_attention_backward<float>(d.args, d.doutbuf.view, {}, {dq.view, dk.view, dv.view, {}}, opt);
  EXPECT_TRUE(bitwise_equal(dq, with.dq));
  EXPECT_TRUE(bitwise_equal(dk, with.dk));
  EXPECT_TRUE(bitwise_equal(dv, with.dv));
}

// What fused_plan promises (tiles.hpp), over shapes from tiny to long.
TEST(Fused, PlanKeepsItsPromises) {
  using attn::detail::BackwardScratch;
  using attn::detail::ForwardScratch;
  using attn::detail::kMaxLanes;
  using attn::detail::kRowMultiple;
  using attn::detail::kScratchBudgetBytes;
  const auto round_up = [](int64_t a, int64_t m) { return (a + m - 1) / m * m; };
  for (int64_t n : {1, 17, 80, 81, 1030, 65536})
    for (int64_t e : {1, 3, 64, 100, 256})
      for (int64_t ev : {1, 64, 256})
        for (int64_t bhkv : {1, 4, 8, 32}) {
          SCOPED_TRACE("L=S=" + std::to_string(n) + " E=" + std::to_string(e) + " Ev=" + std::to_string(ev) +
                       " B*Hkv=" + std::to_string(bhkv));
          Problem p;
          p.B = bhkv > 4 ? 2 : 1;
          p.Hkv = bhkv / p.B;
          p.H = 2 * p.Hkv;
          p.L = p.S = n;
          p.E = e;
          p.Ev = ev;
          p.threads = 1;
          const FusedPlan t = attn::detail::fused_plan(p);
          EXPECT_EQ(t.q_block % kMaxLanes, 0) << t.q_block;
          EXPECT_EQ(t.k_block % kRowMultiple, 0) << t.k_block;
          EXPECT_GE(t.q_block, 1);
          EXPECT_GE(t.k_block, 1);
          EXPECT_LE(t.q_block, round_up(n, kMaxLanes));  // no more than the shape needs
          EXPECT_LE(t.k_block, round_up(n, kRowMultiple));
          // Enough (b, kv head) pairs for every thread: the backward owns heads.
          EXPECT_EQ(t.own_heads, bhkv >= 8);
          for (int64_t lanes : {4, 8, 16}) {  // SSE4, AVX2, AVX-512
            const int64_t fb = ForwardScratch(p, t, lanes, attn::detail::Alloc::no).bytes();
            const int64_t bb = BackwardScratch(p, t, lanes, attn::detail::Alloc::no).bytes();
            EXPECT_LE(fb, kScratchBudgetBytes) << lanes;
            EXPECT_LE(bb, kScratchBudgetBytes) << lanes;
            // Scratch holds the arrays tiles.hpp lists: at least the forward's
            // transposed queries and score tile, the backward's dK/dV blocks.
            EXPECT_GE(fb, 4 * (e * t.q_block + t.k_block * t.q_block));
            EXPECT_GE(bb, 4 * t.k_block * (e + ev));
          }
          // The reported figure is what the kernels allocate for this target.
          const auto rep = attn::detail::fused_scratch_bytes(p, t);
          const ForwardScratch alloc(p, t, 16, attn::detail::Alloc::yes);
          EXPECT_GE(rep.forward, 4 * (e * t.q_block + t.k_block * t.q_block));
          EXPECT_LE(rep.forward, alloc.bytes());  // fewer lanes never pad more
          // The plan depends on the shape only, never on the thread count.
          for (int threads : {2, 3, 8}) {
            p.threads = threads;
            const FusedPlan tt = attn::detail::fused_plan(p);
            EXPECT_EQ(tt.q_block, t.q_block);
            EXPECT_EQ(tt.k_block, t.k_block);
            EXPECT_EQ(tt.own_heads, t.own_heads);
            EXPECT_EQ(tt.queries_once, t.queries_once);
            EXPECT_EQ(tt.keys_once, t.keys_once);
          }
        }
  // Scratch does not grow with the sequence once the blocks are full.
  Problem a;
  a.B = a.H = a.Hkv = 1;
  a.E = a.Ev = 64;
  a.L = a.S = 1030;
  Problem b = a;
  b.L = b.S = 1 << 20;
  const auto sa = attn::detail::fused_scratch_bytes(a, attn::detail::fused_plan(a));
  const auto sb = attn::detail::fused_scratch_bytes(b, attn::detail::fused_plan(b));
  EXPECT_EQ(sa.forward, sb.forward);
  EXPECT_EQ(sa.backward, sb.backward);
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

// y = f(x) by the running target's vector function `apply`, held within 4 ulp
// of `want` (the figure printed, named `name`).
template <class Apply, class Want>
std::vector<float> within_4_ulp(const char* name, const std::vector<float>& x, Apply apply, Want want) {
  std::vector<float> y(x.size());
  apply(x.data(), y.data(), int64_t(x.size()));
  const auto [worst_ulp, worst_x] = worst_ulp_error(x, y, want);
  EXPECT_LE(worst_ulp, 4.0) << name << " at x = " << worst_x;
  std::printf("vectorised %s on %s: worst error %.2f ulp (at %g) over %zu points\n", name,
              attn::detail::fused_target_name(), worst_ulp, double(worst_x), x.size());
  return y;
}

TEST(Fused, VectorisedExpIsAccurateToAFewUlp) {
  // The kernels' exp is for softmax arguments (<= 0, or barely above after
  // rounding); tested over its whole stated range [-87.3, 88], on every
  // compiled target (AVX-512 scales by VSCALEFPS).
  std::vector<float> x;
  for (float v = -87.3f; v < 88.0f; v += 0.0137f) x.push_back(v);
  for (float v = -1.0f; v < 1.0f; v += 0.000731f) x.push_back(v);
  x.push_back(0.0f);
  x.push_back(-0.0f);
  x.push_back(1e-30f);
  x.push_back(-1e-30f);
  const std::string names = attn::testing::for_each_target([&](int64_t) {
    const std::vector<float> y =
        within_4_ulp("exp", x, attn::detail::fused_exp, [](double v) { return std::exp(v); });
    EXPECT_EQ(y[x.size() - 4], 1.0f);  // exp(0) is exactly 1
    // Masked scores and underflow: exp(−∞) and anything below −105 are
    // exactly 0; below −87.33, a subnormal or 0 (by target); NaN stays NaN.
    const float neg[6] = {-std::numeric_limits<float>::infinity(), -1e4f, -200.0f, -105.0f, -87.5f,
                          std::numeric_limits<float>::quiet_NaN()};
    float out[6] = {1, 1, 1, 1, 1, 0};
    attn::detail::fused_exp(neg, out, 6);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], 0.0f) << neg[i];
    EXPECT_TRUE(out[4] >= 0.0f && out[4] < std::numeric_limits<float>::min()) << out[4];
    EXPECT_TRUE(std::isnan(out[5]));
  });
  std::printf("exp targets run: %s\n", names.c_str());
}

TEST(Fused, VectorisedExp2IsAccurateToAFewUlp) {
  // The forward's exponential (scores in base 2), over its stated range
  // [-126, 127], on every compiled target (AVX-512 scales by VSCALEFPS).
  std::vector<float> x;
  for (float v = -126.0f; v < 127.0f; v += 0.0191f) x.push_back(v);
  for (float v = -1.0f; v < 1.0f; v += 0.000731f) x.push_back(v);
  for (int k = -126; k <= 127; ++k) x.push_back(float(k));  // exact powers of two
  const std::string names = attn::testing::for_each_target([&](int64_t) {
    within_4_ulp("exp2", x, attn::detail::fused_exp2, [](double v) { return std::exp2(v); });
    // Masked scores and underflow: 2^−∞ and anything below −151 are exactly
    // 0; below −126.5, a subnormal or 0 (by target); 2^0 is exactly 1; NaN
    // stays NaN.
    const float neg[7] = {-std::numeric_limits<float>::infinity(), -1e4f, -200.0f, -151.0f, -126.51f, 0.0f,
                          std::numeric_limits<float>::quiet_NaN()};
    float out[7] = {1, 1, 1, 1, 1, 0, 0};
    attn::detail::fused_exp2(neg, out, 7);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], 0.0f) << neg[i];
    EXPECT_TRUE(out[4] >= 0.0f && out[4] < std::numeric_limits<float>::min()) << out[4];
    EXPECT_EQ(out[5], 1.0f);
    EXPECT_TRUE(std::isnan(out[6]));
  });
  std::printf("exp2 targets run: %s\n", names.c_str());
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

namespace {

// The variants and their combinations, fused against reference, on the
// awkward shapes of the sweep above.
TEST(FusedVariants, MatchReferenceOnRandomCases) {
  std::mt19937_64 rng(20261201);
  for (int i = 0; i < kCases; ++i) {
    const Case c = random_case(rng, 3000 + uint64_t(i), /*variants=*/true);
    SCOPED_TRACE(c.str());
    Data d(c);
    const bool weights = c.L * c.S <= 300000;
    compare(d, run(d, Backend::fused, weights), run(d, Backend::reference, weights));
    if (::testing::Test::HasFailure()) break;
  }
}

// The combinations the issue names, on fixed awkward shapes.
TEST(FusedVariants, MatchReferenceOnNamedCombinations) {
  std::vector<Case> cases;
  Case c;
  c.B = 2, c.H = 6, c.Hkv = 2, c.L = 67, c.S = 130, c.E = 24, c.Ev = 40, c.causal = true;
  c.window = {21, -1}, c.sinks = true, c.layout = Layout::bnhd, c.threads = 3;
  cases.push_back(c);  // window + causal + GQA + sinks
  c.align = CausalAlign::bottom_right, c.tiles = {12, 16};
  cases.push_back(c);
  c = Case{};
  c.B = 2, c.H = 2, c.Hkv = 1, c.L = 65, c.S = 63, c.E = 16, c.Ev = 8, c.alibi = true, c.softcap = 5.0;
  c.mask = 2, c.layout = Layout::strided, c.threads = 2;
  cases.push_back(c);  // ALiBi + soft-cap + bias (and dbias)
  c.mask = 3, c.key_lengths = true, c.window = {7, 3}, c.offset = -10, c.sinks = true, c.tiles = {7, 13, true};
  cases.push_back(c);  // everything at once, with fully masked rows
  uint64_t seed = 70;
  for (auto& cs : cases) {
    cs.seed = seed++;
    SCOPED_TRACE(cs.str());
    Data d(cs);
    compare(d, run(d, Backend::fused), run(d, Backend::reference));
  }
}

// Windows whose edges fall at every offset inside a tile (q_block 16,
// k_block 12), on both sides, with positions shifted both ways.
TEST(FusedVariants, WindowsCuttingTilesAtEveryOffset) {
  for (int64_t side = 0; side <= 12; ++side)
    for (int kind = 0; kind < 3; ++kind) {
      Case c;
      c.H = 2, c.L = 45, c.S = 50, c.E = 8, c.Ev = 8, c.tiles = {16, 12, kind == 1};
      c.seed = uint64_t(100 + side * 3 + kind);
      if (kind == 0) c.window = {side, -1}, c.causal = true;
      if (kind == 1) c.window = {3, side};
      if (kind == 2) c.window = {side, side}, c.offset = side - 6;
      SCOPED_TRACE(c.str());
      Data d(c);
      compare(d, run(d, Backend::fused), run(d, Backend::reference));
      if (::testing::Test::HasFailure()) return;
    }
}

// A window skips the tiles outside it: with a window of w keys, the fused
// forward's time does not grow with S (measured as work: the tiles the band
// classifies as visited, which is what the kernel runs).
TEST(FusedVariants, WindowTilesVisitedGrowWithTheWindowNotS) {
  for (int64_t S : {1024, 4096}) {
    Problem p;
    p.B = p.H = p.Hkv = 1;
    p.L = p.S = S;
    p.E = p.Ev = 64;
    p.rules.causal = true;
    p.rules.window_left = 128;
    p.rules.offset = {0}, p.rules.key_end = {S};
    const FusedPlan t = attn::detail::fused_plan(p);
    const attn::detail::rules::Band band = p.band(0);
    int64_t visited = 0, scores = 0;
    for (int64_t i0 = 0; i0 < S; i0 += t.q_block) {
      const int64_t nr = std::min(t.q_block, S - i0);
      const auto keys = band.keys_of_rows(i0, i0 + nr);
      for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += t.k_block)
        if (band.classify(i0, nr, j0, std::min(t.k_block, keys.hi - j0)) != attn::detail::rules::Tile::empty)
          visited += nr * std::min(t.k_block, keys.hi - j0);
      for (int64_t i = i0; i < i0 + nr; ++i) scores += band.keys(i).hi - band.keys(i).lo;
    }
    // Every visible score is computed once; the waste is at most one tile
    // of keys per query block on top of the window.
    EXPECT_LE(visited, scores + S * (t.q_block + t.k_block)) << S;
    EXPECT_LE(double(visited), double(S) * double(129 + t.q_block + t.k_block)) << S;
  }
}

// Under a narrow window the plan's query blocks are short enough that the
// masked scores on the band's edges stay under 10% of the visible ones
// (a block of q rows visits w + q − 1 keys per row: q = 96 would visit 18%
// more than the window of 512 keys), while a wide window keeps the long
// blocks (fewer K/V re-reads).
TEST(FusedVariants, PlanShortensQueryBlocksUnderNarrowWindows) {
  Problem p;
  p.B = p.H = p.Hkv = 1;
  p.L = p.S = 16384;
  p.E = p.Ev = 64;
  p.rules.causal = true;
  p.rules.window_left = 511;
  p.rules.offset = {0}, p.rules.key_end = {p.S};
  const FusedPlan t = attn::detail::fused_plan(p);
  const attn::detail::rules::Band band = p.band(0);
  int64_t visited = 0, scores = 0;
  for (int64_t i0 = 0; i0 < p.L; i0 += t.q_block) {
    const int64_t nr = std::min(t.q_block, p.L - i0);
    const auto keys = band.keys_of_rows(i0, i0 + nr);
    for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += t.k_block)
      if (band.classify(i0, nr, j0, std::min(t.k_block, keys.hi - j0)) != attn::detail::rules::Tile::empty)
        visited += nr * std::min(t.k_block, keys.hi - j0);
    for (int64_t i = i0; i < i0 + nr; ++i) scores += band.keys(i).hi - band.keys(i).lo;
  }
  EXPECT_LE(double(visited), 1.10 * double(scores)) << "q_block " << t.q_block;
  p.rules.window_left = 4095;  // wide: the default blocks
  Problem dense = p;
  dense.rules.causal = false, dense.rules.window_left = -1;
  EXPECT_EQ(attn::detail::fused_plan(p).q_block, attn::detail::fused_plan(dense).q_block);
}

TEST(FusedVariants, VectorisedTanhIsAccurateToAFewUlp) {
  std::vector<float> x;
  for (float v = -12.0f; v < 12.0f; v += 0.00731f)
    if (v != 0.0f) x.push_back(v);
  for (float v = 1e-30f; v < 1.0f; v *= 1.37f) x.push_back(v), x.push_back(-v);
  for (float v : {0.625f, -0.625f, 0.62499994f, 8.9f})
    x.push_back(v);
  // Every compiled target (their reciprocal estimates differ).
  const std::string names = attn::testing::for_each_target([&](int64_t) {
    within_4_ulp("tanh", x, attn::detail::fused_tanh, [](double v) { return std::tanh(v); });
    const float inf = std::numeric_limits<float>::infinity();
    // The specials among near-zero lanes, so no vector takes the near-0 path alone.
    const float special[8] = {0.0f, inf, -inf, 50.0f, -1e30f, std::numeric_limits<float>::quiet_NaN(), 0.1f, 0.2f};
    float out[8];
    attn::detail::fused_tanh(special, out, 8);
    EXPECT_EQ(out[0], 0.0f);
    EXPECT_EQ(out[1], 1.0f);
    EXPECT_EQ(out[2], -1.0f);
    EXPECT_EQ(out[3], 1.0f);
    EXPECT_EQ(out[4], -1.0f);
    EXPECT_TRUE(std::isnan(out[5]));
    const float nan_alone[4] = {std::numeric_limits<float>::quiet_NaN(), 0.1f, 0.0f, -0.3f};  // NaN among small lanes
    attn::detail::fused_tanh(nan_alone, out, 4);
    EXPECT_TRUE(std::isnan(out[0]));
    EXPECT_EQ(out[2], 0.0f);
  });
  std::printf("tanh targets run: %s\n", names.c_str());
}

// Sinks: a fully masked row puts all its weight on the sink in the fused
// backend too (output 0, lse = the sink, zero gradient).
TEST(FusedVariants, SinkTakesFullyMaskedRows) {
  Case c;
  c.H = 2, c.L = 9, c.S = 20, c.E = 8, c.Ev = 8, c.sinks = true, c.window = {0, 0}, c.offset = 15;
  Data d(c);  // rows 5.. see keys 20.. : none
  const Results r = run(d, Backend::fused);
  for (int64_t i = 5; i < c.L; ++i) {
    EXPECT_FLOAT_EQ(r.lse[size_t(i)], d.sinks[0]) << i;
    for (int64_t e = 0; e < c.Ev; ++e) EXPECT_EQ(r.out.view(0, 0, i, e), 0.0f);
    for (int64_t e = 0; e < c.E; ++e) EXPECT_EQ(r.dq.view(0, 0, i, e), 0.0f);
  }
  compare(d, r, run(d, Backend::reference));
}

}  // namespace

namespace {

TEST(FusedVariants, BitwiseDeterministicAcrossThreadCounts) {
  for (bool own : {false, true}) {
    Case c;
    c.B = 2, c.H = 4, c.Hkv = 2, c.L = 131, c.S = 140, c.E = 16, c.Ev = 24, c.causal = true, c.mask = 2;
    c.window = {40, -1}, c.softcap = 6.0, c.alibi = true, c.sinks = true, c.tiles = {16, 24, own}, c.seed = 9;
    Results first;
    for (int t : {1, 3}) {
      c.threads = t;
      Data d(c);
      Results r = run(d, Backend::fused);
      if (t == 1) {
        first = std::move(r);
        continue;
      }
      SCOPED_TRACE(c.str());
      EXPECT_TRUE(bitwise_equal(r.out, first.out));
      EXPECT_TRUE(bitwise_equal(r.dq, first.dq));
      EXPECT_TRUE(bitwise_equal(r.dk, first.dk));
      EXPECT_TRUE(bitwise_equal(r.dv, first.dv));
      EXPECT_TRUE(bitwise_equal(r.dbias, first.dbias));
      EXPECT_EQ(std::memcmp(r.dsinks.data(), first.dsinks.data(), r.dsinks.size() * sizeof(float)), 0);
    }
  }
}

}  // namespace

namespace {

// Varlen + causal + window (+ sinks, ALiBi, GQA) through the packed entry
// points, fused against reference, forward and backward.
TEST(FusedVariants, VarlenMatchesReference) {
  std::mt19937_64 rng(404);
  const std::vector<int64_t> lq = {1, 130, 0, 67, 33}, lk = {5, 130, 3, 20, 0};
  std::vector<int64_t> cq{0}, ck{0};
  for (size_t b = 0; b < lq.size(); ++b) cq.push_back(cq.back() + lq[b]), ck.push_back(ck.back() + lk[b]);
  const int64_t H = 4, Hkv = 2, E = 24, Ev = 16, tq = cq.back(), tk = ck.back();
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& x, int64_t n) {
    x.resize(size_t(n));
    for (auto& y : x) y = nd(rng);
  };
  std::vector<float> q, k, v, dout, slopes = {0.1f, 0.2f, 0.3f, 0.4f}, sinks = {0.5f, -1.0f, 2.0f, 0.0f};
  fill(q, tq * H * E), fill(k, tk * Hkv * E), fill(v, tk * Hkv * Ev), fill(dout, tq * H * Ev);
  attn::VarlenArgs<float> a;
  a.q = View3<const float>(q.data(), {tq, H, E});
  a.k = View3<const float>(k.data(), {tk, Hkv, E});
  a.v = View3<const float>(v.data(), {tk, Hkv, Ev});
  a.cu_seqlens_q = View1<const int64_t>(cq.data(), {int64_t(cq.size())});
  a.cu_seqlens_k = View1<const int64_t>(ck.data(), {int64_t(ck.size())});
  a.max_seqlen_q = a.max_seqlen_k = 130;
  a.alibi_slopes = View1<const float>(slopes.data(), {H});
  a.sinks = View1<const float>(sinks.data(), {H});
  struct Out {
    std::vector<float> out, lse, dq, dk, dv, dsinks;
  };
  auto run_varlen = [&](Backend be, CausalAlign align) {
    attn::SdpaOptions opt;
    opt.backend = be;
    opt.causal = true;
    opt.causal_align = align;
    opt.window = {9, -1};
    opt.num_threads = 2;
    Out o;
    o.out.resize(size_t(tq * H * Ev)), o.lse.resize(size_t(H * tq));
    o.dq.resize(size_t(tq * H * E)), o.dk.resize(size_t(tk * Hkv * E)), o.dv.resize(size_t(tk * Hkv * Ev));
    o.dsinks.resize(size_t(H));
    const View3<float> out(o.out.data(), {tq, H, Ev});
    const attn::View2<float> lse(o.lse.data(), {H, tq});
    attn::varlen_attention<float>(a, {out, lse}, opt);
    attn::varlen_attention_backward<float>(
        a, View3<const float>(dout.data(), {tq, H, Ev}), {out, lse},
        {View3<float>(o.dq.data(), {tq, H, E}), View3<float>(o.dk.data(), {tk, Hkv, E}),
         View3<float>(o.dv.data(), {tk, Hkv, Ev}), View1<float>(o.dsinks.data(), {H})},
        opt);
    return o;
  };
  for (CausalAlign align : {CausalAlign::top_left, CausalAlign::bottom_right}) {
    const Out f = run_varlen(Backend::fused, align), r = run_varlen(Backend::reference, align);
    auto close = [](const std::vector<float>& x, const std::vector<float>& y, int64_t n, const char* what) {
      const View1<const float> vx(x.data(), {int64_t(x.size())}), vy(y.data(), {int64_t(y.size())});
      EXPECT_TRUE(attn::testing::all_close(vx, vy, tolerance<float>(n, max_abs(vy)), what));
    };
    close(f.out, r.out, 200, "out");
    close(f.lse, r.lse, 200, "lse");
    close(f.dq, r.dq, 400, "dq");
    close(f.dk, r.dk, 400, "dk");
    close(f.dv, r.dv, 400, "dv");
    close(f.dsinks, r.dsinks, 4000, "dsinks");
  }
}

}  // namespace

namespace {

// Decoding shapes (a few query rows, no weights) with the variants: the
// dense call hands them to the decode kernel (L <= 32), which must apply
// every rule, forward and backward.
TEST(FusedVariants, DecodingShapesKeepTheRules) {
  for (int64_t L : {1, 3, 32}) {
    Case c;
    c.B = 2, c.H = 4, c.Hkv = 2, c.L = L, c.S = 300, c.E = 16, c.Ev = 16, c.causal = true;
    c.align = CausalAlign::bottom_right, c.window = {50, -1}, c.softcap = 8.0, c.alibi = true, c.sinks = true;
    c.seed = uint64_t(500 + L);
    SCOPED_TRACE(c.str());
    Data d(c);
    compare(d, run(d, Backend::fused, /*with_weights=*/false), run(d, Backend::reference, false));
    Case o = c;
    o.window = {}, o.softcap = 0, o.alibi = false, o.sinks = false, o.offset = 100;  // the offset alone
    SCOPED_TRACE(o.str());
    Data dd(o);
    compare(dd, run(dd, Backend::fused, false), run(dd, Backend::reference, false));
  }
}

}  // namespace
