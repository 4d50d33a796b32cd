// The decode kernel: attention of a few new query rows per sequence over a
// long key/value history (a KV cache, or the dense K/V of a call with few
// query rows), float32 arithmetic on float32, float16 or bfloat16 storage,
// or bfloat16 products (compute_dtype bfloat16).
//
// Memory traffic is the whole story. With L new queries and S cached keys,
// the work is O(L·S·E) flops against O(S·(E + Ev)) bytes of K and V, so for
// small L the kernel is bound by the read bandwidth, and the only goal is to
// read each K and V byte once, at full speed, from every core.
//
//  * Grouped heads. The G = H / Hkv query heads that share a key/value head,
//    times the L new rows, form one block of M = G·L query rows (row
//    m = i·G + g: query i of head hk·G + g). Each K/V tile is loaded once
//    and used by all M rows, instead of once per query head.
//  * Split-KV. A (sequence, kv head, row block) has few units compared to
//    the threads when B·Hkv is small, so its keys are cut into chunks of
//    `chunk` keys; each chunk yields a partial output with its running max
//    and sum (the online-softmax state), and the chunks of a block are
//    merged in chunk order by the online softmax's merge. The chunk size is
//    a function of the shape only (decode_plan), and the same chunks are
//    merged in the same order whether they ran on one thread or many, so the
//    result is bitwise the same for any thread count.
//  * Tiles. A chunk is walked in tiles of `tile` keys (fewer at its end),
//    whatever the layout: a tile of one head is one contiguous run of
//    tile·E (and tile·Ev) elements, or in a paged cache the runs of the
//    pages it spans (at most kMaxRuns), so paged and contiguous caches give
//    the same bits and small pages do not make short tiles. Scores: a register block of
//    up to 4 rows × 2 keys (4 keys on AVX-512, ScoreKeys), E accumulated in
//    vectors (the key vector is converted once and used by the 4 rows), the
//    sums reduced across lanes four at a time by a transposing tree at the end; then the online-softmax step per row (in base 2: the queries are
//    pre-multiplied by scale·log2(e)); then acc += P·V with a register block
//    of up to 4 rows × a strip of value vectors (as wide as half the
//    vector registers allow: 4 vectors for 4 rows on AVX-512), each value
//    vector converted once; where 2 rows' whole value rows fit and 4 rows'
//    do not (Ev = 128 on AVX-512), float32 blocks of 2 rows read each value
//    row whole and in order (ValueRowBlock). The register blocks are in
//    blocks-inl.h; ScoreTile and ValueTile below drive them over a tile.
//  * Prefetch. The value loop walks a tile in strips of features (all keys
//    for the strip's features, then the next strip), which from DRAM
//    is a strided pattern the hardware prefetchers follow badly; so the
//    loops start loading rows themselves (software prefetch into the L2,
//    vectors-inl.h). The rows a chunk reads form one stream: the tile's K
//    rows, its V rows, the next tile's K rows (found through the block
//    table, so pages are followed), and so on. While the score loop uses
//    key j it starts row j + ahead of that stream, and so does the value
//    loop's first strip, `ahead` being about 8 KiB of rows
//    (kPrefetchBytes), or one tile where tiles are shorter (small pages:
//    the stream a loop sees ends with the next tile). Only the first row
//    group of a block issues them.
//    With the cache's huge pages (attn/detail/memory.hpp) the prefetches
//    nearly doubled the float32 rate from DRAM (figures in docs/decode.md).
//    Half storage interleaves the values of a tile with the scores of the
//    next, 16 keys of each in turn, so K and V are two steady streams, each
//    prefetched ahead of its own loop (ChunkT; 0-20% less time on Zen 4).
//  * Storage types: float16 and bfloat16 are widened in registers
//    (F16C / AVX-512 conversions; bfloat16 keys by one zero-masked VPERMW
//    on AVX-512, a shift elsewhere; portable code on other targets); the
//    data never exists as float32 in memory. A bfloat16 value row is read
//    as 32-bit feature pairs, a shift giving the even and an AND the odd
//    features (no shuffle), so its accumulators hold each block of 2·Lanes features even first,
//    then odd, until Finalize writes them in order (EvenOddPosition, BlockOrder: vectors-inl.h).
//    The products and their order are those of the float32 kernel on the widened values, so a
//    half-precision cache gives the float32 call's result on the rounded values, bit for bit.
//    Queries stay float32: products are float32 × (exactly widened) stored values, the contract
//    "exact for the stored precision"; a native bf16 dot (vdpbf16ps) would round q, so every
//    target widens (docs/decode.md).
//  * bfloat16 compute (p.bf16_products: compute_dtype bfloat16): the same
//    tiles, chunks, softmax and merges; the two products take bfloat16
//    operands instead (decode/bf16.hpp: q rounded once per block, K and V
//    rounded as read, P rounded per tile into key pairs), on AVX512_BF16
//    (bf16_native.cpp) or the portable path (bf16-inl.h), which give the
//    same bits. Their value loop goes over the tile's key pairs, so its
//    pieces start at even keys of the tile (a pair may span two pages), and
//    a key a row does not see reads a row of zeros with probability 0.
//
// NaN, the rule of the dense call: keys a row does not see never touch it;
// a visible key with NaN/inf in its q, k or v row poisons the row (output
// and lse NaN). A non-finite visible score sets a per-row flag (the vector
// max would drop a NaN); a non-finite v reaches the accumulator, which the
// finalisation checks; the causal diagonal of a tile is accumulated row by
// row so that a key beyond a row's end is not even multiplied by 0. A row
// that sees no key finalises to output 0, lse −inf.
//
// Written once with Highway, compiled per target (AVX-512, AVX2, SSE4,
// portable), dispatched at run time like the fused kernel.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/decode/decode.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attn/half.hpp"
#include "kernels/decode/bf16.hpp"
#include "kernels/decode/decode.hpp"
#include "kernels/fused/common.hpp"
#include "kernels/fused/online_softmax.hpp"
#include "kernels/vec-inl.h"
#include "kernels/fused/pipeline-inl.h"
#include "kernels/decode/vectors-inl.h"
#include "kernels/decode/blocks-inl.h"
#include "kernels/decode/bf16-inl.h"

