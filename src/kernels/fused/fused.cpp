// The fused backend's per-target compilation and run-time dispatch.
//
// Highway's foreach_target.h re-includes this file once per SIMD target
// (AVX-512, AVX2, SSE4, portable EMU128; SSSE3 is disabled in
// cmake/attn_kernels.cmake), each time with a different HWY_NAMESPACE, so the
// bodies in simd-inl.h and attention-inl.h are compiled for each target.
// HWY_EXPORT collects the per-target entry points into tables, and the
// functions of fused.hpp pick the best one the CPU supports
// (HWY_DYNAMIC_DISPATCH). The plan and the scratch layouts are compiled once
// (tiles.cpp).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused/fused.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// Must come after foreach_target.h.
#include <hwy/highway.h>

#include <algorithm>

#include "attn/tensor.hpp"
#include "kernels/fused/attention-inl.h"
#include "kernels/fused/bf16-inl.h"
#include "kernels/fused/bf16.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/fused/packed-inl.h"
#include "kernels/fused/simd-inl.h"
#include "kernels/fused/tiles.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

const char* TargetNameImpl() { return hwy::TargetName(HWY_TARGET); }
int64_t LanesImpl() { return Lanes(); }

void GemmImpl(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B,
              int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  Gemm(M, N, K, A, ars, aks, B, ldb, C, ldc, accumulate);
}

// max |x[i]| over i < n bfloat16 bits, NaN left out: the largest magnitude
// bits (x & 0x7FFF, ordered as the values are) not above ∞'s.
uint16_t MaxAbsBitsImpl(const uint16_t* x, int64_t n) {
  const hn::ScalableTag<int16_t> d;
  const int64_t N = int64_t(hn::Lanes(d));
  const auto mag = hn::Set(d, int16_t(0x7FFF)), inf = hn::Set(d, int16_t(0x7F80));
  const auto* xi = reinterpret_cast<const int16_t*>(x);
  auto m = hn::Zero(d);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto a = hn::And(hn::LoadU(d, xi + i), mag);
    m = hn::Max(m, hn::IfThenZeroElse(hn::Gt(a, inf), a));
  }
  uint16_t r = uint16_t(hn::GetLane(hn::MaxOfLanes(d, m)));
  for (; i < n; ++i) {
    const uint16_t a = x[i] & 0x7FFFu;
    if (a <= 0x7F80u && a > r) r = a;
  }
  return r;
}

// bf16_operand_bits_row: per 16-bit lane, a zero exponent keeps only the
// sign, a NaN (magnitude above ∞'s bits) gets its quiet bit.
bool OperandBitsImpl(const uint16_t* x, int64_t n, uint16_t* dst) {
  const hn::ScalableTag<int16_t> d;
  const int64_t N = int64_t(hn::Lanes(d));
  const auto expo = hn::Set(d, int16_t(0x7F80)), mag = hn::Set(d, int16_t(0x7FFF));
  const auto sign = hn::Set(d, int16_t(-0x8000)), quiet = hn::Set(d, int16_t(0x0040));
  auto bad = hn::Zero(d);
  const auto one = [&](hn::Vec<decltype(d)> v) {
    const auto e = hn::And(v, expo);
    v = hn::IfThenElse(hn::Eq(e, hn::Zero(d)), hn::And(v, sign), v);
    v = hn::IfThenElse(hn::Gt(hn::And(v, mag), expo), hn::Or(v, quiet), v);  // (the magnitude is >= 0 as int16)
    bad = hn::Or(bad, hn::VecFromMask(d, hn::Eq(e, expo)));
    return v;
  };
  const auto* xi = reinterpret_cast<const int16_t*>(x);
  auto* di = reinterpret_cast<int16_t*>(dst);
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(one(hn::LoadU(d, xi + i)), d, di + i);
  if (i < n) {
    HWY_ALIGN int16_t buf[64] = {};  // >= the lane count of any target
    std::copy(xi + i, xi + n, buf);
    hn::Store(one(hn::Load(d, buf)), d, buf);
    std::copy(buf, buf + (n - i), di + i);
  }
  return !hn::AllTrue(d, hn::Eq(bad, hn::Zero(d)));
}

// max |x[i]| over i < n, NaN left out (0 for none), four vectors at a time.
float MaxAbsImpl(const float* x, int64_t n) {
  const DF d;
  const int64_t N = Lanes();
  const auto abs = [&](VF v) { return hn::IfThenZeroElse(hn::IsNaN(v), hn::Abs(v)); };
  VF m[4] = {hn::Zero(d), hn::Zero(d), hn::Zero(d), hn::Zero(d)};
  int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N)
    for (int c = 0; c < 4; ++c) m[c] = hn::Max(m[c], abs(hn::LoadU(d, x + i + c * N)));
  for (; i + N <= n; i += N) m[0] = hn::Max(m[0], abs(hn::LoadU(d, x + i)));
  float r = hn::GetLane(hn::MaxOfLanes(d, hn::Max(hn::Max(m[0], m[1]), hn::Max(m[2], m[3]))));
  for (; i < n; ++i) r = std::fabs(x[i]) > r ? std::fabs(x[i]) : r;  // (NaN: not greater)
  return r;
}

