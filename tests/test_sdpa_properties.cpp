// Properties of the reference attention on random inputs: rows of A are
// distributions, self-attention is permutation-equivariant, causal outputs
// ignore the future, scores are the bilinear form X·M·Xᵀ, layouts and
// broadcasting agree, and nothing overflows.
#include <map>

#include "sdpa_case.hpp"

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace {

using namespace attn::testing;
using attn::Tensor;
using attn::Backend;
using attn::View3;
using attn::View4;

TEST(SdpaProperties, RowsOfAttentionAreDistributions) {
  std::mt19937_64 rng(1);
  for (MaskKind mk : {MaskKind::none, MaskKind::bool_full, MaskKind::bias_broadcast, MaskKind::key_lengths}) {
    SdpaCase<float> c({2, 3, 3, 7, 9, 5, 4}, rng);
    c.add_mask(mk, rng);
    Tensor<float> A, lse;
    c.forward(&A, &lse);
    auto a = A.view4();
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 3; ++h)
        for (int64_t i = 0; i < 7; ++i) {
          double sum = 0;
          for (int64_t j = 0; j < 9; ++j) {
            EXPECT_GE(a(b, h, i, j), 0.0f);
            sum += a(b, h, i, j);
          }
          const bool fully_masked = std::isinf(lse.view<3>()(b, h, i));
          EXPECT_NEAR(sum, fully_masked ? 0.0 : 1.0, 1e-5) << "mask kind " << int(mk) << " row " << i;
        }
  }
}

// Projects X (N, D) with W (F, D) into a (1, 1, N, F) tensor: X·Wᵀ.
Tensor<double> project(const Tensor<double>& X, const Tensor<double>& W) {
  const int64_t N = X.dim(0), D = X.dim(1), F = W.dim(0);
  Tensor<double> out({1, 1, N, F});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += X[size_t(n * D + d)] * W[size_t(f * D + d)];
      out[size_t(n * F + f)] = s;
    }
  return out;
}

struct SelfAttention {
  Tensor<double> Wq, Wk, Wv;
  Tensor<double> run(const Tensor<double>& X, bool causal, Tensor<double>* A = nullptr) const {
    const Tensor<double> Q = project(X, Wq), K = project(X, Wk), V = project(X, Wv);
    Tensor<double> Y({1, 1, X.dim(0), Wv.dim(0)});
    attn::SdpaArgs<double> args{{}, Q.view4(), K.view4(), V.view4()};
    attn::SdpaOptions opt;
    opt.causal = causal;
    View4<double> w;
    if (A) {
      *A = Tensor<double>({1, 1, X.dim(0), X.dim(0)});
      w = A->view4();
    }
    attn::scaled_dot_product_attention<double>(args, {Y.view4(), w}, opt);
    return Y;
  }
};

TEST(SdpaProperties, SelfAttentionIsPermutationEquivariant) {
  std::mt19937_64 rng(2);
  const int64_t N = 9, D = 6, E = 4, Ev = 5;
  SelfAttention sa{random_tensor<double>({E, D}, rng), random_tensor<double>({E, D}, rng),
                   random_tensor<double>({Ev, D}, rng)};
  const Tensor<double> X = random_tensor<double>({N, D}, rng);
  std::vector<int64_t> perm(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) perm[size_t(i)] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  Tensor<double> PX({N, D});
  for (int64_t i = 0; i < N; ++i)
    for (int64_t d = 0; d < D; ++d) PX[size_t(i * D + d)] = X[size_t(perm[size_t(i)] * D + d)];
  const Tensor<double> Y = sa.run(X, false), PY = sa.run(PX, false);
  Tensor<double> P_of_Y({1, 1, N, Ev});
  for (int64_t i = 0; i < N; ++i)
    for (int64_t e = 0; e < Ev; ++e) P_of_Y[size_t(i * Ev + e)] = Y[size_t(perm[size_t(i)] * Ev + e)];
  EXPECT_TRUE(all_close(PY, P_of_Y, 1e-12, "Attention(P X) vs P Attention(X)"));

  // A causal mask breaks the symmetry: the same check fails.
  const Tensor<double> Yc = sa.run(X, true), PYc = sa.run(PX, true);
  Tensor<double> P_of_Yc({1, 1, N, Ev});
  for (int64_t i = 0; i < N; ++i)
    for (int64_t e = 0; e < Ev; ++e) P_of_Yc[size_t(i * Ev + e)] = Yc[size_t(perm[size_t(i)] * Ev + e)];
  EXPECT_FALSE(all_close(PYc, P_of_Yc, 1e-6, "causal"));
}

