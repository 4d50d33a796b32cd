// The bfloat16 products of the fused forward, for one SIMD target (included
// once per target by fused.cpp; no ordinary include guard). The unit is the
// float32 forward's (ForwardUnitT, attention-inl.h); Bf16Products supplies
// its two products on the operands of bf16.hpp:
//
//   scores:      st = scale·log2(e) · K·Qᵀ   A = K (bf16), B = the unit's query pairs
//                then the score pipeline (ScoreRulesT), as the float32 tile
//   accumulate:  oᵀ <- oᵀ·alpha + Vᵀ·Pᵀ       A = V transposed (bf16), B = the tile's
//                probabilities after the softmax, rounded to bfloat16 in pairs
//
// Per tile the extra work over the float32 unit is the rounding of P into
// pairs, a few integer operations per score in the pass that exponentiates
// the tile (TileExpPairsChunk; with dropout, which multiplies P first, a
// pass of its own); the queries are paired once per unit, K and V once per
// call (bf16.cpp). The
// products themselves run on the path the call chose (bf16.hpp); the
// portable one is here: float32 multiply-adds on the rounded values, the
// odd element of each pair first (VDPBF16PS's order, so the same bits).
#if defined(ATTN_KERNELS_FUSED_BF16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_FUSED_BF16_INL_H_
#undef ATTN_KERNELS_FUSED_BF16_INL_H_
#else
#define ATTN_KERNELS_FUSED_BF16_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/fused/attention-inl.h"
#include "kernels/fused/bf16.hpp"
#include "kernels/fused/bf16_round-inl.h"
#include "kernels/fused/blocking.hpp"
#include "kernels/fused/simd-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

using DU = hn::RebindToUnsigned<DF>;
using VU = hn::Vec<DU>;

// ---- the portable products ---------------------------------------------------

// Register tile C[R × NV·lanes] (+)= A·B, A float32 rows (lda), B pairs.
template <int R, int NV>
HWY_INLINE void PairKernel(int64_t K, const float* HWY_RESTRICT A, int64_t lda, const uint32_t* HWY_RESTRICT B,
                           int64_t ldb, float* HWY_RESTRICT C, int64_t ldc, float alpha, bool accumulate) {
  const DF d;
  const DU du;
  const size_t N = hn::Lanes(d);
  VF acc[R][NV];
  StartTile(acc, C, ldc, accumulate);
  const VU high = hn::Set(du, 0xFFFF0000u);
  for (int64_t k = 0; k < K; k += 2) {
    VF even[NV], odd[NV];  // the pairs' first and second elements as float32
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const VU u = hn::LoadU(du, B + (k / 2) * ldb + int64_t(v * N));
      even[v] = hn::BitCast(d, hn::ShiftLeft<16>(u));
      odd[v] = hn::BitCast(d, hn::And(u, high));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* a = A + r * lda + k;
      const VF a1 = hn::Set(d, a[1]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(a1, odd[v], acc[r][v]);
      const VF a0 = hn::Set(d, a[0]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = hn::MulAdd(a0, even[v], acc[r][v]);
    }
  }
  const VF s = hn::Set(d, accumulate ? 1.0f : alpha);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) hn::StoreU(hn::Mul(acc[r][v], s), d, C + r * ldc + int64_t(v * N));
}

// bf16.hpp's Bf16Gemm on the portable path (A: float32 values).
void PortableBf16Gemm(int64_t M, int64_t N, int64_t K, const void* Av, int64_t lda, const uint32_t* B, int64_t ldb,
                      float* C, int64_t ldc, float alpha, bool accumulate) {
  const auto* A = static_cast<const float*>(Av);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  constexpr int kRows = 8, kVecs = 3;  // 24 accumulators + 6 of B + 1 of A within 32 registers
#else
  constexpr int kRows = 4, kVecs = 2;  // 8 + 4 + 1 within 16
#endif
  ForRegisterTiles<kRows, kVecs>(M, N, Lanes(), [&]<int R, int NV>(int64_t m0, int64_t n0) {
    PairKernel<R, NV>(K, A + m0 * lda, lda, B + n0, ldb, C + m0 * ldc + n0, ldc, alpha, accumulate);
  });
}

// ---- operands of the unit ----------------------------------------------------

// RoundToBf16High (the operands' rounding) comes with bf16_round-inl.h.

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr bool kCvtPairs = true;
// VCVTNE2PS2BF16: lo's 16 floats rounded to the low 16 bfloat16 of the
// result, hi's to the high 16, with bf16_operand's conversion (nearest
// even, a subnormal input to a signed zero, NaN kept and made quiet; the
// AVX512_BF16 path's Pairs says so too). Only where the CPU has AVX512_BF16
// (Bf16Kernel::vcvtne2ps2bf16); an asm statement, as this target's code is
// compiled without that extension.
HWY_INLINE __m512i CvtNe2(VF lo, VF hi) {
  __m512i both;
  asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(both) : "v"(hi.raw), "v"(lo.raw));
  return both;
}
// The pair vector (pe, po): CvtNe2, then one permutation that interleaves
// its two halves.
HWY_INLINE VU CvtPairs(VF pe, VF po) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return VU{_mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), CvtNe2(pe, po))};
}
#else
constexpr bool kCvtPairs = false;
HWY_INLINE VU CvtPairs(VF, VF) { return VU{}; }
#endif

