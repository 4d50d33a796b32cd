// The multi-head attention layer: the input projections, one call to the
// public scaled dot-product attention over all heads at once, and an output
// projection. It is the only multi-head attention in attn: the transformer's
// nn::SelfAttention wraps it, adding rotary positions through the Q/K
// transform hook.
//
// Data flow (B batch, L queries, S keys, D = embed_dim, H heads, E / Ev head
// widths), every buffer row-major:
//
//   self-attention:  x (B·L, D) ─ GEMM [W_q; W_k; W_v]ᵀ ─▶ [q | k | v] (B·L, 2·H·E + H·Ev)
//   otherwise:       xq ─ GEMM W_qᵀ ─▶ q (B·L, H·E),  xk ─▶ k (B·S, H·E),  xv ─▶ v (B·S, H·Ev)
//   + bias, split into heads ─▶ q (B, H, L, E), k (B, H, S, E), v (B, H, S, Ev), dense
//   q, k ─ transform (optional, in place, e.g. rotary positions)
//   sdpa(q, k, v) ─▶ o (B·L, H·Ev)   (written with the heads concatenated)
//   o ─ GEMM W_oᵀ ─▶ y (B·L, D)
//
// With the packed in_proj_weight [3D, D] (its row blocks are W_q, W_k, W_v)
// the self-attention projection is one GEMM; in_proj_bias is laid out
// [b_q; b_k; b_v] in both the packed and the separate case, so one slicing
// rule serves both.
//
// Why dense heads. The GEMM writes a head's rows H·E (self-attention:
// 3·H·E) floats apart, and the attention re-reads each K and V row once per
// query block: at that stride (9 KiB for D = 768) a head's rows fall on a
// quarter of the cache sets and evict each other; on (1, 2048, 768, 12)
// the attention ran about 1.6x slower on those strided views than on dense
// heads. So the projections are split into dense (B, H, N, ·) heads in the
// pass that adds the bias, and the backward does the same for what its
// attention reads again and again (dY, Y) and accumulates (dQ): it splits
// dY and Y, and merges dq, dk, dv back into the GEMM layout, where dW and
// dx are one product each. Each split or merge is one pass over a buffer
// the GEMMs read or write anyway.
//
// Construction, initialisation and the parameters by name are in
// multihead_params.cpp.
//
// The backward walks the same steps in reverse with the transposed GEMMs:
//   y = o·W_oᵀ + b_o   ->  dW_o += dyᵀ·o,  db_o += Σ_rows dy,  do = dy·W_o
//   o = sdpa(q, k, v)  ->  dq', dk', dv from scaled_dot_product_attention_backward
//                          (dense heads, merged into the projections' GEMM layout)
//   q', k' = t(q, k)   ->  dq, dk from the transform's backward
//   p = x·Wᵀ + b       ->  dW += dpᵀ·x,  db += Σ_rows dp (in the merge),  dx = dp·W
// In self-attention x feeds all three parts, so dx = [dq | dk | dv]·[W_q; W_k; W_v],
// one GEMM again when packed.
#include "attn/multihead.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn/kv_cache.hpp"
#include "attn/rng.hpp"
#include "kernels/gemm/gemm.hpp"
#include "multihead_names.hpp"
#include "validate.hpp"

namespace attn {
namespace {

using detail::add_column_sums;
using detail::gemm;
using detail::GemmShape;

// The parameters' PyTorch state_dict names: multihead_names.hpp.

using detail::Checker;
using namespace detail::mha_names;

// Copies a rank-3 view (any strides) into dense row-major storage.
template <class T>
void gather(View3<const T> src, T* dst) {
  const int64_t n1 = src.dim(1), F = src.dim(2), rows = src.dim(0) * n1;
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = &src(r / n1, r % n1, 0);
    T* d = dst + r * F;
    if (src.strides[2] == 1)
      std::copy_n(x, F, d);
    else
      for (int64_t c = 0; c < F; ++c) d[c] = x[c * src.strides[2]];
  }
}
template <class T>
void scatter(const T* src, View3<T> dst) {
  for (int64_t a = 0; a < dst.dim(0); ++a)
    for (int64_t b = 0; b < dst.dim(1); ++b)
      for (int64_t c = 0; c < dst.dim(2); ++c) dst(a, b, c) = *src++;
}

// `t` with this shape: kept as it is when it has the shape already,
// allocated without zeroing otherwise (the caller overwrites every element).
template <class T>
void sized(Tensor<T>& t, std::vector<int64_t> shape) {
  if (t.shape() != shape) t = Tensor<T>::uninitialized(std::move(shape));
}

// f(r) for every r in [0, rows), each row `width` elements of work: on
// `threads` OpenMP threads (the pool the GEMMs and the attention use) when
// there are at least 2^16 elements, else on the calling thread. The rows are
// independent copies, so the result is the same for any thread count. (On
// a quiet 2-core Zen 4 the layer's copies in parallel cut the small shape's
// forward by 3-5%, docs/multihead.md; on a Zen 3 whose other core was busy
// they had cost more than they saved: 55 against 38 ms on that forward.)
template <class F>
void parallel_rows(int threads, int64_t rows, int64_t width, const F& f) {
  const bool par = threads > 1 && rows > 1 && rows * width >= (int64_t(1) << 16);
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
  for (int64_t r = 0; r < rows; ++r) f(r);
}

// A dense (rows, width) copy of `src` in `storage`, or src's own data when it
// is already dense and no copy is wanted.
template <class T>
const T* dense(View3<const T> src, Tensor<T>& storage, bool force_copy, int threads) {
  if (src.is_contiguous() && !force_copy) return src.data;
  sized(storage, {src.dim(0), src.dim(1), src.dim(2)});
  if (src.is_contiguous())
    parallel_rows(threads, src.dim(0) * src.dim(1), src.dim(2), [&](int64_t r) {
      std::copy_n(src.data + r * src.dim(2), src.dim(2), storage.data() + r * src.dim(2));
    });
  else
    gather(src, storage.data());
  return storage.data();
}

// True when p points into t's storage.
template <class T>
bool inside(const Tensor<T>& t, const void* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(t.data());
  const auto* x = static_cast<const unsigned char*>(p);
  return b && x && std::less_equal<>()(b, x) && std::less<>()(x, b + t.size() * sizeof(T));
}


}  // namespace

