// The multi-head attention layer's backward against central finite
// differences in double, for every input and parameter gradient, over
// self- and cross-attention, every mask, both causal alignments, explicit
// head widths and a Q/K transform (the hook rotary positions use).
#include "multihead_reference.hpp"

namespace {

using namespace attn;  // the layer and its structs
using namespace attn::testing;

// ---------------------------------------------------------------------------
// (b) Gradients against central finite differences (double).

using GradCase = LayerCase;  // the forward tests' case, with the Q/K transform flag

// A Q/K transform for the hook test: each position n of q and k scaled by
// (1 + n/4) (linear and position-dependent, like a rotation; its transpose
// is itself).
template <class T>
attn::QkTransform<T> position_scaling() {
  auto scale = [](View4<T> x) {
    for (int64_t b = 0; b < x.dim(0); ++b)
      for (int64_t h = 0; h < x.dim(1); ++h)
        for (int64_t n = 0; n < x.dim(2); ++n)
          for (int64_t e = 0; e < x.dim(3); ++e) x(b, h, n, e) *= T(1 + 0.25 * double(n));
  };
  auto both = [scale](View4<T> q, View4<T> k) {
    scale(q);
    scale(k);
  };
  return {both, both};
}

void check_gradients(const GradCase& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(seed);
  MultiheadAttention<double> m(c.cfg, seed);
  randomize(m, rng, 0.6);
  if (c.transform) m.set_qk_transform(position_scaling<double>());
  const int64_t D = m.embed_dim(), H = m.num_heads();
  Tensor<double> q = random_tensor<double>({c.B, c.L, D}, rng);
  Tensor<double> k = c.self ? Tensor<double>() : random_tensor<double>({c.B, c.S, m.kdim()}, rng);
  Tensor<double> v = c.self ? Tensor<double>() : random_tensor<double>({c.B, c.S, m.vdim()}, rng);
  Tensor<double> G = random_tensor<double>({c.B, c.L, D}, rng);  // loss = Σ y ⊙ G
  Tensor<bool> kpm, am;
  Tensor<double> ab;
  Tensor<int64_t> lens;
  MhaArgs<double> mk = c.self ? inputs<double>(v3(q)) : inputs<double>(v3(q), v3(k), v3(v));
  if (c.kpm) {
    kpm = Tensor<bool>({c.B, c.S});
    kpm[size_t(c.S - 1)] = true;  // batch 0: last key is padding
    if (c.B > 1) kpm[size_t(c.S)] = true;  // batch 1: first key is padding
    mk.key_padding_mask = kpm.view<2>();
  }
  if (c.mask) {
    am = random_bools({c.B, H, c.L, c.S}, rng, 0.75);
    mk.mask = am.view4();
  }
  if (c.bias) {
    ab = random_tensor<double>({1, H, c.L, c.S}, rng);
    mk.bias = ab.view4();
  }
  if (c.key_lengths) {
    lens = Tensor<int64_t>({c.B});
    for (int64_t b = 0; b < c.B; ++b) lens[size_t(b)] = c.S - b;
    mk.key_lengths = lens.view<1>();
  }
  Tensor<double> slopes;
  if (c.alibi) {
    slopes = random_tensor<double>({H}, rng, 0.5);
    for (size_t h = 0; h < slopes.size(); ++h) slopes[h] = std::abs(slopes[h]);
    mk.alibi_slopes = slopes.view<1>();
  }
  MhaOptions opt = layer_options(c);
  opt.sdpa.backend = attn::Backend::reference;

  auto loss = [&]() {
    Tensor<double> y({c.B, c.L, D});
    m.forward(mk, {v3(y)}, opt);
    return dot(G, y);
  };

  // Analytic: one forward with cache, one backward. Input gradients are
  // overwritten, so start them from garbage. The cache owns the masks: the
  // caller's are overwritten before the backward.
  MhaSaved<double> cache;
  Tensor<double> y({c.B, c.L, D});
  m.forward(mk, {v3(y)}, opt, &cache);
  const Tensor<bool> kpm_kept = kpm, am_kept = am;
  const Tensor<double> ab_kept = ab;
  const Tensor<int64_t> lens_kept = lens;
  const Tensor<double> slopes_kept = slopes;
  kpm.fill(true), am.fill(false), ab.fill(-1e30), lens.fill(0), slopes.fill(7.0);
  Tensor<double> dq({c.B, c.L, D}), dk, dv;
  dq.fill(123.0);
  if (!c.self) {
    dk = Tensor<double>({c.B, c.S, m.kdim()});
    dv = Tensor<double>({c.B, c.S, m.vdim()});
    dk.fill(-7.0);
    dv.fill(9.0);
  }
  const MhaGrads<double> grads{v3(dq), c.self ? View3<double>() : v3(dk), c.self ? View3<double>() : v3(dv)};
  m.zero_grad();
  m.backward(cache, v3(std::as_const(G)), grads);
  // Back in place (mk's views point into these buffers).
  auto restore = [](auto& t, const auto& kept) { std::copy_n(kept.data(), kept.size(), t.data()); };
  restore(kpm, kpm_kept), restore(am, am_kept), restore(ab, ab_kept), restore(lens, lens_kept);
  restore(slopes, slopes_kept);

  EXPECT_TRUE(gradient_check(q, dq, loss, c.self ? "dx" : "dquery"));
  if (!c.self) {
    EXPECT_TRUE(gradient_check(k, dk, loss, "dkey"));
    EXPECT_TRUE(gradient_check(v, dv, loss, "dvalue"));
  }
  for (const auto& name : m.parameter_names())
    EXPECT_TRUE(gradient_check(m.parameter(name), m.grad(name), loss, "grad " + name));

  // Parameter gradients accumulate; input gradients do not.
  auto flat = [](const Tensor<double>& t) { return View1<const double>(t.data(), {int64_t(t.size())}); };
  std::map<std::string, Tensor<double>> once;
  for (const auto& name : m.parameter_names()) once.emplace(name, m.grad(name));
  Tensor<double> dq1 = dq;
  m.backward(cache, v3(std::as_const(G)), grads);
  for (const auto& name : m.parameter_names()) {
    Tensor<double> twice = once.at(name);
    for (size_t i = 0; i < twice.size(); ++i) twice[i] *= 2;
    EXPECT_TRUE(all_close(m.grad(name), twice, 1e-12 * std::max(1.0, max_abs(flat(twice))), "accumulated " + name));
  }
  EXPECT_TRUE(all_close(dq, dq1, 0.0, "input gradient is overwritten"));
  m.zero_grad();
  for (const auto& name : m.parameter_names()) EXPECT_EQ(max_abs(flat(m.grad(name))), 0.0) << name;
}

TEST(MultiheadAttentionGrad, SelfAttentionPacked) {
  check_gradients({"self_packed", config(4, 2), 2, 3, 3, true}, 11);
}

TEST(MultiheadAttentionGrad, SelfAttentionCausalKeyPadding) {
  GradCase c{"self_causal_kpm", config(4, 2), 2, 4, 4, true};
  c.causal = true;
  c.kpm = true;
  check_gradients(c, 12);
}

TEST(MultiheadAttentionGrad, CrossAttentionKdimVdimAllMasks) {
  GradCase c{"cross_all_masks", config(4, 2, true, 3, 5), 2, 2, 4, false};
  c.kpm = c.mask = c.bias = true;
  check_gradients(c, 13);
}

TEST(MultiheadAttentionGrad, ExplicitHeadDimsNoBiasBottomRightCausalKeyLengths) {
  GradCase c{"explicit_dims", config(5, 2, false, 3, 4, 3, 2), 2, 3, 5, false};
  c.causal = true;
  c.align = CausalAlign::bottom_right;
  c.key_lengths = true;
  check_gradients(c, 14);
}

TEST(MultiheadAttentionGrad, ExplicitHeadDimsSelfAttentionWithMask) {
  GradCase c{"explicit_dims_self", config(3, 2, true, 0, 0, 2, 3), 1, 4, 4, true};
  c.mask = true;
  check_gradients(c, 15);
}

TEST(MultiheadAttentionGrad, QkTransformSelfAttentionCausal) {
  GradCase c{"transform_self_causal", config(4, 2), 2, 4, 4, true};
  c.causal = c.transform = true;
  check_gradients(c, 16);
}

TEST(MultiheadAttentionGrad, QkTransformCrossAttention) {
  GradCase c{"transform_cross", config(4, 2, true, 3, 5), 2, 3, 5, false};
  c.transform = c.kpm = true;
  check_gradients(c, 17);
}

// The variants: the layer's sinks get their gradient like every other
// parameter (d sinks included in the parameter loop above).
TEST(MultiheadAttentionGrad, SelfAttentionSinks) {
  check_gradients({"self_sinks", with_sinks(config(4, 2)), 2, 4, 4, true}, 21);
}

TEST(MultiheadAttentionGrad, CrossAttentionSinksWithMasks) {
  GradCase c{"cross_sinks_masks", with_sinks(config(4, 2, true, 3, 5)), 2, 3, 4, false};
  c.kpm = c.mask = true;
  check_gradients(c, 22);
}

TEST(MultiheadAttentionGrad, SelfAttentionCausalWindowAlibi) {
  GradCase c{"self_causal_window_alibi", config(4, 2), 2, 6, 6, true};
  c.causal = c.alibi = true;
  c.variants.window = {2, -1};
  check_gradients(c, 23);
}

TEST(MultiheadAttentionGrad, SelfAttentionSoftcapWindowSinksTransform) {
  GradCase c{"self_softcap_window_sinks", with_sinks(config(4, 2)), 2, 5, 5, true};
  c.variants.softcap = 0.8;
  c.variants.window = {1, 2};
  c.transform = true;
  check_gradients(c, 24);
}

TEST(MultiheadAttentionGrad, CrossAttentionEverythingWithOffset) {
  GradCase c{"cross_everything_offset", with_sinks(config(5, 2, false, 3, 4, 3, 2)), 2, 3, 6, false};
  c.causal = c.alibi = c.bias = c.key_lengths = true;
  c.variants.position_offset = 2;
  c.variants.window = {2, 1};
  c.variants.softcap = 2.0;
  check_gradients(c, 25);
}

// The float layer on the fused backend gives the double reference's
// gradients with every variant on (sinks included).
TEST(MultiheadAttentionGrad, FusedFloatMatchesReferenceWithVariants) {
  std::mt19937_64 rng(26);
  const MultiheadConfig cfg = with_sinks(config(8, 2));
  MultiheadAttention<double> md(cfg, 1);
  MultiheadAttention<float> mf(cfg, 1);
  randomize(md, rng, 0.5);
  for (const auto& name : md.parameter_names()) {
    const Tensor<double>& p = md.parameter(name);
    Tensor<float> f(p.shape());
    for (size_t i = 0; i < p.size(); ++i) f[i] = float(p[i]);
    if (p.rank() == 2)
      mf.load_parameter(name, View2<const float>(f.data(), {f.dim(0), f.dim(1)}));
    else
      mf.load_parameter(name, View1<const float>(f.data(), {f.dim(0)}));
  }
  const int64_t B = 2, N = 37;
  const Tensor<double> x = random_tensor<double>({B, N, 8}, rng), g = random_tensor<double>({B, N, 8}, rng);
  Tensor<float> xf(x.shape()), gf(g.shape());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = float(x[i]), gf[i] = float(g[i]);
  const double slopes_d[2] = {0.25, 0.0625};
  const float slopes_f[2] = {0.25f, 0.0625f};
  LayerCase c{"fused_variants", cfg, B, N, N, true};
  c.causal = true;
  c.variants.window = {9, 0};
  c.variants.softcap = 3.0;
  MhaOptions od = layer_options(c), of = layer_options(c);
  od.sdpa.backend = attn::Backend::reference;
  of.sdpa.backend = attn::Backend::fused;
  MhaArgs<double> ad = inputs<double>(v3(x));
  ad.alibi_slopes = View1<const double>(slopes_d, {2});
  MhaArgs<float> af = inputs<float>(v3(std::as_const(xf)));
  af.alibi_slopes = View1<const float>(slopes_f, {2});
  MhaSaved<double> cd;
  MhaSaved<float> cf;
  Tensor<double> yd({B, N, 8}), dxd({B, N, 8});
  Tensor<float> yf({B, N, 8}), dxf({B, N, 8});
  md.forward(ad, {v3(yd)}, od, &cd);
  mf.forward(af, {v3(yf)}, of, &cf);
  md.zero_grad(), mf.zero_grad();
  md.backward(cd, v3(g), {v3(dxd)});
  mf.backward(cf, v3(std::as_const(gf)), {v3(dxf)});
  auto close = [](const Tensor<float>& f, const Tensor<double>& d, const std::string& what) {
    Tensor<double> fd(f.shape());
    for (size_t i = 0; i < f.size(); ++i) fd[i] = double(f[i]);
    const double mag = std::max(1.0, max_abs(View1<const double>(d.data(), {int64_t(d.size())})));
    return all_close(fd, d, 2e-5 * mag * std::sqrt(double(N)), what);
  };
  EXPECT_TRUE(close(yf, yd, "out"));
  EXPECT_TRUE(close(dxf, dxd, "dx"));
  for (const auto& name : md.parameter_names()) EXPECT_TRUE(close(mf.grad(name), md.grad(name), "grad " + name));
}

// The transform runs between projection and attention: the cache keeps the
// transformed q and k (what the attention saw) and the untouched v.
TEST(MultiheadAttention, QkTransformSeesTheProjections) {
  std::mt19937_64 rng(18);
  MultiheadAttention<double> plain(config(4, 2), 3), scaled(config(4, 2), 3);
  scaled.set_qk_transform(position_scaling<double>());
  Tensor<double> x = random_tensor<double>({1, 3, 4}, rng), y({1, 3, 4});
  MhaSaved<double> cp, cs;
  plain.forward(inputs<double>(v3(x)), {v3(y)}, {}, &cp);
  scaled.forward(inputs<double>(v3(x)), {v3(y)}, {}, &cs);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t e = 0; e < 2; ++e) {
        EXPECT_DOUBLE_EQ(cs.q()(0, h, n, e), cp.q()(0, h, n, e) * (1 + 0.25 * double(n)));
        EXPECT_DOUBLE_EQ(cs.k()(0, h, n, e), cp.k()(0, h, n, e) * (1 + 0.25 * double(n)));
        EXPECT_DOUBLE_EQ(cs.v()(0, h, n, e), cp.v()(0, h, n, e));
      }
}

}  // namespace

