// The whole transformer against finite differences (with dropout too, its
// masks fixed by one key), seeded initialisation, dropout only in training
// forwards, the optimizers against hand-computed steps, clipping and the
// schedule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attn/nn.hpp"
#include "testing.hpp"

namespace {

using attn::Tensor;
using attn::testing::gradient_check;
namespace nn = attn::nn;

struct ModelCase {
  const char* name;
  nn::Positions positions;
  bool causal;
  bool unscaled;
  double dropout = 0;  // > 0: training forwards with one key, so the masks stay fixed
};

// A model configuration of these sizes, every other field at its default.
nn::ModelConfig sized(int64_t vocab, int64_t max_len, int64_t dim, int64_t heads, int64_t layers) {
  nn::ModelConfig mc;
  mc.vocab = vocab, mc.max_len = max_len, mc.dim = dim, mc.heads = heads, mc.layers = layers;
  return mc;
}

class NnTransformerGrad : public ::testing::TestWithParam<ModelCase> {};

TEST_P(NnTransformerGrad, EveryParameterMatchesFiniteDifferences) {
  const auto& c = GetParam();
  nn::ModelConfig mc = sized(7, 6, 8, 2, 2);
  mc.mlp_hidden = 12;
  mc.positions = c.positions;
  mc.causal = c.causal;
  mc.dropout = c.dropout;
  if (c.unscaled) mc.attn_scale = 1.0;
  nn::Transformer<double> model(mc, 5);
  const std::optional<nn::DropoutKey> key =
      c.dropout > 0 ? std::optional<nn::DropoutKey>(nn::DropoutKey{11, 2}) : std::nullopt;
  // perturb the LayerNorm and bias parameters away from their 1/0 init
  nn::Rng r(9);
  for (auto& p : model.parameters())
    if (p.name.find("ln") != std::string::npos || p.name.find("bias") != std::string::npos)
      for (size_t i = 0; i < p.value->size(); ++i) (*p.value)[i] += 0.2 * r.normal();
  const int64_t B = 2, N = 5;
  std::vector<int32_t> tokens(B * N), targets(B * N);
  for (int64_t i = 0; i < B * N; ++i) {
    tokens[size_t(i)] = int32_t(r.below(7));
    targets[size_t(i)] = i % 3 == 0 ? -1 : int32_t(r.below(7));
  }
  model.zero_grad();
  const auto res = model.loss(tokens.data(), targets.data(), B, N, true, key);
  EXPECT_GT(res.loss, 0.5);
  auto F = [&] { return model.loss(tokens.data(), targets.data(), B, N, false, key).loss; };
  for (auto& p : model.parameters()) {
    const Tensor<double> g = *p.grad;  // F re-runs forward only, grads stay
    EXPECT_TRUE(gradient_check(*p.value, g, F, p.name, {1e-6, 1e-6, 24, true})) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, NnTransformerGrad,
                         ::testing::Values(ModelCase{"sinusoidal", nn::Positions::sinusoidal, false, false},
                                           ModelCase{"learned_causal", nn::Positions::learned, true, false},
                                           ModelCase{"rope", nn::Positions::rope, false, false},
                                           ModelCase{"none_unscaled", nn::Positions::none, false, true},
                                           ModelCase{"rope_dropout", nn::Positions::rope, true, false, 0.3}),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

TEST(NnTransformer, SeededInitIsReproducible) {
  nn::ModelConfig mc;
  mc.vocab = 10;
  mc.max_len = 8;
  mc.dim = 16;
  mc.heads = 2;
  mc.positions = nn::Positions::learned;
  nn::Transformer<float> a(mc, 3), b(mc, 3), c(mc, 4);
  auto pa = a.parameters(), pb = b.parameters(), pc = c.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  bool any_diff = false;
  for (size_t k = 0; k < pa.size(); ++k) {
    EXPECT_EQ(pa[k].name, pb[k].name);
    for (size_t i = 0; i < pa[k].value->size(); ++i) {
      EXPECT_EQ((*pa[k].value)[i], (*pb[k].value)[i]) << pa[k].name;
      any_diff = any_diff || (*pa[k].value)[i] != (*pc[k].value)[i];
    }
  }
  EXPECT_TRUE(any_diff);
  // parameter count: embed 160 + pos 128 + 2 blocks·(ln 64 + attn 1088 + mlp 2128) + ln_f 32 + head 170
  EXPECT_EQ(a.num_parameters(), 160 + 128 + 2 * (64 + 1088 + 2128) + 32 + 170);
}

// A model with chunked attention (Llama 4's local layers) keeps every token
// inside its own chunk, through all layers: changing the tokens of one chunk
// leaves the logits of every other chunk exactly as they were, and the
// training gradient matches finite differences.
TEST(NnTransformer, ChunkedLayersKeepTokensInTheirChunk) {
  nn::ModelConfig mc;
  mc.vocab = 9, mc.max_len = 12, mc.dim = 8, mc.heads = 2, mc.layers = 2, mc.mlp_hidden = 12;
  mc.causal = true, mc.chunk_size = 4;
  mc.positions = nn::Positions::rope;
  nn::Transformer<double> model(mc, 3);
  const int64_t B = 1, N = 12, V = 9;
  std::vector<int32_t> tokens(N), changed;
  nn::Rng r(4);
  for (auto& t : tokens) t = int32_t(r.below(9));
  changed = tokens;
  for (int64_t i = 4; i < 8; ++i) changed[size_t(i)] = int32_t((tokens[size_t(i)] + 1) % 9);  // chunk 1 only
  Tensor<double> a, b;
  model.forward(tokens.data(), B, N, a);
  model.forward(changed.data(), B, N, b);
  for (int64_t i = 0; i < N; ++i) {
    bool same = true;
    for (int64_t v = 0; v < V; ++v) same = same && a[size_t(i * V + v)] == b[size_t(i * V + v)];
    EXPECT_EQ(same, i < 4 || i >= 8) << "position " << i;
  }
  std::vector<int32_t> targets(N);
  for (auto& t : targets) t = int32_t(r.below(9));
  model.zero_grad();
  (void)model.loss(tokens.data(), targets.data(), B, N, true);
  auto F = [&] { return model.loss(tokens.data(), targets.data(), B, N, false).loss; };
  for (auto& p : model.parameters()) {
    const Tensor<double> g = *p.grad;
    EXPECT_TRUE(gradient_check(*p.value, g, F, p.name, {1e-6, 1e-6, 24, true}));
  }
}

TEST(NnTransformer, ReturnsEveryLayersAttention) {
  // The weights a heatmap draws: one (B, H, N, N) tensor per layer, rows on
  // the probability simplex, zero above the diagonal when causal.
  nn::ModelConfig mc = sized(6, 5, 8, 2, 3);
  mc.causal = true;
  nn::Transformer<double> model(mc, 2);
  const int32_t tokens[10] = {1, 2, 3, 4, 5, 0, 1, 2, 3, 4};
  Tensor<double> logits, again;
  std::vector<Tensor<double>> att;
  model.forward(tokens, 2, 5, logits, &att);
  model.forward(tokens, 2, 5, again);
  EXPECT_TRUE(attn::testing::all_close(again, logits, 0.0, "logits with and without capture"));
  ASSERT_EQ(att.size(), 3u);
  for (const auto& a : att) {
    ASSERT_EQ(a.shape(), (std::vector<int64_t>{2, 2, 5, 5}));
    for (int64_t r = 0; r < 2 * 2 * 5; ++r) {
      const int64_t i = r % 5;
      double sum = 0;
      for (int64_t j = 0; j < 5; ++j) {
        const double w = a[size_t(r * 5 + j)];
        if (j > i) {
          EXPECT_EQ(w, 0.0);
        }
        EXPECT_GE(w, 0.0);
        sum += w;
      }
      EXPECT_NEAR(sum, 1.0, 1e-12);
    }
  }
}

// The shapes checkpoint readers check a file against (before building the
// model) are the ones the model really has, name for name, in order.
TEST(NnTransformer, ParameterShapesAreTheModelsWithoutBuildingIt) {
  for (const auto positions : {nn::Positions::learned, nn::Positions::rope, nn::Positions::sinusoidal})
    for (const int64_t layers : {0, 1, 3})
      for (const int64_t hidden : {0, 12}) {
        nn::ModelConfig mc;
        mc.vocab = 9;
        mc.max_len = 5;
        mc.dim = 8;
        mc.heads = 2;
        mc.layers = layers;
        mc.mlp_hidden = hidden;
        mc.positions = positions;
        nn::Transformer<float> model(mc);
        const auto shapes = nn::parameter_shapes(mc);
        const auto params = model.parameters();
        ASSERT_EQ(shapes.size(), params.size()) << layers;
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_EQ(shapes[i].first, params[i].name);
          EXPECT_EQ(shapes[i].second, params[i].value->shape()) << params[i].name;
        }
      }
  nn::ModelConfig bad;
  bad.vocab = 4;
  bad.max_len = 3;
  bad.dim = 6;
  bad.heads = 4;
  EXPECT_THROW(nn::parameter_shapes(bad), attn::Error);
}

// Attention dropout acts only in forwards given a key (training steps): without
// one a model with dropout computes exactly what the model without it does
// (evaluation too); with one, each block drops its own weights, the same key
// gives the same logits, another key others; and a training step is the same
// bit for bit for any thread count.
TEST(NnTransformer, DropoutOnlyInTrainingForwards) {
  const nn::ModelConfig mc = sized(9, 12, 16, 2, 2);
  nn::ModelConfig with = mc;
  with.dropout = 0.3;
  nn::Transformer<float> plain(mc, 4), drop(with, 4);
  const int64_t B = 3, N = 12;
  nn::Rng r(2);
  std::vector<int32_t> tokens(B * N), targets(B * N);
  for (auto& t : tokens) t = int32_t(r.below(9));
  for (auto& t : targets) t = int32_t(r.below(9));
  Tensor<float> a, b, k1, k1again, k2, p1;
  plain.forward(tokens.data(), B, N, a);
  drop.forward(tokens.data(), B, N, b);
  EXPECT_TRUE(attn::testing::all_close(b, a, 0.0, "no key"));
  std::vector<Tensor<float>> w;
  drop.forward(tokens.data(), B, N, k1, &w, nn::DropoutKey{5, 0});
  drop.forward(tokens.data(), B, N, k1again, nullptr, nn::DropoutKey{5, 0});
  drop.forward(tokens.data(), B, N, k2, nullptr, nn::DropoutKey{6, 0});
  plain.forward(tokens.data(), B, N, p1, nullptr, nn::DropoutKey{5, 0});
  EXPECT_TRUE(attn::testing::all_close(k1again, k1, 0.0, "the same key"));
  EXPECT_TRUE(attn::testing::all_close(p1, a, 0.0, "dropout 0 with a key"));
  EXPECT_FALSE(attn::testing::all_close(k1, a, 1e-3, "dropped"));
  EXPECT_FALSE(attn::testing::all_close(k2, k1, 1e-3, "another key"));
  // each block drops about 30% of its weights (no mask: every weight is > 0
  // before dropout), and not the same ones as the other block
  ASSERT_EQ(w.size(), 2u);
  int64_t zeros[2] = {0, 0}, both = 0;
  for (size_t i = 0; i < w[0].size(); ++i) {
    zeros[0] += w[0][i] == 0, zeros[1] += w[1][i] == 0;
    both += w[0][i] == 0 && w[1][i] == 0;
  }
  const double n = double(w[0].size());  // 864 weights per block; bounds at 6σ
  for (const int64_t z : zeros) EXPECT_NEAR(double(z) / n, 0.3, 6 * std::sqrt(0.3 * 0.7 / n));
  EXPECT_NEAR(double(both) / n, 0.09, 6 * std::sqrt(0.09 * 0.91 / n));  // independent masks: 0.3²
  nn::Task task({nn::TaskKind::copy, 5, 7});
  nn::ModelConfig tc = mc;
  tc.vocab = task.vocab_size(), tc.max_len = task.seq_len();
  nn::ModelConfig td = tc;
  td.dropout = 0.5;
  nn::Transformer<float> te(tc, 1), tdm(td, 1);
  const auto ea = nn::evaluate(te, task, 64, 3), eb = nn::evaluate(tdm, task, 64, 3);
  EXPECT_EQ(ea.loss, eb.loss);
  EXPECT_EQ(ea.token_acc, eb.token_acc);
  // a training step with 1 and 2 threads in the attention layers
  auto step = [&](int threads) {
    nn::Transformer<float> m(with, 4);
    for (auto& blk : m.blocks()) blk.attn.options.sdpa.num_threads = threads;
    m.zero_grad();
    const double loss = m.loss(tokens.data(), targets.data(), B, N, true, nn::DropoutKey{9, 1}).loss;
    std::vector<float> g{float(loss)};
    for (auto& p : m.parameters()) g.insert(g.end(), p.grad->data(), p.grad->data() + p.grad->size());
    return g;
  };
  EXPECT_EQ(step(1), step(2));
}

// Mixed precision (ModelConfig::precision bf16): every attention layer
// computes its products in bfloat16. Each block's attention, run by both
// models on the same input (the bf16 model's own), differs from float32's by
// at most the bound of docs/fused.md ("bfloat16 compute") against the exact
// call on the unrounded operands: per output element
//   |Δo| <= max|v|·(2·2^-8 + (e^(2^-6·m) − 1) + 2·(E + 16)·2^-24·m + (S + 16)·2^-24)
// (2^-8: bfloat16's relative precision, for the rounded probabilities and v;
// 2·2^-7·m: q and k rounded move a score by up to 2^-7·m, m = scale·max_ij
// Σ_e |q_ie·k_je|), carried through out_proj: |Δy_r| <= Σ_c |Wo_rc|·max|Δo|.
// The logits differ; a training step is the same bit for bit for any thread
// count. Sequences of 40 tokens: the fused forward's bfloat16 products
// (calls with at most 32 query rows take the decode kernel's).
TEST(NnTransformer, Bf16PrecisionWithinTheBound) {
  const int64_t B = 2, N = 40, D = 16, H = 2, E = D / H, M = B * N;
  const nn::ModelConfig mc = sized(9, N, D, H, 2);
  nn::ModelConfig bc = mc;
  bc.precision = nn::Precision::bf16;
  nn::Transformer<float> f32(mc, 4), b16(bc, 4);
  nn::Rng r(3);
  std::vector<int32_t> tokens(B * N), targets(B * N);
  for (auto& t : tokens) t = int32_t(r.below(9));
  for (auto& t : targets) t = int32_t(r.below(9));
  Tensor<float> lf, lb;
  f32.forward(tokens.data(), B, N, lf);
  b16.forward(tokens.data(), B, N, lb);
  EXPECT_FALSE(attn::testing::all_close(lb, lf, 0.0, "bf16 logits"));
  std::map<std::string, Tensor<float>*> param;
  for (auto& p : f32.parameters()) param[p.name] = p.value;
  for (size_t l = 0; l < 2; ++l) {
    const Tensor<float> x = b16.blocks()[l].x1;  // LN1's output in the bf16 model
    Tensor<float> yf, yb;
    f32.blocks()[l].attn.forward(x, B, N, yf);
    b16.blocks()[l].attn.forward(x, B, N, yb);
    const std::string pre = "blocks." + std::to_string(l) + ".attn.";
    const Tensor<float>&w = *param.at(pre + "in_proj_weight"), &bias = *param.at(pre + "in_proj_bias"),
          &wo = *param.at(pre + "out_proj.weight");
    // q, k, v = x·W_inᵀ + b_in in double, (M, 3D)
    std::vector<double> qkv(size_t(M * 3 * D));
    for (int64_t i = 0; i < M; ++i)
      for (int64_t o = 0; o < 3 * D; ++o) {
        double s = bias[size_t(o)];
        for (int64_t c = 0; c < D; ++c) s += double(x[size_t(i * D + c)]) * w[size_t(o * D + c)];
        qkv[size_t(i * 3 * D + o)] = s;
      }
    double m = 0, vmax = 0;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < N; ++i)
          for (int64_t j = 0; j < N; ++j) {
            const double* q = &qkv[size_t((b * N + i) * 3 * D + h * E)];
            const double* k = &qkv[size_t((b * N + j) * 3 * D + D + h * E)];
            double s = 0;
            for (int64_t e = 0; e < E; ++e) s += std::abs(q[e] * k[e]);
            m = std::max(m, s / std::sqrt(double(E)));
          }
    for (int64_t i = 0; i < M; ++i)
      for (int64_t c = 2 * D; c < 3 * D; ++c) vmax = std::max(vmax, std::abs(qkv[size_t(i * 3 * D + c)]));
    const double u = std::ldexp(1.0, -24);
    const double d_o = vmax * (2 * std::ldexp(1.0, -8) + std::expm1(std::ldexp(m, -6)) + 2 * double(E + 16) * u * m +
                               double(N + 16) * u);
    double wo_rows = 0;
    for (int64_t o = 0; o < D; ++o) {
      double s = 0;
      for (int64_t c = 0; c < D; ++c) s += std::abs(double(wo[size_t(o * D + c)]));
      wo_rows = std::max(wo_rows, s);
    }
    const double bound = wo_rows * d_o * 1.01 + 1e-5;  // 1e-5: out_proj's own float32 rounding
    double diff = 0;
    for (size_t i = 0; i < yf.size(); ++i) diff = std::max(diff, std::abs(double(yb[i]) - yf[i]));
    EXPECT_LE(diff, bound) << "block " << l;
    EXPECT_GT(diff, 1e-5) << "block " << l << ": no bfloat16 products";  // float32 alone: ~1e-7 here
  }
  // a training step with 1 and 2 threads in the attention layers
  auto step = [&](int threads) {
    nn::Transformer<float> model(bc, 4);
    for (auto& blk : model.blocks()) blk.attn.options.sdpa.num_threads = threads;
    model.zero_grad();
    const double loss = model.loss(tokens.data(), targets.data(), B, N, true).loss;
    std::vector<float> g{float(loss)};
    for (auto& p : model.parameters()) g.insert(g.end(), p.grad->data(), p.grad->data() + p.grad->size());
    return g;
  };
  const auto one = step(1);
  EXPECT_EQ(one, step(2));
  f32.zero_grad();
  EXPECT_NE(f32.loss(tokens.data(), targets.data(), B, N, true).loss, double(one[0]));
}

TEST(NnTransformer, RejectsBadConfigAndInput) {
  nn::ModelConfig mc;
  mc.vocab = 5;
  mc.max_len = 4;
  mc.dim = 10;
  mc.heads = 3;
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::Transformer<float> m(mc); }, {"ModelConfig", "heads is 3", "dim = 10"}));
  mc.heads = 2;  // E = 5
  mc.positions = nn::Positions::rope;
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::Transformer<float> m(mc); }, {"rope", "even"}));
  mc.positions = nn::Positions::sinusoidal;
  mc.dropout = 1;
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::Transformer<float> m(mc); }, {"ModelConfig", "dropout is 1"}));
  mc.dropout = 0;
  mc.precision = nn::Precision::bf16;
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::Transformer<double> m(mc); }, {"precision bf16", "float"}));
  mc.backend = attn::Backend::reference;
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::Transformer<float> m(mc); }, {"ModelConfig", "precision is bf16", "reference"}));
  mc.backend = attn::Backend::automatic;
  mc.precision = nn::Precision::fp32;
  EXPECT_TRUE(attn::testing::throws_with([] { nn::parse_precision("fp16"); }, {"precision", "'fp16'", "fp32, bf16"}));
  nn::Transformer<float> m(mc);
  std::vector<int32_t> tok(10, 1);
  Tensor<float> logits;
  EXPECT_TRUE(attn::testing::throws_with([&] { m.forward(tok.data(), 2, 5, logits); }, {"N = 5", "max_len = 4"}));
  tok[3] = 5;
  EXPECT_TRUE(attn::testing::throws_with([&] { m.forward(tok.data(), 2, 4, logits); }, {"token id 5", "vocab = 5"}));
}

