// The row-major GEMM (oneDNN for float, OpenBLAS for double, cut into tiles
// by gemm_tiles) against its plain triple-loop reference in double: awkward
// shapes, M/N/K = 1, every transpose combination, padded leading dimensions,
// alpha/beta, products of many tiles, several thread counts; and the same
// bits for any thread count.
#include <array>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "kernels/fused/bf16.hpp"
#include "kernels/gemm/gemm.hpp"
#include "simd_targets.hpp"
#include "testing.hpp"

namespace {

using attn::detail::gemm_tiles;
using attn::detail::GemmShape;
using namespace attn::testing;

// gemm against gemm_reference on one shape; the leading dimensions are padded
// (lda, ldb, ldc larger than the rows they hold) unless `tight`, and the
// padding must come back untouched (the comparison covers all of C's storage).
template <class T>
void check(int64_t M, int64_t N, int64_t K, bool ta, bool tb, T alpha, T beta, int threads, std::mt19937_64& rng,
           bool tight = false) {
  const int64_t pad = tight ? 0 : 1;
  const int64_t lda = (ta ? M : K) + 3 * pad, ldb = (tb ? K : N) + pad, ldc = N + 2 * pad;
  auto A = random_tensor<T>({(ta ? K : M) * lda + 1}, rng);
  auto B = random_tensor<T>({(tb ? N : K) * ldb + 1}, rng);
  auto C0 = random_tensor<T>({M * ldc + 1}, rng);
  auto C1 = C0;
  attn::detail::gemm<T>({M, N, K}, ta, A.data(), lda, tb, B.data(), ldb, C0.data(), ldc, alpha, beta, threads);
  attn::detail::gemm_reference<T>({M, N, K}, ta, A.data(), lda, tb, B.data(), ldb, C1.data(), ldc, alpha, beta);
  EXPECT_TRUE(all_close(C0, C1, tolerance<T>(K, 3.0 * std::sqrt(double(K) + 1)),
                        "gemm " + std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K) +
                            (ta ? " Ta" : "") + (tb ? " Tb" : "") + ", " + std::to_string(threads) + " threads"));
}

TEST(Gemm, MatchesReference) {
  std::mt19937_64 rng(3);
  for (int64_t M : {1, 3, 17, 64})
    for (int64_t N : {1, 5, 33})
      for (int64_t K : {1, 7, 130})
        for (int t = 0; t < 4; ++t) {
          check<float>(M, N, K, t & 1, t & 2, 1.0f, 0.0f, 1 + t % 2, rng);
          check<double>(M, N, K, t & 1, t & 2, 0.5, 2.0, 1 + t % 2, rng);
          check<float>(M, N, K, t & 1, t & 2, -1.5f, 0.25f, 3, rng, /*tight=*/true);
        }
}

// Products large enough to be cut into several tiles, whose sides are not
// multiples of the tiles' (the last row and column of tiles are partial),
// and thin ones (a single row or column of C over a long K).
TEST(Gemm, ManyTilesMatchReference) {
  std::mt19937_64 rng(5);
  const GemmShape shapes[] = {{1300, 1100, 64}, {257, 1031, 129}, {1, 2000, 3000}, {2000, 1, 3000}, {600, 600, 1}};
  for (const GemmShape& s : shapes)
    for (int t = 0; t < 4; ++t) {
      check<float>(s.M, s.N, s.K, t & 1, t & 2, 1.0f, t < 2 ? 0.0f : 1.0f, 2, rng);
      check<double>(s.M, s.N, s.K, t & 1, t & 2, 0.75, t < 2 ? 0.0 : -0.5, 3, rng);
    }
  EXPECT_GE(gemm_tiles({1300, 1100, 64}, attn::detail::gemm_min_tile()).count({1300, 1100, 64}), 2);  // tiled
}

