// The multi-head attention layer: three input projections, one call to the
// public scaled dot-product attention over all heads at once, and an output
// projection.
//
// Data flow (B batch, L queries, S keys, D = embed_dim, H heads, E / Ev head
// widths), every buffer row-major:
//
//   xq (B·L, D)    ─ GEMM W_qᵀ ─▶ q (B·L, H·E)  ┐
//   xk (B·S, kdim) ─ GEMM W_kᵀ ─▶ k (B·S, H·E)  ├ viewed as (B, H, N, ·) with
//   xv (B·S, vdim) ─ GEMM W_vᵀ ─▶ v (B·S, H·Ev) ┘ View4::bnhd: no head split copy
//   sdpa(q, k, v) ─▶ o (B·L, H·Ev)   (heads already concatenated in memory)
//   o ─ GEMM W_oᵀ ─▶ y (B·L, D)
//
// The backward walks the same steps in reverse with the transposed GEMMs:
//   y = o·W_oᵀ + b_o   ->  dW_o += dyᵀ·o,  db_o += Σ_rows dy,  do = dy·W_o
//   o = sdpa(q, k, v)  ->  dq, dk, dv from scaled_dot_product_attention_backward
//   q = xq·W_qᵀ + b_q  ->  dW_q += dqᵀ·xq, db_q += Σ_rows dq,  dxq = dq·W_q
// (and the same for k and v). In self-attention xq = xk = xv, so dx is the sum
// of the three input gradients.
//
// The packed parameter in_proj_weight [3D, D] holds W_q, W_k and W_v as three
// consecutive row blocks, and in_proj_bias is laid out [b_q; b_k; b_v] in
// both the packed and the separate case, so one slicing rule serves both.
#include "attn/multihead.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn/rng.hpp"
#include "kernels/gemm/gemm.hpp"
#include "validate.hpp"

namespace attn {
namespace {

using detail::add_column_sums;
using detail::gemm;
using detail::GemmShape;

const char* const kInProjWeight = "in_proj_weight";
const char* const kQProjWeight = "q_proj_weight";
const char* const kKProjWeight = "k_proj_weight";
const char* const kVProjWeight = "v_proj_weight";
const char* const kInProjBias = "in_proj_bias";
const char* const kOutProjWeight = "out_proj.weight";
const char* const kOutProjBias = "out_proj.bias";

using detail::Checker;

// Copies a rank-3 view (any strides) into dense row-major storage.
template <class T>
void gather(View3<const T> src, T* dst) {
  for (int64_t a = 0; a < src.dim(0); ++a)
    for (int64_t b = 0; b < src.dim(1); ++b)
      for (int64_t c = 0; c < src.dim(2); ++c) *dst++ = src(a, b, c);
}
template <class T>
void scatter(const T* src, View3<T> dst) {
  for (int64_t a = 0; a < dst.dim(0); ++a)
    for (int64_t b = 0; b < dst.dim(1); ++b)
      for (int64_t c = 0; c < dst.dim(2); ++c) dst(a, b, c) = *src++;
}

// A dense (rows, width) copy of `src` in `storage`, or src's own data when it
// is already dense and no copy is wanted.
template <class T>
const T* dense(View3<const T> src, Tensor<T>& storage, bool force_copy) {
  if (src.is_contiguous() && !force_copy) return src.data;
  storage = Tensor<T>({src.dim(0), src.dim(1), src.dim(2)});
  gather(src, storage.data());
  return storage.data();
}

// One row block of the input projection: W (rows, cols) with leading
// dimension cols, bias of `rows` entries (nullptr when the layer has none).
// T is const for parameters, mutable for their gradients.
template <class T>
struct Proj {
  T* w;
  T* b;
  int64_t rows, cols;
};

// Adds `bias` (n) to every row of C (m, n).
template <class T>
void add_rows(T* C, int64_t m, int64_t n, const T* bias) {
  if (!bias) return;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) C[i * n + j] += bias[j];
}
// U(-bound, bound) from the library's generator.
template <class T>
void fill_uniform(Tensor<T>& t, double bound, Rng& rng) {
  for (size_t i = 0; i < t.size(); ++i) t[i] = T(rng.uniform(-bound, bound));
}

}  // namespace

