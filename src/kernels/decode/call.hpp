// The decode kernel's target-independent parts (src/kernels/decode/decode.cpp
// compiles once per SIMD target and includes this once): its constants, the
// units a call is cut into, what the units share, and each thread's scratch.
#pragma once

#include <hwy/aligned_allocator.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/decode/decode.hpp"
#include "kernels/fused/common.hpp"
#include "kernels/fused/bf16.hpp"
#include "kernels/fused/online_softmax.hpp"
#include "kernels/score_rules.hpp"

namespace attn::detail::decode_common {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;
// How far ahead of the rows in use the software prefetches run, in bytes of
// K/V rows (docs/decode.md, "Prefetch distance"): on Zen 4, 6-8 KiB took
// 5-15% less time than a whole tile ahead at G = 4 and the same at G = 1.
constexpr int64_t kPrefetchBytes = 8192;
// Keys of each loop in turn when half storage interleaves the values of a
// tile with the scores of the next (docs/decode.md, "Interleaved tiles").
constexpr int64_t kInterleaveKeys = 16;
// Page runs per tile at most (pages of 16 tokens: 8 in a tile of 128 keys;
// smaller pages make shorter tiles).
constexpr int kMaxRuns = 16;

// One chunk of keys [c0, c1) for query rows [m0, m0 + nm) of (b, hk);
// first: the block's first chunk (the one whose softmax starts at the sinks).
struct Unit {
  int64_t b, hk, m0, nm, c0, c1;
  bool first;
};
// The chunks of one row block: units [first, first + count); when count > 1
// their partials live in slots [slot, slot + count).
struct Block {
  int64_t first, count, slot;
};

// Everything the units of one call share.
struct Call {
  const Problem* p;
  const KVLayout* kv;
  View4<const float> q;
  View4<float> out;
  View3<float> lse;
  DecodePlan plan;
  int64_t Ep, Evp, tilep;
  // bfloat16 products (decode/bf16.hpp) on `path`: q's bfloat16 rows are
  // Eq = E rounded up to 32 elements long, the scores' one multiply is
  // alpha = scale·log2(e), a tile's probability pairs are ldp apart per
  // row, and `zeros` is a value row of zeros (a key a row does not see).
  // pair_layout: the accumulator rows hold the features in the AVX512_BF16
  // products' order (decode_pair_position; Evp a multiple of 32).
  // even_odd: exact products over bfloat16 storage, whose value loop keeps
  // the features of each block of 2·Lanes even first, then odd
  // (EvenOddPosition in vectors-inl.h).
  // amx: the products run as 16-row tile products (kernel: AMX or its
  // emulation, kernels/fused/amx-inl.h) on operands packed per tile; the
  // accumulators then have arows = rows rounded up to 16 rows per slot.
  bool bf16 = false, pair_layout = false, even_odd = false, amx = false;
  Bf16Path path = Bf16Path::portable;
  Bf16Kernel kernel{};
  float alpha = 0;
  int64_t Eq = 0, ldp = 0, arows = 0;
  const void* zeros = nullptr;
  int64_t qcols() const { return round_up(plan.rows, 16); }  // AMX: columns of the queries' pairs
  int64_t tile16() const { return round_up(plan.tile, 32); }  // AMX: a tile's keys, padded
};

// The tile configuration of one thread for the AMX products (none else).
struct TileThread {
  const Call& c;
  explicit TileThread(const Call& call) : c(call) {
    if (c.amx && c.kernel.thread_begin) c.kernel.thread_begin();
  }
  ~TileThread() {
    if (c.amx && c.kernel.thread_end) c.kernel.thread_end();
  }
  TileThread(const TileThread&) = delete;
  TileThread& operator=(const TileThread&) = delete;
};

// ---- per-thread scratch ------------------------------------------------------
//   q    [rows × Ep]     the block's queries × scale·log2(e), zero padded
//   s    [rows × tilep]  scores of a tile → probabilities
//   s2   [rows × tilep]  the next tile's scores, while the values of a tile
//                        run (half storage interleaves the two)
//   acc  [rows × Evp]    accumulator of a chunk that is finalised directly
//   begin, end [rows]    the keys [begin, end) each row sees
//   pos  [rows]          each row's position (the slopes' distances)
//   slope [rows]         each row's per-head slope (0: none)
//   mask, bias [rows]    each row's line of the elementwise mask and bias
//   holes [rows]         the tile has a key in the row's range that the mask
//                        or a −inf bias hides (its value loop skips it)
//   kt, vt [tile × E|Ev] a tile's K and V rows gathered contiguous, when the
//                        features are not (a dense view with feature
//                        strides != 1), in the storage type (4 bytes each
//                        allocated, enough for any)
//   st, nan [rows]       online-softmax state and NaN flag (direct chunks)
// and with bfloat16 products
//   qb  [rows × Eq]      the block's queries rounded to bfloat16 (unscaled)
//   pp  [rows × ldp]     a tile's probabilities rounded, in key pairs
//   vr  [tile + 2]       the value rows of a tile's keys
//   vp  [tile + 2]       the value rows of a pair loop (zeros for keys the row
//                        does not see)
// and with AMX products (c.amx)
//   qpair [Eq/2 × qcols]     the block's queries as B of K·Qᵀ (pairs, zero columns)
//   kb  [tile16 × Eq]        a tile's keys as A of K·Qᵀ (bfloat16 bits, zero rows)
//   sc  [tile16 × qcols]     K·Qᵀ of a tile (keys × queries)
//   vb  [tile16/2 × Evp]     a tile's values as B of P·V (pairs of keys)
//   kr  [tile + 2]           the key rows of a tile
//   pp has arows rows (P as A of P·V: its pairs are the row's bfloat16 P)
// s and s2 hold two vectors more than their rows: the pairs read whole
// vectors of a row's scores past its end.
struct Scratch {
  hwy::AlignedFreeUniquePtr<float[]> q, s, s2, acc;
  hwy::AlignedFreeUniquePtr<uint16_t[]> qb, kb;
  hwy::AlignedFreeUniquePtr<uint32_t[]> pp, qpair, vb;
  hwy::AlignedFreeUniquePtr<float[]> sc;
  std::vector<const void*> vr, vp, kr;
  std::vector<int64_t> begin, end, pos;
  std::vector<float> slope;
  std::vector<rules::Line<bool>> mask;
  std::vector<rules::Line<float>> bias;
  std::vector<uint8_t> holes;
  hwy::AlignedFreeUniquePtr<uint8_t[]> kt, vt;
  std::vector<online_softmax::State<float>> st;
  std::vector<uint8_t> nan;
  explicit Scratch(const Call& c) {
    const int64_t rows = c.plan.rows;
    q = hwy::AllocateAligned<float>(size_t(rows * c.Ep));
    const int64_t pad = 64;  // >= two vectors of any target
    s = hwy::AllocateAligned<float>(size_t(rows * c.tilep + pad));
    s2 = hwy::AllocateAligned<float>(size_t(rows * c.tilep + pad));
    std::fill(s.get(), s.get() + rows * c.tilep + pad, 0.0f);
    std::fill(s2.get(), s2.get() + rows * c.tilep + pad, 0.0f);
    acc = hwy::AllocateAligned<float>(size_t(std::max(rows, c.arows) * c.Evp));
    std::fill(q.get(), q.get() + rows * c.Ep, 0.0f);
    begin.resize(size_t(rows));
    end.resize(size_t(rows));
    pos.resize(size_t(rows));
    slope.resize(size_t(rows));
    mask.resize(size_t(rows));
    bias.resize(size_t(rows));
    holes.resize(size_t(rows));
    if (c.kv->k_elem != 1 || c.kv->v_elem != 1) {  // float32 slots hold any storage type's rows
      kt = hwy::AllocateAligned<uint8_t>(size_t(c.plan.tile * c.p->E) * 4);
      vt = hwy::AllocateAligned<uint8_t>(size_t(c.plan.tile * c.p->Ev) * 4);
    }
    st.resize(size_t(rows));
    nan.resize(size_t(rows));
    if (c.bf16) {
      qb = hwy::AllocateAligned<uint16_t>(size_t(rows * c.Eq));
      std::fill(qb.get(), qb.get() + rows * c.Eq, uint16_t(0));
      const int64_t prows = std::max(rows, c.arows);
      pp = hwy::AllocateAligned<uint32_t>(size_t(prows * c.ldp));
      std::fill(pp.get(), pp.get() + prows * c.ldp, 0u);
      vr.resize(size_t(c.plan.tile + 2));
      vp.resize(size_t(c.plan.tile + 2));
    }
    if (c.amx) {
      const int64_t t16 = c.tile16(), nq = c.qcols();
      qpair = hwy::AllocateAligned<uint32_t>(size_t(c.Eq / 2 * nq));
      kb = hwy::AllocateAligned<uint16_t>(size_t(t16 * c.Eq));
      sc = hwy::AllocateAligned<float>(size_t(t16 * nq));
      vb = hwy::AllocateAligned<uint32_t>(size_t(t16 / 2 * c.Evp));
      std::fill(kb.get(), kb.get() + t16 * c.Eq, uint16_t(0));
      kr.resize(size_t(c.plan.tile + 2));
    }
  }
};

}  // namespace attn::detail::decode_common