// x[0, n) rounded to bfloat16 operands (bf16_operand) at dst: RoundRow's
// whole vectors (with cvt, 32 at a time by AVX512_BF16's instruction), then
// the tail; whether one is ±∞ or NaN.
bool RoundRowBf16Impl(const float* x, int64_t n, uint16_t* dst, bool cvt) {
  const int64_t whole = n / Lanes() * Lanes();
  bool bad = RoundRow(x, whole, false, reinterpret_cast<std::byte*>(dst), cvt);
  for (int64_t j = whole; j < n; ++j) {
    dst[j] = bf16_operand(x[j]);
    bad = bad || (dst[j] & 0x7F80u) == 0x7F80u;
  }
  return bad;
}

// dst[(r/2)·ldd + j] = the pair (x[r][j], x[r + 1][j]) for even r < rows and
// j < n (x[r] = src + r·lds; past the last row: zeros), rounded to bfloat16
// operands, the first in the low half (bf16.hpp's pair layout). cvt:
// CvtPairs.
void PairRowsBf16Impl(const float* HWY_RESTRICT src, int64_t lds, int64_t rows, int64_t n,
                      uint32_t* HWY_RESTRICT dst, int64_t ldd, bool cvt) {
  const DF d;
  const DU du;
  const VU high = hn::Set(du, 0xFFFF0000u);
  for (int64_t r = 0; r < rows; r += 2) {
    const float* lo = src + r * lds;
    const float* hi = r + 1 < rows ? lo + lds : nullptr;
    uint32_t* out = dst + r / 2 * ldd;
    int64_t j = 0;
    if (kCvtPairs && cvt)
      for (; j + Lanes() <= n; j += Lanes())
        hn::StoreU(CvtPairs(hn::LoadU(d, lo + j), hi ? hn::LoadU(d, hi + j) : hn::Zero(d)), du, out + j);
    for (; j + Lanes() <= n; j += Lanes()) {
      const VU l = hn::ShiftRight<16>(RoundToBf16High(hn::LoadU(d, lo + j)));
      const VU h = hi ? hn::And(RoundToBf16High(hn::LoadU(d, hi + j)), high) : hn::Zero(du);
      hn::StoreU(hn::Or(l, h), du, out + j);
    }
    for (; j < n; ++j) out[j] = uint32_t(bf16_operand(lo[j])) | (hi ? uint32_t(bf16_operand(hi[j])) << 16 : 0u);
  }
}