TEST(SdpaProperties, CausalOutputsIgnoreFutureTokens) {
  std::mt19937_64 rng(3);
  const int64_t N = 8, D = 5;
  SelfAttention sa{random_tensor<double>({4, D}, rng), random_tensor<double>({4, D}, rng),
                   random_tensor<double>({3, D}, rng)};
  Tensor<double> X = random_tensor<double>({N, D}, rng);
  const Tensor<double> before = sa.run(X, true);
  const int64_t changed = 5;
  for (int64_t d = 0; d < D; ++d) X[size_t(changed * D + d)] += 3.0;
  const Tensor<double> after = sa.run(X, true);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t e = 0; e < 3; ++e) {
      const double diff = std::abs(after[size_t(i * 3 + e)] - before[size_t(i * 3 + e)]);
      if (i < changed) EXPECT_EQ(diff, 0.0) << "row " << i;
      else EXPECT_GT(diff, 0.0) << "row " << i;  // the changed token and later ones see it
    }
}

TEST(SdpaProperties, ScoresAreTheBilinearFormXMXt) {
  std::mt19937_64 rng(4);
  const int64_t N = 6, D = 5, E = 3;
  SelfAttention sa{random_tensor<double>({E, D}, rng), random_tensor<double>({E, D}, rng),
                   random_tensor<double>({2, D}, rng)};
  const Tensor<double> X = random_tensor<double>({N, D}, rng);
  Tensor<double> A;
  sa.run(X, false, &A);
  // M = W_Qᵀ·W_K (D×D).
  std::vector<double> M(size_t(D * D));
  for (int64_t a = 0; a < D; ++a)
    for (int64_t b = 0; b < D; ++b)
      for (int64_t e = 0; e < E; ++e) M[size_t(a * D + b)] += sa.Wq[size_t(e * D + a)] * sa.Wk[size_t(e * D + b)];
  double asym = 0;
  for (int64_t a = 0; a < D; ++a)
    for (int64_t b = 0; b < D; ++b) asym = std::max(asym, std::abs(M[size_t(a * D + b)] - M[size_t(b * D + a)]));
  EXPECT_GT(asym, 0.1) << "M = W_Q^T W_K is not symmetric in general";
  // A = softmax_row(X·M·Xᵀ / sqrt(E)).
  Tensor<double> expected({1, 1, N, N});
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> s(static_cast<size_t>(N));
    for (int64_t m = 0; m < N; ++m)
      for (int64_t a = 0; a < D; ++a)
        for (int64_t b = 0; b < D; ++b)
          s[size_t(m)] += X[size_t(n * D + a)] * M[size_t(a * D + b)] * X[size_t(m * D + b)] / std::sqrt(double(E));
    attn::softmax(s.data(), &expected[size_t(n * N)], N);
  }
  EXPECT_TRUE(all_close(A, expected, 1e-12, "A vs softmax(X M X^T / sqrt(E))"));
  double a_asym = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < N; ++m) a_asym = std::max(a_asym, std::abs(A[size_t(n * N + m)] - A[size_t(m * N + n)]));
  EXPECT_GT(a_asym, 1e-3) << "attention is not symmetric";
}

