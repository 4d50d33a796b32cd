// Vector math shared by the fused and decode kernels, for one SIMD target
// (included once per target, Highway-style, so no ordinary include guard):
// the softmax's two exponentials (natural for the fused backward, base 2 for
// the forward and decode), cheaper than a general exp because their
// arguments are known to be <= 0 or −∞; tanh for the soft-cap; a row scale.
// Everything here is inline, so a kernel that uses part of it compiles no
// unused function.

// Per-target include guard, the Highway way (see kernels/fused/attention-inl.h).
#if defined(ATTN_KERNELS_VEC_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_VEC_INL_H_
#undef ATTN_KERNELS_VEC_INL_H_
#else
#define ATTN_KERNELS_VEC_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>

#include "kernels/fused/online_softmax.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
namespace os = online_softmax;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

inline int64_t Lanes() { return int64_t(hn::Lanes(DF())); }

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

// x·a rounded to float32 before anything is added to it: the empty asm
// statement on its register keeps the compiler from contracting it with a
// following add into a fused multiply-add (GCC contracts by default in
// C++), which would skip that rounding. For a scale applied later than the
// product it belongs to, with the bits the product's own scaling gives.
HWY_INLINE VF MulRounded(VF x, VF a) {
  VF y = hn::Mul(x, a);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  asm("" : "+v"(y.raw));
#elif HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128
  asm("" : "+x"(y.raw));
#else
  volatile float sink[hn::MaxLanes(DF())];  // elsewhere through memory
  for (size_t i = 0; i < hn::Lanes(DF()); ++i) sink[i] = hn::ExtractLane(y, i);
  HWY_ALIGN float back[hn::MaxLanes(DF())];
  for (size_t i = 0; i < hn::Lanes(DF()); ++i) back[i] = sink[i];
  y = hn::Load(DF(), back);
#endif
  return y;
}

// c[0]·x^(N−1) + c[1]·x^(N−2) + … + c[N−1] by Horner's rule.
template <size_t N>
HWY_INLINE VF Horner(DF d, VF x, const float (&c)[N]) {
  VF p = hn::Set(d, c[0]);
#pragma GCC unroll 8
  for (size_t i = 1; i < N; ++i) p = hn::MulAdd(p, x, hn::Set(d, c[i]));
  return p;
}

// 2^n·y for the two exponentials below, where n is an integer taken as the
// float t − 1.5·2^23 (t = 1.5·2^23 + n: its last bit is worth 1, so its bits
// are those of 1.5·2^23 plus n). On AVX-512 one VSCALEFPS (kScalef): the
// nearest float to 2^n·y, 0 far enough below the normal range, and the
// callers clamp their argument low enough that −∞ gives exactly 0.
// Elsewhere the bits of t shifted up 23 places, plus 127's, are the
// exponent of 2^n (1.5·2^23's bits end in 22 zeros), all zero for n = −127
// (2^n taken as 0): the callers clamp so that n >= −127. No float-to-integer
// conversion, whose overflow fix-ups cost more than the conversion itself;
// a NaN x stays NaN (RestoreNaN).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr bool kScalef = true;
HWY_INLINE VF TimesPow2(DF, VF, VF y, VF, VF n) { return VF{_mm512_scalef_ps(y.raw, n.raw)}; }
#else
constexpr bool kScalef = false;
HWY_INLINE VF TimesPow2(DF d, VF x, VF y, VF t, VF) {
  const hn::RebindToSigned<DF> di;
  const auto e = hn::ShiftLeft<23>(hn::Add(hn::BitCast(di, t), hn::Set(di, 127)));  // 2^n, 0 for n = −127
  return RestoreNaN(x, hn::Mul(y, hn::BitCast(d, e)));
}
#endif