// ---------------------------------------------------------------------------
// Construction and parameters

template <class T>
MultiheadAttention<T>::MultiheadAttention(const MultiheadConfig& config, uint64_t seed) : cfg_(config) {
  const Checker c{"MultiheadAttention::MultiheadAttention"};
  auto at_least = [&](int64_t v, const char* name, int64_t lo, const char* note) {
    if (v < lo)
      c.fail(std::string("config '") + name + "' is " + std::to_string(v) + ", expected >= " +
             std::to_string(lo) + note);
  };
  at_least(cfg_.embed_dim, "embed_dim", 1, "");
  at_least(cfg_.num_heads, "num_heads", 1, "");
  at_least(cfg_.kdim, "kdim", 0, " (0 = embed_dim)");
  at_least(cfg_.vdim, "vdim", 0, " (0 = embed_dim)");
  at_least(cfg_.head_dim, "head_dim", 0, " (0 = embed_dim / num_heads)");
  at_least(cfg_.v_head_dim, "v_head_dim", 0, " (0 = head_dim)");
  const int64_t D = cfg_.embed_dim, H = cfg_.num_heads;
  // Keep every parameter and activation width far from int64 overflow.
  constexpr int64_t kMaxWidth = int64_t(1) << 24;
  for (auto [v, name] : {std::pair{D, "embed_dim"}, {H, "num_heads"}, {cfg_.kdim, "kdim"}, {cfg_.vdim, "vdim"},
                         {cfg_.head_dim, "head_dim"}, {cfg_.v_head_dim, "v_head_dim"}})
    if (v > kMaxWidth)
      c.fail(std::string("config '") + name + "' is " + std::to_string(v) + ", expected <= " +
             std::to_string(kMaxWidth));
  if (cfg_.head_dim == 0) {
    if (D % H != 0)
      c.fail("config 'embed_dim' = " + std::to_string(D) + " is not divisible by 'num_heads' = " +
             std::to_string(H) + "; set 'head_dim' (and 'v_head_dim') explicitly");
    cfg_.head_dim = D / H;
  }
  if (cfg_.v_head_dim == 0) cfg_.v_head_dim = cfg_.head_dim;
  if (cfg_.kdim == 0) cfg_.kdim = D;
  if (cfg_.vdim == 0) cfg_.vdim = D;
  if (H * std::max(cfg_.head_dim, cfg_.v_head_dim) > kMaxWidth)
    c.fail("config 'num_heads' * 'head_dim' = " + std::to_string(H * std::max(cfg_.head_dim, cfg_.v_head_dim)) +
           " is too large, expected <= " + std::to_string(kMaxWidth));
  packed_ = cfg_.kdim == D && cfg_.vdim == D && cfg_.head_dim == cfg_.v_head_dim && H * cfg_.head_dim == D;

  const int64_t HE = H * cfg_.head_dim, HEv = H * cfg_.v_head_dim;
  if (packed_) {
    params_.emplace(kInProjWeight, Tensor<T>({3 * D, D}));
  } else {
    params_.emplace(kQProjWeight, Tensor<T>({HE, D}));
    params_.emplace(kKProjWeight, Tensor<T>({HE, cfg_.kdim}));
    params_.emplace(kVProjWeight, Tensor<T>({HEv, cfg_.vdim}));
  }
  if (cfg_.bias) {
    params_.emplace(kInProjBias, Tensor<T>({2 * HE + HEv}));
    params_.emplace(kOutProjBias, Tensor<T>({D}));
  }
  params_.emplace(kOutProjWeight, Tensor<T>({D, HEv}));
  for (const auto& [name, p] : params_) grads_.emplace(name, Tensor<T>(p.shape()));
  reset_parameters(seed);
}