// x[0, n) rounded to bfloat16 (bf16_operand) as A elements at dst: the
// bits, or their float32 values (a_float); n a multiple of the lane count.
// Returns whether one of them is ±∞ or NaN (its exponent all ones). With
// cvt (bits, an AVX-512 target on a CPU with AVX512_BF16), 32 elements at a
// time by CvtNe2: one instruction where RoundToBf16High takes about ten.
bool RoundRow(const float* x, int64_t n, bool a_float, std::byte* dst, bool cvt = false) {
  const DF d;
  const DU du;
  const hn::Rebind<uint16_t, DU> d16;
  const VU high = hn::Set(du, 0xFFFF0000u), exponent = hn::Set(du, 0x7F800000u);
  VU bad = hn::Zero(du);
  int64_t j = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if (cvt && !a_float) {
    const __m512i exponent16 = _mm512_set1_epi16(0x7F80);
    __mmask32 any = 0;
    auto* bits = reinterpret_cast<uint16_t*>(dst);
    for (; j + 32 <= n; j += 32) {
      const __m512i r = CvtNe2(hn::LoadU(d, x + j), hn::LoadU(d, x + j + 16));
      _mm512_storeu_si512(bits + j, r);
      any |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(r, exponent16), exponent16);
    }
    if (any != 0) bad = hn::Set(du, 1u);
  }
#else
  (void)cvt;
#endif
  for (; j < n; j += Lanes()) {
    const VU r = RoundToBf16High(hn::LoadU(d, x + j));
    bad = hn::Or(bad, hn::VecFromMask(du, hn::Eq(hn::And(r, exponent), exponent)));
    if (a_float)
      hn::StoreU(hn::BitCast(d, hn::And(r, high)), d, reinterpret_cast<float*>(dst) + j);
    else
      hn::StoreU(hn::TruncateTo(d16, hn::ShiftRight<16>(r)), d16, reinterpret_cast<uint16_t*>(dst) + j);
  }
  return !hn::AllTrue(du, hn::Eq(bad, hn::Zero(du)));
}

// bf16.hpp's Bf16Pairs on the running SIMD target (the paths without their
// own conversion instruction).
void ProbabilityPairs(const float* st, int64_t ld, int64_t nk, int64_t K, int64_t nrp, uint32_t* pp) {
  const DF d;
  const DU du;
  const int64_t N = Lanes();
  const VU high = hn::Set(du, 0xFFFF0000u);
  for (int64_t k = 0; 2 * k < K; ++k) {
    const bool has_e = 2 * k < nk, has_o = 2 * k + 1 < nk;
    const float* e = has_e ? st + 2 * k * ld : nullptr;
    const float* o = has_o ? st + (2 * k + 1) * ld : nullptr;
    uint32_t* dst = pp + k * ld;
    for (int64_t r = 0; r < nrp; r += N) {
      const VU lo = has_e ? hn::ShiftRight<16>(RoundToBf16High(hn::Load(d, e + r))) : hn::Zero(du);
      const VU hi = has_o ? hn::And(RoundToBf16High(hn::Load(d, o + r)), high) : hn::Zero(du);
      hn::Store(hn::Or(lo, hi), du, dst + r);
    }
  }
}


