// The fused backend: tiled scaled dot-product attention with an online
// softmax (FlashAttention's algorithm) on the CPU, float32.
//
// Forward. Work is split into units (batch b, head h, block of q_block query
// rows). A unit copies its queries (pre-multiplied by the scale) into scratch,
// then streams the keys in blocks of k_block: it packs the key block
// transposed (E × k_block) and the value block (k_block × Ev), computes the
// score tile S = Q·Kᵀ with a register-blocked micro-kernel, applies the masks,
// folds the tile into each row's running max and sum (online_softmax.hpp),
// rescales the output accumulator and adds P·V. At the end each row is
// divided once by its sum; the log-sum-exp is the only extra state saved.
// Memory traffic per unit: Q and the output once, K and V once per query
// block (so K/V are re-read L / q_block times from cache or memory); the
// L×S matrices never exist. Causal units stop at the last key their last row
// can see, so fully masked tiles cost nothing. Attention weights, when asked
// for, are a second pass per unit: exp(S − lse), tile by tile.
//
// Backward. With P = exp(S − lse) recomputed per tile, D_i = Σ_e dY_ie·Y_ie:
//   dV = Pᵀ·dY,  dP = dY·Vᵀ,  dS = P∘(dP − D),  dQ = scale·dS·K,
//   dK = scale·dSᵀ·Q,  dbias = dS summed over the bias's broadcast axes.
// No atomics: when there are enough (b, kv-head) pairs, a unit owns one pair
// and walks its key blocks in order, accumulating dK/dV for the block in
// scratch and dQ directly in the (zeroed) output, which no other unit
// touches. Otherwise two passes: units over key blocks write dK/dV, then
// units over query blocks recompute the tiles and write dQ. dbias, when
// requested, is a third pass whose units own tiles of dbias. The choice
// depends only on the shape, and every output element is summed in a fixed
// order, so the results are bitwise identical for any thread count.
//
// SIMD: written once with Highway and compiled for several targets
// (AVX-512, AVX2, SSE4, portable scalar), picked at run time. The products
// use one micro-kernel C[M×N] += A·B: a column strip of B (two vectors wide)
// stays in registers' reach while MR rows of A are broadcast, MR×2 vector
// accumulators live in registers (MR = 12 with 32 vector registers, 6 with 16).
// A is read through (row, k) strides, so the same kernel serves Q·Kᵀ, P·V and
// the transposed products of the backward.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused/fused.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attn/tensor.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/fused/online_softmax.hpp"

#ifndef ATTN_FUSED_COMMON_ONCE
#define ATTN_FUSED_COMMON_ONCE
namespace attn::detail::fused_common {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Everything the units of one call share (read-only).
struct Call {
  const Problem* p;
  const SdpaArgs<float>* a;
  FusedTiles t;
  float scale;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }

inline int64_t key_len(const Call& c, int64_t b) {
  return c.a->key_lengths.empty() ? c.p->S : c.a->key_lengths(b);
}
// One past the last key row i sees (causal rule and key length).
inline int64_t row_end(const Call& c, int64_t b, int64_t i) {
  return std::min(c.p->causal_end(i), key_len(c, b));
}
// The first query row that sees key j under the causal rule (L if none).
inline int64_t first_row_seeing(const Problem& p, int64_t j) {
  if (!p.causal) return 0;
  const int64_t off = p.align == CausalAlign::top_left ? 0 : p.S - p.L;
  return std::clamp<int64_t>(j - off, 0, p.L);
}

}  // namespace attn::detail::fused_common
#endif

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
namespace os = online_softmax;
using namespace fused_common;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Rows of the micro-kernel: two vectors per row, MR rows, all in registers.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kMR = 12;
#else
constexpr int kMR = 6;
#endif
constexpr int kNV = 2;

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
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = B + k * ldb;
    VF bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = hn::LoadU(d, bk + v * N);
    const float* ak = A + k * aks;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const VF av = hn::Set(d, ak[r * ars]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(av, bv[v], acc[r][v]);
    }
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