void ExpPairsImpl(const float* st, int64_t ld, int64_t nk, int64_t K, int64_t nrp, const float* shift, float* tsum,
                  uint32_t* pp, bool cvt) {
  ForColumnGroups<ExpPairsOp>(nrp / Lanes(), Lanes(), st, ld, nk, K, shift, tsum, pp, cvt, 1.0f);
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

HWY_EXPORT(ForwardImpl);
HWY_EXPORT(ForwardBf16Impl);
HWY_EXPORT(BackwardBf16Impl);
HWY_EXPORT(PortableBf16Gemm);
HWY_EXPORT(BackwardImpl);
HWY_EXPORT(ForwardPackedImpl);
HWY_EXPORT(BackwardPackedImpl);
HWY_EXPORT(ExpArray);
HWY_EXPORT(Exp2Array);
HWY_EXPORT(TanhArray);
HWY_EXPORT(TargetNameImpl);
HWY_EXPORT(LanesImpl);
HWY_EXPORT(GemmImpl);
HWY_EXPORT(RoundRowBf16Impl);
HWY_EXPORT(PairRowsBf16Impl);
HWY_EXPORT(MaxAbsImpl);
HWY_EXPORT(OperandBitsImpl);

bool bf16_operand_bits_row(const uint16_t* x, int64_t n, uint16_t* dst) {
  return HWY_DYNAMIC_DISPATCH(OperandBitsImpl)(x, n, dst);
}

float max_abs_row(const float* x, int64_t n) { return HWY_DYNAMIC_DISPATCH(MaxAbsImpl)(x, n); }
HWY_EXPORT(MaxAbsBitsImpl);
float max_abs_row(const bfloat16_t* x, int64_t n) {
  return bf16_value(HWY_DYNAMIC_DISPATCH(MaxAbsBitsImpl)(reinterpret_cast<const uint16_t*>(x), n));
}

bool bf16_round_row(const float* x, int64_t n, uint16_t* dst, int cvt) {
  static const bool has = bf16_path_available(Bf16Path::avx512_bf16);
  return HWY_DYNAMIC_DISPATCH(RoundRowBf16Impl)(x, n, dst, cvt < 0 ? has : cvt > 0 && has);
}
void bf16_pair_rows(const float* src, int64_t lds, int64_t rows, int64_t n, uint32_t* dst, int64_t ldd, int cvt) {
  static const bool has = bf16_path_available(Bf16Path::avx512_bf16);
  HWY_DYNAMIC_DISPATCH(PairRowsBf16Impl)(src, lds, rows, n, dst, ldd, cvt < 0 ? has : cvt > 0 && has);
}
HWY_EXPORT(ExpPairsImpl);

namespace {

// K and V copied dense once per call where the forward's units would
// otherwise gather the same strided rows many times: rows that are not
// adjacent (the heads of a (B, S, H, E) tensor seen as (B, H, S, E), the
// layout of torch's q.view(B, L, H, E).transpose(1, 2)) are packed per key
// tile, once for every query block and every query head of a kv head.
// Copied once, K and V take the in-place route of a dense call: the same
// products in the same order, so the same bits. On Zen 4 (2 threads,
// causal), strided K and V took 1.06-1.14× the dense inputs' time; the copy
// took 0.89-0.93× the strided call's at (1, 8, 2048-4096, 64-128), where
// they are packed 22-43 times, but 1.03-1.06× at (4, 8, 512, 64) and
// (8, 8, 768, 64), packed 6 and 8 times: hence kDenseKVPacks. Not where the
// copy would pass kDenseKVBytes (the tiles pack the rows then).
constexpr int64_t kDenseKVPacks = 16;
constexpr int64_t kDenseKVBytes = int64_t(256) << 20;

struct DenseKV {
  OperandBuffer k, v;
  SdpaArgs<float> args;
  bool used = false;
  DenseKV(const Problem& p, const SdpaArgs<float>& a, const FusedPlan& t) : args(a) {
    const bool k_dense = rows_adjacent(a.k), v_dense = rows_adjacent(a.v);
    const int64_t rows = p.B * p.Hkv * p.S;
    const int64_t packs = p.group() * ceil_div(std::max<int64_t>(p.L, 1), std::max<int64_t>(t.q_block, 1));
    const int64_t bytes = rows * ((k_dense ? 0 : p.E) + (v_dense ? 0 : p.Ev)) * int64_t(sizeof(float));
    if ((k_dense && v_dense) || packs < kDenseKVPacks || rows == 0 || bytes > kDenseKVBytes) return;
    used = true;
    if (!k_dense) k = OperandBuffer(size_t(rows * p.E) * sizeof(float), false);
    if (!v_dense) v = OperandBuffer(size_t(rows * p.Ev) * sizeof(float), false);
    const auto copy = [&](const View4<const float>& x, int64_t F, float* dst, int64_t r) {
      const int64_t j = r % p.S, h = r / p.S % p.Hkv, b = r / (p.S * p.Hkv);
      const float* src = &x(b, h, j, 0);
      if (x.strides[3] == 1) std::copy_n(src, F, dst + r * F);
      else
        for (int64_t f = 0; f < F; ++f) dst[r * F + f] = src[f * x.strides[3]];
    };
#pragma omp parallel for num_threads(std::max(p.threads, 1)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      if (!k_dense) copy(a.k, p.E, k.as<float>(), r);
      if (!v_dense) copy(a.v, p.Ev, v.as<float>(), r);
    }
    if (!k_dense) args.k = View4<const float>::bhnd(k.as<float>(), p.B, p.Hkv, p.S, p.E);
    if (!v_dense) args.v = View4<const float>::bhnd(v.as<float>(), p.B, p.Hkv, p.S, p.Ev);
  }
};

}  // namespace

void fused_forward_tiled(const Problem& p, const SdpaArgs<float>& a, View4<float> out,
                         View4<float> weights, View3<float> lse, const FusedPlan& t) {
  const DenseKV dense(p, a, t);
  HWY_DYNAMIC_DISPATCH(ForwardImpl)(p, dense.used ? dense.args : a, out, weights, lse, t);
}

void fused_forward_bf16_ops(const Problem& p, const Bf16Operands& ops, View4<float> out, View4<float> weights,
                            View3<float> lse, const FusedPlan& t) {
  HWY_DYNAMIC_DISPATCH(ForwardBf16Impl)(p, ops, out, weights, lse, t);
}

