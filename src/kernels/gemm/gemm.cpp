// Row-major GEMM. float: oneDNN's dnnl_sgemm (row-major by definition, so
// arguments stay in the reader's order: C = op(A)·op(B)); double: OpenBLAS's
// cblas_dgemm (CblasRowMajor); the portable build without either
// (ATTN_NO_BLAS: the WebAssembly explainer in web/) runs the plain loops of
// gemm_reference.
//
// Why oneDNN for float. It compiles its kernels at run time from the CPU's
// feature bits (AVX2, AVX-512, AVX512_BF16, AMX), so a CPU newer than the
// library still gets its vector width. OpenBLAS picks a hand-written kernel
// from a list of known CPUs and falls back to a generic SSE3 one on any
// other: Debian's 0.3.21 on Emerald Rapids ran sgemm at 42-64 GFLOP/s, at
// most a fifth of MKL's (docs/performance.md, "GEMM").
//
// Threads. C is cut into tiles by its shape alone (gemm_tiles), and the
// tiles run on the caller's OpenMP threads, each tile one single-threaded
// library call over all of K. A tile's bits depend only on its own shape and
// operands, so C is the same for any thread count, and the products share
// the OpenMP pool with the attention kernels instead of starting a pool of
// their own. (oneDNN's own threads may split K among themselves, and then
// the sums depend on their number.) The price: each tile packs its own
// slices of A and B, and oneDNN runs a little slower on a tile than on the
// whole product. At most 16 tiles of at least 256×256 kept that loss to
// about 7% of one core's GFLOP per CPU-second on the layer's products with
// the AVX-512 kernels (Zen 4, one thread; 32 tiles of 128 and more lost 9%).
// One exception: a product with two tiles' work that the rule would leave
// whole is cut in two, where the halves' sides stay at half the minimum or
// more, or where the whole is itself below the minimum (then the library
// runs the same kernels on the halves). On one thread of oneDNN's AVX2
// kernels (Zen 4) the halves ran at 0.82-1.4x the whole's GFLOP/s
// (1.07x for 1024 × 256 × 256 against 2048 × 256 × 256, 1.38x for
// 256 × 512 × 4096 against 512 × 512 × 4096 with A transposed, 0.82x for
// 128 × 256 × 4096 against 256 × 256 × 4096), so the layer's products at
// D = 256 run on both threads instead of one; with AVX-512 the smallest
// layer's 256 × 256 × 1024 weight gradient had run on one of two threads.
// Its AVX2 kernels need larger tiles (gemm_min_tile): below about 526×526
// oneDNN switches them to kernels that do not pack, which ran the layer's
// long-K products at a third of the speed.
#include "kernels/gemm/gemm.hpp"

#include "kernels/fused/bf16.hpp"
#include "kernels/fused/common.hpp"

#ifndef ATTN_NO_BLAS
#include <cblas.h>
#include <omp.h>

#include <oneapi/dnnl/dnnl.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <atomic>
#include <string>
#endif

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

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

