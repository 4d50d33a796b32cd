// The fused attention kernels, forward and backward side by side, for one
// SIMD target (included once per target by fused.cpp; no ordinary include
// guard). FlashAttention's algorithm on the CPU, float32.
//
// Forward. Work is split into units (batch b, head h, block of q_block query
// rows). A unit packs its queries transposed and pre-multiplied by the scale
// and log2(e), then streams the keys in blocks of k_block: the score tile
// S = K·Qᵀ (keys × queries, K read in place when its rows are adjacent,
// else a tile at a time from a copy) comes from the block product, the
// masks are applied, each query's running max and sum are updated
// (online_softmax.hpp, in base 2), the output accumulator is rescaled and
// P·V added (V likewise). At the end each row is divided once by its sum; the log-sum-exp is the only state saved.
// Memory traffic per unit: Q and the output once, K and V once per query
// block (re-read L / q_block times from cache or memory); the L×S matrices
// never exist. A unit visits only the keys its rows see under the band rule
// (causal, window, key lengths: kernels/score_rules.hpp) and skips tiles the
// rule classifies empty, so the cost grows with the visible band, not with
// S. A head's sink enters as the initial state of each row's softmax (one
// seen logit, no value), so it is in the sum and the lse and takes its
// weight. Attention weights, when asked for, are a second pass per unit: exp(S − max) / sum, tile by tile.
//
// Backward. With P = exp(S − lse) recomputed per tile (query rows × keys; the
// scores in natural units, or in base 2 where the products ask for it, then
// P = 2^(S·log2(e) − lse·log2(e))) and D_i = Σ_e dY_ie·Y_ie:
//   dV = Pᵀ·dY,  dP = dY·Vᵀ,  dS = P∘(dP − D),  dU = dS∘capped'(U),
//   dQ = scale·dU·K,  dK = scale·dUᵀ·Q,  dbias = dS summed over the bias's
//   broadcast axes,  d(sink_h) = −Σ_{b,i} exp(sink_h − lse_i)·D_i.
// The key blocks of a query block and the query blocks of a key block are
// the band rule's intervals; empty tiles are skipped as in the forward, and
// each visited tile is cut to its box under the band (the rows that see one
// of its keys, the keys those rows see), so the tiles on a window's edges
// cost little beyond the band's scores.
// No atomics: with plan.own_heads a unit owns one (b, kv head) pair and walks
// its key blocks in order, accumulating dK/dV for the block in scratch and dQ
// directly in the (zeroed) output, which no other unit touches. Otherwise two
// passes: units over key blocks write dK/dV, then units over query blocks
// recompute the tiles and write dQ. dbias, when requested, is a third pass
// whose units own tiles of dbias. Every output element is summed in a fixed
// order, so the results are bitwise identical for any thread count.
//
// Products. Both directions' units are templates on the object that does
// their block products (Float32Products and Float32BackwardProducts here,
// the bfloat16 ones in bf16-inl.h); everything else (tiles, band, score
// pipeline, softmax, dS, masks, NaN) is one code for both arithmetics.
//
// Scores. Both directions build their score tile in one function each,
// ScoreTileT (forward: transposed, base 2) and ScoreTile (backward): the
// block product, the NaN poison (forward), then the score pipeline
// (kernels/fused/pipeline-inl.h: the rules of kernels/score_rules.hpp in
// their order, −∞ outside the band and where the mask or the bias hides a
// key). They sit next to each other in scores-inl.h, with the packing of the
// operands; a new rule on scores goes into score_rules.hpp and the pipeline
// (and its derivative into BackwardTileT's
// dS). Which key blocks a unit
// visits at all comes from the band (score_rules.hpp, via common.hpp).
//
// NaN. Non-finite inputs are flagged and zeroed in the packed operands, and
// the poison travels as NaN in the scores and probabilities (scores-inl.h
// says how); the block products never see a NaN.
//
// Packed variable-length batches (packed-inl.h) run these same units for
// all their sequences in one parallel region, longest first.
//
// Scratch layouts: tiles.hpp. SIMD building blocks: simd-inl.h.
#if defined(ATTN_KERNELS_FUSED_ATTENTION_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_FUSED_ATTENTION_INL_H_
#undef ATTN_KERNELS_FUSED_ATTENTION_INL_H_
#else
#define ATTN_KERNELS_FUSED_ATTENTION_INL_H_
#endif

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attn/sdpa.hpp"
#include "kernels/fused/common.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/fused/online_softmax.hpp"
#include "kernels/fused/scores-inl.h"
#include "kernels/fused/simd-inl.h"
#include "kernels/fused/tiles.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

// ---- forward ---------------------------------------------------------------

