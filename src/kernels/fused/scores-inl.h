// The fused kernels' operands and score tiles, for one SIMD target (included
// once per target through attention-inl.h; no ordinary include guard): the
// NaN/±∞ marking of K and V rows, the packing of strided views into dense
// scratch (prefetching rows that are not adjacent), the one function per
// direction that builds a score tile through the score rules (ScoreTileT
// for the forward, in base 2 and transposed; ScoreTile for the backward),
// and the backward's packed blocks (its query and key sides, per tile or
// once per call). The units that use them, forward and backward side by
// side, are in attention-inl.h.

// Per-target include guard, the Highway way (see attention-inl.h).
#if defined(ATTN_KERNELS_FUSED_SCORES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_FUSED_SCORES_INL_H_
#undef ATTN_KERNELS_FUSED_SCORES_INL_H_
#else
#define ATTN_KERNELS_FUSED_SCORES_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attn/sdpa.hpp"
#include "kernels/fused/bf16.hpp"
#include "kernels/fused/common.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/fused/online_softmax.hpp"
#include "kernels/fused/simd-inl.h"
#include "kernels/fused/pipeline-inl.h"
#include "kernels/fused/tiles.hpp"
#include "kernels/prefetch.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

// ---- NaN and ±∞ in the inputs ------------------------------------------------
//
// The rule (docs/fused.md, "NaN and infinities"): a key a row cannot see
// (causal, key_lengths, mask, bias −∞) never touches the row. A visible pair
// (i, j) whose query row, key row or value row holds NaN or ±∞ gets a NaN
// score; a row with a NaN or +∞ visible score is poisoned: output and lse
// NaN, weights NaN where visible, gradients NaN wherever the row reaches.
// The kernels keep the products finite and carry the poison in the scores:
// bad K/V rows and bad query rows are flagged while packing and replaced by
// zeros in the packed operands, and NaN is written into the visible scores.

// Whether a row of n floats (stride sx) holds NaN or ±∞: x − x is 0 for
// every finite x and NaN otherwise, so the sum of x − x over the row is 0
// exactly when the row is finite (vectors over a dense row).
bool RowNonFinite(const float* x, int64_t n, int64_t sx) {
  if (sx != 1) {
    bool any = false;
    for (int64_t e = 0; e < n; ++e) any |= non_finite(x[e * sx]);
    return any;
  }
  const DF d;
  const int64_t N = Lanes();
  VF acc = hn::Zero(d);
  int64_t e = 0;
  for (; e + N <= n; e += N) {
    const VF v = hn::LoadU(d, x + e);
    acc = hn::Add(acc, hn::Sub(v, v));
  }
  bool any = !hn::AllTrue(d, hn::Eq(acc, hn::Zero(d)));
  for (; e < n; ++e) any |= non_finite(x[e]);
  return any;
}

// Rows [u0, u1) of the index space of MarkBadKeys, marked; returns whether
// any is bad. The index space runs through K in memory order: key-major,
// heads fastest, when K's heads are closer together than its keys (a packed
// (total, H, E) batch or a (B, S, H, E) tensor), so that consecutive rows are
// adjacent in memory and a thread's share is one stream; head-major
// otherwise. (Walking a packed batch head by head reads every 8th row from
// memory, 2 KiB apart: about 4% of a 16-sequence varlen forward in a
// profile, against 1%.) The position of u0 is decoded once and then stepped:
// three divisions per row cost more than the row's check (8.5% of a
// windowed forward, w = 512 at S = 16384, on AVX-512). The mark always lands
// at bad[(b·Hkv + hk)·S + j].
bool MarkBadKeyRange(const Problem& p, const SdpaArgs<float>& a, uint8_t* bad, int64_t u0, int64_t u1) {
  const bool key_major = a.k.strides[1] < a.k.strides[2];
  const int64_t inner_n = key_major ? p.Hkv : p.S, outer_n = key_major ? p.S : p.Hkv;
  int64_t inner = u0 % inner_n, outer = (u0 / inner_n) % outer_n, b = u0 / (p.S * p.Hkv);
  bool any = false;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t j = key_major ? outer : inner, hk = key_major ? inner : outer;
    const bool row_bad = RowNonFinite(&a.k(b, hk, j, 0), p.E, a.k.strides[3]) ||
                         RowNonFinite(&a.v(b, hk, j, 0), p.Ev, a.v.strides[3]);
    bad[(b * p.Hkv + hk) * p.S + j] = row_bad;
    any = any || row_bad;
    if (++inner == inner_n) {
      inner = 0;
      if (++outer == outer_n) outer = 0, ++b;
    }
  }
  return any;
}
// Rows per work item of the marking loops (a fixed split: any thread count
// marks the same rows).
constexpr int64_t kMarkBlock = 512;