GemmTiles gemm_tiles(GemmShape s, int64_t min_tile) {
  constexpr int64_t kMaxTiles = 16;          // enough to balance a few threads
  constexpr double kMinTileFlops = 1 << 24;  // ~0.1 ms on one core: the call's set-up is noise
  constexpr int64_t kAlign = 16;             // sides stay multiples of the micro-kernels' widths
  const auto half = [](int64_t side) { return ((side + 1) / 2 + kAlign - 1) / kAlign * kAlign; };
  // 1/rows + 1/cols <= 2/min_tile, and each side really smaller than before.
  const auto large = [&](GemmTiles t) {
    return double(min_tile) * double(t.rows + t.cols) <= 2.0 * double(t.rows) * double(t.cols);
  };
  const auto fits = [&](GemmTiles t, GemmTiles was) { return (t.rows < was.rows || t.cols < was.cols) && large(t); };
  GemmTiles t{std::max<int64_t>(s.M, 1), std::max<int64_t>(s.N, 1)};
  const double flops = 2.0 * double(s.M) * double(s.N) * double(s.K);
  for (;;) {
    const int64_t n = t.count(s);
    if (n * 2 > kMaxTiles || flops / double(n * 2) < kMinTileFlops) return t;
    // Halve the longer side if the tile stays large enough, else the shorter.
    GemmTiles longer = t, shorter = t;
    if (t.rows >= t.cols)
      longer.rows = half(t.rows), shorter.cols = half(t.cols);
    else
      longer.cols = half(t.cols), shorter.rows = half(t.rows);
    if (fits(longer, t))
      t = longer;
    else if (fits(shorter, t))
      t = shorter;
    else if (n == 1 && (longer.rows < t.rows || longer.cols < t.cols) &&
             (2 * std::min(longer.rows, longer.cols) >= min_tile || !large(t)))
      return longer;  // two tiles' work in two (one would leave a thread idle): see below
    else
      return t;
  }
}

namespace {

// A stored operand (rows × cols elements, rows ld apart) rounded to
// bfloat16 into a dense copy (rows cols apart) in a buffer reused across
// calls: float values (the CPUs without oneDNN's bfloat16 matmul), or
// (uint16_t) the bits, a row at a time by bf16_round_row (one element at a
// time into a fresh vector, the copy and its page faults took a third of a
// 3072 × 1024 × 4096 product with A transposed).
template <class Out>
auto rounded_copy(const float* X, int64_t rows, int64_t cols, int64_t ld, int threads) {
  if constexpr (std::is_same_v<Out, float>) {
#ifdef ATTN_NO_BLAS
    std::vector<float> r(size_t(rows * cols));  // (the portable build has no operand buffers)
    float* const d = r.data();
#else
    OperandBuffer r(size_t(rows * cols) * sizeof(float), false);
    float* const d = r.as<float>();
#endif
#pragma omp parallel for num_threads(std::max(threads, 1)) schedule(static) if (threads != 1)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) d[i * cols + j] = bf16_value(bf16_operand(X[i * ld + j]));
    return r;
  } else {
    OperandBuffer r(size_t(rows * cols) * sizeof(uint16_t), false);
    uint16_t* const d = r.as<uint16_t>();
#pragma omp parallel for num_threads(std::max(threads, 1)) schedule(static) if (threads != 1)
    for (int64_t i = 0; i < rows; ++i) bf16_round_row(X + i * ld, cols, d + i * cols);
    return r;
  }
}

// A and B as stored: A is [M×K] or, transposed, [K×M]; B [K×N] or [N×K].
struct Stored {
  int64_t rows, cols;
};
Stored stored_a(GemmShape s, bool ta) { return ta ? Stored{s.K, s.M} : Stored{s.M, s.K}; }
Stored stored_b(GemmShape s, bool tb) { return tb ? Stored{s.N, s.K} : Stored{s.K, s.N}; }

// gemm_bf16's bias comes with alpha 1 and beta 0 only.
void check_bias(const float* bias, float alpha, float beta) {
  if (bias && (alpha != 1.0f || beta != 0.0f))
    throw std::logic_error("detail::gemm_bf16: a bias needs alpha = 1 and beta = 0");
}

// Every row of C (m, n), leading dimension ldc, set to bias (n).
void fill_bias(float* C, int64_t m, int64_t n, int64_t ldc, const float* bias) {
  for (int64_t i = 0; i < m; ++i) std::copy_n(bias, n, C + i * ldc);
}

}  // namespace

#ifdef ATTN_NO_BLAS