// Folds a transposed tile into the per-query online softmax: the tile's
// column maxima (the products' score_maxima) give each query's shift and
// rescale factor (colv[2·qbp ..]),
// then the products' exponentiate pass makes P = 2^(s − shift) and the
// column sums (keep_p: P must stay in st, for dropout to multiply it).
template <class Products>
void SoftmaxTileT(Products& pr, ForwardScratch& w, int64_t nr, int64_t nrp, int64_t nk, bool keep_p) {
  float* tmax = w.colv;
  float* shift = tmax + w.qbp;
  float* alpha = shift + w.qbp;
  float* tsum = alpha + w.qbp;
  pr.score_maxima(nrp, nk, tmax);
  for (int64_t r = 0; r < nr; ++r) {
    const os::Step<float> step = os::begin_tile<os::Base2>(w.rows[r], tmax[r]);
    alpha[r] = step.alpha;
    shift[r] = step.shift;
  }
  std::fill(shift + nr, shift + nrp, 0.0f);
  std::fill(alpha + nr, alpha + nrp, 1.0f);  // the padding columns: nothing to rescale
  pr.exponentiate(nrp, nk, static_cast<const float*>(shift), tsum, keep_p);
  for (int64_t r = 0; r < nr; ++r) os::end_tile(w.rows[r], tsum[r]);
}

// Dropout (kernels/dropout.hpp): the probabilities of a transposed tile
// times their keep factors, after the softmax has summed them.
void DropTileT(const Problem& p, ForwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0,
               int64_t nk) {
  for (int64_t r = 0; r < nr; ++r) {
    p.dropout.factors(b, p.H, h, i0 + r, j0, nk, w.keep);
    for (int64_t jj = 0; jj < nk; ++jj) w.st[jj * w.qbp + r] *= w.keep[jj];
  }
}

// The float32 products of the forward unit (exact): Q·Kᵀ on the queries
// packed transposed and scaled (PackQt), K read in place or copied per tile
// (ScoreTileT); P·V into the row-major accumulator o [qb × Evp], V read in
// place when its rows are adjacent and a whole number of vectors.
struct Float32Products {
  const FusedCall& c;
  ForwardScratch& w;
  bool v_in_place = false;

  // Packs the unit's queries and zeroes its accumulator.
  void begin(int64_t b, int64_t h, int64_t i0, int64_t nr) {
    v_in_place = rows_adjacent(c.a->v) && c.p->Ev == w.Evp;
    PackQt(c, w, b, h, i0, nr);
    std::fill(w.o, w.o + nr * w.Evp, 0.0f);
  }
  // The transposed score tile through the score pipeline (st).
  void scores(int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t nrp, int64_t j0, int64_t nk) {
    ScoreTileT(c, w, b, h, i0, nr, nrp, j0, nk);
  }
  // The tile's column maxima.
  void score_maxima(int64_t nrp, int64_t nk, float* tmax) const {
    ForColumnGroups<MaxOp>(nrp / Lanes(), Lanes(), static_cast<const float*>(w.st), w.qbp, nk, tmax);
  }
  // st <- 2^(st − shift), tsum = the column sums (each in key order).
  void exponentiate(int64_t nrp, int64_t nk, const float* shift, float* tsum, bool) {
    const int64_t N = Lanes();
    ForColumnGroups<ExpOp>(nrp / N, N, w.st, w.qbp, nk, shift, tsum);
  }
  // o <- o·alpha + P·V for the tile's probabilities (st) and rescale factors.
  void accumulate(int64_t b, int64_t h, int64_t nr, int64_t j0, int64_t nk) {
    const auto& V = c.a->v;
    const int64_t hk = c.p->kv_head(h);
    const float* alpha = w.colv + 2 * w.qbp;
    for (int64_t r = 0; r < nr; ++r)
      if (alpha[r] != 1.0f) ScaleRow(w.o + r * w.Evp, w.Evp, alpha[r]);  // acc <- acc · alpha
    const float* vb = w.vb;
    int64_t ldv = w.Evp;
    bool tile_bad = false;  // a bad value row must not reach rows that mask it (0·NaN)
    for (int64_t jj = 0; c.any_bad_keys && jj < nk; ++jj) tile_bad = tile_bad || c.bad_key(b, hk, j0 + jj);
    if (v_in_place && !tile_bad) {
      vb = &V(b, hk, j0, 0);
      ldv = V.strides[2];
    } else {
      PackRows(V, b, hk, j0, nk, w.vb, w.Evp);
      for (int64_t jj = 0; tile_bad && jj < nk; ++jj)
        if (c.bad_key(b, hk, j0 + jj)) std::fill(w.vb + jj * w.Evp, w.vb + (jj + 1) * w.Evp, 0.0f);
    }
    // o += P·V, with P(r, jj) = st_t[jj][r]
    Gemm(nr, w.Evp, nk, w.st, 1, w.qbp, vb, ldv, w.o, w.Evp, true);
  }
  // Row r of the output: y = acc / sum (dst: Ev elements, se apart).
  void write_row(int64_t r, float inv_sum, float* dst, int64_t se) const {
    const int64_t lanes = int64_t(hn::Lanes(DF())), Ev = c.p->Ev;
    const float* o = w.o + r * w.Evp;
    int64_t e = 0;
    if (se == 1)
      for (const VF inv = hn::Set(DF(), inv_sum); e + lanes <= Ev; e += lanes)
        hn::StoreU(hn::Mul(hn::Load(DF(), o + e), inv), DF(), dst + e);
    for (; e < Ev; ++e) dst[e * se] = o[e] * inv_sum;
  }
};

