// The decode kernel's bfloat16 products on AVX512_BF16 (the arithmetic both
// paths share is in decode/bf16.hpp). Compiled once with the baseline flags:
// the code sits in a `#pragma GCC target` region and runs only where
// bf16_path_available(Bf16Path::avx512_bf16) says the CPU allows it.
//
// Scores: a register block of R rows × C keys (R·C <= 16 accumulators),
// each key's 32 features loaded once per block as bfloat16 (VCVTNE2PS2BF16
// rounds float32 and widened float16 rows; a bfloat16 row is loaded as it
// is) and used by the R rows; the 16 accumulators are then summed across
// lanes together by a transposing tree (Sums16) in lane_sum16's order.
// Values: a block of R rows × NS strips of 32 features; the two value rows
// of a key pair are interleaved (VPUNPCKLWD/VPUNPCKHWD) into VDPBF16PS's
// pair layout once per block and used by the R rows, whose probability
// pair is one broadcast dword. The interleave leaves the features of a
// strip permuted across its two accumulators (lo: features 8β + 0..3, hi:
// 8β + 4..7 of each 128-bit block β), and the accumulator rows keep that
// order (decode_pair_position) until the kernel writes the output.
//
// Every loop over a block's accumulators is unrolled (`#pragma GCC
// unroll`): where one was not, GCC kept the accumulator array in memory and
// stored it on every pass of the feature loop, which took 1.7× the time
// (Zen 4, one thread, warm cache of (32, 8, 4096, 128): 1.31 against
// 0.77 ms).
#include <algorithm>
#include <cstring>

#include "kernels/decode/bf16.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_DECODE_BF16_X86 1
#include <immintrin.h>
#else
#define ATTN_DECODE_BF16_X86 0
#endif

namespace attn::detail {

bool decode_bf16_pays() {
  static const bool pays = bf16_best_path() == Bf16Path::avx512_bf16;  // the fused forward's rule
  return pays;
}

Bf16Path decode_bf16_path() {
  // (Not AMX: packing a tile's keys and value pairs for the tile products
  // took longer than VDPBF16PS on an Emerald Rapids, docs/decode.md.)
  static const Bf16Path path =
      bf16_path_available(Bf16Path::avx512_bf16) ? Bf16Path::avx512_bf16 : Bf16Path::portable;
  return path;
}

#if ATTN_DECODE_BF16_X86

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")

namespace {

using decode_common::RowPrefetch;

// ---- 32 features of a row as bfloat16 operands (n < 32: zeros after n) ------

inline __mmask16 First16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }

inline __m512i Ops32(const float* p, int64_t n) {
  if (n >= 32) return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(First16(n - 16), p + 16), _mm512_maskz_loadu_ps(First16(n), p));
}
inline __m512i Ops32(const float16_t* p, int64_t n) {
  const auto* b = reinterpret_cast<const char*>(p);
  __m256i lo, hi;
  if (n >= 32) {
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
  } else {
    lo = _mm256_maskz_loadu_epi16(First16(n), b);
    hi = _mm256_maskz_loadu_epi16(First16(n - 16), b + 32);
  }
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_cvtph_ps(0xFFFF, hi), _mm512_maskz_cvtph_ps(0xFFFF, lo));
}
inline __m512i Ops32(const bfloat16_t* p, int64_t n) {
  if (n >= 32) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(n <= 0 ? __mmask32(0) : __mmask32((uint64_t(1) << n) - 1), p);
}