// The softmax's exponentials of C column groups of a transposed tile, two key
// rows at a time, straight into probability pairs: for keys 2k and 2k + 1,
// P = 2^(s − shift) (TileExpChunk's values), added to the column sums in key
// order (TileExpChunk's sums, P unrounded), then rounded into the pair
// pp[k] (ProbabilityPairs's bits), zeros past nk up to K / 2 pairs. One pass
// over the tile instead of writing P back to st and reading it again.
// With kCvt (AVX-512 targets on CPUs with AVX512_BF16) the pairs come from
// CvtPairs: two instructions. Otherwise, where every x = s − shift of the
// two rows' vectors is at least −126 (no NaN), each P is a normal float
// (Exp2Softmax: 2^n·2^f with 2^f >= 1 when n = −126), whose rounding needs
// neither RoundToBf16High's NaN nor its subnormal case: the same bits in
// four integer operations. (At B=1, H=8, L=S=4096, one thread, Emerald
// Rapids, the instructions took the forward from 50-51 to 44-46 ms at
// E=64, causal.) kScaled: st lacks the scores' scale a (the products
// deferred it), each score is multiplied by it first (the same bits).
template <int C, bool kCvt, bool kScaled>
HWY_INLINE void TileExpPairsChunk(const float* st, int64_t ld, int64_t nk, int64_t K, const float* shift,
                                  float* tsum, uint32_t* pp, float a) {
  const DF d;
  const VF av = hn::Set(d, a);
  const auto score = [&](const float* x) { return kScaled ? MulRounded(hn::Load(d, x), av) : hn::Load(d, x); };
  const DU du;
  const int64_t N = Lanes();
  const VU high = hn::Set(du, 0xFFFF0000u), half = hn::Set(du, 0x7FFFu), one = hn::Set(du, 1u);
  const VF normal = hn::Set(d, -126.0f);
  const auto round_normal = [&](VF p) {  // RoundToBf16High for a normal float
    const VU u = hn::BitCast(du, p);
    return hn::Add(u, hn::Add(half, hn::And(hn::ShiftRight<16>(u), one)));
  };
  VF sh[C], sum[C];
#pragma GCC unroll 4
  for (int g = 0; g < C; ++g) sh[g] = hn::Load(d, shift + g * N), sum[g] = hn::Zero(d);
  int64_t k = 0;
  for (; 2 * k + 1 < nk; ++k) {
    const float* e = st + 2 * k * ld;
    const float* o = e + ld;
#pragma GCC unroll 4
    for (int g = 0; g < C; ++g) {
      const VF xe = hn::Sub(score(e + g * N), sh[g]), xo = hn::Sub(score(o + g * N), sh[g]);
      const VF pe = Exp2Softmax(d, xe), po = Exp2Softmax(d, xo);  // 0 if masked
      sum[g] = hn::Add(hn::Add(sum[g], pe), po);
      if constexpr (kCvt) {
        hn::Store(CvtPairs(pe, po), du, pp + k * ld + g * N);
        continue;
      }
      VU re, ro;
      if (hn::AllTrue(d, hn::And(hn::Ge(xe, normal), hn::Ge(xo, normal))))
        re = round_normal(pe), ro = round_normal(po);
      else
        re = RoundToBf16High(pe), ro = RoundToBf16High(po);
      hn::Store(hn::Or(hn::ShiftRight<16>(re), hn::And(ro, high)), du, pp + k * ld + g * N);
    }
  }
  if (2 * k < nk) {  // an odd key count: the last pair's second element is 0
    const float* e = st + 2 * k * ld;
    for (int g = 0; g < C; ++g) {
      const VF pe = Exp2Softmax(d, hn::Sub(score(e + g * N), sh[g]));
      sum[g] = hn::Add(sum[g], pe);
      hn::Store(hn::ShiftRight<16>(RoundToBf16High(pe)), du, pp + k * ld + g * N);
    }
    ++k;
  }
  for (; 2 * k < K; ++k)
    for (int g = 0; g < C; ++g) hn::Store(hn::Zero(du), du, pp + k * ld + g * N);
#pragma GCC unroll 4
  for (int g = 0; g < C; ++g) hn::Store(sum[g], d, tsum + g * N);
}
template <int C>
struct ExpPairsOp {
  static void run(int64_t r, const float* st, int64_t ld, int64_t nk, int64_t K, const float* shift, float* tsum,
                  uint32_t* pp, bool cvt, float a) {
    st += r, shift += r, tsum += r, pp += r;
    if (kCvtPairs && cvt && a != 1.0f) TileExpPairsChunk<C, kCvtPairs, true>(st, ld, nk, K, shift, tsum, pp, a);
    else if (kCvtPairs && cvt) TileExpPairsChunk<C, kCvtPairs, false>(st, ld, nk, K, shift, tsum, pp, a);
    else if (a != 1.0f) TileExpPairsChunk<C, false, true>(st, ld, nk, K, shift, tsum, pp, a);
    else TileExpPairsChunk<C, false, false>(st, ld, nk, K, shift, tsum, pp, a);
  }
};

// ---- the unit's products ---------------------------------------------------------

// Whether no score rule reads a score's value (no soft-cap, ALiBi or float
// bias; the band and the boolean mask only hide scores), so that the
// products may leave the scores' scale to the pass after the rules.
HWY_INLINE bool ScaleFree(const ScoreRules<float>& r) { return !r.capped() && !r.alibi() && r.bias.empty(); }

// The bfloat16 products of one thread (see the top of this file); the
// path's per-thread set-up lives as long as the object.
class Bf16Products {
 public:
  // defer: the call may leave the scores' scale to the passes that read them
  // (scores).
  Bf16Products(const FusedCall& c, ForwardScratch& w, const Bf16Operands& ops, bool defer)
      : c_(c),
        w_(w),
        ops_(ops),
        gemm_(ops.kernel.gemm ? ops.kernel.gemm : &PortableBf16Gemm),
        deferred_(defer ? c.scale * kLog2e : 1.0f) {
    if (ops_.kernel.thread_begin) ops_.kernel.thread_begin();
  }
  ~Bf16Products() {
    if (ops_.kernel.thread_end) ops_.kernel.thread_end();
  }
  Bf16Products(const Bf16Products&) = delete;
  Bf16Products& operator=(const Bf16Products&) = delete;

