// Every nn layer: forward against its defining formula or known values,
// backward against central finite differences in double.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>

#include "attn/nn.hpp"
#include "testing.hpp"

namespace {

using attn::Tensor;
using attn::testing::dot;
using attn::testing::gradient_check;
using attn::testing::random_tensor;
namespace nn = attn::nn;

// Up to 200 elements of each tensor moved by ±h (the nn tensors are small).
const attn::testing::GradCheck kSampled{1e-6, 1e-6, 200, true};

TEST(NnRng, SameSeedSameStreamAndMoments) {
  nn::Rng a(42), b(42), c(43);
  for (int i = 0; i < 10; ++i) {
    const uint64_t x = a.next();
    EXPECT_EQ(x, b.next());
    EXPECT_NE(x, c.next());
  }
  // sample moments of 20000 normals: mean ~ 0 ± 0.01, variance ~ 1 ± 0.03
  nn::Rng r(7);
  double s = 0, s2 = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const double z = r.normal();
    s += z;
    s2 += z * z;
  }
  EXPECT_NEAR(s / n, 0.0, 0.03);
  EXPECT_NEAR(s2 / n, 1.0, 0.05);
  EXPECT_NE(nn::derive_seed(1, 0), nn::derive_seed(1, 1));
  EXPECT_EQ(nn::derive_seed(5, 3), nn::derive_seed(5, 3));
}

TEST(NnLinear, ForwardMatchesFormulaAndGradients) {
  std::mt19937_64 rng(1);
  nn::Linear<double> lin(5, 3);
  nn::Rng init(3);
  lin.reset_parameters(init);
  auto x = random_tensor<double>({4, 5}, rng);
  auto r = random_tensor<double>({4, 3}, rng);
  Tensor<double> y;
  lin.forward(x, y);
  for (int m = 0; m < 4; ++m)
    for (int o = 0; o < 3; ++o) {
      double want = lin.bias[size_t(o)];
      for (int i = 0; i < 5; ++i) want += x[size_t(m * 5 + i)] * lin.weight[size_t(o * 5 + i)];
      EXPECT_NEAR(y[size_t(m * 3 + o)], want, 1e-12);
    }
  Tensor<double> dx;
  lin.zero_grad();
  lin.backward(x, r, &dx);
  auto F = [&] {
    Tensor<double> yy;
    lin.forward(x, yy);
    return dot(r, yy);
  };
  EXPECT_TRUE(gradient_check(x, dx, F, "dx", kSampled));
  EXPECT_TRUE(gradient_check(lin.weight, lin.dweight, F, "dW", kSampled));
  EXPECT_TRUE(gradient_check(lin.bias, lin.dbias, F, "db", kSampled));
}

TEST(NnLinear, RejectsWrongInputWidth) {
  nn::Linear<double> lin(5, 3);
  Tensor<double> x({4, 6}), y;
  EXPECT_TRUE(attn::testing::throws_with([&] { lin.forward(x, y); },
                                         {"attn::nn::Linear::forward", "'x'", "(4, 6)", "(M, 5)"}));
}

TEST(NnEmbedding, LooksUpRowsAndAccumulatesRepeatedTokens) {
  std::mt19937_64 rng(2);
  nn::Embedding<double> emb(6, 4);
  nn::Rng init(1);
  emb.reset_parameters(init);
  const int32_t tokens[5] = {1, 3, 1, 5, 0};
  Tensor<double> y;
  emb.forward(tokens, 5, y);
  for (int m = 0; m < 5; ++m)
    for (int d = 0; d < 4; ++d) EXPECT_EQ(y[size_t(m * 4 + d)], emb.weight[size_t(tokens[m] * 4 + d)]);
  auto r = random_tensor<double>({5, 4}, rng);
  emb.zero_grad();
  emb.backward(tokens, 5, r);
  auto F = [&] {
    Tensor<double> yy;
    emb.forward(tokens, 5, yy);
    return dot(r, yy);
  };
  EXPECT_TRUE(gradient_check(emb.weight, emb.dweight, F, "dW", kSampled));
  const int32_t bad[2] = {1, 6};
  EXPECT_TRUE(attn::testing::throws_with([&] { emb.forward(bad, 2, y); },
                                         {"Embedding::forward", "token id 6", "position 1", "vocab = 6"}));
}

