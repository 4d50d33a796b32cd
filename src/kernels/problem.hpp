// Internal: the resolved shape and rules of one attention call, shared by
// every backend (reference, fused, decode, chunked prefill, varlen, ring).
// Built once at the boundary after validation (make_problem for a dense
// call, src/kv_cache.cpp for a call over a cache); kernels trust it.
#pragma once

#include <cstdint>

#include "attn/sdpa.hpp"
#include "kernels/dropout.hpp"
#include "kernels/score_rules.hpp"

namespace attn::detail {

// F: the compute type (float, or double for the reference backend).
template <class F>
struct ProblemOf {
  int64_t B = 0, H = 0, Hkv = 0, L = 0, S = 0, E = 0, Ev = 0;  // S: keys (a cache's capacity)
  ScoreRules<F> rules;
  Dropout dropout;  // of the probabilities (kernels/dropout.hpp); off by default
  // The products take bfloat16 operands (SdpaOptions::compute_dtype; the
  // fused forward's bfloat16 path, kernels/fused/bf16.hpp, and the decode
  // kernel's, kernels/decode/bf16.hpp); false: exact.
  bool bf16_products = false;
  int threads = 1;

  int64_t group() const { return H / Hkv; }  // query heads per key/value head
  int64_t kv_head(int64_t h) const { return h / group(); }
  // The band rule of sequence b.
  rules::Band band(int64_t b) const { return rules.band(b); }
  // The keys [lo, hi) query i of sequence b sees (lo and hi never decrease with i).
  rules::Keys keys(int64_t b, int64_t i) const { return rules.band(b).keys(i); }
  // Sequence b's keys [j0, j0 + n) as a problem of batch 1 (ScoreRules::keys_of).
  ProblemOf keys_of(int64_t b, int64_t j0, int64_t n) const {
    ProblemOf p = *this;
    p.B = 1, p.S = n;
    p.rules = rules.keys_of(b, j0, n);
    return p;
  }
};
using Problem = ProblemOf<float>;

// The problem of a dense call whose arguments passed the boundary's
// validation (src/sdpa.cpp): shapes from q, k, v, the rules resolved
// (resolve_rules) with key 0 at position key_origin, the thread count
// resolved and clamped (see SdpaOptions). Tests and benchmarks that call a
// kernel directly build their Problem with it too.
// Where a call sits in a larger one: its keys start at position `key` (the
// ring's blocks), its first sequence is sequence `batch` (a packed batch's
// per-sequence calls: the dropout's b).
struct Origin {
  int64_t key = 0, batch = 0;
};
template <class T>
ProblemOf<compute_t<T>> make_problem(const SdpaArgs<T>& a, const SdpaOptions& opt, Origin origin = {});

// Index into a broadcastable axis: size-1 axes always read element 0.
inline int64_t bcast(int64_t idx, int64_t dim) { return dim == 1 ? 0 : idx; }

}  // namespace attn::detail