// K = 0: C = beta·C (and beta = 0 clears C, whatever it held).
TEST(Gemm, EmptyReductionScalesC) {
  std::mt19937_64 rng(9);
  for (const float beta : {0.0f, 0.5f}) {
    auto C = random_tensor<float>({4 * 6}, rng);
    auto want = C;
    for (size_t i = 0; i < want.size(); ++i) want[i] *= beta;
    const float a = 1, b = 1;
    attn::detail::gemm<float>({4, 6, 0}, false, &a, 1, false, &b, 6, C.data(), 6, 2.0f, beta);
    EXPECT_TRUE(all_close(C, want, 0.0, "K = 0, beta " + std::to_string(beta)));
  }
}

// The tiles depend on the shape only, so C has the same bits for any thread
// count, tiled or not; both precisions, every transpose combination.
template <class T>
void same_bits(GemmShape s, bool ta, bool tb, std::mt19937_64& rng) {
  const auto A = random_tensor<T>({s.M * s.K}, rng), B = random_tensor<T>({s.K * s.N}, rng);
  const auto C0 = random_tensor<T>({s.M * s.N}, rng);
  attn::Tensor<T> one;
  for (const int threads : {1, 2, 3, 5}) {
    auto C = C0;
    attn::detail::gemm<T>(s, ta, A.data(), ta ? s.M : s.K, tb, B.data(), tb ? s.K : s.N, C.data(), s.N, T(1),
                          T(0.5), threads);
    if (threads == 1) {
      one = C;
      continue;
    }
    EXPECT_EQ(std::memcmp(C.data(), one.data(), C.size() * sizeof(T)), 0)
        << s.M << "x" << s.N << "x" << s.K << (ta ? " Ta" : "") << (tb ? " Tb" : "") << ": " << threads
        << " threads differ from one";
  }
}

TEST(Gemm, BitwiseIdenticalForAnyThreadCount) {
  std::mt19937_64 rng(11);
  for (const GemmShape s : {GemmShape{640, 576, 512}, GemmShape{96, 96, 5000}, GemmShape{33, 17, 9}})
    for (int t = 0; t < 4; ++t) {
      same_bits<float>(s, t & 1, t & 2, rng);
      same_bits<double>(s, t & 1, t & 2, rng);
    }
}