// exp for the softmax, where arguments are s − max <= 0 (or −∞), or s − lse
// a rounding error above 0: valid for x <= 88, within a few ulp of exp on
// [−87.3, 88], and exactly 0 below −87.33 (where exp(x) would be smaller
// than the smallest normal float) and for −∞. Cephes's range reduction
// x = n·ln2 + r, |r| <= ln2/2, and its degree-7 polynomial for exp(r); about
// 18 vector operations against ~25 for Highway's general Exp.
HWY_INLINE VF ExpSoftmax(DF d, VF x) {
  const hn::RebindToSigned<DF> di;
  const VF xc = hn::Max(x, hn::Set(d, -88.0f));  // keeps −∞ out of the integer path
  const VF n = hn::Round(hn::Mul(xc, hn::Set(d, 1.44269504088896341f)));
  VF r = hn::NegMulAdd(n, hn::Set(d, 0.693359375f), xc);  // r = x − n·ln2, ln2 in two parts
  r = hn::NegMulAdd(n, hn::Set(d, -2.12194440e-4f), r);
  VF p = hn::Set(d, 1.9875691500e-4f);
  p = hn::MulAdd(p, r, hn::Set(d, 1.3981999507e-3f));
  p = hn::MulAdd(p, r, hn::Set(d, 8.3334519073e-3f));
  p = hn::MulAdd(p, r, hn::Set(d, 4.1665795894e-2f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.6666665459e-1f));
  p = hn::MulAdd(p, r, hn::Set(d, 5.0000001201e-1f));
  const VF y = hn::MulAdd(p, hn::Mul(r, r), hn::Add(r, hn::Set(d, 1.0f)));  // exp(r)
  const auto e = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));  // 2^n
  return hn::IfThenElseZero(hn::Ge(x, hn::Set(d, -87.33f)), hn::Mul(y, hn::BitCast(d, e)));
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
  const VF xc = hn::Max(x, hn::Set(d, -127.0f));  // keeps −∞ out of the integer path
  const VF n = hn::Round(xc);
  const VF f = hn::Sub(xc, n);
  VF p = hn::Set(d, 1.534579205326736e-4f);
  p = hn::MulAdd(p, f, hn::Set(d, 1.3399929739534855e-3f));
  p = hn::MulAdd(p, f, hn::Set(d, 9.618489071726799e-3f));
  p = hn::MulAdd(p, f, hn::Set(d, 5.550328642129898e-2f));
  p = hn::MulAdd(p, f, hn::Set(d, 2.4022646248340607e-1f));
  p = hn::MulAdd(p, f, hn::Set(d, 6.931471824645996e-1f));
  p = hn::MulAdd(p, f, hn::Set(d, 1.0f));
  const auto e = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));  // 2^n, 0 for n = −127
  return hn::Mul(p, hn::BitCast(d, e));
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

// Per-thread scratch, allocated once per call per thread. Widths are padded
// to the lane count with zeros (padding is never read as data, but stays
// finite so 0·pad is 0):
//   q  [qb × Ep]   queries × scale        kt [E  × kbp]  keys, transposed
//   dy [qb × Evp]  dY (backward)          vt [Ev × kbp]  values, transposed (bwd)
//   o  [qb × Evp]  output accumulator     kb [kb × Ep]   keys (bwd, for dQ)
//   s  [qb × kbp]  scores → probabilities vb [kb × Evp]  values
//   dp [qb × kbp]  dP → dS (bwd)          dk [kb × Ep], dv [kb × Evp] (bwd)
//   dq [qb × Ep]   dQ tile (bwd)          acc: dbias tile (bwd)
// The forward works on transposed scores (keys × queries), so the queries
// are packed transposed once per unit and the keys are read in place:
//   qt [E × qbp]   queries × scale, transposed
//   st_t [kb × qbp] scores → probabilities, transposed
//   colv [4 × qbp] per-query tile max, shift, rescale factor, tile sum
struct Scratch {
  int64_t qb, kb, kbp, Ep, Evp, qbp = 0;
  hwy::AlignedFreeUniquePtr<float[]> q, kt, vb, s, o, dy, vt, kb_rows, dp, dk, dv, dq, acc;
  hwy::AlignedFreeUniquePtr<float[]> qt, st_t, colv;
  std::vector<os::State<float>> st;
  std::vector<float> lse, D;

  static hwy::AlignedFreeUniquePtr<float[]> alloc(int64_t n) {
    auto ptr = hwy::AllocateAligned<float>(size_t(std::max<int64_t>(n, 1)));
    std::fill(ptr.get(), ptr.get() + std::max<int64_t>(n, 1), 0.0f);
    return ptr;
  }

  Scratch(const Problem& p, FusedTiles t, bool backward) {
    const int64_t lanes = int64_t(hn::Lanes(DF()));
    qb = t.q_block;
    kb = t.k_block;
    kbp = round_up(kb, lanes);
    Ep = round_up(p.E, lanes);
    Evp = round_up(p.Ev, lanes);
    st.resize(size_t(qb));
    lse.resize(size_t(qb));
    if (!backward) {
      qbp = round_up(qb, lanes);
      qt = alloc(p.E * qbp);
      st_t = alloc(kb * qbp);
      vb = alloc(kb * Evp);
      o = alloc(qb * Evp);
      colv = alloc(4 * qbp);
    } else {
      q = alloc(qb * Ep);
      kt = alloc(p.E * kbp);
      s = alloc(qb * kbp);
      dy = alloc(qb * Evp);
      vt = alloc(p.Ev * kbp);
      kb_rows = alloc(kb * Ep);
      dp = alloc(qb * kbp);
      dk = alloc(kb * Ep);
      dv = alloc(kb * Evp);
      dq = alloc(qb * Ep);
      acc = alloc(qb * kbp);
      D.resize(size_t(qb));
    }
  }
};

// ---- packing (strided views → dense scratch) -------------------------------

// q[r][e] = scale · Q(b, h, i0 + r, e) for r < nr.
void PackQ(const Call& c, Scratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr) {
  const auto& Q = c.a->q;
  const int64_t E = c.p->E;
  for (int64_t r = 0; r < nr; ++r) {
    const float* src = &Q(b, h, i0 + r, 0);
    float* dst = w.q.get() + r * w.Ep;
    const int64_t se = Q.strides[3];
    for (int64_t e = 0; e < E; ++e) dst[e] = c.scale * src[e * se];
  }
}

