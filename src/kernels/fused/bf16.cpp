// The operands of the bfloat16 forward and backward, built once per call
// (bf16.hpp), and their entry points. Compiled once: the units run per SIMD target (fused.cpp,
// bf16-inl.h), the products on the chosen path (bf16_products.cpp).
#include "kernels/fused/bf16.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/fused/common.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/prefetch.hpp"

namespace attn::detail {

void transpose8(const uint16_t* src, int64_t lds, int64_t rj, int64_t ce, uint16_t* dst, int64_t ldd) {
  int64_t ne = 0, nj = 0;  // the part done in blocks
#if defined(__SSE2__)
  ne = ce / 8 * 8, nj = rj / 8 * 8;
  for (int64_t e = 0; e < ne; e += 8)
    for (int64_t j = 0; j < nj; j += 8) {
      __m128i r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (j + i) * lds + e));
      const __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
      const __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
      const __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
      const __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
      const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
      const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
      const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
      const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
      const __m128i c[8] = {_mm_unpacklo_epi64(b0, b4), _mm_unpackhi_epi64(b0, b4), _mm_unpacklo_epi64(b1, b5),
                            _mm_unpackhi_epi64(b1, b5), _mm_unpacklo_epi64(b2, b6), _mm_unpackhi_epi64(b2, b6),
                            _mm_unpacklo_epi64(b3, b7), _mm_unpackhi_epi64(b3, b7)};
      for (int i = 0; i < 8; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (e + i) * ldd + j), c[i]);
    }
#endif
  for (int64_t e = 0; e < ce; ++e)
    for (int64_t j = e < ne ? nj : 0; j < rj; ++j) dst[e * ldd + j] = src[j * lds + e];
}

namespace {

// The operand bits of one input value.
template <class T>
uint16_t operand_of(T x) {
  if constexpr (std::is_same_v<T, bfloat16_t>) {  // already bfloat16: subnormals to zero, NaN quiet
    if ((x.bits & 0x7F80u) == 0) return uint16_t(x.bits & 0x8000u);
    return (x.bits & 0x7FFFu) > 0x7F80u ? uint16_t(x.bits | 0x0040u) : x.bits;
  } else {
    return bf16_operand(float(x));
  }
}

// Operand bits of the n elements of a row (s apart) into dst; returns
// whether one of them is ±∞ or NaN.
template <class T>
bool operand_row(const T* x, int64_t s, int64_t n, uint16_t* dst) {
  uint32_t bad = 0;
  const auto one = [&](int64_t e, T y) {
    dst[e] = operand_of(y);
    bad |= uint32_t((dst[e] & 0x7F80u) == 0x7F80u);
  };
  if constexpr (std::is_same_v<T, float>)
    if (s == 1) return bf16_round_row(x, n, dst);  // contiguous float32, the common case: SIMD
  if constexpr (std::is_same_v<T, bfloat16_t>)
    if (s == 1) return bf16_operand_bits_row(reinterpret_cast<const uint16_t*>(x), n, dst);  // SIMD too
  if (s == 1)
    for (int64_t e = 0; e < n; ++e) one(e, x[e]);
  else
    for (int64_t e = 0; e < n; ++e) one(e, x[e * s]);
  return bad != 0;
}

// An A element: operand bits, or (the portable path) their float32 value.
template <class A>
A element(uint16_t bits) {
  if constexpr (std::is_same_v<A, float>) return bf16_value(bits);
  else return bits;
}

// Keys per work item of the key/value pass (a fixed split).
constexpr int64_t kKeyBlock = 64;
// How many keys ahead the key/value pass starts loading rows: a key's K and
// V rows are often far apart from the next key's (the multi-head layer's
// packed projections: 3·D floats), which the hardware prefetchers follow
// badly. 2 to 16 keys ahead took 3-6% less time on the bfloat16 layer's
// forward at (8, 128, 256, 4) and (4, 512, 512, 8) (Zen 4, 2 threads).
constexpr int64_t kPackAhead = 4;

// The k rows and vt columns of keys [j0, j1) of one (b, kv head), A the
// path's element type; a bad key (in K or V) is zeros, as are k's columns
// past E. Returns whether one is bad.
template <class A, class T>
bool pack_keys(const Problem& p, const SdpaArgs<T>& a, int64_t b, int64_t hk, int64_t j0, int64_t j1, A* k, A* vt,
               int64_t E2, int64_t ldvt, uint8_t* bad_keys) {
  constexpr bool bits = std::is_same_v<A, uint16_t>;  // k's rows take the bits as they are rounded
  std::vector<uint16_t> kr(bits ? 0 : size_t(p.E)), vr(size_t((j1 - j0) * p.Ev));
  bool any = false;
  for (int64_t j = j0; j < j1; ++j) {
    if (j + kPackAhead < j1 && a.k.strides[3] == 1 && a.v.strides[3] == 1) {  // key j + kPackAhead's rows
      PrefetchL1Bytes(&a.k(b, hk, j + kPackAhead, 0), p.E * int64_t(sizeof(T)));
      PrefetchL1Bytes(&a.v(b, hk, j + kPackAhead, 0), p.Ev * int64_t(sizeof(T)));
    }
    uint16_t* v = vr.data() + (j - j0) * p.Ev;
    uint16_t* kb = bits ? reinterpret_cast<uint16_t*>(k + j * E2) : kr.data();
    const bool bad = operand_row(&a.k(b, hk, j, 0), a.k.strides[3], p.E, kb) |
                     operand_row(&a.v(b, hk, j, 0), a.v.strides[3], p.Ev, v);
    bad_keys[j] = bad;
    any = any || bad;
    std::fill(k + j * E2 + p.E, k + (j + 1) * E2, A(0));
    if (bad) {
      std::fill(v, v + p.Ev, uint16_t(0));
      std::fill(k + j * E2, k + j * E2 + p.E, A(0));
      continue;
    }
    if constexpr (!bits)
      for (int64_t e = 0; e < p.E; ++e) k[j * E2 + e] = element<A>(kr[size_t(e)]);
  }
  if constexpr (bits)  // the block transposed: contiguous writes
    transpose8(vr.data(), p.Ev, j1 - j0, p.Ev, vt + j0, ldvt);
  else
    for (int64_t e = 0; e < p.Ev; ++e)
      for (int64_t j = j0; j < j1; ++j) vt[e * ldvt + j] = element<A>(vr[size_t((j - j0) * p.Ev + e)]);
  return any;
}

// The buffers this thread keeps for its next calls (OperandBuffer).
std::vector<std::pair<size_t, hwy::AlignedFreeUniquePtr<std::byte[]>>>& kept_buffers() {
  thread_local std::vector<std::pair<size_t, hwy::AlignedFreeUniquePtr<std::byte[]>>> kept;
  return kept;
}

}  // namespace

