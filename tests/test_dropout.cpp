// Attention dropout (SdpaOptions::dropout_p, kernels/dropout.hpp):
//   the keep-mask formulation: the weights with dropout are the weights
//     without it times factors in {0, 1/(1-p)}, the output is those weights
//     times V, and lse is unchanged (reference, double);
//   the fused backend against the reference with the same mask, forward and
//     backward, on awkward shapes with causal, windows, sinks and grouped heads;
//   gradients against finite differences (the mask is a function of the
//     position, so it stays fixed while the inputs move);
//   the keep fraction and the independence of the masks across rows, heads,
//     batch entries and seeds, as binomial tests at 6 standard deviations
//     (a false alarm about once in 10^9 runs per check);
//   bitwise equality across thread counts; varlen against its reference;
//   the argument errors, and the entry points that refuse dropout;
//   the multi-head layer: its forward and backward against the projections
//     and the dense call composed by hand with the same options, finite
//     differences through its fixed mask, bitwise equality across thread
//     counts, and decode's refusal.
#include <cmath>
#include <random>

#include "attn/kv_cache.hpp"
#include "attn/multihead.hpp"
#include "attn/sdpa.hpp"
#include "attn/varlen.hpp"
#include "multihead_reference.hpp"
#include "testing.hpp"

namespace {

using namespace attn;
using namespace attn::testing;

struct Case {
  int64_t B, H, Hkv, L, S, E, Ev;
  bool causal;
  Window window;
  bool sinks;
};

template <class T>
struct Run {
  Tensor<T> out, weights, lse, dq, dk, dv;
};

template <class T>
Run<T> run(const Case& c, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, const Tensor<T>& dout,
           const Tensor<T>& sinks, SdpaOptions opt, bool weights = true) {
  Run<T> r{Tensor<T>({c.B, c.H, c.L, c.Ev}), Tensor<T>({c.B, c.H, c.L, c.S}), Tensor<T>({c.B, c.H, c.L}),
           Tensor<T>({c.B, c.H, c.L, c.E}), Tensor<T>({c.B, c.Hkv, c.S, c.E}), Tensor<T>({c.B, c.Hkv, c.S, c.Ev})};
  opt.causal = c.causal;
  opt.window = c.window;
  SdpaArgs<T> a;
  a.q = q.view4(), a.k = k.view4(), a.v = v.view4();
  if (c.sinks) a.sinks = sinks.template view<1>();
  scaled_dot_product_attention<T>(a, {r.out.view4(), weights ? r.weights.view4() : View4<T>{}, r.lse.template view<3>()},
                                  opt);
  scaled_dot_product_attention_backward<T>(a, dout.view4(), {r.out.view4(), r.lse.template view<3>()},
                                           {r.dq.view4(), r.dk.view4(), r.dv.view4()}, opt);
  return r;
}

template <class T>
struct Inputs {
  Tensor<T> q, k, v, dout, sinks;
  Inputs(const Case& c, uint64_t seed) {
    std::mt19937_64 rng(seed);
    q = random_tensor<T>({c.B, c.H, c.L, c.E}, rng);
    k = random_tensor<T>({c.B, c.Hkv, c.S, c.E}, rng);
    v = random_tensor<T>({c.B, c.Hkv, c.S, c.Ev}, rng);
    dout = random_tensor<T>({c.B, c.H, c.L, c.Ev}, rng);
    sinks = random_tensor<T>({c.H}, rng);
  }
};

SdpaOptions dropout(double p, uint64_t seed, uint64_t offset = 0) {
  SdpaOptions o;
  o.dropout_p = p, o.dropout_seed = seed, o.dropout_offset = offset;
  return o;
}

std::vector<Case> cases() {
  return {{2, 3, 1, 7, 9, 5, 4, false, {}, false},     {1, 4, 2, 37, 29, 16, 8, true, {}, true},
          {2, 2, 2, 64, 64, 32, 32, true, {}, false},  {1, 2, 1, 45, 130, 9, 11, false, {6, 3}, true},
          {1, 1, 1, 133, 133, 64, 64, true, {}, false}};
}

TEST(Dropout, ReferenceIsTheKeepMaskFormulation) {
  const double p = 0.3, keep = 1 / (1 - p);
  for (const Case& c : cases()) {
    const Inputs<double> in(c, 3);
    const SdpaOptions ref = [] {
      SdpaOptions o;
      o.backend = Backend::reference;
      return o;
    }();
    SdpaOptions drop = dropout(p, 99);
    drop.backend = Backend::reference;
    const auto plain = run<double>(c, in.q, in.k, in.v, in.dout, in.sinks, ref);
    const auto d = run<double>(c, in.q, in.k, in.v, in.dout, in.sinks, drop);
    int64_t dropped = 0, kept = 0;
    for (size_t x = 0; x < plain.weights.size(); ++x) {
      const double a = plain.weights[x], w = d.weights[x];
      if (a == 0) {
        ASSERT_EQ(w, 0.0);
        continue;
      }
      if (w == 0) {
        ++dropped;
      } else {
        ++kept;
        ASSERT_NEAR(w / a, keep, 1e-6) << "element " << x;  // the factor is float32's 1/(1-p)
      }
    }
    EXPECT_GT(dropped, 0);
    EXPECT_GT(kept, dropped);
    for (size_t x = 0; x < plain.lse.size(); ++x) ASSERT_EQ(d.lse[x], plain.lse[x]) << "lse is dropout's own";
    // out = weights · V, summed here in double
    const auto W = d.weights.view4();
    const auto V = in.v.view4();
    const auto O = d.out.view4();
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.L; ++i)
          for (int64_t e = 0; e < c.Ev; ++e) {
            double y = 0;
            for (int64_t j = 0; j < c.S; ++j) y += W(b, h, i, j) * V(b, h / (c.H / c.Hkv), j, e);
            ASSERT_NEAR(O(b, h, i, e), y, 1e-12);
          }
  }
}