// Transposed copy of nk rows of a (B, Hx, N, F) view: dst[f][jj] =
// X(b, hx, j0 + jj, f), row length ld; columns nk..ld are zero.
void PackTransposed(const View4<const float>& X, int64_t b, int64_t hx, int64_t j0, int64_t nk,
                    float* dst, int64_t ld) {
  const int64_t F = X.dim(3), sf = X.strides[3];
  for (int64_t jj = 0; jj < nk; ++jj) {
    const float* src = &X(b, hx, j0 + jj, 0);
    for (int64_t f = 0; f < F; ++f) dst[f * ld + jj] = src[f * sf];
  }
  for (int64_t f = 0; f < F; ++f) std::fill(dst + f * ld + nk, dst + (f + 1) * ld, 0.0f);
}

// kt[e][jj] = K(b, hk, j0 + jj, e); columns nk..kbp are zero.
void PackKt(const Call& c, Scratch& w, int64_t b, int64_t hk, int64_t j0, int64_t nk) {
  PackTransposed(c.a->k, b, hk, j0, nk, w.kt.get(), w.kbp);
}

// Row-major copy of nk rows of a (B, Hx, N, F) view into dst [nk × ld].
void PackRows(const View4<const float>& X, int64_t b, int64_t hx, int64_t j0, int64_t nk,
              float* dst, int64_t ld) {
  const int64_t F = X.dim(3), sf = X.strides[3];
  for (int64_t jj = 0; jj < nk; ++jj) {
    const float* src = &X(b, hx, j0 + jj, 0);
    float* row = dst + jj * ld;
    if (sf == 1)
      std::memcpy(row, src, size_t(F) * sizeof(float));
    else
      for (int64_t f = 0; f < F; ++f) row[f] = src[f * sf];
  }
}

// vt[e][jj] = V(b, hk, j0 + jj, e); columns nk..kbp zero.
void PackVt(const Call& c, Scratch& w, int64_t b, int64_t hk, int64_t j0, int64_t nk) {
  PackTransposed(c.a->v, b, hk, j0, nk, w.vt.get(), w.kbp);
}

// ---- score tile ------------------------------------------------------------

// s[r][jj] = scale·q·k + bias for the visible keys of rows i0..i0+nr against
// keys j0..j0+nk; −∞ for masked keys and for padding up to nkp. Needs q and
// kt packed.
void ScoreTile(const Call& c, Scratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr,
               int64_t j0, int64_t nk, int64_t nkp) {
  Gemm(nr, nkp, c.p->E, w.q.get(), w.Ep, 1, w.kt.get(), w.kbp, w.s.get(), w.kbp, false);
  const auto& bias = c.a->bias;
  const auto& mask = c.a->mask;
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = i0 + r;
    float* row = w.s.get() + r * w.kbp;
    const int64_t vis = std::clamp<int64_t>(row_end(c, b, i) - j0, 0, nk);
    if (!bias.empty()) {
      const float* br = bias.data + bcast(b, bias.dim(0)) * bias.strides[0] +
                        bcast(h, bias.dim(1)) * bias.strides[1] + bcast(i, bias.dim(2)) * bias.strides[2];
      const int64_t sj = bias.dim(3) == 1 ? 0 : bias.strides[3];
      for (int64_t jj = 0; jj < vis; ++jj) row[jj] += br[(j0 + jj) * sj];
    }
    if (!mask.empty()) {
      const bool* mr = mask.data + bcast(b, mask.dim(0)) * mask.strides[0] +
                       bcast(h, mask.dim(1)) * mask.strides[1] + bcast(i, mask.dim(2)) * mask.strides[2];
      const int64_t sj = mask.dim(3) == 1 ? 0 : mask.strides[3];
      for (int64_t jj = 0; jj < vis; ++jj)
        if (!mr[(j0 + jj) * sj]) row[jj] = kNegInf;
    }
    std::fill(row + vis, row + nkp, kNegInf);
  }
}