// bad[(b·Hkv + hk)·S + j] = 1 where K or V row j of (b, hk) holds NaN or ±∞;
// returns whether any does. One pass over K and V per call.
bool MarkBadKeys(const Problem& p, const SdpaArgs<float>& a, std::vector<uint8_t>& bad) {
  const int64_t rows = p.B * p.Hkv * p.S;
  bad.assign(size_t(rows), 0);
  bool any = false;
#pragma omp parallel for num_threads(p.threads) schedule(static) reduction(|| : any)
  for (int64_t u = 0; u < rows; u += kMarkBlock)
    any = MarkBadKeyRange(p, a, bad.data(), u, std::min(rows, u + kMarkBlock)) || any;
  return any;
}

// A call's shared state, with the bad keys marked (kept alive by `bad`).
FusedCall MakeCall(const Problem& p, const SdpaArgs<float>& a, const FusedPlan& t, std::vector<uint8_t>& bad) {
  FusedCall c{&p, &a, t, float(p.rules.scale)};
  c.any_bad_keys = MarkBadKeys(p, a, bad);
  c.bad_keys = bad.data();
  return c;
}

// ---- packing (strided views → dense scratch) -------------------------------

// Rows that are not adjacent (a packed batch's rows lie H·F floats apart)
// are fetched from memory one by one, each a few cache lines after a jump
// the hardware prefetchers follow badly; the copies below ask for the row
// kAhead rows on while they copy the current one, so that several rows are
// in flight at once. (16-sequence varlen forward read in place, Zen 3:
// 0.86-0.87 of the dense kernel's GFLOP/s without, 0.92 with, one run of 21
// paired repetitions.)
constexpr int64_t kAhead = 8;

void PrefetchRow(const float* row, int64_t F, int64_t sf) {
  if (sf != 1) return;  // element-strided rows: one line per element, not worth it
  PrefetchL1Bytes(row, F * int64_t(sizeof(float)));
}

// fn(jj, row) for the nk rows of a (B, Hx, N, F) view from j0; rows that
// are not adjacent start loading kAhead rows on. (For the transposes of K
// and V and the rows of Q in the backward too: 0.93 of the float32
// backward's time at (8, 4, 128, 64) and (4, 8, 512, 64) on a (B, L, H, E)
// tensor, the same at (1, 8, 2048, 64); Zen 4, 2 threads.)
template <class Fn>
void ForRows(const View4<const float>& X, int64_t b, int64_t hx, int64_t j0, int64_t nk, const Fn& fn) {
  const int64_t F = X.dim(3), sf = X.strides[3];
  const bool ahead = !rows_adjacent(X);
  for (int64_t jj = 0; ahead && jj < std::min(nk, kAhead); ++jj) PrefetchRow(&X(b, hx, j0 + jj, 0), F, sf);
  for (int64_t jj = 0; jj < nk; ++jj) {
    if (ahead && jj + kAhead < nk) PrefetchRow(&X(b, hx, j0 + jj + kAhead, 0), F, sf);
    fn(jj, &X(b, hx, j0 + jj, 0));
  }
}

// dst[f·ld + jj] = X(b, hx, j0 + jj, f) for jj < nk; columns nk..ld zero.
void PackTransposed(const View4<const float>& X, int64_t b, int64_t hx, int64_t j0, int64_t nk,
                    float* dst, int64_t ld) {
  const int64_t F = X.dim(3), sf = X.strides[3];
  ForRows(X, b, hx, j0, nk, [&](int64_t jj, const float* src) {
    for (int64_t f = 0; f < F; ++f) dst[f * ld + jj] = src[f * sf];
  });
  for (int64_t f = 0; f < F; ++f) std::fill(dst + f * ld + nk, dst + (f + 1) * ld, 0.0f);
}