TEST(Dropout, FusedMatchesTheReferenceForwardAndBackward) {
  for (const Case& c : cases())
    for (const double p : {0.1, 0.5, 0.9}) {
      const Inputs<float> in(c, 5);
      SdpaOptions f = dropout(p, 1234, 7), r = f;
      f.backend = Backend::fused;
      r.backend = Backend::reference;
      const auto a = run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, f);
      const auto b = run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, r);
      const double tol = tolerance<float>(c.S, 1.0 / (1 - p), 40.0);
      EXPECT_TRUE(all_close(a.out.view4(), b.out.view4(), tol)) << "p " << p;
      EXPECT_TRUE(all_close(a.weights.view4(), b.weights.view4(), tol)) << "p " << p;
      EXPECT_TRUE(all_close(a.dq.view4(), b.dq.view4(), 10 * tol)) << "p " << p;
      EXPECT_TRUE(all_close(a.dk.view4(), b.dk.view4(), 10 * tol)) << "p " << p;
      EXPECT_TRUE(all_close(a.dv.view4(), b.dv.view4(), 10 * tol)) << "p " << p;
      for (size_t x = 0; x < a.weights.size(); ++x)  // the same entries dropped
        ASSERT_EQ(a.weights[x] == 0, b.weights[x] == 0) << "element " << x << " p " << p;
      // Without weights (the forward's own pass) the output is the same.
      const auto n = run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, f, false);
      EXPECT_TRUE(all_close(n.out.view4(), a.out.view4(), 0.0));
    }
}

TEST(Dropout, GradientsMatchFiniteDifferences) {
  const Case c{1, 2, 1, 5, 6, 3, 4, true, {}, true};
  Inputs<double> in(c, 11);
  SdpaOptions o = dropout(0.4, 77);
  o.backend = Backend::reference;
  const auto r = run<double>(c, in.q, in.k, in.v, in.dout, in.sinks, o);
  auto loss = [&] {
    const auto y = run<double>(c, in.q, in.k, in.v, in.dout, in.sinks, o);
    return dot(in.dout, y.out);
  };
  EXPECT_TRUE(gradient_check(in.q, r.dq, loss, "dq"));
  EXPECT_TRUE(gradient_check(in.k, r.dk, loss, "dk"));
  EXPECT_TRUE(gradient_check(in.v, r.dv, loss, "dv"));
}

