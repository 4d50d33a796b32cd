// The decode kernel's vector helpers, compiled per target with decode.cpp
// (which includes this header once per target, after the fused kernels'
// simd-inl.h, so it has no ordinary include guard): loading stored K/V
// elements (float32, float16, bfloat16) as float32 vectors and the reduction of a register block of dot products
// across lanes.
#if defined(ATTN_KERNELS_DECODE_VECTORS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_DECODE_VECTORS_INL_H_
#undef ATTN_KERNELS_DECODE_VECTORS_INL_H_
#else
#define ATTN_KERNELS_DECODE_VECTORS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/decode/decode.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

// hn, DF, VF and Lanes() come with kernels/fused/simd-inl.h, included first.

// ---- loads: N stored elements as float32 ---------------------------------

HWY_INLINE VF LoadF(DF d, const float* HWY_RESTRICT p) { return hn::LoadU(d, p); }
HWY_INLINE VF LoadF(DF d, const hwy::float16_t* HWY_RESTRICT p) {
  const hn::Rebind<hwy::float16_t, DF> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, p));
}
HWY_INLINE VF LoadF(DF d, const hwy::bfloat16_t* HWY_RESTRICT p) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // One VPERMW with zero masking puts word i into the high half of dword i
  // (PromoteTo: VPMOVZXWD, then a shift).
  (void)d;
  const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0,
                                       3, 0, 2, 0, 1, 0, 0, 0);
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return VF{_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, _mm512_castsi256_si512(x)))};
#else
  const hn::Rebind<hwy::bfloat16_t, DF> db;
  return hn::PromoteTo(d, hn::LoadU(db, p));
#endif
}
// The first n (< N) elements, zeros after them; never reads past p + n.
template <class T>
HWY_INLINE VF LoadTail(DF d, const T* p, int64_t n) {
  HWY_ALIGN T buf[64];  // >= the lane count of any target
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, size_t(n) * sizeof(T));
  return LoadF(d, buf);
}

// The value loop's loads: NV vectors of a value row from p, float32 and
// float16 widened in order (vector c: the features cN .. cN + N − 1). A
// bfloat16 row is read as 32-bit words, each a pair of features (2i, 2i + 1):
// the word shifted left by 16 is the even feature as a float32, the word with
// its low half cleared the odd one, one shift and one AND per 2N features
// and no shuffle (PromoteTo costs a shuffle and a shift per N). So for
// bfloat16 each pair of vectors (2i, 2i + 1) holds the even, then the odd
// features of the 2N from p + 2iN: the accumulators keep that order
// (EvenOddPosition) until the kernel writes the output, and each element
// still sums its keys in order, so the bits are those of the float32 loop.
// TAIL: one vector of the first n (< N) features, in order.
template <class T>
constexpr bool kEvenOdd = std::is_same_v<T, hwy::bfloat16_t>;
template <int NV, bool TAIL, class T>
HWY_INLINE void LoadValues(DF d, const T* HWY_RESTRICT p, int64_t n, VF (&v)[NV]) {
  const int64_t N = int64_t(hn::Lanes(d));
  if constexpr (TAIL) {
    v[0] = LoadTail(d, p, n);
  } else if constexpr (kEvenOdd<T> && NV % 2 == 0) {
    const hn::RebindToUnsigned<DF> du;
    const auto odd = hn::Set(du, 0xFFFF0000u);
    for (int i = 0; i < NV / 2; ++i) {
      const auto x = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p + 2 * i * N));
      v[2 * i] = hn::BitCast(d, hn::ShiftLeft<16>(x));
      v[2 * i + 1] = hn::BitCast(d, hn::And(x, odd));
    }
  } else {
    for (int c = 0; c < NV; ++c) v[c] = LoadF(d, p + c * N);
  }
}

// Where the exact value loop keeps feature e of a bfloat16 value row of Ev
// features in its accumulator row (LoadValues): in each whole block of 2N
// features the even ones first, then the odd ones; the features past the
// last whole block in order. (One lane: the order of the features.)
HWY_INLINE int64_t EvenOddPosition(int64_t e, int64_t Ev) {
  const int64_t N = Lanes(), f = e % (2 * N);
  return e >= Ev / (2 * N) * (2 * N) ? e : e - f + (f % 2 ? N : 0) + f / 2;
}