// Row-major copy of nk rows of a (B, Hx, N, F) view into dst [nk × ld].
void PackRows(const View4<const float>& X, int64_t b, int64_t hx, int64_t j0, int64_t nk,
              float* dst, int64_t ld) {
  const int64_t F = X.dim(3), sf = X.strides[3];
  ForRows(X, b, hx, j0, nk, [&](int64_t jj, const float* src) {
    float* row = dst + jj * ld;
    if (sf == 1)
      std::memcpy(row, src, size_t(F) * sizeof(float));
    else
      for (int64_t f = 0; f < F; ++f) row[f] = src[f * sf];
  });
}

// ---- score tiles: the forward's (transposed) and the backward's ----------

// The forward measures scores in base 2: s·log2(e), so exp(s − m) = 2^(s2 − m2).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

// qt[e][r] = scale·log2(e) · Q(b, h, i0 + r, e); columns nr..qbp are zero,
// and so is the column of a query row with NaN or ±∞ (flagged in qbad).
// Whole vectors of rows are gathered (one column e of N rows per gather, so
// each store is a vector of qt); the rest of the rows, and views whose row
// offsets do not fit the gather's 32-bit indices, go element by element.
// (Element by element, the packing was about a third of the forward unit's
// own time, outside the block products, under a window of 512 keys on
// AVX-512, where a unit visits only about 560 keys.)
void PackQt(const FusedCall& c, ForwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr) {
  const auto& Q = c.a->q;
  const int64_t E = c.p->E, se = Q.strides[3];
  const float s2 = c.scale * kLog2e;
  float* qt = w.qt;
  w.any_qbad = false;
  const bool ahead = !rows_adjacent(Q);  // as in PackRows
  int64_t r = 0;
#if HWY_TARGET != HWY_SCALAR
  const DF d;
  const hn::RebindToSigned<DF> di;
  const int64_t N = Lanes(), sr = Q.strides[2];
  if (N > 1 && std::abs(sr) * N + std::abs(se) * E < (int64_t(1) << 31)) {
    const auto idx = hn::Mul(hn::Iota(di, 0), hn::Set(di, int32_t(sr)));
    const VF vs2 = hn::Set(d, s2);
    for (; r + N <= nr; r += N) {
      if (ahead)
        for (int64_t t = r + N; t < std::min(nr, r + 2 * N); ++t) PrefetchRow(&Q(b, h, i0 + t, 0), E, se);
      const float* base = &Q(b, h, i0 + r, 0);
      VF poison = hn::Zero(d);  // x − x: 0 for finite x, NaN otherwise
      for (int64_t e = 0; e < E; ++e) {
        const VF x = hn::GatherIndex(d, base + e * se, idx);
        poison = hn::Add(poison, hn::Sub(x, x));
        hn::Store(hn::Mul(vs2, x), d, qt + e * w.qbp + r);
      }
      HWY_ALIGN float flags[64];  // >= the lane count of any target
      hn::Store(poison, d, flags);
      for (int64_t t = 0; t < N; ++t) {
        const bool bad = flags[t] != 0.0f;  // (true for NaN)
        w.qbad[r + t] = bad;
        w.any_qbad = w.any_qbad || bad;
        if (bad)
          for (int64_t e = 0; e < E; ++e) qt[e * w.qbp + r + t] = 0.0f;
      }
    }
  }
#endif
  for (int64_t t = r; ahead && t < std::min(nr, r + kAhead); ++t) PrefetchRow(&Q(b, h, i0 + t, 0), E, se);
  for (; r < nr; ++r) {
    const float* src = &Q(b, h, i0 + r, 0);
    if (ahead && r + kAhead < nr) PrefetchRow(&Q(b, h, i0 + r + kAhead, 0), E, se);
    bool bad = false;
    for (int64_t e = 0; e < E; ++e) {
      bad |= non_finite(src[e * se]);
      qt[e * w.qbp + r] = s2 * src[e * se];
    }
    if (bad)
      for (int64_t e = 0; e < E; ++e) qt[e * w.qbp + r] = 0.0f;
    w.qbad[r] = bad;
    w.any_qbad = w.any_qbad || bad;
  }
  for (int64_t e = 0; e < E; ++e) std::fill(qt + e * w.qbp + nr, qt + (e + 1) * w.qbp, 0.0f);
}