// |observed − expected| <= 6σ for a count of n Bernoulli(q) draws.
::testing::AssertionResult binomial(int64_t hits, int64_t n, double q, const char* what) {
  const double sigma = std::sqrt(n * q * (1 - q)), dev = std::abs(double(hits) - n * q);
  if (dev <= 6 * sigma) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << hits << " of " << n << ", expected " << n * q << " ± "
                                       << 6 * sigma;
}

TEST(Dropout, KeepFractionAndIndependence) {
  const Case c{2, 4, 4, 96, 128, 8, 8, false, {}, false};
  const Inputs<float> in(c, 2);
  for (const double p : {0.1, 0.5, 0.77}) {
    const auto a = run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, dropout(p, 1));
    const auto s2 = run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, dropout(p, 2));
    const auto o2 = run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, dropout(p, 1, 1));
    const auto W = a.weights.view4(), W2 = s2.weights.view4(), Wo = o2.weights.view4();
    const int64_t n = int64_t(a.weights.size());
    int64_t kept = 0, same_seed = 0, same_offset = 0, same_row = 0, same_head = 0, same_batch = 0, same_key = 0;
    int64_t rows = 0, heads = 0, batches = 0, keys = 0;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.L; ++i)
          for (int64_t j = 0; j < c.S; ++j) {
            const bool k = W(b, h, i, j) != 0;
            kept += k;
            same_seed += k == (W2(b, h, i, j) != 0);
            same_offset += k == (Wo(b, h, i, j) != 0);
            if (i + 1 < c.L) same_row += k == (W(b, h, i + 1, j) != 0), ++rows;
            if (h + 1 < c.H) same_head += k == (W(b, h + 1, i, j) != 0), ++heads;
            if (b + 1 < c.B) same_batch += k == (W(b + 1, h, i, j) != 0), ++batches;
            if (j + 1 < c.S) same_key += k == (W(b, h, i, j + 1) != 0), ++keys;
          }
    // Two independent masks agree at an entry with probability p² + (1 − p)².
    const double agree = p * p + (1 - p) * (1 - p);
    EXPECT_TRUE(binomial(kept, n, 1 - p, "kept"));
    EXPECT_TRUE(binomial(same_seed, n, agree, "another seed"));
    EXPECT_TRUE(binomial(same_offset, n, agree, "another offset"));
    EXPECT_TRUE(binomial(same_row, rows, agree, "the next row"));
    EXPECT_TRUE(binomial(same_head, heads, agree, "the next head"));
    EXPECT_TRUE(binomial(same_batch, batches, agree, "the next batch entry"));
    EXPECT_TRUE(binomial(same_key, keys, agree, "the next key"));
  }
}

TEST(Dropout, BitwiseTheSameForAnyThreadCount) {
  const Case c{2, 4, 2, 150, 140, 32, 16, true, {}, true};
  const Inputs<float> in(c, 8);
  SdpaOptions o = dropout(0.25, 5);
  o.num_threads = 1;
  const auto one = run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, o);
  for (const int t : {2, 3, 4}) {
    o.num_threads = t;
    const auto r = run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, o);
    EXPECT_TRUE(all_close(r.out.view4(), one.out.view4(), 0.0)) << t << " threads";
    EXPECT_TRUE(all_close(r.dq.view4(), one.dq.view4(), 0.0)) << t << " threads";
    EXPECT_TRUE(all_close(r.dk.view4(), one.dk.view4(), 0.0)) << t << " threads";
    EXPECT_TRUE(all_close(r.dv.view4(), one.dv.view4(), 0.0)) << t << " threads";
  }
}

