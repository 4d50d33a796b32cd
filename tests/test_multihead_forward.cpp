// The multi-head attention layer's forward against the explicit per-head
// computation (multihead_reference.hpp), its parameters (names, shapes,
// PyTorch's initialisation, loading), stability at huge scores and fully
// masked rows, PyTorch's sequence-first layout through strides, and the
// permutation symmetry of self-attention.
#include <cmath>
#include <limits>
#include <tuple>

#include "multihead_reference.hpp"

namespace {

using namespace attn;  // the layer and its structs
using namespace attn::testing;

// ---------------------------------------------------------------------------
// (a) The layer equals the explicit per-head computation.

using Case = LayerCase;

std::vector<Case> cases() {
  std::vector<Case> cs;
  cs.push_back({"self_packed", config(6, 2), 2, 5, 5, true});
  cs.push_back({"self_packed_nobias", config(6, 3, false), 2, 4, 4, true});
  cs.push_back({"self_single_head", config(4, 1), 1, 3, 3, true});
  cs.push_back({"cross_kdim_vdim", config(4, 2, true, 3, 5), 2, 3, 4, false});
  cs.push_back({"cross_kdim_vdim_nobias", config(4, 2, false, 3, 5), 2, 4, 2, false});
  cs.push_back({"explicit_head_dims", config(5, 2, true, 0, 0, 3, 2), 2, 3, 4, false});
  cs.push_back({"explicit_head_dims_self", config(5, 3, true, 0, 0, 2, 4), 2, 4, 4, true});
  Case c{"self_key_padding", config(6, 2), 2, 5, 5, true};
  c.kpm = true;
  cs.push_back(c);
  c = {"self_causal", config(6, 2), 2, 5, 5, true};
  c.causal = true;
  cs.push_back(c);
  c = {"cross_causal_bottom_right", config(4, 2, true, 3, 5), 2, 3, 5, false};
  c.causal = true;
  c.align = CausalAlign::bottom_right;
  cs.push_back(c);
  c = {"cross_attn_mask", config(4, 2, true, 3, 5), 2, 3, 4, false};
  c.mask = true;
  cs.push_back(c);
  c = {"all_masks", config(5, 2, true, 3, 4, 3, 2), 2, 4, 6, false};
  c.kpm = c.mask = c.bias = c.key_lengths = c.causal = true;
  cs.push_back(c);
  c = {"self_bias_and_lengths", config(6, 3), 3, 4, 4, true};
  c.bias = c.key_lengths = true;
  cs.push_back(c);
  // The variants, each alone and combined with masks and each other.
  c = {"self_window", config(6, 2), 2, 7, 7, true};
  c.variants.window = {2, 1};
  cs.push_back(c);
  c = {"self_causal_window", config(6, 2), 2, 7, 7, true};
  c.causal = true;
  c.variants.window = {1, -1};
  cs.push_back(c);
  c = {"self_alibi", config(6, 3), 2, 6, 6, true};
  c.alibi = true;
  cs.push_back(c);
  c = {"self_sinks", with_sinks(config(6, 2)), 2, 5, 5, true};
  cs.push_back(c);
  c = {"self_softcap", config(6, 2), 2, 5, 5, true};
  c.variants.softcap = 0.7;
  cs.push_back(c);
  c = {"cross_sinks_fully_masked_rows", with_sinks(config(4, 2, true, 3, 5)), 2, 3, 4, false};
  c.mask = true;  // some rows see no key: all their weight goes to the sink
  cs.push_back(c);
  c = {"cross_window_alibi_offset", config(4, 2, true, 3, 5), 2, 3, 8, false};
  c.variants.window = {2, 2};
  c.variants.position_offset = 3;
  c.alibi = true;
  cs.push_back(c);
  c = {"self_everything", with_sinks(config(6, 2)), 2, 6, 6, true};
  c.causal = c.alibi = c.kpm = c.bias = true;
  c.variants.window = {3, -1};
  c.variants.softcap = 1.5;
  cs.push_back(c);
  c = {"explicit_dims_bottom_right_window_sinks", with_sinks(config(5, 2, false, 3, 4, 3, 2)), 2, 3, 6, false};
  c.causal = true;
  c.align = CausalAlign::bottom_right;
  c.variants.window = {1, 0};
  c.alibi = true;
  cs.push_back(c);
  return cs;
}

template <class T>
void check_against_reference(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(seed);
  MultiheadAttention<T> m(c.cfg, seed);
  if (c.cfg.bias || c.cfg.sinks) randomize(m, rng);  // non-zero biases and sinks
  const int64_t D = m.embed_dim(), H = m.num_heads();
  Tensor<T> q = random_tensor<T>({c.B, c.L, D}, rng);
  Tensor<T> k = c.self ? q : random_tensor<T>({c.B, c.S, m.kdim()}, rng);
  Tensor<T> v = c.self ? q : random_tensor<T>({c.B, c.S, m.vdim()}, rng);
  Tensor<bool> kpm, am;
  Tensor<T> ab;
  Tensor<int64_t> lens;
  MhaArgs<T> mk;
  Tensor<T> slopes;
  if (c.alibi) {
    slopes = Tensor<T>({H});
    std::uniform_real_distribution<double> u(0, 1);
    for (int64_t h = 0; h < H; ++h) slopes[size_t(h)] = T(u(rng));
    mk.alibi_slopes = slopes.template view<1>();
  }
  if (c.kpm) {
    kpm = random_bools({c.B, c.S}, rng, 0.3);
    kpm[0] = false;  // batch 0 keeps its first key
    mk.key_padding_mask = kpm.template view<2>();
  }
  if (c.mask) {
    am = random_bools({1, H, c.L, c.S}, rng, 0.7);  // broadcast over the batch
    for (int64_t j = 0; j < c.S; ++j) am[size_t(j)] = false;  // head 0's first query sees no key
    mk.mask = am.view4();
  }
  if (c.bias) {
    ab = random_tensor<T>({c.B, 1, 1, c.S}, rng);  // per-key bias, broadcast over heads and queries
    mk.bias = ab.view4();
  }
  if (c.key_lengths) {
    lens = Tensor<int64_t>({c.B});
    for (int64_t b = 0; b < c.B; ++b) lens[size_t(b)] = std::max<int64_t>(1, c.S - b);
    mk.key_lengths = lens.template view<1>();
  }
  const MhaOptions opt = layer_options(c);

  const MhaArgs<T> args = c.self ? inputs<T>(v3(q), {}, {}, mk) : inputs<T>(v3(q), v3(k), v3(v), mk);
  Tensor<T> y({c.B, c.L, D}), hw({c.B, H, c.L, c.S}), aw({c.B, c.L, c.S});
  m.forward(args, {v3(y), hw.view4(), v3(aw)}, opt);
  const RefResult r = reference_mha<T>(m, args, c.causal, c.align, c.variants);

  const double mag = std::max(max_abs(r.y.template view<3>()), 1.0);
  const int64_t red = std::max({D, m.kdim(), m.vdim(), c.S, H * m.v_head_dim()});
  EXPECT_TRUE(all_close(y, r.y, tolerance<T>(red, mag, 50.0), "out"));
  EXPECT_TRUE(all_close(hw, r.w, tolerance<T>(red, 1.0, 50.0), "head_weights"));
  EXPECT_TRUE(all_close(aw, head_mean(r.w), tolerance<T>(red, 1.0, 50.0), "avg_weights"));
  // Only averaged weights requested: same values.
  Tensor<T> y2({c.B, c.L, D}), aw2({c.B, c.L, c.S});
  m.forward(args, {v3(y2), {}, v3(aw2)}, opt);
  EXPECT_TRUE(all_close(aw2, aw, 0.0, "avg_weights alone"));
  EXPECT_TRUE(all_close(y2, y, 0.0, "out (avg_weights alone)"));
  // Self-attention also equals passing the same tensor as query, key and
  // value (the separate-projection path).
  if (c.self) {
    Tensor<T> y3({c.B, c.L, D});
    m.forward(inputs<T>(v3(q), v3(q), v3(q), mk), {v3(y3)}, opt);
    EXPECT_TRUE(all_close(y3, y, tolerance<T>(red, mag, 50.0), "out (query = key = value given)"));
  }
}

TEST(MultiheadAttention, EqualsPerHeadComputationDouble) {
  uint64_t seed = 1;
  for (const Case& c : cases()) check_against_reference<double>(c, seed++);
}

TEST(MultiheadAttention, EqualsPerHeadComputationFloat) {
  uint64_t seed = 100;
  for (const Case& c : cases()) check_against_reference<float>(c, seed++);
}

TEST(MultiheadAttention, HeadsAreIndependentSlices) {
  // Changing the projection rows of head 1 leaves head 0's weights unchanged,
  // and zeroing head 1's columns of out_proj.weight removes its contribution.
  std::mt19937_64 rng(7);
  MultiheadAttention<double> m(config(4, 2), 3);
  Tensor<double> x = random_tensor<double>({1, 3, 4}, rng);
  Tensor<double> y0({1, 3, 4}), w0({1, 2, 3, 3}), y1({1, 3, 4}), w1({1, 2, 3, 3});
  m.forward(inputs<double>(v3(x)), {v3(y0), w0.view4()});
  Tensor<double>& W = m.parameter("in_proj_weight");  // rows 2..3 (q) and 6..7 (k) belong to head 1
  for (int64_t r : {2, 3, 6, 7})
    for (int64_t c = 0; c < 4; ++c) W[size_t(r * 4 + c)] *= 3.0;
  m.forward(inputs<double>(v3(x)), {v3(y1), w1.view4()});
  for (int64_t i = 0; i < 9; ++i) EXPECT_DOUBLE_EQ(w1[size_t(i)], w0[size_t(i)]) << "head 0 weight " << i;
  bool head1_changed = false;
  for (int64_t i = 9; i < 18; ++i) head1_changed |= std::abs(w1[size_t(i)] - w0[size_t(i)]) > 1e-6;
  EXPECT_TRUE(head1_changed);
}

TEST(MultiheadAttention, SeedCatExampleThroughTheLayer) {
  // One-hot tokens (the, cat, was, hungry); column i of each projection holds
  // token i's query / key / value from the seed; d_k = 4, d_v = 2.
  MultiheadAttention<double> m(config(4, 1, false, 0, 0, 4, 2));
  const double wq[16] = {0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const double wk[16] = {-1, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0};
  const double wv[8] = {0, 1, 0, 0, 0, 0, 1, 1};
  const double wo[8] = {1, 0, 0, 1, 0, 0, 0, 0};
  m.load_parameter("q_proj_weight", View2<const double>(wq, {4, 4}));
  m.load_parameter("k_proj_weight", View2<const double>(wk, {4, 4}));
  m.load_parameter("v_proj_weight", View2<const double>(wv, {2, 4}));
  m.load_parameter("out_proj.weight", View2<const double>(wo, {4, 2}));
  Tensor<double> x({1, 4, 4}), y({1, 4, 4}), a({1, 1, 4, 4});
  for (int i = 0; i < 4; ++i) x[size_t(i * 4 + i)] = 1;
  m.forward(inputs<double>(v3(x)), {v3(y), a.view4()});
  const double* hungry = &a[12];
  EXPECT_NEAR(hungry[0], 0.038, 0.0005);
  EXPECT_NEAR(hungry[1], 0.757, 0.0005);
  EXPECT_NEAR(hungry[2], 0.102, 0.0005);
  EXPECT_NEAR(hungry[3], 0.102, 0.0005);
  EXPECT_NEAR(y[12], 0.76, 0.005);
  EXPECT_NEAR(y[13], 0.20, 0.005);
  EXPECT_EQ(y[14], 0.0);
  EXPECT_EQ(y[15], 0.0);
}

// ---------------------------------------------------------------------------
// Parameters: names, shapes, initialisation, loading.

TEST(MultiheadAttention, ANanWeightReachesEveryOutputItTouches) {
  // One NaN in head 0's query projection: every query row of head 0 becomes
  // NaN, and out_proj mixes head 0 into every output feature, so the whole
  // output is NaN (as in PyTorch), in both backends, and so are the gradients.
  for (const Backend be : {Backend::reference, Backend::fused}) {
    std::mt19937_64 rng(9);
    MultiheadAttention<float> m(config(4, 2), 3);
    Tensor<float> x = random_tensor<float>({2, 3, 4}, rng), y({2, 3, 4});
    m.parameter("in_proj_weight")[1] = std::numeric_limits<float>::quiet_NaN();  // row 0 (head 0's q)
    MhaOptions opt;
    opt.sdpa.backend = be;
    MhaSaved<float> cache;
    m.forward(inputs<float>(v3(x)), {v3(y)}, opt, &cache);
    for (size_t i = 0; i < y.size(); ++i) EXPECT_TRUE(std::isnan(y[i])) << backend_name(be) << " out " << i;
    Tensor<float> dy({2, 3, 4}), dx({2, 3, 4});
    dy.fill(1.0f);
    MhaGrads<float> g;
    g.dquery = v3(dx);
    m.backward(cache, dy.template view<3>(), g);
    for (size_t i = 0; i < dx.size(); ++i) EXPECT_TRUE(std::isnan(dx[i])) << backend_name(be) << " dx " << i;
    // A NaN in the last feature of out_proj's row 2 touches output feature 2 only.
    MultiheadAttention<float> m2(config(4, 2), 3);
    m2.parameter("out_proj.weight")[2 * 4 + 3] = std::numeric_limits<float>::quiet_NaN();
    m2.forward(inputs<float>(v3(x)), {v3(y)}, opt);
    for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(std::isnan(y[i]), i % 4 == 2) << backend_name(be) << " " << i;
  }
}

TEST(MultiheadAttention, ParameterNamesAndShapesFollowPyTorch) {
  MultiheadAttention<float> packed(config(8, 2));
  EXPECT_TRUE(packed.packed_in_proj());
  EXPECT_EQ(packed.parameter_names(),
            (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}));
  EXPECT_EQ(packed.parameter("in_proj_weight").shape(), (std::vector<int64_t>{24, 8}));
  EXPECT_EQ(packed.parameter("in_proj_bias").shape(), (std::vector<int64_t>{24}));
  EXPECT_EQ(packed.parameter("out_proj.weight").shape(), (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(packed.parameter("out_proj.bias").shape(), (std::vector<int64_t>{8}));
  EXPECT_EQ(packed.head_dim(), 4);
  EXPECT_EQ(packed.v_head_dim(), 4);
  EXPECT_EQ(packed.kdim(), 8);

  MultiheadAttention<float> sep(config(6, 2, false, 3, 5));
  EXPECT_FALSE(sep.packed_in_proj());
  EXPECT_EQ(sep.parameter_names(),
            (std::vector<std::string>{"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}));
  EXPECT_EQ(sep.parameter("q_proj_weight").shape(), (std::vector<int64_t>{6, 6}));
  EXPECT_EQ(sep.parameter("k_proj_weight").shape(), (std::vector<int64_t>{6, 3}));
  EXPECT_EQ(sep.parameter("v_proj_weight").shape(), (std::vector<int64_t>{6, 5}));

  MultiheadAttention<float> dims(config(5, 2, true, 0, 0, 3, 2));
  EXPECT_FALSE(dims.packed_in_proj());
  EXPECT_EQ(dims.parameter("q_proj_weight").shape(), (std::vector<int64_t>{6, 5}));
  EXPECT_EQ(dims.parameter("v_proj_weight").shape(), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(dims.parameter("in_proj_bias").shape(), (std::vector<int64_t>{16}));
  EXPECT_EQ(dims.parameter("out_proj.weight").shape(), (std::vector<int64_t>{5, 4}));
  for (const auto& n : dims.parameter_names()) EXPECT_EQ(dims.grad(n).shape(), dims.parameter(n).shape());
}

TEST(MultiheadAttention, InitialisationMatchesPyTorchBoundsAndIsSeeded) {
  const int64_t D = 32;
  MultiheadAttention<double> a(config(D, 4), 42), b(config(D, 4), 42), c(config(D, 4), 43);
  const Tensor<double>& w = a.parameter("in_proj_weight");
  const double xavier = std::sqrt(6.0 / double(D + 3 * D));  // fans of the whole [3D, D] tensor
  const double wmax = max_abs(w.view<2>());
  EXPECT_LE(wmax, xavier);
  EXPECT_GT(wmax, 0.95 * xavier);  // 3072 uniform draws reach close to the bound
  double mean = 0;
  for (size_t i = 0; i < w.size(); ++i) mean += w[i] / double(w.size());
  EXPECT_NEAR(mean, 0.0, 0.1 * xavier);
  const double out_bound = 1.0 / std::sqrt(double(D));
  const double omax = max_abs(a.parameter("out_proj.weight").view<2>());
  EXPECT_LE(omax, out_bound);
  EXPECT_GT(omax, 0.9 * out_bound);
  EXPECT_EQ(max_abs(a.parameter("in_proj_bias").view<1>()), 0.0);
  EXPECT_EQ(max_abs(a.parameter("out_proj.bias").view<1>()), 0.0);
  EXPECT_TRUE(all_close(a.parameter("in_proj_weight"), b.parameter("in_proj_weight"), 0.0, "same seed"));
  EXPECT_FALSE(all_close(a.parameter("in_proj_weight"), c.parameter("in_proj_weight"), 1e-3, "other seed"));
  a.reset_parameters(43);
  EXPECT_TRUE(all_close(a.parameter("in_proj_weight"), c.parameter("in_proj_weight"), 0.0, "reset"));

  // out_proj.weight [D, H·Ev]: the bound follows its input width H·Ev = 8, not D.
  MultiheadAttention<double> e(config(D, 4, true, 0, 0, 8, 2), 5);
  EXPECT_LE(max_abs(e.parameter("out_proj.weight").view<2>()), 1.0 / std::sqrt(8.0));
  EXPECT_GT(max_abs(e.parameter("out_proj.weight").view<2>()), 0.9 / std::sqrt(8.0));

  // Separate projections: each gets Xavier bounds from its own fans.
  MultiheadAttention<double> s(config(8, 2, true, 24, 40), 1);
  EXPECT_LE(max_abs(s.parameter("k_proj_weight").view<2>()), std::sqrt(6.0 / (8 + 24)));
  EXPECT_GT(max_abs(s.parameter("k_proj_weight").view<2>()), 0.9 * std::sqrt(6.0 / (8 + 24)));
  EXPECT_LE(max_abs(s.parameter("v_proj_weight").view<2>()), std::sqrt(6.0 / (8 + 40)));
}

TEST(MultiheadAttention, LoadParameterCopiesStridedValues) {
  MultiheadAttention<double> m(config(2, 1, true, 3, 0));
  // A [2, 3] weight given transposed: a (3, 2) buffer read with swapped strides.
  const double buf[6] = {1, 4, 2, 5, 3, 6};
  m.load_parameter("k_proj_weight", View2<const double>(buf, {2, 3}, {1, 2}));
  const Tensor<double>& k = m.parameter("k_proj_weight");
  for (int i = 0; i < 6; ++i) EXPECT_EQ(k[size_t(i)], double(i + 1));
  const double b[6] = {1, 2, 3, 4, 5, 6};
  m.load_parameter("in_proj_bias", View1<const double>(b, {6}));
  EXPECT_EQ(m.parameter("in_proj_bias")[5], 6.0);
}

// ---------------------------------------------------------------------------
// (d) Stability: huge scores and fully masked rows.

template <class T>
void check_stability() {
  const int64_t B = 2, N = 4, D = 4, H = 2;
  MultiheadAttention<T> m(config(D, H), 5);
  std::mt19937_64 rng(5);
  randomize(m, rng, 1.0);
  // Scale the packed q and k rows so that scores reach ~1e4.
  Tensor<T>& w = m.parameter("in_proj_weight");
  for (int64_t i = 0; i < 2 * D * D; ++i) w[size_t(i)] *= T(30);
  Tensor<T> x = random_tensor<T>({B, N, D}, rng, 3.0);
  Tensor<T> y({B, N, D}), hw({B, H, N, N});
  MhaSaved<T> cache;
  m.forward(inputs<T>(v3(x)), {v3(y), hw.view4()}, {}, &cache);
  double max_score = 0;
  for (size_t i = 0; i < cache.lse.size(); ++i) max_score = std::max(max_score, std::abs(double(cache.lse[i])));
  EXPECT_GT(max_score, 1e3) << "the test should produce huge scores";
  EXPECT_TRUE(all_finite(y));
  EXPECT_TRUE(all_finite(hw));
  const RefResult r = reference_mha<T>(m, inputs<T>(v3(x)));
  // The score gaps are in the thousands, so the weights are saturated (0 or
  // 1) and the rounding of the scores (eps·|score|) does not reach the output.
  const double mag = max_abs(r.y.template view<3>());
  EXPECT_TRUE(all_close(y, r.y, tolerance<T>(N * D, mag, 50.0), "out at huge scores"));
  Tensor<T> G = random_tensor<T>({B, N, D}, rng), dx({B, N, D});
  m.zero_grad();
  m.backward(cache, v3(std::as_const(G)), {v3(dx)});
  EXPECT_TRUE(all_finite(dx));
  for (const auto& n : m.parameter_names()) EXPECT_TRUE(all_finite(m.grad(n))) << n;
}

TEST(MultiheadAttentionStability, HugeScoresFloat) { check_stability<float>(); }
TEST(MultiheadAttentionStability, HugeScoresDouble) { check_stability<double>(); }

template <class T>
void check_fully_masked() {
  const int64_t B = 2, L = 3, S = 4, D = 4, H = 2;
  MultiheadAttention<T> m(config(D, H, true, 3, 5), 9);
  std::mt19937_64 rng(9);
  randomize(m, rng);
  Tensor<T> q = random_tensor<T>({B, L, D}, rng), k = random_tensor<T>({B, S, 3}, rng),
            v = random_tensor<T>({B, S, 5}, rng);
  Tensor<bool> kpm({B, S});
  for (int64_t j = 0; j < S; ++j) kpm[size_t(S + j)] = true;  // batch 1: every key is padding
  Tensor<bool> am({1, 1, L, S});
  am.fill(true);
  for (int64_t j = 0; j < S; ++j) am[size_t(1 * S + j)] = false;  // query 1 sees nothing, in every batch
  MhaArgs<T> mk = inputs<T>(v3(q), v3(k), v3(v));
  mk.key_padding_mask = kpm.template view<2>();
  mk.mask = am.view4();
  Tensor<T> y({B, L, D}), hw({B, H, L, S}), aw({B, L, S});
  MhaSaved<T> cache;
  m.forward(mk, {v3(y), hw.view4(), v3(aw)}, {}, &cache);
  EXPECT_TRUE(all_finite(y));
  EXPECT_TRUE(all_finite(hw));
  const Tensor<T>& bo = m.parameter("out_proj.bias");
  auto masked_row = [&](int64_t b, int64_t i) { return b == 1 || i == 1; };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i) {
      if (!masked_row(b, i)) continue;
      for (int64_t d = 0; d < D; ++d) EXPECT_EQ(y[size_t((b * L + i) * D + d)], bo[size_t(d)]) << b << "," << i;
      for (int64_t j = 0; j < S; ++j) EXPECT_EQ(aw[size_t((b * L + i) * S + j)], T(0));
    }
  const RefResult r = reference_mha<T>(m, mk);
  EXPECT_TRUE(all_close(y, r.y, tolerance<T>(8, max_abs(r.y.template view<3>()), 50.0), "out"));

  Tensor<T> G = random_tensor<T>({B, L, D}, rng), dq({B, L, D}), dk({B, S, 3}), dv({B, S, 5});
  m.zero_grad();
  m.backward(cache, v3(std::as_const(G)), {v3(dq), v3(dk), v3(dv)});
  EXPECT_TRUE(all_finite(dq) && all_finite(dk) && all_finite(dv));
  for (const auto& n : m.parameter_names()) EXPECT_TRUE(all_finite(m.grad(n))) << n;
  // Fully masked rows do not depend on their query; batch 1 does not depend on its keys/values.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < D; ++d)
        if (masked_row(b, i)) {
          EXPECT_EQ(dq[size_t((b * L + i) * D + d)], T(0));
        }
  for (int64_t j = 0; j < S; ++j) {
    for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(dk[size_t((S + j) * 3 + c)], T(0));
    for (int64_t c = 0; c < 5; ++c) EXPECT_EQ(dv[size_t((S + j) * 5 + c)], T(0));
  }
  // out_proj.bias still gets the full Σ dout.
  for (int64_t d = 0; d < D; ++d) {
    double s = 0;
    for (int64_t r0 = 0; r0 < B * L; ++r0) s += double(G[size_t(r0 * D + d)]);
    EXPECT_NEAR(double(m.grad("out_proj.bias")[size_t(d)]), s, tolerance<T>(B * L, std::abs(s) + 1));
  }
}

TEST(MultiheadAttentionStability, FullyMaskedRowsFloat) { check_fully_masked<float>(); }
TEST(MultiheadAttentionStability, FullyMaskedRowsDouble) { check_fully_masked<double>(); }

// ---------------------------------------------------------------------------
// (e) PyTorch's (N, B, D) layout through swapped strides.

template <class T>
void check_strided() {
  const int64_t B = 3, L = 4, S = 5, D = 6, H = 2;
  MultiheadAttention<T> m(config(D, H, true, 3, 4), 21);
  std::mt19937_64 rng(21);
  randomize(m, rng);
  // Sequence-first buffers (N, B, width), viewed as logical (B, N, width).
  Tensor<T> q_nb = random_tensor<T>({L, B, D}, rng), k_nb = random_tensor<T>({S, B, 3}, rng),
            v_nb = random_tensor<T>({S, B, 4}, rng);
  auto seq_first = [](Tensor<T>& t) {
    const int64_t N = t.dim(0), Bb = t.dim(1), W = t.dim(2);
    return View3<T>(t.data(), {Bb, N, W}, {W, Bb * W, 1});
  };
  auto to_batch_first = [&](Tensor<T>& t) {
    View3<T> sv = seq_first(t);
    Tensor<T> out({sv.dim(0), sv.dim(1), sv.dim(2)});
    for (int64_t b = 0; b < sv.dim(0); ++b)
      for (int64_t n = 0; n < sv.dim(1); ++n)
        for (int64_t c = 0; c < sv.dim(2); ++c) out[size_t((b * sv.dim(1) + n) * sv.dim(2) + c)] = sv(b, n, c);
    return out;
  };
  Tensor<T> q = to_batch_first(q_nb), k = to_batch_first(k_nb), v = to_batch_first(v_nb);
  Tensor<bool> kpm = random_bools({B, S}, rng, 0.3);
  MhaArgs<T> mk;
  mk.key_padding_mask = kpm.template view<2>();
  Tensor<T> G = random_tensor<T>({B, L, D}, rng);

  // Batch-first, contiguous.
  Tensor<T> y({B, L, D}), dq({B, L, D}), dk({B, S, 3}), dv({B, S, 4});
  MhaSaved<T> cache;
  m.forward(inputs<T>(v3(q), v3(k), v3(v), mk), {v3(y)}, {}, &cache);
  m.zero_grad();
  m.backward(cache, v3(std::as_const(G)), {v3(dq), v3(dk), v3(dv)});
  std::map<std::string, Tensor<T>> grads;
  for (const auto& n : m.parameter_names()) grads.emplace(n, m.grad(n));

  // Sequence-first, strided everywhere: inputs, output, dout and input grads.
  Tensor<T> y_nb({L, B, D}), dq_nb({L, B, D}), dk_nb({S, B, 3}), dv_nb({S, B, 4}), G_nb({L, B, D});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < D; ++d) seq_first(G_nb)(b, i, d) = G[size_t((b * L + i) * D + d)];
  MhaSaved<T> cache2;
  const MhaArgs<T> strided = inputs<T>(seq_first(q_nb), seq_first(k_nb), seq_first(v_nb), mk);
  m.forward(strided, {seq_first(y_nb)}, {}, &cache2);
  m.zero_grad();
  m.backward(cache2, View3<const T>(seq_first(G_nb)), {seq_first(dq_nb), seq_first(dk_nb), seq_first(dv_nb)});
  const double tol = tolerance<T>(D, 4.0);
  EXPECT_TRUE(all_close(View3<const T>(seq_first(y_nb)), v3(std::as_const(y)), tol, "out"));
  EXPECT_TRUE(all_close(View3<const T>(seq_first(dq_nb)), v3(std::as_const(dq)), tol, "dquery"));
  EXPECT_TRUE(all_close(View3<const T>(seq_first(dk_nb)), v3(std::as_const(dk)), tol, "dkey"));
  EXPECT_TRUE(all_close(View3<const T>(seq_first(dv_nb)), v3(std::as_const(dv)), tol, "dvalue"));
  for (const auto& n : m.parameter_names()) EXPECT_TRUE(all_close(m.grad(n), grads.at(n), tol, "grad " + n));
  // And both equal the per-head computation.
  const RefResult r = reference_mha<T>(m, inputs<T>(v3(q), v3(k), v3(v), mk));
  EXPECT_TRUE(all_close(y, r.y, tolerance<T>(D, max_abs(r.y.template view<3>()), 50.0), "out vs reference"));

  // Without a cache the strided inputs go through scratch copies: same result.
  Tensor<T> y3({L, B, D});
  m.forward(strided, {seq_first(y3)});
  EXPECT_TRUE(all_close(y3, y_nb, tol, "out without cache"));
}

TEST(MultiheadAttentionLayout, SequenceFirstStridesFloat) { check_strided<float>(); }
TEST(MultiheadAttentionLayout, SequenceFirstStridesDouble) { check_strided<double>(); }

TEST(MultiheadAttentionLayout, CacheOwnsItsInputs) {
  // The caller's buffers may change between forward and backward.
  std::mt19937_64 rng(31);
  MultiheadAttention<double> m(config(4, 2), 31);
  Tensor<double> x = random_tensor<double>({2, 3, 4}, rng), y({2, 3, 4}), G = random_tensor<double>({2, 3, 4}, rng);
  Tensor<double> dx1({2, 3, 4}), dx2({2, 3, 4});
  MhaSaved<double> cache;
  m.forward(inputs<double>(v3(x)), {v3(y)}, {}, &cache);
  m.backward(cache, v3(std::as_const(G)), {v3(dx1)});
  Tensor<double> x_saved = x;
  x.fill(1e3);
  m.backward(cache, v3(std::as_const(G)), {v3(dx2)});
  EXPECT_TRUE(all_close(dx2, dx1, 0.0, "dx after the input buffer changed"));
  EXPECT_TRUE(all_close(cache.query, x_saved, 0.0, "cached input"));
  // The cache's own saved input may be fed back into a forward that refills it.
  Tensor<double> y_again({2, 3, 4});
  m.forward(inputs<double>(cache.query.view<3>()), {v3(y_again)}, {}, &cache);
  EXPECT_TRUE(all_close(y_again, y, 0.0, "forward from the cache's own input"));
  EXPECT_TRUE(all_close(cache.query, x_saved, 0.0, "cached input after refill"));
}

// A cache refilled call after call reuses its buffers; whatever the previous
// call was (cross- or self-attention, other lengths), the backward equals the
// one from a fresh cache, bit for bit.
TEST(MultiheadAttentionLayout, RefilledCacheEqualsAFreshOne) {
  std::mt19937_64 rng(33);
  MultiheadAttention<double> m(config(4, 2), 33);
  randomize(m, rng);
  MhaSaved<double> reused;
  for (const auto& [L, S, self] : {std::tuple{3, 5, false}, {3, 3, true}, {4, 2, false}, {4, 4, true}, {2, 6, false}}) {
    SCOPED_TRACE(std::to_string(L) + " " + std::to_string(S) + (self ? " self" : " cross"));
    Tensor<double> q = random_tensor<double>({2, L, 4}, rng), k = random_tensor<double>({2, S, 4}, rng),
                   v = random_tensor<double>({2, S, 4}, rng), G = random_tensor<double>({2, L, 4}, rng);
    const MhaArgs<double> a = self ? inputs<double>(v3(q)) : inputs<double>(v3(q), v3(k), v3(v));
    Tensor<double> y1({2, L, 4}), y2({2, L, 4}), dq1({2, L, 4}), dq2({2, L, 4});
    MhaSaved<double> fresh;
    m.forward(a, {v3(y1)}, {}, &fresh);
    m.forward(a, {v3(y2)}, {}, &reused);
    EXPECT_TRUE(all_close(y2, y1, 0.0, "out"));
    m.zero_grad();
    m.backward(fresh, v3(std::as_const(G)), {v3(dq1)});
    const Tensor<double> g1 = m.grad("in_proj_weight");
    m.zero_grad();
    m.backward(reused, v3(std::as_const(G)), {v3(dq2)});
    EXPECT_TRUE(all_close(dq2, dq1, 0.0, "dquery"));
    EXPECT_TRUE(all_close(m.grad("in_proj_weight"), g1, 0.0, "grad in_proj_weight"));
  }
}

// A forward without a saved state reads the caller's masks, bias, key
// lengths and slopes where they are (strided, broadcast) instead of copying
// them, beside the layer's sinks, and borrows the layer's buffers: its output is the one of a forward
// that fills a state, bit for bit, call after call with changing operands,
// and the caller's operands are left as they were.
TEST(MultiheadAttentionLayout, ForwardWithoutStateEqualsForwardWithOne) {
  std::mt19937_64 rng(44);
  for (const Dtype compute : {Dtype::float32, Dtype::bfloat16}) {
    // With the layer's own sinks in bfloat16 (they join the caller's operands).
    MultiheadAttention<float> m(compute == Dtype::float32 ? config(8, 2) : with_sinks(config(8, 2)), 44);
    randomize(m, rng);
    for (int round = 0; round < 6; ++round) {
      SCOPED_TRACE(std::string(compute == Dtype::float32 ? "float32" : "bfloat16, sinks") + ", round " +
                   std::to_string(round));
      const int64_t B = 2, L = 3 + round % 3, S = round % 2 ? L : L + 2;
      const bool self = S == L && round % 4 == 1;
      Tensor<float> q = random_tensor<float>({B, L, 8}, rng), k = random_tensor<float>({B, S, 8}, rng),
                    v = random_tensor<float>({B, S, 8}, rng);
      MhaArgs<float> mk;
      // A bool mask stored transposed (strided), broadcast over the batch.
      Tensor<bool> mask_t = random_bools({1, 2, S, L}, rng, 0.7);
      const View4<const bool> mt = mask_t.view4();
      if (round % 3 != 2) mk.mask = View4<const bool>(mt.data, {1, 2, L, S}, {mt.strides[0], mt.strides[1], 1, L});
      // A float bias broadcast over the heads, every other round.
      Tensor<float> bias = random_tensor<float>({B, 1, L, S}, rng);
      if (round % 2 == 0) mk.bias = bias.view4();
      Tensor<bool> pad({B, S});  // the last key of batch 1 is padding
      pad[size_t(2 * S - 1)] = true;
      if (round % 3 == 1) mk.key_padding_mask = pad.view<2>();
      Tensor<int64_t> lengths({B});
      lengths[0] = S, lengths[1] = S - 1;
      if (round % 3 == 0) mk.key_lengths = lengths.view<1>();
      Tensor<float> slopes({2});
      slopes[0] = 0.5f, slopes[1] = 0.25f;
      if (round >= 3) mk.alibi_slopes = slopes.view<1>();
      const Tensor<bool> mask_before = mask_t;
      const Tensor<float> bias_before = bias;
      const MhaArgs<float> a = self ? inputs<float>(v3(q), {}, {}, mk) : inputs<float>(v3(q), v3(k), v3(v), mk);
      MhaOptions opt;
      opt.sdpa.compute_dtype = compute;
      Tensor<float> y_saved({B, L, 8}), y({B, L, 8});
      MhaSaved<float> saved;
      m.forward(a, {v3(y_saved)}, opt, &saved);
      m.forward(a, {v3(y)}, opt);
      EXPECT_TRUE(all_close(y, y_saved, 0.0, "out"));
      EXPECT_TRUE(all_close(mask_t, mask_before, 0.0, "mask"));
      EXPECT_TRUE(all_close(bias, bias_before, 0.0, "bias"));
    }
  }
}

// ---------------------------------------------------------------------------
// (f) Self-attention without a mask commutes with permuting the tokens.

TEST(MultiheadAttentionProperties, PermutationEquivariance) {
  const int64_t B = 2, N = 6, D = 6, H = 3;
  std::mt19937_64 rng(41);
  MultiheadAttention<double> m(config(D, H), 41);
  randomize(m, rng);
  Tensor<double> x = random_tensor<double>({B, N, D}, rng), px({B, N, D});
  std::vector<int64_t> perm(N);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t d = 0; d < D; ++d) px[size_t((b * N + i) * D + d)] = x[size_t((b * N + perm[size_t(i)]) * D + d)];
  Tensor<double> y({B, N, D}), py({B, N, D}), y_perm({B, N, D});
  m.forward(inputs<double>(v3(x)), {v3(y)});
  m.forward(inputs<double>(v3(px)), {v3(py)});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t d = 0; d < D; ++d) y_perm[size_t((b * N + i) * D + d)] = y[size_t((b * N + perm[size_t(i)]) * D + d)];
  EXPECT_TRUE(all_close(py, y_perm, tolerance<double>(D * N, max_abs(y.view<3>())), "Attention(P.X) vs P.Attention(X)"));
  // A causal mask breaks the symmetry (the permutation is not the identity).
  ASSERT_FALSE(std::is_sorted(perm.begin(), perm.end()));
  MhaOptions causal;
  causal.sdpa.causal = true;
  m.forward(inputs<double>(v3(x)), {v3(y)}, causal);
  m.forward(inputs<double>(v3(px)), {v3(py)}, causal);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t d = 0; d < D; ++d) y_perm[size_t((b * N + i) * D + d)] = y[size_t((b * N + perm[size_t(i)]) * D + d)];
  EXPECT_FALSE(all_close(py, y_perm, 1e-6, "causal"));
}

TEST(MultiheadAttentionProperties, CausalFutureTokensDoNotLeak) {
  const int64_t B = 1, N = 5, D = 4, H = 2;
  std::mt19937_64 rng(43);
  MultiheadAttention<double> m(config(D, H), 43);
  randomize(m, rng);
  Tensor<double> x = random_tensor<double>({B, N, D}, rng), y({B, N, D}), y2({B, N, D});
  MhaOptions opt;
  opt.sdpa.causal = true;
  m.forward(inputs<double>(v3(x)), {v3(y)}, opt);
  for (int64_t d = 0; d < D; ++d) x[size_t(3 * D + d)] += 5.0;  // change token 3
  m.forward(inputs<double>(v3(x)), {v3(y2)}, opt);
  for (int64_t i = 0; i < N; ++i) {
    double diff = 0;
    for (int64_t d = 0; d < D; ++d) diff = std::max(diff, std::abs(y[size_t(i * D + d)] - y2[size_t(i * D + d)]));
    if (i < 3)
      EXPECT_EQ(diff, 0.0) << "token " << i;
    else
      EXPECT_GT(diff, 1e-6) << "token " << i;
  }
}

}  // namespace

namespace {

// The standard slopes: 2^(-8(h+1)/H) for a power of two; otherwise the
// paper's interleaving (H = 6: the 4-head slopes, then the 1st and 3rd of 8).
TEST(MultiheadAttention, AlibiSlopesAreThePapers) {
  const std::vector<double> s8 = attn::alibi_slopes(8);
  ASSERT_EQ(s8.size(), 8u);
  for (int h = 0; h < 8; ++h) EXPECT_EQ(s8[size_t(h)], std::exp2(-(h + 1))) << h;
  const std::vector<double> s1 = attn::alibi_slopes(1);
  ASSERT_EQ(s1.size(), 1u);
  EXPECT_EQ(s1[0], std::exp2(-8.0));
  const std::vector<double> s6 = attn::alibi_slopes(6), want6 = {0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125};
  ASSERT_EQ(s6.size(), 6u);
  for (size_t h = 0; h < 6; ++h) EXPECT_EQ(s6[h], want6[h]) << h;
  EXPECT_TRUE(throws_with([] { (void)attn::alibi_slopes(0); }, {"alibi_slopes", "num_heads is 0"}));
}

// The sinks are a parameter: named last, zero at the start, loadable; ALiBi
// slopes of the wrong length are refused by the layer, by name.
TEST(MultiheadAttention, SinksParameterAndAlibiValidation) {
  MultiheadAttention<float> m(with_sinks(config(4, 2)), 1);
  ASSERT_EQ(m.parameter_names().back(), "sinks");
  EXPECT_EQ(m.parameter("sinks").shape(), (std::vector<int64_t>{2}));
  EXPECT_EQ(m.parameter("sinks")[0], 0.0f);
  EXPECT_EQ(m.grad("sinks").shape(), (std::vector<int64_t>{2}));
  const float v[2] = {0.5f, -1.0f};
  m.load_parameter("sinks", View1<const float>(v, {2}));
  EXPECT_EQ(m.parameter("sinks")[1], -1.0f);
  MultiheadAttention<float> plain(config(4, 2), 1);
  for (const auto& n : plain.parameter_names()) EXPECT_NE(n, "sinks");
  std::mt19937_64 rng(3);
  Tensor<float> x = random_tensor<float>({1, 3, 4}, rng), y({1, 3, 4});
  const float slopes[3] = {0.1f, 0.2f, 0.3f};
  MhaArgs<float> a = inputs<float>(v3(std::as_const(x)));
  a.alibi_slopes = View1<const float>(slopes, {3});
  EXPECT_TRUE(throws_with([&] { m.forward(a, {v3(y)}); },
                          {"MultiheadAttention::forward", "alibi_slopes", "(2,)"}));
}

}  // namespace