// The tiling rule, for both tile sizes the CPU may ask for: the tiles cover
// C; small products are one tile; a side is halved (to a multiple of 16)
// only while the tile stays as large as a min_tile square (1/rows + 1/cols
// <= 2/min_tile), into at most 16 tiles, except that a product with two
// tiles' work is cut in two while the sides stay at least half a min_tile;
// the layer's products are cut finely enough to share among several threads.
TEST(Gemm, TilesFollowTheRule) {
  const int64_t cpu = attn::detail::gemm_min_tile();
  EXPECT_TRUE(cpu == 256 || cpu == 640) << cpu;
  for (const int64_t min_tile : {int64_t(256), int64_t(640)})
    for (const GemmShape s : {GemmShape{1, 1, 1}, GemmShape{64, 64, 64}, GemmShape{800, 288, 96},
                              GemmShape{4096, 1536, 512}, GemmShape{512, 512, 4096}, GemmShape{4096, 2048, 6144},
                              GemmShape{1024, 1024, 4096}, GemmShape{3, 100000, 50}, GemmShape{300, 7, 100000}}) {
      const auto t = gemm_tiles(s, min_tile);
      const std::string what = std::to_string(s.M) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K) +
                               ", min_tile " + std::to_string(min_tile);
      EXPECT_GE(t.rows, 1) << what;
      EXPECT_GE(t.cols, 1) << what;
      EXPECT_LE(t.count(s), 16) << what;
      if (t.count(s) > 2) {
        EXPECT_LE(1.0 / double(t.rows) + 1.0 / double(t.cols), 2.0 / double(min_tile)) << what;
      }
      if (t.count(s) == 2) {  // a product too small to halve by the rule, but with two tiles' work
        const bool whole_below = double(min_tile) * double(s.M + s.N) > 2.0 * double(s.M) * double(s.N);
        EXPECT_TRUE(2 * std::min(t.rows, t.cols) >= min_tile || whole_below) << what;
      }
      if (t.count(s) > 1) {
        EXPECT_GE(2.0 * double(s.M) * double(s.N) * double(s.K) / double(t.count(s)), double(1 << 24)) << what;
      }
      if (t.rows < s.M) {
        EXPECT_EQ(t.rows % 16, 0) << what;
      }
      if (t.cols < s.N) {
        EXPECT_EQ(t.cols % 16, 0) << what;
      }
    }
  EXPECT_EQ(gemm_tiles({64, 64, 64}, 256).count({64, 64, 64}), 1);
  EXPECT_EQ(gemm_tiles({1, 1, 1}, 256).count({1, 1, 1}), 1);
  EXPECT_EQ(gemm_tiles({4096, 1536, 512}, 256).count({4096, 1536, 512}), 16);
  EXPECT_EQ(gemm_tiles({512, 512, 4096}, 256).count({512, 512, 4096}), 4);
  EXPECT_EQ(gemm_tiles({4096, 1536, 512}, 640).count({4096, 1536, 512}), 8);   // 1024 x 768
  EXPECT_EQ(gemm_tiles({1024, 1024, 4096}, 640).count({1024, 1024, 4096}), 2);  // 512 x 1024
  // Two tiles' work in two, not one: the smallest layer's weight gradients
  // (D = 256, 1024 rows), and with the AVX2 minimum the products whose whole
  // is below it too.
  EXPECT_EQ(gemm_tiles({256, 256, 1024}, 256).count({256, 256, 1024}), 2);
  EXPECT_EQ(gemm_tiles({256, 256, 1024}, 640).count({256, 256, 1024}), 2);
  EXPECT_EQ(gemm_tiles({512, 512, 4096}, 640).count({512, 512, 4096}), 2);  // 256 x 512
  const auto half = gemm_tiles({2048, 256, 256}, 640);  // 1024 x 256
  EXPECT_EQ(half.rows, 1024);
  EXPECT_EQ(half.cols, 256);
  // Still one tile: too little work for two (2^24 FLOPs each).
  EXPECT_EQ(gemm_tiles({256, 256, 128}, 640).count({256, 256, 128}), 1);
  EXPECT_EQ(gemm_tiles({1280, 1280, 8}, 640).count({1280, 1280, 8}), 1);
}

}  // namespace

// gemm_bf16: the operands rounded to bfloat16 (bf16_operand), float32 sums.
// Against the sum in double of the rounded operands' products, within
// float32's accumulation bound (K + 2)·2^-24·(|alpha|·Σ_k |a·b| + |beta·c|);
// and clearly apart from the float32 product (the rounding is really
// there); the same bits for any thread count; NaN reaches its row.
// Every route gemm_bf16 can take on this machine: the one it picks, and the
// AMX tiles' (emulated everywhere, native where the CPU has them).
std::vector<attn::detail::Bf16Path> gemm_bf16_routes() {
  using attn::detail::Bf16Path;
  std::vector<Bf16Path> r{attn::detail::bf16_best_path(), Bf16Path::amx_emulated};
  if (attn::detail::bf16_path_available(Bf16Path::amx) && r[0] != Bf16Path::amx) r.push_back(Bf16Path::amx);
  if (r[0] == Bf16Path::amx) r.push_back(Bf16Path::portable);  // the library route
  return r;
}