// One forward unit: queries [i0, i0 + nr) of (b, h) against the keys they
// see, tile by tile; `Products` does the two products (Float32Products, or
// the bfloat16 ones of bf16-inl.h) and the tile's exponentials (where its
// P goes: back into st, or straight into the bfloat16 pairs), the rest is
// the same for both.
template <class Products>
void ForwardUnitT(const FusedCall& c, Products& pr, ForwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr,
                  View4<float> out, View4<float> weights, View3<float> lse) {
  const Problem& p = *c.p;
  const int64_t lanes = int64_t(hn::Lanes(DF()));
  const int64_t nrp = round_up(nr, lanes);
  // The keys any row of the block sees (the band is monotone in the row).
  const rules::Band band = band_of(c, b);
  const rules::Keys keys = band.keys_of_rows(i0, i0 + nr);
  pr.begin(b, h, i0, nr);
  // A sink starts every row's softmax as one seen logit with no value.
  const float sink2 = c.p->rules.sink(h) * kLog2e;
  for (int64_t r = 0; r < nr; ++r) w.rows[r] = os::State<float>{sink2, sink2 == kNegInf ? 0.0f : 1.0f};

  for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += w.kb) {
    const int64_t nk = std::min(w.kb, keys.hi - j0);
    if (band.classify(i0, nr, j0, nk) == rules::Tile::empty) continue;
    pr.scores(b, h, i0, nr, nrp, j0, nk);
    SoftmaxTileT(pr, w, nr, nrp, nk, p.dropout.on());
    if (p.dropout.on()) DropTileT(p, w, b, h, i0, nr, j0, nk);  // o += (P∘m)·V; the sums keep P
    pr.accumulate(b, h, nr, j0, nk);
  }

  for (int64_t r = 0; r < nr; ++r) {
    const os::Final<float> f = os::finalize<os::Base2>(w.rows[r]);
    const float row_lse = f.lse * kLn2;  // back to natural units (−∞ stays −∞)
    pr.write_row(r, f.inv_sum, &out(b, h, i0 + r, 0), out.strides[3]);
    if (!lse.empty()) lse(b, h, i0 + r) = row_lse;
  }

  if (weights.empty()) return;
  // Second pass: weights = exp(S − max) / sum, zero beyond the visible keys.
  // (The row's max and sum rather than its lse: max is one of the scores, so
  // S − max carries no rounding of a large lse.)
  const DF d;
  float* shift = w.colv + w.qbp;
  float* inv = shift + w.qbp;
  for (int64_t r = 0; r < nrp; ++r) {
    const os::Final<float> f = r < nr ? os::finalize<os::Base2>(w.rows[r]) : os::Final<float>{0.0f, 0.0f};
    shift[r] = r < nr && f.inv_sum > 0 ? w.rows[r].max : 0.0f;
    inv[r] = f.inv_sum;
  }
  const int64_t sj = weights.strides[3];
  for (int64_t r = 0; r < nr; ++r)  // zero outside the keys the block sees
    for (int64_t j = 0; j < p.S; ++j)
      if (j < keys.lo || j >= keys.hi) weights(b, h, i0 + r, j) = 0.0f;
  for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += w.kb) {
    const int64_t nk = std::min(w.kb, keys.hi - j0);
    pr.scores(b, h, i0, nr, nrp, j0, nk);
    for (int64_t jj = 0; jj < nk; ++jj)
      for (int64_t r = 0; r < nrp; r += lanes) {
        float* x = w.st + jj * w.qbp + r;
        const VF s = hn::Load(d, x);
        const VF pw = hn::Mul(Exp2Softmax(d, hn::Sub(s, hn::Load(d, shift + r))), hn::Load(d, inv + r));
        hn::Store(hn::IfThenZeroElse(hn::Eq(s, hn::Set(d, kNegInf)), pw), d, x);  // masked: 0, even if poisoned
      }
    if (p.dropout.on()) DropTileT(p, w, b, h, i0, nr, j0, nk);  // the weights are what multiplies V
    for (int64_t r = 0; r < nr; ++r) {
      float* dst = &weights(b, h, i0 + r, j0);
      const float* src = w.st + r;
      for (int64_t jj = 0; jj < nk; ++jj) dst[jj * sj] = src[jj * w.qbp];
    }
  }
}

