// The FMA-throughput loop attn-bench measures the machine's peak with.
#pragma once

namespace attn_bench {
// Best of three runs of `threads` threads doing nothing but vector FMAs for
// about `seconds` each; GFLOP/s (an FMA counts as two FLOPs).
double fma_peak_gflops(int threads, double seconds);
}  // namespace attn_bench