// Row of s becomes exp(s − lse) (0 everywhere for a fully masked row).
void ProbRow(float* row, int64_t nkp, float lse) {
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

// ---- forward ---------------------------------------------------------------

// The forward measures scores in base 2: s·log2(e), so exp(s − m) = 2^(s2 − m2).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

// qt[e][r] = scale·log2(e) · Q(b, h, i0 + r, e); columns nr..qbp are zero.
void PackQt(const Call& c, Scratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr) {
  const auto& Q = c.a->q;
  const int64_t E = c.p->E, se = Q.strides[3];
  const float s2 = c.scale * kLog2e;
  float* qt = w.qt.get();
  for (int64_t r = 0; r < nr; ++r) {
    const float* src = &Q(b, h, i0 + r, 0);
    for (int64_t e = 0; e < E; ++e) qt[e * w.qbp + r] = s2 * src[e * se];
  }
  for (int64_t e = 0; e < E; ++e) std::fill(qt + e * w.qbp + nr, qt + (e + 1) * w.qbp, 0.0f);
}

// Transposed score tile, in base 2: st_t[jj][r] = (scale·q_r·k_j + bias)·log2(e) for keys
// j0..j0+nk against the unit's queries i0..i0+nr; −∞ where masked and in the
// padding columns up to nrp. K is read in place.
void ScoreTileT(const Call& c, Scratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t nrp,
                int64_t j0, int64_t nk) {
  const Problem& p = *c.p;
  const auto& K = c.a->k;
  const int64_t hk = p.kv_head(h);
  Gemm(nk, nrp, p.E, &K(b, hk, j0, 0), K.strides[2], K.strides[3], w.qt.get(), w.qbp, w.st_t.get(), w.qbp,
       false);
  const auto& bias = c.a->bias;
  const auto& mask = c.a->mask;
  for (int64_t jj = 0; jj < nk; ++jj) {
    const int64_t j = j0 + jj;
    float* row = w.st_t.get() + jj * w.qbp;
    // Query i sees key j iff i >= first_row_seeing(j) (and j < key length,
    // which the caller's key range already ensures).
    const int64_t first = std::clamp<int64_t>(first_row_seeing(p, j) - i0, 0, nr);
    std::fill(row, row + first, kNegInf);
    if (!bias.empty()) {
      const float* bj = bias.data + bcast(b, bias.dim(0)) * bias.strides[0] +
                        bcast(h, bias.dim(1)) * bias.strides[1] + bcast(j, bias.dim(3)) * bias.strides[3];
      const int64_t si = bias.dim(2) == 1 ? 0 : bias.strides[2];
      for (int64_t r = first; r < nr; ++r) row[r] += kLog2e * bj[(i0 + r) * si];
    }
    if (!mask.empty()) {
      const bool* mj = mask.data + bcast(b, mask.dim(0)) * mask.strides[0] +
                       bcast(h, mask.dim(1)) * mask.strides[1] + bcast(j, mask.dim(3)) * mask.strides[3];
      const int64_t si = mask.dim(2) == 1 ? 0 : mask.strides[2];
      for (int64_t r = first; r < nr; ++r)
        if (!mj[(i0 + r) * si]) row[r] = kNegInf;
    }
    std::fill(row + nr, row + nrp, kNegInf);
  }
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

// Folds a transposed tile into the per-query online softmax: st_t becomes
// 2^(s − shift) and colv[2·qbp ..] holds each query's rescale factor.
void SoftmaxTileT(Scratch& w, int64_t nr, int64_t nrp, int64_t nk) {
  const int64_t N = int64_t(hn::Lanes(DF()));
  float* tmax = w.colv.get();
  float* shift = tmax + w.qbp;
  float* alpha = shift + w.qbp;
  float* tsum = alpha + w.qbp;
  float* st = w.st_t.get();
  ForColumnGroups<MaxOp>(nrp / N, N, static_cast<const float*>(st), w.qbp, nk, tmax);
  for (int64_t r = 0; r < nr; ++r) {
    const os::Step<float> step = os::begin_tile<os::Base2>(w.st[size_t(r)], tmax[r]);
    alpha[r] = step.alpha;
    shift[r] = step.shift;
  }
  std::fill(shift + nr, shift + nrp, 0.0f);
  ForColumnGroups<ExpOp>(nrp / N, N, st, w.qbp, nk, static_cast<const float*>(shift), tsum);
  for (int64_t r = 0; r < nr; ++r) os::end_tile(w.st[size_t(r)], tsum[r]);
}

void ForwardUnit(const Call& c, Scratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr,
                 View4<float> out, View4<float> weights, View3<float> lse) {
  const Problem& p = *c.p;
  const auto& V = c.a->v;
  const int64_t hk = p.kv_head(h), lanes = int64_t(hn::Lanes(DF()));
  const int64_t nrp = round_up(nr, lanes);
  const int64_t kend = row_end(c, b, i0 + nr - 1);  // no row of the block sees keys beyond
  // V is used in place when its rows are dense and a whole number of vectors.
  const bool v_in_place = V.strides[3] == 1 && p.Ev == w.Evp && V.strides[2] % lanes == 0;
  PackQt(c, w, b, h, i0, nr);
  std::fill(w.o.get(), w.o.get() + nr * w.Evp, 0.0f);
  for (int64_t r = 0; r < nr; ++r) w.st[size_t(r)] = os::State<float>{};

  for (int64_t j0 = 0; j0 < kend; j0 += w.kb) {
    const int64_t nk = std::min(w.kb, kend - j0);
    ScoreTileT(c, w, b, h, i0, nr, nrp, j0, nk);
    SoftmaxTileT(w, nr, nrp, nk);
    const float* alpha = w.colv.get() + 2 * w.qbp;
    for (int64_t r = 0; r < nr; ++r)
      if (alpha[r] != 1.0f) ScaleRow(w.o.get() + r * w.Evp, w.Evp, alpha[r]);  // acc <- acc · alpha
    const float* vb = w.vb.get();
    int64_t ldv = w.Evp;
    if (v_in_place) {
      vb = &V(b, hk, j0, 0);
      ldv = V.strides[2];
    } else {
      PackRows(V, b, hk, j0, nk, w.vb.get(), w.Evp);
    }
    // o += P·V, with P(r, jj) = st_t[jj][r]
    Gemm(nr, w.Evp, nk, w.st_t.get(), 1, w.qbp, vb, ldv, w.o.get(), w.Evp, true);
  }

  for (int64_t r = 0; r < nr; ++r) {
    const os::Final<float> f = os::finalize<os::Base2>(w.st[size_t(r)]);
    const float row_lse = f.lse * kLn2;  // back to natural units (−∞ stays −∞)
    const float* o = w.o.get() + r * w.Evp;
    float* dst = &out(b, h, i0 + r, 0);
    const int64_t se = out.strides[3];
    for (int64_t e = 0; e < p.Ev; ++e) dst[e * se] = o[e] * f.inv_sum;  // y = acc / sum
    w.lse[size_t(r)] = row_lse;
    if (!lse.empty()) lse(b, h, i0 + r) = row_lse;
  }

  if (weights.empty()) return;
  // Second pass: weights = exp(S − max) / sum, zero beyond the visible keys.
  // (The row's max and sum rather than its lse: max is one of the scores, so
  // S − max carries no rounding of a large lse.)
  const DF d;
  float* shift = w.colv.get() + w.qbp;
  float* inv = shift + w.qbp;
  for (int64_t r = 0; r < nrp; ++r) {
    const os::Final<float> f = r < nr ? os::finalize<os::Base2>(w.st[size_t(r)]) : os::Final<float>{0.0f, 0.0f};
    shift[r] = r < nr && f.inv_sum > 0 ? w.st[size_t(r)].max : 0.0f;
    inv[r] = f.inv_sum;
  }
  const int64_t sj = weights.strides[3];
  for (int64_t j0 = 0; j0 < p.S; j0 += w.kb) {
    const int64_t nk = std::min(w.kb, p.S - j0);
    if (j0 < kend) {
      const int64_t nkv = std::min(nk, kend - j0);
      ScoreTileT(c, w, b, h, i0, nr, nrp, j0, nkv);
      for (int64_t jj = 0; jj < nkv; ++jj)
        for (int64_t r = 0; r < nrp; r += lanes) {
          float* x = w.st_t.get() + jj * w.qbp + r;
          hn::Store(hn::Mul(Exp2Softmax(d, hn::Sub(hn::Load(d, x), hn::Load(d, shift + r))), hn::Load(d, inv + r)), d, x);
        }
      for (int64_t jj = nkv; jj < nk; ++jj) std::fill(w.st_t.get() + jj * w.qbp, w.st_t.get() + (jj + 1) * w.qbp, 0.0f);
    } else {
      std::fill(w.st_t.get(), w.st_t.get() + nk * w.qbp, 0.0f);
    }
    for (int64_t r = 0; r < nr; ++r) {
      float* dst = &weights(b, h, i0 + r, j0);
      const float* src = w.st_t.get() + r;
      for (int64_t jj = 0; jj < nk; ++jj) dst[jj * sj] = src[jj * w.qbp];
    }
  }
}

void ForwardImpl(const Problem& p, const SdpaArgs<float>& a, View4<float> out, View4<float> weights,
                 View3<float> lse, FusedTiles t) {
  const Call c{&p, &a, t, float(p.scale)};
  const int64_t nqb = ceil_div(p.L, t.q_block);
  const int64_t units = p.B * p.H * nqb;
#pragma omp parallel num_threads(p.threads)
  {
    Scratch w(p, t, /*backward=*/false);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t qbi = u % nqb, h = (u / nqb) % p.H, b = u / (nqb * p.H);
      const int64_t i0 = qbi * t.q_block, nr = std::min(t.q_block, p.L - i0);
      ForwardUnit(c, w, b, h, i0, nr, out, weights, lse);
    }
  }
}

// ---- backward --------------------------------------------------------------

// What one backward tile accumulates.
struct TileJobs {
  bool dkdv = false;  // dk/dv (scratch, k-block rows) += ...
  bool dq = false;    // dq scratch (q-block rows) += dS·K (unscaled)
};  // dS is always left in w.dp (the dbias pass reads it)

// Backward state of a query block: q (scaled), dY, lse and D for its rows.
void PackQueryBlock(const Call& c, Scratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr,
                    const View4<const float>& dout, const View4<const float>& out,
                    const View3<const float>& lse) {
  PackQ(c, w, b, h, i0, nr);
  PackRows(dout, b, h, i0, nr, w.dy.get(), w.Evp);
  const int64_t Ev = c.p->Ev, se = out.strides[3];
  for (int64_t r = 0; r < nr; ++r) {
    const float* y = &out(b, h, i0 + r, 0);
    const float* dy = w.dy.get() + r * w.Evp;
    float acc = 0;
    for (int64_t e = 0; e < Ev; ++e) acc += dy[e] * y[e * se];  // D_i = Σ_e dY_ie·Y_ie
    w.D[size_t(r)] = acc;
    w.lse[size_t(r)] = lse(b, h, i0 + r);
  }
}

// Key-side state of a key block: kt, vt (and kb_rows when dQ is wanted).
void PackKeyBlock(const Call& c, Scratch& w, int64_t b, int64_t hk, int64_t j0, int64_t nk,
                  bool rows) {
  PackKt(c, w, b, hk, j0, nk);
  PackVt(c, w, b, hk, j0, nk);
  if (rows) PackRows(c.a->k, b, hk, j0, nk, w.kb_rows.get(), w.Ep);
}

// One (query block × key block) tile of the backward; needs both blocks packed.
void BackwardTile(const Call& c, Scratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr,
                  int64_t j0, int64_t nk, TileJobs jobs) {
  const Problem& p = *c.p;
  const int64_t lanes = int64_t(hn::Lanes(DF())), nkp = round_up(nk, lanes);
  const DF d;
  ScoreTile(c, w, b, h, i0, nr, j0, nk, nkp);
  for (int64_t r = 0; r < nr; ++r) ProbRow(w.s.get() + r * w.kbp, nkp, w.lse[size_t(r)]);  // P
  // dP = dY·Vᵀ
  Gemm(nr, nkp, p.Ev, w.dy.get(), w.Evp, 1, w.vt.get(), w.kbp, w.dp.get(), w.kbp, false);
  for (int64_t r = 0; r < nr; ++r) {
    float* dpr = w.dp.get() + r * w.kbp;
    const float* pr = w.s.get() + r * w.kbp;
    const VF Dr = hn::Set(d, w.D[size_t(r)]);
    for (int64_t j = 0; j < nkp; j += int64_t(hn::Lanes(d)))  // dS = P∘(dP − D)
      hn::Store(hn::Mul(hn::Load(d, pr + j), hn::Sub(hn::Load(d, dpr + j), Dr)), d, dpr + j);
  }
  if (jobs.dkdv) {
    // dV += Pᵀ·dY ; dK += dSᵀ·(scale·Q)
    Gemm(nk, w.Evp, nr, w.s.get(), 1, w.kbp, w.dy.get(), w.Evp, w.dv.get(), w.Evp, true);
    Gemm(nk, w.Ep, nr, w.dp.get(), 1, w.kbp, w.q.get(), w.Ep, w.dk.get(), w.Ep, true);
  }
  if (jobs.dq)  // dQ += dS·K (the scale is applied when written out)
    Gemm(nr, w.Ep, nk, w.dp.get(), w.kbp, 1, w.kb_rows.get(), w.Ep, w.dq.get(), w.Ep, true);
}

// Range of query blocks that can see some key of [j0, j0 + nk) (causal).
int64_t FirstQueryBlock(const Call& c, int64_t j0) {
  return first_row_seeing(*c.p, j0) / c.t.q_block;
}

// Writes the dK/dV accumulators of a key block (zero where nothing reached).
void StoreKeyGrads(const Call& c, Scratch& w, const SdpaGrads<float>& g, int64_t b, int64_t hk,
                   int64_t j0, int64_t nk) {
  const Problem& p = *c.p;
  for (int64_t jj = 0; jj < nk; ++jj) {
    float* dk = &g.dk(b, hk, j0 + jj, 0);
    float* dv = &g.dv(b, hk, j0 + jj, 0);
    const float* sk = w.dk.get() + jj * w.Ep;
    const float* sv = w.dv.get() + jj * w.Evp;
    for (int64_t e = 0; e < p.E; ++e) dk[e * g.dk.strides[3]] = sk[e];
    for (int64_t e = 0; e < p.Ev; ++e) dv[e * g.dv.strides[3]] = sv[e];
  }
}

// dK/dV of one key block of (b, hk), summed over the query heads of the group
// and all query blocks in order. With `dq_into_output`, also adds each tile's
// scale·dS·K into g.dq (which the caller zeroed and owns for this (b, hk)).
void KeyBlockUnit(const Call& c, Scratch& w, const SdpaGrads<float>& g,
                  const View4<const float>& dout, const View4<const float>& out,
                  const View3<const float>& lse, int64_t b, int64_t hk, int64_t j0,
                  bool dq_into_output) {
  const Problem& p = *c.p;
  const int64_t nk = std::min(w.kb, p.S - j0);
  std::fill(w.dk.get(), w.dk.get() + w.kb * w.Ep, 0.0f);
  std::fill(w.dv.get(), w.dv.get() + w.kb * w.Evp, 0.0f);
  if (j0 < key_len(c, b)) {
    PackKeyBlock(c, w, b, hk, j0, nk, dq_into_output);
    const int64_t nqb = ceil_div(p.L, w.qb);
    for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
      for (int64_t qbi = FirstQueryBlock(c, j0); qbi < nqb; ++qbi) {
        const int64_t i0 = qbi * w.qb, nr = std::min(w.qb, p.L - i0);
        PackQueryBlock(c, w, b, h, i0, nr, dout, out, lse);
        TileJobs jobs;
        jobs.dkdv = true;
        jobs.dq = dq_into_output;
        if (jobs.dq) std::fill(w.dq.get(), w.dq.get() + nr * w.Ep, 0.0f);
        BackwardTile(c, w, b, h, i0, nr, j0, nk, jobs);
        if (jobs.dq) {
          for (int64_t r = 0; r < nr; ++r) {
            float* dst = &g.dq(b, h, i0 + r, 0);
            const float* src = w.dq.get() + r * w.Ep;
            for (int64_t e = 0; e < p.E; ++e) dst[e * g.dq.strides[3]] += c.scale * src[e];
          }
        }
      }
    }
  }
  // dK = scale·dSᵀ·Q is already scaled through the packed (scaled) queries.
  StoreKeyGrads(c, w, g, b, hk, j0, nk);
}

