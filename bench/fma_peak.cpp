// The machine's FMA throughput, measured: every thread runs independent
// fused multiply-add chains on the widest vectors the CPU has (Highway's
// run-time dispatch), enough chains to hide the FMA latency.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "fma_peak.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/highway.h>
#include <omp.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>

#include "fma_peak.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn_bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Runs `iters` rounds of 12 independent FMAs; returns a value that depends on
// every chain so the compiler cannot drop them. Adds the FLOPs done to *flops.
float FmaChains(int64_t iters, float seed, double* flops) {
  const hn::ScalableTag<float> d;
  const auto a = hn::Set(d, 0.999999f), b = hn::Set(d, 1e-7f * seed);
  // Every chain starts from its own value: chains that start equal compute
  // equal values, and the compiler folds them into one latency-bound chain.
  auto c0 = hn::Set(d, seed), c1 = hn::Set(d, seed + 1), c2 = hn::Set(d, seed + 2),
       c3 = hn::Set(d, seed + 3), c4 = hn::Set(d, seed + 4), c5 = hn::Set(d, seed + 5),
       c6 = hn::Set(d, seed + 6), c7 = hn::Set(d, seed + 7), c8 = hn::Set(d, seed + 8),
       c9 = hn::Set(d, seed + 9), c10 = hn::Set(d, seed + 10), c11 = hn::Set(d, seed + 11);
  for (int64_t i = 0; i < iters; ++i) {
    c0 = hn::MulAdd(c0, a, b);
    c1 = hn::MulAdd(c1, a, b);
    c2 = hn::MulAdd(c2, a, b);
    c3 = hn::MulAdd(c3, a, b);
    c4 = hn::MulAdd(c4, a, b);
    c5 = hn::MulAdd(c5, a, b);
    c6 = hn::MulAdd(c6, a, b);
    c7 = hn::MulAdd(c7, a, b);
    c8 = hn::MulAdd(c8, a, b);
    c9 = hn::MulAdd(c9, a, b);
    c10 = hn::MulAdd(c10, a, b);
    c11 = hn::MulAdd(c11, a, b);
  }
  const auto s = hn::Add(hn::Add(hn::Add(c0, c1), hn::Add(c2, c3)),
                         hn::Add(hn::Add(hn::Add(c4, c5), hn::Add(c6, c7)),
                                 hn::Add(hn::Add(c8, c9), hn::Add(c10, c11))));
  *flops += double(iters) * 12.0 * 2.0 * double(hn::Lanes(d));
  return hn::GetLane(s);
}

}  // namespace HWY_NAMESPACE
}  // namespace attn_bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn_bench {
HWY_EXPORT(FmaChains);

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

double fma_peak_gflops(int threads, double seconds, double* per_cpu_second) {
  // Calibrate the iteration count on one thread, then run all threads at once.
  double f = 0;
  int64_t iters = 1 << 16;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile float sink = HWY_DYNAMIC_DISPATCH(FmaChains)(iters, 1.0f, &f);
    (void)sink;
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > seconds / 4) {
      iters = int64_t(double(iters) * seconds / dt);
      break;
    }
    iters *= 2;
  }
  double best = 0, best_cpu = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double total = 0;
    const double c0 = cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      double mine = 0;
      volatile float sink = HWY_DYNAMIC_DISPATCH(FmaChains)(iters, 1.0f + float(omp_get_thread_num()), &mine);
      (void)sink;
      total += mine;
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double dc = cpu_seconds() - c0;
    if (total / dt > best) best = total / dt;
    if (dc > 0 && total / dc > best_cpu) best_cpu = total / dc;
  }
  if (per_cpu_second) *per_cpu_second = best_cpu * 1e-9;
  return best * 1e-9;
}

}  // namespace attn_bench

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "kernels/fused/bf16.hpp"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
namespace attn_bench {
namespace {
// `iters` rounds of four TDPBF16PS on tiles 0-3 (C) from 4, 5 (A) and 6, 7
// (B), all loaded once; returns the FLOPs done.
double AmxChains(int64_t iters) {
  struct Config {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } cfg;
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));  // the whole 64 bytes (see bf16_products.cpp)
  alignas(64) static const uint16_t ones[16 * 32] = {};  // zeros: the products' values do not matter
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[16 * 16];
  _tile_stored(0, c, 64);
  _tile_release();
  return double(iters) * 4 * 16 * 16 * 32 * 2 + double(c[0]) * 0;
}
}  // namespace
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16")
namespace {
// `iters` rounds of 12 independent VDPBF16PS on 512-bit vectors (16 lanes,
// two bfloat16 products each); returns the FLOPs done.
double DpChains(int64_t iters) {
  __m512 c[12];
  for (int i = 0; i < 12; ++i) c[i] = _mm512_set1_ps(float(i));
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x3380);  // 1, 2^-24
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) c[i] = _mm512_dpbf16_ps(c[i], a, b);
  }
  float sum = 0;
  for (int i = 0; i < 12; ++i) sum += _mm512_reduce_add_ps(c[i]);
  return double(iters) * 12 * 16 * 2 * 2 + double(sum) * 0;
}
}  // namespace
#pragma GCC pop_options

// Best of three runs of `threads` threads each calling chains(iters), iters
// calibrated on one thread to take about `seconds`; GFLOP/s of wall time.
template <class Chains>
double ChainsPeak(int threads, double seconds, Chains chains) {
  int64_t iters = 1 << 14;
  for (;;) {  // calibrate on one thread
    const auto t0 = std::chrono::steady_clock::now();
    volatile double sink = chains(iters);  // (used, so the call is not dropped)
    (void)sink;
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > seconds / 4) {
      iters = int64_t(double(iters) * seconds / dt);
      break;
    }
    iters *= 2;
  }
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double total = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    total += chains(iters);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, total / dt);
  }
  return best * 1e-9;
}

double amx_peak_gflops(int threads, double seconds) {
  using attn::detail::Bf16Path;
  if (!attn::detail::bf16_path_available(Bf16Path::amx)) return 0;  // also asks the OS for the tile state
  return ChainsPeak(threads, seconds, AmxChains);
}

double dpbf16_peak_gflops(int threads, double seconds) {
  using attn::detail::Bf16Path;
  if (!attn::detail::bf16_path_available(Bf16Path::avx512_bf16)) return 0;
  return ChainsPeak(threads, seconds, DpChains);
}
}  // namespace attn_bench
#else
namespace attn_bench {
double amx_peak_gflops(int, double) { return 0; }
double dpbf16_peak_gflops(int, double) { return 0; }
}  // namespace attn_bench
#endif
#endif
