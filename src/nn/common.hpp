// Internal helpers shared by the nn layer: shape checks with named errors and
// the small loops every layer needs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/tensor.hpp"
#include "kernels/gemm/gemm.hpp"

namespace attn::nn {

// Reallocates t (zeroed) unless it already has this shape.
template <class T>
void ensure_shape(Tensor<T>& t, const std::vector<int64_t>& shape) {
  if (t.shape() != shape) t = Tensor<T>(shape);
}

// Checks that x is a (M, width) matrix and returns M.
template <class T>
int64_t rows_of(const Tensor<T>& x, int64_t width, const char* fn, const char* name) {
  if (x.rank() != 2 || x.dim(1) != width)
    throw InvalidArgument(std::string(fn) + ": argument '" + name + "' has shape " + shape_str(x.shape()) +
                          ", expected (M, " + std::to_string(width) + ")");
  return x.dim(0);
}

// out[j] += Σ_m x[m, j] for a (M, n) matrix (the GEMM helpers' column sum).
template <class T>
void add_column_sums(const Tensor<T>& x, int64_t M, int64_t n, Tensor<T>& out) {
  attn::detail::add_column_sums(x.data(), M, n, n, out.data());
}

inline void check_tokens(const int32_t* tokens, int64_t M, int64_t vocab, const char* fn) {
  for (int64_t m = 0; m < M; ++m)
    if (tokens[m] < 0 || tokens[m] >= vocab)
      throw InvalidArgument(std::string(fn) + ": token id " + std::to_string(tokens[m]) + " at position " +
                  std::to_string(m) + " is outside [0, vocab = " + std::to_string(vocab) + ")");
}

}  // namespace attn::nn
