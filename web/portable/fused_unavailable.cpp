// The fused and decode kernels' entry points in the portable build (web/):
// Highway's run-time dispatch is not compiled here, so each one refuses with
// attn::Error. Nothing reaches them: the explainer asks every call for the
// reference backend.
#include "kernels/decode/decode.hpp"
#include "kernels/fused/fused.hpp"

namespace attn::detail {
namespace {
[[noreturn]] void unavailable(const char* what) {
  throw Error(std::string("attn: ") + what + " is not built into the portable (WebAssembly) build; use the reference backend");
}
}  // namespace

void fused_forward(const Problem&, const SdpaArgs<float>&, View4<float>, View4<float>, View3<float>) {
  unavailable("the fused backend");
}
void fused_backward(const Problem&, const SdpaArgs<float>&, View4<const float>, const SdpaGrads<float>&,
                    View4<const float>, View3<const float>) {
  unavailable("the fused backend");
}
bool decode_suits_dense(const Problem&) { return false; }
template <class T>
void decode_forward_dense(const Problem&, const SdpaArgs<T>&, View4<float>, View3<float>) {
  unavailable("the decode kernel");
}
template void decode_forward_dense<float>(const Problem&, const SdpaArgs<float>&, View4<float>, View3<float>);

}  // namespace attn::detail