TEST(SdpaProperties, LayoutsAndStridesGiveIdenticalResults) {
  std::mt19937_64 rng(5);
  const CaseShape base{2, 4, 2, 5, 7, 6, 3};
  SdpaCase<float> a(base, rng);
  CaseShape other = base;
  other.layout = Layout::bnhd;
  other.pad = 3;
  std::mt19937_64 rng2(5);
  SdpaCase<float> b(other, rng2);
  // a's values in b's layout.
  b.qbuf.assign_values(a.args.q);
  b.kbuf.assign_values(a.args.k);
  b.vbuf.assign_values(a.args.v);
  EXPECT_TRUE(all_close(a.forward(), b.forward(), 0.0, "bhnd vs strided bnhd"));
}

TEST(SdpaProperties, GroupedQueryAttentionEqualsRepeatedKeysAndValues) {
  std::mt19937_64 rng(6);
  SdpaCase<double> gqa({2, 6, 2, 4, 5, 3, 2}, rng);
  SdpaCase<double> mha({2, 6, 6, 4, 5, 3, 2}, rng);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 6; ++h) {
      for (int64_t i = 0; i < 4; ++i)
        for (int64_t e = 0; e < 3; ++e) mha.qbuf[size_t(((b * 6 + h) * 4 + i) * 3 + e)] = gqa.args.q(b, h, i, e);
      for (int64_t j = 0; j < 5; ++j) {
        for (int64_t e = 0; e < 3; ++e) mha.kbuf[size_t(((b * 6 + h) * 5 + j) * 3 + e)] = gqa.args.k(b, h / 3, j, e);
        for (int64_t e = 0; e < 2; ++e) mha.vbuf[size_t(((b * 6 + h) * 5 + j) * 2 + e)] = gqa.args.v(b, h / 3, j, e);
      }
    }
  EXPECT_TRUE(all_close(gqa.forward(), mha.forward(), 1e-14, "GQA vs repeated K/V"));
}

TEST(SdpaProperties, MaskFormsAgree) {
  // A bool mask, the same mask as an additive -inf bias, a broadcast mask and
  // key lengths expressed as a mask all give the same output.
  std::mt19937_64 rng(8);
  SdpaCase<double> c({3, 2, 2, 4, 6, 3, 3}, rng);
  c.add_mask(MaskKind::key_lengths, rng);
  const Tensor<double> y_len = c.forward();
  Tensor<bool> m({3, 1, 1, 6});
  Tensor<double> bias({3, 1, 1, 6});
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t j = 0; j < 6; ++j) {
      const bool keep = j < c.key_lengths[size_t(b)];
      m.view4()(b, 0, 0, j) = keep;
      bias.view4()(b, 0, 0, j) = keep ? 0.0 : -std::numeric_limits<double>::infinity();
    }
  c.args.key_lengths = {};
  c.args.mask = m.view4();
  const Tensor<double> y_mask = c.forward();
  c.args.mask = {};
  c.args.bias = bias.view4();
  const Tensor<double> y_bias = c.forward();
  EXPECT_TRUE(all_close(y_mask, y_len, 0.0, "bool mask vs key_lengths"));
  EXPECT_TRUE(all_close(y_bias, y_len, 0.0, "-inf bias vs key_lengths"));
}

