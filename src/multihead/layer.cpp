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
// the GEMMs read or write anyway. The bfloat16 forward makes no split: its
// attention copies q, k, v into its own layouts, so it reads the strided
// heads once (its backward, tried on strided dY, Y and dQ, ran slower: the
// splits and the merge stay there).
//
// Construction, initialisation and the parameters by name are in
// params.cpp; the steps forward, backward and decode share (dense
// copies, the input projections split into heads, the output projection) in
// multihead/steps.hpp; incremental decoding over a KV cache in
// decode.cpp.
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
#include "multihead/names.hpp"
#include "multihead/steps.hpp"
#include "validate.hpp"

namespace attn {

using namespace detail::mha_steps;

// ---------------------------------------------------------------------------
// Forward and backward

namespace {

// A dense copy of a view, a row (its last dimension) at a time.
template <class T, int R>
Tensor<T> copy_of(View<const T, R> v) {
  std::vector<int64_t> shape(v.shape.begin(), v.shape.end());
  Tensor<T> t = Tensor<T>::uninitialized(shape);
  const int64_t n = v.shape[R - 1], s = v.strides[R - 1];
  if (t.size() == 0) return t;
  std::array<int64_t, R> idx{};
  for (size_t f = 0; f < t.size(); f += size_t(n)) {
    int64_t o = 0;
    for (int i = 0; i < R - 1; ++i) o += idx[size_t(i)] * v.strides[size_t(i)];
    if (s == 1)
      std::copy_n(v.data + o, n, t.data() + f);
    else
      for (int64_t j = 0; j < n; ++j) t[f + size_t(j)] = v.data[o + j * s];
    for (int i = R - 2; i >= 0; --i) {
      if (++idx[size_t(i)] < v.shape[size_t(i)]) break;
      idx[size_t(i)] = 0;
    }
  }
  return t;
}

// The attention's arguments: the heads of the projections, the masks, bias,
// key lengths and per-head operands the saved state owns, and the layer's
// sinks.
template <class T>
SdpaArgs<T> sdpa_args(const MhaSaved<T>& st, View4<const T> q, View4<const T> k, View4<const T> v,
                      const Tensor<T>* sinks) {
  SdpaArgs<T> args;
  args.q = q, args.k = k, args.v = v;
  if (st.mask.rank() == 4) args.mask = st.mask.view4();
  if (st.bias.rank() == 4) args.bias = st.bias.view4();
  if (st.key_lengths.rank() == 1) args.key_lengths = st.key_lengths.template view<1>();
  for (size_t i = 0; i < st.per_head.size(); ++i)
    if (st.per_head[i].rank() == 1) args.*detail::kPerHeadOperands<T>[i].member = st.per_head[i].template view<1>();
  if (sinks) args.sinks = sinks->template view<1>();
  return args;
}

}  // namespace

template <class T>
void MultiheadAttention<T>::forward(const MhaArgs<T>& a, const MhaOutputs<T>& o, const MhaOptions& opt,
                                    MhaSaved<T>* cache) const {
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
  if (c.given(a.sinks, "sinks"))
    c.fail("argument 'sinks' is not taken: the layer's sinks are its parameter 'sinks' (MultiheadConfig::sinks)");
  const int threads = detail::check_rules<T>(c, a, opt.sdpa, full, read);
  c.optional(a.key_padding_mask, "key_padding_mask", {B, S}, read, "(B, S) = " + shape_str({B, S}));
  if (c.given(a.key_lengths, "key_lengths")) {
    c.shape(a.key_lengths, "key_lengths", {B}, "(B,) = " + shape_str({B}));
    for (int64_t b = 0; b < B; ++b)
      if (a.key_lengths(b) < 0 || a.key_lengths(b) > S)
        c.fail("argument 'key_lengths' has value " + std::to_string(a.key_lengths(b)) + " at batch " +
               std::to_string(b) + ", expected 0 <= key_lengths[b] <= S = " + std::to_string(S));
    read.push_back(c.extent(a.key_lengths, "key_lengths"));
  }
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, read);
  if (opt.sdpa.check_finite) {
    c.finite(a.query, "query");
    if (!self) {
      c.finite(a.key, "key");
      c.finite(a.value, "value");
    }
  }

