// Internal: row-major matrix products with named parameters. No column-major
// argument juggling leaks out of kernels/gemm/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace attn::detail {

enum class Bf16Path;  // kernels/fused/bf16.hpp

// C[M×N] = alpha · op(A)·op(B) + beta · C, all row-major.
//   op(A) is A[M×K] (lda >= K), or A stored [K×M] and transposed (lda >= M).
//   op(B) is B[K×N] (ldb >= N), or B stored [N×K] and transposed (ldb >= K).
// beta = 0 overwrites C (its old contents may be uninitialised).
// `threads` OpenMP threads (0: the caller's OpenMP default) run the tiles of
// gemm_tiles; C's bits depend on the shape (and the CPU), never on `threads`.
struct GemmShape {
  int64_t M, N, K;
};
template <class T>
void gemm(GemmShape s, bool transpose_a, const T* A, int64_t lda, bool transpose_b, const T* B,
          int64_t ldb, T* C, int64_t ldc, T alpha = T(1), T beta = T(0), int threads = 0);

// The same product with the operands rounded to bfloat16 (bf16_operand of
// kernels/fused/bf16.hpp: nearest even, subnormals to signed zero, NaN
// kept) and float32 sums: what compute_dtype bfloat16 asks of the multi-head
// layer's projections. With AMX (bf16_best_path) the operands are rounded
// once into the tiles' layouts and each tile of C is one call of the fused
// kernels' AMX block product over all of K; elsewhere each tile is one
// single-threaded oneDNN matmul on bfloat16 sources (AVX512_BF16 where the
// CPU has it), or, where oneDNN has no bfloat16 matmul for the CPU, sgemm
// on the rounded values (their products are exact in float32). Same tiles
// as gemm: the same bits for any thread count.
// `bias` (N floats; nullptr: none) is added to every row of the product,
// C = op(A)·op(B) + bias, in the pass that writes each tile (alpha 1 and
// beta 0 only): a linear layer's output without a pass of its own.
void gemm_bf16(GemmShape s, bool transpose_a, const float* A, int64_t lda, bool transpose_b, const float* B,
               int64_t ldb, float* C, int64_t ldc, float alpha = 1.0f, float beta = 0.0f, int threads = 0,
               const float* bias = nullptr);
// gemm_bf16 on a given path (tests): amx and amx_emulated take the tiles,
// the others the library route.
void gemm_bf16_on(Bf16Path path, GemmShape s, bool transpose_a, const float* A, int64_t lda, bool transpose_b,
                  const float* B, int64_t ldb, float* C, int64_t ldc, float alpha, float beta, int threads,
                  const float* bias = nullptr);
// gemm, or gemm_bf16 when `bf16` (float only; double ignores it).
template <class T>
void gemm_as(bool bf16, GemmShape s, bool transpose_a, const T* A, int64_t lda, bool transpose_b, const T* B,
             int64_t ldb, T* C, int64_t ldc, T alpha, T beta, int threads) {
  if constexpr (std::is_same_v<T, float>)
    if (bf16) return gemm_bf16(s, transpose_a, A, lda, transpose_b, B, ldb, C, ldc, alpha, beta, threads);
  gemm<T>(s, transpose_a, A, lda, transpose_b, B, ldb, C, ldc, alpha, beta, threads);
}

// Plain triple loop with the same signature (less the threads), summing in
// double: the reference gemm is tested against, and the portable build's
// GEMM (ATTN_NO_BLAS).
template <class T>
void gemm_reference(GemmShape s, bool transpose_a, const T* A, int64_t lda, bool transpose_b,
                    const T* B, int64_t ldb, T* C, int64_t ldc, T alpha = T(1), T beta = T(0));

// How gemm cuts C into tiles: `rows` × `cols` blocks (the last ones in each
// direction smaller), each one an independent single-threaded product over
// all of K. Chosen from the shape and the CPU's `min_tile`, never from the
// thread count, so the thread count cannot change a bit of C. A side is
// halved (to a multiple of 16) while there are fewer than 16 tiles, each
// keeps at least 2^24 FLOPs, and each stays as large as a min_tile square in
// the sense 1/rows + 1/cols <= 2/min_tile; small products are one tile.
struct GemmTiles {
  int64_t rows, cols;
  int64_t count(GemmShape s) const { return ((s.M + rows - 1) / rows) * ((s.N + cols - 1) / cols); }
};
GemmTiles gemm_tiles(GemmShape s, int64_t min_tile);
// The smallest tile (as a square's side) the float library computes at full
// speed on this CPU: 256 with oneDNN's AVX-512 kernels, 640 otherwise (its
// AVX2 sgemm turns to kernels without packing once 1/rows + 1/cols reaches
// 0.0038, and those ran at a third of the speed on the layer's long-K tiles).
int64_t gemm_min_tile();

// What runs the float products, for the benchmarks' headers: the library,
// its version and the instruction set it chose for this CPU at run time.
const char* gemm_backend_description();

// db[j] += Σ_i C[i, j] for a row-major C (m, n) with leading dimension
// ldc, accumulated in double: the bias gradient of a linear map.
template <class T>
void add_column_sums(const T* C, int64_t m, int64_t n, int64_t ldc, T* db) {
  std::vector<double> s(static_cast<std::size_t>(n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) s[std::size_t(j)] += double(C[i * ldc + j]);
  for (int64_t j = 0; j < n; ++j) db[j] += T(s[std::size_t(j)]);
}

}  // namespace attn::detail