void gemm_bf16(GemmShape s, bool ta, const float* A, int64_t lda, bool tb, const float* B, int64_t ldb, float* C,
               int64_t ldc, float alpha, float beta, int threads, const float* bias) {
  check_bias(bias, alpha, beta);
  const Stored sa = stored_a(s, ta), sb = stored_b(s, tb);
  const std::vector<float> a = rounded_copy<float>(A, sa.rows, sa.cols, lda, 1);
  const std::vector<float> b = rounded_copy<float>(B, sb.rows, sb.cols, ldb, 1);
  if (bias) fill_bias(C, s.M, s.N, ldc, bias), beta = 1.0f;
  gemm<float>(s, ta, a.data(), sa.cols, tb, b.data(), sb.cols, C, ldc, alpha, beta, threads);
}

void gemm_bf16_on(Bf16Path, GemmShape s, bool ta, const float* A, int64_t lda, bool tb, const float* B, int64_t ldb,
                  float* C, int64_t ldc, float alpha, float beta, int threads, const float* bias) {
  gemm_bf16(s, ta, A, lda, tb, B, ldb, C, ldc, alpha, beta, threads, bias);
}

template <class T>
void gemm(GemmShape s, bool ta, const T* A, int64_t lda, bool tb, const T* B, int64_t ldb, T* C,
          int64_t ldc, T alpha, T beta, int /*threads: one in the browser*/) {
  gemm_reference(s, ta, A, lda, tb, B, ldb, C, ldc, alpha, beta);
}

int64_t gemm_min_tile() { return 256; }  // unused: one thread

const char* gemm_backend_description() { return "the plain loops (ATTN_NO_BLAS)"; }

#else

namespace {

// One tile on the calling thread alone (its OpenMP default is 1 here, and
// both libraries size their thread teams from it). Returns false when the
// library refused the arguments.
bool tile(GemmShape s, bool ta, const float* A, int64_t lda, bool tb, const float* B, int64_t ldb,
          float* C, int64_t ldc, float alpha, float beta) {
  return dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', s.M, s.N, s.K, alpha, A, lda, B, ldb, beta, C,
                    ldc) == dnnl_success;
}

bool tile(GemmShape s, bool ta, const double* A, int64_t lda, bool tb, const double* B, int64_t ldb,
          double* C, int64_t ldc, double alpha, double beta) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(s.M),
              int(s.N), int(s.K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
  return true;
}

const char* isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_sse41: return "sse41";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    default: return "other";
  }
}

}  // namespace

template <class T>
void gemm(GemmShape s, bool ta, const T* A, int64_t lda, bool tb, const T* B, int64_t ldb, T* C,
          int64_t ldc, T alpha, T beta, int threads) {
  if (s.M == 0 || s.N == 0) return;
  if (s.K == 0) return gemm_reference(s, ta, A, lda, tb, B, ldb, C, ldc, alpha, beta);  // C = beta·C
  const GemmTiles t = gemm_tiles(s, gemm_min_tile());
  const int64_t across = (s.N + t.cols - 1) / t.cols, n = t.count(s);
  const int team = int(std::min<int64_t>(n, threads > 0 ? threads : omp_get_max_threads()));
  std::atomic<bool> refused{false};
#pragma omp parallel num_threads(team) if (team > 1)
  {
    omp_set_num_threads(1);  // the libraries' own teams: this thread alone
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = i / across * t.rows, c = i % across * t.cols;
      const GemmShape part{std::min(t.rows, s.M - r), std::min(t.cols, s.N - c), s.K};
      // op(A)'s rows r.. and op(B)'s columns c.. give C's tile at (r, c).
      if (!tile(part, ta, A + (ta ? r : r * lda), lda, tb, B + (tb ? c * ldb : c), ldb, C + r * ldc + c, ldc,
                alpha, beta))
        refused = true;
    }
  }
  if (refused) throw std::logic_error("detail::gemm: the library refused a product's arguments");
}