TEST(Dropout, EverythingDroppedGivesZeros) {
  const Case c{1, 2, 2, 9, 9, 4, 4, true, {}, false};
  const Inputs<float> in(c, 4);
  for (const Backend be : {Backend::reference, Backend::fused}) {
    SdpaOptions o = dropout(1.0, 3);
    o.backend = be;
    const auto r = run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, o);
    EXPECT_EQ(max_abs(r.out.view4()), 0.0);
    EXPECT_EQ(max_abs(r.dv.view4()), 0.0);
    EXPECT_TRUE(all_finite(r.dq));
  }
}

// A packed batch: the fused path against the reference path, and sequence b
// draws its own mask (b is in the counter): two equal sequences differ.
TEST(Dropout, VarlenFusedMatchesReferenceAndSequencesDiffer) {
  const int64_t H = 2, E = 8, n = 20;
  const std::vector<int64_t> cu{0, n, 2 * n};
  std::mt19937_64 rng(6);
  Tensor<float> q = random_tensor<float>({2 * n, H, E}, rng), k = random_tensor<float>({2 * n, H, E}, rng),
                v = random_tensor<float>({2 * n, H, E}, rng), dout = random_tensor<float>({2 * n, H, E}, rng);
  for (int64_t t = 0; t < n * H * E; ++t) {  // sequence 1 = sequence 0
    q[size_t(n * H * E + t)] = q[size_t(t)], k[size_t(n * H * E + t)] = k[size_t(t)];
    v[size_t(n * H * E + t)] = v[size_t(t)], dout[size_t(n * H * E + t)] = dout[size_t(t)];
  }
  VarlenArgs<float> a;
  a.q = q.view<3>(), a.k = k.view<3>(), a.v = v.view<3>();
  a.cu_seqlens_q = a.cu_seqlens_k = View1<const int64_t>(cu.data(), {3});
  a.max_seqlen_q = a.max_seqlen_k = n;
  std::vector<Tensor<float>> outs, grads;
  for (const Backend be : {Backend::fused, Backend::reference}) {
    SdpaOptions o = dropout(0.5, 21);
    o.causal = true;
    o.backend = be;
    Tensor<float> out({2 * n, H, E}), lse({H, 2 * n}), dq({2 * n, H, E}), dk({2 * n, H, E}), dv({2 * n, H, E});
    varlen_attention<float>(a, {out.view<3>(), lse.view<2>()}, o);
    varlen_attention_backward<float>(a, dout.view<3>(), {out.view<3>(), lse.view<2>()},
                                     {dq.view<3>(), dk.view<3>(), dv.view<3>()}, o);
    outs.push_back(out);
    grads.push_back(dq);
  }
  EXPECT_TRUE(all_close(outs[0].view<3>(), outs[1].view<3>(), 1e-5));
  EXPECT_TRUE(all_close(grads[0].view<3>(), grads[1].view<3>(), 1e-4));
  double diff = 0;
  for (int64_t t = 0; t < n * H * E; ++t) diff = std::max(diff, double(std::abs(outs[0][size_t(t)] - outs[0][size_t(n * H * E + t)])));
  EXPECT_GT(diff, 1e-3) << "two sequences drew the same mask";
}

TEST(Dropout, ArgumentErrorsAndRefusals) {
  const Case c{1, 1, 1, 3, 3, 2, 2, false, {}, false};
  const Inputs<float> in(c, 1);
  for (const double p : {-0.1, 1.5, std::nan("")})
    EXPECT_TRUE(throws_with<InvalidArgument>([&] { run<float>(c, in.q, in.k, in.v, in.dout, in.sinks, dropout(p, 0)); },
                                             {"option 'dropout_p'", "expected 0 <= dropout_p <= 1"}));
  KVCacheConfig kc;
  kc.capacity = 4, kc.head_dim = 2;
  KVCache cache(kc);
  Tensor<float> q({1, 1, 1, 2}), out({1, 1, 1, 2});
  EXPECT_TRUE(throws_with<InvalidArgument>(
      [&] { decode_attention({{}, q.view4(), &cache}, {out.view4()}, dropout(0.1, 0)); },
      {"decode_attention", "option 'dropout_p' is not taken over a cache"}));
}