#include "kernels/decode/call.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace {

using namespace decode_common;  // hn, os, DF, VF come with simd-inl.h

// The instruction set this copy of the kernel was compiled for.
const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }

#include "kernels/decode/tiles-inl.h"  // ScoreTile, ValueTile, ValueTileBf16

// ---- one chunk --------------------------------------------------------------

// q[r][e] = scale·log2(e)·Q(b, hk·G + g, i, e) for the block's rows m = i·G + g,
// and each row's keys, position and slope.
void PackQueries(const Call& c, Scratch& w, const Unit& u) {
  const Problem& p = *c.p;
  const int64_t G = p.group(), E = p.E, se = c.q.strides[3];
  const float s2 = float(p.rules.scale) * kLog2e;
  for (int64_t r = 0; r < u.nm; ++r) {
    const int64_t m = u.m0 + r, i = m / G, h = u.hk * G + m % G;
    const float* src = &c.q(u.b, h, i, 0);
    if (c.bf16) {  // rounded, unscaled: the scores' sums are scaled (bf16.hpp)
      uint16_t* dst = w.qb.get() + r * c.Eq;
      for (int64_t e = 0; e < E; ++e) dst[e] = bf16_operand(src[e * se]);
    } else {
      float* dst = w.q.get() + r * c.Ep;
      for (int64_t e = 0; e < E; ++e) dst[e] = s2 * src[e * se];
    }
    const rules::Keys k = p.keys(u.b, i);
    w.begin[size_t(r)] = k.lo, w.end[size_t(r)] = k.hi;
    w.pos[size_t(r)] = i + p.rules.offset[size_t(u.b)];
    w.slope[size_t(r)] = p.rules.slope(h);
    if (c.amx) {  // the row as a column of B of K·Qᵀ
      const int64_t nq = c.qcols();
      const uint16_t* b = w.qb.get() + r * c.Eq;
      for (int64_t kp = 0; kp < c.Eq / 2; ++kp) w.qpair[size_t(kp * nq + r)] = b[2 * kp] | uint32_t(b[2 * kp + 1]) << 16;
    }
    if (!p.rules.mask.empty()) w.mask[size_t(r)] = rules::key_row(p.rules.mask, u.b, h, i);
    if (!p.rules.bias.empty()) w.bias[size_t(r)] = rules::key_row(p.rules.bias, u.b, h, i);
  }
  if (c.amx)  // the columns past the block's rows are zeros
    for (int64_t k = 0; k < c.Eq / 2; ++k)
      std::fill(w.qpair.get() + k * c.qcols() + u.nm, w.qpair.get() + (k + 1) * c.qcols(), 0u);
}


// Whether one of x[0, n) is NaN or ±inf (x aligned, readable up to a whole
// vector past n): z = Σ 0·x is NaN exactly then.
HWY_INLINE bool AnyNonFinite(const float* HWY_RESTRICT x, int64_t n) {
  const DF d;
  const int64_t N = Lanes();
  const VF zero = hn::Zero(d);
  VF z = zero;
  int64_t i = 0;
  for (; i + N <= n; i += N) z = hn::MulAdd(hn::Load(d, x + i), zero, z);
  if (i < n) z = hn::MulAdd(hn::IfThenElseZero(hn::FirstN(d, size_t(n - i)), hn::Load(d, x + i)), zero, z);
  return std::isnan(hn::GetLane(hn::SumOfLanes(d, z)));
}

