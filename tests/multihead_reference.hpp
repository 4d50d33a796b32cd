// Helpers shared by the multi-head attention tests: configurations, random
// parameters, and the explicit per-head computation in double the layer is
// compared with (split into heads, softmax(q·kᵀ/√E)·v per head,
// concatenate, project), independent of the layer's code except for the
// parameters. The variants are written out as their definitions: a window
// and causal as a position test, soft-capping as c·tanh(s/c), ALiBi as the
// bias -slope·|p - j|, sinks as one more term in the denominator.
#pragma once

#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "testing.hpp"

namespace attn::testing {

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
// `a` gives the inputs and masks; empty key and value mean self-attention.
// `variants` supplies window, softcap and position_offset (its other fields
// are ignored); the ALiBi slopes come from `a`, the sinks from the layer.
template <class T>
RefResult reference_mha(const MultiheadAttention<T>& m, const MhaArgs<T>& a, bool causal = false,
                        CausalAlign align = CausalAlign::top_left, const SdpaOptions& variants = {}) {
  const MhaArgs<T>& mk = a;
  const View3<const T> query = a.query, key = a.key.empty() ? a.query : a.key,
                       value = a.value.empty() ? a.query : a.value;
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
  // Query i sits at key position i + offset.
  const int64_t offset = variants.position_offset ? *variants.position_offset
                         : align == CausalAlign::bottom_right ? S - L
                                                              : 0;
  const Window win = variants.window;
  const double cap = variants.softcap;
  std::vector<double> sinks;
  if (m.has_sinks())
    for (int64_t h = 0; h < H; ++h) sinks.push_back(double(m.parameter("sinks")[size_t(h)]));

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
        double zmax = sinks.empty() ? -1e300 : sinks[size_t(h)];
        bool any = !sinks.empty();
        const int64_t pos = i + offset;
        for (int64_t j = 0; j < S; ++j) {
          bool v = true;
          if (causal && j > pos) v = false;
          if (win.left >= 0 && j < pos - win.left) v = false;
          if (win.right >= 0 && j > pos + win.right) v = false;
          if (!mk.key_padding_mask.empty() && mk.key_padding_mask(b, j)) v = false;
          if (!mk.key_lengths.empty() && j >= mk.key_lengths(b)) v = false;
          if (!mk.mask.empty()) {
            const auto& am = mk.mask;
            if (!am(bc(b, am.dim(0)), bc(h, am.dim(1)), bc(i, am.dim(2)), bc(j, am.dim(3)))) v = false;
          }
          double s = 0;
          for (int64_t e = 0; e < E; ++e) s += qh[size_t(i * E + e)] * kh[size_t(j * E + e)];
          s /= std::sqrt(double(E));
          if (cap > 0) s = cap * std::tanh(s / cap);
          if (!mk.alibi_slopes.empty()) s -= double(mk.alibi_slopes(h)) * double(std::abs(pos - j));
          if (!mk.bias.empty()) {
            const auto& ab = mk.bias;
            s += double(ab(bc(b, ab.dim(0)), bc(h, ab.dim(1)), bc(i, ab.dim(2)), bc(j, ab.dim(3))));
          }
          vis[size_t(j)] = v;
          z[size_t(j)] = s;
          if (v) {
            any = true;
            zmax = std::max(zmax, s);
          }
        }
        // The sink joins the denominator and adds no value.
        double sum = sinks.empty() ? 0.0 : std::exp(sinks[size_t(h)] - zmax);
        for (int64_t j = 0; j < S; ++j) sum += vis[size_t(j)] ? std::exp(z[size_t(j)] - zmax) : 0.0;
        for (int64_t j = 0; j < S; ++j) {
          const double p = (any && vis[size_t(j)]) ? std::exp(z[size_t(j)] - zmax) / sum : 0.0;
          r.w[size_t(((b * H + h) * L + i) * S + j)] = p;
          // Concatenate: head h fills columns [h·Ev, (h+1)·Ev).
          for (int64_t e = 0; e < Ev; ++e) concat[size_t(i * HEv + h * Ev + e)] += p * vh[size_t(j * Ev + e)];
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

// The layer's arguments: inputs (key and value empty for self-attention)
// and the masks of `masks`.
template <class T>
MhaArgs<T> inputs(View3<const T> query, View3<const T> key = {}, View3<const T> value = {}, MhaArgs<T> masks = {}) {
  masks.query = query;
  masks.key = key;
  masks.value = value;
  return masks;
}

// One multi-head test case: the layer, the batch and lengths, and which
// options and masks are on (shared by the forward and the backward tests).
struct LayerCase {
  const char* name;
  MultiheadConfig cfg;
  int64_t B, L, S;
  bool self;
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  bool kpm = false, mask = false, bias = false, key_lengths = false;
  bool transform = false;  // the position_scaling Q/K transform (backward tests)
  // Variants: window, softcap and position_offset in `variants`; ALiBi with
  // random slopes in [0, 1); sinks: set cfg.sinks (random values are loaded).
  SdpaOptions variants{};
  bool alibi = false;
};

MultiheadConfig with_sinks(MultiheadConfig c) {
  c.sinks = true;
  return c;
}

// The options of a case: causal, its alignment and the variants.
MhaOptions layer_options(const LayerCase& c) {
  MhaOptions o;
  o.sdpa = c.variants;
  o.sdpa.causal = c.causal;
  o.sdpa.causal_align = c.align;
  return o;
}

}  // namespace attn::testing
