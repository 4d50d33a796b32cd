// The multi-head attention layer against a plain per-head computation written
// out below (split into heads, softmax(q·kᵀ/√E)·v per head, concatenate,
// project), against central finite differences for every gradient, and on
// its error messages, stability, strided inputs and permutation symmetry.
#include <map>
#include <numeric>
#include <utility>

#include "testing.hpp"

namespace {

using attn::CausalAlign;
using attn::MhaCache;
using attn::MhaMasks;
using attn::MhaOptions;
using attn::MultiheadAttention;
using attn::MultiheadConfig;
using attn::Tensor;
using attn::View;
using attn::View1;
using attn::View2;
using attn::View3;
using attn::View4;
using attn::testing::all_close;
using attn::testing::all_finite;
using attn::testing::max_abs;
using attn::testing::random_tensor;
using attn::testing::throws_with;
using attn::testing::tolerance;

MultiheadConfig config(int64_t D, int64_t H, bool bias = true, int64_t kdim = 0, int64_t vdim = 0,
                       int64_t E = 0, int64_t Ev = 0) {
  MultiheadConfig c;
  c.embed_dim = D;
  c.num_heads = H;
  c.bias = bias;
  c.kdim = kdim;
  c.vdim = vdim;
  c.head_dim = E;
  c.v_head_dim = Ev;
  return c;
}

// Loads random values into every parameter (biases included, which start at
// zero) through load_parameter.
template <class T>
void randomize(MultiheadAttention<T>& m, std::mt19937_64& rng, double stddev = 0.5) {
  for (const auto& name : m.parameter_names()) {
    const Tensor<T>& p = m.parameter(name);
    Tensor<T> r = random_tensor<T>(p.shape(), rng, stddev);
    if (p.rank() == 2)
      m.load_parameter(name, View2<const T>(r.data(), {r.dim(0), r.dim(1)}));
    else
      m.load_parameter(name, View1<const T>(r.data(), {r.dim(0)}));
  }
}

// A double copy of a layer's parameter, as a dense row-major matrix.
struct Mat {
  std::vector<double> a;
  int64_t rows = 0, cols = 0;
  double operator()(int64_t i, int64_t j) const { return a[size_t(i * cols + j)]; }
};
template <class T>
Mat rows_of(const MultiheadAttention<T>& m, const std::string& name, int64_t first, int64_t n) {
  const Tensor<T>& p = m.parameter(name);
  const int64_t cols = p.rank() == 2 ? p.dim(1) : 1;
  Mat out{{}, n, cols};
  for (int64_t i = 0; i < n * cols; ++i) out.a.push_back(double(p[size_t(first * cols + i)]));
  return out;
}

struct RefResult {
  Tensor<double> y;  // (B, L, D)
  Tensor<double> w;  // (B, H, L, S)
};

// The explicit per-head computation, in double, reading masks with explicit
// broadcasting. Independent of the layer's code except for the parameters.
template <class T>
RefResult reference_mha(const MultiheadAttention<T>& m, View3<const T> query, View3<const T> key,
                        View3<const T> value, const MhaMasks<T>& mk = {}, bool causal = false,
                        CausalAlign align = CausalAlign::top_left) {
  const int64_t D = m.embed_dim(), H = m.num_heads(), E = m.head_dim(), Ev = m.v_head_dim();
  const int64_t B = query.dim(0), L = query.dim(1), S = key.dim(1);
  const int64_t HE = H * E, HEv = H * Ev;
  Mat wq, wk, wv;
  if (m.packed_in_proj()) {
    wq = rows_of(m, "in_proj_weight", 0, D);
    wk = rows_of(m, "in_proj_weight", D, D);
    wv = rows_of(m, "in_proj_weight", 2 * D, D);
  } else {
    wq = rows_of(m, "q_proj_weight", 0, HE);
    wk = rows_of(m, "k_proj_weight", 0, HE);
    wv = rows_of(m, "v_proj_weight", 0, HEv);
  }
  const bool bias = m.config().bias;
  Mat bq, bk, bv, bo;
  if (bias) {
    bq = rows_of(m, "in_proj_bias", 0, HE);
    bk = rows_of(m, "in_proj_bias", HE, HE);
    bv = rows_of(m, "in_proj_bias", 2 * HE, HEv);
    bo = rows_of(m, "out_proj.bias", 0, D);
  }
  const Mat wo = rows_of(m, "out_proj.weight", 0, D);
  auto bc = [](int64_t i, int64_t dim) { return dim == 1 ? 0 : i; };

  RefResult r{Tensor<double>({B, L, D}), Tensor<double>({B, H, L, S})};
  std::vector<double> concat(size_t(L * HEv));
  for (int64_t b = 0; b < B; ++b) {
    std::fill(concat.begin(), concat.end(), 0.0);
    for (int64_t h = 0; h < H; ++h) {
      // Split: this head's rows of the projections.
      std::vector<double> qh(size_t(L * E)), kh(size_t(S * E)), vh(size_t(S * Ev));
      for (int64_t i = 0; i < L; ++i)
        for (int64_t e = 0; e < E; ++e) {
          double s = bias ? bq(h * E + e, 0) : 0;
          for (int64_t c = 0; c < D; ++c) s += double(query(b, i, c)) * wq(h * E + e, c);
          qh[size_t(i * E + e)] = s;
        }
      for (int64_t j = 0; j < S; ++j) {
        for (int64_t e = 0; e < E; ++e) {
          double s = bias ? bk(h * E + e, 0) : 0;
          for (int64_t c = 0; c < m.kdim(); ++c) s += double(key(b, j, c)) * wk(h * E + e, c);
          kh[size_t(j * E + e)] = s;
        }
        for (int64_t e = 0; e < Ev; ++e) {
          double s = bias ? bv(h * Ev + e, 0) : 0;
          for (int64_t c = 0; c < m.vdim(); ++c) s += double(value(b, j, c)) * wv(h * Ev + e, c);
          vh[size_t(j * Ev + e)] = s;
        }
      }
      // Attend: softmax over the visible keys of q·k/√E (+ bias).
      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> z(static_cast<size_t>(S));
        std::vector<bool> vis(static_cast<size_t>(S));
        double zmax = -1e300;
        bool any = false;
        for (int64_t j = 0; j < S; ++j) {
          bool v = true;
          if (causal) v = align == CausalAlign::top_left ? j <= i : j <= i + (S - L);
          if (!mk.key_padding_mask.empty() && mk.key_padding_mask(b, j)) v = false;
          if (!mk.key_lengths.empty() && j >= mk.key_lengths(b)) v = false;
          if (!mk.attn_mask.empty()) {
            const auto& am = mk.attn_mask;
            if (!am(bc(b, am.dim(0)), bc(h, am.dim(1)), bc(i, am.dim(2)), bc(j, am.dim(3)))) v = false;
          }
          double s = 0;
          for (int64_t e = 0; e < E; ++e) s += qh[size_t(i * E + e)] * kh[size_t(j * E + e)];
          s /= std::sqrt(double(E));
          if (!mk.attn_bias.empty()) {
            const auto& ab = mk.attn_bias;
            s += double(ab(bc(b, ab.dim(0)), bc(h, ab.dim(1)), bc(i, ab.dim(2)), bc(j, ab.dim(3))));
          }
          vis[size_t(j)] = v;
          z[size_t(j)] = s;
          if (v) {
            any = true;
            zmax = std::max(zmax, s);
          }
        }
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) sum += vis[size_t(j)] ? std::exp(z[size_t(j)] - zmax) : 0.0;
        for (int64_t j = 0; j < S; ++j) {
          const double a = (any && vis[size_t(j)]) ? std::exp(z[size_t(j)] - zmax) / sum : 0.0;
          r.w[size_t(((b * H + h) * L + i) * S + j)] = a;
          // Concatenate: head h fills columns [h·Ev, (h+1)·Ev).
          for (int64_t e = 0; e < Ev; ++e) concat[size_t(i * HEv + h * Ev + e)] += a * vh[size_t(j * Ev + e)];
        }
      }
    }
    // Project: y = concat·W_oᵀ + b_o.
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < D; ++d) {
        double s = bias ? bo(d, 0) : 0;
        for (int64_t c = 0; c < HEv; ++c) s += concat[size_t(i * HEv + c)] * wo(d, c);
        r.y[size_t((b * L + i) * D + d)] = s;
      }
  }
  return r;
}

