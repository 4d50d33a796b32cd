// Internal: row-major matrix products with named parameters, backed by BLAS
// (OpenBLAS). No column-major argument juggling leaks out of this file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace attn::detail {

// C[M×N] = alpha · op(A)·op(B) + beta · C, all row-major.
//   op(A) is A[M×K] (lda >= K), or A stored [K×M] and transposed (lda >= M).
//   op(B) is B[K×N] (ldb >= N), or B stored [N×K] and transposed (ldb >= K).
// beta = 0 overwrites C (its old contents may be uninitialised).
struct GemmShape {
  int64_t M, N, K;
};
template <class T>
void gemm(GemmShape s, bool transpose_a, const T* A, int64_t lda, bool transpose_b, const T* B,
          int64_t ldb, T* C, int64_t ldc, T alpha = T(1), T beta = T(0));

// Plain triple loop with the same signature: the reference the BLAS path is
// tested against, and the fallback for tiny shapes.
template <class T>
void gemm_reference(GemmShape s, bool transpose_a, const T* A, int64_t lda, bool transpose_b,
                    const T* B, int64_t ldb, T* C, int64_t ldc, T alpha = T(1), T beta = T(0));

// db[j] += Σ_i C[i, j] for a row-major C (m, n) with leading dimension
// ldc, accumulated in double: the bias gradient of a linear map.
template <class T>
void add_column_sums(const T* C, int64_t m, int64_t n, int64_t ldc, T* db) {
  std::vector<double> s(static_cast<std::size_t>(n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) s[std::size_t(j)] += double(C[i * ldc + j]);
  for (int64_t j = 0; j < n; ++j) db[j] += T(s[std::size_t(j)]);
}

// Sets OpenBLAS's own thread count for the object's lifetime and restores
// the previous count afterwards. The training loop's products are small,
// and OpenBLAS's worker threads then only compete for the cores with the
// OpenMP threads the rest of attn uses (on the 2-core development machine
// `attn train --task recall` ran 4x slower with both pools active). The
// setting is process-wide: other threads' BLAS calls see it too.
class ScopedBlasThreads {
 public:
  explicit ScopedBlasThreads(int threads);
  ~ScopedBlasThreads();
  ScopedBlasThreads(const ScopedBlasThreads&) = delete;
  ScopedBlasThreads& operator=(const ScopedBlasThreads&) = delete;

 private:
  int saved_;
};

}  // namespace attn::detail