// Writes y[e] = o[position(e)]·inv for the whole blocks of 2N features of
// an accumulator row that keeps them out of order (y contiguous), a vector
// at a time: output vector k of a block takes lane i from the block's first
// vector where sel(i), else from its second, at lane idx_k(i):
//   even/odd (EvenOddPosition): sel = i even, idx_k = k·N/2 + i/2;
//   pairs (decode_pair_position, blocks of 32 with N = 16): sel = i % 8 < 4,
//   idx_k = 8k + 4·(i/8) + i % 4.
// The same products as position by position, so the same bits; a scalar loop
// of those took a third of a decode call over 16 keys of a bfloat16 cache.
// Returns how many features it wrote (0 where the layout has no such blocks
// on this target: pairs need N = 16, one lane has no even/odd order).
class BlockOrder {
 public:
  explicit BlockOrder(bool pairs) : ok_(Lanes() > 1 && (!pairs || Lanes() == 16)) {
    const int64_t N = Lanes();
    for (int64_t i = 0; ok_ && i < N; ++i) {
      sel_[i] = (pairs ? i % 8 < 4 : i % 2 == 0) ? -1 : 0;
      for (int64_t k = 0; k < 2; ++k) idx_[k][i] = int32_t(pairs ? 8 * k + 4 * (i / 8) + i % 4 : k * N / 2 + i / 2);
    }
  }
  int64_t Write(const float* HWY_RESTRICT o, int64_t Ev, float inv, float* HWY_RESTRICT y) const {
    if (!ok_) return 0;
    const DF d;
    const hn::RebindToSigned<DF> di;
    const int64_t N = Lanes(), whole = Ev / (2 * N) * (2 * N);
    const auto first = hn::RebindMask(d, hn::Ne(hn::Load(di, sel_), hn::Zero(di)));
    const auto i0 = hn::SetTableIndices(d, idx_[0]), i1 = hn::SetTableIndices(d, idx_[1]);
    const VF vinv = hn::Set(d, inv);
    for (int64_t e = 0; e < whole; e += 2 * N) {
      const VF a = hn::Load(d, o + e), b = hn::Load(d, o + e + N);
      hn::StoreU(hn::Mul(hn::IfThenElse(first, hn::TableLookupLanes(a, i0), hn::TableLookupLanes(b, i0)), vinv), d,
                 y + e);
      hn::StoreU(hn::Mul(hn::IfThenElse(first, hn::TableLookupLanes(a, i1), hn::TableLookupLanes(b, i1)), vinv), d,
                 y + e + N);
    }
    return whole;
  }

 private:
  static constexpr size_t kMax = HWY_MAX_BYTES / sizeof(float);
  bool ok_;
  HWY_ALIGN int32_t sel_[kMax] = {};
  HWY_ALIGN int32_t idx_[2][kMax] = {};
};

// n stored elements widened to float32, a vector at a time (the bulk path of
// convert_from_storage).
template <class T>
void WidenRow(const T* HWY_RESTRICT x, int64_t n, float* HWY_RESTRICT y) {
  const DF d;
  const int64_t N = Lanes();
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(LoadF(d, x + i), d, y + i);
  if (i < n) {
    HWY_ALIGN float buf[64];
    hn::Store(LoadTail(d, x + i, n - i), d, buf);
    std::memcpy(y + i, buf, size_t(n - i) * sizeof(float));
  }
}
void WidenImpl(Dtype t, const void* src, int64_t n, float* y) {
  if (t == Dtype::float16) return WidenRow(static_cast<const hwy::float16_t*>(src), n, y);
  WidenRow(static_cast<const hwy::bfloat16_t*>(src), n, y);
}

// ---- sums of a register block across lanes ----------------------------------

#if HWY_TARGET != HWY_SCALAR && !HWY_HAVE_SCALABLE
// The 128-bit vector of the sums of the 128-bit blocks of v.
template <class D>
HWY_INLINE auto BlockSum(D d, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(d) <= 4) {
    return v;
  } else {
    const hn::Half<D> dh;
    return BlockSum(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  }
}

// The sums of the lanes of a, b, c and e in lanes 0..3 of one 128-bit
// vector, by a transposing tree: interleave pairs of lanes and add, then
// pairs of pairs, then add the 128-bit blocks. About 3 operations per
// accumulator, where a reduction of each alone costs about 7.
HWY_INLINE hn::Vec<hn::Full128<float>> Sums4(VF a, VF b, VF c, VF e) {
  const DF d;
  const hn::Repartition<double, DF> dd;
  const VF ab = hn::Add(hn::InterleaveLower(d, a, b), hn::InterleaveUpper(d, a, b));  // per block a0+a2, b0+b2, a1+a3, b1+b3
  const VF ce = hn::Add(hn::InterleaveLower(d, c, e), hn::InterleaveUpper(d, c, e));
  const auto x = hn::BitCast(dd, ab), y = hn::BitCast(dd, ce);
  const VF z = hn::Add(hn::BitCast(d, hn::InterleaveLower(dd, x, y)), hn::BitCast(d, hn::InterleaveUpper(dd, x, y)));
  return BlockSum(d, z);  // per block: the block's sums of a, b, c, e
}
#endif

// s[r·lds + c] = the sum of the lanes of acc[r][c], four accumulators at a
// time where the target allows.
template <int R, int C>
HWY_INLINE void StoreSums(VF (&acc)[R][C], float* HWY_RESTRICT s, int64_t lds) {
  const DF d;
  constexpr int kN = R * C;
  int f = 0;
#if HWY_TARGET != HWY_SCALAR && !HWY_HAVE_SCALABLE
  const hn::Full128<float> d4;
  for (; f + 4 <= kN; f += 4) {
    const auto v = Sums4(acc[f / C][f % C], acc[(f + 1) / C][(f + 1) % C], acc[(f + 2) / C][(f + 2) % C],
                         acc[(f + 3) / C][(f + 3) % C]);
    if constexpr (C == 2) {  // two rows of two keys
      const hn::Full64<float> d2;
      hn::StoreU(hn::LowerHalf(d2, v), d2, s + (f / 2) * lds);
      hn::StoreU(hn::UpperHalf(d2, v), d2, s + (f / 2 + 1) * lds);
    } else if constexpr (C == 4) {  // one row of four keys
      hn::StoreU(v, d4, s + (f / 4) * lds);
    } else {
      HWY_ALIGN float t[4];
      hn::Store(v, d4, t);
      for (int i = 0; i < 4; ++i) s[((f + i) / C) * lds + (f + i) % C] = t[i];
    }
  }
#endif
  for (; f < kN; ++f) s[(f / C) * lds + f % C] = hn::GetLane(hn::SumOfLanes(d, acc[f / C][f % C]));
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_DECODE_VECTORS_INL_H_