// Mean of the reference's per-head weights over heads: (B, L, S).
Tensor<double> head_mean(const Tensor<double>& w) {
  const int64_t B = w.dim(0), H = w.dim(1), L = w.dim(2), S = w.dim(3);
  Tensor<double> out({B, L, S});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < S; ++j)
          out[size_t((b * L + i) * S + j)] += w[size_t(((b * H + h) * L + i) * S + j)] / double(H);
  return out;
}

// Random bool tensor with the given probability of true.
Tensor<bool> random_bools(std::vector<int64_t> shape, std::mt19937_64& rng, double p_true) {
  Tensor<bool> t(std::move(shape));
  std::bernoulli_distribution bd(p_true);
  for (size_t i = 0; i < t.size(); ++i) t[i] = bd(rng);
  return t;
}

template <class T>
View3<const T> v3(const Tensor<T>& t) {
  return t.template view<3>();
}
template <class T>
View3<T> v3(Tensor<T>& t) {
  return t.template view<3>();
}

// ---------------------------------------------------------------------------
// (a) The layer equals the explicit per-head computation.

struct Case {
  const char* name;
  MultiheadConfig cfg;
  int64_t B, L, S;
  bool self;
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  bool kpm = false, attn_mask = false, attn_bias = false, key_lengths = false;
};

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
  c.attn_mask = true;
  cs.push_back(c);
  c = {"all_masks", config(5, 2, true, 3, 4, 3, 2), 2, 4, 6, false};
  c.kpm = c.attn_mask = c.attn_bias = c.key_lengths = c.causal = true;
  cs.push_back(c);
  c = {"self_bias_and_lengths", config(6, 3), 3, 4, 4, true};
  c.attn_bias = c.key_lengths = true;
  cs.push_back(c);
  return cs;
}