// exp for the softmax, where arguments are s − max <= 0 (or −∞), or s − lse
// a rounding error above 0: valid for x <= 88, within a few ulp of exp on
// [−87.3, 88], exactly 0 for −∞, and below −87.33 (where exp(x) is below the
// smallest normal float) a subnormal or 0. Cephes's range reduction
// x = n·ln2 + r, |r| <= ln2/2, and its degree-7 polynomial for exp(r); about
// 15 vector operations against ~25 for Highway's general Exp. n is
// x·log2(e) rounded to nearest by adding 1.5·2^23 and taking it away again
// (as Exp2Softmax does), then 2^n·exp(r) by TimesPow2, with x clamped at
// −120 for VSCALEFPS (2^-173: 0), else at −88 (n >= −127). (The backward
// with bfloat16 products, B=1, H=8, L=S=4096, E=128, two threads, on an
// Emerald Rapids: 122 against 113-118 ms before the scaling.)
HWY_INLINE VF ExpSoftmax(DF d, VF x) {
  constexpr float kPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                             4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  const VF magic = hn::Set(d, 12582912.0f);  // 1.5·2^23
  const VF xc = ClampBelow(d, x, kScalef ? -120.0f : -88.0f);  // −∞ kept out of r and n (NaN stays)
  const VF t = hn::MulAdd(xc, hn::Set(d, 1.44269504088896341f), magic);
  const VF n = hn::Sub(t, magic);
  VF r = hn::NegMulAdd(n, hn::Set(d, 0.693359375f), xc);  // r = x − n·ln2, ln2 in two parts
  r = hn::NegMulAdd(n, hn::Set(d, -2.12194440e-4f), r);
  const VF p = Horner(d, r, kPoly);
  return TimesPow2(d, x, hn::MulAdd(p, hn::Mul(r, r), hn::Add(r, hn::Set(d, 1.0f))), t, n);  // 2^n·exp(r)
}

// 2^x for the forward's softmax, whose scores are in base 2 (log2(e) is
// folded into the query scale), so x = s − shift needs no multiply before the
// split x = n + f, n an integer and |f| <= 1/2 (exact in float). 2^f is a
// degree-5 polynomial with constant term 1 (2^0 = 1 exactly), fitted for
// relative error (minimax on a dense grid: 9e-8; within 2 ulp with float
// rounding, tests/test_fused.cpp measures 4 as its bound). Valid for
// x <= 127; −∞ gives exactly 0, below −126.5 a subnormal or 0.
// n comes from two adds, t = x + 1.5·2^23 (n rounded to nearest even, what
// a round instruction gives, at a cost of two uops on port 0 of Intel's
// AVX-512 cores) and t − 1.5·2^23 = n exactly; 2^n·2^f by TimesPow2, with x
// clamped at −160 for VSCALEFPS (0 below about −150), else at −127 (0 below
// −126.5). (The scaling instruction and the degree-5 polynomial took the
// bfloat16 forward at B=1, H=8, L=S=4096, E=64, one thread, on an Emerald
// Rapids from 61.6-62.3 ms to 57.4-57.5.)
HWY_INLINE VF Exp2Softmax(DF d, VF x) {
  constexpr float kPoly[] = {1.3274990120e-3f, 9.6718461659e-3f, 5.5506927358e-2f, 2.4022234778e-1f,
                             6.9314701769e-1f, 1.0f};
  const VF magic = hn::Set(d, 12582912.0f);  // 1.5·2^23
  const VF xc = ClampBelow(d, x, kScalef ? -160.0f : -127.0f);  // −∞ kept out of f and n (NaN stays)
  const VF t = hn::Add(xc, magic);
  const VF n = hn::Sub(t, magic);
  return TimesPow2(d, x, Horner(d, hn::Sub(xc, n), kPoly), t, n);
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

// row[0, n) ·= f (n a multiple of the lane count).
HWY_INLINE void ScaleRow(float* row, int64_t n, float f) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const VF vf = hn::Set(d, f);
  for (int64_t j = 0; j < n; j += N) hn::Store(hn::Mul(hn::Load(d, row + j), vf), d, row + j);
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_VEC_INL_H_