namespace {

// The body of a loop that waits for another running thread.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

const dnnl::engine& cpu_engine() {
  static const dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

// One tile of gemm_bf16 (A, B: bfloat16 bits, the strides of the stored
// operands): a single-threaded oneDNN matmul; false where oneDNN has no
// bfloat16 matmul for this CPU.
bool tile_bf16(GemmShape s, bool ta, const uint16_t* A, int64_t lda, bool tb, const uint16_t* B, int64_t ldb,
               float* C, int64_t ldc, float alpha, float beta, const float* bias = nullptr) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  const dnnl::memory::desc a({s.M, s.K}, dt::bf16, ta ? dims{1, lda} : dims{lda, 1});
  const dnnl::memory::desc b({s.K, s.N}, dt::bf16, tb ? dims{1, ldb} : dims{ldb, 1});
  const dnnl::memory::desc c({s.M, s.N}, dt::f32, dims{ldc, 1});
  dnnl::primitive_attr attr;
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops po;
    po.append_sum(beta);
    attr.set_post_ops(po);
  }
  const dnnl::memory::desc bias_md({1, s.N}, dt::f32, dims{s.N, 1});
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(bias ? dnnl::matmul::desc(a, b, bias_md, c) : dnnl::matmul::desc(a, b, c),
                                      attr, cpu_engine());
  } catch (const dnnl::error&) {
    return false;
  }
  const dnnl::memory am(a, cpu_engine(), const_cast<uint16_t*>(A)), bm(b, cpu_engine(), const_cast<uint16_t*>(B)),
      cm(c, cpu_engine(), C);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
  if (bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(bias_md, cpu_engine(), const_cast<float*>(bias)));
  dnnl::stream st(cpu_engine());
  dnnl::matmul(pd).execute(st, args);
  st.wait();
  return true;
}

// Whether oneDNN runs bfloat16 matmuls on this CPU (asked once).
bool dnnl_has_bf16() {
  static const bool yes = [] {
    const uint16_t one = 0x3F80;
    float c = 0;
    return tile_bf16({1, 1, 1}, false, &one, 1, false, &one, 1, &c, 1, 1.0f, 0.0f) && c == 1.0f;
  }();
  return yes;
}


