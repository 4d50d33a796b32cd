// Internal: the resolved shape of one attention call, shared by all backends.
// Built once by make_problem after the validation in src/sdpa.cpp; kernels
// trust it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attn/sdpa.hpp"
#include "kernels/score_rules.hpp"

namespace attn::detail {

struct Problem {
  int64_t B = 0, H = 0, Hkv = 0, L = 0, S = 0, E = 0, Ev = 0;
  double scale = 1.0;
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  std::optional<int64_t> position_offset;    // replaces the alignment when given
  int64_t window_left = -1, window_right = -1;  // −1: unbounded
  double softcap = 0;                          // 0: off
  int threads = 1;

  int64_t group() const { return H / Hkv; }  // query heads per key/value head
  int64_t kv_head(int64_t h) const { return h / group(); }

  // The position of query row 0 on the key axis (see score_rules.hpp).
  int64_t offset() const {
    return rules::query_offset(position_offset ? &*position_offset : nullptr,
                               align == CausalAlign::bottom_right, L, S);
  }
  // The band rule of a (batch, head) slice whose keys end at key_end.
  rules::Band band(int64_t key_end) const {
    return rules::Band::make(offset(), window_left, window_right, causal, key_end);
  }
  // Whether any rule beyond causal alignment and key lengths narrows the band.
  bool windowed() const { return window_left >= 0 || window_right >= 0 || position_offset.has_value(); }
};

// The problem of a call whose arguments passed the boundary's validation
// (src/sdpa.cpp): shapes from q, k, v; the default scale 1/sqrt(E) unless
// opt.scale; the thread count resolved and clamped (see SdpaOptions). Tests
// and benchmarks that call a kernel directly build their Problem with it too.
template <class T>
Problem make_problem(const SdpaArgs<T>& a, const SdpaOptions& opt);

// Index into a broadcastable axis: size-1 axes always read element 0.
inline int64_t bcast(int64_t idx, int64_t dim) { return dim == 1 ? 0 : idx; }

}  // namespace attn::detail