TEST(NnOptim, SgdMomentumHandComputed) {
  Tensor<double> w({1}), g({1});
  w[0] = 1.0;
  nn::Sgd<double> sgd({{"w", &w, &g, true}}, {0.9, 0.0});
  g[0] = 0.5;
  sgd.step(0.1);  // m = 0.5, w = 1 − 0.05
  EXPECT_DOUBLE_EQ(w[0], 0.95);
  sgd.step(0.1);  // m = 0.9·0.5 + 0.5 = 0.95, w = 0.95 − 0.095
  EXPECT_DOUBLE_EQ(w[0], 0.855);
  // with weight decay 0.1 the gradient gains 0.1·w: g' = 0.5 + 0.1 = 0.6 at w = 1
  Tensor<double> w2({1});
  w2[0] = 1.0;
  nn::Sgd<double> sgd2({{"w", &w2, &g, true}}, {0.0, 0.1});
  sgd2.step(0.1);
  EXPECT_DOUBLE_EQ(w2[0], 0.94);
}

TEST(NnOptim, AdamWHandComputed) {
  // lr 0.1, β = (0.9, 0.999), ε = 1e-8, λ = 0.01; gradients 0.5 then −0.25.
  // step 1: m̂ = 0.5, v̂ = 0.25, so the update is 0.1·0.5/(0.5 + 1e-8) = 0.099999998;
  //   decayed weight: 1·(1 − 0.001) − 0.099999998 = 0.899000002.
  // step 2: m = 0.045 − 0.025 = 0.02, v = 0.00024975 + 0.0000625 = 0.00031225,
  //   m̂ = 0.02/0.19, v̂ = 0.00031225/0.001999, update 0.1·0.105263/0.395225 = 0.0266337...
  Tensor<double> w({2}), g({2});
  Tensor<double> b({1}), gb({1});
  w[0] = 1.0;
  w[1] = 1.0;
  b[0] = 1.0;
  nn::AdamWConfig cfg;
  cfg.weight_decay = 0.01;
  nn::AdamW<double> opt({{"w", &w, &g, true}, {"b", &b, &gb, false}}, cfg);
  g[0] = 0.5;
  g[1] = 0.0;
  gb[0] = 0.5;
  opt.step(0.1);
  EXPECT_NEAR(w[0], 0.899000002, 1e-15);
  EXPECT_NEAR(w[1], 0.999, 1e-15);        // zero gradient: decay only
  EXPECT_NEAR(b[0], 0.900000002, 1e-15);  // not decayed
  g[0] = -0.25;
  gb[0] = -0.25;
  opt.step(0.1);
  EXPECT_NEAR(w[0], 0.8714672987058463, 1e-13);
  EXPECT_NEAR(b[0], 0.8733662987078463, 1e-13);
  EXPECT_EQ(opt.steps_taken, 2);
  EXPECT_EQ(opt.state().size(), 4u);
  EXPECT_EQ(opt.state()[0].first, "adamw.m.w");
}

