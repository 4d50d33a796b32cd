// The benchmarks' --target option: run the kernels on a SIMD target other
// than the best one the CPU supports (to measure every target a machine can
// run, as the tests run them all). Highway dispatches to the best target not
// disabled; on every architecture a better target has a lower bit.
#pragma once

#include <hwy/targets.h>

#include <cstdint>
#include <string>

namespace attn_bench {

// Disables every target better than `name` (as Highway prints it: AVX3,
// AVX2, SSE4, EMU128, ...); "best" or "" keeps them all. False when no
// target has that name or the CPU cannot run it.
inline bool limit_simd_target(const std::string& name) {
  if (name.empty() || name == "best") return true;
  for (int bit = 0; bit < 63; ++bit) {
    const int64_t t = int64_t(1) << bit;
    if (name != hwy::TargetName(t)) continue;
    if ((hwy::SupportedTargets() & t) == 0) return false;
    hwy::DisableTargets(t - 1);  // all lower bits: the better targets
    return true;
  }
  return false;
}

}  // namespace attn_bench
