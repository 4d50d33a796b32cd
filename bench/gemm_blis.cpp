// See gemm_blis.hpp. BLIS's strided API takes a row and a column stride per
// operand, so row-major storage and the transposes are strides, not flags.
#include "gemm_blis.hpp"

#include <dlfcn.h>

#ifdef ATTN_BENCH_BLIS
#include <blis.h>
#endif

namespace attn_bench {

#ifdef ATTN_BENCH_BLIS
namespace {
struct Blis {
  decltype(&bli_sgemm) sgemm = nullptr;
  decltype(&bli_thread_set_num_threads) set_threads = nullptr;
  decltype(&bli_arch_query_id) arch_id = nullptr;
  decltype(&bli_arch_string) arch_string = nullptr;
  decltype(&bli_init) init = nullptr;
};
Blis blis;
}  // namespace

bool blis_open(std::string* arch, std::string* why) {
  static void* lib = [] {
    void* h = dlopen("libblis.so.4", RTLD_NOW | RTLD_LOCAL);
    return h ? h : dlopen(ATTN_BENCH_BLIS_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  }();
  if (!lib) {
    *why = "BLIS not found (libblis.so.4, " ATTN_BENCH_BLIS_LIBRARY ")";
    return false;
  }
  blis.sgemm = reinterpret_cast<decltype(blis.sgemm)>(dlsym(lib, "bli_sgemm"));
  blis.set_threads = reinterpret_cast<decltype(blis.set_threads)>(dlsym(lib, "bli_thread_set_num_threads"));
  blis.arch_id = reinterpret_cast<decltype(blis.arch_id)>(dlsym(lib, "bli_arch_query_id"));
  blis.arch_string = reinterpret_cast<decltype(blis.arch_string)>(dlsym(lib, "bli_arch_string"));
  blis.init = reinterpret_cast<decltype(blis.init)>(dlsym(lib, "bli_init"));
  if (!blis.sgemm || !blis.set_threads || !blis.arch_id || !blis.arch_string || !blis.init) {
    *why = "BLIS lacks bli_sgemm, bli_init or its arch queries";
    return false;
  }
  blis.init();  // before the query: a configuration forced by BLIS_ARCH_TYPE is looked up in what it sets up
  *arch = blis.arch_string(blis.arch_id());
  return true;
}

void blis_set_threads(int threads) { blis.set_threads(threads); }

void blis_sgemm(int64_t M, int64_t N, int64_t K, bool ta, const float* A, int64_t lda, bool tb, const float* B,
                int64_t ldb, float* C, int64_t ldc) {
  float one = 1.0f, zero = 0.0f;
  // op(A)[i, k] sits at A + i·rsa + k·csa; likewise op(B) and C.
  blis.sgemm(BLIS_NO_TRANSPOSE, BLIS_NO_TRANSPOSE, M, N, K, &one, const_cast<float*>(A), ta ? 1 : lda,
             ta ? lda : 1, const_cast<float*>(B), tb ? 1 : ldb, tb ? ldb : 1, &zero, C, ldc, 1);
}
#else
bool blis_open(std::string*, std::string* why) {
  *why = "built without blis.h (Debian: libblis-openmp-dev)";
  return false;
}
void blis_set_threads(int) {}
void blis_sgemm(int64_t, int64_t, int64_t, bool, const float*, int64_t, bool, const float*, int64_t, float*,
                int64_t) {}
#endif

}  // namespace attn_bench