TEST(NnPositions, SinusoidalValues) {
  Tensor<double> x({2 * 3, 4});
  nn::add_sinusoidal_positions(x, 2, 3);
  for (int b = 0; b < 2; ++b)
    for (int n = 0; n < 3; ++n) {
      const double* row = x.data() + (b * 3 + n) * 4;
      EXPECT_NEAR(row[0], std::sin(n), 1e-15);
      EXPECT_NEAR(row[1], std::cos(n), 1e-15);
      EXPECT_NEAR(row[2], std::sin(n * 0.01), 1e-15);  // ω_1 = 10000^(-2/4)
      EXPECT_NEAR(row[3], std::cos(n * 0.01), 1e-15);
    }
}

TEST(NnPositions, LearnedAddsTableAndGradientSumsOverBatch) {
  std::mt19937_64 rng(3);
  nn::LearnedPositions<double> pos(6, 4);
  nn::Rng init(2);
  pos.reset_parameters(init);
  auto x0 = random_tensor<double>({3 * 5, 4}, rng);
  auto r = random_tensor<double>({3 * 5, 4}, rng);
  Tensor<double> x = x0;
  pos.forward(x, 3, 5);
  EXPECT_EQ(x[size_t((2 * 5 + 4) * 4 + 1)], x0[size_t((2 * 5 + 4) * 4 + 1)] + pos.weight[size_t(4 * 4 + 1)]);
  pos.zero_grad();
  pos.backward(r, 3, 5);
  auto F = [&] {
    Tensor<double> xx = x0;
    pos.forward(xx, 3, 5);
    return dot(r, xx);
  };
  EXPECT_TRUE(gradient_check(pos.weight, pos.dweight, F, "dP", kSampled));
  Tensor<double> too_long({7, 4});
  EXPECT_TRUE(attn::testing::throws_with([&] { pos.forward(too_long, 1, 7); }, {"max_len 6"}));
}

TEST(NnPositions, RotaryIsARelativeRotation) {
  std::mt19937_64 rng(4);
  // (B, H, N, E) = (1, 1, 6, 8): the same q and k vector placed at every position
  auto q1 = random_tensor<double>({8}, rng), k1 = random_tensor<double>({8}, rng);
  Tensor<double> q({1, 1, 6, 8}), k({1, 1, 6, 8});
  for (int n = 0; n < 6; ++n)
    for (int e = 0; e < 8; ++e) {
      q[size_t(n * 8 + e)] = q1[size_t(e)];
      k[size_t(n * 8 + e)] = k1[size_t(e)];
    }
  const Tensor<double> q0 = q;
  nn::apply_rotary(q.view4());
  nn::apply_rotary(k.view4());
  auto dotp = [&](int m, int n) {
    double s = 0;
    for (int e = 0; e < 8; ++e) s += q[size_t(m * 8 + e)] * k[size_t(n * 8 + e)];
    return s;
  };
  // q_m·k_n depends only on m − n; position 0 is unrotated; norms are kept
  EXPECT_NEAR(dotp(3, 1), dotp(5, 3), 1e-12);
  EXPECT_NEAR(dotp(1, 4), dotp(2, 5), 1e-12);
  EXPECT_NE(std::abs(dotp(3, 1) - dotp(3, 2)), 0.0);
  for (int e = 0; e < 8; ++e) EXPECT_EQ(q[size_t(e)], q0[size_t(e)]);
  double n0 = 0, n5 = 0;
  for (int e = 0; e < 8; ++e) {
    n0 += q0[size_t(5 * 8 + e)] * q0[size_t(5 * 8 + e)];
    n5 += q[size_t(5 * 8 + e)] * q[size_t(5 * 8 + e)];
  }
  EXPECT_NEAR(n0, n5, 1e-12);
  // the inverse rotation undoes it
  nn::apply_rotary(q.view4(), /*inverse=*/true);
  EXPECT_TRUE(attn::testing::all_close(q, q0, 1e-14, "inverse"));
  Tensor<double> odd({1, 1, 2, 3});
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::apply_rotary(odd.view4()); }, {"E = 3", "even"}));
}

