// The attention variants (sliding window, ALiBi, soft-cap, sinks, position
// offsets, packed variable-length batches) in the reference backend, each
// against an independent formulation through the public API:
//   window / causal / offset   a boolean mask built from positions here
//   ALiBi                      an additive bias built here
//   sinks                      an extra key column with zero key and value
//                              whose bias is the sink
//   soft-cap                   the formula evaluated here in double
//   varlen                     a loop of dense calls on copied sequences
// and every gradient, d(sinks) included, against central finite differences
// in double. Validation messages for the new arguments at the end.
#include <functional>

#include "sdpa_case.hpp"

namespace {

using namespace attn::testing;
using attn::CausalAlign;
using attn::SdpaOptions;
using attn::Tensor;
using attn::View1;
using attn::View2;
using attn::View3;
using attn::View4;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Outputs {
  Tensor<double> out, weights, lse;
};

Outputs forward(SdpaCase<double>& c) {
  Outputs o;
  o.out = c.forward(&o.weights, &o.lse);
  return o;
}

using Grads = SdpaCase<double>::Grads;

Grads backward(SdpaCase<double>& c, const Tensor<double>& dout) { return c.backward(dout); }

// The query offset the tests derive on their own (the documented rule).
int64_t offset_of(const SdpaOptions& o, int64_t L, int64_t S) {
  if (o.position_offset) return *o.position_offset;
  return o.causal_align == CausalAlign::bottom_right ? S - L : 0;
}

void expect_same(const Outputs& a, const Outputs& b, double tol, const std::string& what) {
  EXPECT_TRUE(all_close(a.out, b.out, tol, what + " out"));
  EXPECT_TRUE(all_close(a.lse, b.lse, tol, what + " lse"));
  EXPECT_TRUE(all_close(a.weights, b.weights, tol, what + " weights"));
}
void expect_same(const Grads& a, const Grads& b, double tol, const std::string& what) {
  EXPECT_TRUE(all_close(a.dq, b.dq, tol, what + " dq"));
  EXPECT_TRUE(all_close(a.dk, b.dk, tol, what + " dk"));
  EXPECT_TRUE(all_close(a.dv, b.dv, tol, what + " dv"));
}

Tensor<double> per_head(int64_t H, std::mt19937_64& rng, double lo, double hi) {
  Tensor<double> t({H});
  std::uniform_real_distribution<double> u(lo, hi);
  for (int64_t h = 0; h < H; ++h) t[size_t(h)] = u(rng);
  return t;
}

struct WindowCase {
  CaseShape shape;
  int64_t left, right;
  bool causal;
  CausalAlign align;
  std::optional<int64_t> offset;
};

class Window : public ::testing::TestWithParam<WindowCase> {};

// A window (with causal and offsets) is the boolean mask of its positions.
TEST_P(Window, IsTheBooleanMaskOfItsPositions) {
  const WindowCase& wc = GetParam();
  std::mt19937_64 rng(11);
  SdpaCase<double> a(wc.shape, rng);
  a.opt.backend = attn::Backend::reference;
  a.opt.window = {wc.left, wc.right};
  a.opt.causal = wc.causal;
  a.opt.causal_align = wc.align;
  a.opt.position_offset = wc.offset;
  SdpaCase<double> m = a;  // the copy's q, k, v views still read a's buffers
  m.opt = SdpaOptions{};
  m.opt.backend = attn::Backend::reference;
  const auto& s = a.s;
  const int64_t off = offset_of(a.opt, s.L, s.S);
  m.mask = Tensor<bool>({1, 1, s.L, s.S});
  for (int64_t i = 0; i < s.L; ++i)
    for (int64_t j = 0; j < s.S; ++j) {
      const int64_t pos = i + off;
      bool vis = true;
      if (wc.left >= 0 && j < pos - wc.left) vis = false;
      if (wc.right >= 0 && j > pos + wc.right) vis = false;
      if (wc.causal && j > pos) vis = false;
      m.mask.view4()(0, 0, i, j) = vis;
    }
  m.args.mask = m.mask.view4();
  expect_same(forward(a), forward(m), 1e-13, "window");
  const Tensor<double> dout = random_tensor<double>({s.B, s.H, s.L, s.Ev}, rng);
  expect_same(backward(a, dout), backward(m, dout), 1e-13, "window");
}

constexpr auto TL = CausalAlign::top_left;
constexpr auto BR = CausalAlign::bottom_right;

INSTANTIATE_TEST_SUITE_P(
    Reference, Window,
    ::testing::Values(WindowCase{{1, 2, 1, 9, 9, 4, 3}, 2, 1, false, TL, {}},
                      WindowCase{{1, 2, 2, 9, 9, 4, 3}, 3, -1, true, TL, {}},
                      WindowCase{{2, 4, 2, 5, 12, 4, 3}, 2, 0, false, BR, {}},
                      WindowCase{{1, 2, 1, 12, 5, 4, 3}, -1, 2, false, BR, {}},
                      WindowCase{{1, 1, 1, 6, 14, 4, 3}, 1, 3, true, TL, int64_t{5}},
                      WindowCase{{1, 1, 1, 6, 10, 4, 3}, 0, 0, false, TL, int64_t{-3}},
                      WindowCase{{1, 3, 1, 7, 7, 4, 3}, 4, 5, true, BR, int64_t{40}}));

// ALiBi is the additive bias −slope_h·|i + offset − j|.
TEST(Alibi, IsTheAdditiveBiasOfItsDistances) {
  for (const auto& [align, offset, causal] :
       {std::tuple{TL, std::optional<int64_t>{}, false}, {BR, std::optional<int64_t>{}, true},
        {TL, std::optional<int64_t>{7}, false}}) {
    std::mt19937_64 rng(12);
    SdpaCase<double> a(CaseShape{2, 4, 2, 5, 9, 4, 3}, rng);
    a.opt.backend = attn::Backend::reference;
    a.opt.causal = causal;
    a.opt.causal_align = align;
    a.opt.position_offset = offset;
    Tensor<double> slopes = per_head(4, rng, 0.1, 1.5);
    a.args.alibi_slopes = slopes.view<1>();
    SdpaCase<double> b = a;
    b.args.alibi_slopes = {};
    const auto& s = a.s;
    const int64_t off = offset_of(a.opt, s.L, s.S);
    b.bias = Strided<double>(1, s.H, s.L, s.S, Layout::bhnd);
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t i = 0; i < s.L; ++i)
        for (int64_t j = 0; j < s.S; ++j) b.bias.view4()(0, h, i, j) = -slopes[size_t(h)] * double(std::abs(i + off - j));
    b.args.bias = b.bias.view4();
    expect_same(forward(a), forward(b), 1e-13, "alibi");
    const Tensor<double> dout = random_tensor<double>({s.B, s.H, s.L, s.Ev}, rng);
    expect_same(backward(a, dout), backward(b, dout), 1e-13, "alibi");
  }
}