// pp[m] = the probabilities of keys 2m and 2m + 1 of a row (p) rounded to
// bfloat16, the even key in the low half, for the nk keys' pairs; the
// partner of an odd last key is 0 (p is read two vectors past its end).
HWY_INLINE void ProbabilityPairs(const float* p, int64_t nk, uint32_t* pp) {
  const int64_t npairs = (nk + 1) / 2;
#if HWY_TARGET == HWY_SCALAR  // one lane
  for (int64_t m = 0; m < npairs; ++m) pp[m] = bf16_operand(p[2 * m]) | uint32_t(bf16_operand(p[2 * m + 1])) << 16;
#else
  const DB d;
  const DBU du;
  for (int64_t m = 0; m < npairs; m += kBLanes) {
    const auto lo = RoundToBf16High(hn::LoadU(d, p + 2 * m)), hi = RoundToBf16High(hn::LoadU(d, p + 2 * m + kBLanes));
    const auto even = hn::ConcatEven(du, hi, lo), odd = hn::ConcatOdd(du, hi, lo);
    hn::StoreU(hn::Or(hn::ShiftRight<16>(even), hn::And(odd, hn::Set(du, 0xFFFF0000u))), du, pp + m);
  }
#endif
  if (nk % 2) pp[nk / 2] &= 0xFFFFu;
}

// Folds tile scores s (nk keys from j0) into the rows' states: the score
// pipeline (pipeline-inl.h, in base 2 as the queries were scaled by
// log2(e)) hides the keys a row does not see (and the padding up to tilep),
// then the scores become 2^(s − shift) and the rows of acc are rescaled.
void SoftmaxTile(const Call& c, Scratch& w, int64_t nm, int64_t j0, int64_t nk, float* acc,
                 os::State<float>* st, uint8_t* nan) {
  const DF d;
  const int64_t N = Lanes();
  // Only the vectors that hold the tile's keys: a short tile (pages of 16
  // tokens) costs its length, not tilep. Past them every score would be
  // −inf (a 0 added to the sum, nothing to the max), so the bits are those
  // of the whole row.
  const int64_t span = std::min(c.tilep, round_up(nk, N));
  for (int64_t r = 0; r < nm; ++r) {
    float* row = w.s.get() + r * c.tilep;
    const rules::Keys vis = TileKeys(w, r, j0, nk);
    // The scores the row does not see become 0 first: the NaN check reads
    // whole vectors, and the soft-cap's tanh picks its formula per vector,
    // so what lies beside a visible score must be the same on every call
    // (the padding past nk is left over from earlier tiles).
    std::fill(row, row + vis.lo, 0.0f);
    std::fill(row + vis.hi, row + span, 0.0f);
    // So do the keys the mask or a −inf bias hides: an infinite hidden key
    // does not poison the row either.
    const bool elementwise = c.p->rules.elementwise();
    w.holes[size_t(r)] = 0;
    for (int64_t jj = vis.lo; elementwise && jj < vis.hi; ++jj)
      if (Hidden(*c.p, w, r, j0 + jj)) row[jj] = 0.0f, w.holes[size_t(r)] = 1;
    // A visible score that is not finite (NaN, or ±inf from an infinite q or
    // k) poisons the row; the vector max would drop a NaN, and the soft-cap
    // would turn ±inf into a plausible ±c.
    if (AnyNonFinite(row, span)) nan[r] = 1;
    // The rules, in base 2 like the scores (pipeline-inl.h).
    ScoreLine line;
    line.lo = vis.lo, line.hi = vis.hi;
    line.distance = float(j0 - w.pos[size_t(r)]), line.slope = w.slope[size_t(r)];
    if (!c.p->rules.bias.empty()) line.bias = w.bias[size_t(r)];
    if (!c.p->rules.mask.empty()) line.mask = w.mask[size_t(r)];
    line.at = j0;
    ApplyScoreRules(row, span, line, c.p->rules, kLog2e, nullptr);
    VF vmax = hn::Set(d, kNegInf);
    for (int64_t jj = 0; jj < span; jj += N) vmax = hn::Max(vmax, hn::Load(d, row + jj));
    const os::Step<float> step = os::begin_tile<os::Base2>(st[r], hn::GetLane(hn::MaxOfLanes(d, vmax)));
    const VF shift = hn::Set(d, step.shift);
    VF sum = hn::Zero(d);
    for (int64_t jj = 0; jj < span; jj += N) {
      const VF pj = Exp2Softmax(d, hn::Sub(hn::Load(d, row + jj), shift));  // 0 where masked
      hn::Store(pj, d, row + jj);
      sum = hn::Add(sum, pj);
    }
    os::end_tile(st[r], hn::GetLane(hn::SumOfLanes(d, sum)));
    if (step.alpha != 1.0f) ScaleRow(acc + r * c.Evp, c.Evp, step.alpha);  // acc <- acc · alpha
    if (c.bf16) ProbabilityPairs(row, nk, w.pp.get() + r * c.ldp);  // the row sum keeps the unrounded P
  }
}

#include "kernels/decode/amx_tiles-inl.h"  // KeyBits, ValuePairs, AmxTile

