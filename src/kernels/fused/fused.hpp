// Internal: the entry points of the fused CPU backend (float32), called from
// the dispatch in src/sdpa.cpp after validation (and from tests and the
// benchmark). No SIMD types here: the kernels are compiled per target in
// fused.cpp and picked at run time.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"
#include "kernels/fused/tiles.hpp"
#include "kernels/problem.hpp"

namespace attn::detail {

void fused_forward(const Problem& p, const SdpaArgs<float>& a, View4<float> out,
                   View4<float> weights, View3<float> lse);
// out and lse are the forward's saved state; either may be empty, in which
// case the backend recomputes what it needs.
void fused_backward(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                    const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse);

// A backward's saved state: out and lse as given, the missing ones
// recomputed by forward(out, lse) into storage this holds.
struct SavedState {
  Tensor<float> out_tmp, lse_tmp;
  View4<const float> out;
  View3<const float> lse;
  template <class Forward>
  SavedState(const Problem& p, View4<const float> o, View3<const float> l, Forward forward) : out(o), lse(l) {
    if (!out.empty() && !lse.empty()) return;
    out_tmp = Tensor<float>({p.B, p.H, p.L, p.Ev});
    lse_tmp = Tensor<float>({p.B, p.H, p.L});
    View4<float> ov(out_tmp.data(), {p.B, p.H, p.L, p.Ev});
    View3<float> lv(lse_tmp.data(), {p.B, p.H, p.L});
    forward(ov, lv);
    if (out.empty()) out = ov;
    if (lse.empty()) lse = lv;
  }
};

// The same entry points with an explicit plan instead of fused_plan(p) (for
// tests and tuning). Any block sizes >= 1 work; fused_plan's promises
// (tiles.hpp) are about speed and scratch size, not correctness.
void fused_forward_tiled(const Problem& p, const SdpaArgs<float>& a, View4<float> out,
                         View4<float> weights, View3<float> lse, const FusedPlan& t);
void fused_backward_tiled(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                          const SdpaGrads<float>& g, View4<const float> out,
                          View3<const float> lse, const FusedPlan& t);

// One sequence of a packed batch (src/varlen.cpp) as a dense call of batch
// 1: its problem (every sequence has the same H, Hkv, E, Ev, options and
// thread count) and views into the packed tensors.
struct FusedSequence {
  Problem p;
  SdpaArgs<float> a;
  View4<float> out;    // forward: written
  View3<float> lse;    // forward: written when not empty
  View4<const float> dout, saved_out;  // backward: read
  View3<const float> saved_lse;        // backward: read (both saved views required)
  View4<float> dq, dk, dv;             // backward: written
};
// The sequences' units in one parallel region, on one plan (that of the
// longest sequence); results do not depend on the thread count. Sequences
// with no queries or no keys are the caller's (none may be passed).
void fused_forward_packed(const std::vector<FusedSequence>& seqs);
// The same on the plan made for plan_p, e.g. a part of a batch on the plan
// of the whole (fused_packed_plan_problem of all its sequences), which gives
// every sequence the bits it gets in one call with all of them.
void fused_forward_packed(const std::vector<FusedSequence>& seqs, const Problem& plan_p);
Problem fused_packed_plan_problem(const std::vector<FusedSequence>& seqs);
// dsinks (empty: not wanted) receives the sinks' gradient summed over all
// sequences.
void fused_backward_packed(const std::vector<FusedSequence>& seqs, View1<float> dsinks);
// The plan fused_forward_packed and fused_backward_packed use.
FusedPlan fused_packed_plan(const std::vector<FusedSequence>& seqs);

// Bytes of scratch each thread allocates for this plan on the SIMD target in
// use (the same ForwardScratch/BackwardScratch::bytes() the kernels allocate).
struct FusedScratchBytes {
  int64_t forward = 0;
  int64_t backward = 0;
};
FusedScratchBytes fused_scratch_bytes(const Problem& p, const FusedPlan& t);

// The SIMD target the kernels dispatch to on this machine (e.g. "AVX2").
const char* fused_target_name();
// The kernels' block product C[M×N] (+)= A·B with A(r, k) = A[r·ars + k·aks]
// and B, C row-major; N, ldb and ldc must be multiples of 16 (any target's
// lane count). Exposed for its test and for tuning.
void fused_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool accumulate);
// exp over n floats with the kernels' vectorised exp (for its accuracy test):
// valid for x <= 88, exactly 0 below -87.33 and for -inf.
void fused_exp(const float* x, float* y, int64_t n);
// 2^x over n floats with the forward's base-2 exponential: valid for
// x <= 127, exactly 0 below -126.5 and for -inf.
void fused_exp2(const float* x, float* y, int64_t n);
// tanh over n floats with the soft-cap's vectorised tanh: every float
// (±∞ give ±1, NaN stays NaN).
void fused_tanh(const float* x, float* y, int64_t n);

}  // namespace attn::detail