// dQ of one query block: Σ over key blocks in order of scale·dS·K.
void QueryBlockUnit(const Call& c, Scratch& w, const SdpaGrads<float>& g,
                    const View4<const float>& dout, const View4<const float>& out,
                    const View3<const float>& lse, int64_t b, int64_t h, int64_t i0, int64_t nr) {
  const Problem& p = *c.p;
  const int64_t hk = p.kv_head(h);
  const int64_t kend = row_end(c, b, i0 + nr - 1);
  std::fill(w.dq.get(), w.dq.get() + nr * w.Ep, 0.0f);
  PackQueryBlock(c, w, b, h, i0, nr, dout, out, lse);
  for (int64_t j0 = 0; j0 < kend; j0 += w.kb) {
    const int64_t nk = std::min(w.kb, kend - j0);
    PackKeyBlock(c, w, b, hk, j0, nk, true);
    TileJobs jobs;
    jobs.dq = true;
    BackwardTile(c, w, b, h, i0, nr, j0, nk, jobs);
  }
  for (int64_t r = 0; r < nr; ++r) {
    float* dst = &g.dq(b, h, i0 + r, 0);
    const float* src = w.dq.get() + r * w.Ep;
    for (int64_t e = 0; e < p.E; ++e) dst[e * g.dq.strides[3]] = c.scale * src[e];
  }
}