template <class T>
void ChunkT(const Call& c, Scratch& w, const Unit& u, float* acc, os::State<float>* st, uint8_t* nan) {
  const KVLayout& kv = *c.kv;
  PackQueries(c, w, u);
  std::fill(acc, acc + u.nm * c.Evp, 0.0f);
  // The block's first chunk starts each row's softmax at its head's sink (one
  // seen logit with no value), as the fused kernel does; the merge of the
  // chunks then counts it once.
  for (int64_t r = 0; r < u.nm; ++r) {
    const float sink2 = u.first ? c.p->rules.sink(u.hk * c.p->group() + (u.m0 + r) % c.p->group()) * kLog2e : kNegInf;
    st[r] = os::State<float>{sink2, sink2 == kNegInf ? 0.0f : 1.0f}, nan[r] = 0;
  }
  const int64_t kend = std::min(u.c1, w.end[size_t(u.nm - 1)]);  // rows are in query order
  const T* kbase = static_cast<const T*>(kv.k);
  const T* vbase = static_cast<const T*>(kv.v);
  // The tile of keys from j0: up to plan.tile keys in up to kMaxRuns runs,
  // each run the keys of one page (contiguous K rows, contiguous V rows),
  // `off` its first key in the tile. A contiguous layout gives one run.
  struct Run {
    const T *k, *v;
    int64_t off, nk;
  };
  struct Tile {
    std::array<Run, kMaxRuns> run;
    int nr = 0;
    int64_t nk = 0;
  };
  const auto tile_at = [&](int64_t j0) {
    Tile x;
    for (int64_t j = j0; j < kend && x.nk < c.plan.tile && x.nr < kMaxRuns;) {
      const int64_t slot = j / kv.page_size, off = j % kv.page_size;
      const int64_t page = kv.table ? kv.table[u.b * kv.table_stride + slot] : u.b;
      const int64_t n = std::min({c.plan.tile - x.nk, kend - j, kv.page_size - off});
      x.run[size_t(x.nr++)] = Run{kbase + page * kv.k_page + u.hk * kv.k_head + off * kv.k_row,
                                  vbase + page * kv.v_page + u.hk * kv.v_head + off * kv.v_row, x.nk, n};
      x.nk += n, j += n;
    }
    return x;
  };
  const int64_t E = c.p->E, Ev = c.p->Ev, krow = kv.k_row, vrow = kv.v_row;
  const auto next_tile = [&](int64_t j0, const Tile& x) { return j0 + x.nk < kend ? tile_at(j0 + x.nk) : Tile{}; };
  const auto k_rows = [&](const Run& x, int64_t from) { return x.nk > from ? RowsOf(x.k + from * krow, krow, E, x.nk - from) : RowPrefetch::Segment{}; };
  const auto v_rows = [&](const Run& x, int64_t from) { return x.nk > from ? RowsOf(x.v + from * vrow, vrow, Ev, x.nk - from) : RowPrefetch::Segment{}; };
  // The first run of a tile (none: an empty run, which no stream follows).
  const auto first = [](const Tile& x) { return x.nr > 0 ? x.run[0] : Run{nullptr, nullptr, 0, 0}; };
  Tile t = u.c0 < kend ? tile_at(u.c0) : Tile{};
  // A tile's rows with their features gathered contiguous into kd, vd (a
  // dense view whose features are strided): the kernel then reads the same
  // values in the same order, so the layout does not change a bit.
  const bool gather = kv.k_elem != 1 || kv.v_elem != 1;
  T* kd = reinterpret_cast<T*>(w.kt.get());
  T* vd = reinterpret_cast<T*>(w.vt.get());
  const auto gather_tile = [&](const Tile& x) {
    for (int i = 0; i < x.nr; ++i) {
      const Run& r = x.run[size_t(i)];
      for (int64_t j = 0; j < r.nk; ++j) {
        for (int64_t e = 0; e < E; ++e) kd[(r.off + j) * E + e] = r.k[j * kv.k_row + e * kv.k_elem];
        for (int64_t e = 0; e < Ev; ++e) vd[(r.off + j) * Ev + e] = r.v[j * kv.v_row + e * kv.v_elem];
      }
    }
  };
  if (c.amx) {  // tile after tile: the rows of the next start loading, then AmxTile
    for (int64_t j0 = u.c0; j0 < kend;) {
      const Tile next = next_tile(j0, t);
      for (int i = 0; i < next.nr; ++i) {
        const Run& x = next.run[size_t(i)];
        PrefetchRows(reinterpret_cast<const char*>(x.k), krow * int64_t(sizeof(T)), x.nk, E * int64_t(sizeof(T)));
        PrefetchRows(reinterpret_cast<const char*>(x.v), vrow * int64_t(sizeof(T)), x.nk, Ev * int64_t(sizeof(T)));
      }
      if (gather) gather_tile(t);
      for (int i = 0; i < t.nr; ++i) {
        const Run& x = t.run[size_t(i)];
        for (int64_t j = 0; j < x.nk; ++j) {
          const int64_t at = x.off + j;
          w.kr[size_t(at)] = gather ? kd + at * E : x.k + j * krow;
          w.vr[size_t(at)] = gather ? vd + at * Ev : x.v + j * vrow;
        }
      }
      AmxTile<T>(c, w, u, j0, t.nk, acc, st, nan);
      j0 += t.nk;
      t = next;
    }
    return;
  }
  if (gather) {  // strided features: each tile's rows gathered, then as usual
    for (int64_t j0 = u.c0; j0 < kend;) {
      const Tile next = next_tile(j0, t);
      gather_tile(t);
      ScoreTile(c, w, u.nm, kd, E, t.nk, w.s.get(), RowPrefetch{});
      SoftmaxTile(c, w, u.nm, j0, t.nk, acc, st, nan);
      if (c.bf16) {
        for (int64_t j = 0; j < t.nk; ++j) w.vr[size_t(j)] = vd + j * Ev;
        ValueTileBf16<T>(c, w, u.nm, w.vr.data(), j0, t.nk, 0, t.nk, acc, RowPrefetch{});
      } else {
        ValueTile(c, w, u.nm, w.s.get(), vd, Ev, j0, t.nk, acc, RowPrefetch{});
      }
      j0 += t.nk;
      t = next;
    }
    return;
  }
  // The loops start loading rows about kPrefetchBytes ahead of the row they
  // use, along a stream of the rows they read next (a short run runs as far
  // ahead as it is long), first the rows of the chunk's first tile that no
  // earlier loop started.
  const int64_t ahead = ceil_div(kPrefetchBytes, std::max({E, Ev, int64_t(1)}) * int64_t(sizeof(T)));
  RowPrefetch{k_rows(first(t), 0), {}, 0}.rows(0, std::min(first(t).nk, ahead));
  // The scores of a whole tile into w.s, run by run; the stream is K of each
  // run, then V of the first: the loop runs ahead into the rows the value
  // loop reads next.
  const auto score_tile = [&](const Tile& x) {
    for (int i = 0; i < x.nr; ++i) {
      const Run& r = x.run[size_t(i)];
      const auto then = i + 1 < x.nr ? k_rows(x.run[size_t(i + 1)], 0) : v_rows(x.run[0], 0);
      ScoreTile(c, w, u.nm, r.k, krow, r.nk, w.s.get() + r.off, RowPrefetch{k_rows(r, 0), then, std::min(r.nk, ahead)});
    }
  };
  struct Piece {
    int run;
    int64_t from, nk;  // keys [from, from + nk) of the run (bf16_pieces: the last may be the next run's first)
  };
  const auto exact_pieces = [](const Tile& x, std::vector<Piece>& out) {
    out.clear();
    for (int i = 0; i < x.nr; ++i)
      for (int64_t b = 0; b < x.run[size_t(i)].nk; b += kInterleaveKeys)
        out.push_back({i, b, std::min(kInterleaveKeys, x.run[size_t(i)].nk - b)});
  };
  // With bfloat16 products the value pieces start at even keys of the tile
  // (a run's start rounded up; the piece before takes the key between), at
  // most `step` keys each: the pairs are the tile's, whatever the runs.
  const auto bf16_pieces = [](const Tile& x, int64_t step, std::vector<Piece>& out) {
    out.clear();
    for (int i = 0; i < x.nr; ++i) {
      const Run& r = x.run[size_t(i)];
      const int64_t end = i + 1 < x.nr ? round_up(x.run[size_t(i + 1)].off, 2) : x.nk;
      for (int64_t a = round_up(r.off, 2); a < end; a += step) out.push_back({i, a - r.off, std::min(step, end - a)});
    }
  };
  // The value rows of a tile's keys (bfloat16 products).
  const auto value_rows = [&](const Tile& x) {
    for (int i = 0; i < x.nr; ++i)
      for (int64_t j = 0; j < x.run[size_t(i)].nk; ++j) w.vr[size_t(x.run[size_t(i)].off + j)] = x.run[size_t(i)].v + j * vrow;
  };
  std::vector<Piece> pt, pn;

  // The stream after piece p of tile x: the rest of its run, then the next
  // run of x, or the first run of `then` after x's last run.
  const auto k_stream = [&](const Tile& x, const Piece& p, const Tile& then) {
    const Run& r = x.run[size_t(p.run)];
    return RowPrefetch{k_rows(r, p.from), k_rows(p.run + 1 < x.nr ? x.run[size_t(p.run + 1)] : first(then), 0),
                       std::min(ahead, r.nk)};
  };
  const auto v_stream = [&](const Tile& x, const Piece& p, const Tile& then) {
    const Run& r = x.run[size_t(p.run)];
    return RowPrefetch{v_rows(r, p.from), v_rows(p.run + 1 < x.nr ? x.run[size_t(p.run + 1)] : first(then), 0),
                       std::min(ahead, r.nk)};
  };
  if constexpr (sizeof(T) == 4) {
    // float32: the scores of a tile, then its values, run by run; the value
    // loop's stream is V of each run, then K of the next tile.
    for (int64_t j0 = u.c0; j0 < kend;) {
      const Tile next = next_tile(j0, t);
      score_tile(t);
      SoftmaxTile(c, w, u.nm, j0, t.nk, acc, st, nan);
      if (c.bf16) {  // the runs' pieces (pairs may span two runs), each with its run's stream
        value_rows(t);
        bf16_pieces(t, c.plan.tile, pt);
        for (const Piece& p : pt) {  // the stream: V of the run's rest, its next run, then K of the next tile
          const Run& r = t.run[size_t(p.run)];
          const auto then = p.run + 1 < t.nr ? v_rows(t.run[size_t(p.run + 1)], 0) : k_rows(first(next), 0);
          ValueTileBf16<T>(c, w, u.nm, w.vr.data(), j0, t.nk, r.off + p.from, r.off + p.from + p.nk, acc,
                           RowPrefetch{v_rows(r, p.from), then, std::min(ahead, r.nk)});
        }
        j0 += t.nk;
        t = next;
        continue;
      }
      for (int i = 0; i < t.nr; ++i) {
        const Run& x = t.run[size_t(i)];
        const auto then = i + 1 < t.nr ? v_rows(t.run[size_t(i + 1)], 0) : k_rows(first(next), 0);
        ValueTile(c, w, u.nm, w.s.get() + x.off, x.v, vrow, j0 + x.off, x.nk, acc,
                  RowPrefetch{v_rows(x, 0), then, std::min(x.nk, ahead)});
      }
      j0 += t.nk;
      t = next;
    }
    return;
  }
  // Half storage: the values of a tile interleaved with the scores of the
  // next, a piece of at most kInterleaveKeys keys of each in turn (pieces cut
  // from the start of each run), so the K and V rows are read as two steady
  // streams rather than in bursts (the value loop, widening each row once
  // for 4 query rows, reads its rows several times faster than the score
  // loop). Each stream runs about kPrefetchBytes ahead. The next tile's
  // softmax waits for this tile's values (it rescales acc), and every output
  // element still sums its keys in order, and every score is the float32
  // loop's (its run is cut at even offsets, so its keys pair the same way):
  // the float32 loop's bits on the widened values (docs/decode.md,
  // "Interleaved tiles").
  if (t.nk == 0) return;
  // The value pieces of a tile (the score pieces are always exact_pieces:
  // a score reads its own key only).
  const auto value_pieces = [&](const Tile& x, std::vector<Piece>& out) {
    if (c.bf16) bf16_pieces(x, kInterleaveKeys, out);
    else exact_pieces(x, out);
  };
  Tile next = next_tile(u.c0, t);
  score_tile(t);  // the first tile's scores as the float32 loop's (nothing to interleave with)
  SoftmaxTile(c, w, u.nm, u.c0, t.nk, acc, st, nan);
  RowPrefetch{k_rows(first(next), 0), {}, 0}.rows(0, std::min(first(next).nk, ahead));
  int64_t j0 = u.c0;
  while (next.nk > 0) {
    const Tile after = next_tile(j0 + t.nk, next);
    exact_pieces(next, pn);
    value_pieces(t, pt);
    if (c.bf16) value_rows(t);
    for (size_t i = 0; i < std::max(pt.size(), pn.size()); ++i) {
      if (i < pn.size()) {
        const Piece& p = pn[i];
        const Run& r = next.run[size_t(p.run)];
        ScoreTile(c, w, u.nm, r.k + p.from * krow, krow, p.nk, w.s2.get() + r.off + p.from, k_stream(next, p, after));
      }
      if (i < pt.size()) {
        const Piece& p = pt[i];
        const Run& r = t.run[size_t(p.run)];
        if (c.bf16)
          ValueTileBf16<T>(c, w, u.nm, w.vr.data(), j0, t.nk, r.off + p.from, r.off + p.from + p.nk, acc,
                           v_stream(t, p, next));
        else
          ValueTile(c, w, u.nm, w.s.get() + r.off + p.from, r.v + p.from * vrow, vrow, j0 + r.off + p.from, p.nk,
                    acc, v_stream(t, p, next));
      }
    }
    std::swap(w.s, w.s2);
    j0 += t.nk;
    SoftmaxTile(c, w, u.nm, j0, next.nk, acc, st, nan);
    t = next;
    next = after;
  }
  value_pieces(t, pt);
  if (c.bf16) value_rows(t);
  for (const Piece& p : pt) {
    const Run& r = t.run[size_t(p.run)];
    if (c.bf16)
      ValueTileBf16<T>(c, w, u.nm, w.vr.data(), j0, t.nk, r.off + p.from, r.off + p.from + p.nk, acc,
                       v_stream(t, p, Tile{}));
    else
      ValueTile(c, w, u.nm, w.s.get() + r.off + p.from, r.v + p.from * vrow, vrow, j0 + r.off + p.from, p.nk, acc,
                v_stream(t, p, Tile{}));
  }
}

