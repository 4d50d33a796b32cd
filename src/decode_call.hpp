// Internal: the steps of decode_attention (src/decode_call.cpp), for the
// callers that must check everything before they change the cache (the
// multi-head layer's decode, a model's decoding step over its layers) and
// then run the call themselves.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "attn/kv_cache.hpp"
#include "kernels/problem.hpp"
#include "validate.hpp"

namespace attn::detail {

// The rule operands and options of a call over a cache, with full = (B, H,
// L, C), C the capacity (check_rules, and position_offset refused: the
// positions come from the cache). The extents of the operands join `read`;
// returns the thread count.
int check_decode(const Checker& c, const ScoreArgs<float>& rules, const SdpaOptions& opt,
                 const std::array<int64_t, 4>& full, std::vector<Extent>& read);
// The computation over the cache as it is now (call after appending the new
// tokens), under the cache's shared lock: the problem of H heads × L new
// queries per sequence (positions and key lengths from the cache's
// lengths), then the reference backend on the cache read back, or the
// decode kernel (chunked prefill for many rows).
void decode_run(const KVCache& cache, const ScoreArgs<float>& rules, const SdpaOptions& opt, int64_t H, int64_t L,
                int threads, View4<const float> q, View4<float> out, View3<float> lse, Backend backend);

}  // namespace attn::detail