template <class T>
void check_against_reference(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(seed);
  MultiheadAttention<T> m(c.cfg, seed);
  if (c.cfg.bias) randomize(m, rng);  // non-zero biases
  const int64_t D = m.embed_dim(), H = m.num_heads();
  Tensor<T> q = random_tensor<T>({c.B, c.L, D}, rng);
  Tensor<T> k = c.self ? q : random_tensor<T>({c.B, c.S, m.kdim()}, rng);
  Tensor<T> v = c.self ? q : random_tensor<T>({c.B, c.S, m.vdim()}, rng);
  Tensor<bool> kpm, am;
  Tensor<T> ab;
  Tensor<int64_t> lens;
  MhaMasks<T> mk;
  if (c.kpm) {
    kpm = random_bools({c.B, c.S}, rng, 0.3);
    kpm[0] = false;  // batch 0 keeps its first key
    mk.key_padding_mask = kpm.template view<2>();
  }
  if (c.attn_mask) {
    am = random_bools({1, H, c.L, c.S}, rng, 0.7);  // broadcast over the batch
    mk.attn_mask = am.view4();
  }
  if (c.attn_bias) {
    ab = random_tensor<T>({c.B, 1, 1, c.S}, rng);  // per-key bias, broadcast over heads and queries
    mk.attn_bias = ab.view4();
  }
  if (c.key_lengths) {
    lens = Tensor<int64_t>({c.B});
    for (int64_t b = 0; b < c.B; ++b) lens[size_t(b)] = std::max<int64_t>(1, c.S - b);
    mk.key_lengths = lens.template view<1>();
  }
  MhaOptions opt;
  opt.causal = c.causal;
  opt.causal_align = c.align;

  Tensor<T> y({c.B, c.L, D}), hw({c.B, H, c.L, c.S}), aw({c.B, c.L, c.S});
  if (c.self)
    m.forward_self(v3(q), v3(y), mk, opt, nullptr, hw.view4(), v3(aw));
  else
    m.forward(v3(q), v3(k), v3(v), v3(y), mk, opt, nullptr, hw.view4(), v3(aw));
  const RefResult r = reference_mha<T>(m, v3(q), v3(k), v3(v), mk, c.causal, c.align);

  const double mag = std::max(max_abs(r.y.template view<3>()), 1.0);
  const int64_t red = std::max({D, m.kdim(), m.vdim(), c.S, H * m.v_head_dim()});
  EXPECT_TRUE(all_close(y, r.y, tolerance<T>(red, mag, 50.0), "out"));
  EXPECT_TRUE(all_close(hw, r.w, tolerance<T>(red, 1.0, 50.0), "head_weights"));
  EXPECT_TRUE(all_close(aw, head_mean(r.w), tolerance<T>(red, 1.0, 50.0), "avg_weights"));
  // Only averaged weights requested: same values.
  Tensor<T> y2({c.B, c.L, D}), aw2({c.B, c.L, c.S});
  m.forward(v3(q), v3(k), v3(v), v3(y2), mk, opt, nullptr, {}, v3(aw2));
  EXPECT_TRUE(all_close(aw2, aw, 0.0, "avg_weights alone"));
  EXPECT_TRUE(all_close(y2, y, 0.0, "out (avg_weights alone)"));
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
  m.forward_self(v3(x), v3(y0), {}, {}, nullptr, w0.view4());
  Tensor<double>& W = m.parameter("in_proj_weight");  // rows 2..3 (q) and 6..7 (k) belong to head 1
  for (int64_t r : {2, 3, 6, 7})
    for (int64_t c = 0; c < 4; ++c) W[size_t(r * 4 + c)] *= 3.0;
  m.forward_self(v3(x), v3(y1), {}, {}, nullptr, w1.view4());
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
  m.forward_self(v3(x), v3(y), {}, {}, nullptr, a.view4());
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
// (b) Gradients against central finite differences (double).

struct GradCase {
  const char* name;
  MultiheadConfig cfg;
  int64_t B, L, S;
  bool self;
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  bool kpm = false, attn_mask = false, attn_bias = false, key_lengths = false;
};

void check_gradients(const GradCase& c, uint64_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(seed);
  MultiheadAttention<double> m(c.cfg, seed);
  randomize(m, rng, 0.6);
  const int64_t D = m.embed_dim(), H = m.num_heads();
  Tensor<double> q = random_tensor<double>({c.B, c.L, D}, rng);
  Tensor<double> k = c.self ? Tensor<double>() : random_tensor<double>({c.B, c.S, m.kdim()}, rng);
  Tensor<double> v = c.self ? Tensor<double>() : random_tensor<double>({c.B, c.S, m.vdim()}, rng);
  Tensor<double> G = random_tensor<double>({c.B, c.L, D}, rng);  // loss = Σ y ⊙ G
  Tensor<bool> kpm, am;
  Tensor<double> ab;
  Tensor<int64_t> lens;
  MhaMasks<double> mk;
  if (c.kpm) {
    kpm = Tensor<bool>({c.B, c.S});
    kpm[size_t(c.S - 1)] = true;  // batch 0: last key is padding
    if (c.B > 1) kpm[size_t(c.S)] = true;  // batch 1: first key is padding
    mk.key_padding_mask = kpm.view<2>();
  }
  if (c.attn_mask) {
    am = random_bools({c.B, H, c.L, c.S}, rng, 0.75);
    mk.attn_mask = am.view4();
  }
  if (c.attn_bias) {
    ab = random_tensor<double>({1, H, c.L, c.S}, rng);
    mk.attn_bias = ab.view4();
  }
  if (c.key_lengths) {
    lens = Tensor<int64_t>({c.B});
    for (int64_t b = 0; b < c.B; ++b) lens[size_t(b)] = c.S - b;
    mk.key_lengths = lens.view<1>();
  }
  MhaOptions opt;
  opt.causal = c.causal;
  opt.causal_align = c.align;
  opt.backend = attn::Backend::reference;

  auto loss = [&]() {
    Tensor<double> y({c.B, c.L, D});
    if (c.self)
      m.forward_self(v3(q), v3(y), mk, opt);
    else
      m.forward(v3(q), v3(k), v3(v), v3(y), mk, opt);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * G[i];
    return s;
  };
  const double h = 1e-6;
  auto fd = [&](Tensor<double>& t) {
    Tensor<double> g(t.shape());
    for (size_t i = 0; i < t.size(); ++i) {
      const double x0 = t[i];
      t[i] = x0 + h;
      const double lp = loss();
      t[i] = x0 - h;
      const double lm = loss();
      t[i] = x0;
      g[i] = (lp - lm) / (2 * h);
    }
    return g;
  };

  // Analytic: one forward with cache, one backward. Input gradients are
  // overwritten, so start them from garbage.
  MhaCache<double> cache;
  Tensor<double> y({c.B, c.L, D});
  if (c.self)
    m.forward_self(v3(q), v3(y), mk, opt, &cache);
  else
    m.forward(v3(q), v3(k), v3(v), v3(y), mk, opt, &cache);
  Tensor<double> dq({c.B, c.L, D}), dk, dv;
  dq.fill(123.0);
  if (!c.self) {
    dk = Tensor<double>({c.B, c.S, m.kdim()});
    dv = Tensor<double>({c.B, c.S, m.vdim()});
    dk.fill(-7.0);
    dv.fill(9.0);
  }
  m.zero_grad();
  m.backward(cache, v3(std::as_const(G)), v3(dq), c.self ? View3<double>() : v3(dk),
             c.self ? View3<double>() : v3(dv));

  auto flat = [](const Tensor<double>& t) { return View1<const double>(t.data(), {int64_t(t.size())}); };
  auto check_flat = [&](const Tensor<double>& analytic, const Tensor<double>& numeric, const std::string& what) {
    const double tol = 1e-6 * std::max(1.0, max_abs(flat(numeric)));
    EXPECT_TRUE(all_close(analytic, numeric, tol, what));
    EXPECT_GT(max_abs(flat(numeric)), 1e-3) << what << ": a gradient check on an all-zero gradient proves little";
  };
  check_flat(dq, fd(q), c.self ? "dx" : "dquery");
  if (!c.self) {
    check_flat(dk, fd(k), "dkey");
    check_flat(dv, fd(v), "dvalue");
  }
  for (const auto& name : m.parameter_names()) {
    Tensor<double>& p = m.parameter(name);
    check_flat(m.grad(name), fd(p), "grad " + name);
  }

  // Parameter gradients accumulate; input gradients do not.
  std::map<std::string, Tensor<double>> once;
  for (const auto& name : m.parameter_names()) once.emplace(name, m.grad(name));
  Tensor<double> dq1 = dq;
  m.backward(cache, v3(std::as_const(G)), v3(dq), c.self ? View3<double>() : v3(dk),
             c.self ? View3<double>() : v3(dv));
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
  c.kpm = c.attn_mask = c.attn_bias = true;
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
  c.attn_mask = true;
  check_gradients(c, 15);
}

// ---------------------------------------------------------------------------
// (c) Errors name the function, the argument and the shapes.

TEST(MultiheadAttentionErrors, Config) {
  auto make = [](MultiheadConfig c) { return [c] { MultiheadAttention<float> m(c); }; };
  EXPECT_TRUE(throws_with(make(config(0, 1)), {"attn::MultiheadAttention", "'embed_dim' is 0", ">= 1"}));
  EXPECT_TRUE(throws_with(make(config(4, 0)), {"attn::MultiheadAttention", "'num_heads' is 0", ">= 1"}));
  EXPECT_TRUE(throws_with(make(config(4, -2)), {"'num_heads' is -2"}));
  EXPECT_TRUE(throws_with(make(config(4, 1, true, -1)), {"'kdim' is -1", ">= 0"}));
  EXPECT_TRUE(throws_with(make(config(4, 1, true, 0, -3)), {"'vdim' is -3", ">= 0"}));
  EXPECT_TRUE(throws_with(make(config(4, 1, true, 0, 0, -1)), {"'head_dim' is -1"}));
  EXPECT_TRUE(throws_with(make(config(4, 1, true, 0, 0, 2, -1)), {"'v_head_dim' is -1"}));
  EXPECT_TRUE(throws_with(make(config(10, 3)),
                          {"'embed_dim' = 10 is not divisible by 'num_heads' = 3", "'head_dim'"}));
  EXPECT_TRUE(throws_with(make(config(int64_t(1) << 40, 1)), {"'embed_dim' is 1099511627776", "expected <="}));
  EXPECT_TRUE(throws_with(make(config(4, 1 << 20, true, 0, 0, 1 << 10)), {"'num_heads' * 'head_dim'", "too large"}));
  EXPECT_NO_THROW(make(config(10, 3, true, 0, 0, 4))());  // explicit head_dim lifts the divisibility rule
}

TEST(MultiheadAttentionErrors, ParameterNames) {
  MultiheadAttention<float> m(config(4, 2));
  EXPECT_TRUE(throws_with([&] { m.parameter("weight"); },
                          {"attn::MultiheadAttention::parameter", "unknown parameter name 'weight'",
                           "in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias"}));
  EXPECT_TRUE(throws_with([&] { m.grad("q_proj_weight"); },
                          {"attn::MultiheadAttention::grad", "'q_proj_weight'", "in_proj_weight"}));
  const MultiheadAttention<float>& cm = m;
  EXPECT_TRUE(throws_with([&] { cm.parameter("x"); }, {"unknown parameter name 'x'"}));
  EXPECT_TRUE(throws_with([&] { cm.grad("x"); }, {"unknown parameter name 'x'"}));
  MultiheadAttention<float> nb(config(4, 2, false, 3));
  EXPECT_TRUE(throws_with([&] { nb.parameter("in_proj_bias"); },
                          {"'in_proj_bias'", "q_proj_weight, k_proj_weight, v_proj_weight, out_proj.weight"}));
}

TEST(MultiheadAttentionErrors, LoadParameter) {
  MultiheadAttention<float> m(config(4, 2));
  std::vector<float> buf(100);
  EXPECT_TRUE(throws_with([&] { m.load_parameter("in_proj_weight", View2<const float>(buf.data(), {4, 4})); },
                          {"attn::MultiheadAttention::load_parameter", "'in_proj_weight' has shape (12, 4)",
                           "got a value of shape (4, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("in_proj_bias", View1<const float>(buf.data(), {4})); },
                          {"'in_proj_bias' has shape (12,)", "got a value of shape (4,)"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("out_proj.bias", View2<const float>(buf.data(), {1, 4})); },
                          {"'out_proj.bias' has shape (4,)", "(1, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("out_proj.weight", View1<const float>(buf.data(), {16})); },
                          {"'out_proj.weight' has shape (4, 4)", "(16,)"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("bias", View1<const float>(buf.data(), {4})); },
                          {"load_parameter", "unknown parameter name 'bias'", "out_proj.bias"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("out_proj.weight", View2<const float>(nullptr, {4, 4})); },
                          {"'out_proj.weight'", "null pointer"}));
  // A failed load leaves the parameter unchanged.
  const Tensor<float> before = m.parameter("in_proj_weight");
  EXPECT_ANY_THROW(m.load_parameter("in_proj_weight", View2<const float>(buf.data(), {3, 4})));
  EXPECT_TRUE(all_close(m.parameter("in_proj_weight"), before, 0.0, "unchanged"));
}

struct ErrorFixture : ::testing::Test {
  MultiheadAttention<float> m{config(4, 2, true, 3, 5)};
  MultiheadAttention<float> s{config(4, 2)};
  Tensor<float> q{2, 3, 4}, k{2, 6, 3}, v{2, 6, 5}, y{2, 3, 4};
  View3<const float> cq() const { return q.view<3>(); }
  View3<const float> ck() const { return k.view<3>(); }
  View3<const float> cv() const { return v.view<3>(); }
};

TEST_F(ErrorFixture, ForwardInputShapes) {
  const char* fn = "attn::MultiheadAttention::forward:";
  Tensor<float> bad{2, 3, 5};
  EXPECT_TRUE(throws_with([&] { m.forward(bad.view<3>(), ck(), cv(), y.view<3>()); },
                          {fn, "'query' has shape (2, 3, 5)", "expected (B, L, 4)"}));
  Tensor<float> k1{1, 6, 3};
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), k1.view<3>(), cv(), y.view<3>()); },
                          {fn, "'key' has shape (1, 6, 3)", "expected (2, S, 3)"}));
  Tensor<float> k2{2, 6, 4};
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), k2.view<3>(), cv(), y.view<3>()); },
                          {fn, "'key' has shape (2, 6, 4)", "kdim = 3"}));
  Tensor<float> v1{2, 5, 5};
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), v1.view<3>(), y.view<3>()); },
                          {fn, "'value' has shape (2, 5, 5)", "expected (2, 6, 5)"}));
  Tensor<float> v2{2, 6, 4};
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), v2.view<3>(), y.view<3>()); },
                          {fn, "'value' has shape (2, 6, 4)", "vdim = 5"}));
  EXPECT_TRUE(throws_with([&] { m.forward({}, ck(), cv(), y.view<3>()); }, {fn, "'query' is required"}));
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), {}, cv(), y.view<3>()); }, {fn, "'key' is required"}));
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), {}, y.view<3>()); }, {fn, "'value' is required"}));
  std::vector<float> buf(64);
  EXPECT_TRUE(throws_with([&] { m.forward(View3<const float>(buf.data(), {2, 0, 4}), ck(), cv(), y.view<3>()); },
                          {fn, "'query' has shape (2, 0, 4)", "B, L >= 1"}));
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), View3<const float>(buf.data(), {2, 0, 3}), cv(), y.view<3>()); },
                          {fn, "'key' has shape (2, 0, 3)", "S >= 1"}));
}

