// The FMA-throughput loop attn-bench measures the machine's peak with.
#pragma once

namespace attn_bench {
// Best of three runs of `threads` threads doing nothing but vector FMAs for
// about `seconds` each; GFLOP/s of wall time (an FMA counts as two FLOPs).
// *per_cpu_second (if given) gets GFLOP per second of CPU time the process
// actually received, which does not depend on other load on the machine.
double fma_peak_gflops(int threads, double seconds, double* per_cpu_second = nullptr);
}  // namespace attn_bench