  // Filled here and moved into *cache at the end, so that inputs which alias
  // the caller's old cache stay valid while they are read.
  MhaSaved<T> st;
  // A cache refilled call after call (a training loop) lends its buffers to
  // the new state, unless an argument points into one of them; without a
  // cache, the layer's spare state lends them (and takes them back below).
  std::unique_ptr<MhaSaved<T>> spare = cache ? nullptr : spare_.take();
  if (MhaSaved<T>* lender = cache ? cache : spare.get()) {
    std::vector<const void*> ptrs{a.query.data,       a.key.data,       a.value.data,
                                  a.mask.data,        a.bias.data,      a.key_padding_mask.data,
                                  a.key_lengths.data, o.out.data,       o.head_weights.data,
                                  o.avg_weights.data};
    for (const auto& op : detail::kPerHeadOperands<T>) ptrs.push_back((a.*op.member).data);
    std::vector<const Tensor<T>*> owned{&lender->query,    &lender->key, &lender->value, &lender->proj,
                                        &lender->packed,   &lender->attn_out, &lender->lse, &lender->bias};
    for (const Tensor<T>& t : lender->per_head) owned.push_back(&t);
    bool aliased = false;
    for (const void* p : ptrs)
      for (const Tensor<T>* t : owned) aliased = aliased || inside(*t, p);
    for (const void* p : ptrs) aliased = aliased || inside(lender->mask, p) || inside(lender->key_lengths, p);
    if (!aliased) {
      st.query = std::move(lender->query), st.key = std::move(lender->key), st.value = std::move(lender->value);
      st.proj = std::move(lender->proj), st.packed = std::move(lender->packed);
      st.attn_out = std::move(lender->attn_out), st.lse = std::move(lender->lse);
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
  // + b and the split into dense heads (bfloat16 products: the GEMMs add b,
  // and the heads stay in their layout, MhaSaved::heads_in_packed).
  const int64_t HE = H * E, HEv = H * Ev, proj_size = B * L * HE + B * S * (HE + HEv);
  const bool bf16 = opt.sdpa.compute_dtype == Dtype::bfloat16;  // the projections' products too
  st.heads_in_packed = bf16 && std::is_same_v<T, float>;  // (project's layouts)
  sized(st.packed, {proj_size});
  if (st.heads_in_packed)
    st.proj = Tensor<T>();
  else
    sized(st.proj, {proj_size});
  const auto ps = parts<T>(*this, cfg_, packed_, self, B, L, S, xq, xk, xv, st.packed.data(), nullptr);
  const auto [qh, kh, vh] = project(ps, self && packed_, B, L, S, H, E, Ev, st.proj.data(), threads, bf16);
  if (qk_.forward) qk_.forward(qh, kh);

  // The masks: a saved state owns copies (its backward may run after the
  // caller's arrays are gone), a call without one reads the caller's (the
  // copy of a (1, 12, 2048, 2048) float bias took a fifth of the layer's
  // forward at (1, 2048, 768, 12)). key_padding_mask (true = padding) folds
  // into the bool mask (true = attend) either way.
  const bool keep = cache != nullptr;
  const auto& am = a.mask;
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
  } else if (!am.empty() && keep) {
    st.mask = copy_of<bool, 4>(am);
  }
  if (keep) {
    if (!a.bias.empty()) st.bias = copy_of<T, 4>(a.bias);
    if (!a.key_lengths.empty()) st.key_lengths = copy_of<int64_t, 1>(a.key_lengths);
    st.per_head.resize(detail::kPerHeadOperands<T>.size());
    for (size_t i = 0; i < st.per_head.size(); ++i)
      if (const View1<const T>& v = a.*detail::kPerHeadOperands<T>[i].member; !v.empty())
        st.per_head[i] = copy_of<T, 1>(v);
  }

  SdpaArgs<T> args = sdpa_args<T>(st, qh, kh, vh, cfg_.sinks ? &params_.at(kSinks) : nullptr);
  if (!keep) {  // the caller's operands as they are
    if (a.key_padding_mask.empty()) args.mask = am;
    args.bias = a.bias;
    args.key_lengths = a.key_lengths;
    for (const auto& op : detail::kPerHeadOperands<T>)
      if (!(a.*op.member).empty()) args.*op.member = a.*op.member;  // (not the layer's sinks)
  }

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
              cfg_.bias ? parameter(kOutProjBias).data() : nullptr, HEv, o.out, threads, bf16);
  if (cache) {
    *cache = std::move(st);
  } else {
    *spare = std::move(st);
    spare_.give(std::move(spare));
  }
}
template <class T>
void MultiheadAttention<T>::backward(const MhaSaved<T>& cache, View3<const T> dout, const MhaGrads<T>& g) {
  const Checker c{"MultiheadAttention::backward"};
  const int64_t D = cfg_.embed_dim, H = cfg_.num_heads, E = cfg_.head_dim, Ev = cfg_.v_head_dim;
  const bool self = cache.self_attention;
  if (!cache.filled()) c.fail("argument 'cache' is empty; pass the same cache to forward first");
  const int threads = c.threads(cache.options.sdpa.num_threads);
  const bool bf16 = cache.options.sdpa.compute_dtype == Dtype::bfloat16;  // the forward's products
  const int64_t B = cache.B, L = cache.L, S = cache.S;
  const int64_t HE = H * E, HEv = H * Ev;
  const bool consistent =
      cache.H == H && cache.E == E && cache.Ev == Ev &&
      cache.packed.size() == size_t(self ? B * L * (2 * HE + HEv) : B * L * HE + B * S * (HE + HEv)) &&
      (cache.heads_in_packed || cache.proj.size() == cache.packed.size()) &&
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
  gemm_as<T>(bf16, {D, HEv, B * L}, true, dy, D, false, cache.attn_out.data(), HEv,
             grads_.at(kOutProjWeight).data(), HEv, T(1), T(1), threads);
  if (cfg_.bias) add_column_sums(dy, B * L, D, D, grads_.at(kOutProjBias).data());
  // The gradient buffers live in the layer between calls (every element is
  // written before it is read): no allocation in a training loop.
  Tensor<T>& d_attn = d_attn_;
  sized(d_attn, {B, L, HEv});
  gemm_as<T>(bf16, {B * L, HEv, D}, false, dy, D, false, wo.data(), HEv, d_attn.data(), HEv, T(1), T(0), threads);
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
  sized(dproj, {int64_t(cache.packed.size())});
  const T* xs = cache.query.data();
  const auto ps = parts<T>(*this, cfg_, packed_, self, B, L, S, xs, self ? xs : cache.key.data(),
                           self ? xs : cache.value.data(), dproj.data(), &grads_);
  const SdpaArgs<T> args =
      sdpa_args<T>(cache, cache.q(), cache.k(), cache.v(), cfg_.sinks ? &params_.at(kSinks) : nullptr);
  SdpaOptions so = cache.options.sdpa;
  so.check_finite = false;  // the forward checked its inputs
  SdpaGrads<T> sg;
  sized(heads_dproj_, {int64_t(cache.packed.size())});
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
    gemm_as<T>(bf16, {3 * D, D, B * L}, true, dproj.data(), 3 * D, false, xs, D, ps[0].gw, D, T(1), T(1), threads);
    if (!g.dquery.empty()) {
      Tensor<T> scratch;
      T* dx = g.dquery.is_contiguous() ? g.dquery.data : (scratch = Tensor<T>({B, L, D})).data();
      gemm_as<T>(bf16, {B * L, D, 3 * D}, false, dproj.data(), 3 * D, false, ps[0].w, D, dx, D, T(1), T(0), threads);
      if (!g.dquery.is_contiguous()) scatter<T>(dx, g.dquery);
    }
    return;
  }
  for (const Part<T>& p : ps)
    gemm_as<T>(bf16, {p.width, p.cols, p.rows}, true, p.p, p.ld, false, p.x, p.cols, p.gw, p.cols, T(1), T(1), threads);
  // dx = dp·W (self-attention: the sum over q, k, v)
  auto input_grad = [&](View3<T> dst, std::initializer_list<int> which) {
    if (dst.empty()) return;
    Tensor<T> scratch;
    T* dx = dst.is_contiguous() ? dst.data : (scratch = Tensor<T>({dst.dim(0), dst.dim(1), dst.dim(2)})).data();
    bool first = true;
    for (int t : which) {
      const Part<T>& p = ps[size_t(t)];
      gemm_as<T>(bf16, {p.rows, p.cols, p.width}, false, p.p, p.ld, false, p.w, p.cols, dx, p.cols, T(1),
                 first ? T(0) : T(1), threads);
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