TEST_F(ErrorFixture, ForwardOutputs) {
  const char* fn = "attn::MultiheadAttention::forward:";
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), {}); }, {fn, "'out' is required"}));
  Tensor<float> y2{2, 4, 4};
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y2.view<3>()); },
                          {fn, "'out' has shape (2, 4, 4)", "expected (2, 3, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), View3<float>(y.data(), {2, 3, 4}, {0, 4, 1})); },
                          {fn, "'out' has stride 0 on axis 0"}));
  Tensor<float> hw{2, 2, 3, 5};
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), {}, {}, nullptr, hw.view4()); },
                          {fn, "'head_weights' has shape (2, 2, 3, 5)", "expected (2, 2, 3, 6)"}));
  Tensor<float> aw{2, 3, 3};
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), {}, {}, nullptr, {}, aw.view<3>()); },
                          {fn, "'avg_weights' has shape (2, 3, 3)", "expected (2, 3, 6)"}));
}

TEST_F(ErrorFixture, ForwardMasksAndOptions) {
  const char* fn = "attn::MultiheadAttention::forward:";
  Tensor<bool> am{2, 2, 3, 4};
  MhaMasks<float> mk;
  mk.attn_mask = am.view4();
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), mk); },
                          {fn, "'attn_mask' has shape (2, 2, 3, 4)", "(B, H, L, S) = (2, 2, 3, 6) or 1"}));
  Tensor<float> ab{3, 1, 1, 6};
  mk = {};
  mk.attn_bias = ab.view4();
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), mk); },
                          {fn, "'attn_bias' has shape (3, 1, 1, 6)", "(2, 2, 3, 6) or 1"}));
  Tensor<float> ab2{1, 1, 3, 6};
  ab2[4] = std::numeric_limits<float>::quiet_NaN();
  mk.attn_bias = ab2.view4();
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), mk); },
                          {fn, "'attn_bias' contains NaN or +Inf at (0, 0, 0, 4)"}));
  ab2[4] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), mk); }, {fn, "'attn_bias'", "+Inf"}));
  ab2[4] = -std::numeric_limits<float>::infinity();  // -inf masks the key
  EXPECT_NO_THROW(m.forward(cq(), ck(), cv(), y.view<3>(), mk));
  Tensor<bool> kpm{2, 3};
  mk = {};
  mk.key_padding_mask = kpm.view<2>();
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), mk); },
                          {fn, "'key_padding_mask' has shape (2, 3)", "expected (B, S) = (2, 6)"}));
  Tensor<int64_t> lens{3};
  mk = {};
  mk.key_lengths = lens.view<1>();
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), mk); },
                          {fn, "'key_lengths' has shape (3,)", "expected (B,) = (2,)"}));
  Tensor<int64_t> lens2{2};
  lens2[1] = 7;
  mk.key_lengths = lens2.view<1>();
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), mk); },
                          {fn, "'key_lengths' has value 7 at batch 1", "<= S = 6"}));
  MhaOptions opt;
  opt.num_threads = -1;
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), ck(), cv(), y.view<3>(), {}, opt); },
                          {fn, "'num_threads' is -1"}));
  opt = {};
  opt.check_finite = true;
  Tensor<float> kn = k;
  kn[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(throws_with([&] { m.forward(cq(), kn.view<3>(), cv(), y.view<3>(), {}, opt); },
                          {fn, "'key' contains NaN or Inf at (0, 1, 2)"}));
  // Without the check, NaN inputs are the caller's business; the options
  // pass through to scaled_dot_product_attention (fused is float-only).
  MultiheadAttention<double> md(config(4, 2));
  Tensor<double> xd{1, 2, 4}, yd{1, 2, 4};
  opt = {};
  opt.backend = attn::Backend::fused;
  EXPECT_TRUE(throws_with([&] { md.forward_self(xd.view<3>(), yd.view<3>(), {}, opt); },
                          {"scaled_dot_product_attention", "'backend' is fused", "float32 only"}));
}