OperandBuffer::OperandBuffer(size_t bytes, bool zeroed) {
  bytes = std::max<size_t>(bytes, 1);
  auto& kept = kept_buffers();
  auto best = kept.end();  // the smallest kept buffer that holds `bytes`
  for (auto it = kept.begin(); it != kept.end(); ++it)
    if (it->first >= bytes && (best == kept.end() || it->first < best->first)) best = it;
  if (best != kept.end()) {
    cap_ = best->first;
    p_ = std::move(best->second);
    kept.erase(best);
  } else {
    cap_ = bytes;
    p_ = hwy::AllocateAligned<std::byte>(bytes);
    if (!p_) throw std::bad_alloc();
  }
  if (zeroed) std::memset(p_.get(), 0, bytes);
}

void OperandBuffer::release() {
  if (!p_ || cap_ > kKeptBytes) return;
  auto& kept = kept_buffers();
  if (kept.size() >= kKept) {
    const auto smallest = std::min_element(kept.begin(), kept.end(),
                                           [](const auto& x, const auto& y) { return x.first < y.first; });
    if (smallest->first >= cap_) return;
    kept.erase(smallest);
  }
  kept.emplace_back(cap_, std::move(p_));
}

OperandBuffer::~OperandBuffer() { release(); }

OperandBuffer& OperandBuffer::operator=(OperandBuffer&& o) noexcept {
  if (this != &o) {
    release();
    p_ = std::move(o.p_);
    cap_ = o.cap_;
  }
  return *this;
}