TEST(NnOptim, ClipGradNorm) {
  Tensor<double> a({1}), ga({1}), b({1}), gb({1});
  ga[0] = 3;
  gb[0] = 4;
  std::vector<nn::ParamRef<double>> ps{{"a", &a, &ga, true}, {"b", &b, &gb, true}};
  EXPECT_DOUBLE_EQ(nn::clip_grad_norm(ps, 10.0), 5.0);  // below the limit: untouched
  EXPECT_EQ(ga[0], 3);
  EXPECT_DOUBLE_EQ(nn::clip_grad_norm(ps, 1.0), 5.0);
  EXPECT_NEAR(ga[0], 0.6, 1e-15);
  EXPECT_NEAR(gb[0], 0.8, 1e-15);
}

TEST(NnOptim, WarmupCosineSchedule) {
  const nn::LrSchedule s{1.0, 0.1, 4, 12};
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);                    // cosine starts at lr
  EXPECT_NEAR(s.at(8), 0.1 + 0.45 * 1.0, 1e-15);     // halfway: (lr + min)/2
  EXPECT_NEAR(s.at(11), 0.1 + 0.45 * (1 + std::cos(M_PI * 7 / 8)), 1e-15);
  EXPECT_DOUBLE_EQ(s.at(12), 0.1);
  EXPECT_DOUBLE_EQ(s.at(1000), 0.1);
  const nn::LrSchedule flat{0.5, 0.5, 0, 10};
  EXPECT_DOUBLE_EQ(flat.at(0), 0.5);
  EXPECT_DOUBLE_EQ(flat.at(7), 0.5);
}

}  // namespace