void fused_backward_bf16_ops(const Problem& p, const Bf16Operands& ops, const Bf16BackwardOperands& qo,
                             View4<const float> dout, const SdpaGrads<float>& g, View4<const float> out,
                             View3<const float> lse, const FusedPlan& t) {
  HWY_DYNAMIC_DISPATCH(BackwardBf16Impl)(p, ops, qo, dout, g, out, lse, t);
}

void bf16_portable_gemm(int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const uint32_t* B,
                        int64_t ldb, float* C, int64_t ldc, float alpha, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(PortableBf16Gemm)(M, N, K, A, lda, B, ldb, C, ldc, alpha, accumulate);
}

void fused_forward(const Problem& p, const SdpaArgs<float>& a, View4<float> out,
                   View4<float> weights, View3<float> lse) {
  fused_forward_tiled(p, a, out, weights, lse, fused_plan(p));
}

void fused_backward_tiled(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                          const SdpaGrads<float>& g, View4<const float> out,
                          View3<const float> lse, const FusedPlan& t) {
  // The saved state; recomputed by a forward pass when not given.
  const SavedState st(p, out, lse, [&](View4<float> o, View3<float> l) { fused_forward_tiled(p, a, o, {}, l, t); });
  HWY_DYNAMIC_DISPATCH(BackwardImpl)(p, a, dout, g, st.out, st.lse, t);
}

void fused_backward(const Problem& p, const SdpaArgs<float>& a, View4<const float> dout,
                    const SdpaGrads<float>& g, View4<const float> out, View3<const float> lse) {
  fused_backward_tiled(p, a, dout, g, out, lse, fused_plan(p));
}

namespace {
// The problem the plan of a packed batch is made for: the longest sequence's
// L and S, the sequences' count as B (so own_heads sees all their kv heads).
Problem packed_plan_problem(const std::vector<FusedSequence>& seqs) {
  Problem p = seqs.at(0).p;
  p.B = int64_t(seqs.size());
  for (const auto& s : seqs) p.L = std::max(p.L, s.p.L), p.S = std::max(p.S, s.p.S);
  return p;
}
}  // namespace

FusedPlan fused_packed_plan(const std::vector<FusedSequence>& seqs) {
  return fused_plan(packed_plan_problem(seqs));
}

Problem fused_packed_plan_problem(const std::vector<FusedSequence>& seqs) { return packed_plan_problem(seqs); }

void fused_forward_packed(const std::vector<FusedSequence>& seqs) {
  if (seqs.empty()) return;
  fused_forward_packed(seqs, packed_plan_problem(seqs));
}

void fused_forward_packed(const std::vector<FusedSequence>& seqs, const Problem& plan_p) {
  if (seqs.empty()) return;
  HWY_DYNAMIC_DISPATCH(ForwardPackedImpl)(seqs.data(), int64_t(seqs.size()), plan_p, fused_plan(plan_p));
}

void fused_backward_packed(const std::vector<FusedSequence>& seqs, View1<float> dsinks) {
  if (seqs.empty()) {
    for (int64_t h = 0; h < dsinks.dim(0); ++h) dsinks(h) = 0.0f;  // no row reaches a sink
    return;
  }
  const Problem p = packed_plan_problem(seqs);
  HWY_DYNAMIC_DISPATCH(BackwardPackedImpl)(seqs.data(), int64_t(seqs.size()), p, fused_plan(p), dsinks);
}

FusedScratchBytes fused_scratch_bytes(const Problem& p, const FusedPlan& t) {
  const int64_t lanes = HWY_DYNAMIC_DISPATCH(LanesImpl)();
  return {ForwardScratch(p, t, lanes, Alloc::no).bytes(), BackwardScratch(p, t, lanes, Alloc::no).bytes()};
}

const char* fused_target_name() { return HWY_DYNAMIC_DISPATCH(TargetNameImpl)(); }

void fused_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B,
                int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(GemmImpl)(M, N, K, A, ars, aks, B, ldb, C, ldc, accumulate);
}

void bf16_exp_pairs(const float* st, int64_t ld, int64_t nk, int64_t K, int64_t nrp, const float* shift, float* tsum,
                    uint32_t* pp, bool vcvtne2ps2bf16) {
  HWY_DYNAMIC_DISPATCH(ExpPairsImpl)(st, ld, nk, K, nrp, shift, tsum, pp, vcvtne2ps2bf16);
}

void fused_exp(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(ExpArray)(x, y, n); }

void fused_exp2(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(Exp2Array)(x, y, n); }

void fused_tanh(const float* x, float* y, int64_t n) { HWY_DYNAMIC_DISPATCH(TanhArray)(x, y, n); }

}  // namespace attn::detail
#endif  // HWY_ONCE