  // qp[k][r] = the pair (2k, 2k + 1) of query row i0 + r (zero columns past
  // nr); the accumulator zeroed.
  void begin(int64_t b, int64_t h, int64_t i0, int64_t nr) {
    const Problem& p = *c_.p;
    const int64_t pairs = ops_.E2 / 2, qbp = w_.qbp;
    w_.any_qbad = false;
    for (int64_t r = 0; r < nr; ++r) {
      const uint16_t* q = ops_.q_row(p, b, h, i0 + r);
      for (int64_t k = 0; k < pairs; ++k) std::memcpy(w_.qp + k * qbp + r, q + 2 * k, 4);
      w_.qbad[r] = ops_.qbad[size_t((b * p.H + h) * p.L + i0 + r)];
      w_.any_qbad = w_.any_qbad || w_.qbad[r];
    }
    for (int64_t k = 0; k < pairs; ++k) std::fill(w_.qp + k * qbp + nr, w_.qp + (k + 1) * qbp, 0u);
    std::fill(w_.ot, w_.ot + ops_.Evr * qbp, 0.0f);
  }
  // st = scale·log2(e)·K·Qᵀ over the tile (rows padded to the path's
  // height), then the score pipeline. With a deferred scale (a call whose
  // rules only hide scores, without dropout or weights: ForwardBf16Impl) st
  // holds K·Qᵀ, and the two passes that read it, the maxima and the
  // exponentials, multiply each score by the scale as the product would
  // have (the same bits): no pass of its own after every block of the
  // product. (−∞ and NaN stay what they are under the scale.)
  void scores(int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t nrp, int64_t j0, int64_t nk) {
    const Problem& p = *c_.p;
    gemm_(round_up(nk, ops_.kernel.mpad), nrp, ops_.E2, ops_.k_rows(p, b, p.kv_head(h), j0), ops_.E2, w_.qp,
          w_.qbp, w_.st, w_.qbp, deferred_ != 1.0f ? 1.0f : c_.scale * kLog2e, false);
    ScoreRulesT(c_, w_, b, h, i0, nr, nrp, j0, nk);
  }
  // The column maxima of the tile's scores.
  void score_maxima(int64_t nrp, int64_t nk, float* tmax) const {
    const int64_t N = Lanes();
    if (deferred_ != 1.0f) ForColumnGroups<ScaledMaxOp>(nrp / N, N, static_cast<const float*>(w_.st), w_.qbp, nk,
                                                        deferred_, tmax);
    else ForColumnGroups<MaxOp>(nrp / N, N, static_cast<const float*>(w_.st), w_.qbp, nk, tmax);
  }
  // The tile's P = 2^(st − shift) and its column sums (tsum). Unless P must
  // stay in st (keep_p), it goes straight into the pairs of the product
  // (the same values and sums as the float32 unit's pass, then the pairs').
  void exponentiate(int64_t nrp, int64_t nk, const float* shift, float* tsum, bool keep_p) {
    const int64_t N = Lanes();
    paired_ = !keep_p;
    if (keep_p)
      ForColumnGroups<ExpOp>(nrp / N, N, w_.st, w_.qbp, nk, shift, tsum);
    else
      ForColumnGroups<ExpPairsOp>(nrp / N, N, static_cast<const float*>(w_.st), w_.qbp, nk,
                                  round_up(nk, ops_.kernel.kpad), shift, tsum, w_.pp, ops_.kernel.vcvtne2ps2bf16,
                                  deferred_);
  }
  // oᵀ <- oᵀ·alpha + Vᵀ·Pᵀ with P rounded to bfloat16.
  void accumulate(int64_t b, int64_t h, int64_t nr, int64_t j0, int64_t nk) {
    const Problem& p = *c_.p;
    const DF d;
    const int64_t nrp = round_up(nr, Lanes()), qbp = w_.qbp;
    const float* alpha = w_.colv + 2 * qbp;
    // acc <- acc · alpha, per query (column), over the column groups whose
    // factors are not all 1 (no max grew there: they would change nothing),
    // eight groups at a time row by row, so that each row's part is one
    // contiguous run (walking a group down the rows, a stride of qbp, took
    // about a fifth of the unit's own time at E=128; B=1, H=8, L=S=4096, two
    // threads, Emerald Rapids: 40.5-40.9 against 40.9-41.2 ms, the same bits).
    constexpr int kGroups = 8;
    for (int64_t r = 0; r < nrp;) {
      VF a[kGroups];
      int64_t at[kGroups];
      int n = 0;
      for (; r < nrp && n < kGroups; r += Lanes()) {
        a[n] = hn::Load(d, alpha + r);
        if (!hn::AllTrue(d, hn::Eq(a[n], hn::Set(d, 1.0f)))) at[n++] = r;
      }
      for (float* row = w_.ot; n > 0 && row < w_.ot + p.Ev * qbp; row += qbp)
        for (int g = 0; g < n; ++g) hn::Store(hn::Mul(hn::Load(d, row + at[g]), a[g]), d, row + at[g]);
    }
    const int64_t K = round_up(nk, ops_.kernel.kpad);
    if (!paired_) (ops_.kernel.pairs ? ops_.kernel.pairs : &ProbabilityPairs)(w_.st, qbp, nk, K, nrp, w_.pp);
    gemm_(ops_.Evr, nrp, K, ops_.vt_cols(p, b, p.kv_head(h), j0), ops_.ldvt, w_.pp, qbp, w_.ot, qbp, 1.0f, true);
  }
  // Row r of the output: y = acc / sum.
  void write_row(int64_t r, float inv_sum, float* dst, int64_t se) const {
    for (int64_t e = 0; e < c_.p->Ev; ++e) dst[e * se] = w_.ot[e * w_.qbp + r] * inv_sum;
  }

 private:
  const FusedCall& c_;
  ForwardScratch& w_;
  const Bf16Operands& ops_;
  Bf16Gemm gemm_;
  bool paired_ = false;  // the tile's P is already in pp (exponentiate)
  const float deferred_;  // the scale st lacks (scores), or 1
};

