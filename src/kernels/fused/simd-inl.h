// The SIMD building blocks of the fused kernels, written once with Highway
// and compiled for every target fused.cpp lists (this header is included once
// per target, so it has no ordinary include guard).
//
// The block product C[M×N] (+)= A·B is one register-blocked micro-kernel: a
// column strip of B two vectors wide is loaded per k, MR rows of A are
// broadcast against it, and the MR×2 vector accumulators stay in registers
// (MR = 12 with 32 vector registers, 6 with 16). A is read through (row, k)
// strides, so the one kernel serves Q·Kᵀ, P·V and the transposed products of
// the backward without copies. Around it the row and column-group passes
// (max, exponentiate-and-sum) over tiles; the vector math they use (the
// softmax's exponentials, tanh) is kernels/vec-inl.h, shared with the decode
// kernel.
#if defined(ATTN_KERNELS_FUSED_SIMD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_FUSED_SIMD_INL_H_
#undef ATTN_KERNELS_FUSED_SIMD_INL_H_
#else
#define ATTN_KERNELS_FUSED_SIMD_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>

#include "kernels/fused/common.hpp"
#include "kernels/fused/online_softmax.hpp"
#include "kernels/vec-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

// Rows of the micro-kernel: two vectors per row, MR rows, all in registers.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kMR = 12;
#else
constexpr int kMR = 6;
#endif
constexpr int kNV = 2;
static_assert(kRowMultiple % kMR == 0, "the plan's k_block must be a whole number of micro-kernel rows");


// A register tile's accumulators: C[R × NV·lanes] (accumulate) or zero.
template <int R, int NV>
HWY_INLINE void StartTile(VF (&acc)[R][NV], const float* HWY_RESTRICT C, int64_t ldc, bool accumulate) {
  const DF d;
  const size_t N = hn::Lanes(d);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? hn::LoadU(d, C + r * ldc + int64_t(v * N)) : hn::Zero(d);
}

// C[MR × NV·lanes] (+)= A[MR × K] · B[K × NV·lanes]; A(r, k) = A[r·ars + k·aks].
template <int MR, int NV>
HWY_INLINE void MicroKernel(int64_t K, const float* HWY_RESTRICT A, int64_t ars, int64_t aks,
                            const float* HWY_RESTRICT B, int64_t ldb, float* HWY_RESTRICT C,
                            int64_t ldc, bool accumulate) {
  const DF d;
  const size_t N = hn::Lanes(d);
  VF acc[MR][NV];
  StartTile(acc, C, ldc, accumulate);
  // Row r of A is read at a[r / 4][off[r % 4]]: one pointer per four rows,
  // moved by aks per k, and three offsets. Twelve row pointers (or twelve
  // offsets r·ars) would not fit in x86's 16 general registers beside the
  // loop's own, and the spills cost a third of the AVX-512 kernel's time.
  constexpr int kGroups = (MR + 3) / 4;
  const float* a[kGroups];
#pragma GCC unroll 4
  for (int q = 0; q < kGroups; ++q) a[q] = A + 4 * q * ars;
  const int64_t off[4] = {0, ars, 2 * ars, 3 * ars};
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = B + k * ldb;
    VF bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = hn::LoadU(d, bk + v * N);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const VF av = hn::Set(d, a[r / 4][off[r % 4]]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(av, bv[v], acc[r][v]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < kGroups; ++q) a[q] += aks;
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) hn::StoreU(acc[r][v], d, C + r * ldc + int64_t(v * N));
}

template <int NV, int MR>
HWY_INLINE void MicroRows(int m, int64_t K, const float* A, int64_t ars, int64_t aks,
                          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if constexpr (MR > 0) {
    if (m == MR) return MicroKernel<MR, NV>(K, A, ars, aks, B, ldb, C, ldc, accumulate);
    MicroRows<NV, MR - 1>(m, K, A, ars, aks, B, ldb, C, ldc, accumulate);
  }
}