// The float32 forward unit (the dense call's and the packed batch's).
void ForwardUnit(const FusedCall& c, ForwardScratch& w, int64_t b, int64_t h, int64_t i0, int64_t nr,
                 View4<float> out, View4<float> weights, View3<float> lse) {
  Float32Products pr{c, w};
  ForwardUnitT(c, pr, w, b, h, i0, nr, out, weights, lse);
}

// Every unit of a dense forward call, threads taking them dynamically;
// make(w) gives a thread its products on its scratch w.
template <class MakeProducts>
void ForwardUnits(const FusedCall& c, const FusedPlan& t, View4<float> out, View4<float> weights, View3<float> lse,
                  MakeProducts make) {
  const Problem& p = *c.p;
  const int64_t nqb = ceil_div(p.L, t.q_block);
  const int64_t units = p.B * p.H * nqb;
#pragma omp parallel num_threads(p.threads)
  {
    const FlushToZero ftz;  // common.hpp
    ForwardScratch w(p, t, Lanes());
    auto pr = make(w);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t qbi = u % nqb, h = (u / nqb) % p.H, b = u / (nqb * p.H);
      const int64_t i0 = qbi * t.q_block, nr = std::min(t.q_block, p.L - i0);
      ForwardUnitT(c, pr, w, b, h, i0, nr, out, weights, lse);
    }
  }
}

void ForwardImpl(const Problem& p, const SdpaArgs<float>& a, View4<float> out, View4<float> weights,
                 View3<float> lse, FusedPlan t) {
  std::vector<uint8_t> bad;
  const FusedCall c = MakeCall(p, a, t, bad);
  ForwardUnits(c, t, out, weights, lse, [&](ForwardScratch& w) { return Float32Products{c, w}; });
}

// ---- backward --------------------------------------------------------------

// What one backward tile accumulates.
struct TileJobs {
  bool dkdv = false;  // dk/dv (scratch, k-block rows) += ...
  bool dq = false;    // dq scratch (q-block rows) += dS·K (unscaled)
};  // with neither (the dbias pass, which reads it), dS is left in w.dp


// The float32 products of the backward (exact), on the packed blocks of
// BackwardScratch: S = (scale·Q)·Kᵀ (ScoreTile), dP = dY·Vᵀ, dV += Pᵀ·dY,
// dK += dUᵀ·(scale·Q), dQ += dU·K. The bfloat16 ones (bf16-inl.h) have the
// same members.
struct Float32BackwardProducts {
  const FusedCall& c;
  BackwardScratch& w;
  const BackwardQueries* queries = nullptr;  // the call's query side (null: packed per tile)
  const BackwardKeys* keys = nullptr;        // the call's key side (null: packed per tile)
  float* dq_accumulator() const { return queries ? queries->dq : nullptr; }  // dense dQ sums (null: in g.dq)

  // The padded width of a tile's nk keys.
  int64_t width(int64_t nk) const { return round_up(nk, Lanes()); }
  float score_unit() const { return 1.0f; }  // scores in natural units
  float deferred_scale() const { return 1.0f; }  // and scaled (w.q is)
  void pack_keys(int64_t b, int64_t hk, int64_t j0, int64_t nk, bool rows) {
    if (keys) return keys->point(*c.p, w, b, hk, j0);
    PackKeyBlock(c, w, b, hk, j0, nk, rows);
  }
  void pack_queries(int64_t b, int64_t h, int64_t i0, int64_t nr, const View4<const float>& dout,
                    const View4<const float>& out, const View3<const float>& lse) {
    if (queries) return queries->point(*c.p, w, b, h, i0);
    PackQueryBlock(c, w, b, h, i0, nr, dout, out, lse);
  }
  // w.s = the tile's scores through the score pipeline.
  void scores(int64_t b, int64_t h, int64_t i0, int64_t nr, int64_t j0, int64_t nk, int64_t nkp, TileOrigin at) {
    ScoreTile(c, w, b, h, i0, nr, j0, nk, nkp, at);
  }
  // w.dp = dY·Vᵀ
  void dp(int64_t nr, int64_t nkp, TileOrigin at) {
    Gemm(nr, nkp, c.p->Ev, w.dy + at.row * w.Evp, w.Evp, 1, w.vt + at.key, w.ldk, w.dp, w.kbp, false);
  }
  // dV += (P∘m)ᵀ·dY ; dK += dUᵀ·(scale·Q)
  void dkdv(int64_t nr, int64_t nk, int64_t, TileOrigin at) {
    const float* dy = w.dy + at.row * w.Evp;
    Gemm(nk, w.Evp, nr, w.s, 1, w.kbp, dy, w.Evp, w.dv + at.key * w.Evp, w.Evp, true);
    Gemm(nk, w.Ep, nr, w.dp, 1, w.kbp, w.q + at.row * w.Ep, w.Ep, w.dk + at.key * w.Ep, w.Ep, true);
  }
  // dQ += dU·K (the scale is applied when written out)
  void dq(int64_t nr, int64_t nk, int64_t, TileOrigin at) {
    Gemm(nr, w.Ep, nk, w.dp, w.kbp, 1, w.kr + at.key * w.Ep, w.Ep, w.dq + at.row * w.Ep, w.Ep, true);
  }
  void zero_key_grads() {
    std::fill(w.dk, w.dk + w.kb * w.Ep, 0.0f);
    std::fill(w.dv, w.dv + w.kb * w.Evp, 0.0f);
  }
  void store_key_grads(const SdpaGrads<float>& g, int64_t b, int64_t hk, int64_t j0, int64_t nk) const {
    StoreKeyGrads(c, w, g, b, hk, j0, nk);
  }
  void zero_dq(int64_t nr) { std::fill(w.dq, w.dq + nr * w.Ep, 0.0f); }
  // Row r of the dQ accumulator (unscaled).
  const float* dq_row(int64_t r) const { return w.dq + r * w.Ep; }
};