TEST(SdpaProperties, CausalAlignmentsFollowTheirDefinitions) {
  // L = 3 queries, S = 5 keys: top-left lets query i see keys 0..i,
  // bottom-right lets it see keys 0..i+2.
  std::mt19937_64 rng(9);
  for (auto align : {attn::CausalAlign::top_left, attn::CausalAlign::bottom_right}) {
    SdpaCase<double> c({1, 1, 1, 3, 5, 2, 2}, rng);
    c.opt.causal = true;
    c.opt.causal_align = align;
    Tensor<double> A;
    c.forward(&A);
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 5; ++j) {
        const int64_t last = align == attn::CausalAlign::top_left ? i : i + 2;
        if (j <= last) EXPECT_GT(A.view4()(0, 0, i, j), 0.0) << i << "," << j;
        else EXPECT_EQ(A.view4()(0, 0, i, j), 0.0) << i << "," << j;
      }
  }
  // Top-left with L > S leaves no row empty; bottom-right with L > S fully masks
  // the first L - S rows (output 0, lse -inf).
  SdpaCase<double> c({1, 1, 1, 5, 3, 2, 2}, rng);
  c.opt.causal = true;
  c.opt.causal_align = attn::CausalAlign::bottom_right;
  Tensor<double> lse;
  const Tensor<double> y = c.forward(nullptr, &lse);
  for (int64_t i = 0; i < 5; ++i) {
    if (i < 2) {
      EXPECT_TRUE(std::isinf(lse[size_t(i)]) && lse[size_t(i)] < 0);
      EXPECT_EQ(y[size_t(i * 2)], 0.0);
      EXPECT_EQ(y[size_t(i * 2 + 1)], 0.0);
    } else {
      EXPECT_TRUE(std::isfinite(lse[size_t(i)]));
    }
  }
}

TEST(SdpaStability, HugeScoresNeverOverflow) {
  // Scores of magnitude 1e4 (both signs) in float: softmax subtracts the row
  // maximum, so nothing overflows, forward or backward.
  std::mt19937_64 rng(10);
  SdpaCase<float> c({1, 2, 1, 6, 6, 4, 4}, rng, /*stddev=*/50.0);
  c.opt.scale = 1.0;  // unscaled: scores have standard deviation 2 * 50 * 50 = 5000
  Tensor<float> A, lse;
  const Tensor<float> y = c.forward(&A, &lse);
  EXPECT_TRUE(all_finite(y) && all_finite(A) && all_finite(lse));
  const Tensor<float> dout = random_tensor<float>({1, 2, 6, 4}, rng);
  const auto g = c.backward(dout, false);
  EXPECT_TRUE(all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv));
  // The weights match a softmax of the same scores computed in double here.
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 6; ++i) {
      double z[6], a[6], zabs = 0;
      for (int64_t j = 0; j < 6; ++j) {
        z[j] = 0;
        for (int64_t e = 0; e < 4; ++e) {
          z[j] += double(c.args.q(0, h, i, e)) * double(c.args.k(0, 0, j, e));
          zabs = std::max(zabs, std::abs(double(c.args.q(0, h, i, e)) * double(c.args.k(0, 0, j, e))));
        }
      }
      attn::softmax(z, a, 6);
      // A float32 backend rounds each score by about eps·Σ|q_e·k_e| (here
      // ~1e-3 absolute), which moves a weight by that much relative to itself.
      for (int64_t j = 0; j < 6; ++j)
        EXPECT_NEAR(A.view4()(0, h, i, j), a[j], 1e-5 + a[j] * 4 * 4 * 1.2e-7 * zabs) << h << "," << i << "," << j;
    }
}

TEST(SdpaStability, FullyMaskedRowsAreZeroNeverNaN) {
  std::mt19937_64 rng(11);
  for (MaskKind mk : {MaskKind::bool_full, MaskKind::bias_full, MaskKind::key_lengths}) {
    SdpaCase<float> c({2, 2, 2, 3, 4, 5, 3}, rng);
    c.add_mask(mk, rng);
    Tensor<float> A, lse;
    const Tensor<float> y = c.forward(&A, &lse);
    // Row (b=0, h=0, i=0) is fully masked by construction in every kind.
    EXPECT_TRUE(std::isinf(lse[0]) && lse[0] < 0);
    for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(y.view4()(0, 0, 0, e), 0.0f);
    for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(A.view4()(0, 0, 0, j), 0.0f);
    EXPECT_TRUE(all_finite(y) && all_finite(A));
    const Tensor<float> dout = random_tensor<float>({2, 2, 3, 3}, rng);
    const auto g = c.backward(dout, mk == MaskKind::bias_full);
    EXPECT_TRUE(all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv));
    for (int64_t e = 0; e < 5; ++e) EXPECT_EQ(g.dq.view4()(0, 0, 0, e), 0.0f);
    if (mk == MaskKind::bias_full) {
      EXPECT_TRUE(all_finite(g.dbias));
      for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(g.dbias.view4()(0, 0, 0, j), 0.0f);
    }
  }
}