TEST_F(ErrorFixture, ForwardSelf) {
  const char* fn = "attn::MultiheadAttention::forward_self:";
  EXPECT_TRUE(throws_with([&] { m.forward_self(cq(), y.view<3>()); },
                          {fn, "kdim = vdim = embed_dim = 4", "kdim = 3, vdim = 5", "forward(query, key, value)"}));
  Tensor<float> bad{2, 3, 6};
  EXPECT_TRUE(throws_with([&] { s.forward_self(bad.view<3>(), y.view<3>()); },
                          {fn, "'x' has shape (2, 3, 6)", "expected (B, N, 4)"}));
  EXPECT_TRUE(throws_with([&] { s.forward_self({}, y.view<3>()); }, {fn, "'x' is required"}));
  Tensor<float> y2{2, 3, 3};
  EXPECT_TRUE(throws_with([&] { s.forward_self(cq(), y2.view<3>()); }, {fn, "'out' has shape (2, 3, 3)"}));
  MhaOptions opt;
  opt.check_finite = true;
  Tensor<float> qi = q;
  qi[0] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_with([&] { s.forward_self(qi.view<3>(), y.view<3>(), {}, opt); },
                          {fn, "'x' contains NaN or Inf at (0, 0, 0)"}));
}

TEST_F(ErrorFixture, Backward) {
  const char* fn = "attn::MultiheadAttention::backward:";
  MhaCache<float> empty;
  EXPECT_TRUE(throws_with([&] { m.backward(empty, y.view<3>()); }, {fn, "'cache' is empty"}));
  MhaCache<float> cache;
  m.forward(cq(), ck(), cv(), y.view<3>(), {}, {}, &cache);
  MultiheadAttention<float> other(config(4, 1, true, 3, 5));
  EXPECT_TRUE(throws_with([&] { other.backward(cache, y.view<3>()); },
                          {fn, "'cache'", "num_heads = 1", "different layer"}));
  Tensor<float> dy{2, 4, 4};
  EXPECT_TRUE(throws_with([&] { m.backward(cache, dy.view<3>()); },
                          {fn, "'dout' has shape (2, 4, 4)", "expected (2, 3, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.backward(cache, {}); }, {fn, "'dout' is required"}));
  Tensor<float> dq{2, 3, 3}, dk{2, 6, 4}, dv{2, 5, 5};
  EXPECT_TRUE(throws_with([&] { m.backward(cache, y.view<3>(), dq.view<3>()); },
                          {fn, "'dquery' has shape (2, 3, 3)", "expected (2, 3, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.backward(cache, y.view<3>(), {}, dk.view<3>()); },
                          {fn, "'dkey' has shape (2, 6, 4)", "expected (2, 6, 3)"}));
  EXPECT_TRUE(throws_with([&] { m.backward(cache, y.view<3>(), {}, {}, dv.view<3>()); },
                          {fn, "'dvalue' has shape (2, 5, 5)", "expected (2, 6, 5)"}));
  Tensor<float> dq2{2, 3, 4};
  EXPECT_TRUE(throws_with([&] { m.backward(cache, y.view<3>(), View3<float>(dq2.data(), {2, 3, 4}, {12, 0, 1})); },
                          {fn, "'dquery' has stride 0 on axis 1"}));

  MhaCache<float> scache;
  s.forward_self(cq(), y.view<3>(), {}, {}, &scache);
  Tensor<float> dx{2, 3, 4}, dk2{2, 3, 4};
  EXPECT_TRUE(throws_with([&] { s.backward(scache, y.view<3>(), dx.view<3>(), dk2.view<3>()); },
                          {fn, "'dkey' and 'dvalue' must be empty after forward_self", "'dquery'"}));
  // The cache of forward_self (S = L) used by a layer whose widths differ.
  MultiheadAttention<float> s3(config(4, 4));
  EXPECT_TRUE(throws_with([&] { s3.backward(scache, y.view<3>()); }, {fn, "different layer"}));

  MhaOptions opt;
  opt.check_finite = true;
  s.forward_self(cq(), y.view<3>(), {}, opt, &scache);
  Tensor<float> dyn{2, 3, 4};
  dyn[13] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(throws_with([&] { s.backward(scache, dyn.view<3>(), dx.view<3>()); },
                          {fn, "'dout' contains NaN or Inf at (1, 0, 1)"}));
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
  MhaCache<T> cache;
  m.forward_self(v3(x), v3(y), {}, {}, &cache, hw.view4());
  double max_score = 0;
  for (size_t i = 0; i < cache.lse.size(); ++i) max_score = std::max(max_score, std::abs(double(cache.lse[i])));
  EXPECT_GT(max_score, 1e3) << "the test should produce huge scores";
  EXPECT_TRUE(all_finite(y));
  EXPECT_TRUE(all_finite(hw));
  const RefResult r = reference_mha<T>(m, v3(x), v3(x), v3(x));
  // The score gaps are in the thousands, so the weights are saturated (0 or
  // 1) and the rounding of the scores (eps·|score|) does not reach the output.
  const double mag = max_abs(r.y.template view<3>());
  EXPECT_TRUE(all_close(y, r.y, tolerance<T>(N * D, mag, 50.0), "out at huge scores"));
  Tensor<T> G = random_tensor<T>({B, N, D}, rng), dx({B, N, D});
  m.zero_grad();
  m.backward(cache, v3(std::as_const(G)), v3(dx));
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
  MhaMasks<T> mk;
  mk.key_padding_mask = kpm.template view<2>();
  mk.attn_mask = am.view4();
  Tensor<T> y({B, L, D}), hw({B, H, L, S}), aw({B, L, S});
  MhaCache<T> cache;
  m.forward(v3(q), v3(k), v3(v), v3(y), mk, {}, &cache, hw.view4(), v3(aw));
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
  const RefResult r = reference_mha<T>(m, v3(q), v3(k), v3(v), mk);
  EXPECT_TRUE(all_close(y, r.y, tolerance<T>(8, max_abs(r.y.template view<3>()), 50.0), "out"));

  Tensor<T> G = random_tensor<T>({B, L, D}, rng), dq({B, L, D}), dk({B, S, 3}), dv({B, S, 5});
  m.zero_grad();
  m.backward(cache, v3(std::as_const(G)), v3(dq), v3(dk), v3(dv));
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
  MhaMasks<T> mk;
  mk.key_padding_mask = kpm.template view<2>();
  Tensor<T> G = random_tensor<T>({B, L, D}, rng);

  // Batch-first, contiguous.
  Tensor<T> y({B, L, D}), dq({B, L, D}), dk({B, S, 3}), dv({B, S, 4});
  MhaCache<T> cache;
  m.forward(v3(q), v3(k), v3(v), v3(y), mk, {}, &cache);
  m.zero_grad();
  m.backward(cache, v3(std::as_const(G)), v3(dq), v3(dk), v3(dv));
  std::map<std::string, Tensor<T>> grads;
  for (const auto& n : m.parameter_names()) grads.emplace(n, m.grad(n));

  // Sequence-first, strided everywhere: inputs, output, dout and input grads.
  Tensor<T> y_nb({L, B, D}), dq_nb({L, B, D}), dk_nb({S, B, 3}), dv_nb({S, B, 4}), G_nb({L, B, D});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < D; ++d) seq_first(G_nb)(b, i, d) = G[size_t((b * L + i) * D + d)];
  MhaCache<T> cache2;
  m.forward(seq_first(q_nb), seq_first(k_nb), seq_first(v_nb), seq_first(y_nb), mk, {}, &cache2);
  m.zero_grad();
  m.backward(cache2, View3<const T>(seq_first(G_nb)), seq_first(dq_nb), seq_first(dk_nb), seq_first(dv_nb));
  const double tol = tolerance<T>(D, 4.0);
  EXPECT_TRUE(all_close(View3<const T>(seq_first(y_nb)), v3(std::as_const(y)), tol, "out"));
  EXPECT_TRUE(all_close(View3<const T>(seq_first(dq_nb)), v3(std::as_const(dq)), tol, "dquery"));
  EXPECT_TRUE(all_close(View3<const T>(seq_first(dk_nb)), v3(std::as_const(dk)), tol, "dkey"));
  EXPECT_TRUE(all_close(View3<const T>(seq_first(dv_nb)), v3(std::as_const(dv)), tol, "dvalue"));
  for (const auto& n : m.parameter_names()) EXPECT_TRUE(all_close(m.grad(n), grads.at(n), tol, "grad " + n));
  // And both equal the per-head computation.
  const RefResult r = reference_mha<T>(m, v3(q), v3(k), v3(v), mk);
  EXPECT_TRUE(all_close(y, r.y, tolerance<T>(D, max_abs(r.y.template view<3>()), 50.0), "out vs reference"));

  // Without a cache the strided inputs go through scratch copies: same result.
  Tensor<T> y3({L, B, D});
  m.forward(seq_first(q_nb), seq_first(k_nb), seq_first(v_nb), seq_first(y3), mk);
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
  MhaCache<double> cache;
  m.forward_self(v3(x), v3(y), {}, {}, &cache);
  m.backward(cache, v3(std::as_const(G)), v3(dx1));
  Tensor<double> x_saved = x;
  x.fill(1e3);
  m.backward(cache, v3(std::as_const(G)), v3(dx2));
  EXPECT_TRUE(all_close(dx2, dx1, 0.0, "dx after the input buffer changed"));
  EXPECT_TRUE(all_close(cache.query, x_saved, 0.0, "cached input"));
  // The cache's own saved input may be fed back into a forward that refills it.
  Tensor<double> y_again({2, 3, 4});
  m.forward_self(cache.query.view<3>(), v3(y_again), {}, {}, &cache);
  EXPECT_TRUE(all_close(y_again, y, 0.0, "forward from the cache's own input"));
  EXPECT_TRUE(all_close(cache.query, x_saved, 0.0, "cached input after refill"));
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
  m.forward_self(v3(x), v3(y));
  m.forward_self(v3(px), v3(py));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t d = 0; d < D; ++d) y_perm[size_t((b * N + i) * D + d)] = y[size_t((b * N + perm[size_t(i)]) * D + d)];
  EXPECT_TRUE(all_close(py, y_perm, tolerance<double>(D * N, max_abs(y.view<3>())), "Attention(P.X) vs P.Attention(X)"));
  // A causal mask breaks the symmetry (the permutation is not the identity).
  ASSERT_FALSE(std::is_sorted(perm.begin(), perm.end()));
  MhaOptions causal;
  causal.causal = true;
  m.forward_self(v3(x), v3(y), {}, causal);
  m.forward_self(v3(px), v3(py), {}, causal);
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
  opt.causal = true;
  m.forward_self(v3(x), v3(y), {}, opt);
  for (int64_t d = 0; d < D; ++d) x[size_t(3 * D + d)] += 5.0;  // change token 3
  m.forward_self(v3(x), v3(y2), {}, opt);
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