// A sink is one more key whose score is the sink and whose value is zero:
// here a zero key (score 0) with the sink as its bias.
TEST(Sinks, AreAnExtraKeyColumnWithZeroValue) {
  std::mt19937_64 rng(13);
  const CaseShape shape{2, 4, 2, 5, 7, 4, 3};
  SdpaCase<double> a(shape, rng);
  a.opt.backend = attn::Backend::reference;
  Tensor<double> sinks = per_head(4, rng, -1.0, 2.0);
  sinks[1] = -kInf;  // a head without a sink
  a.args.sinks = sinks.view<1>();
  a.bias = Strided<double>(1, 4, 1, 7, Layout::bhnd);
  a.bias.randomize(rng);
  a.args.bias = a.bias.view4();
  const int64_t S1 = shape.S + 1;
  CaseShape wide = shape;
  wide.S = S1;
  SdpaCase<double> b(wide, rng);
  b.opt = a.opt;
  const View4<double> bk = layout_view(b.kbuf.data(), shape.B, shape.Hkv, S1, shape.E, Layout::bhnd);
  const View4<double> bv = layout_view(b.vbuf.data(), shape.B, shape.Hkv, S1, shape.Ev, Layout::bhnd);
  for (int64_t bb = 0; bb < shape.B; ++bb)
    for (int64_t hk = 0; hk < shape.Hkv; ++hk)
      for (int64_t j = 0; j < S1; ++j) {
        for (int64_t e = 0; e < shape.E; ++e) bk(bb, hk, j, e) = j < shape.S ? a.args.k(bb, hk, j, e) : 0.0;
        for (int64_t e = 0; e < shape.Ev; ++e) bv(bb, hk, j, e) = j < shape.S ? a.args.v(bb, hk, j, e) : 0.0;
      }
  for (size_t i = 0; i < a.qbuf.size(); ++i) b.qbuf[i] = a.qbuf[i];
  b.bias = Strided<double>(1, 4, 1, S1, Layout::bhnd);
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t j = 0; j < S1; ++j) b.bias.view4()(0, h, 0, j) = j < shape.S ? a.bias.view4()(0, h, 0, j) : sinks[size_t(h)];
  b.args.bias = b.bias.view4();
  const Outputs oa = forward(a), ob = forward(b);
  EXPECT_TRUE(all_close(oa.out, ob.out, 1e-13, "out"));
  EXPECT_TRUE(all_close(oa.lse, ob.lse, 1e-13, "lse"));
  for (int64_t bb = 0; bb < shape.B; ++bb)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < shape.L; ++i)
        for (int64_t j = 0; j < shape.S; ++j)
          EXPECT_NEAR(oa.weights.view4()(bb, h, i, j), ob.weights.view4()(bb, h, i, j), 1e-13);
  const Tensor<double> dout = random_tensor<double>({shape.B, shape.H, shape.L, shape.Ev}, rng);
  const Grads ga = backward(a, dout), gb = backward(b, dout);
  EXPECT_TRUE(all_close(ga.dq, gb.dq, 1e-13, "dq"));
  for (int64_t h = 0; h < 4; ++h) {
    // d(sink_h) is the gradient of the extra column's bias.
    EXPECT_NEAR(ga.dsinks[size_t(h)], gb.dbias.view4()(0, h, 0, shape.S), 1e-13) << h;
    for (int64_t j = 0; j < shape.S; ++j)
      EXPECT_NEAR(ga.dbias.view4()(0, h, 0, j), gb.dbias.view4()(0, h, 0, j), 1e-13);
  }
  EXPECT_EQ(ga.dsinks[1], 0.0);
  for (int64_t bb = 0; bb < shape.B; ++bb)
    for (int64_t hk = 0; hk < shape.Hkv; ++hk)
      for (int64_t j = 0; j < shape.S; ++j) {
        for (int64_t e = 0; e < shape.E; ++e) EXPECT_NEAR(ga.dk.view4()(bb, hk, j, e), gb.dk.view4()(bb, hk, j, e), 1e-13);
        for (int64_t e = 0; e < shape.Ev; ++e) EXPECT_NEAR(ga.dv.view4()(bb, hk, j, e), gb.dv.view4()(bb, hk, j, e), 1e-13);
      }
}

