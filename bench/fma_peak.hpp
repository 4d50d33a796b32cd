// The FMA-throughput loop the benchmarks measure the machine's peak with,
// and the clock and CPU name they report beside it.
#pragma once

#include <string>

namespace attn_bench {
// Best of three runs of `threads` threads doing nothing but vector FMAs for
// about `seconds` each; GFLOP/s of wall time (an FMA counts as two FLOPs).
// *per_cpu_second (if given) gets GFLOP per second of CPU time the process
// actually received, which does not depend on other load on the machine.
double fma_peak_gflops(int threads, double seconds, double* per_cpu_second = nullptr);
// The same for AMX's TDPBF16PS (bfloat16 products, float32 sums): each
// thread runs four independent tile products on tiles held in registers,
// 16·16·32·2 FLOPs each. 0 where the CPU (or the OS) has no AMX.
double amx_peak_gflops(int threads, double seconds);
// The same for AVX512_BF16's VDPBF16PS on 512-bit vectors (32 products a
// call, float32 sums), 12 independent chains a thread. 0 without it.
double dpbf16_peak_gflops(int threads, double seconds);
// CPU time of all the process's threads (precise, unlike getrusage's ticks).
double cpu_seconds();
// The CPU's "model name" from /proc/cpuinfo ("unknown" without one).
std::string cpu_model();
}  // namespace attn_bench
