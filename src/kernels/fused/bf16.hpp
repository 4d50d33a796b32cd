// Internal: the fused forward and backward with bfloat16 products
// (compute_dtype bfloat16, docs/fused.md "bfloat16 compute"). No SIMD types
// here. (The backward: bf16-inl.h, Bf16BackwardProducts, on the operands
// below and Bf16BackwardOperands.)
//
// The unit is the float32 forward's (attention-inl.h, ForwardUnitT): the
// same tiles, score pipeline and online softmax in float32; only the two
// products change. Q·Kᵀ takes Q and K rounded to bfloat16 and accumulates
// in float32 (the scale applied to the float32 sum); P·V takes P rounded to
// bfloat16 after the softmax and V rounded to bfloat16, into a float32
// accumulator. Three instruction paths run those products, picked at run
// time (bf16_best_path): AMX tiles (TDPBF16PS), AVX512_BF16 (VDPBF16PS), or
// the portable one, float32 multiply-adds on the rounded operands in the
// order VDPBF16PS documents (odd element of each pair first), which gives
// its bits.
//
// Operand layouts, shared by every path. A product C[M × N] (+)= A·B with
// the reduction over K elements:
//   A  row-major, row m = K elements (bfloat16 bits; on the portable path
//      the same values as float32), so a pair (2k, 2k + 1) is one dword;
//   B  the pair layout: dword (k, n) = (bf16 B[2k][n], bf16 B[2k + 1][n]),
//      low half first, rows of N dwords: what VDPBF16PS and TDPBF16PS read.
// Q·Kᵀ (keys × queries, as the float32 forward's transposed tile): A = K
// (packed once per call), B = the unit's queries. oᵀ += Vᵀ·Pᵀ: A = V
// transposed (packed once per call), B = the tile's probabilities. The
// accumulator oᵀ holds values × queries, so the rescale by each query's
// factor is a product of rows with one vector.
//
// Rounding (the operands): float32 → bfloat16 to nearest even; a value
// below 2^-126 in magnitude (a subnormal float32) becomes a signed zero,
// as the hardware's conversions and products treat subnormal inputs (DAZ),
// so no path ever meets a subnormal operand; NaN stays NaN. A row of q, k or
// v that holds NaN or ±∞ after rounding (a float32 beyond bfloat16's range
// rounds to ∞) is a bad row, zeroed in the operands and carried as NaN in
// the scores, as in the float32 forward.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include <hwy/aligned_allocator.h>

#include "attn/half.hpp"
#include "attn/sdpa.hpp"
#include "kernels/fused/tiles.hpp"
#include "kernels/problem.hpp"