// A row that sees no key puts all its weight on the sink: output 0, lse =
// the sink (finite), zero gradients.
TEST(Sinks, FullyMaskedRowPutsAllWeightOnTheSink) {
  std::mt19937_64 rng(14);
  SdpaCase<double> a(CaseShape{1, 2, 1, 4, 6, 3, 3}, rng);
  a.opt.backend = attn::Backend::reference;
  a.add_mask(MaskKind::bool_full, rng);  // row 0 of (0, 0) fully masked
  Tensor<double> sinks = per_head(2, rng, -1.0, 1.0);
  a.args.sinks = sinks.view<1>();
  const Outputs o = forward(a);
  for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(o.out.view4()(0, 0, 0, e), 0.0);
  EXPECT_DOUBLE_EQ(o.lse.view<3>()(0, 0, 0), sinks[0]);
  const Tensor<double> dout = random_tensor<double>({1, 2, 4, 3}, rng);
  const Grads g = backward(a, dout);
  for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(g.dq.view4()(0, 0, 0, e), 0.0);
  EXPECT_TRUE(all_finite(g.dsinks));
}

// Soft-capping against the formula, evaluated here in double.
TEST(Softcap, MatchesTheFormula) {
  std::mt19937_64 rng(15);
  const CaseShape shape{1, 2, 1, 5, 6, 4, 3};
  SdpaCase<double> a(shape, rng, 3.0);  // large scores, where the cap matters
  a.opt.backend = attn::Backend::reference;
  a.opt.softcap = 2.5;
  a.bias = Strided<double>(1, 1, 5, 6, Layout::bhnd);
  a.bias.randomize(rng);
  a.args.bias = a.bias.view4();
  const Outputs o = forward(a);
  const double scale = 1.0 / std::sqrt(4.0);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 5; ++i) {
      std::vector<double> z(6);
      double m = -kInf;
      for (int64_t j = 0; j < 6; ++j) {
        double u = 0;
        for (int64_t e = 0; e < 4; ++e) u += a.args.q(0, h, i, e) * a.args.k(0, 0, j, e);
        z[size_t(j)] = 2.5 * std::tanh(scale * u / 2.5) + a.bias.view4()(0, 0, i, j);
        m = std::max(m, z[size_t(j)]);
      }
      double sum = 0;
      for (double& x : z) sum += (x = std::exp(x - m));
      EXPECT_NEAR(o.lse.view<3>()(0, h, i), m + std::log(sum), 1e-13);
      for (int64_t e = 0; e < 3; ++e) {
        double y = 0;
        for (int64_t j = 0; j < 6; ++j) y += z[size_t(j)] / sum * a.args.v(0, 0, j, e);
        EXPECT_NEAR(o.out.view4()(0, h, i, e), y, 1e-13);
      }
    }
}