// One product on one route: the same bits for 1, 2 and 3 threads, within
// the bound of the rounded operands' sum in double (every step-th row and
// column), apart from float32's.
void check_rounded_product(attn::detail::Bf16Path path, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                           float alpha, float beta, int64_t lda, int64_t ldb, int64_t ldc, std::mt19937_64& rng,
                           int64_t step = 1) {
  const auto r = [](float x) { return double(attn::detail::bf16_value(attn::detail::bf16_operand(x))); };
  auto A = random_tensor<float>({(ta ? K : M) * lda}, rng);
  auto B = random_tensor<float>({(tb ? N : K) * ldb}, rng);
  auto C = random_tensor<float>({M * ldc}, rng);
  const auto C0 = C;
  attn::detail::gemm_bf16_on(path, {M, N, K}, ta, A.data(), lda, tb, B.data(), ldb, C.data(), ldc, alpha, beta, 2);
  for (int threads : {1, 3}) {
    auto again = C0;
    attn::detail::gemm_bf16_on(path, {M, N, K}, ta, A.data(), lda, tb, B.data(), ldb, again.data(), ldc, alpha, beta,
                               threads);
    ASSERT_EQ(std::memcmp(again.data(), C.data(), C.size() * sizeof(float)), 0) << M << " " << N << " " << K;
  }
  double worst = 0, apart = 0;
  for (int64_t i = 0; i < M; i += step)
    for (int64_t j = 0; j < N; j += step) {
      double exact = 0, mag = 0, f32 = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float a = ta ? A[size_t(k * lda + i)] : A[size_t(i * lda + k)];
        const float b = tb ? B[size_t(j * ldb + k)] : B[size_t(k * ldb + j)];
        exact += r(a) * r(b), mag += std::abs(r(a) * r(b)), f32 += double(a) * double(b);
      }
      const double c0 = C0[size_t(i * ldc + j)];
      const double want = alpha * exact + beta * c0;
      const double bound = double(K + 2) * 0x1p-24 * (std::abs(alpha) * mag + std::abs(beta * c0)) + 1e-30;
      worst = std::max(worst, std::abs(C[size_t(i * ldc + j)] - want) / bound);
      apart = std::max(apart, std::abs(alpha * f32 + beta * c0 - want));
    }
  ASSERT_LE(worst, 1.0) << M << "x" << N << "x" << K << " ta=" << ta << " tb=" << tb;
  if (M * N * K > 1000) {
    ASSERT_GT(apart, 1e-4) << "the operands were not rounded";
  }
}