void ForwardBf16Impl(const Problem& p, const Bf16Operands& ops, View4<float> out, View4<float> weights,
                     View3<float> lse, FusedPlan t) {
  FusedCall c{&p, nullptr, t, float(p.rules.scale)};
  c.bad_keys = ops.bad_keys.data();
  c.any_bad_keys = ops.any_bad_keys;
  const bool defer = ScaleFree(p.rules) && !p.dropout.on() && weights.empty();  // (keep_p: st must be P)
  ForwardUnits(c, t, out, weights, lse, [&](ForwardScratch& w) { return Bf16Products(c, w, ops, defer); });
}

// ---- the backward's products ------------------------------------------------------
//
// The float32 backward's units and tile (attention-inl.h, BackwardTileT) with
// these products, PyTorch's and FlashAttention's bfloat16 backward:
//   S   = scale·log2(e) · Q·Kᵀ   A = Q, B = K pairs (features paired): the
//                           forward's scores (its K·Qᵀ pairs the same
//                           products in the same order), in base 2
//   dP  = dY·Vᵀ             A = dY rounded, B = V pairs (features paired)
//   dVᵀ += dYᵀ·(P∘m)        A = dY rounded, transposed, B = P rounded, rows paired
//   dKᵀ += Qᵀ·dU            A = Q transposed, B = dU rounded, rows paired (× scale on store)
//   dQ  += dU·K             A = dU rounded, B = K pairs (keys paired)
// dY is rounded to bfloat16 once per call and used rounded everywhere
// (D = Σ_e dY·Y too); P, dS = P∘(dP − D) and every accumulator stay float32.
// The query side's operands are built once per call (Bf16BackwardOperands,
// bf16.hpp), the key side's per key block from the call's k and vᵀ, into
// per-thread scratch beside BackwardScratch's (whose float32 q, k and v
// blocks go unused), widths padded for the path's granularity (kpad, mpad;
// N a multiple of 16), padding zero:
//   kfpairs [E2/2 × KW]  K pairs of the key block, B of S   KW = kb + 32
//   vpairs [Ev2/2 × KW]   V pairs of the key block, B of dP
//   kpairs [KW/2 × E16]   K pairs of the key block, B of dQ  E16 = E up to 16
//   pairs  [QW/2 × kbp]   P or dU rounded, rows paired       QW = qb + 32
//   dspairs [QW/2 × kbp]  dU rounded, rows paired (fused_tile, beside P's)
//   dsa    [qb + 16 × KW] dU rows rounded, A of dQ
//   dkt    [Er × KW], dvt [Evr × KW], dq [qb + 16 × E16]   accumulators
class Bf16BackwardProducts {
 public:
  Bf16BackwardProducts(const FusedCall& c, BackwardScratch& w, const Bf16Operands& ops,
                       const Bf16BackwardOperands& qo)
      : c_(c),
        w_(w),
        ops_(ops),
        qo_(qo),
        gemm_(ops.kernel.gemm ? ops.kernel.gemm : &PortableBf16Gemm),
        deferred_(ScaleFree(c.p->rules) ? c.scale * kLog2e : 1.0f) {
    const Problem& p = *c.p;
    af_ = ops.kernel.a_float;
    E2_ = ops.E2, Evr_ = ops.Evr, Er_ = qo.Er, Ev2_ = qo.Ev2;
    E16_ = round_up(p.E, 16), QW_ = w.qb + 32, KW_ = w.kb + 32;
    kfpairs_ = alloc<uint32_t>(E2_ / 2 * KW_);
    vpairs_ = alloc<uint32_t>(Ev2_ / 2 * KW_);
    kpairs_ = alloc<uint32_t>(KW_ / 2 * E16_);
    pairs_ = alloc<uint32_t>(QW_ / 2 * w.kbp);
    if (ops_.kernel.vcvtne2ps2bf16) dspairs_ = alloc<uint32_t>(QW_ / 2 * w.kbp);  // fused_tile's
    dsa_ = alloc<std::byte>((w.qb + 16) * KW_ * elem());
    dkt_ = alloc<float>(Er_ * KW_);
    dvt_ = alloc<float>(Evr_ * KW_);
    dq_ = alloc<float>((w.qb + 16) * E16_);
    if (ops_.kernel.thread_begin) ops_.kernel.thread_begin();
  }
  ~Bf16BackwardProducts() {
    if (ops_.kernel.thread_end) ops_.kernel.thread_end();
  }
  Bf16BackwardProducts(const Bf16BackwardProducts&) = delete;
  Bf16BackwardProducts& operator=(const Bf16BackwardProducts&) = delete;

  int64_t width(int64_t nk) const { return round_up(nk, 16); }
  float score_unit() const { return kLog2e; }  // scores in base 2
  float deferred_scale() const { return deferred_; }  // the scale w.s still lacks (scores)