// ---- gradients against central finite differences ---------------------------

double loss(SdpaCase<double>& c, const Tensor<double>& dout) {
  const Tensor<double> y = c.forward();
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * dout[i];
  return s;
}

// Central differences of the loss with respect to each of n doubles at x,
// against the analytic gradient g (n values, same order).
void check_fd(const std::function<double()>& f, double* x, int64_t n, const double* g, const char* what) {
  const double h = 1e-6;
  double worst = 0;
  int64_t at = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isinf(x[i])) continue;  // a masked bias entry or absent sink
    const double saved = x[i];
    x[i] = saved + h;
    const double up = f();
    x[i] = saved - h;
    const double down = f();
    x[i] = saved;
    const double err = std::abs((up - down) / (2 * h) - g[i]);
    if (err > worst) worst = err, at = i;
  }
  EXPECT_LE(worst, 1e-6) << what << " worst at flat index " << at;
}

struct FdCase {
  const char* name;
  CaseShape shape;
  MaskKind mask;
  bool causal;
  CausalAlign align;
  attn::Window window;
  double softcap;
  bool alibi, sinks;
  std::optional<int64_t> offset;
};

class VariantGradient : public ::testing::TestWithParam<FdCase> {};

TEST_P(VariantGradient, MatchesFiniteDifferences) {
  const FdCase& fc = GetParam();
  std::mt19937_64 rng(21);
  SdpaCase<double> c(fc.shape, rng, 1.5);
  c.add_mask(fc.mask, rng);
  c.opt.backend = attn::Backend::reference;
  c.opt.causal = fc.causal;
  c.opt.causal_align = fc.align;
  c.opt.window = fc.window;
  c.opt.softcap = fc.softcap;
  c.opt.position_offset = fc.offset;
  Tensor<double> slopes = per_head(fc.shape.H, rng, 0.2, 1.0), sinks = per_head(fc.shape.H, rng, -0.5, 1.5);
  if (fc.alibi) c.args.alibi_slopes = slopes.view<1>();
  if (fc.sinks) c.args.sinks = sinks.view<1>();
  const auto& s = c.s;
  const Tensor<double> dout = random_tensor<double>({s.B, s.H, s.L, s.Ev}, rng);
  const Grads g = backward(c, dout);
  auto f = [&] { return loss(c, dout); };
  // q, k, v are contiguous (no pad, bhnd), so their buffers are in view order.
  ASSERT_FALSE(fc.shape.layout != Layout::bhnd || fc.shape.pad);
  check_fd(f, c.qbuf.data(), int64_t(c.qbuf.size()), g.dq.data(), "dq");
  check_fd(f, c.kbuf.data(), int64_t(c.kbuf.size()), g.dk.data(), "dk");
  check_fd(f, c.vbuf.data(), int64_t(c.vbuf.size()), g.dv.data(), "dv");
  if (!c.args.bias.empty()) check_fd(f, c.bias.data(), int64_t(c.bias.size()), g.dbias.data(), "dbias");
  if (fc.sinks) check_fd(f, sinks.data(), s.H, g.dsinks.data(), "dsinks");
}

