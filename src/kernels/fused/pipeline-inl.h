// The score pipeline, for one SIMD target: the rules of kernels/score_rules.hpp
// applied to one line of a score tile after the product, in the one
// documented order (soft-cap, ALiBi, the band, bias, mask), with the
// soft-cap's derivative for the backward. The SIMD twin of ScoreRules's
// scalar pipeline; every kernel that builds scores (the fused forward's
// transposed tiles and the backward's row tiles, scores-inl.h; the decode
// kernel's row tiles, kernels/decode/decode.cpp) calls it, and none composes
// a rule itself. Included once per target (no ordinary include guard).

// Per-target include guard, the Highway way (see attention-inl.h).
#if defined(ATTN_KERNELS_FUSED_PIPELINE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_FUSED_PIPELINE_INL_H_
#undef ATTN_KERNELS_FUSED_PIPELINE_INL_H_
#else
#define ATTN_KERNELS_FUSED_PIPELINE_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "kernels/fused/common.hpp"
#include "kernels/vec-inl.h"
#include "kernels/score_rules.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

// One line of a score tile: the scores of one query row against a run of
// keys (element t = key j0 + t), or of one key against a run of query rows
// (the forward's transposed tile: element t = row i0 + t).
// ALiBi along a tile line of n floats (n a multiple of the lane count):
// x[t] −= slope·|base + t|, where base + t is the signed distance between
// the query's position and the key (exact in float below 2^24).
HWY_INLINE void AlibiLine(float* x, int64_t n, float base, float slope) {
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
HWY_INLINE void SoftcapTile(float* x, int64_t n, float c, float* dcap) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const VF vc = hn::Set(d, c), inv = hn::Set(d, 1.0f / c), one = hn::Set(d, 1.0f);
  for (int64_t i = 0; i < n; i += N) {
    const VF t = Tanh(d, hn::Mul(hn::Load(d, x + i), inv));
    hn::Store(hn::Mul(vc, t), d, x + i);
    if (dcap) hn::Store(hn::NegMulAdd(t, t, one), d, dcap + i);
  }
}

struct ScoreLine {
  int64_t lo = 0, hi = 0;        // the elements the band leaves visible: [lo, hi)
  float distance = 0;            // ALiBi: element t is |distance + t| positions from its partner
  float slope = 0;               // the head's ALiBi slope (0: none)
  rules::Line<float> bias{};     // the elementwise operands along the line (base null: none),
  rules::Line<bool> mask{};      // element t at index `at` + t
  int64_t at = 0;
};

// x[0, n) (n a multiple of the lane count) through the call's rules, in
// the order of score_rules.hpp; `unit` is log2(e) when the scores are in
// base 2 (the forward and decode fold log2(e) into the query scale), else 1,
// and scales the soft-cap, the slope and the bias alike. With a soft-cap
// c > 0 and dcap non-null, dcap[t] receives ∂s/∂u = 1 − tanh² (the
// backward's). Elements outside [lo, hi), and those the mask or a −∞ bias
// hides, become −∞.
void ApplyScoreRules(float* x, int64_t n, const ScoreLine& l, const ScoreRules<float>& rules, float unit,
                     float* dcap) {
  constexpr float kHidden = -std::numeric_limits<float>::infinity();
  if (rules.capped()) SoftcapTile(x, n, float(rules.softcap) * unit, dcap);  // s = c·tanh(u / c)
  if (l.slope != 0.0f) AlibiLine(x, n, l.distance, l.slope * unit);          //   − slope·|pos_i − pos_j|
  std::fill(x, x + l.lo, kHidden);                                           // the band
  if (l.bias.base)
    for (int64_t t = l.lo; t < l.hi; ++t) {
      const float b = l.bias.at(l.at + t);
      x[t] = b == kHidden ? kHidden : x[t] + unit * b;                       //   + bias (−∞ hides)
    }
  if (l.mask.base)
    for (int64_t t = l.lo; t < l.hi; ++t)
      if (!l.mask.at(l.at + t)) x[t] = kHidden;                              // the mask
  std::fill(x + l.hi, x + n, kHidden);
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_FUSED_PIPELINE_INL_H_
