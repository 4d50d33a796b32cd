// The memory read bandwidth attn-decode-bench measures the machine with.
#pragma once

#include <cstdint>

namespace attn_bench {
// Best of `reps` passes in which `threads` threads each read their own slice
// of a `bytes`-byte buffer (much larger than the caches) once with vector
// loads; GB/s of wall time (1 GB = 1e9 bytes).
double read_bandwidth_gbs(int threads, int64_t bytes, int reps = 5);
}  // namespace attn_bench
