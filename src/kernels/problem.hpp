// Internal: the resolved shape of one attention call, shared by all backends.
// Built once by make_problem after the validation in src/sdpa.cpp; kernels
// trust it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attn/sdpa.hpp"

namespace attn::detail {

struct Problem {
  int64_t B = 0, H = 0, Hkv = 0, L = 0, S = 0, E = 0, Ev = 0;
  double scale = 1.0;
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  int threads = 1;

  int64_t group() const { return H / Hkv; }  // query heads per key/value head
  int64_t kv_head(int64_t h) const { return h / group(); }

  // One past the last key query i may see under the causal rule (S if not
  // causal), clipped to [0, S].
  int64_t causal_end(int64_t i) const {
    if (!causal) return S;
    const int64_t end = align == CausalAlign::top_left ? i + 1 : i + 1 + (S - L);
    return std::clamp<int64_t>(end, 0, S);
  }
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