// One tile of the backward, rows i0..i0+nr × keys j0..j0+nk, lying at `at`
// in the packed query and key blocks (dS is left at w.dp's origin, unless
// pr forms it in one pass, fused_tile; the accumulators are written at the
// tile's rows and keys); `pr` does the
// products (Float32BackwardProducts, or the bfloat16 ones of bf16-inl.h).
template <class Products>
void BackwardTileT(const FusedCall& c, Products& pr, BackwardScratch& w, int64_t b, int64_t h, int64_t i0,
                   int64_t nr, int64_t j0, int64_t nk, TileJobs jobs, TileOrigin at = {}) {
  const Problem& p = *c.p;
  const int64_t nkp = pr.width(nk);
  const DF d;
  const float* lse = w.lse + at.row;
  const float* D = w.D + at.row;
  const uint8_t* poisoned = w.poisoned + at.row;
  pr.scores(b, h, i0, nr, j0, nk, nkp, at);
  if constexpr (requires { pr.fused_tile(nr, nkp, at, jobs, lse, D, poisoned); })  // P, dP, dS in one pass
    if (pr.fused_tile(nr, nkp, at, jobs, lse, D, poisoned)) return;
  for (int64_t r = 0; r < nr; ++r)  // P
    ProbRow(w.s + r * w.kbp, nkp, lse[r], poisoned[r], pr.score_unit(), pr.deferred_scale());
  pr.dp(nr, nkp, at);  // dP = dY·Vᵀ
  for (int64_t r = 0; r < nr; ++r) {
    float* dpr = w.dp + r * w.kbp;
    float* pr_ = w.s + r * w.kbp;
    const VF Dr = hn::Set(d, D[r]);
    if (p.dropout.on()) {  // dP ∘ m, and P ∘ m for dV once dS is formed
      std::fill(w.keep + nk, w.keep + nkp, 0.0f);
      p.dropout.factors(b, p.H, h, i0 + r, j0, nk, w.keep);
      for (int64_t j = 0; j < nkp; j += int64_t(hn::Lanes(d))) {
        const VF m = hn::Load(d, w.keep + j), pj = hn::Load(d, pr_ + j);
        hn::Store(hn::Mul(pj, hn::Sub(hn::Mul(hn::Load(d, dpr + j), m), Dr)), d, dpr + j);  // dS = P∘(dP∘m − D)
        hn::Store(hn::Mul(pj, m), d, pr_ + j);
      }
      continue;
    }
    for (int64_t j = 0; j < nkp; j += int64_t(hn::Lanes(d)))  // dS = P∘(dP − D)
      hn::Store(hn::Mul(hn::Load(d, pr_ + j), hn::Sub(hn::Load(d, dpr + j), Dr)), d, dpr + j);
  }
  if (p.rules.capped() && (jobs.dkdv || jobs.dq))  // dU = dS ∘ ∂s/∂u (the dbias pass keeps dS)
    for (int64_t r = 0; r < nr; ++r) {
      float* dpr = w.dp + r * w.kbp;
      const float* gr = w.dcap + r * w.kbp;
      for (int64_t j = 0; j < nkp; j += int64_t(hn::Lanes(d)))
        hn::Store(hn::Mul(hn::Load(d, dpr + j), hn::Load(d, gr + j)), d, dpr + j);
    }
  if (jobs.dkdv) pr.dkdv(nr, nk, nkp, at);  // dV += (P∘m)ᵀ·dY ; dK += dUᵀ·(scale·Q)
  if (jobs.dq) pr.dq(nr, nk, nkp, at);      // dQ += dU·K (the scale is applied when written out)
}

