// The SIMD building blocks of the fused kernels, written once with Highway
// and compiled for every target fused.cpp lists (this header is included once
// per target, so it has no ordinary include guard).
//
// The block product C[M×N] (+)= A·B is one register-blocked micro-kernel: a
// column strip of B two vectors wide is loaded per k, MR rows of A are
// broadcast against it, and the MR×2 vector accumulators stay in registers
// (MR = 12 with 32 vector registers, 6 with 16). A is read through (row, k)
// strides, so the one kernel serves Q·Kᵀ, P·V and the transposed products of
// the backward without copies. Around it: the two exponentials of the
// softmax (natural for the backward, base 2 for the forward), cheaper than a
// general exp because their arguments are known to be <= 0 or −∞, and the
// row and column-group passes (scale, max, exponentiate-and-sum) over tiles.
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

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
namespace os = online_softmax;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Rows of the micro-kernel: two vectors per row, MR rows, all in registers.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kMR = 12;
#else
constexpr int kMR = 6;
#endif
constexpr int kNV = 2;
static_assert(kRowMultiple % kMR == 0, "the plan's k_block must be a whole number of micro-kernel rows");

inline int64_t Lanes() { return int64_t(hn::Lanes(DF())); }

// C[MR × NV·lanes] (+)= A[MR × K] · B[K × NV·lanes]; A(r, k) = A[r·ars + k·aks].
template <int MR, int NV>
HWY_INLINE void MicroKernel(int64_t K, const float* HWY_RESTRICT A, int64_t ars, int64_t aks,
                            const float* HWY_RESTRICT B, int64_t ldb, float* HWY_RESTRICT C,
                            int64_t ldc, bool accumulate) {
  const DF d;
  const size_t N = hn::Lanes(d);
  VF acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? hn::LoadU(d, C + r * ldc + int64_t(v * N)) : hn::Zero(d);
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

// NaN through the exponentials (the one place this is target-specific). A
// NaN argument must give NaN (a poisoned score must reach the row's sum), so
// the clamp that keeps −∞ out of the integer path must keep NaN: x86's max
// returns its second operand when either is NaN, so max(lo, x) is NaN for a
// NaN x at no cost. Highway's portable Max ignores NaN (and converting NaN to
// an integer is undefined in C++), so other targets clamp with Max(x, lo)
// and put a NaN argument back at the end.
#if HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR
HWY_INLINE VF ClampBelow(DF d, VF x, float lo) { return hn::Max(hn::Set(d, lo), x); }
HWY_INLINE VF RestoreNaN(VF, VF y) { return y; }
#else
HWY_INLINE VF ClampBelow(DF d, VF x, float lo) { return hn::Max(x, hn::Set(d, lo)); }
HWY_INLINE VF RestoreNaN(VF x, VF y) { return hn::IfThenElse(hn::IsNaN(x), x, y); }
#endif

// c[0]·x^(N−1) + c[1]·x^(N−2) + … + c[N−1] by Horner's rule.
template <size_t N>
HWY_INLINE VF Horner(DF d, VF x, const float (&c)[N]) {
  VF p = hn::Set(d, c[0]);
#pragma GCC unroll 8
  for (size_t i = 1; i < N; ++i) p = hn::MulAdd(p, x, hn::Set(d, c[i]));
  return p;
}

// exp for the softmax, where arguments are s − max <= 0 (or −∞), or s − lse
// a rounding error above 0: valid for x <= 88, within a few ulp of exp on
// [−87.3, 88], and exactly 0 below −87.33 (where exp(x) would be smaller
// than the smallest normal float) and for −∞. Cephes's range reduction
// x = n·ln2 + r, |r| <= ln2/2, and its degree-7 polynomial for exp(r); about
// 18 vector operations against ~25 for Highway's general Exp.
HWY_INLINE VF ExpSoftmax(DF d, VF x) {
  const hn::RebindToSigned<DF> di;
  const VF xc = ClampBelow(d, x, -88.0f);  // keeps −∞ out of the integer path
  const VF n = hn::Round(hn::Mul(xc, hn::Set(d, 1.44269504088896341f)));
  VF r = hn::NegMulAdd(n, hn::Set(d, 0.693359375f), xc);  // r = x − n·ln2, ln2 in two parts
  r = hn::NegMulAdd(n, hn::Set(d, -2.12194440e-4f), r);
  constexpr float kPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                             4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  const VF p = Horner(d, r, kPoly);
  const VF y = hn::MulAdd(p, hn::Mul(r, r), hn::Add(r, hn::Set(d, 1.0f)));  // exp(r)
  const auto e = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));  // 2^n
  return RestoreNaN(x, hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, -87.33f)), hn::Mul(y, hn::BitCast(d, e))));
}