// gemm_bf16 on AMX tiles (native, or the tests' emulation). The operands
// are rounded once per call into panels the tiles load whole: A in blocks
// of 32 rows × kChunk (row-major), B in blocks of kChunk/2 pair rows × 32
// columns (bf16.hpp's pair layout), K cut into equal chunks of at most
// kMaxChunk elements (a multiple of 32), everything zero-padded (M and N
// to 32, K to 32). Each C tile of gemm_tiles runs in blocks of
// kRows × kCols: per chunk, the path's block product (32 × 32) on each pair
// of panels, accumulated into a dense block (each element sums its chunks
// in order, so C's bits do not depend on the threads); then
// C = alpha·block + beta·C. Where alpha is 1, beta 0 or 1 and the block is
// whole, the block is C's own rows, the products accumulating onto C when
// beta is 1 (no copy: on the multi-head layer's forward at (B, N, D, H) =
// (8, 128, 256, 4), bfloat16 products, one thread, this and starting from
// zeroed tiles took 0.89 of the time).
// Why panels: the block product runs from the L1 cache at about 8.5 ns per
// TDPBF16PS, from L2 at 20-28 ns, with its tiles in registers at 5.7 ns
// (Emerald Rapids, one thread); row-major operands with K = 2048 put a
// tile's 16 rows 4 KiB apart, in one L1 set. A chunk's A and B panels of a
// block (up to 512 KiB each) and the block of C (256 KiB) stay in L2. Why
// long chunks: each block product loads and stores its C tiles and waits
// for its first and last products; on the layer's products (D = 512, 1024,
// 2048, 4096 rows, one thread) chunks of up to 1024 took 0.83-0.89 of the
// time of chunks of 256, and longer ones did no better.
void gemm_bf16_tiles(const Bf16Kernel& kern, GemmShape s, bool ta, const float* A, int64_t lda, bool tb,
                     const float* B, int64_t ldb, float* C, int64_t ldc, float alpha, float beta, int team,
                     const float* bias) {
  constexpr int64_t kPanel = 32, kMaxChunk = 1024, kRows = 256, kCols = 256;
  const int64_t Mp = round_up(s.M, kPanel), Np = round_up(s.N, kPanel), Kp = round_up(s.K, kern.kpad);
  const int64_t kChunk = round_up(ceil_div(Kp, ceil_div(Kp, kMaxChunk)), kern.kpad);
  const int64_t chunks = ceil_div(Kp, kChunk);
  const auto chunk_k = [&](int64_t c) { return std::min(kChunk, Kp - c * kChunk); };
  // Row panel p's chunk c starts at (p·Kp + c·kChunk)·32 elements of a, column
  // panel q's at half that in b (dwords); each is copied in the order that
  // reads the stored operand contiguously.
  // Zeroed only where a panel has padding: the copies below write every other element.
  const OperandBuffer abuf(size_t(Mp * Kp) * sizeof(uint16_t), Mp != s.M || Kp != s.K),
      bbuf(size_t(Np * Kp / 2) * sizeof(uint32_t), Np != s.N || Kp != s.K);
  uint16_t* const a = abuf.as<uint16_t>();
  uint32_t* const b = bbuf.as<uint32_t>();
  const int64_t pa = Mp / kPanel, pb = Np / kPanel;
  // A transposed: its stored rows (op(A)'s columns) rounded once into a
  // dense copy, whose panels are then transposed 8 × 8 at a time (rounding
  // 32-element pieces one call each, then moving them one element at a
  // time, took longer than the products: 768 × 768 × 2048, one thread).
  const OperandBuffer at = ta ? rounded_copy<uint16_t>(A, s.K, s.M, lda, team) : OperandBuffer();
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (int64_t u = 0; u < (pa + pb) * chunks; ++u) {
    // Chunk-major: consecutive units read the same stored rows of a transposed operand.
    const int64_t c = u / (pa + pb), panel = u % (pa + pb), k0 = c * kChunk, ck = chunk_k(c);
    const int64_t kn = std::min(s.K, k0 + kChunk) - k0;  // stored elements of K in the chunk
    if (panel < pa) {  // A: 32 rows of ck elements
      const int64_t i0 = panel * kPanel, rows = std::min(kPanel, s.M - i0);
      uint16_t* blk = a + (i0 * Kp + k0 * kPanel);
      for (int64_t ii = 0; !ta && ii < rows; ++ii) bf16_round_row(A + (i0 + ii) * lda + k0, kn, blk + ii * ck);
      if (ta) {  // blk[ii][kk] = op(A)[i0 + ii][k0 + kk], the rounded copy's [k0 + kk][i0 + ii]
        transpose8(at.as<uint16_t>() + k0 * s.M + i0, s.M, kn, rows, blk, ck);
      }
    } else {  // B: ck / 2 pair rows of 32 columns
      const int64_t j0 = (panel - pa) * kPanel, cols = std::min(kPanel, s.N - j0);
      uint32_t* blk = b + (j0 * Kp / 2 + k0 / 2 * kPanel);
      if (!tb) bf16_pair_rows(B + k0 * ldb + j0, ldb, kn, cols, blk, kPanel);
      if (tb) {  // op(B)'s column jj is a stored row: rounded, its pairs are adjacent
        std::vector<uint16_t> rows(size_t(kPanel * ck), 0);  // the panel's rows, zeros past kn and cols
        for (int64_t jj = 0; jj < cols; ++jj) bf16_round_row(B + (j0 + jj) * ldb + k0, kn, rows.data() + jj * ck);
        // Then transposed as pairs, a pair row of the panel at a time (contiguous writes).
        for (int64_t k2 = 0; k2 < ck / 2; ++k2)
          for (int64_t jj = 0; jj < kPanel; ++jj) {
            const uint16_t* r = rows.data() + jj * ck + 2 * k2;
            blk[k2 * kPanel + jj] = uint32_t(r[0]) | uint32_t(r[1]) << 16;
          }
      }
    }
  }
  GemmTiles t = gemm_tiles(s, gemm_min_tile());
  t.rows = round_up(t.rows, kPanel), t.cols = round_up(t.cols, kPanel);  // whole panels
  const int64_t across = (s.N + t.cols - 1) / t.cols, n = t.count(s);
#pragma omp parallel num_threads(int(std::min<int64_t>(n, team))) if (std::min<int64_t>(n, team) > 1)
  {
    const FlushToZero ftz;  // as in the attention kernels' parallel regions
    if (kern.thread_begin) kern.thread_begin();
    std::vector<float> dense;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = i / across * t.rows, c0 = i % across * t.cols;
      // In blocks of at most kRows × kCols: a block of C (256 KiB) and its
      // chunks of A and B (up to 512 KiB each) stay in the L2 cache.
      for (int64_t r1 = r; r1 < std::min(r + t.rows, s.M); r1 += kRows)
        for (int64_t c1 = c0; c1 < std::min(c0 + t.cols, s.N); c1 += kCols) {
          const int64_t m = std::min({kRows, r + t.rows - r1, s.M - r1});
          const int64_t w = std::min({kCols, c0 + t.cols - c1, s.N - c1});
          const int64_t mp = round_up(m, kPanel), wp = round_up(w, kPanel);
          // The first chunk's products start from zeroed tiles (C is not read), the later ones
          // accumulate into the block: the same sums as accumulating from zeros. Where alpha is
          // 1, beta 0 or 1 and the block has no padding, the block is C itself (beta 1: the
          // first chunk accumulates into C too, the sum starting from C's value).
          // A bias is the block's starting value (beta is 0 then): the first chunk accumulates onto it.
          const bool direct = (beta == 0.0f || beta == 1.0f) && alpha == 1.0f && m == mp && w == wp;
          if (!direct && dense.size() < size_t(mp * wp)) dense.resize(size_t(mp * wp));
          float* const blk = direct ? C + r1 * ldc + c1 : dense.data();
          const int64_t ldk = direct ? ldc : wp;
          for (int64_t y = 0; bias && y < mp; ++y) {  // the padding (dense blocks only) starts from 0
            std::copy_n(bias + c1, w, blk + y * ldk);
            std::fill(blk + y * ldk + w, blk + y * ldk + wp, 0.0f);
          }
          for (int64_t c = 0; c < chunks; ++c)
            for (int64_t y = 0; y < mp; y += kPanel)
              for (int64_t x = 0; x < wp; x += kPanel)
                kern.gemm(kPanel, kPanel, chunk_k(c), a + (r1 + y) * Kp + c * kChunk * kPanel, chunk_k(c),
                          b + (c1 + x) * Kp / 2 + c * kChunk / 2 * kPanel, kPanel, blk + y * ldk + x,
                          ldk, 1.0f, c > 0 || bias || (direct && beta == 1.0f));
          for (int64_t y = 0; y < m && !direct; ++y) {
            float* dst = C + (r1 + y) * ldc + c1;
            const float* src = dense.data() + y * wp;
            if (beta == 0.0f)
              for (int64_t x = 0; x < w; ++x) dst[x] = alpha * src[x];
            else
              for (int64_t x = 0; x < w; ++x) dst[x] = alpha * src[x] + beta * dst[x];
          }
        }
    }
    if (kern.thread_end) kern.thread_end();
  }
}

