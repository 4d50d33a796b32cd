// The BLAS-backed row-major GEMM against its plain triple-loop reference, on
// awkward shapes, every transpose combination, padded leading dimensions and
// alpha/beta.
#include "kernels/gemm/gemm.hpp"
#include "testing.hpp"

namespace {

using attn::detail::GemmShape;
using namespace attn::testing;

template <class T>
void check(int64_t M, int64_t N, int64_t K, bool ta, bool tb, T alpha, T beta, std::mt19937_64& rng) {
  const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 1, ldc = N + 2;
  auto A = random_tensor<T>({(ta ? K : M) * lda + 1}, rng);
  auto B = random_tensor<T>({(tb ? N : K) * ldb + 1}, rng);
  auto C0 = random_tensor<T>({M * ldc + 1}, rng);
  auto C1 = C0;
  attn::detail::gemm<T>({M, N, K}, ta, A.data(), lda, tb, B.data(), ldb, C0.data(), ldc, alpha, beta);
  attn::detail::gemm_reference<T>({M, N, K}, ta, A.data(), lda, tb, B.data(), ldb, C1.data(), ldc, alpha, beta);
  EXPECT_TRUE(all_close(C0, C1, tolerance<T>(K, 3.0 * std::sqrt(double(K) + 1)),
                        "gemm " + std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K) +
                            (ta ? " Ta" : "") + (tb ? " Tb" : "")));
}

TEST(Gemm, MatchesReference) {
  std::mt19937_64 rng(3);
  for (int64_t M : {1, 3, 17, 64})
    for (int64_t N : {1, 5, 33})
      for (int64_t K : {1, 7, 130})
        for (int t = 0; t < 4; ++t) {
          check<float>(M, N, K, t & 1, t & 2, 1.0f, 0.0f, rng);
          check<double>(M, N, K, t & 1, t & 2, 0.5, 2.0, rng);
        }
}

}  // namespace