// 2^x for the forward's softmax, whose scores are in base 2 (log2(e) is
// folded into the query scale), so x = s − shift needs no multiply before the
// split x = n + f, n an integer and |f| <= 1/2 (exact in float). 2^f is a
// degree-6 polynomial fitted for relative error (about 2e-9, so float
// rounding dominates: within 2 ulp); 2^n goes into the exponent bits. Valid
// for x <= 127. Below −126.5, including −∞, n is clamped to −127, whose
// exponent bits are all zero, so the result is exactly 0 with no compare or
// select; in [−126.5, −126) the result is a subnormal near 2^x.
HWY_INLINE VF Exp2Softmax(DF d, VF x) {
  const hn::RebindToSigned<DF> di;
  const VF xc = ClampBelow(d, x, -127.0f);  // keeps −∞ out of the integer path
  const VF n = hn::Round(xc);
  const VF f = hn::Sub(xc, n);
  constexpr float kPoly[] = {1.534579205326736e-4f,  1.3399929739534855e-3f, 9.618489071726799e-3f,
                             5.550328642129898e-2f,  2.4022646248340607e-1f, 6.931471824645996e-1f,
                             1.0f};
  const VF p = Horner(d, f, kPoly);
  const auto e = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));  // 2^n, 0 for n = −127
  return RestoreNaN(x, hn::Mul(p, hn::BitCast(d, e)));
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
// tanh for the soft-cap, for every float. A vector whose lanes are all near
// 0 (|x| < 0.625: the common case of soft-capped scores, |s| well below the
// cap) takes an odd polynomial x + x³·P(x²) (Cephes's tanhf coefficients).
// Any other vector takes, in every lane, tanh|x| = −m/(2 + m) with
// m = expm1(−2|x|) ∈ (−1, 0], which neither cancels near 0 (m is computed
// to full relative precision) nor loses anything near 1: with y = −2|x|
// log2(e) = n + f, n an integer and |f| <= 1/2 (exact in float),
// m = (2^f − 1)·2^n + (2^n − 1), where 2^f − 1 = f·R(f) is a degree-5
// polynomial fitted for relative error (about 1e-8) and 2^n goes into the
// exponent bits. For y below −127 (large |x|, ±∞), n is clamped to −127,
// whose exponent bits are all zero: m = −1 exactly, so ±∞ give ±1. One
// division (pipelined beside the rest on current x86 cores: at about twenty
// other operations per vector its throughput costs nothing) rather than a
// reciprocal estimate, which would leave 1/1 an ulp short. NaN stays NaN
// (the clamp keeps it, as in the exponentials). Within 3 ulp of tanh on
// every target (tests/test_fused.cpp measures it); about 22 vector
// operations per mixed vector against about 33 for the polynomial and the
// exponential form together.
HWY_INLINE VF Tanh(DF d, VF x) {
  const VF ax = hn::Abs(x);
  const VF z = hn::Mul(x, x);
  constexpr float kOdd[] = {-5.70498872745e-3f, 2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f,
                            -3.33332819422e-1f};
  const VF small = hn::MulAdd(hn::Mul(Horner(d, z, kOdd), z), x, x);
  if (hn::AllTrue(d, hn::Lt(ax, hn::Set(d, 0.625f)))) return small;  // (false for NaN)
  const hn::RebindToSigned<DF> di;
  const VF y = ClampBelow(d, hn::Mul(ax, hn::Set(d, -2.0f * 1.44269504088896341f)), -127.0f);
  const VF n = hn::Round(y);
  const VF f = hn::Sub(y, n);
  constexpr float kPoly[] = {1.5403510769829154e-4f, 1.3390735257416964e-3f, 9.618237614631653e-3f,
                             5.550357326865196e-2f, 2.4022649228572845e-1f, 6.931471824645996e-1f};
  const VF fr = hn::Mul(f, Horner(d, f, kPoly));  // 2^f − 1
  const VF pn = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127))));  // 2^n
  const VF one = hn::Set(d, 1.0f);
  const VF negm = hn::NegMulAdd(fr, pn, hn::Sub(one, pn));  // −m = 1 − 2^y >= 0
  const VF t = hn::Div(negm, hn::Sub(hn::Set(d, 2.0f), negm));  // tanh|x|
  return RestoreNaN(x, hn::CopySignToAbs(t, x));
}