void ScoreRulesT(const FusedCall& c, ForwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t nrp,
                 int64_t j0, int64_t nk);

// Transposed score tile, in base 2: st_t[jj][r] = s(q_r, k_j)·log2(e) for keys
// j0..j0+nk against the unit's queries i0..i0+nr, through the score
// pipeline (pipeline-inl.h; −∞ also in the padding columns up to nrp). In
// base 2 the soft-cap c·tanh(u/c) is the same formula with c·log2(e). K is read in place when its rows are adjacent
// (a dense (B, H, S, E) tensor), and copied into scratch first otherwise: the
// rows of a packed (total, H, E) batch lie H·E floats apart, a power-of-two
// stride at which the block product's re-reads of the tile fall into a few
// cache sets and evict each other (the copy is 1/(2·q_block) of the tile's
// multiply-adds).
void ScoreTileT(const FusedCall& c, ForwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t nrp,
                int64_t j0, int64_t nk) {
  const Problem& p = *c.p;
  const auto& K = c.a->k;
  const int64_t hk = p.kv_head(h);
  if (rows_adjacent(K)) {
    Gemm(nk, nrp, p.E, &K(b, hk, j0, 0), p.E, 1, w.qt, w.qbp, w.st, w.qbp, false);
  } else {
    PackRows(K, b, hk, j0, nk, w.kr, p.E);
    Gemm(nk, nrp, p.E, w.kr, p.E, 1, w.qt, w.qbp, w.st, w.qbp, false);
  }
  ScoreRulesT(c, w, b, h, i0, nr, nrp, j0, nk);
}

// The score pipeline over a transposed tile whose products are in place
// (st_t[jj][r] = u(q_r, k_j)·log2(e) for the tile's nk keys): the NaN poison
// of bad keys and queries, then the rules, −∞ outside the band and in the
// padding columns up to nrp. Every forward product path ends here.
void ScoreRulesT(const FusedCall& c, ForwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t nrp,
                 int64_t j0, int64_t nk) {
  const Problem& p = *c.p;
  const int64_t hk = p.kv_head(h);
  const ScoreRules<float>& sr = p.rules;
  const rules::Band band = band_of(c, b);
  // A tile no rule touches (every query sees every key; no soft-cap, ALiBi,
  // bias or mask; no bad key or query; no padding column) stays as it is.
  if (nr == nrp && !w.any_qbad && !c.any_bad_keys && !sr.capped() && !sr.alibi() && !sr.elementwise() &&
      band.classify(i0, nr, j0, nk) == rules::Tile::full)
    return;
  const float slope = sr.slope(h);
  const int64_t off = sr.offset[size_t(b)];
  // The rows of the block that see key j under the band are [first, end);
  // both ends only grow with j (the band is monotone), so two pointers walk
  // them across the tile (Band::rows_seeing's two binary searches per key
  // cost more than the rest of this loop).
  int64_t first = 0, end = 0;
  for (int64_t jj = 0; jj < nk; ++jj) {
    const int64_t j = j0 + jj;
    float* row = w.st + jj * w.qbp;
    while (first < nr && band.keys(i0 + first).hi <= j) ++first;
    end = std::max(end, first);
    while (end < nr && band.keys(i0 + end).lo <= j) ++end;
    // Poison: NaN in every visible pair of a bad key or a bad query.
    if (c.bad_key(b, hk, j))
      std::fill(row + first, row + end, kNaN);
    else if (w.any_qbad)
      for (int64_t r = first; r < end; ++r)
        if (w.qbad[r]) row[r] = kNaN;
    ScoreLine line;
    line.lo = first, line.hi = end;
    line.distance = float(i0 + off - j), line.slope = slope;  // |i0 + r + off − j| for row r
    if (!sr.bias.empty()) line.bias = rules::query_column(sr.bias, b, h, j);
    if (!sr.mask.empty()) line.mask = rules::query_column(sr.mask, b, h, j);
    line.at = i0;
    ApplyScoreRules(row, nrp, line, sr, kLog2e, nullptr);
  }
}