template <class T>
std::vector<std::string> MultiheadAttention<T>::parameter_names() const {
  // PyTorch's state_dict order.
  std::vector<std::string> names;
  if (packed_) {
    names.push_back(kInProjWeight);
  } else {
    names.insert(names.end(), {kQProjWeight, kKProjWeight, kVProjWeight});
  }
  if (cfg_.bias) names.push_back(kInProjBias);
  names.push_back(kOutProjWeight);
  if (cfg_.bias) names.push_back(kOutProjBias);
  return names;
}

namespace {
template <class Map>
auto& lookup(Map& m, const std::string& name, const char* fn, const std::vector<std::string>& valid) {
  auto it = m.find(name);
  if (it == m.end()) {
    std::string list;
    for (const auto& n : valid) list += (list.empty() ? "" : ", ") + n;
    throw InvalidArgument(std::string("attn::MultiheadAttention::") + fn + ": unknown parameter name '" + name +
                "', expected one of " + list);
  }
  return it->second;
}
}  // namespace

template <class T>
Tensor<T>& MultiheadAttention<T>::parameter(const std::string& name) {
  return lookup(params_, name, "parameter", parameter_names());
}
template <class T>
const Tensor<T>& MultiheadAttention<T>::parameter(const std::string& name) const {
  return lookup(params_, name, "parameter", parameter_names());
}
template <class T>
Tensor<T>& MultiheadAttention<T>::grad(const std::string& name) {
  return lookup(grads_, name, "grad", parameter_names());
}
template <class T>
const Tensor<T>& MultiheadAttention<T>::grad(const std::string& name) const {
  return lookup(grads_, name, "grad", parameter_names());
}

template <class T>
void MultiheadAttention<T>::zero_grad() {
  for (auto& [name, g] : grads_) g.fill(T(0));
}

template <class T>
void MultiheadAttention<T>::reset_parameters(uint64_t seed) {
  // As torch.nn.MultiheadAttention._reset_parameters: Xavier-uniform input
  // projections, bound sqrt(6 / (fan_in + fan_out)) over the whole tensor
  // (the packed [3D, D] one included); out_proj keeps nn.Linear's default
  // kaiming_uniform_(a = sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); biases 0.
  Rng rng(seed);
  auto xavier = [&](Tensor<T>& w) {
    fill_uniform(w, std::sqrt(6.0 / double(w.dim(0) + w.dim(1))), rng);
  };
  if (packed_) {
    xavier(params_.at(kInProjWeight));
  } else {
    xavier(params_.at(kQProjWeight));
    xavier(params_.at(kKProjWeight));
    xavier(params_.at(kVProjWeight));
  }
  Tensor<T>& wo = params_.at(kOutProjWeight);
  fill_uniform(wo, 1.0 / std::sqrt(double(wo.dim(1))), rng);
  if (cfg_.bias) {
    params_.at(kInProjBias).fill(T(0));
    params_.at(kOutProjBias).fill(T(0));
  }
}

template <class T>
void MultiheadAttention<T>::load_parameter(const std::string& name, View<const T, 2> w) {
  Tensor<T>& p = lookup(params_, name, "load_parameter", parameter_names());
  const Checker c{"MultiheadAttention::load_parameter"};
  if (p.rank() != 2 || w.shape[0] != p.dim(0) || w.shape[1] != p.dim(1))
    c.fail("parameter '" + name + "' has shape " + shape_str(p.shape()) + ", got a value of shape " +
           shape_str(w.shape));
  if (w.data == nullptr && w.numel() > 0) c.fail("the value for '" + name + "' has no data (null pointer)");
  for (int64_t i = 0; i < w.shape[0]; ++i)
    for (int64_t j = 0; j < w.shape[1]; ++j) p[size_t(i * w.shape[1] + j)] = w(i, j);
}