  // K and V pairs of keys [j0, j0 + nk) of (b, hk), from the call's operands
  // (zeros past nk).
  void pack_keys(int64_t b, int64_t hk, int64_t j0, int64_t nk, bool rows) {
    const Problem& p = *c_.p;
    const std::byte* kr = static_cast<const std::byte*>(ops_.k_rows(p, b, hk, j0));
    const std::byte* vt = static_cast<const std::byte*>(ops_.vt_cols(p, b, hk, j0));
    if (af_) {
      PackKeys(reinterpret_cast<const float*>(kr), reinterpret_cast<const float*>(vt), nk, rows);
    } else {
      PackKeys(reinterpret_cast<const uint16_t*>(kr), reinterpret_cast<const uint16_t*>(vt), nk, rows);
    }
  }

  // The query block: its lse, D and poison (its operands are the call's).
  void pack_queries(int64_t b, int64_t h, int64_t i0, int64_t nr, const View4<const float>&,
                    const View4<const float>&, const View3<const float>& lse) {
    const Problem& p = *c_.p;
    bh_ = b * p.H + h, i0_ = i0;
    for (int64_t r = 0; r < nr; ++r) {
      w_.lse[r] = lse(b, h, i0 + r);
      w_.D[r] = qo_.D[size_t(bh_ * p.L + i0 + r)];
      w_.poisoned[r] = qo_.poisoned[size_t(bh_ * p.L + i0 + r)];
    }
  }