// q[r][e] = scale · Q(b, h, i0 + r, e) for r < nr; a row with NaN or ±∞
// becomes zeros and is flagged poisoned.
void PackQ(const FusedCall& c, BackwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr) {
  const auto& Q = c.a->q;
  const int64_t E = c.p->E, se = Q.strides[3];
  const DF d;
  const int64_t N = Lanes();
  const VF scale = hn::Set(d, c.scale);
  ForRows(Q, b, h, i0, nr, [&](int64_t r, const float* src) {
    float* dst = w.q + r * w.Ep;
    const bool bad = RowNonFinite(src, E, se);
    int64_t e = 0;
    if (se == 1)
      for (; e + N <= E; e += N) hn::StoreU(hn::Mul(scale, hn::LoadU(d, src + e)), d, dst + e);
    for (; e < E; ++e) dst[e] = c.scale * src[e * se];
    if (bad) std::fill(dst, dst + E, 0.0f);
    w.poisoned[r] = bad;
  });
}

// Σ_e x[e]·y[e·sy] over n features: in vectors when y is dense (lane-wise
// partial sums, then one sum across the lanes), else one product at a time.
// (The backward's D = Σ dY·Y per query row, once per tile: as a scalar chain
// of dependent adds it took about 10% of a (1, 12, 2048, 64) backward.)
float RowDot(const float* x, const float* y, int64_t n, int64_t sy) {
  float acc = 0;
  int64_t e = 0;
  if (sy == 1) {
    const DF d;
    const int64_t N = Lanes();
    VF v = hn::Zero(d);
    for (; e + N <= n; e += N) v = hn::MulAdd(hn::LoadU(d, x + e), hn::LoadU(d, y + e), v);
    acc = hn::GetLane(hn::SumOfLanes(d, v));
  }
  for (; e < n; ++e) acc += x[e] * y[e * sy];
  return acc;
}

// Where a backward tile lies in the packed blocks: its first row is `row`
// rows into the packed query block, its first key `key` keys into the packed
// key block (a multiple of the lane count, so the tile's padded columns stay
// within the block's width).
struct TileOrigin {
  int64_t row = 0, key = 0;
};

// The score pipeline (pipeline-inl.h) over the products in w.s (rows
// i0..i0+nr against keys j0..j0+nk; −∞ also for padding up to nkp); with a
// soft-cap, dcap receives its derivative; unit as ApplyScoreRules's (log2(e):
// the products are in base 2).
void ScoreTileRules(const FusedCall& c, BackwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr,
                    int64_t j0, int64_t nk, int64_t nkp, float unit) {
  const Problem& p = *c.p;
  const ScoreRules<float>& sr = p.rules;
  const rules::Band band = band_of(c, b);
  const float slope = sr.slope(h);
  const int64_t off = sr.offset[size_t(b)];
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t i = i0 + r;
    // The keys of the tile row i sees under the band: [lo, hi).
    const rules::Keys keys = band.keys(i);
    ScoreLine line;
    line.lo = std::clamp<int64_t>(keys.lo - j0, 0, nk), line.hi = std::clamp<int64_t>(keys.hi - j0, line.lo, nk);
    line.distance = float(j0 - i - off), line.slope = slope;  // |j0 + jj − (i + off)|
    if (!sr.bias.empty()) line.bias = rules::key_row(sr.bias, b, h, i);
    if (!sr.mask.empty()) line.mask = rules::key_row(sr.mask, b, h, i);
    line.at = j0;
    ApplyScoreRules(w.s + r * w.kbp, nkp, line, sr, unit, w.dcap ? w.dcap + r * w.kbp : nullptr);
  }
}

// s[r][jj] = s(q_r, k_j) through the score pipeline for rows i0..i0+nr
// against keys j0..j0+nk. Needs q and kt packed (the tile at `at` in them).
void ScoreTile(const FusedCall& c, BackwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr,
               int64_t j0, int64_t nk, int64_t nkp, TileOrigin at) {
  Gemm(nr, nkp, c.p->E, w.q + at.row * w.Ep, w.Ep, 1, w.kt + at.key, w.ldk, w.s, w.kbp, false);
  // The columns past nk hold the products of whatever keys follow the tile in
  // kt. The soft-cap's Tanh picks its formula per vector, so they start at 0,
  // as a tile packed alone has them, for the tile's own scores to keep their bits.
  if (c.p->rules.capped())
    for (int64_t r = 0; r < nr; ++r) std::fill(w.s + r * w.kbp + nk, w.s + r * w.kbp + nkp, 0.0f);
  ScoreTileRules(c, w, b, h, i0, nr, j0, nk, nkp, 1.0f);
}