template <class T>
void MultiheadAttention<T>::load_parameter(const std::string& name, View<const T, 1> b) {
  Tensor<T>& p = lookup(params_, name, "load_parameter", parameter_names());
  const Checker c{"MultiheadAttention::load_parameter"};
  if (p.rank() != 1 || b.shape[0] != p.dim(0))
    c.fail("parameter '" + name + "' has shape " + shape_str(p.shape()) + ", got a value of shape " +
           shape_str(b.shape));
  if (b.data == nullptr && b.numel() > 0) c.fail("the value for '" + name + "' has no data (null pointer)");
  for (int64_t i = 0; i < b.shape[0]; ++i) p[size_t(i)] = b(i);
}

// ---------------------------------------------------------------------------
// Forward

namespace {

// The three input projections of a layer, as row blocks of its parameters;
// get(name) returns the data of the parameter (or gradient) of that name.
template <class T, class Get>
std::array<Proj<T>, 3> projections(const MultiheadConfig& cfg, bool packed, Get get) {
  const int64_t D = cfg.embed_dim, HE = cfg.num_heads * cfg.head_dim, HEv = cfg.num_heads * cfg.v_head_dim;
  T* b = cfg.bias ? get(kInProjBias) : nullptr;
  auto off = [&](int64_t n) { return b ? b + n : nullptr; };
  if (packed) {
    T* w = get(kInProjWeight);
    return {Proj<T>{w, off(0), D, D}, Proj<T>{w + D * D, off(D), D, D}, Proj<T>{w + 2 * D * D, off(2 * D), D, D}};
  }
  return {Proj<T>{get(kQProjWeight), off(0), HE, D}, Proj<T>{get(kKProjWeight), off(HE), HE, cfg.kdim},
          Proj<T>{get(kVProjWeight), off(2 * HE), HEv, cfg.vdim}};
}

// out (m, rows) = x (m, cols) · Wᵀ + b
template <class T>
void project(const Proj<const T>& p, const T* x, int64_t m, T* out) {
  gemm<T>({m, p.rows, p.cols}, false, x, p.cols, true, p.w, p.cols, out, p.rows);
  add_rows(out, m, p.rows, p.b);
}

// The shared body of forward and forward_self, after the inputs' shapes
// were checked: validates the rest, projects, attends, projects back.
template <class T>
void forward_impl(const MultiheadAttention<T>& layer, const Checker& c, View3<const T> query,
                  View3<const T> key, View3<const T> value, bool self, View3<T> out, const MhaMasks<T>& masks,
                  const MhaOptions& opt, MhaCache<T>* cache, View4<T> head_weights, View3<T> avg_weights) {
  const MultiheadConfig& cfg_ = layer.config();
  const int64_t D = cfg_.embed_dim, H = cfg_.num_heads, E = cfg_.head_dim, Ev = cfg_.v_head_dim;
  const int64_t B = query.dim(0), L = query.dim(1), S = key.dim(1);
  const std::array<int64_t, 4> full{B, H, L, S};

  // Validation of everything else, before any work.
  c.require(out, "out");
  c.shape(out, "out", {B, L, D});
  std::vector<detail::Extent> written{c.extent(out, "out")};
  c.optional(head_weights, "head_weights", full, written);
  c.optional(avg_weights, "avg_weights", {B, L, S}, written);
  std::vector<detail::Extent> read{c.extent(query, self ? "x" : "query")};
  if (!self) {
    read.push_back(c.extent(key, "key"));
    read.push_back(c.extent(value, "value"));
  }
  if (c.given(masks.attn_mask, "attn_mask")) {
    c.broadcastable(masks.attn_mask, "attn_mask", full);
    read.push_back(c.extent(masks.attn_mask, "attn_mask"));
  }
  if (c.given(masks.attn_bias, "attn_bias")) {
    c.broadcastable(masks.attn_bias, "attn_bias", full);
    c.finite(masks.attn_bias, "attn_bias", /*allow_neg_inf=*/true);
    read.push_back(c.extent(masks.attn_bias, "attn_bias"));
  }
  c.optional(masks.key_padding_mask, "key_padding_mask", {B, S}, read, "(B, S) = " + shape_str({B, S}));
  if (c.given(masks.key_lengths, "key_lengths")) {
    c.shape(masks.key_lengths, "key_lengths", {B}, "(B,) = " + shape_str({B}));
    for (int64_t b = 0; b < B; ++b)
      if (masks.key_lengths(b) < 0 || masks.key_lengths(b) > S)
        c.fail("argument 'key_lengths' has value " + std::to_string(masks.key_lengths(b)) + " at batch " +
               std::to_string(b) + ", expected 0 <= key_lengths[b] <= S = " + std::to_string(S));
    read.push_back(c.extent(masks.key_lengths, "key_lengths"));
  }
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, read);
  (void)c.threads(opt.num_threads);
  if (opt.check_finite) {
    c.finite(query, self ? "x" : "query");
    if (!self) {
      c.finite(key, "key");
      c.finite(value, "value");
    }
  }

