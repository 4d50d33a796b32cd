// The AMX block product, written once against a tile interface `Tiles`
// (included twice by bf16_products.cpp, no include guard: once for the
// native instructions inside their target region, once for the plain C++
// emulation the tests run on every machine).
//
// Tiles:: config(TileConfig), release(), load<t>(ptr, stride bytes),
// store<t>(ptr, stride bytes), zero<t>(), dp<c, a, b>() (TDPBF16PS:
// C[m][n] += Σ_k A[m][2k]·B[k][2n] + A[m][2k+1]·B[k][2n+1]).
//
// One configuration for every product: eight tiles of 16 rows × 64 bytes.
// tmm0..3 hold a 2 × 2 block of C (32 rows × 32 floats), tmm4..5 two
// 16-row slices of A (32 bfloat16 of K each), tmm6..7 two 16-pair-row
// slices of B (16 dwords, i.e. 16 columns, each). Per 32 elements of K a
// block loads two A and two B tiles and runs four TDPBF16PS; C is loaded
// (accumulate) or zeroed once per block and stored once. M must be a
// multiple of 16 (mpad), K of 32 (kpad), N of 16.

struct TileConfig {
  uint8_t palette = 0, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "the tile configuration is 64 bytes");

template <class Tiles>
void AmxBegin() {
  TileConfig cfg;
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  Tiles::config(cfg);
}

template <class Tiles>
void AmxEnd() {
  Tiles::release();
}

// One block of MT × NT C tiles at C (rows of ldc floats): the edges of
// AmxGemm, at most one of MT, NT 2 (whole 2 × 2 blocks: AmxBlocks22).
template <class Tiles, int MT, int NT>
void AmxBlock(int64_t K, const uint16_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C, int64_t ldc,
              float alpha, bool accumulate) {
  const int64_t sc = ldc * 4, sa = lda * 2, sb = ldb * 4;  // strides in bytes
  float* c1 = C + 16;
  float* c2 = C + 16 * ldc;
  float* c3 = c2 + 16;
  if (accumulate) {
    Tiles::template load<0>(C, sc);
    if constexpr (NT > 1) Tiles::template load<1>(c1, sc);
    if constexpr (MT > 1) Tiles::template load<2>(c2, sc);
    if constexpr (MT > 1 && NT > 1) Tiles::template load<3>(c3, sc);
  } else {
    Tiles::template zero<0>();
    if constexpr (NT > 1) Tiles::template zero<1>();
    if constexpr (MT > 1) Tiles::template zero<2>();
    if constexpr (MT > 1 && NT > 1) Tiles::template zero<3>();
  }
  // Each operand tile of the next 32 elements of K is loaded as soon as the
  // last product reading its register has been issued (tile registers are
  // not renamed: a load waits for the products before it that read its
  // register), so the loads overlap the remaining products of the step.
  Tiles::template load<4>(A, sa);
  if constexpr (MT > 1) Tiles::template load<5>(A + 16 * lda, sa);
  Tiles::template load<6>(B, sb);
  if constexpr (NT > 1) Tiles::template load<7>(B + 16, sb);
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const bool more = k0 + 32 < K;
    Tiles::template dp<0, 4, 6>();
    if constexpr (MT > 1) Tiles::template dp<2, 5, 6>();
    if (more) Tiles::template load<6>(B + ((k0 + 32) / 2) * ldb, sb);
    if constexpr (NT > 1) Tiles::template dp<1, 4, 7>();
    if (more) Tiles::template load<4>(A + k0 + 32, sa);
    if constexpr (MT > 1 && NT > 1) Tiles::template dp<3, 5, 7>();
    if constexpr (MT > 1) if (more) Tiles::template load<5>(A + 16 * lda + k0 + 32, sa);
    if constexpr (NT > 1) if (more) Tiles::template load<7>(B + ((k0 + 32) / 2) * ldb + 16, sb);
  }
  Tiles::template store<0>(C, sc);
  if constexpr (NT > 1) Tiles::template store<1>(c1, sc);
  if constexpr (MT > 1) Tiles::template store<2>(c2, sc);
  if constexpr (MT > 1 && NT > 1) Tiles::template store<3>(c3, sc);
  if (accumulate || alpha == 1.0f) return;  // (a product by 1 is the value itself)
  for (int64_t r = 0; r < 16 * MT; ++r)  // C = alpha·(A·B), one rounding as on the other paths
    for (int64_t n = 0; n < 16 * NT; ++n) C[r * ldc + n] *= alpha;
}