void gemm_bf16_library(GemmShape s, bool ta, const float* A, int64_t lda, bool tb, const float* B, int64_t ldb,
                       float* C, int64_t ldc, float alpha, float beta, int team, const float* bias) {
  const Stored sa = stored_a(s, ta), sb = stored_b(s, tb);
  if (s.K == 0 || !dnnl_has_bf16()) {  // sgemm on the rounded values
    const OperandBuffer a = rounded_copy<float>(A, sa.rows, sa.cols, lda, team);
    const OperandBuffer b = rounded_copy<float>(B, sb.rows, sb.cols, ldb, team);
    if (bias) fill_bias(C, s.M, s.N, ldc, bias), beta = 1.0f;
    return gemm<float>(s, ta, a.as<float>(), sa.cols, tb, b.as<float>(), sb.cols, C, ldc, alpha, beta, team);
  }
  // Dense copies: a tile's rows of A (unless transposed) and columns of B
  // (when transposed, the layer's weights) are then dense blocks. A tile's
  // slices are rounded when a thread first needs them, inside the region
  // that runs the tiles, with no barrier between rounding and products: a
  // thread that waits passively (OMP_WAIT_POLICY=passive, the default of
  // attn's programs) sleeps at a barrier and wakes tens of µs later. On the
  // smallest layer's products (D = 256, 1024 rows: 0.4-1.2 ms a call) that
  // took 0.91-0.99 of the time of rounding in loops of their own first
  // (Zen 4, 2 threads, passive, alternating in one process), and the same
  // with the threads spinning. Rounding is a function of the element, so
  // C's bits do not depend on which thread rounded what.
  const OperandBuffer abuf(size_t(sa.rows * sa.cols) * sizeof(uint16_t), false);
  const OperandBuffer bbuf(size_t(sb.rows * sb.cols) * sizeof(uint16_t), false);
  uint16_t* const a = abuf.as<uint16_t>();
  uint16_t* const b = bbuf.as<uint16_t>();
  const GemmTiles t = gemm_tiles(s, gemm_min_tile());
  const int64_t across = (s.N + t.cols - 1) / t.cols, n = t.count(s);
  // A tile row's rows of op(A), a tile column's columns of op(B): a block
  // of stored rows, or (transposed) of stored columns, rounded in pieces of
  // about 16K elements that every thread needing the slice takes in turn
  // (one thread rounding a slice that the others waited for took 3-5%
  // longer than the loops of their own with the threads spinning).
  struct Slice {
    std::atomic<int64_t> next{0}, done{0};  // pieces taken, pieces rounded
  };
  const auto rows_per_piece = [](int64_t row) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row, 1)); };
  const auto ensure = [&](Slice& slice, const float* X, int64_t ld, int64_t cols, bool by_columns, int64_t from,
                          int64_t len, int64_t stored_rows, uint16_t* d) {
    // A piece is a run of stored rows: of all of them for a slice of columns.
    const int64_t first = by_columns ? 0 : from, rows = by_columns ? stored_rows : len;
    const int64_t step = rows_per_piece(by_columns ? len : cols), pieces = ceil_div(rows, step);
    for (int64_t p; (p = slice.next.fetch_add(1, std::memory_order_relaxed)) < pieces;) {
      for (int64_t i = first + p * step; i < first + std::min(rows, (p + 1) * step); ++i)
        if (by_columns)
          bf16_round_row(X + i * ld + from, len, d + i * cols + from);
        else
          bf16_round_row(X + i * ld, cols, d + i * cols);
      slice.done.fetch_add(1, std::memory_order_release);
    }
    while (slice.done.load(std::memory_order_acquire) < pieces) cpu_relax();  // the others' pieces
  };
  std::vector<Slice> a_slices(static_cast<size_t>(n / across)), b_slices(static_cast<size_t>(across));
  std::atomic<bool> refused{false};
  // oneDNN writes C's tile in place, but where C's rows are a multiple of
  // 4 KiB apart (their lines share L1 sets) into a dense tile copied out:
  // in place took 0.95 of the time on the multi-head layer's forward at
  // (8, 128, 256, 4) and 1.2× on products with rows 8 KiB apart (Zen 4).
  const bool direct = ldc % 1024 != 0;
