// The decode kernel's portable bfloat16 products, compiled per target with
// decode.cpp (included once per target after blocks-inl.h, so it has no
// ordinary include guard): float32 multiply-adds on the bfloat16-rounded
// operands in the arithmetic of decode/bf16.hpp, so that they give the bits
// of the AVX512_BF16 products (bf16_native.cpp) on every target. A block of
// 32 features is 16 lanes, the 16 / N vectors of N lanes side by side; a
// vector's lanes hold the pairs (2i, 2i + 1) of its 2N features, split into
// their even and odd elements.
#if defined(ATTN_KERNELS_DECODE_BF16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_DECODE_BF16_INL_H_
#undef ATTN_KERNELS_DECODE_BF16_INL_H_
#else
#define ATTN_KERNELS_DECODE_BF16_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/decode/bf16.hpp"
#include "kernels/fused/bf16_round-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

// At most 16 lanes (one block of 32 features); 4 on scalable vectors.
#if HWY_HAVE_SCALABLE
using DB = hn::FixedTag<float, 4>;
#else
using DB = hn::CappedTag<float, 16>;
#endif
using VB = hn::Vec<DB>;
using DBU = hn::RebindToUnsigned<DB>;
constexpr int kBLanes = int(hn::MaxLanes(DB()));
static_assert(16 % kBLanes == 0, "a block of 32 features is whole vectors");

// x with its bfloat16 value (the high half of RoundToBf16High's lanes).
HWY_INLINE VB RoundedBf16(VB x) { return hn::BitCast(DB(), hn::And(RoundToBf16High(x), hn::Set(DBU(), 0xFFFF0000u))); }
// bfloat16 values as the products read them: a subnormal is zero (DAZ).
HWY_INLINE VB FlushSubnormal(VB x) {
  const DBU du;
  const auto tiny = hn::Eq(hn::And(hn::BitCast(du, x), hn::Set(du, 0x7F800000u)), hn::Zero(du));
  return hn::IfThenZeroElse(hn::RebindMask(DB(), tiny), x);
}

// N elements of a row as float32 (exact).
HWY_INLINE VB Widened(const float* p) { return hn::LoadU(DB(), p); }
HWY_INLINE VB Widened(const hwy::float16_t* p) { return hn::PromoteTo(DB(), hn::LoadU(hn::Rebind<hwy::float16_t, DB>(), p)); }
HWY_INLINE VB Widened(const hwy::bfloat16_t* p) { return hn::PromoteTo(DB(), hn::LoadU(hn::Rebind<hwy::bfloat16_t, DB>(), p)); }
// ... as bfloat16 operands (bf16_operand), as float32.
template <class T>
HWY_INLINE VB Operands(const T* p) {
  if constexpr (std::is_same_v<T, hwy::bfloat16_t>) return FlushSubnormal(Widened(p));
  else return RoundedBf16(Widened(p));
}

// The operands of 2N features from p: even[i] = feature 2i, odd[i] = 2i + 1.
template <class T>
HWY_INLINE void OperandPairs(const T* p, VB& even, VB& odd) {
  const DB d;
  const DBU du;
  if constexpr (std::is_same_v<T, hwy::bfloat16_t>) {
    const auto u = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p));
    even = FlushSubnormal(hn::BitCast(d, hn::ShiftLeft<16>(u)));
    odd = FlushSubnormal(hn::BitCast(d, hn::And(u, hn::Set(du, 0xFFFF0000u))));
  } else {
#if HWY_TARGET == HWY_SCALAR  // one lane: the pair's two elements
    even = Operands(p);
    odd = Operands(p + 1);
#else
    const auto lo = hn::BitCast(du, Operands(p)), hi = hn::BitCast(du, Operands(p + kBLanes));
    even = hn::BitCast(d, hn::ConcatEven(du, hi, lo));
    odd = hn::BitCast(d, hn::ConcatOdd(du, hi, lo));
#endif
  }
}

// ---- scores: s[r] = alpha · q̂_r · k̂ for R rows and one key ------------------