// One tile of dbias: the element block owned by this unit, summed over all
// (b, h, i, j) that broadcast onto it, in a fixed order.
void DbiasUnit(const Call& c, Scratch& w, const SdpaGrads<float>& g,
               const View4<const float>& dout, const View4<const float>& out,
               const View3<const float>& lse, int64_t bb, int64_t bh, int64_t qbi, int64_t kbi) {
  const Problem& p = *c.p;
  const auto& db = g.dbias;
  const bool fullB = db.dim(0) == p.B && p.B > 1, fullH = db.dim(1) == p.H && p.H > 1;
  const bool fullL = db.dim(2) == p.L && p.L > 1, fullS = db.dim(3) == p.S && p.S > 1;
  // Rows/columns of the dbias tile this unit owns.
  const int64_t ti0 = fullL ? qbi * w.qb : 0, tnr = fullL ? std::min(w.qb, p.L - ti0) : 1;
  const int64_t tj0 = fullS ? kbi * w.kb : 0, tnk = fullS ? std::min(w.kb, p.S - tj0) : 1;
  float* acc = w.acc.get();  // [tnr × kbp]
  std::fill(acc, acc + w.qb * w.kbp, 0.0f);
  const int64_t lanes = int64_t(hn::Lanes(DF()));
  for (int64_t b = fullB ? bb : 0; b < (fullB ? bb + 1 : p.B); ++b) {
    for (int64_t h = fullH ? bh : 0; h < (fullH ? bh + 1 : p.H); ++h) {
      const int64_t hk = p.kv_head(h);
      const int64_t i_lo = fullL ? ti0 : 0, i_hi = fullL ? ti0 + tnr : p.L;
      for (int64_t i0 = i_lo; i0 < i_hi; i0 += w.qb) {
        const int64_t nr = std::min(w.qb, i_hi - i0);
        const int64_t kend = row_end(c, b, i0 + nr - 1);
        const int64_t j_lo = fullS ? tj0 : 0, j_hi = std::min(fullS ? tj0 + tnk : p.S, kend);
        if (j_lo >= j_hi) continue;
        PackQueryBlock(c, w, b, h, i0, nr, dout, out, lse);
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += w.kb) {
          const int64_t nk = std::min(w.kb, j_hi - j0), nkp = round_up(nk, lanes);
          PackKeyBlock(c, w, b, hk, j0, nk, false);
          BackwardTile(c, w, b, h, i0, nr, j0, nk, TileJobs{});
          for (int64_t r = 0; r < nr; ++r) {
            const float* ds = w.dp.get() + r * w.kbp;
            float* arow = acc + (fullL ? r : 0) * w.kbp;
            if (fullS)
              for (int64_t jj = 0; jj < nkp; ++jj) arow[jj] += ds[jj];
            else
              for (int64_t jj = 0; jj < nk; ++jj) arow[0] += ds[jj];
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < tnr; ++r)
    for (int64_t jj = 0; jj < tnk; ++jj)
      db(bb, bh, fullL ? ti0 + r : 0, fullS ? tj0 + jj : 0) = acc[r * w.kbp + jj];
}

// Whether one unit per (b, kv head) gives enough parallel work; depends on
// the shape only, so the summation order never depends on the thread count.
bool OwnHeads(const Problem& p) { return p.B * p.Hkv >= 8; }

void BackwardImpl(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                  const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse,
                  FusedTiles t) {
  const Call c{&p, &a, t, float(p.scale)};
  const int64_t nkb = ceil_div(p.S, t.k_block), nqb = ceil_div(p.L, t.q_block);
  const bool own = OwnHeads(p);
#pragma omp parallel num_threads(p.threads)
  {
    Scratch w(p, t, /*backward=*/true);
    if (own) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < p.B * p.Hkv; ++u) {
        const int64_t b = u / p.Hkv, hk = u % p.Hkv;
        for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h)
          for (int64_t i = 0; i < p.L; ++i)
            for (int64_t e = 0; e < p.E; ++e) g.dq(b, h, i, e) = 0.0f;
        for (int64_t kbi = 0; kbi < nkb; ++kbi)
          KeyBlockUnit(c, w, g, dout, out, lse, b, hk, kbi * t.k_block, true);
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < p.B * p.Hkv * nkb; ++u) {
        const int64_t kbi = u % nkb, hk = (u / nkb) % p.Hkv, b = u / (nkb * p.Hkv);
        KeyBlockUnit(c, w, g, dout, out, lse, b, hk, kbi * t.k_block, false);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < p.B * p.H * nqb; ++u) {
        const int64_t qbi = u % nqb, h = (u / nqb) % p.H, b = u / (nqb * p.H);
        const int64_t i0 = qbi * t.q_block;
        QueryBlockUnit(c, w, g, dout, out, lse, b, h, i0, std::min(t.q_block, p.L - i0));
      }
    }
    if (!g.dbias.empty()) {
      const auto& db = g.dbias;
      const int64_t nb = db.dim(0), nh = db.dim(1);
      const int64_t nq = db.dim(2) == p.L && p.L > 1 ? nqb : 1;
      const int64_t nks = db.dim(3) == p.S && p.S > 1 ? nkb : 1;
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < nb * nh * nq * nks; ++u) {
        const int64_t kbi = u % nks, qbi = (u / nks) % nq, bh = (u / (nks * nq)) % nh,
                      bb = u / (nks * nq * nh);
        DbiasUnit(c, w, g, dout, out, lse, bb, bh, qbi, kbi);
      }
    }
  }
}

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

