// Placeholder until the fused backend lands: reports itself unavailable.
#include "attn/error.hpp"
#include "kernels/fused/fused.hpp"

namespace attn::detail {

bool fused_available() { return false; }
bool fused_supports(const Problem&, const SdpaArgs<float>&, bool) { return false; }
void fused_forward(const Problem&, const SdpaArgs<float>&, View4<float>, View4<float>, View3<float>) {
  throw Error("attn: the fused backend is not built into this version");
}
void fused_backward(const Problem&, const SdpaArgs<float>&, View4<const float>,
                    const SdpaGrads<float>&, View4<const float>, View3<const float>) {
  throw Error("attn: the fused backend is not built into this version");
}

}  // namespace attn::detail
