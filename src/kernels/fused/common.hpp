// Internal: the plain (non-SIMD) helpers every part of the fused kernels
// shares: what one call's units read, and the visibility rules of a row.
// Included by the per-target SIMD bodies and by code compiled once alike, so
// it holds no Highway types.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "attn/sdpa.hpp"
#include "kernels/fused/tiles.hpp"
#include "kernels/problem.hpp"

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
inline int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }

inline int64_t key_len(const FusedCall& c, int64_t b) {
  return c.a->key_lengths.empty() ? c.p->S : c.a->key_lengths(b);
}
// One past the last key row i sees (causal rule and key length).
inline int64_t row_end(const FusedCall& c, int64_t b, int64_t i) {
  return std::min(c.p->causal_end(i), key_len(c, b));
}
// The first query row that sees key j under the causal rule (L if none).
inline int64_t first_row_seeing(const Problem& p, int64_t j) {
  if (!p.causal) return 0;
  const int64_t off = p.align == CausalAlign::top_left ? 0 : p.S - p.L;
  return std::clamp<int64_t>(j - off, 0, p.L);
}

// Whether a float is NaN or ±∞ (without the library call).
inline bool non_finite(float x) { return !(x - x == 0.0f); }

}  // namespace attn::detail