  // Filled here and moved into *cache at the end, so that inputs which alias
  // the caller's old cache stay valid while they are read.
  MhaCache<T> st;
  st.self_attention = self;
  st.masks = masks;
  st.options = opt;

  // Dense inputs: always copied into the cache (so the caller may reuse its
  // buffers before backward), otherwise only when strided.
  const T* xq = dense(query, st.query, cache != nullptr);
  const T* xk = self ? xq : dense(key, st.key, cache != nullptr);
  const T* xv = self ? xq : dense(value, st.value, cache != nullptr);

  // Projections (B·N, H·E | H·Ev).
  const auto proj = projections<const T>(cfg_, layer.packed_in_proj(),
                                   [&](const char* n) { return layer.parameter(n).data(); });
  st.q = Tensor<T>({B, L, H * E});
  st.k = Tensor<T>({B, S, H * E});
  st.v = Tensor<T>({B, S, H * Ev});
  project(proj[0], xq, B * L, st.q.data());
  project(proj[1], xk, B * S, st.k.data());
  project(proj[2], xv, B * S, st.v.data());

  // key_padding_mask (true = padding) folds into the bool mask (true = attend).
  View4<const bool> mask = masks.attn_mask;
  if (!masks.key_padding_mask.empty()) {
    const auto& am = masks.attn_mask;
    const int64_t Hm = am.empty() ? 1 : am.dim(1), Lm = am.empty() ? 1 : am.dim(2);
    st.mask = Tensor<bool>({B, Hm, Lm, S});
    View4<bool> m = st.mask.view4();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hm; ++h)
        for (int64_t i = 0; i < Lm; ++i)
          for (int64_t j = 0; j < S; ++j) {
            bool see = !masks.key_padding_mask(b, j);
            if (see && !am.empty())
              see = am(am.dim(0) == 1 ? 0 : b, h, am.dim(2) == 1 ? 0 : i, am.dim(3) == 1 ? 0 : j);
            m(b, h, i, j) = see;
          }
    mask = st.mask.view4();
  }

  SdpaArgs<T> args;
  args.q = View4<const T>::bnhd(st.q.data(), B, L, H, E);
  args.k = View4<const T>::bnhd(st.k.data(), B, S, H, E);
  args.v = View4<const T>::bnhd(st.v.data(), B, S, H, Ev);
  args.mask = mask;
  args.bias = masks.attn_bias;
  args.key_lengths = masks.key_lengths;
  SdpaOptions so;
  so.causal = opt.causal;
  so.causal_align = opt.causal_align;
  so.backend = opt.backend;
  so.num_threads = opt.num_threads;
  so.check_finite = opt.check_finite;

  st.attn_out = Tensor<T>({B, L, H * Ev});
  st.lse = Tensor<T>({B, H, L});
  Tensor<T> wscratch;
  View4<T> weights = head_weights;
  if (weights.empty() && !avg_weights.empty()) {
    wscratch = Tensor<T>({B, H, L, S});
    weights = wscratch.view4();
  }
  scaled_dot_product_attention<T>(
      args, {View4<T>::bnhd(st.attn_out.data(), B, L, H, Ev), weights, st.lse.template view<3>()}, so);

  if (!avg_weights.empty())
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < S; ++j) {
          double s = 0;
          for (int64_t h = 0; h < H; ++h) s += double(weights(b, h, i, j));
          avg_weights(b, i, j) = T(s / double(H));
        }

  // y = o·W_oᵀ + b_o
  const Tensor<T>& wo = layer.parameter(kOutProjWeight);
  const T* bo = cfg_.bias ? layer.parameter(kOutProjBias).data() : nullptr;
  Tensor<T> yscratch;
  T* y = out.is_contiguous() ? out.data : (yscratch = Tensor<T>({B, L, D})).data();
  gemm<T>({B * L, D, H * Ev}, false, st.attn_out.data(), H * Ev, true, wo.data(), H * Ev, y, D);
  add_rows(y, B * L, D, bo);
  if (!out.is_contiguous()) scatter<T>(y, out);
  if (cache) *cache = std::move(st);
}

}  // namespace