TEST(Softmax, StableForLargeInputsAndEmptyRows) {
  const float big[3] = {1e4f, -1e4f, 1e4f - 1.0f};
  float y[3];
  const float lse = attn::softmax(big, y, 3);
  EXPECT_NEAR(y[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_EQ(y[1], 0.0f);
  EXPECT_NEAR(lse, 1e4 + std::log1p(std::exp(-1.0)), 1e-2);
  const float none[2] = {-INFINITY, -INFINITY};
  EXPECT_TRUE(std::isinf(attn::softmax(none, y, 2)));
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], 0.0f);
}

// The fused kernels flush results below 2^-126 to zero (FlushToZero in
// kernels/fused/common.hpp) and give the caller's thread its own mode back.
// One query, two keys: P = (1, e^-85), e^-85 ≈ 1.2e-37 a normal float, and
// dY = 1e-3, so the second key's exact dV, 1.2e-40, is subnormal: the
// reference (in double, rounded once) keeps it, the fused backward returns 0.
TEST(SdpaStability, FusedFlushesSubnormalResultsAndKeepsTheCallersMode) {
#if defined(__SSE__) || defined(__x86_64__)
  std::vector<float> q = {1, 0, 0, 0}, k = {0, 0, 0, 0, -170, 0, 0, 0}, v = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> dy = {1e-3f, 1e-3f, 1e-3f, 1e-3f};
  const attn::SdpaArgs<float> args{{}, View4<const float>(q.data(), {1, 1, 1, 4}), View4<const float>(k.data(), {1, 1, 2, 4}),
                                   View4<const float>(v.data(), {1, 1, 2, 4})};
  const unsigned saved = _mm_getcsr();
  for (const unsigned fz : {0u, 0x8000u}) {
    std::map<Backend, std::vector<float>> dv;
    for (const Backend be : {Backend::fused, Backend::reference}) {
      std::vector<float> out(4), lse(1), dq(4), dk(8);
      dv[be].assign(8, -1.0f);
      attn::SdpaOptions opt;
      opt.backend = be;
      opt.num_threads = 2;
      _mm_setcsr((saved & ~0x8000u) | fz);
      attn::scaled_dot_product_attention<float>(args, {View4<float>(out.data(), {1, 1, 1, 4}), {}, View3<float>(lse.data(), {1, 1, 1})}, opt);
      attn::scaled_dot_product_attention_backward<float>(
          args, View4<const float>(dy.data(), {1, 1, 1, 4}), {View4<const float>(out.data(), {1, 1, 1, 4}), View3<const float>(lse.data(), {1, 1, 1})},
          {View4<float>(dq.data(), {1, 1, 1, 4}), View4<float>(dk.data(), {1, 1, 2, 4}), View4<float>(dv[be].data(), {1, 1, 2, 4})}, opt);
      EXPECT_EQ(_mm_getcsr() & 0x8000u, fz) << "the call changed the caller's flush-to-zero mode";
      _mm_setcsr(saved);
    }
    for (int e = 0; e < 4; ++e) {
      EXPECT_NEAR(dv[Backend::fused][size_t(e)], 1e-3f, 1e-9f);  // the first key takes P = 1
      EXPECT_EQ(dv[Backend::fused][size_t(4 + e)], 0.0f) << "flushed: below 2^-126";
      if (fz) continue;  // (the caller's own flush applies to the reference's rounding to float)
      EXPECT_GT(dv[Backend::reference][size_t(4 + e)], 1e-41f);  // the exact value, about 1.2e-40
      EXPECT_LT(dv[Backend::reference][size_t(4 + e)], 1e-39f);
    }
  }
#else
  GTEST_SKIP() << "flush-to-zero is set on x86 only";
#endif
}

}  // namespace