// ---------------------------------------------------------------------------
// Forward and backward

namespace {

// One of the three input projections: p = x·Wᵀ + b for x (rows, cols) dense,
// W [width, cols], b [width] (nullptr without bias), p written with leading
// dimension `ld` (the parts of a self-attention share one matrix).
template <class T>
struct Part {
  const T* x;
  int64_t rows, cols;
  const T* w;
  const T* b;
  T* gw;  // gradients of w and b
  T* gb;
  int64_t width;
  T* p;   // the GEMM output (forward: before the head split), then its gradient
  int64_t ld;
};

// The projections of one call: for each of q, k, v its input, weight rows,
// bias and place in the projection buffer `proj` (laid out as MhaCache::proj
// documents). `grads` points gw/gb at the gradient tensors.
template <class T, class Layer>
std::array<Part<T>, 3> parts(Layer& layer, const MultiheadConfig& cfg, bool packed, bool self, int64_t B,
                             int64_t L, int64_t S, const T* xq, const T* xk, const T* xv, T* proj,
                             std::map<std::string, Tensor<T>>* grads) {
  const int64_t D = cfg.embed_dim, HE = cfg.num_heads * cfg.head_dim, HEv = cfg.num_heads * cfg.v_head_dim;
  auto param = [&](const char* n) -> const T* { return layer.parameter(n).data(); };
  auto grad = [&](const char* n) -> T* { return grads ? grads->at(n).data() : nullptr; };
  const T* b = cfg.bias ? param(kInProjBias) : nullptr;
  T* gb = cfg.bias ? grad(kInProjBias) : nullptr;
  auto off = [](auto* ptr, int64_t n) { return ptr ? ptr + n : nullptr; };
  const T* w[3];
  T* gw[3];
  if (packed) {
    for (int t = 0; t < 3; ++t) {
      w[t] = param(kInProjWeight) + t * D * D;
      gw[t] = off(grad(kInProjWeight), t * D * D);
    }
  } else {
    w[0] = param(kQProjWeight), w[1] = param(kKProjWeight), w[2] = param(kVProjWeight);
    gw[0] = grad(kQProjWeight), gw[1] = grad(kKProjWeight), gw[2] = grad(kVProjWeight);
  }
  const int64_t ld_self = 2 * HE + HEv;
  T* pk = self ? proj + HE : proj + B * L * HE;
  T* pv = self ? proj + 2 * HE : pk + B * S * HE;
  return {Part<T>{xq, B * L, D, w[0], b, gw[0], gb, HE, proj, self ? ld_self : HE},
          Part<T>{xk, B * S, cfg.kdim, w[1], off(b, HE), gw[1], off(gb, HE), HE, pk, self ? ld_self : HE},
          Part<T>{xv, B * S, cfg.vdim, w[2], off(b, 2 * HE), gw[2], off(gb, 2 * HE), HEv, pv,
                  self ? ld_self : HEv}};
}

// dst (B, H, N, F), dense, = the heads of one part of the GEMM output plus
// its bias: dst(b, h, n, f) = src[(b·N + n)·ld + h·F + f] + bias[h·F + f]
// (src has B·N rows; bias nullptr: none). A row per iteration of
// parallel_rows.
template <class T>
void split_heads(const T* src, int64_t ld, const T* bias, int64_t B, int64_t N, int64_t H, int64_t F, T* dst,
                 int threads) {
  parallel_rows(threads, B * N, H * F, [&](int64_t r) {
    const int64_t b = r / N, n = r % N;
    for (int64_t h = 0; h < H; ++h) {
      const T* x = src + r * ld + h * F;
      T* d = dst + ((b * H + h) * N + n) * F;
      if (bias)
        for (int64_t f = 0; f < F; ++f) d[f] = x[f] + bias[h * F + f];
      else
        std::copy_n(x, F, d);
    }
  });
}

// The inverse, without bias: dst[(b·N + n)·ld + h·F + f] = src(b, h, n, f)
// for src (B, H, N, F) dense, and in the same pass gb[h·F + f] += Σ_rows of
// what it writes (the bias gradient; gb nullptr: none). A head at a time, so
// that its F sums stay in registers, each over the rows in order, in double,
// as add_column_sums does (one pass instead of a copy and a column-sum pass:
// 4.1-4.3 against 5.4-5.6 ms on (1, 2048, 768, 12), load 4; summing whole
// rows into one vector instead was slower than the two passes).
template <class T>
void merge_heads(const T* src, int64_t B, int64_t N, int64_t H, int64_t F, T* dst, int64_t ld, T* gb,
                 int threads) {
  parallel_rows(threads, H, B * N * F, [&](int64_t h) {
    std::vector<double> sums(static_cast<size_t>(F));
    for (int64_t r = 0; r < B * N; ++r) {
      const int64_t b = r / N, n = r % N;
      T* d = dst + r * ld + h * F;
      std::copy_n(src + ((b * H + h) * N + n) * F, F, d);
      if (gb)
        for (int64_t f = 0; f < F; ++f) sums[size_t(f)] += double(d[f]);
    }
    if (gb)
      for (int64_t f = 0; f < F; ++f) gb[h * F + f] += T(sums[size_t(f)]);
  });
}

// Every row of C (m, n), leading dimension ldc, set to bias (n): a GEMM with
// beta = 1 then adds the product, which saves the pass that adding the bias
// afterwards takes (with beta = 0 OpenBLAS clears C in a pass of its own).
template <class T>
void fill_rows(T* C, int64_t m, int64_t n, int64_t ldc, const T* bias, int threads) {
  parallel_rows(threads, m, n, [&](int64_t i) { std::copy_n(bias, n, C + i * ldc); });
}

// The projections as dense heads: [q | k | v] = x·Wᵀ (into the parts' GEMM
// output: one product when `one_gemm`, a packed self-attention whose three
// weight blocks are consecutive rows of in_proj_weight; else three), then
// + b and the split into q (B, H, L, E), k (B, H, S, E), v (B, H, S, Ev)
// laid out one after the other in `proj` (MhaCache::proj's layout).
template <class T>
std::array<View4<T>, 3> project(const std::array<Part<T>, 3>& ps, bool one_gemm, int64_t B, int64_t L, int64_t S,
                                int64_t H, int64_t E, int64_t Ev, T* proj, int threads) {
  if (one_gemm) {
    const Part<T>& p = ps[0];
    gemm<T>({p.rows, p.ld, p.cols}, false, p.x, p.cols, true, p.w, p.cols, p.p, p.ld);
  } else {
    for (const Part<T>& p : ps) gemm<T>({p.rows, p.width, p.cols}, false, p.x, p.cols, true, p.w, p.cols, p.p, p.ld);
  }
  T* const hq = proj;
  T* const hk = hq + B * L * H * E;
  T* const hv = hk + B * S * H * E;
  split_heads(ps[0].p, ps[0].ld, ps[0].b, B, L, H, E, hq, threads);
  split_heads(ps[1].p, ps[1].ld, ps[1].b, B, S, H, E, hk, threads);
  split_heads(ps[2].p, ps[2].ld, ps[2].b, B, S, H, Ev, hv, threads);
  return {View4<T>::bhnd(hq, B, H, L, E), View4<T>::bhnd(hk, B, H, S, E), View4<T>::bhnd(hv, B, H, S, Ev)};
}

// out = o·W_oᵀ + b_o for the concatenated head outputs o (B·L, HEv) dense,
// W_o [D, HEv], b_o [D] (nullptr: none), out (B, L, D) any strides.
template <class T>
void project_out(const T* o, const T* wo, const T* bo, int64_t HEv, View3<T> out, int threads) {
  const int64_t M = out.dim(0) * out.dim(1), D = out.dim(2);
  Tensor<T> scratch;
  T* y = out.is_contiguous() ? out.data : (scratch = Tensor<T>({out.dim(0), out.dim(1), D})).data();
  if (bo) fill_rows(y, M, D, D, bo, threads);
  gemm<T>({M, D, HEv}, false, o, HEv, true, wo, HEv, y, D, T(1), bo ? T(1) : T(0));
  if (!out.is_contiguous()) scatter<T>(y, out);
}

template <class T, int R>
Tensor<T> copy_of(View<const T, R> v) {
  std::vector<int64_t> shape(v.shape.begin(), v.shape.end());
  Tensor<T> t(shape);
  std::array<int64_t, R> idx{};
  for (size_t f = 0; f < t.size(); ++f) {
    int64_t o = 0;
    for (int i = 0; i < R; ++i) o += idx[size_t(i)] * v.strides[size_t(i)];
    t[f] = v.data[o];
    for (int i = R - 1; i >= 0; --i) {
      if (++idx[size_t(i)] < v.shape[size_t(i)]) break;
      idx[size_t(i)] = 0;
    }
  }
  return t;
}

// The attention's arguments: the heads of the projections, the masks, bias,
// key lengths and ALiBi slopes the cache owns, and the layer's sinks.
template <class T>
SdpaArgs<T> sdpa_args(const MhaCache<T>& st, View4<const T> q, View4<const T> k, View4<const T> v,
                      const Tensor<T>* sinks) {
  SdpaArgs<T> args;
  args.q = q, args.k = k, args.v = v;
  if (st.mask.rank() == 4) args.mask = st.mask.view4();
  if (st.bias.rank() == 4) args.bias = st.bias.view4();
  if (st.key_lengths.rank() == 1) args.key_lengths = st.key_lengths.template view<1>();
  if (st.alibi_slopes.rank() == 1) args.alibi_slopes = st.alibi_slopes.template view<1>();
  if (sinks) args.sinks = sinks->template view<1>();
  return args;
}

}  // namespace

