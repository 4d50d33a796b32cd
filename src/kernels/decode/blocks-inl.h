// The decode kernel's register blocks, compiled per target with decode.cpp
// (included once per target after vectors-inl.h, so it has no ordinary
// include guard): the block of R query rows × C keys of dot products, the
// strips of R rows × NV vectors of probability-weighted value sums (each
// runs the software prefetch of prefetch.hpp along with its keys). They
// know nothing of the call or its scratch; decode.cpp's ScoreTile and
// ValueTile drive them over a tile.
#if defined(ATTN_KERNELS_DECODE_BLOCKS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_DECODE_BLOCKS_INL_H_
#undef ATTN_KERNELS_DECODE_BLOCKS_INL_H_
#else
#define ATTN_KERNELS_DECODE_BLOCKS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>

#include "kernels/decode/decode.hpp"
#include "kernels/decode/prefetch.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

// hn, DF, VF, Lanes() and ceil_div come with kernels/fused/simd-inl.h and
// common.hpp; LoadF, LoadTail and StoreSums with vectors-inl.h; RowPrefetch
// with prefetch.hpp.
using decode_common::RowPrefetch;

// ---- scores: s[r][jj] = q_r · k_jj ----------------------------------------

template <int R, int C, class T>
HWY_INLINE void ScoreBlock(const float* HWY_RESTRICT q, int64_t ldq, const T* HWY_RESTRICT k, int64_t krow,
                           int64_t E, float* HWY_RESTRICT s, int64_t lds) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  VF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = hn::Zero(d);
  int64_t e = 0;
  for (; e + N <= E; e += N) {
    VF kv[C];
    for (int c = 0; c < C; ++c) kv[c] = LoadF(d, k + c * krow + e);  // converted once, used by R rows
    for (int r = 0; r < R; ++r) {
      const VF qv = hn::Load(d, q + r * ldq + e);
      for (int c = 0; c < C; ++c) acc[r][c] = hn::MulAdd(qv, kv[c], acc[r][c]);
    }
  }
  if (e < E) {  // the padded queries are zero beyond E
    VF kv[C];
    for (int c = 0; c < C; ++c) kv[c] = LoadTail(d, k + c * krow + e, E - e);
    for (int r = 0; r < R; ++r) {
      const VF qv = hn::Load(d, q + r * ldq + e);
      for (int c = 0; c < C; ++c) acc[r][c] = hn::MulAdd(qv, kv[c], acc[r][c]);
    }
  }
  StoreSums<R, C>(acc, s, lds);
}

// Keys per score block: R·C sums a multiple of four where the registers
// allow (StoreSums reduces four at a time; a single sum costs about as much
// as four). With 3 rows (a group of 3 query heads per key/value head), 4
// keys rather than 2 per block: a decoding step of 9 heads over 3 at 2,000
// bfloat16 keys of 64 took about 7% less time (medians of five alternating
// runs, one thread, Emerald Rapids, AVX-512). With 4 rows, 4 keys too (16
// accumulators): 0-8% less time with bfloat16 K/V in the caches, float32
// the same or faster (5 alternating runs, one thread, (H, Hkv) = (8, 2) at
// E = 64 and (32, 8) at E = 128, S = 4096, Emerald Rapids); with 2 rows
// float32 took longer. Each score still sums its features in the same
// order, whatever the storage type or the block.
template <int R>
constexpr int ScoreKeys() {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  return R == 2 ? 2 : 4;  // 4 × 4 accumulators + 4 keys + 1 query within 32 registers
#else
  return R == 1 ? 4 : 2;  // 16 registers
#endif
}

template <int R, class T>
HWY_INLINE void ScoreRows(const float* q, int64_t ldq, const T* k, int64_t krow, int64_t nk, int64_t E,
                          float* s, int64_t lds, RowPrefetch pf) {
  int64_t jj = 0;
  if constexpr (ScoreKeys<R>() == 4)
    for (; jj + 4 <= nk; jj += 4) {
      pf.rows(jj, 4);
      ScoreBlock<R, 4>(q, ldq, k + jj * krow, krow, E, s + jj, lds);
    }
  for (; jj + 2 <= nk; jj += 2) {
    pf.rows(jj, 2);
    ScoreBlock<R, 2>(q, ldq, k + jj * krow, krow, E, s + jj, lds);
  }
  if (jj < nk) {
    pf.rows(jj, 1);
    ScoreBlock<R, 1>(q, ldq, k + jj * krow, krow, E, s + jj, lds);
  }
}

// ---- values: acc[r][:] += Σ_jj p[r][jj] · v_jj -------------------------------

