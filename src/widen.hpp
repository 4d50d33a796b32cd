// Internal: half inputs at the boundary (see "Precision" in attn/sdpa.hpp).
// A call with float16/bfloat16 q, k, v computes in float32 on the exactly
// widened values: the decode route reads half K and V in place (and widens
// q only, kernels/decode/plan.cpp); every other route widens q, k and v to
// float32 once, here, and runs the float32 kernels.
#pragma once

#include "attn/half.hpp"
#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"
#include "kernels/decode/decode.hpp"

namespace attn::detail {

// A contiguous float32 copy of a half view (exact), rows in parallel.
template <class T>
Tensor<float> widen(const View4<const T>& v, int threads) {
  auto t = Tensor<float>::uninitialized({v.dim(0), v.dim(1), v.dim(2), v.dim(3)});
  const int64_t n1 = v.dim(1), n2 = v.dim(2), F = v.dim(3), rows = v.dim(0) * n1 * n2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * F >= (int64_t(1) << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = &v(r / (n1 * n2), r / n2 % n1, r % n2, 0);
    float* dst = t.data() + r * F;
    if (v.strides[3] == 1)
      convert_from_storage(dtype_of<T>, src, F, dst);
    else
      for (int64_t e = 0; e < F; ++e) dst[e] = float(src[e * v.strides[3]]);
  }
  return t;
}

// The float32 call on the widened q, k, v; the other arguments are float32
// already and pass through.
template <class T>
struct Widened {
  Tensor<float> q, k, v;
  SdpaArgs<float> args;
  Widened(const SdpaArgs<T>& a, int threads)
      : q(widen(a.q, threads)), k(widen(a.k, threads)), v(widen(a.v, threads)) {
    static_cast<ScoreArgs<float>&>(args) = a;
    args.q = q.view4(), args.k = k.view4(), args.v = v.view4();
    args.key_lengths = a.key_lengths;
  }
};

}  // namespace attn::detail