template <class T>
void MultiheadAttention<T>::forward(const MhaArgs<T>& a, const MhaOutputs<T>& o, const MhaOptions& opt,
                                    MhaCache<T>* cache) const {
  const Checker c{"MultiheadAttention::forward"};
  const int64_t D = cfg_.embed_dim, H = cfg_.num_heads, E = cfg_.head_dim, Ev = cfg_.v_head_dim;
  const bool self = a.key.empty() && a.value.empty();
  if (a.query.empty()) c.fail("argument 'query' is required but was not given");
  if (a.key.empty() != a.value.empty())
    c.fail(std::string("argument '") + (a.key.empty() ? "key" : "value") +
           "' is required when '" + (a.key.empty() ? "value" : "key") +
           "' is given (leave both empty for self-attention)");
  const int64_t B = a.query.dim(0), L = a.query.dim(1), S = self ? L : a.key.dim(1);
  if (B < 1 || L < 1 || a.query.dim(2) != D)
    c.fail("argument 'query' has shape " + shape_str(a.query.shape) + ", expected (B, L, " + std::to_string(D) +
           ") with B, L >= 1 (embed_dim = " + std::to_string(D) + ")");
  if (self) {
    if (cfg_.kdim != D || cfg_.vdim != D)
      c.fail("self-attention (no 'key' and 'value') needs kdim = vdim = embed_dim = " + std::to_string(D) +
             ", but this layer has kdim = " + std::to_string(cfg_.kdim) + ", vdim = " + std::to_string(cfg_.vdim) +
             "; pass 'key' and 'value'");
  } else {
    if (a.key.dim(0) != B || S < 1 || a.key.dim(2) != cfg_.kdim)
      c.fail("argument 'key' has shape " + shape_str(a.key.shape) + ", expected (" + std::to_string(B) + ", S, " +
             std::to_string(cfg_.kdim) + ") with S >= 1 (batch of 'query', kdim = " + std::to_string(cfg_.kdim) +
             ")");
    c.shape(a.value, "value", {B, S, cfg_.vdim},
            "(" + std::to_string(B) + ", " + std::to_string(S) + ", " + std::to_string(cfg_.vdim) +
                ") (batch of 'query', S of 'key', vdim = " + std::to_string(cfg_.vdim) + ")");
  }
  const std::array<int64_t, 4> full{B, H, L, S};
  // Validation of everything else, before any work.
  c.require(o.out, "out");
  c.shape(o.out, "out", {B, L, D});
  std::vector<detail::Extent> written{c.extent(o.out, "out")};
  c.optional(o.head_weights, "head_weights", full, written);
  c.optional(o.avg_weights, "avg_weights", {B, L, S}, written);
  std::vector<detail::Extent> read{c.extent(a.query, "query")};
  if (!self) {
    read.push_back(c.extent(a.key, "key"));
    read.push_back(c.extent(a.value, "value"));
  }
  c.mask_and_bias(a.attn_mask, "attn_mask", a.attn_bias, "attn_bias", full, read);
  c.optional(a.key_padding_mask, "key_padding_mask", {B, S}, read, "(B, S) = " + shape_str({B, S}));
  if (c.given(a.key_lengths, "key_lengths")) {
    c.shape(a.key_lengths, "key_lengths", {B}, "(B,) = " + shape_str({B}));
    for (int64_t b = 0; b < B; ++b)
      if (a.key_lengths(b) < 0 || a.key_lengths(b) > S)
        c.fail("argument 'key_lengths' has value " + std::to_string(a.key_lengths(b)) + " at batch " +
               std::to_string(b) + ", expected 0 <= key_lengths[b] <= S = " + std::to_string(S));
    read.push_back(c.extent(a.key_lengths, "key_lengths"));
  }
  if (c.given(a.alibi_slopes, "alibi_slopes")) {
    c.shape(a.alibi_slopes, "alibi_slopes", {H}, "(num_heads,) = " + shape_str({H}) + ", one slope per head");
    c.finite(a.alibi_slopes, "alibi_slopes");
    read.push_back(c.extent(a.alibi_slopes, "alibi_slopes"));
  }
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, read);
  const int threads = c.threads(opt.sdpa.num_threads);
  if (opt.sdpa.check_finite) {
    c.finite(a.query, "query");
    if (!self) {
      c.finite(a.key, "key");
      c.finite(a.value, "value");
    }
  }

  // Filled here and moved into *cache at the end, so that inputs which alias
  // the caller's old cache stay valid while they are read.
  MhaCache<T> st;
  // A cache refilled call after call (a training loop) lends its buffers to
  // the new state, unless an argument points into one of them.
  if (cache) {
    const void* ptrs[] = {a.query.data,   a.key.data,      a.value.data,         a.attn_mask.data,
                          a.attn_bias.data, a.key_padding_mask.data, a.key_lengths.data, a.alibi_slopes.data,
                          o.out.data, o.head_weights.data, o.avg_weights.data};
    bool aliased = false;
    for (const void* p : ptrs)
      for (const Tensor<T>* t : {&cache->query, &cache->key, &cache->value, &cache->proj, &cache->attn_out,
                                 &cache->lse, &cache->bias, &cache->alibi_slopes})
        aliased = aliased || inside(*t, p);
    for (const void* p : ptrs) aliased = aliased || inside(cache->mask, p) || inside(cache->key_lengths, p);
    if (!aliased) {
      st.query = std::move(cache->query), st.key = std::move(cache->key), st.value = std::move(cache->value);
      st.proj = std::move(cache->proj), st.packed = std::move(cache->packed);
      st.attn_out = std::move(cache->attn_out), st.lse = std::move(cache->lse);
    }
  }
  st.B = B, st.L = L, st.S = S, st.H = H, st.E = E, st.Ev = Ev;
  st.self_attention = self;
  st.options = opt;

  // Dense inputs: always copied into the cache (so the caller may reuse its
  // buffers before backward), otherwise only when strided.
  const T* xq = dense(a.query, st.query, cache != nullptr, threads);
  if (self) st.key = Tensor<T>(), st.value = Tensor<T>();
  const T* xk = self ? xq : dense(a.key, st.key, cache != nullptr, threads);
  const T* xv = self ? xq : dense(a.value, st.value, cache != nullptr, threads);

  // [q | k | v] = x·Wᵀ: one product for a packed self-attention (the three
  // weight blocks are consecutive rows of in_proj_weight), else three; then
  // + b and the split into dense heads.
  const int64_t HE = H * E, HEv = H * Ev, proj_size = B * L * HE + B * S * (HE + HEv);
  sized(st.packed, {proj_size});
  sized(st.proj, {proj_size});
  const auto ps = parts<T>(*this, cfg_, packed_, self, B, L, S, xq, xk, xv, st.packed.data(), nullptr);
  const auto [qh, kh, vh] = project(ps, self && packed_, B, L, S, H, E, Ev, st.proj.data(), threads);
  if (qk_.forward) qk_.forward(qh, kh);

  // The masks, owned by the cache: key_padding_mask (true = padding) folds
  // into the bool mask (true = attend).
  const auto& am = a.attn_mask;
  if (!a.key_padding_mask.empty()) {
    const int64_t Hm = am.empty() ? 1 : am.dim(1), Lm = am.empty() ? 1 : am.dim(2);
    st.mask = Tensor<bool>({B, Hm, Lm, S});
    View4<bool> m = st.mask.view4();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hm; ++h)
        for (int64_t i = 0; i < Lm; ++i)
          for (int64_t j = 0; j < S; ++j) {
            bool see = !a.key_padding_mask(b, j);
            if (see && !am.empty())
              see = am(am.dim(0) == 1 ? 0 : b, h, am.dim(2) == 1 ? 0 : i, am.dim(3) == 1 ? 0 : j);
            m(b, h, i, j) = see;
          }
  } else if (!am.empty()) {
    st.mask = copy_of<bool, 4>(am);
  }
  if (!a.attn_bias.empty()) st.bias = copy_of<T, 4>(a.attn_bias);
  if (!a.key_lengths.empty()) st.key_lengths = copy_of<int64_t, 1>(a.key_lengths);
  if (!a.alibi_slopes.empty()) st.alibi_slopes = copy_of<T, 1>(a.alibi_slopes);

  const SdpaArgs<T> args = sdpa_args<T>(st, qh, kh, vh, cfg_.sinks ? &params_.at(kSinks) : nullptr);

  sized(st.attn_out, {B, L, HEv});
  sized(st.lse, {B, H, L});
  Tensor<T> wscratch;
  View4<T> weights = o.head_weights;
  if (weights.empty() && !o.avg_weights.empty()) {
    wscratch = Tensor<T>({B, H, L, S});
    weights = wscratch.view4();
  }
  scaled_dot_product_attention<T>(
      args, {View4<T>::bnhd(st.attn_out.data(), B, L, H, Ev), weights, st.lse.template view<3>()}, opt.sdpa);

  if (!o.avg_weights.empty())
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < S; ++j) {
          double s = 0;
          for (int64_t h = 0; h < H; ++h) s += double(weights(b, h, i, j));
          o.avg_weights(b, i, j) = T(s / double(H));
        }

  // y = o·W_oᵀ + b_o
  project_out(st.attn_out.data(), parameter(kOutProjWeight).data(),
              cfg_.bias ? parameter(kOutProjBias).data() : nullptr, HEv, o.out, threads);
  if (cache) *cache = std::move(st);
}