#pragma omp parallel num_threads(int(std::min<int64_t>(n, team))) if (std::min<int64_t>(n, team) > 1)
  {
    omp_set_num_threads(1);  // oneDNN's team: this thread alone
    std::vector<float> dense;  // the tile of C, dense where C's rows are a multiple of 4 KiB apart
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = i / across * t.rows, c = i % across * t.cols;
      const GemmShape part{std::min(t.rows, s.M - r), std::min(t.cols, s.N - c), s.K};
      ensure(a_slices[size_t(i / across)], A, lda, sa.cols, ta, r, part.M, sa.rows, a);
      ensure(b_slices[size_t(i % across)], B, ldb, sb.cols, !tb, c, part.N, sb.rows, b);
      if (!direct) dense.resize(size_t(part.M * part.N));
      if (!direct && beta != 0.0f)
        for (int64_t y = 0; y < part.M; ++y) std::copy_n(C + (r + y) * ldc + c, part.N, dense.data() + y * part.N);
      if (!tile_bf16(part, ta, a + (ta ? r : r * sa.cols), sa.cols, tb, b + (tb ? c * sb.cols : c), sb.cols,
                     direct ? C + r * ldc + c : dense.data(), direct ? ldc : part.N, alpha, beta,
                     bias ? bias + c : nullptr))
        refused = true;
      for (int64_t y = 0; !direct && y < part.M; ++y)
        std::copy_n(dense.data() + y * part.N, part.N, C + (r + y) * ldc + c);
    }
  }
  if (refused) throw std::logic_error("detail::gemm_bf16: oneDNN refused a product's arguments");
}

}  // namespace

