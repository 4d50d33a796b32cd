// Internal: the reference backend. See sdpa_reference.cpp.
#pragma once

#include "attn/sdpa.hpp"
#include "kernels/problem.hpp"

namespace attn::detail {

template <class T>
void reference_forward(const ProblemOf<T>& p, const SdpaArgs<T>& a, View4<T> out, View4<T> weights,
                       View3<T> lse);

template <class T>
void reference_backward(const ProblemOf<T>& p, const SdpaArgs<T>& a, View4<const T> dout,
                        const SdpaGrads<T>& g);

}  // namespace attn::detail