TEST(GemmBf16, IsTheProductOfTheRoundedOperands) {
  for (const auto path : gemm_bf16_routes()) {
  SCOPED_TRACE(attn::detail::bf16_path_name(path));
  std::mt19937_64 rng(17);
  for (int64_t M : {1, 17, 300})
    for (int64_t N : {1, 33, 280})
      // K = 1101: two chunks of the AMX route with alpha 1 and beta 0, whose
      // whole blocks accumulate in C itself (K = 130: alpha 0.5, one chunk).
      for (int64_t K : {1, 7, 130, 513, 1101})
        for (int t = 0; t < 4; ++t) {
          if (K == 1101 && !(M == 17 && N == 33) && !(M == 300 && N == 280 && t == 0)) continue;  // (time)
          const bool ta = t & 1, tb = t & 2;
          // (300, 280, 1101): beta 1, whose whole blocks accumulate into C from the first chunk.
          const float alpha = K % 2 ? 1.0f : 0.5f, beta = M == 17 ? 0.25f : K == 1101 ? 1.0f : 0.0f;
          // C's rows 4 KiB apart at (300, 33): the library route's dense tiles, in place elsewhere.
          const int64_t lda = (ta ? M : K) + 1, ldb = (tb ? K : N) + 2, ldc = M == 300 && N == 33 ? 1024 : N + 1;
          check_rounded_product(path, M, N, K, ta, tb, alpha, beta, lda, ldb, ldc, rng);
        }
  // The library route: two tiles down and two across, the last ones partial (304 × 272
  // with AVX-512's minimum tile, 688 × 656 with AVX2's), each tile's slices of A and B
  // rounded by whichever threads get there first, shared with the tiles beside it; every
  // fifth row and column against the sum in double, all of C across thread counts. (The
  // AMX route packs its panels before its tiles run, and its emulation is slow.)
  if (path != attn::detail::Bf16Path::amx_emulated && path != attn::detail::Bf16Path::amx) {
    const int64_t side = attn::detail::gemm_min_tile(), M = 2 * side + 88, N = 2 * side + 8, K = side > 256 ? 64 : 300;
    const attn::detail::GemmTiles grid = attn::detail::gemm_tiles({M, N, K}, side);
    ASSERT_EQ(grid.count({M, N, K}), 4);
    ASSERT_TRUE(M % grid.rows != 0 && N % grid.cols != 0);
    for (int t = 0; t < 4; ++t)
      check_rounded_product(path, M, N, K, t & 1, t & 2, 1.0f, t == 3 ? 1.0f : 0.0f, (t & 1 ? M : K) + 3,
                            (t & 2 ? K : N) + 5, N, rng, 5);
  }
  // NaN in A's row 2 reaches C's row 2 only.
  auto A = random_tensor<float>({40 * 64}, rng), B = random_tensor<float>({64 * 48}, rng);
  A[2 * 64 + 5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> C(40 * 48, 0.0f);
  attn::detail::gemm_bf16_on(path, {40, 48, 64}, false, A.data(), 64, false, B.data(), 48, C.data(), 48, 1.0f, 0.0f,
                             0);
  for (int64_t i = 0; i < 40; ++i)
    for (int64_t j = 0; j < 48; ++j) ASSERT_EQ(std::isnan(C[size_t(i * 48 + j)]), i == 2) << i << " " << j;
  }
}

// gemm_bf16's bias: C = op(A)·op(B) + bias, every row, on every route;
// against the sum in double of the rounded operands' products plus the bias,
// within the same bound with |bias| added to the magnitude; the same bits
// for any thread count; the columns past N and C's other elements untouched;
// refused with alpha ≠ 1 or beta ≠ 0.
TEST(GemmBf16, AddsTheBiasToEveryRow) {
  for (const auto path : gemm_bf16_routes()) {
    SCOPED_TRACE(attn::detail::bf16_path_name(path));
    std::mt19937_64 rng(23);
    const auto r = [](float x) { return double(attn::detail::bf16_value(attn::detail::bf16_operand(x))); };
    // (70, 45, 1101): two chunks of the AMX route in padded blocks; (256, 256, 64): whole blocks in C itself.
    for (const auto& [M, N, K] : {std::array<int64_t, 3>{70, 45, 1101}, {256, 256, 64}, {5, 3, 0}})
      for (int t = 0; t < 4; ++t) {
        const bool ta = t & 1, tb = t & 2;
        const int64_t lda = (ta ? M : K) + 1, ldb = (tb ? K : N) + 2, ldc = N + 3;
        auto A = random_tensor<float>({std::max<int64_t>((ta ? K : M) * lda, 1)}, rng);
        auto B = random_tensor<float>({std::max<int64_t>((tb ? N : K) * ldb, 1)}, rng);
        const auto bias = random_tensor<float>({N}, rng);
        auto C = random_tensor<float>({M * ldc}, rng);
        const auto C0 = C;
        attn::detail::gemm_bf16_on(path, {M, N, K}, ta, A.data(), lda, tb, B.data(), ldb, C.data(), ldc, 1.0f, 0.0f,
                                   2, bias.data());
        for (int threads : {1, 3}) {
          auto again = C0;
          attn::detail::gemm_bf16_on(path, {M, N, K}, ta, A.data(), lda, tb, B.data(), ldb, again.data(), ldc, 1.0f,
                                     0.0f, threads, bias.data());
          ASSERT_EQ(std::memcmp(again.data(), C.data(), C.size() * sizeof(float)), 0) << M << " " << N << " " << K;
        }
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < ldc; ++j) {
            const float got = C[size_t(i * ldc + j)];
            if (j >= N) {
              ASSERT_EQ(got, C0[size_t(i * ldc + j)]) << "past N at " << i << " " << j;
              continue;
            }
            double want = bias[size_t(j)], mag = std::abs(want);
            for (int64_t k = 0; k < K; ++k) {
              const float a = ta ? A[size_t(k * lda + i)] : A[size_t(i * lda + k)];
              const float b = tb ? B[size_t(j * ldb + k)] : B[size_t(k * ldb + j)];
              want += r(a) * r(b), mag += std::abs(r(a) * r(b));
            }
            ASSERT_LE(std::abs(got - want), double(K + 2) * 0x1p-24 * mag + 1e-30)
                << M << "x" << N << "x" << K << " ta=" << ta << " tb=" << tb << " at " << i << " " << j;
          }
      }
    std::vector<float> a(4, 1.0f), b(4, 1.0f), c(4), bias(2, 1.0f);
    for (const auto& [alpha, beta] : {std::pair{0.5f, 0.0f}, {1.0f, 1.0f}})
      EXPECT_THROW(attn::detail::gemm_bf16_on(path, {2, 2, 2}, false, a.data(), 2, false, b.data(), 2, c.data(), 2,
                                              alpha, beta, 1, bias.data()),
                   std::logic_error);
  }
}