namespace {

// The layer keeps its backward's gradient buffers between calls: a backward
// after one of another shape gives what a fresh layer gives, bit for bit.
TEST(MultiheadAttentionGrad, ReusedBuffersAcrossShapesChangeNothing) {
  MultiheadConfig cfg;
  cfg.embed_dim = 8, cfg.num_heads = 2;
  auto step = [&](MultiheadAttention<float>& m, int64_t B, int64_t L, uint64_t seed) {
    std::mt19937_64 r(seed);
    const Tensor<float> x = random_tensor<float>({B, L, 8}, r), g = random_tensor<float>({B, L, 8}, r);
    Tensor<float> y({B, L, 8}), dx({B, L, 8});
    MhaSaved<float> cache;
    m.forward(inputs<float>(x.view<3>()), {y.view<3>()}, {}, &cache);
    m.zero_grad();
    m.backward(cache, g.view<3>(), {dx.view<3>()});
    return dx;
  };
  MultiheadAttention<float> used(cfg, 5), fresh(cfg, 5);
  step(used, 3, 7, 11);
  const Tensor<float> a = step(used, 2, 4, 12), b = step(fresh, 2, 4, 12);
  EXPECT_TRUE(all_close(a, b, 0.0, "dx after another shape"));
  for (const auto& name : used.parameter_names())
    EXPECT_TRUE(all_close(used.grad(name), fresh.grad(name), 0.0, "grad " + name));
}

}  // namespace