INSTANTIATE_TEST_SUITE_P(
    Reference, VariantGradient,
    ::testing::Values(
        FdCase{"window_causal_gqa_sinks", {1, 4, 2, 6, 6, 3, 2}, MaskKind::none, true, TL, {2, -1}, 0, false, true, {}},
        FdCase{"window_both_sides_bottom_right", {2, 2, 1, 4, 7, 3, 2}, MaskKind::none, false, BR, {1, 2}, 0, false, false, {}},
        FdCase{"alibi_softcap_bias", {2, 2, 2, 4, 5, 3, 2}, MaskKind::bias_broadcast, false, TL, {}, 1.3, true, false, {}},
        FdCase{"softcap_mask_sinks", {1, 2, 2, 4, 5, 3, 3}, MaskKind::bool_full, false, TL, {}, 0.8, false, true, {}},
        FdCase{"offset_alibi_sinks_key_lengths", {3, 2, 1, 3, 6, 3, 2}, MaskKind::key_lengths, true, TL, {3, -1}, 0, true, true, int64_t{2}},
        FdCase{"everything", {2, 4, 2, 4, 6, 3, 2}, MaskKind::bias_full, true, BR, {3, 0}, 1.7, true, true, {}}),
    [](const ::testing::TestParamInfo<FdCase>& p) { return std::string(p.param.name); });

// ---- packed variable-length batches -----------------------------------------

struct Packed {
  std::vector<int64_t> cu_q, cu_k;
  int64_t H, Hkv, E, Ev;
  Tensor<double> q, k, v, dout, slopes, sinks;
  attn::VarlenArgs<double> args;

  Packed(std::vector<int64_t> lq, std::vector<int64_t> lk, int64_t h, int64_t hkv, int64_t e, int64_t ev,
         std::mt19937_64& rng)
      : H(h), Hkv(hkv), E(e), Ev(ev) {
    cu_q = {0};
    cu_k = {0};
    int64_t mq = 0, mk = 0;
    for (size_t b = 0; b < lq.size(); ++b) {
      cu_q.push_back(cu_q.back() + lq[b]);
      cu_k.push_back(cu_k.back() + lk[b]);
      mq = std::max(mq, lq[b]);
      mk = std::max(mk, lk[b]);
    }
    q = random_tensor<double>({cu_q.back(), H, E}, rng);
    k = random_tensor<double>({cu_k.back(), Hkv, E}, rng);
    v = random_tensor<double>({cu_k.back(), Hkv, Ev}, rng);
    dout = random_tensor<double>({cu_q.back(), H, Ev}, rng);
    slopes = per_head(H, rng, 0.1, 1.0);
    sinks = per_head(H, rng, -1.0, 1.0);
    args.q = q.view<3>();
    args.k = k.view<3>();
    args.v = v.view<3>();
    const int64_t n = int64_t(cu_q.size());
    args.cu_seqlens_q = View1<const int64_t>(cu_q.data(), {n});
    args.cu_seqlens_k = View1<const int64_t>(cu_k.data(), {n});
    args.max_seqlen_q = mq;
    args.max_seqlen_k = mk;
  }
};

// Rows [r0, r0 + n) of a packed (total, Hx, F) tensor as a dense (1, Hx, n, F) copy.
Tensor<double> unpack(const Tensor<double>& x, int64_t r0, int64_t n) {
  const int64_t Hx = x.dim(1), F = x.dim(2);
  Tensor<double> t({1, Hx, std::max<int64_t>(n, 1), F});
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < Hx; ++h)
      for (int64_t f = 0; f < F; ++f) t.view4()(0, h, r, f) = x.view<3>()(r0 + r, h, f);
  return t;
}