// acc += d(sink_h) of one call: −Σ_{b,i} exp(sink_h − lse_i)·D_i with
// D_i = Σ_e dY_ie·Y_ie, summed in (b, i) order in double.
void AddSinkGradient(const FusedCall& c, int64_t h, const View4<const float>& dout, const View4<const float>& out,
                     const View3<const float>& lse, double& acc) {
  const Problem& p = *c.p;
  const float sink = c.p->rules.sink(h);
  for (int64_t b = 0; sink != kNegInf && b < p.B; ++b)
    for (int64_t i = 0; i < p.L; ++i) {
      double D = 0;
      for (int64_t e = 0; e < p.Ev; ++e) D += double(dout(b, h, i, e)) * double(out(b, h, i, e));
      acc -= std::exp(double(sink) - double(lse(b, h, i))) * D;
    }
}

// ---- the backward's packed operands ------------------------------------------

// kt[e][jj] = K(b, hk, j0 + jj, e); columns nk..ldk are zero.
void PackKt(const FusedCall& c, BackwardScratch& w, int64_t b, int64_t hk, int64_t j0, int64_t nk) {
  PackTransposed(c.a->k, b, hk, j0, nk, w.kt, w.ldk);
}

// vt[e][jj] = V(b, hk, j0 + jj, e); columns nk..ldk zero.
void PackVt(const FusedCall& c, BackwardScratch& w, int64_t b, int64_t hk, int64_t j0, int64_t nk) {
  PackTransposed(c.a->v, b, hk, j0, nk, w.vt, w.ldk);
}

// Backward state of a query block: q (scaled), dY, lse and D for its rows.
void PackQueryBlock(const FusedCall& c, BackwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr,
                    const View4<const float>& dout, const View4<const float>& out,
                    const View3<const float>& lse) {
  PackQ(c, w, b, h, i0, nr);
  PackRows(dout, b, h, i0, nr, w.dy, w.Evp);
  const int64_t Ev = c.p->Ev, se = out.strides[3];
  for (int64_t r = 0; r < nr; ++r) {
    const float* y = &out(b, h, i0 + r, 0);
    float* dy = w.dy + r * w.Evp;
    w.lse[r] = lse(b, h, i0 + r);
    const bool bad = RowNonFinite(dy, Ev, 1);
    // Poisoned: a bad query (PackQ), a bad dY, or a NaN lse (the forward's
    // poisoned rows). Its dY is zeroed and D = 0; its probabilities carry the NaN.
    w.poisoned[r] = w.poisoned[r] || bad || w.lse[r] != w.lse[r];
    if (w.poisoned[r]) {
      std::fill(dy, dy + Ev, 0.0f);
      w.D[r] = 0.0f;
      continue;
    }
    w.D[r] = RowDot(dy, y, Ev, se);  // D_i = Σ_e dY_ie·Y_ie
  }
}

// The query side of a call, built once (BuildBackwardQueries) where every
// query row would otherwise be packed once per key block: the units of
// plan.own_heads and of the dK/dV pass visit each query block once per key
// block (43 times at (1, 8, 2048, 128)), re-reading q, dY and Y, whose rows
// lie H·E floats apart in torch's (B, L, H, E) layout. Row (b·H + h)·L + i
// of each array holds what PackQueryBlock leaves in the scratch for that
// row, padding columns zero; the tiles read the same values, so the results
// keep their bits:
//   q [rows × Ep], dy [rows × Evp], lse [rows], D [rows], poisoned [rows]
//   dq [rows × E]   with plan.own_heads and dQ's rows not adjacent: the
//                   units' dQ sums (each unit's rows copied out at its end)
// What it saves, and why only from 8 key blocks (plan.queries_once,
// tiles.cpp): docs/fused.md, "Algorithm".
struct BackwardQueries {
  OperandBuffer buf;
  float *q = nullptr, *dy = nullptr, *lse = nullptr, *D = nullptr, *dq = nullptr;
  uint8_t* poisoned = nullptr;