inline __m512 Dot(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// The zero-masked forms of the shuffles, permutations and conversions (an
// all-ones mask: the same instruction): GCC 12's unmasked ones pass an
// undefined vector that -Wuninitialized reports once they are inlined.
template <int imm>
inline __m512 Shuffle128(__m512 a, __m512 b) { return _mm512_maskz_shuffle_f32x4(0xFFFF, a, b, imm); }
template <int imm>
inline __m512 ShufflePs(__m512 a, __m512 b) { return _mm512_maskz_shuffle_ps(0xFFFF, a, b, imm); }

// ---- scores -------------------------------------------------------------------

// The 16 lane sums of a[0..n) (missing ones zero) in lane_sum16's order,
// sum k in lane k: pairs of accumulators are folded side by side (lanes
// i and i + 8), then fours (i and i + 4), eights (i and i + 2), sixteen
// (i and i + 1), which leaves sum 4k + β in lane 4β + k; one permutation
// puts it in lane 4k + β.
template <int n>
inline __m512 Sums16(const __m512 (&a)[n]) {
  __m512 x16[16], l1[8], l2[4], l3[2];
#pragma GCC unroll 16
  for (int i = 0; i < n; ++i) x16[i] = a[i];
#pragma GCC unroll 16
  for (int i = n; i < 16; ++i) x16[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m512 x = x16[2 * j], y = x16[2 * j + 1];
    l1[j] = _mm512_add_ps(Shuffle128<0x44>(x, y), Shuffle128<0xEE>(x, y));
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
    l2[j] = _mm512_add_ps(Shuffle128<0x88>(l1[2 * j], l1[2 * j + 1]),
                          Shuffle128<0xDD>(l1[2 * j], l1[2 * j + 1]));
#pragma GCC unroll 2
  for (int j = 0; j < 2; ++j)
    l3[j] = _mm512_add_ps(ShufflePs<0x44>(l2[2 * j], l2[2 * j + 1]),
                          ShufflePs<0xEE>(l2[2 * j], l2[2 * j + 1]));
  const __m512 l4 = _mm512_add_ps(ShufflePs<0x88>(l3[0], l3[1]), ShufflePs<0xDD>(l3[0], l3[1]));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_maskz_permutexvar_ps(0xFFFF, order, l4);
}

// s[r][c] for R rows × C keys.
template <int R, int C, class T>
inline void ScoreBlock(const uint16_t* q, int64_t ldq, const T* k, int64_t krow, int64_t E, float alpha, float* s,
                       int64_t lds) {
  __m512 acc[R * C];
#pragma GCC unroll 16
  for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t e = 0; e < E; e += 32) {  // q is zero past E, and so are the loaded keys
    __m512i kv[C];
    if constexpr (R > 1) {
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) kv[c] = Ops32(k + c * krow + e, E - e);  // loaded once, used by R rows
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i qv = _mm512_loadu_si512(q + r * ldq + e);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
        acc[r * C + c] = Dot(acc[r * C + c], qv, R > 1 ? kv[c] : Ops32(k + c * krow + e, E - e));
    }
  }
  alignas(64) float sums[16];  // row r's C sums are sums[r·C, r·C + C)
  _mm512_store_ps(sums, _mm512_mul_ps(Sums16(acc), _mm512_set1_ps(alpha)));
  for (int r = 0; r < R; ++r) {
    if constexpr (C == 16) _mm512_storeu_ps(s + r * lds, _mm512_load_ps(sums + r * C));
    else if constexpr (C == 8) _mm256_storeu_ps(s + r * lds, _mm256_load_ps(sums + r * C));
    else if constexpr (C == 4) _mm_storeu_ps(s + r * lds, _mm_load_ps(sums + r * C));
    else
      for (int c = 0; c < C; ++c) s[r * lds + c] = sums[r * C + c];
  }
}

template <int R, class T>
void ScoreRows(const uint16_t* q, int64_t ldq, const T* k, int64_t krow, int64_t nk, int64_t E, float alpha,
               float* s, int64_t lds, const RowPrefetch& pf) {
  constexpr int C = R == 1 ? 16 : R == 2 ? 8 : 4;
  int64_t j = 0;
  for (; j + C <= nk; j += C) {
    pf.rows(j, C);
    ScoreBlock<R, C>(q, ldq, k + j * krow, krow, E, alpha, s + j, lds);
  }
  for (; j < nk; ++j) {
    pf.rows(j, 1);
    ScoreBlock<R, 1>(q, ldq, k + j * krow, krow, E, alpha, s + j, lds);
  }
}

template <class T>
void Scores(int rows, const uint16_t* q, int64_t ldq, const T* k, int64_t krow, int64_t nk, int64_t E, float alpha,
            float* s, int64_t lds, const RowPrefetch& pf) {
  switch (rows) {
    case 4: return ScoreRows<4>(q, ldq, k, krow, nk, E, alpha, s, lds, pf);
    case 3: return ScoreRows<3>(q, ldq, k, krow, nk, E, alpha, s, lds, pf);
    case 2: return ScoreRows<2>(q, ldq, k, krow, nk, E, alpha, s, lds, pf);
    default: return ScoreRows<1>(q, ldq, k, krow, nk, E, alpha, s, lds, pf);
  }
}

// ---- values -------------------------------------------------------------------