TEST(NnLayerNorm, NormalisesRowsAndGradients) {
  std::mt19937_64 rng(5);
  nn::LayerNorm<double> ln(6);
  for (int j = 0; j < 6; ++j) {
    ln.weight[size_t(j)] = 0.5 + 0.1 * j;
    ln.bias[size_t(j)] = 0.2 * j - 0.3;
  }
  auto x = random_tensor<double>({4, 6}, rng, 3.0);
  Tensor<double> y;
  nn::LayerNorm<double> plain(6);
  plain.forward(x, y);
  for (int m = 0; m < 4; ++m) {
    double s = 0, s2 = 0;
    for (int j = 0; j < 6; ++j) {
      s += y[size_t(m * 6 + j)];
      s2 += y[size_t(m * 6 + j)] * y[size_t(m * 6 + j)];
    }
    EXPECT_NEAR(s / 6, 0.0, 1e-12);
    EXPECT_NEAR(s2 / 6, 1.0, 1e-5);  // var/(var + eps)
  }
  auto r = random_tensor<double>({4, 6}, rng);
  ln.forward(x, y);
  Tensor<double> dx;
  ln.zero_grad();
  ln.backward(x, r, &dx);
  auto F = [&] {
    Tensor<double> yy;
    ln.forward(x, yy);
    return dot(r, yy);
  };
  EXPECT_TRUE(gradient_check(x, dx, F, "dx", kSampled));
  EXPECT_TRUE(gradient_check(ln.weight, ln.dweight, F, "dgamma", kSampled));
  EXPECT_TRUE(gradient_check(ln.bias, ln.dbias, F, "dbeta", kSampled));
}

TEST(NnGelu, KnownValuesAndDerivative) {
  const double x[4] = {-2.0, 0.0, 1.0, 3.0};
  double y[4];
  nn::gelu_forward(x, y, 4);
  // x·Φ(x): Φ(1) = 0.8413447460685429, Φ(−2) = 0.022750131948179195
  EXPECT_NEAR(y[0], -2.0 * 0.022750131948179195, 1e-15);
  EXPECT_EQ(y[1], 0.0);
  EXPECT_NEAR(y[2], 0.8413447460685429, 1e-15);
  const double ones[4] = {1, 1, 1, 1};
  double d[4];
  nn::gelu_backward(x, ones, d, 4);
  // Σ_i gelu(x_i) has the gradient d (dy = 1).
  Tensor<double> xt({4}), dt({4});
  for (int i = 0; i < 4; ++i) xt[size_t(i)] = x[i], dt[size_t(i)] = d[i];
  auto F = [&] {
    double yy[4];
    nn::gelu_forward(xt.data(), yy, 4);
    return yy[0] + yy[1] + yy[2] + yy[3];
  };
  EXPECT_TRUE(gradient_check(xt, dt, F, "gelu'"));
  EXPECT_NEAR(d[1], 0.5, 1e-15);
}

TEST(NnMlp, Gradients) {
  std::mt19937_64 rng(6);
  nn::Mlp<double> mlp(4, 10);
  nn::Rng init(5);
  mlp.reset_parameters(init);
  auto x = random_tensor<double>({3, 4}, rng);
  auto r = random_tensor<double>({3, 4}, rng);
  Tensor<double> y, dx;
  mlp.forward(x, y);
  mlp.zero_grad();
  mlp.backward(x, r, &dx);
  auto F = [&] {
    Tensor<double> yy;
    mlp.forward(x, yy);
    return dot(r, yy);
  };
  EXPECT_TRUE(gradient_check(x, dx, F, "dx", kSampled));
  EXPECT_TRUE(gradient_check(mlp.fc1.weight, mlp.fc1.dweight, F, "dW1", kSampled));
  EXPECT_TRUE(gradient_check(mlp.fc1.bias, mlp.fc1.dbias, F, "db1", kSampled));
  EXPECT_TRUE(gradient_check(mlp.fc2.weight, mlp.fc2.dweight, F, "dW2", kSampled));
  EXPECT_TRUE(gradient_check(mlp.fc2.bias, mlp.fc2.dbias, F, "db2", kSampled));
}

struct AttnCase {
  const char* name;
  attn::MhaOptions opt;
  nn::Positions positions;  // rope and alibi act inside the layer
  bool sinks = false;
};

attn::MhaOptions opts(bool causal, std::optional<double> scale = {}, attn::Window window = {}) {
  attn::MhaOptions o;
  o.sdpa.causal = causal;
  o.sdpa.scale = scale;
  o.sdpa.window = window;
  return o;
}

class NnSelfAttention : public ::testing::TestWithParam<AttnCase> {};

