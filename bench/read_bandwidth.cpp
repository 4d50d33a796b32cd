// The machine's memory read bandwidth, measured: every thread sums its slice
// of a large buffer with several independent vector accumulators (enough
// loads in flight to keep the memory system busy), on the widest vectors
// the CPU has (Highway's run-time dispatch). Decoding reads the KV cache
// once per step; this is the rate it can at best read it at. The buffer
// comes from the cache's own allocator (huge pages where the system allows
// them), so both are read through the same kind of pages.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "read_bandwidth.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>

#include "attn/detail/memory.hpp"

#include "read_bandwidth.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn_bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Σ p[0..n) with four accumulators (up to 4 vectors at the end unread); any
// alignment (unaligned loads cost nothing extra on aligned data).
float SumFloats(const float* HWY_RESTRICT p, int64_t n) {
  const hn::ScalableTag<float> d;
  const int64_t N = int64_t(hn::Lanes(d));
  auto a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 4 * N <= n; i += 4 * N) {
    a0 = hn::Add(a0, hn::LoadU(d, p + i));
    a1 = hn::Add(a1, hn::LoadU(d, p + i + N));
    a2 = hn::Add(a2, hn::LoadU(d, p + i + 2 * N));
    a3 = hn::Add(a3, hn::LoadU(d, p + i + 3 * N));
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
}

}  // namespace HWY_NAMESPACE
}  // namespace attn_bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn_bench {
HWY_EXPORT(SumFloats);

static double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

BandwidthProbe::BandwidthProbe(int threads, int64_t bytes) : threads_(std::max(threads, 1)) {
  const int64_t n = bytes / 4 / 1024 * 1024;
  slice_ = n / threads_ / 64 * 64;  // 256-byte aligned slices
  bytes_ = size_t(n) * 4;
  buf_ = static_cast<float*>(attn::detail::allocate_streamed(bytes_));
  // Each thread touches (first-touch places pages near it) its own slice.
#pragma omp parallel num_threads(threads_)
  {
    float* s = buf_ + int64_t(omp_get_thread_num()) * slice_;
    std::fill(s, s + slice_, 1.0f);
  }
}

BandwidthProbe::~BandwidthProbe() { attn::detail::free_streamed(buf_, bytes_); }

ReadBandwidth BandwidthProbe::pass() const {
  const double pass_bytes = double(slice_) * threads_ * 4;
  float total = 0;
  double cpu = 0;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads_) reduction(+ : total, cpu)
  {
    const double c0 = thread_cpu_seconds();
    total += HWY_DYNAMIC_DISPATCH(SumFloats)(buf_ + int64_t(omp_get_thread_num()) * slice_, slice_);
    cpu += thread_cpu_seconds() - c0;
  }
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float sink = total;
  (void)sink;
  return {pass_bytes / dt * 1e-9, pass_bytes / (cpu / threads_) * 1e-9};
}

ReadBandwidth read_bandwidth_gbs(int threads, int64_t bytes, int reps) {
  const BandwidthProbe probe(threads, bytes);
  ReadBandwidth best;
  for (int rep = 0; rep < reps; ++rep) {
    const ReadBandwidth r = probe.pass();
    best.wall = std::max(best.wall, r.wall);
    best.cpu = std::max(best.cpu, r.cpu);
  }
  return best;
}

float read_runs(const std::vector<Run>& runs, int threads) {
  int64_t total = 0;
  for (const Run& r : runs) total += r.n;
  threads = std::max(threads, 1);
  float sum = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
  {
    const int64_t t = omp_get_thread_num();
    int64_t lo = total * t / threads, hi = total * (t + 1) / threads;  // this thread's part of the concatenation
    int64_t at = 0;                                                      // where the current run starts in it
    for (const Run& r : runs) {
      const int64_t a = std::max(lo, at), b = std::min(hi, at + r.n);
      if (a < b) sum += HWY_DYNAMIC_DISPATCH(SumFloats)(r.p + (a - at), b - a);
      at += r.n;
    }
  }
  return sum;
}

}  // namespace attn_bench
#endif