// The MB × NB blocks of 2 × 2 C tiles at C, rows of blocks outer, as
// AmxBlock<2, 2> computes each (the same products in the same order, so the
// same bits), software-pipelined: the next block's first operand tiles are
// loaded right after the last products that read their registers, before
// this block's C tiles are stored. Tile registers are not renamed, so in
// AmxBlock those loads wait behind the stores and the zeroing; here they
// overlap the products draining. (One thread, Emerald Rapids, operands
// 64-byte aligned: the forward's score product, 384 × 192 × 128, took
// 8.3-8.5 against 8.9-9.0 ns per TDPBF16PS, its value product
// (128 × 192 × 384, accumulating) the same; the bfloat16 backward at E=128,
// L=S=4096, two threads, 96-100 against 101-104 ms, the forward within 1%.)
template <class Tiles>
void AmxBlocks22(int64_t MB, int64_t NB, int64_t K, const uint16_t* A, int64_t lda, const uint32_t* B, int64_t ldb,
                 float* C, int64_t ldc, float alpha, bool accumulate) {
  const int64_t sc = ldc * 4, sa = lda * 2, sb = ldb * 4;  // strides in bytes
  const auto begin = [&](float* c) {  // a block's C tiles: loaded (accumulate) or zeroed
    if (accumulate) {
      Tiles::template load<0>(c, sc), Tiles::template load<1>(c + 16, sc);
      Tiles::template load<2>(c + 16 * ldc, sc), Tiles::template load<3>(c + 16 * ldc + 16, sc);
    } else {
      Tiles::template zero<0>(), Tiles::template zero<1>(), Tiles::template zero<2>(), Tiles::template zero<3>();
    }
  };
  Tiles::template load<4>(A, sa), Tiles::template load<5>(A + 16 * lda, sa);
  Tiles::template load<6>(B, sb), Tiles::template load<7>(B + 16, sb);
  begin(C);
  for (int64_t mb = 0; mb < MB; ++mb)
    for (int64_t nb = 0; nb < NB; ++nb) {
      const uint16_t* a = A + mb * 32 * lda;
      const uint32_t* b = B + nb * 32;
      float* c = C + mb * 32 * ldc + nb * 32;
      // The next block's first operands and C (none after the last block).
      const bool last_n = nb + 1 == NB, last = last_n && mb + 1 == MB;
      const uint16_t* a1 = last_n ? a + 32 * lda : a;
      const uint32_t* b1 = last_n ? B : b + 32;
      float* c1 = last_n ? C + (mb + 1) * 32 * ldc : c + 32;
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const bool more = k0 + 32 < K, next = more || !last;  // operand tiles to load: this block's or the next's
        const uint16_t* na = more ? a + k0 + 32 : a1;
        const uint32_t* nbp = more ? b + ((k0 + 32) / 2) * ldb : b1;
        Tiles::template dp<0, 4, 6>();
        Tiles::template dp<2, 5, 6>();
        if (next) Tiles::template load<6>(nbp, sb);
        Tiles::template dp<1, 4, 7>();
        if (next) Tiles::template load<4>(na, sa);
        Tiles::template dp<3, 5, 7>();
        if (next) Tiles::template load<5>(na + 16 * lda, sa), Tiles::template load<7>(nbp + 16, sb);
      }
      Tiles::template store<0>(c, sc), Tiles::template store<1>(c + 16, sc);
      Tiles::template store<2>(c + 16 * ldc, sc), Tiles::template store<3>(c + 16 * ldc + 16, sc);
      if (!last) begin(c1);
      if (accumulate || alpha == 1.0f) continue;
      for (int64_t r = 0; r < 32; ++r)  // C = alpha·(A·B), as AmxBlock
        for (int64_t n = 0; n < 32; ++n) c[r * ldc + n] *= alpha;
    }
}

// C[M × N] = alpha·(A·B) or C += A·B (bf16.hpp's Bf16Gemm): the whole 2 × 2
// blocks pipelined (AmxBlocks22), then the edges in blocks of 2 × 1, 1 × 2
// and 1 × 1 tiles.
template <class Tiles>
void AmxGemm(int64_t M, int64_t N, int64_t K, const void* Av, int64_t lda, const uint32_t* B, int64_t ldb, float* C,
             int64_t ldc, float alpha, bool accumulate) {
  const auto* A = static_cast<const uint16_t*>(Av);
  const int64_t M2 = M / 32 * 32, N2 = N / 32 * 32;
  if (M2 > 0 && N2 > 0) AmxBlocks22<Tiles>(M2 / 32, N2 / 32, K, A, lda, B, ldb, C, ldc, alpha, accumulate);
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const bool two_m = M - m0 >= 32;
    for (int64_t n0 = two_m ? N2 : 0; n0 < N; n0 += 32) {
      const bool two_n = N - n0 >= 32;
      const uint16_t* a = A + m0 * lda;
      float* c = C + m0 * ldc + n0;
      if (two_m) AmxBlock<Tiles, 2, 1>(K, a, lda, B + n0, ldb, c, ldc, alpha, accumulate);  // (two_n: pipelined)
      else if (two_n) AmxBlock<Tiles, 1, 2>(K, a, lda, B + n0, ldb, c, ldc, alpha, accumulate);
      else AmxBlock<Tiles, 1, 1>(K, a, lda, B + n0, ldb, c, ldc, alpha, accumulate);
    }
  }
}
