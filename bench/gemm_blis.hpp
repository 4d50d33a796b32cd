// BLIS as a candidate of attn-gemm-bench, loaded at run time: BLIS exports
// the same cblas_* and Fortran BLAS names as the OpenBLAS attn links, so it
// is opened privately (RTLD_LOCAL) and called through its own bli_sgemm.
#pragma once

#include <cstdint>
#include <string>

namespace attn_bench {

// Opens BLIS (Debian: libblis-openmp-dev) once; false, with the reason in
// *why, when it is not installed or the benchmark was built without blis.h.
// *arch gets the configuration BLIS chose for this CPU (bli_arch_string).
bool blis_open(std::string* arch, std::string* why);
void blis_set_threads(int threads);
// Row-major C[M×N] = op(A)·op(B), the arguments as detail::gemm takes them.
void blis_sgemm(int64_t M, int64_t N, int64_t K, bool ta, const float* A, int64_t lda, bool tb, const float* B,
                int64_t ldb, float* C, int64_t ldc);

}  // namespace attn_bench