  // w's query side at rows i0.. of (b, h): the units read them in place.
  void point(const Problem& p, BackwardScratch& w, int64_t b, int64_t h, int64_t i0) const {
    const int64_t row = (b * p.H + h) * p.L + i0;
    w.q = q + row * w.Ep, w.dy = dy + row * w.Evp;
    w.lse = lse + row, w.D = D + row, w.poisoned = poisoned + row;
  }
};
constexpr int64_t kBackwardQueriesBytes = int64_t(256) << 20;  // at most (else packed per tile)

// Fills qs for the call where the plan asks for it and it stays within
// kBackwardQueriesBytes (else leaves it empty): the threads' units of
// q_block rows each pack into their rows of the arrays.
void BuildBackwardQueries(const FusedCall& c, const FusedPlan& t, const View4<const float>& dout,
                          const View4<const float>& out, const View3<const float>& lse, const View4<float>& dq,
                          BackwardQueries& qs) {
  const Problem& p = *c.p;
  const int64_t lanes = Lanes(), Ep = round_up(p.E, lanes), Evp = round_up(p.Ev, lanes);
  const bool own_dq = t.own_heads && !rows_adjacent(dq);
  const int64_t rows = p.B * p.H * p.L;
  const int64_t row_bytes = (Ep + Evp + 2 + (own_dq ? p.E : 0)) * int64_t(sizeof(float)) + 1;
  if (!t.queries_once || rows == 0 || rows > kBackwardQueriesBytes / row_bytes) return;
  // 64-byte aligned arrays in one buffer.
  const int64_t nq = round_up(rows * Ep, 16), ndy = round_up(rows * Evp, 16), nf = round_up(rows, 16);
  const int64_t ndq = own_dq ? round_up(rows * p.E, 16) : 0;
  qs.buf = OperandBuffer(size_t(nq + ndy + 2 * nf + ndq) * sizeof(float) + size_t(rows), false);
  float* const f = qs.buf.as<float>();
  qs.q = f, qs.dy = f + nq, qs.lse = f + nq + ndy, qs.D = qs.lse + nf;
  qs.dq = own_dq ? qs.D + nf : nullptr;
  qs.poisoned = reinterpret_cast<uint8_t*>(qs.D + nf + ndq);
  const int64_t nqb = ceil_div(p.L, t.q_block);
#pragma omp parallel num_threads(p.threads)
  {
    BackwardScratch w(p, t, lanes, Alloc::no);  // only its widths: the arrays are qs's
#pragma omp for schedule(static)
    for (int64_t u = 0; u < p.B * p.H * nqb; ++u) {
      const int64_t qbi = u % nqb, h = (u / nqb) % p.H, b = u / (nqb * p.H);
      const int64_t i0 = qbi * t.q_block, nr = std::min(t.q_block, p.L - i0);
      qs.point(p, w, b, h, i0);
      PackQueryBlock(c, w, b, h, i0, nr, dout, out, lse);
      for (int64_t r = 0; r < nr; ++r) {
        std::fill(w.q + r * Ep + p.E, w.q + (r + 1) * Ep, 0.0f);
        std::fill(w.dy + r * Evp + p.Ev, w.dy + (r + 1) * Evp, 0.0f);
      }
    }
  }
}

// Key-side state of a key block: kt, vt (and kb_rows when dQ is wanted).
void PackKeyBlock(const FusedCall& c, BackwardScratch& w, int64_t b, int64_t hk, int64_t j0, int64_t nk,
                  bool rows) {
  PackKt(c, w, b, hk, j0, nk);
  PackVt(c, w, b, hk, j0, nk);
  if (rows) PackRows(c.a->k, b, hk, j0, nk, w.kr, w.Ep);
  for (int64_t jj = 0; c.any_bad_keys && jj < nk; ++jj) {
    if (!c.bad_key(b, hk, j0 + jj)) continue;  // a bad key: zeros (its rows are poisoned)
    for (int64_t e = 0; e < c.p->E; ++e) w.kt[e * w.ldk + jj] = 0.0f;
    for (int64_t e = 0; e < c.p->Ev; ++e) w.vt[e * w.ldk + jj] = 0.0f;
    if (rows) std::fill(w.kr + jj * w.Ep, w.kr + jj * w.Ep + c.p->E, 0.0f);
  }
}