template <int R, class T>
HWY_INLINE void ScoreKeyBf16(const uint16_t* HWY_RESTRICT q, int64_t ldq, const T* HWY_RESTRICT k, int64_t E,
                             float alpha, float* HWY_RESTRICT s, int64_t lds) {
  const DB d;
  constexpr int kV = 16 / kBLanes;
  VB acc[R][kV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = hn::Zero(d);
  HWY_ALIGN T tail[32];
  for (int64_t e = 0; e < E; e += 32) {
    const T* ke = k + e;
    if (E - e < 32) {  // the features past E are zeros (so are q's)
      std::memset(static_cast<void*>(tail), 0, sizeof(tail));
      std::memcpy(static_cast<void*>(tail), ke, size_t(E - e) * sizeof(T));
      ke = tail;
    }
    for (int v = 0; v < kV; ++v) {
      VB ke2, ko2;
      OperandPairs(ke + 2 * kBLanes * v, ke2, ko2);
      for (int r = 0; r < R; ++r) {
        VB qe, qo;
        OperandPairs(reinterpret_cast<const hwy::bfloat16_t*>(q + r * ldq + e) + 2 * kBLanes * v, qe, qo);
        acc[r][v] = hn::MulAdd(qo, ko2, acc[r][v]);  // the odd element first
        acc[r][v] = hn::MulAdd(qe, ke2, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    HWY_ALIGN float lanes[16];
    for (int v = 0; v < kV; ++v) hn::Store(acc[r][v], d, lanes + v * kBLanes);
    s[r * lds] = lane_sum16(lanes) * alpha;
  }
}

template <int R, class T>
HWY_INLINE void ScoreRowsBf16(const uint16_t* q, int64_t ldq, const T* k, int64_t krow, int64_t nk, int64_t E,
                              float alpha, float* s, int64_t lds, const RowPrefetch& pf) {
  for (int64_t j = 0; j < nk; ++j) {
    pf.rows(j, 1);
    ScoreKeyBf16<R>(q, ldq, k + j * krow, E, alpha, s + j, lds);
  }
}

// ---- values: o[r][:] += the key pairs' products ------------------------------

// One strip of NV vectors from feature e0; TAIL: one partial vector.
template <int R, int NV, bool TAIL, class T>
HWY_INLINE void ValueStripBf16(const uint32_t* HWY_RESTRICT pp, int64_t ldp, int64_t npairs, const T* const* v,
                               int64_t e0, int64_t Ev, float* HWY_RESTRICT o, int64_t ldo, const RowPrefetch& pf) {
  const DB d;
  VB acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = hn::LoadU(d, o + r * ldo + e0 + c * kBLanes);
  HWY_ALIGN T tail[2][16];
  const auto load = [&](const T* row, int c, int which) {
    if constexpr (TAIL) {
      std::memset(static_cast<void*>(tail[which]), 0, sizeof(tail[which]));
      std::memcpy(static_cast<void*>(tail[which]), row + e0, size_t(Ev - e0) * sizeof(T));
      return Operands(tail[which]);
    } else {
      return Operands(row + e0 + c * kBLanes);
    }
  };
  for (int64_t m = 0; m < npairs; ++m) {
    pf.rows(2 * m, 2);
    VB ve[NV], vo[NV];
    for (int c = 0; c < NV; ++c) ve[c] = load(v[2 * m], c, 0), vo[c] = load(v[2 * m + 1], c, 1);
    for (int r = 0; r < R; ++r) {
      const uint32_t pair = pp[r * ldp + m];
      const VB pe = hn::Set(d, bf16_value(uint16_t(pair & 0xFFFFu))), po = hn::Set(d, bf16_value(uint16_t(pair >> 16)));
      for (int c = 0; c < NV; ++c) {
        acc[r][c] = hn::MulAdd(po, vo[c], acc[r][c]);  // the odd key first
        acc[r][c] = hn::MulAdd(pe, ve[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) hn::StoreU(acc[r][c], d, o + r * ldo + e0 + c * kBLanes);
}

template <int R, int NV, class T>
HWY_INLINE void ValueStripsBf16(const uint32_t* pp, int64_t ldp, int64_t npairs, const T* const* v, int64_t& e0,
                                int64_t Ev, float* o, int64_t ldo, RowPrefetch& pf) {
  for (; e0 + NV * kBLanes <= Ev; e0 += NV * kBLanes, pf.a.p = nullptr)
    ValueStripBf16<R, NV, false>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
  if constexpr (NV > 1) ValueStripsBf16<R, NV / 2>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
}

// o rows padded to whole vectors (a tail strip stores one).
template <int R, class T>
HWY_INLINE void ValueRowsBf16(const uint32_t* pp, int64_t ldp, int64_t npairs, const T* const* v, int64_t Ev,
                              float* o, int64_t ldo, RowPrefetch pf) {
  int64_t e0 = 0;
  ValueStripsBf16<R, WidestStrip(R)>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
  if (e0 < Ev) ValueStripBf16<R, 1, true>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_DECODE_BF16_INL_H_