// ---------------------------------------------------------------------------
// The multi-head layer (self-attention, packed in_proj): its attention is one
// dense call on the projected q, k, v (B, H, L, E), so with dropout it must be
// exactly that call with the layer's options, forward and backward.

// What the layer computes, composed by hand in double from its parameters:
//   P_t = x·W_tᵀ + b_t (t = q, k, v; heads h·E .. h·E + E − 1 of each)
//   O = sdpa(P_q, P_k, P_v; so),   y = O·W_oᵀ + b_o
// and the backward: dO = dy·W_o, (dP_q, dP_k, dP_v) = sdpa backward (same so),
//   dx = Σ_t dP_t·W_t,  dW_t = dP_tᵀ·x,  dW_o = dyᵀ·O.
struct Composed {
  Tensor<double> y, dx, dw_in, dw_out;
};
Composed compose(const MultiheadAttention<double>& m, const Tensor<double>& x, const Tensor<double>& dy,
                 const SdpaOptions& so) {
  const int64_t B = x.dim(0), L = x.dim(1), D = x.dim(2), H = m.num_heads(), E = m.head_dim();
  const Tensor<double>&w_in = m.parameter("in_proj_weight"), &b_in = m.parameter("in_proj_bias"),
        &w_o = m.parameter("out_proj.weight"), &b_o = m.parameter("out_proj.bias");
  // fn(t, b, h, i, e, r, row) for every element (b, h, i, e) of `parts`
  // head tensors, with r = t·D + h·E + e its row of in_proj_weight (and
  // h·E + e its column of out_proj.weight) and row = b·L + i its token.
  auto each = [&](int64_t parts, auto fn) {
    for (int64_t t = 0; t < parts; ++t)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < L; ++i)
            for (int64_t e = 0; e < E; ++e) fn(t, b, h, i, e, t * D + h * E + e, b * L + i);
  };
  std::vector<Tensor<double>> P(3, Tensor<double>({B, H, L, E})), dP(3, Tensor<double>({B, H, L, E}));
  each(3, [&](int64_t t, int64_t b, int64_t h, int64_t i, int64_t e, int64_t r, int64_t row) {
    double s = b_in[size_t(r)];
    for (int64_t d = 0; d < D; ++d) s += x[size_t(row * D + d)] * w_in[size_t(r * D + d)];
    P[size_t(t)].view4()(b, h, i, e) = s;
  });
  SdpaArgs<double> a;
  a.q = P[0].view4(), a.k = P[1].view4(), a.v = P[2].view4();
  Tensor<double> o({B, H, L, E}), lse({B, H, L}), d_o({B, H, L, E});
  scaled_dot_product_attention<double>(a, {o.view4(), {}, lse.view<3>()}, so);
  Composed c{Tensor<double>({B, L, D}), Tensor<double>({B, L, D}), Tensor<double>({3 * D, D}),
             Tensor<double>({D, D})};
  const auto O = o.view4();
  for (size_t n = 0; n < c.y.size(); ++n) c.y[n] = b_o[n % size_t(D)];
  each(1, [&](int64_t, int64_t b, int64_t h, int64_t i, int64_t e, int64_t col, int64_t row) {
    double s = 0;
    for (int64_t n = 0; n < D; ++n) {
      c.y[size_t(row * D + n)] += O(b, h, i, e) * w_o[size_t(n * D + col)];
      s += dy[size_t(row * D + n)] * w_o[size_t(n * D + col)];
      c.dw_out[size_t(n * D + col)] += dy[size_t(row * D + n)] * O(b, h, i, e);
    }
    d_o.view4()(b, h, i, e) = s;
  });
  scaled_dot_product_attention_backward<double>(a, d_o.view4(), {o.view4(), lse.view<3>()},
                                                {dP[0].view4(), dP[1].view4(), dP[2].view4()}, so);
  each(3, [&](int64_t t, int64_t b, int64_t h, int64_t i, int64_t e, int64_t r, int64_t row) {
    const double g = dP[size_t(t)].view4()(b, h, i, e);
    for (int64_t d = 0; d < D; ++d) {
      c.dx[size_t(row * D + d)] += g * w_in[size_t(r * D + d)];
      c.dw_in[size_t(r * D + d)] += g * x[size_t(row * D + d)];
    }
  });
  return c;
}