// Decoding: the forward's steps for the L new rows of each sequence, with
// the keys and values of the earlier rows read from the cache:
//   [q | k | v] = x·Wᵀ + b;  q, k ← transform at positions length(b)..length(b)+L−1
//   cache ← cache + (k, v);  o = decode_attention(q, cache)
//   y = o·W_oᵀ + b_o
// Every argument is checked before the cache is appended to.
template <class T>
void MultiheadAttention<T>::decode(const MhaArgs<T>& a, KVCache& cache, View3<T> out,
                                   const MhaDecodeOptions& opt) const {
  const Checker c{"MultiheadAttention::decode"};
  if constexpr (!std::is_same_v<T, float>) {
    (void)a, (void)cache, (void)out, (void)opt;
    c.fail("decoding over a KV cache is float32 only (the cache computes in float32); use MultiheadAttention<float>");
  } else {
    const int64_t D = cfg_.embed_dim, H = cfg_.num_heads, E = cfg_.head_dim, Ev = cfg_.v_head_dim;
    c.require(a.query, "query");
    const auto refuse = [&](const char* name, const char* why) {
      c.fail(std::string("argument '") + name + "' is not taken: " + why);
    };
    const char* self_only = "decoding is self-attention over the cache (leave key and value empty)";
    const char* lengths = "the cache's lengths say which keys each sequence has; use attn_mask to hide some";
    if (c.given(a.key, "key")) refuse("key", self_only);
    if (c.given(a.value, "value")) refuse("value", self_only);
    if (c.given(a.key_padding_mask, "key_padding_mask")) refuse("key_padding_mask", lengths);
    if (c.given(a.key_lengths, "key_lengths")) refuse("key_lengths", lengths);
    if (opt.sdpa.position_offset)
      c.fail("option 'position_offset' is not taken: the new rows of sequence b sit at positions length(b) .. "
             "length(b) + L - 1 of the cache");
    if (cfg_.kdim != D || cfg_.vdim != D)
      c.fail("decoding is self-attention, which needs kdim = vdim = embed_dim = " + std::to_string(D) +
             ", but this layer has kdim = " + std::to_string(cfg_.kdim) + ", vdim = " + std::to_string(cfg_.vdim));
    const int64_t B = a.query.dim(0), L = a.query.dim(1);
    if (B != cache.batch() || L < 1 || a.query.dim(2) != D)
      c.fail("argument 'query' has shape " + shape_str(a.query.shape) + ", expected (B, L, D) = (" +
             std::to_string(cache.batch()) + ", L, " + std::to_string(D) + ") with B the cache's batch and L >= 1");
    if (cache.kv_heads() != H || cache.head_dim() != E || cache.value_dim() != Ev)
      c.fail("argument 'cache' has (kv_heads, head_dim, value_dim) = " +
             shape_str({cache.kv_heads(), cache.head_dim(), cache.value_dim()}) + ", expected the layer's (H, E, Ev) = " +
             shape_str({H, E, Ev}));
    if (std::string why = cache.append_refusal(L); !why.empty())
      c.fail("argument 'cache' cannot take the " + std::to_string(L) + " new tokens of each sequence: " + why);
    if (qk_.forward && !qk_.forward_at)
      c.fail("the layer's Q/K transform has no forward_at (the transform at given positions), which decoding needs");
    c.require(out, "out");
    c.shape(out, "out", {B, L, D});
    const std::vector<detail::Extent> written{c.extent(out, "out")};
    c.writable(written[0]);
    std::vector<detail::Extent> read{c.extent(a.query, "query")};
    DecodeOptions dopt;
    dopt.scale = opt.sdpa.scale;
    dopt.causal = opt.sdpa.causal;
    dopt.window = opt.sdpa.window;
    dopt.softcap = opt.sdpa.softcap;
    dopt.alibi_slopes = a.alibi_slopes;
    if (cfg_.sinks) dopt.sinks = params_.at(kSinks).template view<1>();
    dopt.mask = a.attn_mask;
    dopt.bias = a.attn_bias;
    dopt.backend = opt.sdpa.backend == Backend::reference ? Backend::reference : Backend::automatic;
    dopt.num_threads = opt.sdpa.num_threads;
    const int threads =
        detail::check_decode_options(c, dopt, {B, H, L, cache.capacity()}, read, "attn_mask", "attn_bias");
    c.disjoint(written, read);
    if (opt.sdpa.check_finite) c.finite(a.query, "query");

    Tensor<T> xs;
    const T* x = dense(a.query, xs, false, threads);
    const int64_t HE = H * E, HEv = H * Ev;
    Tensor<T> packed = Tensor<T>::uninitialized({B * L * (2 * HE + HEv)});
    Tensor<T> proj = Tensor<T>::uninitialized({B * L * (2 * HE + HEv)});
    const auto ps = parts<T>(*this, cfg_, packed_, true, B, L, L, x, x, x, packed.data(), nullptr);
    const auto [qh, kh, vh] = project(ps, packed_, B, L, L, H, E, Ev, proj.data(), threads);
    if (qk_.forward_at)
      for (int64_t b = 0; b < B; ++b) {
        auto one = [b](View4<T> v) {
          return View4<T>(v.data + b * v.strides[0], {1, v.dim(1), v.dim(2), v.dim(3)}, v.strides);
        };
        qk_.forward_at(one(qh), one(kh), cache.length(b));
      }
    if (opt.sdpa.check_finite) {  // what reaches the cache stays there for every later token
      c.finite(qh, "q (the projected query)");
      c.finite(kh, "k (the projected keys)");
      c.finite(vh, "v (the projected values)");
    }
    std::vector<int64_t> before(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) before[size_t(b)] = cache.length(b);
    cache.append(View4<const T>(kh), View4<const T>(vh));
    try {
      Tensor<T> o = Tensor<T>::uninitialized({B, L, HEv});
      decode_attention(View4<const T>(qh), cache, View4<T>::bnhd(o.data(), B, L, H, Ev), dopt);
      project_out(o.data(), parameter(kOutProjWeight).data(),
                  cfg_.bias ? parameter(kOutProjBias).data() : nullptr, HEv, out, threads);
    } catch (...) {  // checked above, so only e.g. std::bad_alloc: the cache as it was
      for (int64_t b = 0; b < B; ++b) cache.truncate(b, before[size_t(b)]);
      throw;
    }
  }
}

