// Internal: the entry points of the fused CPU backend (float32), called only
// from the dispatch in src/sdpa.cpp after validation.
#pragma once

#include "attn/sdpa.hpp"
#include "kernels/problem.hpp"

namespace attn::detail {

// Whether the fused backend is compiled in, and whether it handles this request.
bool fused_available();
bool fused_supports(const Problem& p, const SdpaArgs<float>& a, bool want_weights);

void fused_forward(const Problem& p, const SdpaArgs<float>& a, View4<float> out,
                   View4<float> weights, View3<float> lse);
// out and lse are the forward's saved state; either may be empty, in which
// case the backend recomputes what it needs.
void fused_backward(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                    const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse);

}  // namespace attn::detail