void Chunk(const Call& c, Scratch& w, const Unit& u, float* acc, os::State<float>* st, uint8_t* nan) {
  switch (c.kv->type) {
    case Dtype::float32: return ChunkT<float>(c, w, u, acc, st, nan);
    case Dtype::float16: return ChunkT<hwy::float16_t>(c, w, u, acc, st, nan);
    case Dtype::bfloat16: return ChunkT<hwy::bfloat16_t>(c, w, u, acc, st, nan);
  }
}

// out = acc / sum and lse for the block's rows (NaN rows stay NaN).
void Finalize(const Call& c, const Unit& u, const float* acc, const os::State<float>* st, const uint8_t* nan) {
  const Problem& p = *c.p;
  const DF d;
  const int64_t G = p.group(), se = c.out.strides[3], N = Lanes();
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const BlockOrder order(c.pair_layout);
  for (int64_t r = 0; r < u.nm; ++r) {
    const int64_t m = u.m0 + r, i = m / G, h = u.hk * G + m % G;
    const os::Final<float> f = os::finalize<os::Base2>(st[r]);
    const float* o = acc + r * c.Evp;
    // A non-finite value row the row sees leaves acc non-finite: poisoned too.
    const bool bad = nan[r] || std::isnan(f.lse) || AnyNonFinite(o, c.pair_layout ? c.Evp : p.Ev);
    const float inv = bad ? qnan : f.inv_sum;
    float* dst = &c.out(u.b, h, i, 0);
    int64_t e = 0;
    if (c.pair_layout || c.even_odd)  // the features in the AVX512_BF16 products' order (bf16.hpp), or even/odd
      for (e = se == 1 ? order.Write(o, p.Ev, inv, dst) : 0; e < p.Ev; ++e)
        dst[e * se] = o[c.pair_layout ? decode_pair_position(e) : EvenOddPosition(e, p.Ev)] * inv;
    if (se == 1)
      for (const VF vinv = hn::Set(d, inv); e + N <= p.Ev; e += N)
        hn::StoreU(hn::Mul(hn::Load(d, o + e), vinv), d, dst + e);
    for (; e < p.Ev; ++e) dst[e * se] = o[e] * inv;  // y = acc / sum
    if (!c.lse.empty()) c.lse(u.b, h, i) = bad ? qnan : f.lse * kLn2;  // natural units
  }
}