MhaOptions layer_dropout(double p, uint64_t seed, uint64_t offset) {
  MhaOptions o;
  o.sdpa = dropout(p, seed, offset);
  o.sdpa.causal = true;
  return o;
}

TEST(Dropout, LayerIsTheDenseCallComposedByHand) {
  const int64_t B = 2, L = 9, D = 12, H = 3;
  std::mt19937_64 rng(31);
  MultiheadAttention<double> m(config(D, H), 4);
  randomize(m, rng);
  const Tensor<double> x = random_tensor<double>({B, L, D}, rng), dy = random_tensor<double>({B, L, D}, rng);
  const MhaOptions opt = layer_dropout(0.35, 1234, 5);
  Tensor<double> y({B, L, D}), dx({B, L, D});
  MhaSaved<double> saved;
  m.forward(inputs<double>(v3(x)), {.out = y.view<3>()}, opt, &saved);
  m.zero_grad();
  m.backward(saved, View3<const double>(dy.data(), {B, L, D}), {.dquery = dx.view<3>()});
  const Composed c = compose(m, x, dy, opt.sdpa);
  const double tol = tolerance<double>(D * D, 10.0, 200.0);
  EXPECT_TRUE(all_close(y, c.y, tol, "y"));
  EXPECT_TRUE(all_close(dx, c.dx, tol, "dx"));
  EXPECT_TRUE(all_close(m.grad("in_proj_weight"), c.dw_in, tol, "d in_proj_weight"));
  EXPECT_TRUE(all_close(m.grad("out_proj.weight"), c.dw_out, tol, "d out_proj.weight"));
  // The composition tells masks apart: without dropout, or with another
  // offset, it is far from the layer's output.
  for (const SdpaOptions& other : {layer_dropout(0, 0, 0).sdpa, layer_dropout(0.35, 1234, 6).sdpa}) {
    const Composed d = compose(m, x, dy, other);
    double diff = 0;
    for (size_t i = 0; i < y.size(); ++i) diff = std::max(diff, std::abs(y[i] - d.y[i]));
    EXPECT_GT(diff, 1e-2);
  }
}

// float32 on the fused path: the layer's attention output is the dense call
// on its own saved projections with its options, bit for bit (weights too).
TEST(Dropout, LayerAttentionIsTheDenseCallBitForBit) {
  const int64_t B = 2, L = 37, D = 32, H = 4, E = 8;
  std::mt19937_64 rng(8);
  MultiheadAttention<float> m(config(D, H), 2);
  randomize(m, rng);
  const Tensor<float> x = random_tensor<float>({B, L, D}, rng);
  const MhaOptions opt = layer_dropout(0.2, 99, 3);
  Tensor<float> y({B, L, D}), w({B, H, L, L});
  MhaSaved<float> saved;
  m.forward(inputs<float>(v3(x)), {.out = y.view<3>(), .head_weights = w.view4()},
            opt, &saved);
  SdpaArgs<float> a;
  a.q = saved.q(), a.k = saved.k(), a.v = saved.v();
  Tensor<float> o({B, L, H * E}), w2({B, H, L, L}), lse({B, H, L});
  scaled_dot_product_attention<float>(a, {View4<float>::bnhd(o.data(), B, L, H, E), w2.view4(), lse.view<3>()},
                                      opt.sdpa);
  EXPECT_TRUE(all_close(o, saved.attn_out, 0.0, "attention output"));
  EXPECT_TRUE(all_close(w2, w, 0.0, "head weights"));
  int64_t zeros = 0;
  for (size_t i = 0; i < w.size(); ++i) zeros += w[i] == 0;
  EXPECT_GT(zeros, int64_t(w.size()) / 2 + int64_t(w.size()) / 20);  // causal zeros plus the dropped ones
}

