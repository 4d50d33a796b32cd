// Internal: the decode kernel's bfloat16 products (compute_dtype bfloat16,
// docs/decode.md "bfloat16 compute"). No SIMD types here.
//
// The kernel is decode.cpp's (tiles, chunks, online softmax, merges and
// finalisation all float32); only its two products change, and both paths
// below run them with the same arithmetic, so they give the same bits:
//
//  scores   s = alpha · Σ_e q̂_e·k̂_e, q̂ and k̂ rounded to bfloat16
//           (bf16_operand; a float32 K is rounded in registers; float16
//           storage keeps the exact products: rounding its 11-bit values
//           costs more than the products save, and AVX512_FP16 has no
//           products with float32 sums).
//           The features go in blocks of 32 into 16 float32 lanes: lane i
//           of block t adds q̂·k̂ of feature 32t + 2i + 1, then of 32t + 2i
//           (float32 fused multiply-adds, VDPBF16PS's order; features past
//           E are zeros), the blocks in order; the 16 lanes are then summed
//           by halving (lane_sum16), and the sum multiplied by alpha once.
//  values   o_e += P̂_{2m+1}·v̂_{2m+1,e}, then P̂_{2m}·v̂_{2m,e}, for the key
//           pairs m of a tile in order, P̂ the probabilities rounded to
//           bfloat16 and v̂ the values so rounded: pp holds the pairs' bits
//           (the even key in the low half), v the rows of the pair's keys
//           (a key the row does not see points at a row of zeros and has
//           P̂ = 0, so it adds nothing, not even 0·NaN).
//
// Paths: AVX512_BF16 (VDPBF16PS, VCVTNE2PS2BF16; bf16_native.cpp, compiled
// once in a `#pragma GCC target` region like the fused forward's) and the
// portable one (decode/bf16-inl.h, every SIMD target: float32 multiply-adds
// on the rounded values) give the same bits. AMX (and its emulation) runs
// the products as tile products on operands packed per tile (decode.cpp,
// AmxTile; a different order of the sums, so other bits within the same
// bound): selectable, not the default, as the packing took longer than the
// products it saves on an Emerald Rapids.
#pragma once

#include <cstdint>

#include "attn/half.hpp"
#include "kernels/decode/prefetch.hpp"
#include "kernels/fused/bf16.hpp"

namespace attn::detail {

// The sum of 16 lanes by halving: x_i + x_{i+8}, then + 4, + 2, + 1.
inline float lane_sum16(const float* x) {
  float y[8];
  for (int i = 0; i < 8; ++i) y[i] = x[i] + x[i + 8];
  for (int i = 0; i < 4; ++i) y[i] = y[i] + y[i + 4];
  for (int i = 0; i < 2; ++i) y[i] = y[i] + y[i + 2];
  return y[0] + y[1];
}

// Where the AVX512_BF16 value products keep feature e in an accumulator
// row (rows of whole blocks of 32): the interleave of two value rows into
// pairs leaves features 8β + 0..3 of each 128-bit block β of a block in the
// first 16 floats, 8β + 4..7 in the next 16.
inline int64_t decode_pair_position(int64_t e) {
  const int64_t f = e % 32, b = f / 8, i = f % 8;
  return e - f + (i < 4 ? 4 * b + i : 16 + 4 * b + i - 4);
}

// The path the decode kernel takes for bfloat16 products: AVX512_BF16
// where the CPU has it (AMX CPUs do), else portable.
Bf16Path decode_bf16_path();
// Whether calls take the bfloat16 products at all: where the fused forward
// takes AVX512_BF16 (bf16_best_path: AMD CPUs with it and no AMX, Zen 4/5),
// over every storage type, so that float32 inputs holding bfloat16 values
// give the bfloat16 inputs' bits (over a float32 cache that costs speed:
// 0.88-0.92 of the exact call's on a Zen 4, K/V from memory). Elsewhere
// they stay exact, which was faster: on an Emerald Rapids VDPBF16PS issues
// once per 2 cycles against two FMAs a cycle, and the bfloat16 loops took
// longer than the exact ones (docs/decode.md); without AVX512_BF16 the
// portable products are slower still. (Exact results are within the
// bfloat16 bound too.)
bool decode_bf16_pays();

// The AVX512_BF16 products (callable only where bf16_path_available says
// so). scores: s[r·lds + j] for rows r < rows (<= 4) and keys j < nk, q
// the rows' bfloat16 bits (ldq elements apart, zero up to E rounded up to
// 32), key j at k + j·krow elements of storage type t. values: o[r·ldo + e]
// for e < Ev in decode_pair_position's order (rows of Ev rounded up to 32),
// the npairs pairs of pp (ldp apart per row) and their 2·npairs value rows v
// (storage type t). Each runs the prefetch stream pf along.
void decode_bf16_scores_native(Dtype t, int rows, const uint16_t* q, int64_t ldq, const void* k, int64_t krow,
                               int64_t nk, int64_t E, float alpha, float* s, int64_t lds,
                               const decode_common::RowPrefetch& pf);
void decode_bf16_values_native(Dtype t, int rows, const uint32_t* pp, int64_t ldp, int64_t npairs,
                               const void* const* v, int64_t Ev, float* o, int64_t ldo,
                               const decode_common::RowPrefetch& pf);

}  // namespace attn::detail
