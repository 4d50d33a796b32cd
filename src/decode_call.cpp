// decode_attention: attention of new queries over a KV cache, the boundary
// of the decode path (the cache's storage and paging are src/kv_cache.cpp;
// the kernels are src/kernels/decode/). Validation, the problem over the
// cache (positions and key lengths from the cache's lengths; the rules from
// the one resolution, src/rules.cpp), and the route: the reference backend
// on the cache read back, the decode kernel, or chunked prefill for many
// new rows.
#include "decode_call.hpp"

#include <string>
#include <vector>

#include "attn/kv_cache.hpp"
#include "kernels/decode/decode.hpp"
#include "kernels/reference/sdpa_reference.hpp"

namespace attn {

namespace {

// Each sequence through the reference backend on its keys read back as
// float32: the problem of its keys (Problem::keys_of), batch 1.
void decode_reference(const detail::Problem& p, View4<const float> q, const KVCache& cache, View4<float> out,
                      View3<float> lse) {
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t S = detail::KVCacheAccess::length(cache, b);
    View4<float> ob(out.data + b * out.strides[0], {1, p.H, p.L, p.Ev},
                    {out.strides[0], out.strides[1], out.strides[2], out.strides[3]});
    View3<float> lb;
    if (!lse.empty())
      lb = View3<float>(lse.data + b * lse.strides[0], {1, p.H, p.L}, {lse.strides[0], lse.strides[1], lse.strides[2]});
    if (S == 0) {  // nothing to see: output 0, lse −inf (or the head's sink)
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t i = 0; i < p.L; ++i) {
          for (int64_t e = 0; e < p.Ev; ++e) ob(0, h, i, e) = 0.0f;
          if (!lb.empty()) lb(0, h, i) = p.rules.sink(h);
        }
      continue;
    }
    Tensor<float> k({1, p.Hkv, S, p.E}), v({1, p.Hkv, S, p.Ev});
    detail::KVCacheAccess::read(cache, b, View3<float>(k.data(), {p.Hkv, S, p.E}),
                                View3<float>(v.data(), {p.Hkv, S, p.Ev}));
    SdpaArgs<float> a;
    a.q = View4<const float>(q.data + b * q.strides[0], {1, p.H, p.L, p.E},
                             {q.strides[0], q.strides[1], q.strides[2], q.strides[3]});
    a.k = k.view4();
    a.v = v.view4();
    detail::reference_forward(p.keys_of(b, 0, S), a, ob, {}, lb);
  }
}

}  // namespace

int detail::check_decode(const Checker& c, const ScoreArgs<float>& rules, const SdpaOptions& opt,
                         const std::array<int64_t, 4>& full, std::vector<Extent>& read) {
  if (opt.position_offset)
    c.fail("option 'position_offset' is not taken over a cache: query i of sequence b sits at position "
           "length(b) - L + i (the new rows are the last L tokens)");
  if (opt.dropout_p != 0)
    c.fail("option 'dropout_p' is not taken over a cache (decoding runs inference; train with the dense or packed "
           "calls)");
  return check_rules(c, rules, opt, full, read);
}

namespace {

// The problem over the cache's current lengths (the lock held).
detail::Problem decode_problem(const KVCache& cache, const ScoreArgs<float>& rules, const SdpaOptions& opt, int64_t H,
                               int64_t L, int threads) {
  using namespace detail;
  Problem p;
  p.B = cache.batch();
  p.Hkv = cache.kv_heads();
  p.E = cache.head_dim();
  p.Ev = cache.value_dim();
  p.S = cache.capacity();
  p.H = H;
  p.L = L;
  std::vector<int64_t> offset(size_t(p.B)), key_end(size_t(p.B));
  for (int64_t b = 0; b < p.B; ++b) {
    key_end[size_t(b)] = KVCacheAccess::length(cache, b);
    offset[size_t(b)] = key_end[size_t(b)] - L;  // the queries are the last L tokens
  }
  p.rules = resolve_rules(rules, opt, p.E, std::move(offset), std::move(key_end));
  p.threads = threads;
  // bfloat16 products when asked (kernels/decode/bf16.hpp); the reference
  // backend refuses them (decode_attention).
  p.bf16_products = opt.compute_dtype == Dtype::bfloat16;
  return p;
}

}  // namespace

void detail::decode_run(const KVCache& cache, const ScoreArgs<float>& rules, const SdpaOptions& opt, int64_t H,
                        int64_t L, int threads, View4<const float> q, View4<float> out, View3<float> lse,
                        Backend backend) {
  const auto lock = KVCacheAccess::lock(cache);
  const Problem p = decode_problem(cache, rules, opt, H, L, threads);
  if (backend == Backend::reference) return decode_reference(p, q, cache, out, lse);
  const KVLayout kv = KVCacheAccess::layout(cache);
  // Many new rows (chunked prefill) are bound by arithmetic, not by reading
  // the cache: the fused kernel on float32 views of it (kernels/decode/prefill.cpp).
  if (!decode_suits_rows(p.L, p.group())) return prefill_forward(p, kv, q, out, lse);
  decode_forward(p, kv, q, out, lse);
}