template <class T>
void MultiheadAttention<T>::forward(View3<const T> query, View3<const T> key, View3<const T> value,
                                    View3<T> out, const MhaMasks<T>& masks, const MhaOptions& opt,
                                    MhaCache<T>* cache, View4<T> head_weights,
                                    View3<T> avg_weights) const {
  const Checker c{"MultiheadAttention::forward"};
  const int64_t D = cfg_.embed_dim;
  c.require(query, "query");
  c.require(key, "key");
  c.require(value, "value");
  const int64_t B = query.dim(0), L = query.dim(1), S = key.dim(1);
  if (B < 1 || L < 1 || query.dim(2) != D)
    c.fail("argument 'query' has shape " + shape_str(query.shape) + ", expected (B, L, " + std::to_string(D) +
           ") with B, L >= 1 (embed_dim = " + std::to_string(D) + ")");
  if (key.dim(0) != B || S < 1 || key.dim(2) != cfg_.kdim)
    c.fail("argument 'key' has shape " + shape_str(key.shape) + ", expected (" + std::to_string(B) + ", S, " +
           std::to_string(cfg_.kdim) + ") with S >= 1 (batch of 'query', kdim = " + std::to_string(cfg_.kdim) + ")");
  c.shape(value, "value", {B, S, cfg_.vdim},
          "(" + std::to_string(B) + ", " + std::to_string(S) + ", " + std::to_string(cfg_.vdim) +
              ") (batch of 'query', S of 'key', vdim = " + std::to_string(cfg_.vdim) + ")");
  forward_impl(*this, c, query, key, value, /*self=*/false, out, masks, opt, cache, head_weights, avg_weights);
}

template <class T>
void MultiheadAttention<T>::forward_self(View3<const T> x, View3<T> out, const MhaMasks<T>& masks,
                                         const MhaOptions& opt, MhaCache<T>* cache, View4<T> head_weights,
                                         View3<T> avg_weights) const {
  const Checker c{"MultiheadAttention::forward_self"};
  const int64_t D = cfg_.embed_dim;
  c.require(x, "x");
  if (x.dim(0) < 1 || x.dim(1) < 1 || x.dim(2) != D)
    c.fail("argument 'x' has shape " + shape_str(x.shape) + ", expected (B, N, " + std::to_string(D) +
           ") with B, N >= 1 (embed_dim = " + std::to_string(D) + ")");
  if (cfg_.kdim != D || cfg_.vdim != D)
    c.fail("self-attention needs kdim = vdim = embed_dim = " + std::to_string(D) + ", but this layer has kdim = " +
           std::to_string(cfg_.kdim) + ", vdim = " + std::to_string(cfg_.vdim) + "; use forward(query, key, value)");
  forward_impl(*this, c, x, x, x, /*self=*/true, out, masks, opt, cache, head_weights, avg_weights);
}