template <class T>
Bf16Operands::Bf16Operands(const Problem& p, const SdpaArgs<T>& a, const Bf16Kernel& kern) : kernel(kern) {
  E2 = round_up(p.E, kern.kpad);
  Evr = round_up(p.Ev, kern.mpad);
  krows = p.S + 16;
  ldvt = round_up(p.S + 32, 16);
  const int64_t qrows = p.B * p.H * p.L, kvs = p.B * p.Hkv;
  q = OperandBuffer(size_t(qrows * E2) * sizeof(uint16_t), false);  // every row written below
  // k and vt: their padding is zeroed below, with the keys' pass (every
  // other element is written there).
  k = OperandBuffer(size_t(kvs * krows * E2 * elem()), false);
  vt = OperandBuffer(size_t(kvs * Evr * ldvt * elem()), false);
  qbad.assign(size_t(qrows), 0);
  bad_keys.assign(size_t(kvs * p.S), 0);

  // q: bits per row, a bad row zeros. The rows are read in the order they
  // lie in memory: the heads of a query one after the other where the
  // projections wrote them so (the multi-head layer's packed q | k | v rows,
  // where one head's rows are 3·D floats apart; the rounding of q, k and v
  // was about 8% of the bfloat16 layer's forward in a profile on Zen 4, and
  // this order took 1-2% off the forward).
  const bool heads_inner = std::abs(a.q.strides[1]) < std::abs(a.q.strides[2]);
#pragma omp parallel for num_threads(p.threads) schedule(static)
  for (int64_t n = 0; n < qrows; ++n) {
    const int64_t b = n / (p.L * p.H), i = heads_inner ? n / p.H % p.L : n % p.L,
                  h = heads_inner ? n % p.H : n / p.L % p.H, u = (b * p.H + h) * p.L + i;
    uint16_t* row = q.as<uint16_t>() + u * E2;
    const bool bad = operand_row(&a.q(b, h, i, 0), a.q.strides[3], p.E, row);
    std::fill(row + (bad ? 0 : p.E), row + E2, uint16_t(0));
    qbad[size_t(u)] = bad;
  }

  // k rows and vt columns, a block of keys at a time.
  const int64_t nblk = ceil_div(p.S, kKeyBlock);
  bool any = false;
#pragma omp parallel for num_threads(p.threads) schedule(static) reduction(|| : any)
  for (int64_t u = 0; u < kvs * nblk; ++u) {
    const int64_t kv = u / nblk, j0 = (u % nblk) * kKeyBlock, j1 = std::min(p.S, j0 + kKeyBlock);
    uint8_t* bad = bad_keys.data() + kv * p.S;
    if (j0 == 0) {  // the head's padding: k's rows past S, vt's rows past Ev and columns past S
      const int64_t es = elem();
      std::byte* kp = k.get() + (kv * krows + p.S) * E2 * es;
      std::fill(kp, kp + (krows - p.S) * E2 * es, std::byte(0));
      std::byte* vp = vt.get() + kv * Evr * ldvt * es;
      for (int64_t e = 0; e < p.Ev; ++e) std::fill(vp + (e * ldvt + p.S) * es, vp + (e + 1) * ldvt * es, std::byte(0));
      std::fill(vp + p.Ev * ldvt * es, vp + Evr * ldvt * es, std::byte(0));
    }
    const bool b = kern.a_float
                       ? pack_keys(p, a, kv / p.Hkv, kv % p.Hkv, j0, j1,
                                   reinterpret_cast<float*>(k.get()) + kv * krows * E2,
                                   reinterpret_cast<float*>(vt.get()) + kv * Evr * ldvt, E2, ldvt, bad)
                       : pack_keys(p, a, kv / p.Hkv, kv % p.Hkv, j0, j1,
                                   reinterpret_cast<uint16_t*>(k.get()) + kv * krows * E2,
                                   reinterpret_cast<uint16_t*>(vt.get()) + kv * Evr * ldvt, E2, ldvt, bad);
    any = any || b;
  }
  any_bad_keys = any;
}

namespace {

// dst[e·ldd + j] = src[j·lds + e] for e < ce, j < rj (transpose8), then
// zeros in dst's columns [rj, ldd) of those rows and in its whole rows
// [ce, cp).
void transposed_bits(const uint16_t* src, int64_t lds, int64_t rj, int64_t ce, int64_t cp, uint16_t* dst,
                     int64_t ldd) {
  transpose8(src, lds, rj, ce, dst, ldd);
  for (int64_t e = 0; e < ce; ++e) std::fill(dst + e * ldd + rj, dst + (e + 1) * ldd, uint16_t(0));
  std::fill(dst + ce * ldd, dst + cp * ldd, uint16_t(0));
}

}  // namespace