// Merges the partial slots of a block in chunk order into the first, then finalises.
void MergeBlock(const Call& c, const Unit& u, const Block& blk, float* pacc, os::State<float>* pst,
                uint8_t* pnan) {
  const int64_t rows = c.plan.rows, Evp = c.Evp;
  float* acc0 = pacc + blk.slot * c.arows * Evp;
  os::State<float>* st0 = pst + blk.slot * rows;
  uint8_t* nan0 = pnan + blk.slot * rows;
  for (int64_t k = 1; k < blk.count; ++k) {
    const float* acck = pacc + (blk.slot + k) * c.arows * Evp;
    const os::State<float>* stk = pst + (blk.slot + k) * rows;
    const uint8_t* nank = pnan + (blk.slot + k) * rows;
    for (int64_t r = 0; r < u.nm; ++r) {
      const os::MergeWeights<float> mw = os::merge<os::Base2>(st0[r], stk[r]);
      float* o = acc0 + r * Evp;
      const float* ok = acck + r * Evp;
      for (int64_t e = 0; e < Evp; ++e) o[e] = mw.wa * o[e] + mw.wb * ok[e];  // acc = wa·acc_a + wb·acc_b
      nan0[r] |= nank[r];
    }
  }
  Finalize(c, u, acc0, st0, nan0);
}

