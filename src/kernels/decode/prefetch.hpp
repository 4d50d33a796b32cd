// The decode kernel's software prefetch of K/V rows (no SIMD types, so the
// per-target register blocks and the bfloat16 products compiled once share
// it; why it exists: the top of decode.cpp).
#pragma once

#include <cstdint>

#include "kernels/prefetch.hpp"

namespace attn::detail::decode_common {

// Starts loading n rows of `bytes` bytes, `stride` bytes apart, into the L2
// cache (locality 2: prefetcht1 on x86). A prefetch into L1 (hwy::Prefetch,
// prefetcht0) holds one of the core's few L1 miss buffers until its line
// arrives from DRAM, which capped the rows in flight; Zen 4 and Intel cores
// take prefetcht1 into the L2, whose miss queue is deeper, and the demand
// loads then hit the L2. On Zen 4 (2 threads, float32 K/V, alternating
// calls in one process) it took 8-20% less time than prefetcht0 at
// S = 4096 to 32768 (docs/decode.md, "Prefetch into the L2"); not measured
// on Zen 3 or Intel.
inline void PrefetchRows(const char* p, int64_t stride, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j, p += stride)
    for (int64_t o = 0; o < bytes; o += 64) PrefetchL2(p + o);
}

// Rows to start loading while a loop over keys runs (a.p = nullptr: none).
// The rows of segment a, then those of segment b, form one stream; while the
// loop uses key j it starts loading row j + ahead of the stream.
struct RowPrefetch {
  struct Segment {
    const char* p = nullptr;
    int64_t stride = 0, bytes = 0, count = 0;  // count rows of `bytes` bytes, `stride` bytes apart
  };
  Segment a, b;
  int64_t ahead = 0;
  inline void rows(int64_t j, int64_t n) const {
    if (!a.p) return;
    for (int64_t i = j + ahead; i < j + ahead + n; ++i) {
      if (i < a.count) PrefetchRows(a.p + i * a.stride, a.stride, 1, a.bytes);
      else if (b.p && i - a.count < b.count) PrefetchRows(b.p + (i - a.count) * b.stride, b.stride, 1, b.bytes);
    }
  }
};

// count rows of `width` elements from p, `row` elements apart.
template <class T>
RowPrefetch::Segment RowsOf(const T* p, int64_t row, int64_t width, int64_t count) {
  return {reinterpret_cast<const char*>(p), row * int64_t(sizeof(T)), width * int64_t(sizeof(T)), count};
}

}  // namespace attn::detail::decode_common