// The wrapper's own part, the RoPE transform between projection and
// attention, against finite differences (the layer's other gradients are
// test_multihead_backward's).
TEST_P(NnSelfAttention, Gradients) {
  const auto& c = GetParam();
  std::mt19937_64 rng(7);
  const int64_t B = 2, N = 5, D = 8, H = 2;
  nn::SelfAttention<double> att(D, H, c.opt, c.positions, c.sinks);
  nn::Rng init(11);
  att.reset_parameters(init);
  // non-zero biases so their gradients are exercised away from 0
  for (const char* name : {"in_proj_bias", "out_proj.bias", "sinks"}) {
    if (std::string(name) == "sinks" && !c.sinks) continue;
    Tensor<double>& b = att.layer.parameter(name);
    for (size_t i = 0; i < b.size(); ++i) b[i] = 0.1 * init.normal();
  }
  auto x = random_tensor<double>({B * N, D}, rng);
  auto r = random_tensor<double>({B * N, D}, rng);
  Tensor<double> y, dx;
  att.forward(x, B, N, y);
  att.zero_grad();
  att.backward(x, r, &dx);
  auto F = [&] {
    Tensor<double> yy;
    att.forward(x, B, N, yy);
    return dot(r, yy);
  };
  EXPECT_TRUE(gradient_check(x, dx, F, "dx", kSampled));
  for (const auto& name : att.layer.parameter_names())
    EXPECT_TRUE(gradient_check(att.layer.parameter(name), att.layer.grad(name), F, name, kSampled));
  // collect() hands the optimizer the layer's own tensors, PyTorch-named.
  std::vector<nn::ParamRef<double>> refs;
  att.collect("attn.", refs);
  ASSERT_EQ(refs.size(), c.sinks ? 5u : 4u);
  if (c.sinks) {
    EXPECT_EQ(refs[4].name, "attn.sinks");
    EXPECT_FALSE(refs[4].decay);
  }
  EXPECT_EQ(refs[0].name, "attn.in_proj_weight");
  EXPECT_EQ(refs[0].value, &att.layer.parameter("in_proj_weight"));
  EXPECT_EQ(refs[0].grad, &att.layer.grad("in_proj_weight"));
  EXPECT_TRUE(refs[0].decay);
  EXPECT_FALSE(refs[1].decay);
}

INSTANTIATE_TEST_SUITE_P(Variants, NnSelfAttention,
                         ::testing::Values(AttnCase{"plain", opts(false), nn::Positions::none},
                                           AttnCase{"causal", opts(true), nn::Positions::none},
                                           AttnCase{"rope", opts(false), nn::Positions::rope},
                                           AttnCase{"causal_rope", opts(true), nn::Positions::rope},
                                           AttnCase{"unscaled", opts(false, 1.0), nn::Positions::none},
                                           AttnCase{"alibi", opts(false), nn::Positions::alibi},
                                           AttnCase{"causal_window_sinks", opts(true, {}, {2, -1}),
                                                    nn::Positions::none, true},
                                           AttnCase{"alibi_window_sinks", opts(false, {}, {1, 2}),
                                                    nn::Positions::alibi, true}),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

// With RoPE, the layer's output equals the plain per-head formula computed
// from rotated q and k: q_n, k_n of each head rotated pairwise by n·θ_i.
TEST(NnSelfAttentionForward, RopeMatchesPlainFormula) {
  std::mt19937_64 rng(8);
  const int64_t B = 1, N = 4, D = 8, H = 2, E = 4;
  nn::SelfAttention<double> att(D, H, {}, nn::Positions::rope);
  nn::Rng init(3);
  att.reset_parameters(init);
  auto x = random_tensor<double>({B * N, D}, rng);
  Tensor<double> y;
  att.forward(x, B, N, y);
  const Tensor<double>& w_in = att.layer.parameter("in_proj_weight");
  const Tensor<double>& w_out = att.layer.parameter("out_proj.weight");
  // q, k, v for every token, then q and k rotated, then per head
  // softmax(q·k/√E)·v, then out_proj
  std::vector<double> qkv(size_t(N * 3 * D));
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < 3 * D; ++o) {
      double s = 0;
      for (int i = 0; i < D; ++i) s += w_in[size_t(o * D + i)] * x[size_t(n * D + i)];
      qkv[size_t(n * 3 * D + o)] = s;
    }
  for (int n = 0; n < N; ++n)
    for (int part = 0; part < 2; ++part)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < E / 2; ++i) {
          const double angle = n * std::pow(10000.0, -2.0 * i / double(E));
          double* p = &qkv[size_t(n * 3 * D + part * D + h * E + 2 * i)];
          const double a = p[0], b = p[1];
          p[0] = a * std::cos(angle) - b * std::sin(angle);
          p[1] = a * std::sin(angle) + b * std::cos(angle);
        }
  std::vector<double> o(size_t(N * D));
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < N; ++i) {
      std::vector<double> w(static_cast<size_t>(N));
      double mx = -1e300, sum = 0;
      for (int j = 0; j < N; ++j) {
        double s = 0;
        for (int e = 0; e < E; ++e) s += qkv[size_t(i * 3 * D + h * E + e)] * qkv[size_t(j * 3 * D + D + h * E + e)];
        w[size_t(j)] = s / std::sqrt(double(E));
        mx = std::max(mx, w[size_t(j)]);
      }
      for (auto& v : w) sum += (v = std::exp(v - mx));
      for (int e = 0; e < E; ++e) {
        double acc = 0;
        for (int j = 0; j < N; ++j) acc += w[size_t(j)] / sum * qkv[size_t(j * 3 * D + 2 * D + h * E + e)];
        o[size_t(i * D + h * E + e)] = acc;
      }
    }
  for (int n = 0; n < N; ++n)
    for (int d = 0; d < D; ++d) {
      double s = 0;
      for (int i = 0; i < D; ++i) s += w_out[size_t(d * D + i)] * o[size_t(n * D + i)];
      EXPECT_NEAR(y[size_t(n * D + d)], s, 1e-12);
    }
}