TEST(Dropout, LayerGradientsMatchFiniteDifferences) {
  const int64_t B = 2, L = 5, D = 6, H = 2;
  std::mt19937_64 rng(17);
  MultiheadAttention<double> m(config(D, H), 1);
  randomize(m, rng, 0.6);
  Tensor<double> x = random_tensor<double>({B, L, D}, rng);
  const Tensor<double> G = random_tensor<double>({B, L, D}, rng);
  const MhaOptions opt = layer_dropout(0.4, 7, 0);
  Tensor<double> y({B, L, D}), dx({B, L, D});
  MhaSaved<double> saved;
  const MhaArgs<double> args = inputs<double>(v3(x));
  m.forward(args, {.out = y.view<3>()}, opt, &saved);
  m.zero_grad();
  m.backward(saved, View3<const double>(G.data(), {B, L, D}), {.dquery = dx.view<3>()});
  auto loss = [&] {  // the same options: the same mask while the values move
    Tensor<double> out({B, L, D});
    m.forward(args, {.out = out.view<3>()}, opt);
    return dot(G, out);
  };
  EXPECT_TRUE(gradient_check(x, dx, loss, "dx"));
  for (const char* name : {"in_proj_weight", "in_proj_bias", "out_proj.weight"}) {
    const Tensor<double> g = m.grad(name);
    EXPECT_TRUE(gradient_check(m.parameter(name), g, loss, name));
  }
}

TEST(Dropout, LayerBitwiseTheSameForAnyThreadCount) {
  const int64_t B = 2, L = 140, D = 64, H = 4;
  std::mt19937_64 rng(12);
  const Tensor<float> x = random_tensor<float>({B, L, D}, rng), dy = random_tensor<float>({B, L, D}, rng);
  struct Out {
    Tensor<float> y, dx, dw;
  };
  auto run_with = [&](int threads) {
    std::mt19937_64 prng(3);
    MultiheadAttention<float> m(config(D, H), 0);
    randomize(m, prng);
    MhaOptions opt = layer_dropout(0.3, 5, 1);
    opt.sdpa.num_threads = threads;
    Out o{Tensor<float>({B, L, D}), Tensor<float>({B, L, D}), {}};
    MhaSaved<float> saved;
    m.forward(inputs<float>(v3(x)), {.out = o.y.view<3>()}, opt, &saved);
    m.backward(saved, View3<const float>(dy.data(), {B, L, D}), {.dquery = o.dx.view<3>()});
    o.dw = m.grad("in_proj_weight");
    return o;
  };
  const Out one = run_with(1);
  for (const int t : {2, 3}) {
    const Out r = run_with(t);
    EXPECT_TRUE(all_close(r.y, one.y, 0.0, "y")) << t << " threads";
    EXPECT_TRUE(all_close(r.dx, one.dx, 0.0, "dx")) << t << " threads";
    EXPECT_TRUE(all_close(r.dw, one.dw, 0.0, "d in_proj_weight")) << t << " threads";
  }
}

TEST(Dropout, LayerDecodeRefusesDropout) {
  MultiheadAttention<float> m(config(8, 2), 0);
  KVCacheConfig kc;
  kc.capacity = 4, kc.kv_heads = 2, kc.head_dim = 4;
  KVCache cache(kc);
  Tensor<float> x({1, 1, 8}), y({1, 1, 8});
  MhaOptions opt;
  opt.sdpa = dropout(0.1, 0);
  EXPECT_TRUE(throws_with<InvalidArgument>(
      [&] { m.decode(inputs<float>(v3(x)), cache, y.view<3>(), opt); },
      {"MultiheadAttention::decode", "option 'dropout_p' is not taken over a cache"}));
  EXPECT_EQ(cache.length(0), 0);  // refused before the cache changed
}

}  // namespace
