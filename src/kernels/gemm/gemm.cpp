// Row-major GEMM through CBLAS. CBLAS takes the layout explicitly
// (CblasRowMajor), so arguments stay in the reader's order: C = op(A)·op(B).
// A portable build without BLAS (ATTN_NO_BLAS: the WebAssembly explainer in
// web/) runs the plain loops of gemm_reference instead.
#include "kernels/gemm/gemm.hpp"

#ifndef ATTN_NO_BLAS
#include <cblas.h>
#endif

#include <type_traits>

namespace attn::detail {

template <class T>
void gemm_reference(GemmShape s, bool ta, const T* A, int64_t lda, bool tb, const T* B, int64_t ldb,
                    T* C, int64_t ldc, T alpha, T beta) {
  for (int64_t i = 0; i < s.M; ++i)
    for (int64_t j = 0; j < s.N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < s.K; ++k) {
        const double a = ta ? A[k * lda + i] : A[i * lda + k];
        const double b = tb ? B[j * ldb + k] : B[k * ldb + j];
        acc += a * b;
      }
      T& c = C[i * ldc + j];
      c = beta == T(0) ? T(alpha * acc) : T(alpha * acc + double(beta) * double(c));
    }
}

template <class T>
void gemm(GemmShape s, bool ta, const T* A, int64_t lda, bool tb, const T* B, int64_t ldb, T* C,
          int64_t ldc, T alpha, T beta) {
  if (s.M == 0 || s.N == 0) return;
#ifdef ATTN_NO_BLAS
  return gemm_reference(s, ta, A, lda, tb, B, ldb, C, ldc, alpha, beta);
#else
  if (s.K == 0) return gemm_reference(s, ta, A, lda, tb, B, ldb, C, ldc, alpha, beta);
  const auto op_a = ta ? CblasTrans : CblasNoTrans, op_b = tb ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, op_a, op_b, int(s.M), int(s.N), int(s.K), alpha, A, int(lda), B,
                int(ldb), beta, C, int(ldc));
  else
    cblas_dgemm(CblasRowMajor, op_a, op_b, int(s.M), int(s.N), int(s.K), alpha, A, int(lda), B,
                int(ldb), beta, C, int(ldc));
#endif
}

#ifdef ATTN_NO_BLAS
ScopedBlasThreads::ScopedBlasThreads(int threads) : saved_(threads) {}
ScopedBlasThreads::~ScopedBlasThreads() { (void)saved_; }  // no BLAS threads to restore
#else
ScopedBlasThreads::ScopedBlasThreads(int threads) : saved_(openblas_get_num_threads()) {
  openblas_set_num_threads(threads);
}
ScopedBlasThreads::~ScopedBlasThreads() { openblas_set_num_threads(saved_); }
#endif

template void gemm<float>(GemmShape, bool, const float*, int64_t, bool, const float*, int64_t,
                          float*, int64_t, float, float);
template void gemm<double>(GemmShape, bool, const double*, int64_t, bool, const double*, int64_t,
                           double*, int64_t, double, double);
template void gemm_reference<float>(GemmShape, bool, const float*, int64_t, bool, const float*,
                                    int64_t, float*, int64_t, float, float);
template void gemm_reference<double>(GemmShape, bool, const double*, int64_t, bool, const double*,
                                     int64_t, double*, int64_t, double, double);

}  // namespace attn::detail