void ExpArray(const float* x, float* y, int64_t n) { ApplyArray<ExpSoftmax>(x, y, n); }
void Exp2Array(const float* x, float* y, int64_t n) { ApplyArray<Exp2Softmax>(x, y, n); }
void TanhArray(const float* x, float* y, int64_t n) { ApplyArray<Tanh>(x, y, n); }

// ALiBi along a tile line of n floats (n a multiple of the lane count):
// x[t] −= slope·|base + t|, where base + t is the signed distance between
// the query's position and the key (exact in float below 2^24).
void AlibiLine(float* x, int64_t n, float base, float slope) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const VF vs = hn::Set(d, slope);
  VF dist = hn::Iota(d, base);
  const VF step = hn::Set(d, float(N));
  for (int64_t t = 0; t < n; t += N, dist = hn::Add(dist, step))
    hn::Store(hn::NegMulAdd(vs, hn::Abs(dist), hn::Load(d, x + t)), d, x + t);
}

// Soft-cap of a tile of n floats (n a multiple of the lane count), in place:
// x <- c·tanh(x / c), and with dcap non-null dcap <- 1 − tanh² (the
// derivative the backward needs).
void SoftcapTile(float* x, int64_t n, float c, float* dcap) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const VF vc = hn::Set(d, c), inv = hn::Set(d, 1.0f / c), one = hn::Set(d, 1.0f);
  for (int64_t i = 0; i < n; i += N) {
    const VF t = Tanh(d, hn::Mul(hn::Load(d, x + i), inv));
    hn::Store(hn::Mul(vc, t), d, x + i);
    if (dcap) hn::Store(hn::NegMulAdd(t, t, one), d, dcap + i);
  }
}

// Row of s becomes exp(s − lse) (0 everywhere for a fully masked row). A
// poisoned row (NaN lse, or a non-finite dY or query) becomes NaN at every
// visible score and 0 at the masked ones (−∞), so the NaN reaches exactly the
// gradients the row touches.
void ProbRow(float* row, int64_t nkp, float lse, bool poisoned) {
  if (poisoned) {
    for (int64_t j = 0; j < nkp; ++j) row[j] = row[j] == kNegInf ? 0.0f : kNaN;
    return;
  }
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const VF shift = hn::Set(d, os::lse_shift(lse));
  for (int64_t j = 0; j < nkp; j += N)
    hn::Store(ExpSoftmax(d, hn::Sub(hn::Load(d, row + j), shift)), d, row + j);
}

void ScaleRow(float* row, int64_t n, float f) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const VF vf = hn::Set(d, f);
  for (int64_t j = 0; j < n; j += N) hn::Store(hn::Mul(hn::Load(d, row + j), vf), d, row + j);
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