// The key side of a call, built once (BuildBackwardKeys, plan.keys_once):
// in the two-pass backward the query pass packs every key block it meets
// again for each query block and query head (G·L / q_block times). Per
// (b, kv head), rows bh = b·Hkv + hk, what PackKeyBlock leaves in the
// scratch for the whole sequence (a bad key's column and row zero):
//   kt [bh][E × ldk], vt [bh][Ev × ldk]   ldk = S rounded up to the lanes,
//                                           plus the lanes: zero past S
//   kr [bh][S × Ep]                        padding columns zero
// A tile's keys are then columns (rows of kr) j0.. in place; a tile reads at
// most a vector past its last key, which stays within ldk. The tiles see
// the same values, so the results keep their bits.
struct BackwardKeys {
  OperandBuffer buf;
  float *kt = nullptr, *vt = nullptr, *kr = nullptr;
  int64_t ldk = 0;

  void point(const Problem& p, BackwardScratch& w, int64_t b, int64_t hk, int64_t j0) const {
    const int64_t bh = b * p.Hkv + hk;
    w.kt = kt + bh * p.E * ldk + j0, w.vt = vt + bh * p.Ev * ldk + j0, w.kr = kr + (bh * p.S + j0) * w.Ep;
    w.ldk = ldk;
  }
};
constexpr int64_t kBackwardKeysBytes = int64_t(256) << 20;  // at most (else packed per tile)

// Fills ks for the call where the plan asks for it and it stays within
// kBackwardKeysBytes (else leaves it empty): one unit per (b, kv head).
void BuildBackwardKeys(const FusedCall& c, const FusedPlan& t, BackwardKeys& ks) {
  const Problem& p = *c.p;
  const int64_t lanes = Lanes(), Ep = round_up(p.E, lanes), ldk = round_up(p.S, lanes) + lanes;
  const int64_t heads = p.B * p.Hkv;
  const int64_t head_bytes = ((p.E + p.Ev) * ldk + p.S * Ep) * int64_t(sizeof(float));
  if (!t.keys_once || heads == 0 || p.S == 0 || heads > kBackwardKeysBytes / head_bytes) return;
  const int64_t nt = heads * p.E * ldk, nv = heads * p.Ev * ldk, nr = heads * p.S * Ep;
  ks.buf = OperandBuffer(size_t(round_up(nt, 16) + round_up(nv, 16) + nr) * sizeof(float), false);
  ks.kt = ks.buf.as<float>(), ks.vt = ks.kt + round_up(nt, 16), ks.kr = ks.vt + round_up(nv, 16);
  ks.ldk = ldk;
#pragma omp parallel num_threads(p.threads)
  {
    BackwardScratch w(p, t, lanes, Alloc::no);  // only its widths: the arrays are ks's
#pragma omp for schedule(static)
    for (int64_t u = 0; u < heads; ++u) {
      const int64_t b = u / p.Hkv, hk = u % p.Hkv;
      ks.point(p, w, b, hk, 0);
      PackKeyBlock(c, w, b, hk, 0, p.S, true);  // (zero columns S..ldk of kt and vt)
      for (int64_t j = 0; j < p.S; ++j) std::fill(w.kr + j * Ep + p.E, w.kr + (j + 1) * Ep, 0.0f);
    }
  }
}

// Writes the dK/dV accumulators of a key block (zero where nothing reached).
void StoreKeyGrads(const FusedCall& c, BackwardScratch& w, const SdpaGrads<float>& g, int64_t b, int64_t hk,
                   int64_t j0, int64_t nk) {
  const Problem& p = *c.p;
  for (int64_t jj = 0; jj < nk; ++jj) {
    float* dk = &g.dk(b, hk, j0 + jj, 0);
    float* dv = &g.dv(b, hk, j0 + jj, 0);
    const float* sk = w.dk + jj * w.Ep;
    const float* sv = w.dv + jj * w.Evp;
    for (int64_t e = 0; e < p.E; ++e) dk[e * g.dk.strides[3]] = sk[e];
    for (int64_t e = 0; e < p.Ev; ++e) dv[e * g.dv.strides[3]] = sv[e];
  }
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_FUSED_SCORES_INL_H_
