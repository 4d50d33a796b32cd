// The rounding of float32 lanes to bfloat16 operands (bf16.hpp's
// bf16_operand), for one SIMD target: shared by the fused forward's
// bfloat16 products (bf16-inl.h) and the decode kernel's (decode/bf16-inl.h).
// Included once per target; no ordinary include guard.
#if defined(ATTN_KERNELS_FUSED_BF16_ROUND_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_FUSED_BF16_ROUND_INL_H_
#undef ATTN_KERNELS_FUSED_BF16_ROUND_INL_H_
#else
#define ATTN_KERNELS_FUSED_BF16_ROUND_INL_H_
#endif

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;

// The bfloat16 bits of float32 lanes (bf16.hpp's bf16_operand) in the high
// half of each 32-bit lane: nearest even, NaN kept quiet, subnormal → ±0.
template <class V>
HWY_INLINE auto RoundToBf16High(V x) {
  const hn::DFromV<V> d;
  const hn::RebindToUnsigned<decltype(d)> du;
  const auto u = hn::BitCast(du, x);
  const auto rounded = hn::Add(u, hn::Add(hn::Set(du, 0x7FFFu), hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u))));
  const auto nan = hn::Or(u, hn::Set(du, 0x00400000u));
  const auto zero = hn::And(u, hn::Set(du, 0x80000000u));
  const auto is_nan = hn::RebindMask(du, hn::IsNaN(x));  // (Ne(x, x) is an ordered compare: false for NaN)
  const auto tiny = hn::Eq(hn::And(u, hn::Set(du, 0x7F800000u)), hn::Zero(du));
  return hn::IfThenElse(tiny, zero, hn::IfThenElse(is_nan, nan, rounded));
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_FUSED_BF16_ROUND_INL_H_
