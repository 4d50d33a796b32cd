// Chunked prefill over a KV layout: many new query rows per sequence.
//
// The decode kernel is built for a few rows per (sequence, kv head): it
// streams every K/V tile once per block of at most 128 rows, with a
// register block of 4 rows × 2 keys. That is the right trade when the call
// is bound by reading K and V. With hundreds of new rows (a prompt appended
// in chunks) the call is bound by arithmetic instead, and the fused kernel's
// block product, which reuses a K/V block across a whole tile of queries
// from cache, runs close to the FMA peak. So a request whose rows do not
// suit the decode kernel (decode_suits_rows) comes here and runs the fused
// forward (its bfloat16 products under compute_dtype bfloat16, except over
// float16 storage) on float32 views of the stored keys:
//
//  * A float32 sequence that lies in one page (always, for the contiguous
//    layout) is one fused call on views of the storage itself: no copy.
//  * Otherwise the sequence's keys are taken in chunks of chunk_keys keys
//    (a function of Hkv, E and Ev: the split depends on nothing but the
//    shape). A float32 chunk inside one page is again a view; any other
//    chunk (crossing pages, or float16/bfloat16 storage) is widened into a
//    scratch block first, row by row on the call's threads, exactly (the
//    conversion of convert_from_storage).
//    Each chunk's output and log-sum-exp are merged into the running result
//    in chunk order (merge_attention), so the result does not depend on the
//    thread count.
//  * Positions: a chunk whose keys start at j0 is the problem of those keys
//    (Problem::keys_of: the same positions, key_origin j0, the mask and
//    bias sliced), so every rule sees the whole call's positions. Only the
//    keys some query sees are read (a window skips the rest), and the sinks
//    join the first chunk's softmax, so the merge counts them once.
// The widening is O(S·(E + Ev)) against O(L·S·(E + Ev)) flops, a few
// percent at the sizes that come here.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attn/merge.hpp"
#include "kernels/decode/decode.hpp"
#include "kernels/fused/bf16.hpp"
#include "kernels/fused/fused.hpp"

namespace attn::detail {

namespace {

// Keys per chunk when a sequence is not one float32 view: 4096, or fewer
// (a multiple of 1024, at least 1024) where the widened K and V of 4096
// keys would pass kScratchBytes. Longer chunks keep the fused kernel's
// speed (on Zen 5, L = 512 over S = 8192 float16 with Hkv = 8, E = 128 ran
// at 0.91× the float32 cache's speed in chunks of 1024 keys, 0.95-0.99× in
// chunks of 4096); the bound keeps the scratch small where heads are many
// and wide (Hkv = 32, E = Ev = 128: 1024 keys, 32 MiB).
constexpr int64_t kChunkStep = 1024, kChunkMax = 4096;
constexpr int64_t kScratchBytes = int64_t(32) << 20;
int64_t chunk_keys(const Problem& p) {
  const int64_t per_key = std::max<int64_t>(1, p.Hkv * (p.E + p.Ev) * int64_t(sizeof(float)));
  return std::clamp(kScratchBytes / per_key / kChunkStep * kChunkStep, kChunkStep, kChunkMax);
}

int64_t element_bytes(Dtype t) { return t == Dtype::float32 ? 4 : 2; }

// Keys [j0, j0 + n) of (b, every kv head) as a (1, Hkv, n, D) float32 view:
// of the storage itself when possible, else widened into `scratch`.
// `page`, `head`, `row` are the layout's strides of K or of V.
View4<const float> keys_view(const KVLayout& kv, const void* base, int64_t page_stride, int64_t head_stride,
                             int64_t row_stride, int64_t Hkv, int64_t D, int64_t b, int64_t j0, int64_t n,
                             Tensor<float>& scratch, int threads) {
  const auto page_of = [&](int64_t j) {
    return kv.table ? int64_t(kv.table[b * kv.table_stride + j / kv.page_size]) : b;
  };
  const auto at = [&](int64_t hk, int64_t j) {
    return static_cast<const char*>(base) +
           (page_of(j) * page_stride + hk * head_stride + (j % kv.page_size) * row_stride) * element_bytes(kv.type);
  };
  const bool one_page = j0 / kv.page_size == (j0 + n - 1) / kv.page_size;
  if (kv.type == Dtype::float32 && one_page)
    return View4<const float>(reinterpret_cast<const float*>(at(0, j0)), {1, Hkv, n, D},
                              {Hkv * head_stride, head_stride, row_stride, 1});
  const std::vector<int64_t> shape{1, Hkv, n, D};
  if (scratch.shape() != shape) scratch = Tensor<float>::uninitialized(shape);
  float* dst = scratch.data();
  // Row by row (a row is D contiguous elements wherever it lies), the rows
  // shared among the threads; the conversion is exact, so the split does
  // not show in the result.
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) if (threads > 1 && Hkv * n * D >= (int64_t(1) << 16))
  for (int64_t hk = 0; hk < Hkv; ++hk)
    for (int64_t r = 0; r < n; ++r) convert_from_storage(kv.type, at(hk, j0 + r), D, dst + (hk * n + r) * D);
  return scratch.view4();
}

}  // namespace