void ForwardImpl(const Problem& p, const KVLayout& kv, View4<const float> q, View4<float> out,
                 View3<float> lse, DecodePlan plan, Bf16Path path) {
  const int64_t lanes = Lanes();
  Call c{&p, &kv, q, out, lse, plan, round_up(p.E, lanes), round_up(p.Ev, lanes), round_up(plan.tile, lanes)};
  c.arows = plan.rows;
  std::vector<float> zeros;  // a value row of zeros, in any storage type
  c.even_odd = kv.type == Dtype::bfloat16 && !p.bf16_products;  // the exact value loop's order (LoadValues)
  // bfloat16 products, but for float16 storage (decode/bf16.hpp: rounding
  // its values would cost more than the products save).
  if (p.bf16_products && kv.type != Dtype::float16) {
    c.bf16 = true;
    c.path = path;
    c.alpha = float(p.rules.scale) * kLog2e;
    c.Eq = round_up(p.E, 32);
    c.ldp = round_up(ceil_div(c.tilep, 2), 16);
    c.pair_layout = c.path == Bf16Path::avx512_bf16;
    if (c.pair_layout) c.Evp = round_up(p.Ev, 32);
    if (c.path == Bf16Path::amx || c.path == Bf16Path::amx_emulated) {  // products of 16-row tiles
      c.kernel = bf16_kernel(c.path);
      c.amx = true;
      c.Evp = round_up(p.Ev, 16);
      c.arows = round_up(plan.rows, 16);
    }
    zeros.assign(size_t(round_up(p.Ev, 32)), 0.0f);
    c.zeros = zeros.data();
  }
  // The units: every (b, hk, row block) cut into chunks of the keys its rows
  // see, [lo of its first row, hi of its last) (a block that sees none still
  // has one, empty, chunk: its rows finalise to 0 and −inf, or the sink).
  const int64_t M = p.group() * p.L;
  std::vector<Unit> units;
  std::vector<Block> blocks;
  int64_t slots = 0;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t hk = 0; hk < p.Hkv; ++hk)
      for (int64_t m0 = 0; m0 < M; m0 += plan.rows) {
        const int64_t nm = std::min(plan.rows, M - m0);
        const int64_t klo = p.keys(b, m0 / p.group()).lo;
        const int64_t khi = std::max(klo, p.keys(b, (m0 + nm - 1) / p.group()).hi);
        const int64_t count = std::max<int64_t>(1, ceil_div(khi - klo, plan.chunk));
        blocks.push_back({int64_t(units.size()), count, count > 1 ? slots : -1});
        if (count > 1) slots += count;
        for (int64_t k = 0; k < count; ++k)
          units.push_back({b, hk, m0, nm, klo + k * plan.chunk, std::min(khi, klo + (k + 1) * plan.chunk), k == 0});
      }
  // Partials of the chunks of split blocks, slot by slot (layout as in Scratch).
  const int64_t rows = plan.rows;
  hwy::AlignedFreeUniquePtr<float[]> pacc = hwy::AllocateAligned<float>(size_t(std::max<int64_t>(1, slots * c.arows * c.Evp)));
  std::vector<os::State<float>> pst(size_t(slots * rows));
  std::vector<uint8_t> pnan(size_t(slots * rows));
  // Unit u of block k computes into slot (k.slot + its index), or straight
  // into the scratch accumulator and the output when the block has one chunk.
  auto run_unit = [&](Scratch& w, const Block& blk, int64_t k) {
    const Unit& u = units[size_t(blk.first + k)];
    if (blk.count == 1) {
      Chunk(c, w, u, w.acc.get(), w.st.data(), w.nan.data());
      Finalize(c, u, w.acc.get(), w.st.data(), w.nan.data());
    } else {
      const int64_t s = blk.slot + k;
      Chunk(c, w, u, pacc.get() + s * c.arows * c.Evp, pst.data() + s * rows, pnan.data() + s * rows);
    }
  };
  std::vector<int64_t> unit_block(units.size());
  for (size_t k = 0; k < blocks.size(); ++k)
    for (int64_t i = 0; i < blocks[k].count; ++i) unit_block[size_t(blocks[k].first + i)] = int64_t(k);
  // A split block is merged by the thread that finishes its last chunk (the
  // chunks' partials are merged in chunk order whoever runs them), so the
  // threads meet once, at the end: no barrier between the units and the
  // merges, which under OMP_WAIT_POLICY=passive cost a sleeping thread's
  // wake-up of about 25 µs a call (an empty parallel region after 1 ms idle,
  // Emerald Rapids VM). The counter's acquire-release decrement makes the
  // other chunks' partials visible to the merging thread.
  std::vector<std::atomic<int64_t>> chunks_left(blocks.size());
  for (size_t k = 0; k < blocks.size(); ++k) chunks_left[k].store(blocks[k].count, std::memory_order_relaxed);
  const int64_t nunits = int64_t(units.size());
  const int threads = plan.serial ? 1 : int(std::min<int64_t>(p.threads, nunits));
