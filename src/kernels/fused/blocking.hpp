// Internal: how a block product C[M × N] is cut into register tiles of the
// micro-kernels (rows × vectors of columns). No SIMD types: the portable
// bfloat16 products (bf16-inl.h, per Highway target) and the AVX512_BF16
// ones (bf16_products.cpp) pass in their micro-kernel.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attn::detail {

// micro.template operator()<R, NV>(m0, n0) for the tile at (m0, n0) with
// r == R rows.
template <int R, int NV, class Micro>
inline void RegisterTileRows(int r, int64_t m0, int64_t n0, Micro& micro) {
  if constexpr (R > 0) {
    if (r == R) return micro.template operator()<R, NV>(m0, n0);
    RegisterTileRows<R - 1, NV>(r, m0, n0, micro);
  }
}

template <int kMR, int NV, class Micro>
inline void RegisterTileStrip(int64_t M, int64_t n0, Micro& micro) {
  for (int64_t m0 = 0; m0 < M; m0 += kMR)
    RegisterTileRows<kMR, NV>(int(std::min<int64_t>(kMR, M - m0)), m0, n0, micro);
}

// micro.template operator()<R, NV>(m0, n0) for each register tile: strips
// of NV = kNV vectors of `lanes` columns (the last strips narrower when N
// is not a multiple), R = kMR rows at a time (fewer in the last).
template <int kMR, int kNV, class Micro>
inline void ForRegisterTiles(int64_t M, int64_t N, int64_t lanes, Micro&& micro) {
  int64_t n0 = 0;
  for (; N - n0 >= kNV * lanes; n0 += kNV * lanes) RegisterTileStrip<kMR, kNV>(M, n0, micro);
  if constexpr (kNV > 2)
    for (; N - n0 >= 2 * lanes; n0 += 2 * lanes) RegisterTileStrip<kMR, 2>(M, n0, micro);
  for (; n0 < N; n0 += lanes) RegisterTileStrip<kMR, 1>(M, n0, micro);
}

}  // namespace attn::detail
