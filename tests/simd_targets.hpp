// The fused kernels are compiled for several SIMD targets and one is picked
// at run time (HWY_DYNAMIC_DISPATCH); the tests run them on every compiled
// target this CPU can execute.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <hwy/targets.h>

#include "kernels/fused/fused.hpp"

namespace attn::testing {

// The kernels are compiled for several SIMD targets and one is picked at run
// time; this machine runs only the best. Highway can pretend the CPU supports
// fewer targets: runs fn once on every compiled target this CPU can execute
// (down to the portable EMU128 one) and returns their names.
template <class Fn>
inline std::string for_each_target(Fn fn) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  EXPECT_FALSE(targets.empty());
  std::string names;
  for (const int64_t t : targets) {
    if (t == HWY_SSSE3) continue;  // not compiled into the library (cmake/attn_kernels.cmake)
    hwy::SetSupportedTargetsForTest(t);
    hwy::GetChosenTarget().Update(hwy::SupportedTargets());
    EXPECT_STREQ(attn::detail::fused_target_name(), hwy::TargetName(t));
    names += std::string(names.empty() ? "" : ", ") + attn::detail::fused_target_name();
    SCOPED_TRACE(hwy::TargetName(t));
    fn(t);
  }
  hwy::SetSupportedTargetsForTest(0);  // back to what the CPU really has
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  return names;
}

}  // namespace attn::testing
