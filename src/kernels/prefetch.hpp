// Software prefetch of one cache line, for the kernels' loops that start
// loading rows ahead of their use (decode/prefetch.hpp, fused/scores-inl.h).
//
// An asm statement rather than __builtin_prefetch (or hwy::Prefetch, which
// is that builtin): GCC 12 at -O2 deleted the loops over a row's cache lines
// whose only statements were the builtin, as loops without effects, so the
// kernels issued no prefetch at all (objdump of decode.cpp.o: no prefetch
// instruction in the score or value loops). A volatile asm is never deleted.
// Other architectures keep the builtin (the test prefetch_emitted checks x86).
#pragma once

#include <cstdint>

namespace attn::detail {

// Level 1: into every cache level (prefetcht0); level 2: into the L2 and
// outer caches, not the L1 (prefetcht1).
template <int kLevel>
inline void Prefetch(const void* p) {
  static_assert(kLevel == 1 || kLevel == 2);
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  if constexpr (kLevel == 1) asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  else asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, /*rw=*/0, /*locality=*/kLevel == 1 ? 3 : 2);
#endif
}
inline void PrefetchL1(const void* p) { Prefetch<1>(p); }
inline void PrefetchL2(const void* p) { Prefetch<2>(p); }
// Every cache line of [p, p + bytes) into every level (a row to be read next).
inline void PrefetchL1Bytes(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) PrefetchL1(static_cast<const char*>(p) + o);
}

}  // namespace attn::detail