void gemm_bf16_on(Bf16Path path, GemmShape s, bool ta, const float* A, int64_t lda, bool tb, const float* B,
                  int64_t ldb, float* C, int64_t ldc, float alpha, float beta, int threads, const float* bias) {
  check_bias(bias, alpha, beta);
  if (s.M == 0 || s.N == 0) return;
  const int team = threads > 0 ? threads : omp_get_max_threads();
  if (s.K > 0 && (path == Bf16Path::amx || path == Bf16Path::amx_emulated))
    return gemm_bf16_tiles(bf16_kernel(path), s, ta, A, lda, tb, B, ldb, C, ldc, alpha, beta, team, bias);
  gemm_bf16_library(s, ta, A, lda, tb, B, ldb, C, ldc, alpha, beta, team, bias);
}

void gemm_bf16(GemmShape s, bool ta, const float* A, int64_t lda, bool tb, const float* B, int64_t ldb, float* C,
               int64_t ldc, float alpha, float beta, int threads, const float* bias) {
  gemm_bf16_on(bf16_best_path(), s, ta, A, lda, tb, B, ldb, C, ldc, alpha, beta, threads, bias);
}

int64_t gemm_min_tile() {
  static const int64_t side =
      (dnnl_get_effective_cpu_isa() & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core ? 256 : 640;
  return side;
}

const char* gemm_backend_description() {
  static const std::string d = [] {
    const dnnl_version_t* v = dnnl_version();
    return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
           std::to_string(v->patch) + " sgemm, ISA " + isa_name(dnnl_get_effective_cpu_isa());
  }();
  return d.c_str();
}

#endif

template void gemm<float>(GemmShape, bool, const float*, int64_t, bool, const float*, int64_t,
                          float*, int64_t, float, float, int);
template void gemm<double>(GemmShape, bool, const double*, int64_t, bool, const double*, int64_t,
                           double*, int64_t, double, double, int);
template void gemm_reference<float>(GemmShape, bool, const float*, int64_t, bool, const float*,
                                    int64_t, float*, int64_t, float, float);
template void gemm_reference<double>(GemmShape, bool, const double*, int64_t, bool, const double*,
                                     int64_t, double*, int64_t, double, double);

}  // namespace attn::detail