// A tile cut to its bounding box under the band: the rows [i0, i0 + nr) that
// see a key of [j0, j0 + nk), and the keys those rows see, from a multiple of
// `align` keys past j0 (empty: nr = 0). The scores outside it are −∞ under
// the band, so they add nothing to any gradient.
struct TileBox {
  int64_t i0 = 0, nr = 0, j0 = 0, nk = 0;
};
TileBox BandBox(const rules::Band& band, int64_t i0, int64_t nr, int64_t j0, int64_t nk, int64_t align) {
  const auto [r0, r1] = band.rows_seeing(j0, j0 + nk, i0, i0 + nr);
  if (r0 >= r1) return {};
  const rules::Keys keys = band.keys_of_rows(r0, r1);
  const int64_t lo = std::max(keys.lo, j0), hi = std::min(keys.hi, j0 + nk);
  if (lo >= hi) return {};
  const int64_t first = j0 + (lo - j0) / align * align;
  return {r0, r1 - r0, first, hi - first};
}

// dK/dV of one key block of (b, hk), summed over the query heads of the group
// and all query blocks in order. With `dq_into_output`, also adds each tile's
// scale·dS·K into g.dq (which the caller zeroed and owns for this (b, hk)).
template <class Products>
void KeyBlockUnitT(const FusedCall& c, Products& pr, BackwardScratch& w, const SdpaGrads<float>& g,
                   const View4<const float>& dout, const View4<const float>& out, const View3<const float>& lse,
                   int64_t b, int64_t hk, int64_t j0, bool dq_into_output) {
  const Problem& p = *c.p;
  const int64_t nk = std::min(w.kb, p.S - j0);
  pr.zero_key_grads();
  // The query rows that see some key of the block: [r0, r1) (band rule).
  const rules::Band band = band_of(c, b);
  const auto [r0, r1] = band.rows_seeing(j0, j0 + nk, 0, p.L);
  if (r0 < r1) {
    pr.pack_keys(b, hk, j0, nk, dq_into_output);
    for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
      for (int64_t qbi = r0 / w.qb; qbi < ceil_div(r1, w.qb); ++qbi) {
        const int64_t q0 = qbi * w.qb;
        // Only the tile's box is packed and computed (the band's edges).
        const TileBox box = BandBox(band, q0, std::min(w.qb, p.L - q0), j0, nk, Lanes());
        if (box.nr == 0) continue;
        const int64_t i0 = box.i0, nr = box.nr;
        pr.pack_queries(b, h, i0, nr, dout, out, lse);
        TileJobs jobs;
        jobs.dkdv = true;
        jobs.dq = dq_into_output;
        if (jobs.dq) pr.zero_dq(nr);
        BackwardTileT(c, pr, w, b, h, i0, nr, box.j0, box.nk, jobs, {0, box.j0 - j0});
        if (jobs.dq) {
          for (int64_t r = 0; r < nr; ++r) {
            float* dst = &g.dq(b, h, i0 + r, 0);
            const float* src = pr.dq_row(r);
            for (int64_t e = 0; e < p.E; ++e) dst[e * g.dq.strides[3]] += c.scale * src[e];
          }
        }
      }
    }
  }
  pr.store_key_grads(g, b, hk, j0, nk);  // dK = scale·dSᵀ·Q
}

// dQ of one query block: Σ over key blocks in order of scale·dS·K.
template <class Products>
void QueryBlockUnitT(const FusedCall& c, Products& pr, BackwardScratch& w, const SdpaGrads<float>& g,
                     const View4<const float>& dout, const View4<const float>& out, const View3<const float>& lse,
                     int64_t b, int64_t h, int64_t i0, int64_t nr) {
  const Problem& p = *c.p;
  const int64_t hk = p.kv_head(h);
  const rules::Band band = band_of(c, b);
  const rules::Keys keys = band.keys_of_rows(i0, i0 + nr);
  pr.zero_dq(nr);
  pr.pack_queries(b, h, i0, nr, dout, out, lse);
  for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += w.kb) {
    // Only the tile's box is packed and computed (the band's edges).
    const TileBox box = BandBox(band, i0, nr, j0, std::min(w.kb, keys.hi - j0), 1);
    if (box.nr == 0) continue;
    pr.pack_keys(b, hk, box.j0, box.nk, true);
    TileJobs jobs;
    jobs.dq = true;
    BackwardTileT(c, pr, w, b, h, box.i0, box.nr, box.j0, box.nk, jobs, {box.i0 - i0, 0});
  }
  for (int64_t r = 0; r < nr; ++r) {
    float* dst = &g.dq(b, h, i0 + r, 0);
    const float* src = pr.dq_row(r);
    for (int64_t e = 0; e < p.E; ++e) dst[e * g.dq.strides[3]] = c.scale * src[e];
  }
}