// The rows the bfloat16 products read: bf16_round_row and bf16_pair_rows give
// bf16_operand's bits element by element (nearest even, ties both ways, NaN
// kept and made quiet, subnormals to signed zeros, overflow to ±∞) and flag
// a row with ±∞ or NaN after rounding, on every SIMD target, with and
// without AVX512_BF16's conversion instruction (where the CPU has it), at
// every length and alignment.
TEST(Bf16Rounding, RowsAndPairsGiveTheScalarBits) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  const uint32_t specials[] = {0x7FC00000u, 0x7F800001u, 0xFFA00000u, 0x7F800000u, 0xFF800000u, 0x00000000u,
                               0x80000000u, 0x00000001u, 0x807FFFFFu, 0x00800000u, 0x3F808000u, 0x3F818000u,
                               0x3F80FFFFu, 0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F7F7FFFu, 0x3F807FFFu};
  std::vector<float> x(300), y(300);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = u(rng), y[i] = u(rng);
    if (i % 7 == 3) std::memcpy(&x[i], &specials[(i / 7) % std::size(specials)], 4);
    if (i % 11 == 5) std::memcpy(&y[i], &specials[(i / 11) % std::size(specials)], 4);
  }
  std::vector<float> m(x);  // x, y and a third row: the rows that pair
  m.insert(m.end(), y.begin(), y.end());
  for (size_t i = 0; i < x.size(); ++i) m.push_back(i % 5 == 1 ? y[i] * 1e-39f : x[(i * 7) % x.size()] * 3.0f);
  attn::testing::for_each_target([&](int64_t) {
    for (const int cvt : {0, 1})
      for (int64_t off : {0, 1, 5})
        for (int64_t n : {0, 1, 15, 16, 31, 32, 33, 64, 97, 250}) {
          SCOPED_TRACE("cvt " + std::to_string(cvt) + " offset " + std::to_string(off) + " n " + std::to_string(n));
          std::vector<uint16_t> bits(size_t(n) + 1, 0xABCD);
          const bool bad = attn::detail::bf16_round_row(x.data() + off, n, bits.data(), cvt);
          bool want_bad = false;
          for (int64_t j = 0; j < n; ++j) {
            const uint16_t w = attn::detail::bf16_operand(x[size_t(off + j)]);
            ASSERT_EQ(bits[size_t(j)], w) << j;
            want_bad = want_bad || (w & 0x7F80u) == 0x7F80u;
          }
          EXPECT_EQ(bits[size_t(n)], 0xABCD);  // nothing past the row
          EXPECT_EQ(bad, want_bad);
          // Three rows of 300 (x, y, z) pair as (x, y), then (z, zeros); two, as (x, y) only.
          for (const int64_t rows : {2, 3}) {
            const int64_t ldd = n + 3;
            std::vector<uint32_t> pairs(size_t(2 * ldd), 0xDEADBEEFu);
            attn::detail::bf16_pair_rows(m.data() + off, 300, rows, n, pairs.data(), ldd, cvt);
            for (int64_t r = 0; r < rows; r += 2)
              for (int64_t j = 0; j < n; ++j) {
                const uint32_t lo = attn::detail::bf16_operand(m[size_t(r * 300 + off + j)]);
                const uint32_t hi = r + 1 < rows ? attn::detail::bf16_operand(m[size_t((r + 1) * 300 + off + j)]) : 0u;
                ASSERT_EQ(pairs[size_t(r / 2 * ldd + j)], lo | hi << 16) << r << " " << j;
              }
            for (int64_t j = n; j < 2 * ldd; ++j) {
              if (j < ldd || j >= ldd + n || rows == 2) {
                EXPECT_EQ(pairs[size_t(j)], 0xDEADBEEFu) << j;
              }
            }
          }
        }
  });
}