// ---------------------------------------------------------------------------
// Backward

template <class T>
void MultiheadAttention<T>::backward(const MhaCache<T>& cache, View3<const T> dout, View3<T> dquery,
                                     View3<T> dkey, View3<T> dvalue) {
  const Checker c{"MultiheadAttention::backward"};
  const int64_t D = cfg_.embed_dim, H = cfg_.num_heads, E = cfg_.head_dim, Ev = cfg_.v_head_dim;
  const bool self = cache.self_attention;
  if (cache.q.rank() != 3 || cache.attn_out.rank() != 3 || cache.query.rank() != 3)
    c.fail("argument 'cache' is empty; pass the same cache to forward or forward_self first");
  const int64_t B = cache.q.dim(0), L = cache.q.dim(1), S = cache.k.dim(1);
  const bool consistent =
      cache.q.shape() == std::vector<int64_t>{B, L, H * E} && cache.k.shape() == std::vector<int64_t>{B, S, H * E} &&
      cache.v.shape() == std::vector<int64_t>{B, S, H * Ev} &&
      cache.attn_out.shape() == std::vector<int64_t>{B, L, H * Ev} &&
      cache.lse.shape() == std::vector<int64_t>{B, H, L} &&
      cache.query.shape() == std::vector<int64_t>{B, L, D} &&
      (self ? (L == S && cache.key.rank() == 0 && cache.value.rank() == 0)
            : (cache.key.shape() == std::vector<int64_t>{B, S, cfg_.kdim} &&
               cache.value.shape() == std::vector<int64_t>{B, S, cfg_.vdim}));
  if (!consistent)
    c.fail("argument 'cache' holds projections of shape q " + shape_str(cache.q.shape()) + ", v " +
           shape_str(cache.v.shape()) + ", which do not match this layer (num_heads = " + std::to_string(H) +
           ", head_dim = " + std::to_string(E) + ", v_head_dim = " + std::to_string(Ev) +
           "); it was filled by a different layer");
  c.require(dout, "dout");
  c.shape(dout, "dout", {B, L, D});
  if (self && (c.given(dkey, "dkey") || c.given(dvalue, "dvalue")))
    c.fail("arguments 'dkey' and 'dvalue' must be empty after forward_self; the gradient of x goes to 'dquery'");
  std::vector<detail::Extent> written;
  c.optional(dquery, "dquery", {B, L, D}, written);
  c.optional(dkey, "dkey", {B, S, cfg_.kdim}, written);
  c.optional(dvalue, "dvalue", {B, S, cfg_.vdim}, written);
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, {c.extent(dout, "dout")});
  if (cache.options.check_finite) c.finite(dout, "dout");

  Tensor<T> dy_storage;
  const T* dy = dense(dout, dy_storage, false);

  // y = o·W_oᵀ + b_o  ->  dW_o += dyᵀ·o,  db_o += Σ_rows dy,  do = dy·W_o
  const Tensor<T>& wo = params_.at(kOutProjWeight);
  gemm<T>({D, H * Ev, B * L}, true, dy, D, false, cache.attn_out.data(), H * Ev,
          grads_.at(kOutProjWeight).data(), H * Ev, T(1), T(1));
  if (cfg_.bias) add_column_sums(dy, B * L, D, grads_.at(kOutProjBias).data());
  Tensor<T> d_attn({B, L, H * Ev});
  gemm<T>({B * L, H * Ev, D}, false, dy, D, false, wo.data(), H * Ev, d_attn.data(), H * Ev);

  // o = sdpa(q, k, v)
  SdpaArgs<T> args;
  args.q = View4<const T>::bnhd(cache.q.data(), B, L, H, E);
  args.k = View4<const T>::bnhd(cache.k.data(), B, S, H, E);
  args.v = View4<const T>::bnhd(cache.v.data(), B, S, H, Ev);
  args.mask = cache.mask.rank() == 4 ? View4<const bool>(cache.mask.view4()) : cache.masks.attn_mask;
  args.bias = cache.masks.attn_bias;
  args.key_lengths = cache.masks.key_lengths;
  SdpaOptions so;
  so.causal = cache.options.causal;
  so.causal_align = cache.options.causal_align;
  so.backend = cache.options.backend;
  so.num_threads = cache.options.num_threads;
  Tensor<T> dq({B, L, H * E}), dk({B, S, H * E}), dv({B, S, H * Ev});
  SdpaGrads<T> g;
  g.dq = View4<T>::bnhd(dq.data(), B, L, H, E);
  g.dk = View4<T>::bnhd(dk.data(), B, S, H, E);
  g.dv = View4<T>::bnhd(dv.data(), B, S, H, Ev);
  const SdpaSaved<T> saved{View4<const T>::bnhd(cache.attn_out.data(), B, L, H, Ev), cache.lse.template view<3>()};
  scaled_dot_product_attention_backward<T>(args, View4<const T>::bnhd(d_attn.data(), B, L, H, Ev), saved, g, so);

  // x = xq|xk|xv, p = x·Wᵀ + b  ->  dW += dpᵀ·x,  db += Σ_rows dp,  dx = dp·W
  const auto proj = projections<const T>(cfg_, packed_, [&](const char* n) -> const T* { return params_.at(n).data(); });
  // The same slicing, into the gradients.
  const auto grad_proj = projections<T>(cfg_, packed_, [&](const char* n) { return grads_.at(n).data(); });
  const T* xs[3] = {cache.query.data(), self ? cache.query.data() : cache.key.data(),
                    self ? cache.query.data() : cache.value.data()};
  const T* dps[3] = {dq.data(), dk.data(), dv.data()};
  const int64_t rows[3] = {B * L, B * S, B * S};
  for (int t = 0; t < 3; ++t) {
    const Proj<const T>& p = proj[size_t(t)];
    gemm<T>({p.rows, p.cols, rows[t]}, true, dps[t], p.rows, false, xs[t], p.cols,
            grad_proj[size_t(t)].w, p.cols, T(1), T(1));
    if (grad_proj[size_t(t)].b) add_column_sums(dps[t], rows[t], p.rows, grad_proj[size_t(t)].b);
  }

  // dx = dp·W (self-attention: the sum over q, k, v)
  auto input_grad = [&](View3<T> dst, std::initializer_list<int> which) {
    if (dst.empty()) return;
    Tensor<T> scratch;
    T* dx = dst.is_contiguous() ? dst.data : (scratch = Tensor<T>(std::vector<int64_t>{dst.dim(0), dst.dim(1), dst.dim(2)})).data();
    bool first = true;
    for (int t : which) {
      const Proj<const T>& p = proj[size_t(t)];
      gemm<T>({rows[t], p.cols, p.rows}, false, dps[t], p.rows, false, p.w, p.cols, dx, p.cols, T(1),
              first ? T(0) : T(1));
      first = false;
    }
    if (!dst.is_contiguous()) scatter<T>(dx, dst);
  };
  if (self) {
    input_grad(dquery, {0, 1, 2});
  } else {
    input_grad(dquery, {0});
    input_grad(dkey, {1});
    input_grad(dvalue, {2});
  }
}

template class MultiheadAttention<float>;
template class MultiheadAttention<double>;

}  // namespace attn
