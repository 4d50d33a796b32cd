// The fused backend's per-target compilation and run-time dispatch.
//
// Highway's foreach_target.h re-includes this file once per SIMD target
// (AVX-512, AVX2, SSE4, portable EMU128; SSSE3 is disabled in
// cmake/attn_kernels.cmake), each time with a different HWY_NAMESPACE, so the
// bodies in simd-inl.h and attention-inl.h are compiled for each target.
// HWY_EXPORT collects the per-target entry points into tables, and the
// functions of fused.hpp pick the best one the CPU supports
// (HWY_DYNAMIC_DISPATCH). The plan and the scratch layouts are compiled once
// (tiles.cpp).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused/fused.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/highway.h>

#include "attn/tensor.hpp"
#include "kernels/fused/attention-inl.h"
#include "kernels/fused/fused.hpp"
#include "kernels/fused/simd-inl.h"
#include "kernels/fused/tiles.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }
int64_t LanesImpl() { return Lanes(); }

void GemmImpl(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B,
              int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  Gemm(M, N, K, A, ars, aks, B, ldb, C, ldc, accumulate);
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

HWY_EXPORT(ForwardImpl);
HWY_EXPORT(BackwardImpl);
HWY_EXPORT(ExpArray);
HWY_EXPORT(Exp2Array);
HWY_EXPORT(TanhArray);
HWY_EXPORT(TargetNameImpl);
HWY_EXPORT(LanesImpl);
HWY_EXPORT(GemmImpl);

void fused_forward_tiled(const Problem& p, const SdpaArgs<float>& a, View4<float> out,
                         View4<float> weights, View3<float> lse, const FusedPlan& t) {
  HWY_DYNAMIC_DISPATCH(ForwardImpl)(p, a, out, weights, lse, t);
}

void fused_forward(const Problem& p, const SdpaArgs<float>& a, View4<float> out,
                   View4<float> weights, View3<float> lse) {
  fused_forward_tiled(p, a, out, weights, lse, fused_plan(p));
}

void fused_backward_tiled(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                          const SdpaGrads<float>& g, View4<const float> out,
                          View3<const float> lse, const FusedPlan& t) {
  // The saved state; recomputed by a forward pass when not given.
  Tensor<float> out_tmp, lse_tmp;
  if (out.empty() || lse.empty()) {
    out_tmp = Tensor<float>({p.B, p.H, p.L, p.Ev});
    lse_tmp = Tensor<float>({p.B, p.H, p.L});
    View4<float> o(out_tmp.data(), {p.B, p.H, p.L, p.Ev});
    View3<float> l(lse_tmp.data(), {p.B, p.H, p.L});
    fused_forward_tiled(p, a, o, {}, l, t);
    if (out.empty()) out = o;
    if (lse.empty()) lse = l;
  }
  HWY_DYNAMIC_DISPATCH(BackwardImpl)(p, a, dout, g, out, lse, t);
}

void fused_backward(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                    const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse) {
  fused_backward_tiled(p, a, dout, g, out, lse, fused_plan(p));
}

FusedScratchBytes fused_scratch_bytes(const Problem& p, const FusedPlan& t) {
  const int64_t lanes = HWY_DYNAMIC_DISPATCH(LanesImpl)();
  return {ForwardScratch(p, t, lanes, Alloc::no).bytes(), BackwardScratch(p, t, lanes, Alloc::no).bytes()};
}

const char* fused_target_name() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }

void fused_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(GemmImpl)(M, N, K, A, ars, aks, B, ldb, C, ldc, accumulate);
}

void fused_exp(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(ExpArray)(x, y, n); }

void fused_exp2(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(Exp2Array)(x, y, n); }

void fused_tanh(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(TanhArray)(x, y, n); }

}  // namespace attn::detail
#endif  // HWY_ONCE