void GemmImpl(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B,
              int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  Gemm(M, N, K, A, ars, aks, B, ldb, C, ldc, accumulate);
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

HWY_EXPORT(ForwardImpl);
HWY_EXPORT(BackwardImpl);
HWY_EXPORT(ExpArray);
HWY_EXPORT(Exp2Array);
HWY_EXPORT(TargetNameImpl);
HWY_EXPORT(GemmImpl);

void fused_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(GemmImpl)(M, N, K, A, ars, aks, B, ldb, C, ldc, accumulate);
}


bool fused_available() { return true; }
bool fused_supports(const Problem&, const SdpaArgs<float>&, bool) { return true; }

FusedTiles fused_tiles(const Problem& p) {
  // q_block: the queries of a unit, and the vector dimension of the
  // transposed score tile (a multiple of 16 lanes); larger blocks re-read K
  // and V less often, smaller ones waste less on the causal diagonal and
  // give more units. k_block: a multiple of both micro-kernel heights (6 and
  // 12), as large as keeps the key/value tiles and the score tile within
  // about 256 KiB (half of a typical L2).
  FusedTiles t;
  t.q_block = p.L <= 80 ? 16 * fused_common::ceil_div(p.L, 16) : 96;
  const int64_t budget = 256 * 1024 / 4;  // floats
  int64_t kb = 240;
  while (kb > 12 && kb * (p.E + p.Ev) * 2 + t.q_block * kb * 2 > budget) kb -= 48;
  t.k_block = std::min<int64_t>(std::max<int64_t>(kb, 12), fused_common::round_up(p.S, 12));
  return t;
}