namespace attn::detail {

// Which instructions run the bfloat16 products.
enum class Bf16Path {
  portable,      // float32 multiply-adds (any CPU, every Highway target)
  avx512_bf16,   // VDPBF16PS (Zen 4/5, Intel Cooper Lake and later Xeons)
  amx,           // TDPBF16PS tiles (Intel Sapphire Rapids and later)
  amx_emulated,  // the AMX path's code on the plain C++ emulation of its tiles (tests only)
};
const char* bf16_path_name(Bf16Path path);
// Whether the path's products run on AMX tiles, native or emulated (the
// forward's plan: fused_plan_bf16).
inline bool bf16_tile_path(Bf16Path path) { return path == Bf16Path::amx || path == Bf16Path::amx_emulated; }
// Whether this CPU (and for AMX, the operating system's permission) runs it.
bool bf16_path_available(Bf16Path path);
// The fastest available path: AMX, else AVX512_BF16 on AMD CPUs, else
// portable (decided once per process; bf16_products.cpp says why).
Bf16Path bf16_best_path();

// One product C[M × N] = alpha·(A·B) (accumulate false) or C += A·B
// (accumulate true, alpha ignored), layouts above; lda in elements, ldb in
// dwords, ldc in floats. M, N, K are padded to the path's granularity
// (Bf16Kernel) by the caller, and the padding of A and B holds finite values
// and zeros respectively.
using Bf16Gemm = void (*)(int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const uint32_t* B,
                          int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate);

// The probability pairs of a score tile: pp[k][r] = the pair (P[2k][r],
// P[2k + 1][r]) of the tile's nk rows (st, ld floats apart; rows past nk are
// zeros), rounded as operands (bf16_operand), for k < K / 2 and r < nrp
// (a multiple of 8); pp rows are ld dwords apart.
using Bf16Pairs = void (*)(const float* st, int64_t ld, int64_t nk, int64_t K, int64_t nrp, uint32_t* pp);

// A path's products and their granularity.
struct Bf16Kernel {
  Bf16Path path = Bf16Path::portable;
  Bf16Gemm gemm = nullptr;     // null: the portable products of the running SIMD target
  int64_t kpad = 2;            // K a multiple of this
  int64_t mpad = 1;            // M a multiple of this (and A readable that far)
  bool a_float = false;        // A holds float32 values (the portable path) rather than bfloat16 bits
  Bf16Pairs pairs = nullptr;   // null: the running SIMD target's (the same bits)
  bool vcvtne2ps2bf16 = false;  // the CPU has it: the forward's exponentials round their pairs with it
  void (*thread_begin)() = nullptr;  // per thread, before its first product (AMX: the tile configuration)
  void (*thread_end)() = nullptr;
};
Bf16Kernel bf16_kernel(Bf16Path path);

// dst[e·ldd + j] = src[j·lds + e] for e < ce, j < rj: 8 × 8 blocks of
// 16-bit values through registers where SSE2 exists, the edges one at a
// time.
void transpose8(const uint16_t* src, int64_t lds, int64_t rj, int64_t ce, uint16_t* dst, int64_t ldd);

// float32 bits b to bfloat16 bits: nearest even (±∞ beyond the range), NaN
// stays a quiet NaN. bfloat16_t(x) (src/half.cpp) is this.
// (Selects rather than branches, so that loops of it vectorise.)
inline uint16_t bf16_round(uint32_t b) {
  const uint32_t nearest = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const uint32_t nan = (b >> 16) | 0x0040u;
  return uint16_t((b & 0x7FFFFFFFu) > 0x7F800000u ? nan : nearest);
}

// The bfloat16 bits of an operand (see "Rounding" above): bf16_round, with
// subnormals to signed zero.
inline uint16_t bf16_operand(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint32_t zero = (b >> 16) & 0x8000u;
  return (b & 0x7F800000u) == 0 ? uint16_t(zero) : bf16_round(b);
}
inline float bf16_value(uint16_t bits) {
  const uint32_t b = uint32_t(bits) << 16;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// The bytes of one call's operands (the attention's, the bfloat16 GEMMs'
// panels), reused across calls: each thread keeps
// the buffers its calls release (at most kKept, each at most kKeptBytes, the
// smallest dropped first) and hands them to its next calls, so that a
// repeated call does not map, fault in and free fresh pages every time (at
// (B, H, L, E) = (8, 4, 128, 64) the page faults took about an eighth of a
// forward on Emerald Rapids). Thread-local: nothing is shared between
// threads. zeroed: the bytes are set to 0, else they are what the last user
// left.
class OperandBuffer {
 public:
  static constexpr size_t kKeptBytes = size_t(32) << 20;
  static constexpr size_t kKept = 8;

  OperandBuffer() = default;
  OperandBuffer(size_t bytes, bool zeroed);
  ~OperandBuffer();
  OperandBuffer(OperandBuffer&&) noexcept = default;
  OperandBuffer& operator=(OperandBuffer&& o) noexcept;

  std::byte* get() const { return p_.get(); }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(p_.get());
  }

 private:
  void release();
  hwy::AlignedFreeUniquePtr<std::byte[]> p_;
  size_t cap_ = 0;
};

// One call's q, k, v as the products read them (built once per call, in
// parallel; a function of the inputs and the path only).
//   q   [B·H·L][E2]     bfloat16 bits; a bad row is zeros, flagged in qbad
//   k   [B·Hkv][S + 16][E2]   A of Q·Kᵀ (bits, or float32 on the portable
//                       path); rows past S and columns past E zero
//   vt  [B·Hkv][Evr][ldvt]    A of Vᵀ·Pᵀ: V transposed, rows past Ev and
//                       columns past S zero (ldvt >= S + 32)
// with E2 = E rounded up to kpad, Evr = Ev rounded up to mpad; a bad key
// (NaN or ±∞ in its K or V row) has zeros in k and vt and is flagged.
struct Bf16Operands {
  Bf16Kernel kernel;
  int64_t E2 = 0, Evr = 0, krows = 0, ldvt = 0;
  OperandBuffer q, k, vt;  // q holds uint16_t bits
  std::vector<uint8_t> qbad, bad_keys;
  bool any_bad_keys = false;

  template <class T>
  Bf16Operands(const Problem& p, const SdpaArgs<T>& a, const Bf16Kernel& kern);
  int64_t elem() const { return kernel.a_float ? 4 : 2; }  // bytes of an A element
  const void* k_rows(const Problem& p, int64_t b, int64_t hk, int64_t j0) const {
    return k.get() + ((b * p.Hkv + hk) * krows + j0) * E2 * elem();
  }
  const void* vt_cols(const Problem& p, int64_t b, int64_t hk, int64_t j0) const {
    return vt.get() + ((b * p.Hkv + hk) * Evr * ldvt + j0) * elem();
  }
  const uint16_t* q_row(const Problem& p, int64_t b, int64_t h, int64_t i) const {
    return q.as<uint16_t>() + ((b * p.H + h) * p.L + i) * E2;
  }
};

// The backward's query-side operands, built once per call (in parallel)
// from q's operands, dout and the saved state; ldq = L + 32, columns past L
// zero; A elements as in Bf16Operands (bits, or float32 on the portable path):
//   q        [B·H·L + 16][E2]   q's operands: A of the scores (Q·Kᵀ)
//   qt       [B·H][Er][ldq]     q transposed: A of dKᵀ (Er = E up to mpad)
//   dy       [B·H·L + 16][Ev2]  dY rounded: A of dP (Ev2 = Ev up to kpad)
//   dyt      [B·H][Evr][ldq]    dY rounded, transposed: A of dVᵀ
//   D        [B·H·L]            Σ_e dY·Y with dY rounded (0 when poisoned)
//   poisoned [B·H·L]            a bad q or dY row (after rounding) or a NaN lse
// A poisoned row's dY is zeros (its q already is when q is bad).
struct Bf16BackwardOperands {
  int64_t ldq = 0, Er = 0, Ev2 = 0;
  OperandBuffer q, qt, dy, dyt;
  std::vector<float> D;
  std::vector<uint8_t> poisoned;

