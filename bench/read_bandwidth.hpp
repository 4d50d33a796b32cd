// The memory read bandwidth attn-decode-bench measures the machine with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace attn_bench {
// Best of `reps` passes in which `threads` threads each read their own slice
// of a `bytes`-byte buffer (much larger than the caches) once with vector
// loads (1 GB = 1e9 bytes):
//   wall  bytes / wall time of the pass
//   cpu   bytes / (CPU time of the threads / threads): the rate had each
//         thread its core to itself, steadier on a loaded machine
struct ReadBandwidth {
  double wall = 0, cpu = 0;
};
ReadBandwidth read_bandwidth_gbs(int threads, int64_t bytes, int reps = 5);

// The same measurement one pass at a time, on a buffer allocated (and
// touched) once, so that a benchmark can alternate passes with the calls it
// times and compare the two under the same conditions. A pass also evicts
// the caches, so the call timed after it reads its data from memory.
class BandwidthProbe {
 public:
  BandwidthProbe(int threads, int64_t bytes);
  ~BandwidthProbe();
  BandwidthProbe(const BandwidthProbe&) = delete;
  BandwidthProbe& operator=(const BandwidthProbe&) = delete;
  ReadBandwidth pass() const;

 private:
  int threads_;
  int64_t slice_;
  std::size_t bytes_;  // of buf_
  float* buf_;
};

// One read of some runs of memory (n floats each from p, any alignment),
// their total split evenly over `threads` threads in order, each thread
// summing its part with vector loads: what any kernel that reads those bytes
// once costs at least. Returns the sum, so that no read can be dropped.
// Up to 4 vectors at the end of each thread's part of a run stay unread.
struct Run {
  const float* p;
  int64_t n;
};
float read_runs(const std::vector<Run>& runs, int threads);
}  // namespace attn_bench
