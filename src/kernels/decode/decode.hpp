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

enum class Bf16Path;  // kernels/fused/bf16.hpp

// Key j of sequence b, head hk starts at element
//   page·k_page + hk·k_head + (j % page_size)·k_row      of k,
// page = table ? table[b·table_stride + j / page_size] : b; its E features
// are k_elem apart (1 in a cache: contiguous). The same for v. A dense
// (B, Hkv, S, E) view is one page of S keys per sequence.
struct KVLayout {
  Dtype type = Dtype::float32;
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
  static KVLayout dense(Dtype t, const View4<const T>& k, const View4<const T>& v) {
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

namespace decode_common {
constexpr int64_t kMaxRows = 128;      // query rows per block (the M of one unit)
constexpr int64_t kTargetUnits = 32;   // split the keys until about this many units exist
constexpr int64_t kMinChunk = 256;     // ... but never into chunks shorter than this
// Multiply-adds (rows × keys × (E + Ev)) below which one thread runs the
// call: starting and joining a team of sleeping threads costs about what a
// core does with this much work (~15 µs; 9 rows over 256 keys of 64 + 64).
constexpr int64_t kMinParallelWork = int64_t(1) << 18;
}  // namespace decode_common

// How the work is cut; depends only on the shape (never on the threads).
// The G·L query rows of a (sequence, kv head) are split into blocks of at
// most `rows`; the keys of each block into chunks of `chunk` keys (merged by
// log-sum-exp); a chunk is walked in tiles of at most `tile` keys. `serial`:
// the call is too small to be worth more than one thread (the result is the
// same bits either way: the chunks and their merge order are the plan's).
struct DecodePlan {
  int64_t rows = 0, chunk = 0, tile = 0;
  bool serial = false;
};
DecodePlan decode_plan(const Problem& p);

// Attention of p.L query rows per sequence over the keys of kv, under p's
// rules (per-sequence offsets and key ends: a cache's lengths). Every rule
// is read from p; kv says where the keys live. With p.bf16_products the two
// products take bfloat16 operands (kernels/decode/bf16.hpp) on `path`
// (portable and AVX512_BF16 give the same bits, AMX its own within the
// same bound) over float32 and bfloat16 storage; else, and over float16
// storage, they are exact. decode_forward takes decode_bf16_path() where
// decode_bf16_pays(), and the exact products elsewhere.
void decode_forward(const Problem& p, const KVLayout& kv, View4<const float> q, View4<float> out,
                    View3<float> lse);
void decode_forward_planned(const Problem& p, const KVLayout& kv, View4<const float> q,
                            View4<float> out, View3<float> lse, DecodePlan plan, Bf16Path path);

// Whether L new rows per sequence with G query heads per kv head suit the
// decode kernel (few rows: bound by reading K and V). Larger blocks are
// chunked prefill, bound by arithmetic: prefill_forward (prefill.cpp) runs
// them through the fused kernel on float32 views of the stored keys.
bool decode_suits_rows(int64_t L, int64_t G);
void prefill_forward(const Problem& p, const KVLayout& kv, View4<const float> q, View4<float> out,
                     View3<float> lse);

// The dense call's use of the kernel: whether a validated request without
// weights goes this way (few query rows; every rule and any strides are the
// kernel's own), and the call itself on float32 or half q, k, v (half K and
// V are read in their storage type, q is widened; p.bf16_products says
// which products).
bool decode_suits_dense(const Problem& p);
template <class T>
void decode_forward_dense(const Problem& p, const SdpaArgs<T>& a, View4<float> out, View3<float> lse);

// The SIMD target the kernel dispatches to (e.g. "AVX2").
const char* decode_target_name();

// Storage conversions (round to nearest even; NaN stays NaN), n elements:
// to storage and the exact widening back, plain (src/half.cpp: the cache's
// appends and reads), and the kernel's vector widening (the same bits).
void convert_to_storage(Dtype t, const float* x, int64_t stride, int64_t n, void* dst);
void widen_from_storage(Dtype t, const void* src, int64_t n, float* y);
void convert_from_storage(Dtype t, const void* src, int64_t n, float* y);
// The contiguous bfloat16 rows of the two plain ones (src/half.cpp): with
// `wide`, the AVX-512 copy of the loop where bf16_rows_wide() says the CPU
// runs it (the same bits; tests run both).
bool bf16_rows_wide();
void bf16_round_rows(const float* x, int64_t n, uint16_t* y, bool wide);
void bf16_widen_rows(const uint16_t* h, int64_t n, float* y, bool wide);

// The cache's storage as the kernel reads it.
// The decode call holds the cache's shared lock for the whole call (lock)
// and reads it through the members below, which expect the lock held.
struct KVCacheAccess {
  static std::shared_lock<std::shared_mutex> lock(const KVCache& c) { return c.shared(); }
  static KVLayout layout(const KVCache& c);
  static int64_t length(const KVCache& c, int64_t b) { return c.len_[size_t(b)]; }
  static void read(const KVCache& c, int64_t b, View3<float> k, View3<float> v) { c.read_locked(b, k, v); }
};

}  // namespace attn::detail