Bf16BackwardOperands::Bf16BackwardOperands(const Problem& p, const Bf16Operands& ops, View4<const float> dout,
                                           View4<const float> out, View3<const float> lse) {
  const Bf16Kernel& kern = ops.kernel;
  const int64_t es = ops.elem(), E2 = ops.E2, Evr = ops.Evr, BH = p.B * p.H;
  ldq = p.L + 32, Er = round_up(p.E, kern.mpad), Ev2 = round_up(p.Ev, kern.kpad);
  // Bits are written whole, padding included (q's rows are copies of ops.q's,
  // the transposed ones come through transpose8); the portable path's
  // float32 elements are put one at a time into zeroed buffers.
  const bool bits = !kern.a_float;
  q = OperandBuffer(size_t((BH * p.L + 16) * E2 * es), !bits);
  qt = OperandBuffer(size_t(BH * Er * ldq * es), !bits);
  dy = OperandBuffer(size_t((BH * p.L + 16) * Ev2 * es), !bits);
  dyt = OperandBuffer(size_t(BH * Evr * ldq * es), !bits);
  if (bits) {  // the rows past the last head
    std::fill(q.as<uint16_t>() + BH * p.L * E2, q.as<uint16_t>() + (BH * p.L + 16) * E2, uint16_t(0));
    std::fill(dy.as<uint16_t>() + BH * p.L * Ev2, dy.as<uint16_t>() + (BH * p.L + 16) * Ev2, uint16_t(0));
  }
  D.assign(size_t(BH * p.L), 0.0f);
  poisoned.assign(size_t(BH * p.L), 0);
  const auto put = [&](std::byte* base, int64_t i, uint16_t v) { reinterpret_cast<float*>(base)[i] = bf16_value(v); };
#pragma omp parallel for num_threads(p.threads) schedule(static)
  for (int64_t bh = 0; bh < BH; ++bh) {
    const int64_t b = bh / p.H, h = bh % p.H;
    std::vector<uint16_t> dyr(size_t(p.L * p.Ev));  // the head's dY rows, rounded (zeros where poisoned)
    for (int64_t i = 0; i < p.L; ++i) {
      const int64_t row = bh * p.L + i;
      uint16_t* r = dyr.data() + i * p.Ev;
      // dY rounded; a bad row (NaN or ±∞ after rounding), a bad q or a NaN
      // lse poisons the row: its dY becomes zeros and D = 0.
      bool bad = ops.qbad[size_t(row)] || lse(b, h, i) != lse(b, h, i);
      bad = operand_row(&dout(b, h, i, 0), dout.strides[3], p.Ev, r) || bad;
      poisoned[size_t(row)] = bad;
      if (bad) {
        std::fill(r, r + p.Ev, uint16_t(0));
        continue;
      }
      float acc = 0;  // D_i = Σ_e dY_ie·Y_ie
      for (int64_t e = 0; e < p.Ev; ++e) acc += bf16_value(r[e]) * out(b, h, i, e);
      D[size_t(row)] = acc;
    }
    const uint16_t* qh = ops.q_row(p, b, h, 0);  // the head's L rows of E2, adjacent
    if (bits) {
      std::memcpy(q.as<uint16_t>() + bh * p.L * E2, qh, size_t(p.L * E2) * sizeof(uint16_t));
      transposed_bits(qh, E2, p.L, p.E, Er, qt.as<uint16_t>() + bh * Er * ldq, ldq);
      uint16_t* d = dy.as<uint16_t>() + bh * p.L * Ev2;
      for (int64_t i = 0; i < p.L; ++i) {
        std::copy_n(dyr.data() + i * p.Ev, p.Ev, d + i * Ev2);
        std::fill(d + i * Ev2 + p.Ev, d + (i + 1) * Ev2, uint16_t(0));
      }
      transposed_bits(dyr.data(), p.Ev, p.L, p.Ev, Evr, dyt.as<uint16_t>() + bh * Evr * ldq, ldq);
      continue;
    }
    std::byte* qtb = qt.get() + bh * Er * ldq * es;
    std::byte* dytb = dyt.get() + bh * Evr * ldq * es;
    for (int64_t i = 0; i < p.L; ++i) {
      const int64_t row = bh * p.L + i;
      for (int64_t e = 0; e < p.E; ++e)
        put(q.get(), row * E2 + e, qh[i * E2 + e]), put(qtb, e * ldq + i, qh[i * E2 + e]);
      for (int64_t e = 0; e < p.Ev; ++e) {
        put(dy.get(), row * Ev2 + e, dyr[size_t(i * p.Ev + e)]);
        put(dytb, e * ldq + i, dyr[size_t(i * p.Ev + e)]);
      }
    }
  }
}

template <class T>
void fused_forward_bf16_tiled(const Problem& p, const SdpaArgs<T>& a, View4<float> out, View4<float> weights,
                              View3<float> lse, Bf16Path path, const FusedPlan& t) {
  Problem pb = p;
  pb.bf16_products = true;  // the scratch's bfloat16 layout
  const Bf16Operands ops(pb, a, bf16_kernel(path));
  fused_forward_bf16_ops(pb, ops, out, weights, lse, t);
}

template <class T>
void fused_forward_bf16(const Problem& p, const SdpaArgs<T>& a, View4<float> out, View4<float> weights,
                        View3<float> lse, Bf16Path path) {
  fused_forward_bf16_tiled(p, a, out, weights, lse, path, fused_plan_bf16(p, bf16_tile_path(path)));
}