TEST(Varlen, IsALoopOfDenseCallsForwardAndBackward) {
  struct Opt {
    bool causal;
    CausalAlign align;
    attn::Window window;
    bool alibi, sinks;
    double softcap;
    std::optional<int64_t> offset;
  };
  for (const Opt& o : {Opt{false, TL, {}, false, false, 0, {}}, Opt{true, BR, {2, -1}, false, true, 0, {}},
                       Opt{true, TL, {-1, -1}, true, false, 1.5, {}}, Opt{false, TL, {1, 1}, true, true, 0, int64_t{1}}}) {
    std::mt19937_64 rng(31);
    // Lengths: a sequence with no keys, one with no queries, L != S both ways.
    Packed pk({3, 0, 5, 1, 4}, {4, 2, 5, 0, 6}, 4, 2, 3, 2, rng);
    if (o.alibi) pk.args.alibi_slopes = pk.slopes.view<1>();
    if (o.sinks) pk.args.sinks = pk.sinks.view<1>();
    SdpaOptions opt;
    opt.backend = attn::Backend::reference;
    opt.causal = o.causal;
    opt.causal_align = o.align;
    opt.window = o.window;
    opt.softcap = o.softcap;
    opt.position_offset = o.offset;
    const int64_t tq = pk.cu_q.back(), tk = pk.cu_k.back();
    Tensor<double> out({tq, 4, 2}), lse({4, tq});
    attn::varlen_attention<double>(pk.args, {out.view<3>(), lse.view<2>()}, opt);
    Tensor<double> dq({tq, 4, 3}), dk({tk, 2, 3}), dv({tk, 2, 2}), dsinks({4});
    attn::VarlenGrads<double> g{dq.view<3>(), dk.view<3>(), dv.view<3>(), {}};
    if (o.sinks) g.dsinks = dsinks.view<1>();
    attn::varlen_attention_backward<double>(pk.args, pk.dout.view<3>(), {out.view<3>(), lse.view<2>()}, g, opt);
    std::vector<double> dsinks_sum(4, 0.0);
    for (size_t b = 0; b + 1 < pk.cu_q.size(); ++b) {
      const int64_t q0 = pk.cu_q[b], L = pk.cu_q[b + 1] - q0, k0 = pk.cu_k[b], S = pk.cu_k[b + 1] - k0;
      SCOPED_TRACE("sequence " + std::to_string(b));
      if (L == 0) {
        for (int64_t j = 0; j < S; ++j)
          for (int64_t hk = 0; hk < 2; ++hk) EXPECT_EQ(dk.view<3>()(k0 + j, hk, 0), 0.0);
        continue;
      }
      if (S == 0) {
        for (int64_t i = 0; i < L; ++i)
          for (int64_t h = 0; h < 4; ++h) {
            EXPECT_EQ(out.view<3>()(q0 + i, h, 0), 0.0);
            EXPECT_EQ(lse.view<2>()(h, q0 + i), o.sinks ? pk.sinks[size_t(h)] : -kInf);
          }
        continue;
      }
      Tensor<double> q = unpack(pk.q, q0, L), k = unpack(pk.k, k0, S), v = unpack(pk.v, k0, S);
      Tensor<double> dy = unpack(pk.dout, q0, L);
      attn::SdpaArgs<double> a;
      a.q = q.view4();
      a.k = k.view4();
      a.v = v.view4();
      a.alibi_slopes = pk.args.alibi_slopes;
      a.sinks = pk.args.sinks;
      Tensor<double> y({1, 4, L, 2}), l({1, 4, L});
      attn::scaled_dot_product_attention<double>(a, {y.view4(), {}, l.view<3>()}, opt);
      Tensor<double> gq({1, 4, L, 3}), gk({1, 2, S, 3}), gv({1, 2, S, 2}), gs({4});
      attn::SdpaGrads<double> sg{gq.view4(), gk.view4(), gv.view4(), {}, {}};
      if (o.sinks) sg.dsinks = gs.view<1>();
      attn::scaled_dot_product_attention_backward<double>(a, dy.view4(), {}, sg, opt);
      for (int64_t h = 0; h < 4; ++h) {
        dsinks_sum[size_t(h)] += gs[size_t(h)];
        for (int64_t i = 0; i < L; ++i) {
          EXPECT_NEAR(lse.view<2>()(h, q0 + i), l.view<3>()(0, h, i), 1e-14);
          for (int64_t e = 0; e < 2; ++e) EXPECT_NEAR(out.view<3>()(q0 + i, h, e), y.view4()(0, h, i, e), 1e-14);
          for (int64_t e = 0; e < 3; ++e) EXPECT_NEAR(dq.view<3>()(q0 + i, h, e), gq.view4()(0, h, i, e), 1e-14);
        }
      }
      for (int64_t hk = 0; hk < 2; ++hk)
        for (int64_t j = 0; j < S; ++j) {
          for (int64_t e = 0; e < 3; ++e) EXPECT_NEAR(dk.view<3>()(k0 + j, hk, e), gk.view4()(0, hk, j, e), 1e-14);
          for (int64_t e = 0; e < 2; ++e) EXPECT_NEAR(dv.view<3>()(k0 + j, hk, e), gv.view4()(0, hk, j, e), 1e-14);
        }
    }
    if (o.sinks) {
      for (int64_t h = 0; h < 4; ++h) EXPECT_NEAR(dsinks[size_t(h)], dsinks_sum[size_t(h)], 1e-13);
    }
  }
}

