// Internal: how the fused kernels cut one problem into work, and the
// per-thread scratch that work needs. Compiled once (no SIMD types); the
// SIMD bodies pass in their lane count.
//
// The plan depends only on the problem's shape, never on the thread count,
// so every output element is summed in the same order for any number of
// threads (bitwise identical results).
#pragma once

#include <cstddef>
#include <cstdint>

#include <hwy/aligned_allocator.h>

#include "kernels/fused/online_softmax.hpp"
#include "kernels/problem.hpp"

namespace attn::detail {

// The widest lane count of any compiled target (AVX-512: 16 floats).
constexpr int64_t kMaxLanes = 16;
// A common multiple of the micro-kernel heights of all targets (6 and 12).
constexpr int64_t kRowMultiple = 12;
// Per-thread scratch the plan keeps within for head sizes up to 256 (it
// never grows with L or S).
constexpr int64_t kScratchBudgetBytes = 1 << 20;

struct FusedPlan {
  // A unit processes `q_block` query rows against `k_block` keys at a time.
  int64_t q_block = 0;
  int64_t k_block = 0;
  // Backward: one unit per (batch, kv head), dQ accumulated in place (true),
  // or two passes, key blocks for dK/dV then query blocks for dQ (false).
  bool own_heads = false;
  // Backward, float32 products: the query side (q·scale, dY, lse, D) built
  // once per call for every row (true), or packed per tile, once for every
  // key block a query block meets (false). The bfloat16 products always
  // build theirs once; a packed batch's units pack per tile.
  bool queries_once = false;
  // Backward, float32 products, two passes (not own_heads): K and V
  // transposed once per call (true), or per tile, once for every query
  // block and query head that meets a key block (false).
  bool keys_once = false;
};

// The one place the plan is chosen. Promises (tests/test_fused.cpp):
// q_block is a multiple of kMaxLanes (the forward's transposed score tile has
// queries along the vector lanes), k_block a multiple of kRowMultiple (rows of
// the block product), both at least one block and at most what the shape
// needs; the scratch of both directions fits kScratchBudgetBytes for head
// sizes up to 256.
FusedPlan fused_plan(const Problem& p);
// The plan of the forward with bfloat16 products (bf16.hpp), whose key and
// value operands are bfloat16: the same promises. `tiles`: the products run
// on AMX tiles (native or emulated), which take larger blocks.
FusedPlan fused_plan_bf16(const Problem& p, bool tiles = false);
// The plan of the backward with bfloat16 products: fused_plan_bf16's, both
// blocks rounded up to a multiple of 32 (whole pairs of rows and keys, and
// whole 16-row tiles of the AMX products); on AMX tiles (`tiles`), heads of
// E + Ev >= 256 take the key tiles of fused_plan_bf16(p, true).
FusedPlan fused_backward_plan_bf16(const Problem& p, bool tiles = false);

// Whether a scratch only measures its layout or also allocates it.
enum class Alloc { no, yes };

// Per-thread scratch of the forward: one zeroed, aligned block per thread
// per call, carved as below (widths padded to the lane count; padding stays
// zero or finite, so 0·pad is 0). The forward works on transposed scores
// (keys × queries): the queries are packed transposed once per unit and the
// keys are read in place.
//   qt   [E × qbp]    queries × scale·log2(e), transposed
//   st   [kb × qbp]   score tile, transposed → probabilities
//   kr   [kb × E]     keys, when their rows are not adjacent in K
//   vb   [kb × Evp]   values, when V cannot be read in place
//   o    [qb × Evp]   output accumulator
//   colv [4 × qbp]    per query: tile max, shift, rescale factor, tile sum
//   rows [qb]         per query: online-softmax state
//   qbad [qb]         per query: its row holds NaN or ±∞ (any_qbad: some does)
//   keep [kb]         one row's dropout keep factors (with dropout)
// With bfloat16 products (p.bf16_products, bf16.hpp) qt, kr, vb and o are
// not used (empty) and st has room for the padded rows of a tile:
//   st   [kbr × qbp]          kbr = kb rounded up to 16 (the AMX tile height)
//   qp   [E2 / 2 × qbp]       query pairs (bf16.hpp's pair layout), E2 = E rounded up to 32
//   pp   [kbr2 / 2 × qbp]     the tile's probability pairs, kbr2 = kb rounded up to 32
//   ot   [Evr × qbp]          output accumulator, values × queries (Evr = Ev rounded up to 16)
struct ForwardScratch {
  int64_t qb = 0, kb = 0, qbp = 0, Evp = 0;
  float *qt = nullptr, *st = nullptr, *kr = nullptr, *vb = nullptr, *o = nullptr, *colv = nullptr, *keep = nullptr;
  uint32_t *qp = nullptr, *pp = nullptr;
  float* ot = nullptr;
  online_softmax::State<float>* rows = nullptr;
  uint8_t* qbad = nullptr;
  bool any_qbad = false;

  ForwardScratch(const Problem& p, const FusedPlan& t, int64_t lanes, Alloc alloc = Alloc::yes);
  // The bytes the block takes (what is allocated, and what is reported).
  int64_t bytes() const { return bytes_; }

 private:
  int64_t bytes_ = 0;
  hwy::AlignedFreeUniquePtr<std::byte[]> mem_;
};

// Per-thread scratch of the backward, allocated the same way:
//   q   [qb × Ep]   queries × scale          kt [E × kbp]   keys, transposed
//   dy  [qb × Evp]  dY                       vt [Ev × kbp]  values, transposed
//   s   [qb × kbp]  scores → P               kr [kb × Ep]   keys (for dQ)
//   dp  [qb × kbp]  dP → dS                  dk [kb × Ep]   dK accumulator
//   dq  [qb × Ep]   dQ tile                  dv [kb × Evp]  dV accumulator
//   acc [qb × kbp]  dbias tile               dcap [qb × kbp] soft-cap derivative (with a soft-cap)
//   lse [qb], D [qb]  per query: log-sum-exp, Σ_e dY·Y
//   poisoned [qb]     per query: NaN reaches it (bad q or dY, NaN lse)
//   keep [kbp]        one row's dropout keep factors (with dropout)
// With bfloat16 products (p.bf16_products, bf16-inl.h) q, kt, dy, vt, kr,
// dk, dq and dv are not used (empty).
struct BackwardScratch {
  int64_t qb = 0, kb = 0, kbp = 0, Ep = 0, Evp = 0;
  int64_t ldk = 0;  // kt's and vt's row length: kbp, or the call's (BackwardKeys in scores-inl.h)
  float *q = nullptr, *kt = nullptr, *dy = nullptr, *vt = nullptr, *s = nullptr, *kr = nullptr,
        *dp = nullptr, *dk = nullptr, *dq = nullptr, *dv = nullptr, *acc = nullptr, *dcap = nullptr, *lse = nullptr,
        *D = nullptr, *keep = nullptr;
  uint8_t* poisoned = nullptr;

  BackwardScratch(const Problem& p, const FusedPlan& t, int64_t lanes, Alloc alloc = Alloc::yes);
  int64_t bytes() const { return bytes_; }

 private:
  int64_t bytes_ = 0;
  hwy::AlignedFreeUniquePtr<std::byte[]> mem_;
};

}  // namespace attn::detail