template <class T>
void MultiheadAttention<T>::backward(const MhaCache<T>& cache, View3<const T> dout, const MhaGrads<T>& g) {
  const Checker c{"MultiheadAttention::backward"};
  const int64_t D = cfg_.embed_dim, H = cfg_.num_heads, E = cfg_.head_dim, Ev = cfg_.v_head_dim;
  const bool self = cache.self_attention;
  if (!cache.filled()) c.fail("argument 'cache' is empty; pass the same cache to forward first");
  const int threads = c.threads(cache.options.sdpa.num_threads);
  const int64_t B = cache.B, L = cache.L, S = cache.S;
  const int64_t HE = H * E, HEv = H * Ev;
  const bool consistent =
      cache.H == H && cache.E == E && cache.Ev == Ev &&
      cache.proj.size() == size_t(self ? B * L * (2 * HE + HEv) : B * L * HE + B * S * (HE + HEv)) &&
      cache.attn_out.shape() == std::vector<int64_t>{B, L, HEv} &&
      cache.query.shape() == std::vector<int64_t>{B, L, D} &&
      (self ? (L == S && cache.key.rank() == 0 && cache.value.rank() == 0)
            : (cache.key.shape() == std::vector<int64_t>{B, S, cfg_.kdim} &&
               cache.value.shape() == std::vector<int64_t>{B, S, cfg_.vdim}));
  if (!consistent)
    c.fail("argument 'cache' holds " + std::to_string(cache.H) + " heads of head_dim " + std::to_string(cache.E) +
           ", v_head_dim " + std::to_string(cache.Ev) + " for inputs of width " +
           std::to_string(cache.query.rank() == 3 ? cache.query.dim(2) : 0) +
           ", which do not match this layer (num_heads = " + std::to_string(H) + ", head_dim = " +
           std::to_string(E) + ", v_head_dim = " + std::to_string(Ev) + ", embed_dim = " + std::to_string(D) +
           "); it was filled by a different layer");
  c.require(dout, "dout");
  c.shape(dout, "dout", {B, L, D});
  if (self && (c.given(g.dkey, "dkey") || c.given(g.dvalue, "dvalue")))
    c.fail("arguments 'dkey' and 'dvalue' must be empty after a self-attention forward; the gradient of the "
           "input goes to 'dquery'");
  std::vector<detail::Extent> written;
  c.optional(g.dquery, "dquery", {B, L, D}, written);
  c.optional(g.dkey, "dkey", {B, S, cfg_.kdim}, written);
  c.optional(g.dvalue, "dvalue", {B, S, cfg_.vdim}, written);
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, {c.extent(dout, "dout")});
  if (cache.options.sdpa.check_finite) c.finite(dout, "dout");

  Tensor<T> dy_storage;
  const T* dy = dense(dout, dy_storage, false, threads);

  // y = o·W_oᵀ + b_o  ->  dW_o += dyᵀ·o,  db_o += Σ_rows dy,  do = dy·W_o
  const Tensor<T>& wo = params_.at(kOutProjWeight);
  gemm<T>({D, HEv, B * L}, true, dy, D, false, cache.attn_out.data(), HEv, grads_.at(kOutProjWeight).data(), HEv,
          T(1), T(1));
  if (cfg_.bias) add_column_sums(dy, B * L, D, D, grads_.at(kOutProjBias).data());
  // The gradient buffers live in the layer between calls (every element is
  // written before it is read): no allocation in a training loop.
  Tensor<T>& d_attn = d_attn_;
  sized(d_attn, {B, L, HEv});
  gemm<T>({B * L, HEv, D}, false, dy, D, false, wo.data(), HEv, d_attn.data(), HEv);
  // The attention's backward reads dY and Y once per tile and adds dQ into
  // its output tile by tile: each gets dense heads, as q, k and v have (one
  // pass each to split dY and Y here and to merge dQ, dK, dV below).
  sized(heads_dy_, {B, H, L, Ev});
  sized(heads_y_, {B, H, L, Ev});
  split_heads<T>(d_attn.data(), HEv, nullptr, B, L, H, Ev, heads_dy_.data(), threads);
  split_heads<T>(cache.attn_out.data(), HEv, nullptr, B, L, H, Ev, heads_y_.data(), threads);

  // o = sdpa(q, k, v): the gradients land in dense heads, then in a buffer
  // laid out as the GEMM wrote the projections.
  Tensor<T>& dproj = dproj_;
  sized(dproj, {int64_t(cache.proj.size())});
  const T* xs = cache.query.data();
  const auto ps = parts<T>(*this, cfg_, packed_, self, B, L, S, xs, self ? xs : cache.key.data(),
                           self ? xs : cache.value.data(), dproj.data(), &grads_);
  const SdpaArgs<T> args =
      sdpa_args<T>(cache, cache.q(), cache.k(), cache.v(), cfg_.sinks ? &params_.at(kSinks) : nullptr);
  SdpaOptions so = cache.options.sdpa;
  so.check_finite = false;  // the forward checked its inputs
  SdpaGrads<T> sg;
  sized(heads_dproj_, {int64_t(cache.proj.size())});
  T* const hq = heads_dproj_.data();
  T* const hk = hq + B * L * HE;
  T* const hv = hk + B * S * HE;
  sg.dq = View4<T>::bhnd(hq, B, H, L, E), sg.dk = View4<T>::bhnd(hk, B, H, S, E), sg.dv = View4<T>::bhnd(hv, B, H, S, Ev);
  Tensor<T> dsinks;  // sdpa overwrites its dsinks; the layer's gradient accumulates
  if (cfg_.sinks) sg.dsinks = (dsinks = Tensor<T>({H})).template view<1>();
  const SdpaSaved<T> saved{View4<const T>::bhnd(heads_y_.data(), B, H, L, Ev), cache.lse.template view<3>()};
  scaled_dot_product_attention_backward<T>(args, View4<const T>::bhnd(heads_dy_.data(), B, H, L, Ev), saved, sg, so);
  if (cfg_.sinks)
    for (int64_t h = 0; h < H; ++h) grads_.at(kSinks)[size_t(h)] += dsinks[size_t(h)];
  // The transform's own backward turns dQ', dK' into dQ, dK.
  if (qk_.backward) qk_.backward(sg.dq, sg.dk);
  // Back to the GEMM layout, where dW and dx are one product each; the same
  // pass sums the columns into the bias gradient (db += Σ_rows dp).
  merge_heads<T>(hq, B, L, H, E, ps[0].p, ps[0].ld, ps[0].gb, threads);
  merge_heads<T>(hk, B, S, H, E, ps[1].p, ps[1].ld, ps[1].gb, threads);
  merge_heads<T>(hv, B, S, H, Ev, ps[2].p, ps[2].ld, ps[2].gb, threads);

  // p = x·Wᵀ + b  ->  dW += dpᵀ·x,  dx = dp·W (db came with the merge; a
  // packed self-attention does each as one product over [q | k | v]).
  if (self && packed_) {
    gemm<T>({3 * D, D, B * L}, true, dproj.data(), 3 * D, false, xs, D, ps[0].gw, D, T(1), T(1));
    if (!g.dquery.empty()) {
      Tensor<T> scratch;
      T* dx = g.dquery.is_contiguous() ? g.dquery.data : (scratch = Tensor<T>({B, L, D})).data();
      gemm<T>({B * L, D, 3 * D}, false, dproj.data(), 3 * D, false, ps[0].w, D, dx, D);
      if (!g.dquery.is_contiguous()) scatter<T>(dx, g.dquery);
    }
    return;
  }
  for (const Part<T>& p : ps)
    gemm<T>({p.width, p.cols, p.rows}, true, p.p, p.ld, false, p.x, p.cols, p.gw, p.cols, T(1), T(1));
  // dx = dp·W (self-attention: the sum over q, k, v)
  auto input_grad = [&](View3<T> dst, std::initializer_list<int> which) {
    if (dst.empty()) return;
    Tensor<T> scratch;
    T* dx = dst.is_contiguous() ? dst.data : (scratch = Tensor<T>({dst.dim(0), dst.dim(1), dst.dim(2)})).data();
    bool first = true;
    for (int t : which) {
      const Part<T>& p = ps[size_t(t)];
      gemm<T>({p.rows, p.cols, p.width}, false, p.p, p.ld, false, p.w, p.cols, dx, p.cols, T(1),
              first ? T(0) : T(1));
      first = false;
    }
    if (!dst.is_contiguous()) scatter<T>(dx, dst);
  };
  if (self) {
    input_grad(g.dquery, {0, 1, 2});
  } else {
    input_grad(g.dquery, {0});
    input_grad(g.dkey, {1});
    input_grad(g.dvalue, {2});
  }
}

template class MultiheadAttention<float>;
template class MultiheadAttention<double>;

}  // namespace attn
