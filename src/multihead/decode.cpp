// The multi-head layer's incremental decoding over a KV cache
// (MultiheadAttention::decode, attn/multihead.hpp): the forward's
// projections for the new rows only (multihead/steps.hpp), their keys and
// values appended to the cache, decode_attention over everything it holds,
// and the output projection. docs/multihead.md, "Incremental decoding".
#include <string>
#include <type_traits>
#include <vector>

#include "attn/kv_cache.hpp"
#include "attn/multihead.hpp"
#include "decode_call.hpp"
#include "multihead/steps.hpp"

namespace attn {

using namespace detail::mha_steps;

// Decoding: the forward's steps for the L new rows of each sequence, with
// the keys and values of the earlier rows read from the cache:
//   [q | k | v] = x·Wᵀ + b;  q, k ← transform at positions length(b)..length(b)+L−1
//   cache ← cache + (k, v);  o = decode_attention(q, cache)
//   y = o·W_oᵀ + b_o
// Every argument is checked before the cache is appended to.
template <class T>
void MultiheadAttention<T>::decode(const MhaArgs<T>& a, KVCache& cache, View3<T> out, const MhaOptions& opt) const
  requires std::same_as<T, float>
{
  const Checker c{"MultiheadAttention::decode"};
  const int64_t D = cfg_.embed_dim, H = cfg_.num_heads, E = cfg_.head_dim, Ev = cfg_.v_head_dim;
  c.require(a.query, "query");
  const auto refuse = [&](const char* name, const char* why) {
    c.fail(std::string("argument '") + name + "' is not taken: " + why);
  };
  const char* self_only = "decoding is self-attention over the cache (leave key and value empty)";
  const char* lengths = "the cache's lengths say which keys each sequence has; use mask to hide some";
  if (c.given(a.key, "key")) refuse("key", self_only);
  if (c.given(a.value, "value")) refuse("value", self_only);
  if (c.given(a.key_padding_mask, "key_padding_mask")) refuse("key_padding_mask", lengths);
  if (c.given(a.key_lengths, "key_lengths")) refuse("key_lengths", lengths);
  if (c.given(a.sinks, "sinks")) refuse("sinks", "the layer's sinks are its parameter 'sinks' (MultiheadConfig::sinks)");
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
  ScoreArgs<float> rules = a;
  if (cfg_.sinks) rules.sinks = params_.at(kSinks).template view<1>();
  const int threads = detail::check_decode(c, rules, opt.sdpa, {B, H, L, cache.capacity()}, read);
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
    detail::decode_run(cache, rules, opt.sdpa, H, L, threads, View4<const T>(qh), View4<T>::bnhd(o.data(), B, L, H, Ev),
                       {},
                       opt.sdpa.backend == Backend::reference ? Backend::reference : Backend::automatic);
    project_out(o.data(), parameter(kOutProjWeight).data(),
                cfg_.bias ? parameter(kOutProjBias).data() : nullptr, HEv, out, threads);
  } catch (...) {  // checked above, so only e.g. std::bad_alloc: the cache as it was
    for (int64_t b = 0; b < B; ++b) cache.truncate(b, before[size_t(b)]);
    throw;
  }
}

template void MultiheadAttention<float>::decode(const MhaArgs<float>&, KVCache&, View3<float>,
                                                const MhaOptions&) const;

}  // namespace attn