int64_t fused_scratch_bytes(const Problem& p, FusedTiles t) {
  const int64_t lanes = 16;  // the widest target; an upper bound for the others
  const int64_t kbp = fused_common::round_up(t.k_block, lanes);
  const int64_t Ep = fused_common::round_up(p.E, lanes), Evp = fused_common::round_up(p.Ev, lanes);
  const int64_t qb = t.q_block, kb = t.k_block;
  const int64_t fwd = qb * Ep + p.E * kbp + qb * kbp + kb * Evp + qb * Evp;
  const int64_t bwd = qb * Ep + p.E * kbp + qb * kbp + qb * Evp + p.Ev * kbp + kb * Ep + qb * kbp +
                      kb * Ep + kb * Evp + qb * Ep + qb * kbp;
  return 4 * std::max(fwd, bwd) + 16 * qb;
}

void fused_forward_tiled(const Problem& p, const SdpaArgs<float>& a, View4<float> out,
                         View4<float> weights, View3<float> lse, FusedTiles t) {
  HWY_DYNAMIC_DISPATCH(ForwardImpl)(p, a, out, weights, lse, t);
}

void fused_forward(const Problem& p, const SdpaArgs<float>& a, View4<float> out,
                   View4<float> weights, View3<float> lse) {
  fused_forward_tiled(p, a, out, weights, lse, fused_tiles(p));
}

void fused_backward_tiled(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                          const SdpaGrads<float>& g, View4<const float> out,
                          View3<const float> lse, FusedTiles t) {
  // The saved state; recomputed by a forward pass when not given.
  Tensor<float> out_tmp, lse_tmp;
  if (out.empty() || lse.empty()) {
    out_tmp = Tensor<float>({p.B, p.H, p.L, p.Ev});
    lse_tmp = Tensor<float>({p.B, p.H, p.L});
    View4<float> o(out_tmp.data(), {p.B, p.H, p.L, p.Ev});
    View3<float> l(lse_tmp.data(), {p.B, p.H, p.L});
    fused_forward_tiled(p, a, o, {}, l, t);
    if (out.empty()) out = o;
    if (lse.empty()) lse = l;
  }
  HWY_DYNAMIC_DISPATCH(BackwardImpl)(p, a, dout, g, out, lse, t);
}

void fused_backward(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                    const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse) {
  fused_backward_tiled(p, a, dout, g, out, lse, fused_tiles(p));
}

const char* fused_target_name() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }

void fused_exp(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(ExpArray)(x, y, n); }

void fused_exp2(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(Exp2Array)(x, y, n); }

}  // namespace attn::detail
#endif  // HWY_ONCE