template <class T>
void fused_backward_bf16_tiled(const Problem& p, const SdpaArgs<T>& a, View4<const float> dout,
                               const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse,
                               Bf16Path path, const FusedPlan& t) {
  Problem pb = p;
  pb.bf16_products = true;  // the scratch's bfloat16 layout
  const Bf16Operands ops(pb, a, bf16_kernel(path));
  // The saved state; recomputed by the bfloat16 forward when not given.
  const SavedState st(pb, out, lse, [&](View4<float> o, View3<float> l) {
    fused_forward_bf16_ops(pb, ops, o, {}, l, fused_plan_bf16(p, bf16_tile_path(path)));
  });
  const Bf16BackwardOperands qo(pb, ops, dout, st.out, st.lse);
  fused_backward_bf16_ops(pb, ops, qo, dout, g, st.out, st.lse, t);
}

template <class T>
void fused_backward_bf16(const Problem& p, const SdpaArgs<T>& a, View4<const float> dout,
                         const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse, Bf16Path path) {
  fused_backward_bf16_tiled(p, a, dout, g, out, lse, path, fused_backward_plan_bf16(p, bf16_tile_path(path)));
}

void bf16_gemm(Bf16Path path, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
               int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate) {
  const Bf16Kernel kern = bf16_kernel(path);
  const int64_t Mp = round_up(M, kern.mpad), Kp = round_up(K, kern.kpad), esize = kern.a_float ? 4 : 2;
  std::vector<std::byte> a(size_t(Mp * Kp * esize), std::byte{0});
  std::vector<uint32_t> b(size_t(Kp / 2 * N), 0u);
  std::vector<float> c(size_t(Mp * N), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t bits = bf16_operand(A[m * lda + k]);
      if (kern.a_float) reinterpret_cast<float*>(a.data())[m * Kp + k] = bf16_value(bits);
      else reinterpret_cast<uint16_t*>(a.data())[m * Kp + k] = bits;
    }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) b[size_t(k / 2 * N + n)] |= uint32_t(bf16_operand(B[k * ldb + n])) << (16 * (k % 2));
  for (int64_t m = 0; m < M; ++m) std::copy(C + m * ldc, C + m * ldc + N, c.data() + m * N);
  {
    const FlushToZero ftz;  // as in the kernels' parallel regions
    if (kern.thread_begin) kern.thread_begin();
    if (kern.gemm)
      kern.gemm(Mp, N, Kp, a.data(), Kp, b.data(), N, c.data(), N, alpha, accumulate);
    else
      bf16_portable_gemm(Mp, N, Kp, a.data(), Kp, b.data(), N, c.data(), N, alpha, accumulate);
    if (kern.thread_end) kern.thread_end();
  }
  for (int64_t m = 0; m < M; ++m) std::copy(c.data() + m * N, c.data() + (m + 1) * N, C + m * ldc);
}

#define ATTN_INSTANTIATE_BF16(T)                                                                                  \
  template Bf16Operands::Bf16Operands(const Problem&, const SdpaArgs<T>&, const Bf16Kernel&);                   \
  template void fused_forward_bf16<T>(const Problem&, const SdpaArgs<T>&, View4<float>, View4<float>, View3<float>, \
                                      Bf16Path);                                                                 \
  template void fused_forward_bf16_tiled<T>(const Problem&, const SdpaArgs<T>&, View4<float>, View4<float>,      \
                                            View3<float>, Bf16Path, const FusedPlan&);
ATTN_INSTANTIATE_BF16(float)
ATTN_INSTANTIATE_BF16(float16_t)
ATTN_INSTANTIATE_BF16(bfloat16_t)
#undef ATTN_INSTANTIATE_BF16
#define ATTN_INSTANTIATE_BF16_BACKWARD(T)                                                                          \
  template void fused_backward_bf16<T>(const Problem&, const SdpaArgs<T>&, View4<const float>,                   \
                                       const SdpaGrads<float>&, View4<const float>, View3<const float>, Bf16Path);  \
  template void fused_backward_bf16_tiled<T>(const Problem&, const SdpaArgs<T>&, View4<const float>,             \
                                             const SdpaGrads<float>&, View4<const float>, View3<const float>,    \
                                             Bf16Path, const FusedPlan&);
ATTN_INSTANTIATE_BF16_BACKWARD(float)
ATTN_INSTANTIATE_BF16_BACKWARD(bfloat16_t)
#undef ATTN_INSTANTIATE_BF16_BACKWARD

}  // namespace attn::detail
