// Internal: the plain (non-SIMD) helpers every part of the fused kernels
// shares: what one call's units read (q, k, v from the args; every score
// rule from the problem's ScoreRules, kernels/score_rules.hpp).
// Included by the per-target SIMD bodies and by code compiled once alike, so
// it holds no Highway types.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "attn/sdpa.hpp"
#include "kernels/fused/tiles.hpp"
#include "kernels/problem.hpp"

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace attn::detail {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Everything the units of one call share (read-only).
struct FusedCall {
  const Problem* p;
  const SdpaArgs<float>* a;
  FusedPlan t;
  float scale;
  // Keys whose K or V row holds NaN or ±∞ (mark_bad_keys), and whether any does.
  const uint8_t* bad_keys = nullptr;
  bool any_bad_keys = false;

  bool bad_key(int64_t b, int64_t hk, int64_t j) const {
    return any_bad_keys && bad_keys[(b * p->Hkv + hk) * p->S + j];
  }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Whether the rows of a (B, Hx, N, F) view are adjacent (row j + 1 starts
// where row j ends), so a block of them is one dense matrix.
inline bool rows_adjacent(const View4<const float>& X) { return X.strides[3] == 1 && X.strides[2] == X.dim(3); }
inline int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }

// The band rule of batch b (score_rules.hpp: causal, window, chunks, key length).
inline rules::Band band_of(const FusedCall& c, int64_t b) { return c.p->band(b); }

// Flush to zero, for one thread, while it lives: a result below the smallest
// normal float (2^-126, about 1.2e-38) becomes 0. Every parallel region of
// the fused and decode kernels opens one per thread. The softmax makes such results
// all the time when scores spread widely (per-head slopes, long rows): a
// probability near 2^-126 times a gradient below 1, or added to a zeroed
// accumulator. On Intel cores each subnormal result takes a microcode
// assist, which slows such a backward by a fifth; the values lost are below
// 2^-126, where the exponentials already return exactly 0. Inputs are read as they are (no
// denormals-are-zero), NaN and ±inf are untouched, and the mode is put back
// when the guard ends, so the caller's threads keep theirs.
class FlushToZero {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  FlushToZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8000u); }  // MXCSR.FZ
  ~FlushToZero() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#else
  FlushToZero() = default;  // other architectures: results as the FPU gives them
#endif
 public:
  FlushToZero(const FlushToZero&) = delete;
  FlushToZero& operator=(const FlushToZero&) = delete;
};

// Whether a float is NaN or ±∞ (without the library call).
inline bool non_finite(float x) { return !(x - x == 0.0f); }

}  // namespace attn::detail