// One strip of NV vectors starting at feature e0; TAIL: the strip is one
// partial vector of Ev − e0 features.
template <int R, int NV, bool TAIL, class T>
HWY_INLINE void ValueStrip(const float* HWY_RESTRICT p, int64_t ldp, int64_t nk, const T* HWY_RESTRICT v,
                           int64_t vrow, int64_t e0, int64_t Ev, float* HWY_RESTRICT o, int64_t ldo,
                           RowPrefetch pf) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  VF acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = hn::Load(d, o + r * ldo + e0 + c * N);
  for (int64_t jj = 0; jj < nk; ++jj) {
    pf.rows(jj, 1);
    const T* vj = v + jj * vrow + e0;
    VF vv[NV];
    LoadValues<NV, TAIL>(d, vj, Ev - e0, vv);  // bfloat16: even, odd features (EvenOddPosition)
    for (int r = 0; r < R; ++r) {
      const VF pr = hn::Set(d, p[r * ldp + jj]);
      for (int c = 0; c < NV; ++c) acc[r][c] = hn::MulAdd(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) hn::Store(acc[r][c], d, o + r * ldo + e0 + c * N);
}

// Strips of NV vectors while they fit, then of NV / 2, ..., 1 (pf goes with
// the first strip only).
template <int R, int NV, class T>
HWY_INLINE void ValueStrips(const float* p, int64_t ldp, int64_t nk, const T* v, int64_t vrow, int64_t& e0,
                            int64_t Ev, float* o, int64_t ldo, RowPrefetch& pf) {
  const int64_t N = int64_t(hn::Lanes(DF()));
  for (; e0 + NV * N <= Ev; e0 += NV * N, pf.a.p = nullptr)
    ValueStrip<R, NV, false>(p, ldp, nk, v, vrow, e0, Ev, o, ldo, pf);
  if constexpr (NV > 1) ValueStrips<R, NV / 2>(p, ldp, nk, v, vrow, e0, Ev, o, ldo, pf);
}

// The widest strip for R rows: at most half the vector registers as
// accumulators (16 of 32 on AVX-512, 8 of 16 elsewhere), at most 8 vectors,
// a power of two. Wide strips read each value row in few long runs (on
// AVX-512 a row of 128 features in two runs for 4 rows, in one for 1 or 2
// rows), which the hardware prefetchers follow better than many narrow
// strips. Each output element still sums its keys in key order, so the
// strip width does not change a bit.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kValueAccs = 16;
#else
constexpr int kValueAccs = 8;
#endif
constexpr int WidestStrip(int rows) {
  int nv = 1;
  while (nv * 2 <= 8 && nv * 2 * rows <= kValueAccs) nv *= 2;
  return nv;
}

// Rows per value block: 4, or, for float32 storage, 2 when 4 rows' whole
// value rows do not fit the strip's accumulators and 2 rows' do, so that
// each pass over a tile reads every value row whole and in order. On Zen 4
// with Ev = 128 (8 AVX-512 vectors), float32 blocks of 2 rows × 8 vectors
// took 10-15% less time than 4 rows × 4 (half rows), in alternating runs.
// Half storage keeps 4 rows: 2-row blocks widen each value row once per
// block, twice for a group of 4 rows, and there the widening, not the
// memory, sets the pace (docs/decode.md, "Half storage is bound by its
// arithmetic"): 4-row blocks took 5-10% less time with K/V in the cache and
// raised the paired speed-up over float32 from about 1.75× to 1.83× (Zen 4,
// 2 threads). Single rows are not taken for the same reason (on AVX2 at
// Ev = 64, bfloat16 took 25-40% longer). The bits are the same either way
// (each output element sums its keys in order).
int64_t ValueRowBlock(int64_t Ev, size_t elem_bytes) {
  const int64_t nv = ceil_div(Ev, Lanes());
  return elem_bytes == 4 && 4 * nv > kValueAccs && 2 * nv <= kValueAccs && nv <= 8 ? 2 : 4;
}

template <int R, class T>
HWY_INLINE void ValueRows(const float* p, int64_t ldp, int64_t nk, const T* v, int64_t vrow, int64_t Ev,
                          float* o, int64_t ldo, RowPrefetch pf = {}) {
  int64_t e0 = 0;
  ValueStrips<R, WidestStrip(R)>(p, ldp, nk, v, vrow, e0, Ev, o, ldo, pf);
  if (e0 < Ev) ValueStrip<R, 1, true>(p, ldp, nk, v, vrow, e0, Ev, o, ldo, pf);
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_DECODE_BLOCKS_INL_H_