namespace {

// The checks of a call over `cache` (arguments, outputs, options, as
// decode_attention documents them); returns the thread count.
int check_call(const detail::Checker& c, const KVCache& cache, const DecodeArgs& args,
               const SdpaOutputs<float>& outputs, const SdpaOptions& opt) {
  const auto& [out, weights, lse] = outputs;
  const View4<const float>& q = args.q;
  c.require(q, "q");
  c.require(out, "out");
  if (c.given(weights, "weights")) c.fail("output 'weights' is not supported over a cache (the kernel never forms them)");
  const bool with_lse = c.given(lse, "lse");
  const int64_t B = cache.batch(), Hkv = cache.kv_heads(), E = cache.head_dim(), Ev = cache.value_dim();
  const int64_t H = q.dim(1), L = q.dim(2);
  if (q.dim(0) != B || q.dim(3) != E || H < 1 || L < 1 || H % Hkv != 0)
    c.fail("argument 'q' has shape " + shape_str(q.shape) + ", expected (B, H, L, E) = (" + std::to_string(B) +
           ", H, L, " + std::to_string(E) + ") with H a multiple of the cache's Hkv = " + std::to_string(Hkv) +
           " and L >= 1");
  c.shape(out, "out", {B, H, L, Ev}, "(B, H, L, Ev) = " + shape_str({B, H, L, Ev}));
  std::vector<detail::Extent> written{c.extent(out, "out")};
  if (with_lse) {
    c.shape(lse, "lse", {B, H, L}, "(B, H, L) = " + shape_str({B, H, L}));
    written.push_back(c.extent(lse, "lse"));
  }
  for (const auto& e : written) c.writable(e);
  std::vector<detail::Extent> read{c.extent(q, "q")};
  const int threads = detail::check_decode(c, args, opt, {B, H, L, cache.capacity()}, read);
  if (opt.compute_dtype == Dtype::bfloat16 && opt.backend == Backend::reference)
    c.fail("option 'compute_dtype' is bfloat16, which the reference backend does not compute (it is exact); "
           "use compute_dtype float32, or backend auto or fused");
  c.disjoint(written, read);
  if (opt.check_finite) c.finite(q, "q");
  return threads;
}

}  // namespace

void decode_attention(const DecodeArgs& args, const SdpaOutputs<float>& outputs, const SdpaOptions& opt) {
  const detail::Checker c{"decode_attention"};
  if (args.cache == nullptr) c.fail("argument 'cache' is required but was not given (null)");
  const int threads = check_call(c, *args.cache, args, outputs, opt);
  detail::decode_run(*args.cache, args, opt, args.q.dim(1), args.q.dim(2), threads, args.q, outputs.out, outputs.lse,
                     opt.backend);
}

void decode_attention(KVCache& cache, View4<const float> k, View4<const float> v, const DecodeArgs& args,
                      const SdpaOutputs<float>& outputs, const SdpaOptions& opt) {
  const detail::Checker c{"decode_attention"};
  if (args.cache != nullptr && args.cache != &cache)
    c.fail("argument 'args.cache' is another cache than 'cache' (give null or the cache the keys are appended to)");
  DecodeArgs a = args;
  a.cache = &cache;
  const int threads = check_call(c, cache, a, outputs, opt);
  c.require(k, "k");
  c.require(v, "v");
  const int64_t B = cache.batch(), Hkv = cache.kv_heads(), n = k.dim(2);
  c.shape(k, "k", {B, Hkv, n, cache.head_dim()}, "(B, Hkv, n, E) = " + shape_str({B, Hkv, n, cache.head_dim()}));
  c.shape(v, "v", {B, Hkv, n, cache.value_dim()},
          "(B, Hkv, n, Ev) = " + shape_str({B, Hkv, n, cache.value_dim()}) + " (n of 'k')");
  if (std::string why = cache.append_refusal(n); !why.empty())
    c.fail("argument 'cache' cannot take the " + std::to_string(n) + " new tokens of each sequence: " + why);
  std::vector<int64_t> before(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) before[size_t(b)] = cache.length(b);
  cache.append(k, v);
  try {
    detail::decode_run(cache, a, opt, a.q.dim(1), a.q.dim(2), threads, a.q, outputs.out, outputs.lse, opt.backend);
  } catch (...) {  // checked above, so only e.g. std::bad_alloc: the cache as it was
    for (int64_t b = 0; b < B; ++b) cache.truncate(b, before[size_t(b)]);
    throw;
  }
}

}  // namespace attn