// One tile of dbias: the element block owned by this unit, summed over all
// (b, h, i, j) that broadcast onto it, in a fixed order.
template <class Products>
void DbiasUnitT(const FusedCall& c, Products& pr, BackwardScratch& w, const SdpaGrads<float>& g,
                const View4<const float>& dout, const View4<const float>& out, const View3<const float>& lse,
                int64_t bb, int64_t bh, int64_t qbi, int64_t kbi) {
  const Problem& p = *c.p;
  const auto& db = g.dbias;
  const bool fullB = db.dim(0) == p.B && p.B > 1, fullH = db.dim(1) == p.H && p.H > 1;
  const bool fullL = db.dim(2) == p.L && p.L > 1, fullS = db.dim(3) == p.S && p.S > 1;
  // Rows/columns of the dbias tile this unit owns.
  const int64_t ti0 = fullL ? qbi * w.qb : 0, tnr = fullL ? std::min(w.qb, p.L - ti0) : 1;
  const int64_t tj0 = fullS ? kbi * w.kb : 0, tnk = fullS ? std::min(w.kb, p.S - tj0) : 1;
  float* acc = w.acc;  // [tnr × kbp]
  std::fill(acc, acc + w.qb * w.kbp, 0.0f);
  for (int64_t b = fullB ? bb : 0; b < (fullB ? bb + 1 : p.B); ++b) {
    for (int64_t h = fullH ? bh : 0; h < (fullH ? bh + 1 : p.H); ++h) {
      const int64_t hk = p.kv_head(h);
      const int64_t i_lo = fullL ? ti0 : 0, i_hi = fullL ? ti0 + tnr : p.L;
      for (int64_t i0 = i_lo; i0 < i_hi; i0 += w.qb) {
        const int64_t nr = std::min(w.qb, i_hi - i0);
        const rules::Keys keys = band_of(c, b).keys_of_rows(i0, i0 + nr);
        const int64_t j_lo = std::max(fullS ? tj0 : 0, keys.lo), j_hi = std::min(fullS ? tj0 + tnk : p.S, keys.hi);
        if (j_lo >= j_hi) continue;
        pr.pack_queries(b, h, i0, nr, dout, out, lse);
        for (int64_t j0 = j_lo; j0 < j_hi; j0 += w.kb) {
          const int64_t nk = std::min(w.kb, j_hi - j0);
          pr.pack_keys(b, hk, j0, nk, false);
          BackwardTileT(c, pr, w, b, h, i0, nr, j0, nk, TileJobs{});
          for (int64_t r = 0; r < nr; ++r) {
            const float* ds = w.dp + r * w.kbp;
            float* arow = acc + (fullL ? r : 0) * w.kbp;
            if (fullS)  // the tile's keys start j0 − tj0 into the owned columns
              for (int64_t jj = 0; jj < nk; ++jj) arow[j0 - tj0 + jj] += ds[jj];
            else
              for (int64_t jj = 0; jj < nk; ++jj) arow[0] += ds[jj];
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < tnr; ++r)
    for (int64_t jj = 0; jj < tnk; ++jj)
      db(bb, bh, fullL ? ti0 + r : 0, fullS ? tj0 + jj : 0) = acc[r * w.kbp + jj];
}

// The backward unit of plan.own_heads: all of (b, hk), dQ of the group's
// heads accumulated in the output (zeroed here; no other unit touches it),
// or in the products' dense dQ sums, copied to the output at the end.
template <class Products>
void OwnedHeadUnitT(const FusedCall& c, Products& pr, BackwardScratch& w, const SdpaGrads<float>& g,
                    const View4<const float>& dout, const View4<const float>& out, const View3<const float>& lse,
                    int64_t b, int64_t hk) {
  const Problem& p = *c.p;
  SdpaGrads<float> acc = g;  // dQ summed in g.dq, or where the products keep it dense
  if constexpr (requires { pr.dq_accumulator(); })
    if (pr.dq_accumulator()) acc.dq = View4<float>::bhnd(pr.dq_accumulator(), p.B, p.H, p.L, p.E);
  for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h)
    for (int64_t i = 0; i < p.L; ++i)
      for (int64_t e = 0; e < p.E; ++e) acc.dq(b, h, i, e) = 0.0f;
  for (int64_t j0 = 0; j0 < p.S; j0 += w.kb) KeyBlockUnitT(c, pr, w, acc, dout, out, lse, b, hk, j0, true);
  if (acc.dq.data != g.dq.data)
    for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h)
      for (int64_t i = 0; i < p.L; ++i)
        for (int64_t e = 0; e < p.E; ++e) g.dq(b, h, i, e) = acc.dq(b, h, i, e);
}

// The float32 units (the dense call's and the packed batch's).
void KeyBlockUnit(const FusedCall& c, BackwardScratch& w, const SdpaGrads<float>& g,
                  const View4<const float>& dout, const View4<const float>& out, const View3<const float>& lse,
                  int64_t b, int64_t hk, int64_t j0, bool dq_into_output) {
  Float32BackwardProducts pr{c, w};
  KeyBlockUnitT(c, pr, w, g, dout, out, lse, b, hk, j0, dq_into_output);
}
void QueryBlockUnit(const FusedCall& c, BackwardScratch& w, const SdpaGrads<float>& g,
                    const View4<const float>& dout, const View4<const float>& out, const View3<const float>& lse,
                    int64_t b, int64_t h, int64_t i0, int64_t nr) {
  Float32BackwardProducts pr{c, w};
  QueryBlockUnitT(c, pr, w, g, dout, out, lse, b, h, i0, nr);
}
void OwnedHeadUnit(const FusedCall& c, BackwardScratch& w, const SdpaGrads<float>& g,
                   const View4<const float>& dout, const View4<const float>& out, const View3<const float>& lse,
                   int64_t b, int64_t hk) {
  Float32BackwardProducts pr{c, w};
  OwnedHeadUnitT(c, pr, w, g, dout, out, lse, b, hk);
}

// Every unit of a dense backward call, threads taking them dynamically;
// make(w) gives a thread its products on its scratch w.
template <class MakeProducts>
void BackwardUnits(const FusedCall& c, const FusedPlan& t, View4<const float> dout, const SdpaGrads<float>& g,
                   View4<const float> out, View3<const float> lse, MakeProducts make) {
  const Problem& p = *c.p;
  const int64_t nkb = ceil_div(p.S, t.k_block), nqb = ceil_div(p.L, t.q_block);
#pragma omp parallel num_threads(p.threads)
  {
    const FlushToZero ftz;  // common.hpp
    BackwardScratch w(p, t, Lanes());
    auto pr = make(w);
    if (t.own_heads) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < p.B * p.Hkv; ++u)
        OwnedHeadUnitT(c, pr, w, g, dout, out, lse, u / p.Hkv, u % p.Hkv);
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < p.B * p.Hkv * nkb; ++u) {
        const int64_t kbi = u % nkb, hk = (u / nkb) % p.Hkv, b = u / (nkb * p.Hkv);
        KeyBlockUnitT(c, pr, w, g, dout, out, lse, b, hk, kbi * t.k_block, false);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < p.B * p.H * nqb; ++u) {
        const int64_t qbi = u % nqb, h = (u / nqb) % p.H, b = u / (nqb * p.H);
        const int64_t i0 = qbi * t.q_block;
        QueryBlockUnitT(c, pr, w, g, dout, out, lse, b, h, i0, std::min(t.q_block, p.L - i0));
      }
    }
    if (!g.dbias.empty()) {
      const auto& db = g.dbias;
      const int64_t nb = db.dim(0), nh = db.dim(1);
      const int64_t nq = db.dim(2) == p.L && p.L > 1 ? nqb : 1;
      const int64_t nks = db.dim(3) == p.S && p.S > 1 ? nkb : 1;
#pragma omp for schedule(dynamic, 1)
      for (int64_t u = 0; u < nb * nh * nq * nks; ++u) {
        const int64_t kbi = u % nks, qbi = (u / nks) % nq, bh = (u / (nks * nq)) % nh,
                      bb = u / (nks * nq * nh);
        DbiasUnitT(c, pr, w, g, dout, out, lse, bb, bh, qbi, kbi);
      }
    }
    if (!g.dsinks.empty()) {
      // One head per unit (AddSinkGradient).
#pragma omp for schedule(static)
      for (int64_t h = 0; h < p.H; ++h) {
        double acc = 0;
        AddSinkGradient(c, h, dout, out, lse, acc);
        g.dsinks(h) = float(acc);
      }
    }
  }
}

void BackwardImpl(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                  const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse,
                  FusedPlan t) {
  std::vector<uint8_t> bad;
  const FusedCall c = MakeCall(p, a, t, bad);
  BackwardQueries qs;
  BuildBackwardQueries(c, t, dout, out, lse, g.dq, qs);
  BackwardKeys ks;
  BuildBackwardKeys(c, t, ks);
  const BackwardQueries* queries = qs.q ? &qs : nullptr;
  const BackwardKeys* keys = ks.kt ? &ks : nullptr;
  BackwardUnits(c, t, dout, g, out, lse,
                [&](BackwardScratch& w) { return Float32BackwardProducts{c, w, queries, keys}; });
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_FUSED_ATTENTION_INL_H_
