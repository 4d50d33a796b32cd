// `attn sdpa --context-parallel ring|ulysses`: the same command split over the
// processes of mpirun (apps/dist.cpp, built when attn::dist is).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attn/sdpa.hpp"

#include "common.hpp"

namespace attn::cli {

struct ContextParallelSdpa {
  std::string q, k, v, out, lse, strategy, backend;
  double scale = 0;  // 0 = default
  bool causal = false;
  bool mask = false, weights = false;  // requested (refused: not supported across processes)
  // Sets the variant options (window, softcap, position offset) and the
  // per-head ALiBi slopes and sinks for H heads, as the single-process command does.
  std::function<void(int64_t H, SdpaOptions&, SdpaArgs<float>&, std::vector<float>& slopes, std::vector<float>& sinks)>
      variants;
};

#ifdef ATTN_HAVE_DIST
void run_sdpa_context_parallel(const ContextParallelSdpa& r);
#else
[[noreturn]] inline void run_sdpa_context_parallel(const ContextParallelSdpa&) {
  throw Unavailable("attn sdpa: --context-parallel needs attn built with MPI (install libopenmpi-dev, "
                    "reconfigure; see docs/distributed.md)");
}
#endif

}  // namespace attn::cli