void prefill_forward(const Problem& p, const KVLayout& kv, View4<const float> q, View4<float> out,
                     View3<float> lse) {
  Tensor<float> kbuf, vbuf;  // widened chunks (shaped on first use)
  Tensor<float> part = Tensor<float>::uninitialized({1, p.H, p.L, p.Ev}), plse = Tensor<float>::uninitialized({1, p.H, p.L}),
                own_lse;
  if (lse.empty()) own_lse = Tensor<float>({1, p.H, p.L});
  // compute_dtype bfloat16: the fused forward's bfloat16 products, as the
  // dense call's; float16 storage stays exact, as in the decode kernel.
  const bool bf16 = p.bf16_products && kv.type != Dtype::float16;
  // (The float32 forward's scratch is laid out by bf16_products: false there.)
  const auto forward = [&](Problem cp, const SdpaArgs<float>& a, View4<float> o, View3<float> l) {
    cp.bf16_products = bf16;
    if (bf16) fused_forward_bf16(cp, a, o, {}, l, bf16_best_path());
    else fused_forward(cp, a, o, {}, l);
  };
  for (int64_t b = 0; b < p.B; ++b) {
    View4<float> ob(out.data + b * out.strides[0], {1, p.H, p.L, p.Ev},
                    {out.strides[0], out.strides[1], out.strides[2], out.strides[3]});
    View3<float> lb = lse.empty() ? own_lse.view<3>()
                                  : View3<float>(lse.data + b * lse.strides[0], {1, p.H, p.L},
                                                 {lse.strides[0], lse.strides[1], lse.strides[2]});
    // The keys any query of the sequence sees (all of them, unless a window,
    // chunks or the causal rule with fewer keys than queries narrow them).
    const int64_t klo = p.keys(b, 0).lo, khi = std::max(klo, p.keys(b, p.L - 1).hi);
    if (khi == klo) {  // nothing to see: output 0, lse −inf (or the head's sink)
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t i = 0; i < p.L; ++i) {
          for (int64_t e = 0; e < p.Ev; ++e) ob(0, h, i, e) = 0.0f;
          lb(0, h, i) = p.rules.sink(h);
        }
      continue;
    }
    const bool whole = kv.type == Dtype::float32 && klo / kv.page_size == (khi - 1) / kv.page_size;
    const int64_t chunk = whole ? khi - klo : chunk_keys(p);
    SdpaArgs<float> a;
    a.q = View4<const float>(q.data + b * q.strides[0], {1, p.H, p.L, p.E},
                             {q.strides[0], q.strides[1], q.strides[2], q.strides[3]});
    for (int64_t j0 = klo; j0 < khi; j0 += chunk) {
      const int64_t nk = std::min(chunk, khi - j0);
      a.k = keys_view(kv, kv.k, kv.k_page, kv.k_head, kv.k_row, p.Hkv, p.E, b, j0, nk, kbuf, p.threads);
      a.v = keys_view(kv, kv.v, kv.v_page, kv.v_head, kv.v_row, p.Hkv, p.Ev, b, j0, nk, vbuf, p.threads);
      Problem cp = p.keys_of(b, j0, nk);
      if (j0 != klo) cp.rules.sinks = {};  // counted once, in the first chunk
      if (j0 == klo) {
        forward(cp, a, ob, lb);
      } else {
        forward(cp, a, part.view4(), plse.view<3>());
        merge_attention<float>(ob, lb, View4<const float>(part.view4()), View3<const float>(plse.view<3>()), p.threads);
      }
    }
  }
}

}  // namespace attn::detail