// C[M × N] (+)= A·B with A(r, k) = A[r·ars + k·aks], B row-major [K × N]
// (ldb), C row-major (ldc). N, ldb and ldc are multiples of the lane count.
void Gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks,
          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  const int64_t lanes = int64_t(hn::Lanes(DF()));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // With 32 registers, a width of whole three-vector strips (48 or 96
  // queries of a forward score tile) runs 8 rows × 3 vectors, rather than
  // two-vector strips and a one-vector strip that is bound by its loads.
  // Each element's sum over k keeps its order: the same result bit for bit.
  if (N % (3 * lanes) == 0) {
    for (int64_t n0 = 0; n0 < N; n0 += 3 * lanes)
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        MicroRows<3, 8>(int(std::min<int64_t>(8, M - m0)), K, A + m0 * ars, ars, aks, B + n0, ldb,
                        C + m0 * ldc + n0, ldc, accumulate);
    return;
  }
#endif
  for (int64_t n0 = 0; n0 < N; n0 += kNV * lanes) {
    const bool two = N - n0 >= kNV * lanes;
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int m = int(std::min<int64_t>(kMR, M - m0));
      if (two)
        MicroRows<kNV, kMR>(m, K, A + m0 * ars, ars, aks, B + n0, ldb, C + m0 * ldc + n0, ldc,
                            accumulate);
      else
        MicroRows<1, kMR>(m, K, A + m0 * ars, ars, aks, B + n0, ldb, C + m0 * ldc + n0, ldc,
                          accumulate);
    }
  }
}

// f over n floats (the tail through a zero-padded vector), for the tests.
template <VF (*F)(DF, VF)>
void ApplyArray(const float* x, float* y, int64_t n) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(F(d, hn::LoadU(d, x + i)), d, y + i);
  if (i < n) {
    HWY_ALIGN float buf[64] = {};  // >= the lane count of any target
    std::copy(x + i, x + n, buf);
    hn::Store(F(d, hn::Load(d, buf)), d, buf);
    std::copy(buf, buf + (n - i), y + i);
  }
}
void ExpArray(const float* x, float* y, int64_t n) { ApplyArray<ExpSoftmax>(x, y, n); }
void Exp2Array(const float* x, float* y, int64_t n) { ApplyArray<Exp2Softmax>(x, y, n); }
void TanhArray(const float* x, float* y, int64_t n) { ApplyArray<Tanh>(x, y, n); }

// Row of s becomes exp(s − lse) (0 everywhere for a fully masked row); with
// unit = log2(e) the row holds s·log2(e) and becomes 2^(s·log2(e) −
// lse·log2(e)), the same probabilities by the cheaper Exp2Softmax. With
// scale != 1 the row holds the products before their scale (the products
// deferred it to this pass): each is multiplied by it first, the same bits
// as a scaled row. A
// poisoned row (NaN lse, or a non-finite dY or query) becomes NaN at every
// visible score and 0 at the masked ones (−∞), so the NaN reaches exactly the
// gradients the row touches.
void ProbRow(float* row, int64_t nkp, float lse, bool poisoned, float unit, float scale) {
  if (poisoned) {
    for (int64_t j = 0; j < nkp; ++j) row[j] = row[j] == kNegInf ? 0.0f : kNaN;
    return;
  }
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const VF shift = hn::Set(d, os::lse_shift(lse) * unit), a = hn::Set(d, scale);
  const auto run = [&](auto exp) {
    for (int64_t j = 0; j < nkp; j += N) {
      const VF s = scale != 1.0f ? MulRounded(hn::Load(d, row + j), a) : hn::Load(d, row + j);
      hn::Store(exp(d, hn::Sub(s, shift)), d, row + j);
    }
  };
  if (unit != 1.0f) run([](DF df, VF x) { return Exp2Softmax(df, x); });
  else run([](DF df, VF x) { return ExpSoftmax(df, x); });
}