// ---- validation ----------------------------------------------------------------

TEST(Variants, BadArgumentsAreRefusedWithTheirNames) {
  std::mt19937_64 rng(41);
  SdpaCase<double> c(CaseShape{1, 2, 1, 3, 3, 2, 2}, rng);
  auto run = [&] { (void)c.forward(); };
  c.opt.window = {-2, 0};
  EXPECT_TRUE(throws_with(run, {"window.left", "-2"}));
  c.opt.window = {0, -5};
  EXPECT_TRUE(throws_with(run, {"window.right"}));
  c.opt.window = {};
  c.opt.softcap = -1;
  EXPECT_TRUE(throws_with(run, {"softcap"}));
  c.opt.softcap = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(throws_with(run, {"softcap"}));
  c.opt.softcap = 0;
  Tensor<double> three({3}), two({2});
  c.args.alibi_slopes = three.view<1>();
  EXPECT_TRUE(throws_with(run, {"alibi_slopes", "(3,)", "(2,)"}));
  two[0] = std::numeric_limits<double>::quiet_NaN();
  c.args.alibi_slopes = two.view<1>();
  EXPECT_TRUE(throws_with(run, {"alibi_slopes", "NaN"}));
  c.args.alibi_slopes = {};
  c.args.sinks = three.view<1>();
  EXPECT_TRUE(throws_with(run, {"sinks", "(3,)"}));
  two[0] = kInf;
  c.args.sinks = two.view<1>();
  EXPECT_TRUE(throws_with(run, {"sinks", "+Inf"}));
  c.args.sinks = {};
  c.opt.position_offset = int64_t(1) << 60;
  EXPECT_TRUE(throws_with(run, {"position_offset"}));
  c.opt.position_offset.reset();
  // dsinks without sinks.
  Tensor<double> dq({1, 2, 3, 2}), dk({1, 1, 3, 2}), dv({1, 1, 3, 2}), ds({2});
  const Tensor<double> dout({1, 2, 3, 2});
  EXPECT_TRUE(throws_with(
      [&] {
        attn::scaled_dot_product_attention_backward<double>(
            c.args, dout.view4(), {}, {dq.view4(), dk.view4(), dv.view4(), {}, ds.view<1>()}, c.opt);
      },
      {"dsinks", "sinks"}));
}

TEST(Varlen, BadPackingIsRefusedWithItsName) {
  std::mt19937_64 rng(42);
  Packed pk({2, 3}, {2, 3}, 2, 1, 2, 2, rng);
  Tensor<double> out({5, 2, 2});
  auto run = [&] { attn::varlen_attention<double>(pk.args, {out.view<3>(), {}}); };
  pk.cu_q = {0, 3, 2};
  EXPECT_TRUE(throws_with(run, {"cu_seqlens_q", "decreases"}));
  pk.cu_q = {0, 2, 4};
  EXPECT_TRUE(throws_with(run, {"cu_seqlens_q", "ends at 4", "5"}));
  pk.cu_q = {1, 2, 5};
  EXPECT_TRUE(throws_with(run, {"cu_seqlens_q", "starts at 1"}));
  pk.cu_q = {0, 2, 5};
  pk.args.max_seqlen_k = 2;
  EXPECT_TRUE(throws_with(run, {"max_seqlen_k", "3"}));
  pk.args.max_seqlen_k = 3;
  Tensor<double> bad({5, 2, 3});
  EXPECT_TRUE(throws_with([&] { attn::varlen_attention<double>(pk.args, {bad.view<3>(), {}}); }, {"out", "(total_q, H, Ev)"}));
  run();  // and now it is accepted
}

}  // namespace