namespace {

// The layer's forward and backward (fused kernel, float) give the same bits
// for 1, 2 and 3 threads: the GEMMs and the kernel split work by shape
// only, and the copies around them (800 query rows × 96 features: above
// the 2^16 elements from which they run in parallel) are plain copies.
// Self-attention (packed projection) and a cross attention with its own
// key/value widths and L != S.
TEST(MultiheadAttentionGrad, BitwiseIdenticalForAnyThreadCount) {
  struct Result {
    Tensor<float> y, dq, dk, dv;
    std::vector<Tensor<float>> grads;
  };
  for (const bool self : {true, false}) {
    const MultiheadConfig cfg = self ? config(96, 4) : config(96, 4, true, 20, 12, 24, 16);
    const int64_t B = 2, L = 400, S = self ? L : 131;
    std::mt19937_64 rng(31);
    const Tensor<float> xq = random_tensor<float>({B, L, 96}, rng), g = random_tensor<float>({B, L, 96}, rng);
    const Tensor<float> xk = random_tensor<float>({B, S, 20}, rng), xv = random_tensor<float>({B, S, 12}, rng);
    auto run = [&](int threads) {
      MultiheadAttention<float> m(cfg, 9);
      std::mt19937_64 prng(5);
      randomize(m, prng, 0.5);  // biases too
      MhaOptions opt;
      opt.sdpa.backend = attn::Backend::fused;
      opt.sdpa.num_threads = threads;
      Result r{Tensor<float>({B, L, 96}), Tensor<float>({B, L, 96}), Tensor<float>({B, S, 20}),
               Tensor<float>({B, S, 12}), {}};
      MhaSaved<float> cache;
      const MhaArgs<float> a = self ? inputs<float>(xq.view<3>()) : inputs<float>(xq.view<3>(), xk.view<3>(), xv.view<3>());
      m.forward(a, {r.y.view<3>()}, opt, &cache);
      m.zero_grad();
      if (self)
        m.backward(cache, g.view<3>(), {r.dq.view<3>()});
      else
        m.backward(cache, g.view<3>(), {r.dq.view<3>(), r.dk.view<3>(), r.dv.view<3>()});
      for (const auto& name : m.parameter_names()) r.grads.push_back(m.grad(name));
      return r;
    };
    const Result one = run(1);
    for (const int threads : {2, 3}) {
      const Result r = run(threads);
      const std::string t = (self ? "self, " : "cross, ") + std::to_string(threads) + " threads: ";
      EXPECT_TRUE(all_close(r.y, one.y, 0.0, t + "out"));
      EXPECT_TRUE(all_close(r.dq, one.dq, 0.0, t + "dquery"));
      EXPECT_TRUE(all_close(r.dk, one.dk, 0.0, t + "dkey"));
      EXPECT_TRUE(all_close(r.dv, one.dv, 0.0, t + "dvalue"));
      for (size_t i = 0; i < one.grads.size(); ++i)
        EXPECT_TRUE(all_close(r.grads[i], one.grads[i], 0.0, t + "grad " + std::to_string(i)));
    }
  }
}

}  // namespace
