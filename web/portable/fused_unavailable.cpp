// The fused, bfloat16 and decode kernels' entry points in the portable build (web/):
// Highway's run-time dispatch is not compiled here, so each one refuses with
// attn::Error. Nothing reaches them: the explainer asks every call for the
// reference backend.
#include "attn/half.hpp"
#include "kernels/decode/decode.hpp"
#include "kernels/fused/bf16.hpp"
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
Bf16Path bf16_best_path() { return Bf16Path::portable; }
template <class T>
void fused_forward_bf16(const Problem&, const SdpaArgs<T>&, View4<float>, View4<float>, View3<float>, Bf16Path) {
  unavailable("bfloat16 compute");
}
template void fused_forward_bf16<float>(const Problem&, const SdpaArgs<float>&, View4<float>, View4<float>,
                                        View3<float>, Bf16Path);
template void fused_forward_bf16<float16_t>(const Problem&, const SdpaArgs<float16_t>&, View4<float>, View4<float>,
                                            View3<float>, Bf16Path);
template void fused_forward_bf16<bfloat16_t>(const Problem&, const SdpaArgs<bfloat16_t>&, View4<float>,
                                             View4<float>, View3<float>, Bf16Path);

}  // namespace attn::detail
