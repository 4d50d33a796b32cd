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
// pairs (one pass over the tile, a few integer operations per score); the
// queries are paired once per unit, K and V once per call (bf16.cpp). The
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

// pp[k][r] = the pair (P[2k][r], P[2k + 1][r]) of the tile's nk probability
// rows (st, ld floats apart; rows past nk are zeros) for k < K / 2, r < nrp.
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

// ---- the unit's products ---------------------------------------------------------

// The bfloat16 products of one thread (see the top of this file); the
// path's per-thread set-up lives as long as the object.
class Bf16Products {
 public:
  Bf16Products(const FusedCall& c, ForwardScratch& w, const Bf16Operands& ops)
      : c_(c), w_(w), ops_(ops), gemm_(ops.kernel.gemm ? ops.kernel.gemm : &PortableBf16Gemm) {
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
  // height), then the score pipeline.
  void scores(int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t nrp, int64_t j0, int64_t nk) {
    const Problem& p = *c_.p;
    gemm_(round_up(nk, ops_.kernel.mpad), nrp, ops_.E2, ops_.k_rows(p, b, p.kv_head(h), j0), ops_.E2, w_.qp,
          w_.qbp, w_.st, w_.qbp, c_.scale * kLog2e, false);
    ScoreRulesT(c_, w_, b, h, i0, nr, nrp, j0, nk);
  }
  // oᵀ <- oᵀ·alpha + Vᵀ·Pᵀ with P rounded to bfloat16.
  void accumulate(int64_t b, int64_t h, int64_t nr, int64_t j0, int64_t nk) {
    const Problem& p = *c_.p;
    const DF d;
    const int64_t nrp = round_up(nr, Lanes()), qbp = w_.qbp;
    const float* alpha = w_.colv + 2 * qbp;
    for (int64_t e = 0; e < p.Ev; ++e)  // acc <- acc · alpha, per query (column)
      for (int64_t r = 0; r < nrp; r += Lanes())
        hn::Store(hn::Mul(hn::Load(d, w_.ot + e * qbp + r), hn::Load(d, alpha + r)), d, w_.ot + e * qbp + r);
    const int64_t K = round_up(nk, ops_.kernel.kpad);
    ProbabilityPairs(w_.st, qbp, nk, K, nrp, w_.pp);
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
};

void ForwardBf16Impl(const Problem& p, const Bf16Operands& ops, View4<float> out, View4<float> weights,
                     View3<float> lse, FusedPlan t) {
  FusedCall c{&p, nullptr, t, float(p.rules.scale)};
  c.bad_keys = ops.bad_keys.data();
  c.any_bad_keys = ops.any_bad_keys;
  ForwardUnits(c, t, out, weights, lse, [&](ForwardScratch& w) { return Bf16Products(c, w, ops); });
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_FUSED_BF16_INL_H_