#pragma omp parallel num_threads(std::max(threads, 1))
  {
    const FlushToZero ftz;  // as the fused kernels (kernels/fused/common.hpp)
    Scratch w(c);
    const TileThread tiles(c);  // AMX: the tile configuration of this thread
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < nunits; ++i) {
      const int64_t k = unit_block[size_t(i)];
      const Block& blk = blocks[size_t(k)];
      run_unit(w, blk, i - blk.first);
      if (blk.count > 1 && chunks_left[size_t(k)].fetch_sub(1, std::memory_order_acq_rel) == 1)
        MergeBlock(c, units[size_t(blk.first)], blk, pacc.get(), pst.data(), pnan.data());
    }
  }
}

}  // namespace
}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

// ---- storage conversions ----------------------------------------------------

HWY_EXPORT(WidenImpl);

void convert_from_storage(Dtype t, const void* src, int64_t n, float* y) {
  // Widening is exact: the kernel's own vector conversions (F16C where the
  // CPU has it; a shift for bfloat16).
  if (t == Dtype::float32) return (void)std::memcpy(y, src, size_t(n) * 4);
  HWY_DYNAMIC_DISPATCH(WidenImpl)(t, src, n, y);
}

// ---- the kernel ---------------------------------------------------------------

HWY_EXPORT(ForwardImpl);
HWY_EXPORT(TargetNameImpl);

void decode_forward_planned(const Problem& p, const KVLayout& kv, View4<const float> q, View4<float> out,
                            View3<float> lse, DecodePlan plan, Bf16Path path) {
  if (p.bf16_products && !bf16_path_available(path))
    throw std::logic_error(std::string("decode_forward_planned: this CPU does not run ") + bf16_path_name(path));
  HWY_DYNAMIC_DISPATCH(ForwardImpl)(p, kv, q, out, lse, plan, path);
}

void decode_forward(const Problem& p, const KVLayout& kv, View4<const float> q, View4<float> out,
                    View3<float> lse) {
  if (p.bf16_products && !decode_bf16_pays()) {  // exact where that is faster (bf16.hpp)
    Problem exact = p;
    exact.bf16_products = false;
    return decode_forward_planned(exact, kv, q, out, lse, decode_plan(p), decode_bf16_path());
  }
  decode_forward_planned(p, kv, q, out, lse, decode_plan(p), decode_bf16_path());
}

const char* decode_target_name() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }

}  // namespace attn::detail
#endif  // HWY_ONCE