// R rows × NS strips of 32 features from e0 (the last strip may be partial).
template <int R, int NS, class T>
inline void ValueBlock(const uint32_t* pp, int64_t ldp, int64_t npairs, const T* const* v, int64_t e0, int64_t Ev,
                       float* o, int64_t ldo, const RowPrefetch& pf) {
  int64_t n[NS];
#pragma GCC unroll 8
  for (int t = 0; t < NS; ++t) n[t] = std::min<int64_t>(32, Ev - e0 - 32 * t);
  __m512 lo[R][NS], hi[R][NS];  // features 8β + 0..3 and 8β + 4..7 of each 128-bit block β of a strip
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NS; ++t) {
      lo[r][t] = _mm512_loadu_ps(o + r * ldo + e0 + 32 * t);
      hi[r][t] = _mm512_loadu_ps(o + r * ldo + e0 + 32 * t + 16);
    }
  for (int64_t m = 0; m < npairs; ++m) {
    pf.rows(2 * m, 2);
    const T* a = v[2 * m] + e0;
    const T* b = v[2 * m + 1] + e0;
    __m512i vl[NS], vh[NS];
#pragma GCC unroll 8
    for (int t = 0; t < NS; ++t) {
      const __m512i x = Ops32(a + 32 * t, n[t]), y = Ops32(b + 32 * t, n[t]);
      vl[t] = _mm512_unpacklo_epi16(x, y);  // dwords (v_2m, v_2m+1) of features 8β + 0..3
      vh[t] = _mm512_unpackhi_epi16(x, y);  // ... and 8β + 4..7
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i p = _mm512_set1_epi32(int32_t(pp[r * ldp + m]));
#pragma GCC unroll 8
      for (int t = 0; t < NS; ++t) {
        lo[r][t] = Dot(lo[r][t], p, vl[t]);
        hi[r][t] = Dot(hi[r][t], p, vh[t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NS; ++t) {
      _mm512_storeu_ps(o + r * ldo + e0 + 32 * t, lo[r][t]);
      _mm512_storeu_ps(o + r * ldo + e0 + 32 * t + 16, hi[r][t]);
    }
}

// Blocks of NS strips while that many remain, then NS / 2, ..., 1 (the
// prefetch stream goes with the first block only).
template <int R, int NS, class T>
inline void ValueStrips(const uint32_t* pp, int64_t ldp, int64_t npairs, const T* const* v, int64_t& e0, int64_t Ev,
                        float* o, int64_t ldo, RowPrefetch& pf) {
  for (; e0 + 32 * (NS - 1) < Ev; e0 += 32 * NS, pf.a.p = nullptr) ValueBlock<R, NS>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
  if constexpr (NS > 1) ValueStrips<R, NS / 2>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
}

template <class T>
void Values(int rows, const uint32_t* pp, int64_t ldp, int64_t npairs, const T* const* v, int64_t Ev, float* o,
            int64_t ldo, RowPrefetch pf) {
  int64_t e0 = 0;
  switch (rows) {  // up to 16 accumulators: 4 rows × 2 strips, 2 × 4, 1 × 8
    case 4: return ValueStrips<4, 2>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
    case 3: return ValueStrips<3, 2>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
    case 2: return ValueStrips<2, 4>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
    default: return ValueStrips<1, 8>(pp, ldp, npairs, v, e0, Ev, o, ldo, pf);
  }
}

}  // namespace

void decode_bf16_scores_native(Dtype t, int rows, const uint16_t* q, int64_t ldq, const void* k, int64_t krow,
                               int64_t nk, int64_t E, float alpha, float* s, int64_t lds, const RowPrefetch& pf) {
  switch (t) {
    case Dtype::float32: return Scores(rows, q, ldq, static_cast<const float*>(k), krow, nk, E, alpha, s, lds, pf);
    case Dtype::float16: return Scores(rows, q, ldq, static_cast<const float16_t*>(k), krow, nk, E, alpha, s, lds, pf);
    case Dtype::bfloat16: return Scores(rows, q, ldq, static_cast<const bfloat16_t*>(k), krow, nk, E, alpha, s, lds, pf);
  }
}

void decode_bf16_values_native(Dtype t, int rows, const uint32_t* pp, int64_t ldp, int64_t npairs,
                               const void* const* v, int64_t Ev, float* o, int64_t ldo, const RowPrefetch& pf) {
  switch (t) {
    case Dtype::float32: return Values(rows, pp, ldp, npairs, reinterpret_cast<const float* const*>(v), Ev, o, ldo, pf);
    case Dtype::float16: return Values(rows, pp, ldp, npairs, reinterpret_cast<const float16_t* const*>(v), Ev, o, ldo, pf);
    case Dtype::bfloat16: return Values(rows, pp, ldp, npairs, reinterpret_cast<const bfloat16_t* const*>(v), Ev, o, ldo, pf);
  }
}

#pragma GCC pop_options

#else  // not x86: the portable path runs everywhere

void decode_bf16_scores_native(Dtype, int, const uint16_t*, int64_t, const void*, int64_t, int64_t, int64_t, float,
                               float*, int64_t, const decode_common::RowPrefetch&) {}
void decode_bf16_values_native(Dtype, int, const uint32_t*, int64_t, int64_t, const void* const*, int64_t, float*,
                               int64_t, const decode_common::RowPrefetch&) {}

#endif  // ATTN_DECODE_BF16_X86

}  // namespace attn::detail