  // w.s = the tile's scores in base 2 (× log2(e), so that P takes
  // Exp2Softmax) through the score pipeline, the scale deferred to P's pass
  // where no rule reads a score's value (as the forward's scores).
  void scores(int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0, int64_t nk, int64_t nkp, TileOrigin at) {
    const Problem& p = *c_.p;
    BackwardScratch& w = w_;
    // s = scale·log2(e)·Q·Kᵀ (Q·Kᵀ with the scale deferred)
    const int64_t row = bh_ * p.L + i0_ + at.row;
    gemm_(round_up(nr, ops_.kernel.mpad), nkp, E2_, qo_.q.get() + row * E2_ * elem(), E2_, kfpairs_.get() + at.key,
          KW_, w.s, w.kbp, deferred_ != 1.0f ? 1.0f : c_.scale * kLog2e, false);
    ScoreTileRules(c_, w, b, h, i0, nr, j0, nk, nkp, kLog2e);
  }
  // w.dp = dY·Vᵀ
  void dp(int64_t nr, int64_t nkp, TileOrigin at) {
    const int64_t row = bh_ * c_.p->L + i0_ + at.row;
    gemm_(round_up(nr, ops_.kernel.mpad), nkp, Ev2_, qo_.dy.get() + row * Ev2_ * elem(), Ev2_, vpairs_.get() + at.key,
          KW_, w_.dp, w_.kbp, 1.0f, false);
  }
  // dVᵀ += dYᵀ·(P∘m) ; dKᵀ += Qᵀ·dU
  void dkdv(int64_t nr, int64_t, int64_t nkp, TileOrigin at) {
    const int64_t K = round_up(nr, ops_.kernel.kpad);
    const Bf16Pairs pairs = ops_.kernel.pairs ? ops_.kernel.pairs : &ProbabilityPairs;
    pairs(w_.s, w_.kbp, nr, K, nkp, pairs_.get());
    dv_product(nr, nkp, at);
    pairs(w_.dp, w_.kbp, nr, K, nkp, pairs_.get());
    dk_product(nr, nkp, at, pairs_.get());
  }
  // dQ += dU·K (the scale is applied when written out)
  void dq(int64_t nr, int64_t, int64_t nkp, TileOrigin at) {
    // (K >= nkp >= nk: dU is 0 past nk, where P is)
    const int64_t M = round_up(nr, ops_.kernel.mpad), K = round_up(nkp, ops_.kernel.kpad), es = elem();
    for (int64_t r = 0; r < M; ++r) {  // dU rounded, zeros past nr and nkp
      std::byte* dst = dsa_.get() + r * KW_ * es;
      if (r < nr) RoundRow(w_.dp + r * w_.kbp, nkp, af_, dst, ops_.kernel.vcvtne2ps2bf16);
      std::memset(dst + (r < nr ? nkp : 0) * es, 0, size_t((K - (r < nr ? nkp : 0)) * es));
    }
    dq_product(nr, nkp, at);
  }
  // P, dP and dS of the tile in one pass, when the tile has neither dropout
  // nor a soft-cap nor a poisoned row and the CPU has VCVTNE2PS2BF16: dP =
  // dY·Vᵀ first, then one pass over two rows of the scores and of dP at a
  // time gives P = 2^(s − lse·log2(e)) (ProbRow's values) rounded into dV's pairs
  // (as Pairs would), and dS = P∘(dP − D) rounded into dK's pairs and dQ's
  // rows (as Pairs and RoundRow would). So neither P nor dS is stored as
  // float32 and read back; the bits are those of the separate passes. Only
  // for a tile with a dK/dV or dQ job (BackwardTileT: dS is then not left
  // in w.dp). Returns false, having done nothing, where it does not apply.
  bool fused_tile(int64_t nr, int64_t nkp, TileOrigin at, TileJobs jobs, const float* lse, const float* D,
                  const uint8_t* poisoned) {
    const Problem& p = *c_.p;
    if (!kCvtPairs || af_ || !ops_.kernel.vcvtne2ps2bf16 || p.dropout.on() || p.rules.capped()) return false;
    if (!(jobs.dkdv || jobs.dq) || std::any_of(poisoned, poisoned + nr, [](uint8_t x) { return x != 0; })) return false;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    dp(nr, nkp, at);
    const int64_t K = round_up(nr, ops_.kernel.kpad), M = round_up(nr, ops_.kernel.mpad), ld = w_.kbp;
    const DF d;
    const int64_t N = Lanes();  // 16
    const VF a = hn::Set(d, deferred_);
    auto* rows = reinterpret_cast<uint16_t*>(dsa_.get());
    for (int64_t k = 0; 2 * k < std::max(K, M); ++k) {
      const int64_t re = 2 * k, ro = 2 * k + 1;
      const VF she = hn::Set(d, re < nr ? os::lse_shift(lse[re]) * kLog2e : 0.0f);
      const VF sho = hn::Set(d, ro < nr ? os::lse_shift(lse[ro]) * kLog2e : 0.0f);
      const VF De = hn::Set(d, re < nr ? D[re] : 0.0f), Do = hn::Set(d, ro < nr ? D[ro] : 0.0f);
      const auto prob = [&](int64_t r, VF sh, int64_t j) {  // P, 0 past the tile
        if (r >= nr || j >= nkp) return hn::Zero(d);
        return Exp2Softmax(d, hn::Sub(MulRounded(hn::Load(d, w_.s + r * ld + j), a), sh));
      };
      const auto ds = [&](int64_t r, VF pr, VF Dr, int64_t j) {  // dS = P∘(dP − D)
        if (r >= nr || j >= nkp) return hn::Zero(d);
        return hn::Mul(pr, hn::Sub(hn::Load(d, w_.dp + r * ld + j), Dr));
      };
      for (int64_t j = 0; j < nkp; j += 2 * N) {  // (dU's rows: zeros past nkp up to a multiple of 32 >= K)
        const VF pe0 = prob(re, she, j), pe1 = prob(re, she, j + N), po0 = prob(ro, sho, j),
                 po1 = prob(ro, sho, j + N);
        const VF e0 = ds(re, pe0, De, j), e1 = ds(re, pe1, De, j + N), o0 = ds(ro, po0, Do, j),
                 o1 = ds(ro, po1, Do, j + N);
        if (jobs.dkdv && re < K) {
          hn::Store(CvtPairs(pe0, po0), DU(), pairs_.get() + k * ld + j);
          hn::Store(CvtPairs(e0, o0), DU(), dspairs_.get() + k * ld + j);
          if (j + N < nkp) {
            hn::Store(CvtPairs(pe1, po1), DU(), pairs_.get() + k * ld + j + N);
            hn::Store(CvtPairs(e1, o1), DU(), dspairs_.get() + k * ld + j + N);
          }
        }
        if (re < M) _mm512_storeu_si512(rows + re * KW_ + j, CvtNe2(e0, e1));
        if (ro < M) _mm512_storeu_si512(rows + ro * KW_ + j, CvtNe2(o0, o1));
      }
    }
    if (jobs.dkdv) dv_product(nr, nkp, at), dk_product(nr, nkp, at, dspairs_.get());
    if (jobs.dq) dq_product(nr, nkp, at);
    return true;
#else
    (void)nr, (void)nkp, (void)at, (void)jobs, (void)lse, (void)D;
    return false;
#endif
  }
  void zero_key_grads() {
    std::fill(dkt_.get(), dkt_.get() + Er_ * KW_, 0.0f);
    std::fill(dvt_.get(), dvt_.get() + Evr_ * KW_, 0.0f);
  }
  // dK = scale·dKᵀ transposed, dV = dVᵀ transposed.
  void store_key_grads(const SdpaGrads<float>& g, int64_t b, int64_t hk, int64_t j0, int64_t nk) const {
    const Problem& p = *c_.p;
    for (int64_t jj = 0; jj < nk; ++jj) {
      float* dk = &g.dk(b, hk, j0 + jj, 0);
      float* dv = &g.dv(b, hk, j0 + jj, 0);
      for (int64_t e = 0; e < p.E; ++e) dk[e * g.dk.strides[3]] = c_.scale * dkt_[size_t(e * KW_ + jj)];
      for (int64_t e = 0; e < p.Ev; ++e) dv[e * g.dv.strides[3]] = dvt_[size_t(e * KW_ + jj)];
    }
  }
  void zero_dq(int64_t) { std::fill(dq_.get(), dq_.get() + (w_.qb + 16) * E16_, 0.0f); }
  const float* dq_row(int64_t r) const { return dq_.get() + r * E16_; }