// Column maxima of C vector-wide column groups of a transposed tile, walking
// the tile row by row (whole cache lines, C running maxima in registers).
template <int C>
HWY_INLINE void TileMaxChunk(const float* st, int64_t ld, int64_t nk, float* tmax) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  VF m[C];
  for (int g = 0; g < C; ++g) m[g] = hn::Set(d, kNegInf);
  for (int64_t jj = 0; jj < nk; ++jj) {
    const float* row = st + jj * ld;
    for (int g = 0; g < C; ++g) m[g] = hn::Max(m[g], hn::Load(d, row + g * N));
  }
  for (int g = 0; g < C; ++g) hn::Store(m[g], d, tmax + g * N);
}

// TileMaxChunk's maxima of the tile's elements times a (a score scale the
// products deferred: the maxima of the scaled scores, st left as it is).
template <int C>
HWY_INLINE void TileScaledMaxChunk(const float* st, int64_t ld, int64_t nk, float a, float* tmax) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const VF av = hn::Set(d, a);
  VF m[C];
  for (int g = 0; g < C; ++g) m[g] = hn::Set(d, kNegInf);
  for (int64_t jj = 0; jj < nk; ++jj) {
    const float* row = st + jj * ld;
    for (int g = 0; g < C; ++g) m[g] = hn::Max(m[g], hn::Mul(hn::Load(d, row + g * N), av));
  }
  for (int g = 0; g < C; ++g) hn::Store(m[g], d, tmax + g * N);
}

// p = 2^(s − shift) in place over C column groups, row by row, with the
// column sums in registers (each column summed in key order, as before).
template <int C>
HWY_INLINE void TileExpChunk(float* st, int64_t ld, int64_t nk, const float* shift, float* tsum) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  VF sh[C], sum[C];
  for (int g = 0; g < C; ++g) sh[g] = hn::Load(d, shift + g * N), sum[g] = hn::Zero(d);
  for (int64_t jj = 0; jj < nk; ++jj) {
    float* row = st + jj * ld;
    for (int g = 0; g < C; ++g) {
      const VF pj = Exp2Softmax(d, hn::Sub(hn::Load(d, row + g * N), sh[g]));  // 0 if masked
      hn::Store(pj, d, row + g * N);
      sum[g] = hn::Add(sum[g], pj);
    }
  }
  for (int g = 0; g < C; ++g) hn::Store(sum[g], d, tsum + g * N);
}

// Runs Chunk<C> over the column groups of a tile, C = 4 while enough remain.
template <template <int> class Op, class... Args>
HWY_INLINE void ForColumnGroups(int64_t groups, int64_t N, Args... args) {
  for (int64_t g = 0; g < groups;) {
    const int64_t left = groups - g;
    if (left >= 4) Op<4>::run(g * N, args...), g += 4;
    else if (left == 3) Op<3>::run(g * N, args...), g += 3;
    else if (left == 2) Op<2>::run(g * N, args...), g += 2;
    else Op<1>::run(g * N, args...), g += 1;
  }
}
template <int C>
struct MaxOp {
  static void run(int64_t r, const float* st, int64_t ld, int64_t nk, float* tmax) {
    TileMaxChunk<C>(st + r, ld, nk, tmax + r);
  }
};
template <int C>
struct ScaledMaxOp {
  static void run(int64_t r, const float* st, int64_t ld, int64_t nk, float a, float* tmax) {
    TileScaledMaxChunk<C>(st + r, ld, nk, a, tmax + r);
  }
};
template <int C>
struct ExpOp {
  static void run(int64_t r, float* st, int64_t ld, int64_t nk, const float* shift, float* tsum) {
    TileExpChunk<C>(st + r, ld, nk, shift + r, tsum + r);
  }
};


}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_FUSED_SIMD_INL_H_