TEST(NnSelfAttentionForward, ScoreStatsFollowTheScale) {
  // q·k of unit-variance vectors has variance E; the 1/√E scale brings it to ~1
  std::mt19937_64 rng(9);
  const int64_t B = 4, N = 16, D = 64;
  nn::SelfAttention<double> scaled(D, 1), unscaled(D, 1, opts(false, 1.0));
  nn::Rng i1(1), i2(1);
  scaled.reset_parameters(i1);
  unscaled.reset_parameters(i2);
  auto x = random_tensor<double>({B * N, D}, rng);
  Tensor<double> y;
  scaled.forward(x, B, N, y);
  unscaled.forward(x, B, N, y);
  const auto s = scaled.score_stats(), u = unscaled.score_stats();
  EXPECT_NEAR(u.score_std / s.score_std, 8.0, 1e-9);  // √64
  EXPECT_GT(u.mean_top_weight, s.mean_top_weight);
  EXPECT_GE(s.mean_top_weight, 1.0 / N);
  EXPECT_LE(u.mean_top_weight, 1.0);
}

TEST(NnSelfAttention, RejectsOddRopeHeadsAndBadShapes) {
  EXPECT_TRUE(attn::testing::throws_with([] { nn::SelfAttention<float>(6, 2, {}, nn::Positions::rope); },
                                         {"attn::nn::SelfAttention", "even head dimension", "E = 3"}));
  EXPECT_TRUE(attn::testing::throws_with([] { nn::SelfAttention<float>(6, 4); }, {"multiple of heads = 4"}));
  nn::SelfAttention<float> att(4, 2);
  Tensor<float> x({6, 4}), y;
  EXPECT_TRUE(attn::testing::throws_with([&] { att.forward(x, 2, 2, y); }, {"x has 6 rows", "B·N"}));
  EXPECT_TRUE(attn::testing::throws_with([&] { att.backward(x, x, nullptr); }, {"backward", "forward's B·N"}));
}

TEST(NnCrossEntropy, ValuesAndGradient) {
  std::mt19937_64 rng(10);
  Tensor<double> logits({4, 5});
  const int32_t uniform_targets[4] = {0, 3, -1, 4};
  auto res = nn::softmax_cross_entropy<double>(logits, uniform_targets, nullptr);
  EXPECT_EQ(res.count, 3);
  EXPECT_NEAR(res.loss, std::log(5.0), 1e-15);  // uniform logits
  logits = random_tensor<double>({4, 5}, rng, 2.0);
  Tensor<double> dl;
  res = nn::softmax_cross_entropy<double>(logits, uniform_targets, &dl);
  for (int j = 0; j < 5; ++j) EXPECT_EQ(dl[size_t(2 * 5 + j)], 0.0);  // ignored row
  auto F = [&] { return nn::softmax_cross_entropy<double>(logits, uniform_targets, nullptr).loss; };
  EXPECT_TRUE(gradient_check(logits, dl, F, "dlogits", kSampled));
  const int32_t bad[4] = {0, 5, 0, 0};
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::softmax_cross_entropy<double>(logits, bad, nullptr); },
                                         {"target 5", "row 1", "V = 5"}));
}

}  // namespace
