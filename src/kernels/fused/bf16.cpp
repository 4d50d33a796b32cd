// The bfloat16 forward's operands, built once per call (bf16.hpp), and its
// entry points. Compiled once: the units run per SIMD target (fused.cpp,
// bf16-inl.h), the products on the chosen path (bf16_products.cpp).
#include "kernels/fused/bf16.hpp"

#include <algorithm>
#include <cstring>

#include "kernels/fused/common.hpp"

namespace attn::detail {

namespace {

// Whether operand bits are ±∞ or NaN.
bool non_finite_bits(uint16_t b) { return (b & 0x7F80u) == 0x7F80u; }

// Writes operand bits as the path's A element (bits, or their float32 value).
void put(std::byte* base, int64_t index, uint16_t bits, bool as_float) {
  if (as_float) {
    const float x = bf16_value(bits);
    std::memcpy(base + index * 4, &x, 4);
  } else {
    std::memcpy(base + index * 2, &bits, 2);
  }
}

// Keys per work item of the key/value pass (a fixed split).
constexpr int64_t kKeyBlock = 64;

}  // namespace

template <class T>
Bf16Operands::Bf16Operands(const Problem& p, const SdpaArgs<T>& a, const Bf16Kernel& kern) : kernel(kern) {
  E2 = round_up(p.E, kern.kpad);
  Evr = round_up(p.Ev, kern.mpad);
  krows = p.S + 16;
  ldvt = round_up(p.S + 32, 16);
  const bool as_float = kern.a_float;
  const int64_t qrows = p.B * p.H * p.L, kvs = p.B * p.Hkv;
  q = hwy::AllocateAligned<uint16_t>(size_t(std::max<int64_t>(qrows * E2, 1)));
  k = hwy::AllocateAligned<std::byte>(size_t(std::max<int64_t>(kvs * krows * E2 * elem(), 1)));
  vt = hwy::AllocateAligned<std::byte>(size_t(std::max<int64_t>(kvs * Evr * ldvt * elem(), 1)));
  qbad.assign(size_t(qrows), 0);
  bad_keys.assign(size_t(kvs * p.S), 0);
  std::memset(k.get(), 0, size_t(kvs * krows * E2 * elem()));
  std::memset(vt.get(), 0, size_t(kvs * Evr * ldvt * elem()));

  // q: bits per row, a bad row zeros.
#pragma omp parallel for num_threads(p.threads) schedule(static)
  for (int64_t u = 0; u < qrows; ++u) {
    const int64_t i = u % p.L, h = (u / p.L) % p.H, b = u / (p.L * p.H);
    uint16_t* row = q.get() + u * E2;
    bool bad = false;
    for (int64_t e = 0; e < p.E; ++e) {
      row[e] = bf16_operand(float(a.q(b, h, i, e)));
      bad = bad || non_finite_bits(row[e]);
    }
    std::fill(row + (bad ? 0 : p.E), row + E2, uint16_t(0));
    qbad[size_t(u)] = bad;
  }

  // k rows and vt columns, key by key; a bad key (in K or V) stays zero.
  const int64_t nblk = ceil_div(p.S, kKeyBlock);
  bool any = false;
#pragma omp parallel for num_threads(p.threads) schedule(static) reduction(|| : any)
  for (int64_t u = 0; u < kvs * nblk; ++u) {
    const int64_t kv = u / nblk, hk = kv % p.Hkv, b = kv / p.Hkv;
    std::vector<uint16_t> kr(size_t(p.E)), vr(size_t(p.Ev));
    std::byte* kbase = k.get() + kv * krows * E2 * elem();
    std::byte* vbase = vt.get() + kv * Evr * ldvt * elem();
    for (int64_t j = (u % nblk) * kKeyBlock; j < std::min(p.S, (u % nblk + 1) * kKeyBlock); ++j) {
      bool bad = false;
      for (int64_t e = 0; e < p.E; ++e) kr[size_t(e)] = bf16_operand(float(a.k(b, hk, j, e)));
      for (int64_t e = 0; e < p.Ev; ++e) vr[size_t(e)] = bf16_operand(float(a.v(b, hk, j, e)));
      for (uint16_t x : kr) bad = bad || non_finite_bits(x);
      for (uint16_t x : vr) bad = bad || non_finite_bits(x);
      bad_keys[size_t(kv * p.S + j)] = bad;
      any = any || bad;
      if (bad) continue;
      for (int64_t e = 0; e < p.E; ++e) put(kbase, j * E2 + e, kr[size_t(e)], as_float);
      for (int64_t e = 0; e < p.Ev; ++e) put(vbase, e * ldvt + j, vr[size_t(e)], as_float);
    }
  }
  any_bad_keys = any;
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
  fused_forward_bf16_tiled(p, a, out, weights, lse, path, fused_plan(p));
}

void bf16_gemm(Bf16Path path, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
               int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate) {
  const Bf16Kernel kern = bf16_kernel(path);
  const int64_t Mp = round_up(M, kern.mpad), Kp = round_up(K, kern.kpad), esize = kern.a_float ? 4 : 2;
  std::vector<std::byte> a(size_t(Mp * Kp * esize), std::byte{0});
  std::vector<uint32_t> b(size_t(Kp / 2 * N), 0u);
  std::vector<float> c(size_t(Mp * N), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) put(a.data(), m * Kp + k, bf16_operand(A[m * lda + k]), kern.a_float);
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

}  // namespace attn::detail
