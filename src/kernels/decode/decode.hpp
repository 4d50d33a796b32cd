// Internal: the grouped-query, split-KV decode kernel (decode.cpp) and the
// description of where its keys and values live. Called after validation by
// decode_attention (src/kv_cache.cpp) and by the dense dispatch in
// src/sdpa.cpp for calls with few query rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attn/kv_cache.hpp"
#include "attn/sdpa.hpp"
#include "kernels/problem.hpp"

namespace attn::detail {

enum class KVStorage { f32, f16, bf16 };

// Key j of sequence b, head hk starts at element
//   page·k_page + hk·k_head + (j % page_size)·k_row      of k,
// page = table ? table[b·table_stride + j / page_size] : b; its E features
// are k_elem apart (1 in a cache: contiguous). The same for v. A dense
// (B, Hkv, S, E) view is one page of S keys per sequence.
struct KVLayout {
  KVStorage type = KVStorage::f32;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t page_size = 0;
  const int32_t* table = nullptr;
  int64_t table_stride = 0;
  int64_t k_page = 0, k_head = 0, k_row = 0, k_elem = 1;
  int64_t v_page = 0, v_head = 0, v_row = 0, v_elem = 1;

  // Dense (B, Hkv, S, E) and (B, Hkv, S, Ev) views of storage type t: one
  // page per sequence (the page of sequence b is b).
  template <class T>
  static KVLayout dense(KVStorage t, const View4<const T>& k, const View4<const T>& v) {
    KVLayout kv;
    kv.type = t;
    kv.k = k.data;
    kv.v = v.data;
    kv.page_size = k.dim(2);
    kv.k_page = k.strides[0], kv.k_head = k.strides[1], kv.k_row = k.strides[2], kv.k_elem = k.strides[3];
    kv.v_page = v.strides[0], kv.v_head = v.strides[1], kv.v_row = v.strides[2], kv.v_elem = v.strides[3];
    return kv;
  }
};

struct DecodeProblem {
  int64_t B = 0, H = 0, Hkv = 0, L = 0, E = 0, Ev = 0;
  double scale = 1.0;
  // The score rules (src/kernels/score_rules.hpp), as in the dense call:
  // query i of sequence b sits at position i + offset[b] on its key axis;
  // causal, the window and length[b] fold into the keys it sees (keys());
  // softcap, the ALiBi slopes and the sinks change its scores and softmax.
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // −1: unbounded
  double softcap = 0;                           // 0: off
  std::vector<float> slopes;  // ALiBi slope per query head (empty: none)
  std::vector<float> sinks;   // sink logit per query head (empty: none)
  // Elementwise rules, (B|1, H|1, L|1, K|1) over key positions j (K: the
  // dense call's S, the cache's capacity); optional: a boolean mask (true =
  // the query may attend) and an additive bias (−inf masks).
  View4<const bool> mask;
  View4<const float> bias;
  std::vector<int64_t> length;  // keys of sequence b (B entries)
  std::vector<int64_t> offset;  // position of query 0 of sequence b (B entries)
  int threads = 1;
  bool split = true;  // chunks of one (sequence, head) may run on different threads

  int64_t group() const { return H / Hkv; }
  // The keys [lo, hi) query i of sequence b sees (lo and hi never decrease with i).
  rules::Keys keys(int64_t b, int64_t i) const {
    return rules::Band::make(offset[size_t(b)], window_left, window_right, causal, length[size_t(b)]).keys(i);
  }
  // The decode problem of a validated dense call (src/sdpa.cpp): its band,
  // score modifiers and key lengths.
  static DecodeProblem of(const Problem& p, const SdpaArgs<float>& a);
};

// A (B|1, H|1, L|1, K|1) operand (mask or bias) of sequence b over keys
// [j0, j0 + n): a (1, H|1, L|1, n|1) view, for the calls that take one
// sequence's keys at a time (chunked prefill, the reference).
template <class T>
View4<const T> sequence_keys(const View4<const T>& x, int64_t b, int64_t j0, int64_t n) {
  if (x.empty()) return {};
  const bool along = x.dim(3) != 1;
  return View4<const T>(x.data + (x.dim(0) == 1 ? 0 : b * x.strides[0]) + (along ? j0 * x.strides[3] : 0),
                        {1, x.dim(1), x.dim(2), along ? n : 1}, x.strides);
}

namespace decode_common {
constexpr int64_t kMaxRows = 128;      // query rows per block (the M of one unit)
constexpr int64_t kTargetUnits = 32;   // split the keys until about this many units exist
constexpr int64_t kMinChunk = 256;     // ... but never into chunks shorter than this
}  // namespace decode_common

// How the work is cut; depends only on the shape (never on the threads).
// The G·L query rows of a (sequence, kv head) are split into blocks of at
// most `rows`; the keys of each block into chunks of `chunk` keys (merged by
// log-sum-exp); a chunk is walked in tiles of at most `tile` keys.
struct DecodePlan {
  int64_t rows = 0, chunk = 0, tile = 0;
};
DecodePlan decode_plan(const DecodeProblem& p);

void decode_forward(const DecodeProblem& p, const KVLayout& kv, View4<const float> q, View4<float> out,
                    View3<float> lse);
void decode_forward_planned(const DecodeProblem& p, const KVLayout& kv, View4<const float> q,
                            View4<float> out, View3<float> lse, DecodePlan plan);

// Whether L new rows per sequence with G query heads per kv head suit the
// decode kernel (few rows: bound by reading K and V). Larger blocks are
// chunked prefill, bound by arithmetic: prefill_forward (prefill.cpp) runs
// them through the fused kernel on float32 views of the stored keys.
bool decode_suits_rows(int64_t L, int64_t G);
void prefill_forward(const DecodeProblem& p, const KVLayout& kv, View4<const float> q, View4<float> out,
                     View3<float> lse);

// The dense call's use of the kernel: whether a validated request goes this
// way (few query rows, no mask or bias, unit feature strides, no weights),
// and the call itself.
bool decode_suits_dense(const Problem& p, const SdpaArgs<float>& a, bool want_weights);
void decode_forward_dense(const Problem& p, const SdpaArgs<float>& a, View4<float> out, View3<float> lse);

// The SIMD target the kernel dispatches to (e.g. "AVX2").
const char* decode_target_name();

// Storage conversions (round to nearest even; NaN stays NaN), n elements.
void convert_to_storage(KVStorage t, const float* x, int64_t stride, int64_t n, void* dst);
void convert_from_storage(KVStorage t, const void* src, int64_t n, float* y);

// The cache's storage as the kernel reads it.
struct KVCacheAccess {
  static KVLayout layout(const KVCache& c);
};

}  // namespace attn::detail