 private:
  // dVᵀ += dYᵀ·(P∘m), dKᵀ += Qᵀ·dU from the pairs buffer; dQ += dU·K from
  // dU's rounded rows.
  void dv_product(int64_t nr, int64_t nkp, TileOrigin at) {
    const int64_t K = round_up(nr, ops_.kernel.kpad), col = i0_ + at.row, ldq = qo_.ldq;
    gemm_(Evr_, nkp, K, qo_.dyt.get() + (bh_ * Evr_ * ldq + col) * elem(), ldq, pairs_.get(), w_.kbp,
          dvt_.get() + at.key, KW_, 1.0f, true);
  }
  void dk_product(int64_t nr, int64_t nkp, TileOrigin at, const uint32_t* dspairs) {
    const int64_t K = round_up(nr, ops_.kernel.kpad), col = i0_ + at.row, ldq = qo_.ldq;
    gemm_(Er_, nkp, K, qo_.qt.get() + (bh_ * Er_ * ldq + col) * elem(), ldq, dspairs, w_.kbp,
          dkt_.get() + at.key, KW_, 1.0f, true);
  }
  void dq_product(int64_t nr, int64_t nkp, TileOrigin at) {
    const int64_t M = round_up(nr, ops_.kernel.mpad), K = round_up(nkp, ops_.kernel.kpad);
    gemm_(M, E16_, K, dsa_.get(), KW_, kpairs_.get() + at.key / 2 * E16_, E16_, dq_.get() + at.row * E16_, E16_,
          1.0f, true);
  }
  template <class T>
  static hwy::AlignedFreeUniquePtr<T[]> alloc(int64_t n) {
    auto a = hwy::AllocateAligned<T>(size_t(std::max<int64_t>(n, 1)));
    std::memset(static_cast<void*>(a.get()), 0, size_t(std::max<int64_t>(n, 1)) * sizeof(T));
    return a;
  }
  int64_t elem() const { return af_ ? 4 : 2; }
  // The bfloat16 bits of an A element (bits, or a bfloat16 value as float32).
  static uint32_t bits(uint16_t x) { return x; }
  static uint32_t bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u >> 16;  // a bfloat16 value: its low half is zero
  }
  // pack_keys on k rows (E2 apart) and vᵀ rows (ldvt apart) of A elements.
  template <class A>
  void PackKeys(const A* k, const A* vt, int64_t nk, bool rows) {
    const Problem& p = *c_.p;
    for (int64_t q = 0; q < E2_ / 2; ++q) {  // kfpairs[q][jj] = (K[jj][2q], K[jj][2q + 1])
      uint32_t* dst = kfpairs_.get() + q * KW_;
      for (int64_t jj = 0; jj < nk; ++jj) dst[jj] = bits(k[jj * E2_ + 2 * q]) | bits(k[jj * E2_ + 2 * q + 1]) << 16;
      std::fill(dst + nk, dst + KW_, 0u);
    }
    for (int64_t q = 0; q < Ev2_ / 2; ++q) {  // vpairs[q][jj] = (V[jj][2q], V[jj][2q + 1])
      uint32_t* dst = vpairs_.get() + q * KW_;
      const A* lo = vt + 2 * q * ops_.ldvt;
      const A* hi = lo + ops_.ldvt;
      int64_t jj = 0;
      if (2 * q + 1 < p.Ev)
        for (; jj < nk; ++jj) dst[jj] = bits(lo[jj]) | bits(hi[jj]) << 16;
      else if (2 * q < p.Ev)
        for (; jj < nk; ++jj) dst[jj] = bits(lo[jj]);
      std::fill(dst + jj, dst + KW_, 0u);
    }
    if (!rows) return;
    for (int64_t q = 0; q < KW_ / 2; ++q) {  // kpairs[q][e] = (K[2q][e], K[2q + 1][e])
      uint32_t* dst = kpairs_.get() + q * E16_;
      const A* lo = k + 2 * q * E2_;
      const A* hi = lo + E2_;
      int64_t e = 0;
      if (2 * q + 1 < nk)
        for (; e < p.E; ++e) dst[e] = bits(lo[e]) | bits(hi[e]) << 16;
      else if (2 * q < nk)
        for (; e < p.E; ++e) dst[e] = bits(lo[e]);
      std::fill(dst + e, dst + E16_, 0u);
    }
  }

  const FusedCall& c_;
  BackwardScratch& w_;
  const Bf16Operands& ops_;
  const Bf16BackwardOperands& qo_;
  Bf16Gemm gemm_;
  bool af_ = false;
  const float deferred_;  // the score scale left to P's pass (scores), or 1
  int64_t E2_ = 0, Evr_ = 0, Er_ = 0, Ev2_ = 0, E16_ = 0, QW_ = 0, KW_ = 0;
  int64_t bh_ = 0, i0_ = 0;  // the query block: (b·H + h), its first row
  hwy::AlignedFreeUniquePtr<uint32_t[]> kfpairs_, vpairs_, kpairs_, pairs_, dspairs_;
  hwy::AlignedFreeUniquePtr<std::byte[]> dsa_;
  hwy::AlignedFreeUniquePtr<float[]> dkt_, dvt_, dq_;
};

void BackwardBf16Impl(const Problem& p, const Bf16Operands& ops, const Bf16BackwardOperands& qo,
                      View4<const float> dout, const SdpaGrads<float>& g, View4<const float> out,
                      View3<const float> lse, FusedPlan t) {
  FusedCall c{&p, nullptr, t, float(p.rules.scale)};  // (the products read the call's operands from ops)
  c.bad_keys = ops.bad_keys.data();
  c.any_bad_keys = ops.any_bad_keys;
  BackwardUnits(c, t, dout, g, out, lse,
                [&](BackwardScratch& w) { return Bf16BackwardProducts(c, w, ops, qo); });
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_FUSED_BF16_INL_H_