  Bf16BackwardOperands(const Problem& p, const Bf16Operands& ops, View4<const float> dout, View4<const float> out,
                       View3<const float> lse);
};

// The forward with bfloat16 products on `path` (T: float, float16_t or
// bfloat16_t inputs; everything else float32), on its fused_plan_bf16 or a
// given plan. Results are the same bits for any thread count.
template <class T>
void fused_forward_bf16(const Problem& p, const SdpaArgs<T>& a, View4<float> out, View4<float> weights,
                        View3<float> lse, Bf16Path path);
template <class T>
void fused_forward_bf16_tiled(const Problem& p, const SdpaArgs<T>& a, View4<float> out, View4<float> weights,
                              View3<float> lse, Bf16Path path, const FusedPlan& t);
// The units on built operands (fused.cpp: dispatched to the SIMD target).
void fused_forward_bf16_ops(const Problem& p, const Bf16Operands& ops, View4<float> out, View4<float> weights,
                            View3<float> lse, const FusedPlan& t);

// The backward with bfloat16 products on `path` (bf16-inl.h: S = Q·Kᵀ as
// the forward's, dP = dY·Vᵀ, dV += Pᵀ·dY, dK += dSᵀ·Q, dQ += dS·K, each on
// bfloat16 operands into float32 sums; dY rounded to bfloat16, P and dS
// float32 until they enter a product), on its fused_backward_plan_bf16 or a
// given plan. out and lse: the bfloat16 forward's (recomputed when empty).
// q, k and v in float32 or bfloat16 (rounded, or taken as they are, into
// the operands once, as the forward does; float16 inputs come widened).
template <class T>
void fused_backward_bf16(const Problem& p, const SdpaArgs<T>& a, View4<const float> dout,
                         const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse, Bf16Path path);
template <class T>
void fused_backward_bf16_tiled(const Problem& p, const SdpaArgs<T>& a, View4<const float> dout,
                               const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse,
                               Bf16Path path, const FusedPlan& t);
// The units on built operands (fused.cpp: dispatched to the SIMD target).
void fused_backward_bf16_ops(const Problem& p, const Bf16Operands& ops, const Bf16BackwardOperands& qo,
                             View4<const float> dout, const SdpaGrads<float>& g, View4<const float> out,
                             View3<const float> lse, const FusedPlan& t);

// For tests: one product on `path` from float32 operands A [M × K] (lda)
// and B [K × N] (ldb), rounded as above and laid out (and padded) as the
// kernels do; C [M × N] (ldc, N a multiple of 16).
void bf16_gemm(Bf16Path path, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
               int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate);
// The portable products of the running SIMD target on laid-out operands
// (fused.cpp; A as float32).
void bf16_portable_gemm(int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const uint32_t* B,
                        int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate);
// The forward's exponentials of a transposed score tile straight into its
// probability pairs, on the running SIMD target (fused.cpp; for its test):
// P = 2^(st − shift) for the tile's nk rows, tsum[r] = Σ over the rows of
// P (float32, in key order), pp as Bf16Pairs leaves it for P; nrp a
// multiple of the lane count. vcvtne2ps2bf16: as Bf16Kernel's (the same bits).
void bf16_exp_pairs(const float* st, int64_t ld, int64_t nk, int64_t K, int64_t nrp, const float* shift, float* tsum,
                    uint32_t* pp, bool vcvtne2ps2bf16 = false);

// Rows rounded to bfloat16 operands (bf16_operand) on the running SIMD
// target: x[0, n) to bits at dst (returns whether one is ±∞ or NaN); rows
// in pairs to the pair layout, dst[(r/2)·ldd + j] = (x[r][j], x[r + 1][j])
// for even r < rows, x[r] = src + r·lds, the first in the low half (past
// the last row: zeros). cvt: whether AVX-512 targets convert with
// AVX512_BF16's instruction (-1: where the CPU has it; 0: never; 1: where
// it has it; the same bits either way).
bool bf16_round_row(const float* x, int64_t n, uint16_t* dst, int cvt = -1);
// bfloat16 values x[0, n) as operands at dst: the same bits, but a
// subnormal becomes a signed zero and a NaN is made quiet (what
// bf16_operand gives for their float32 values); returns whether one is ±∞
// or NaN. SIMD on the running target.
bool bf16_operand_bits_row(const uint16_t* x, int64_t n, uint16_t* dst);
void bf16_pair_rows(const float* src, int64_t lds, int64_t rows, int64_t n, uint32_t* dst, int64_t ldd,
                    int cvt = -1);

}  // namespace attn::detail
