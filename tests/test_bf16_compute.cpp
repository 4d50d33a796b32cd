// bfloat16 compute (SdpaOptions::compute_dtype, kernels/fused/bf16.hpp).
//
// The block products on every path this machine runs (portable, the AMX
// code on emulated tiles, and AVX512_BF16 / native AMX where the CPU has
// them) against plain loops of the documented instruction semantics, bit
// for bit. The forward on each path against the exact attention of the
// bfloat16-rounded q, k, v (the reference backend in double) within the
// bound of docs/fused.md:
//
//   |y − ŷ| ≤ 2^-8 · Σ_j w_ij |v̂_j|          P rounded to bfloat16 (relative 2^-8 each)
//           + 2 δs · max_j |v̂_j|              the scores' float32 sums, δs ≤ (E + 16)·2^-24·m
//           + (S + 16) · 2^-24 · max_j |v̂_j|  float32 sums of P·V, exponentials
//
// (w: the exact weights of the rounded operands, m: the largest magnitude a
// score's terms reach: scale·Σ_e |q̂_e k̂_e| + |ALiBi| + |bias|); with one
// key tile the reference also rounds P and the bound shrinks to a few
// rounding flips. Native paths equal the portable one bitwise (the AMX
// emulation differs only in the order of the pair's two products); any
// thread count gives the same bits; fully masked rows, NaN, the option's
// validation and defaults. The backward with bfloat16 products on every
// path against a double reference with the same roundings and against the
// exact gradients (the bounds: backward_reference below), the same checks
// of bits, threads, masked rows and NaN, and the public call.
#include <gtest/gtest.h>

#include <hwy/aligned_allocator.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "kernels/fused/bf16.hpp"
#include "kernels/fused/common.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/problem.hpp"
#include "bf16_reference.hpp"
#include "sdpa_case.hpp"
#include "simd_targets.hpp"
#include "validate.hpp"

namespace {

using namespace attn;
using namespace attn::testing;
using detail::Bf16Path;

// ---- the operands' rounding and the block products ----------------------------

TEST(Bf16Operands, RoundToNearestEvenFlushSubnormalsKeepNaN) {
  EXPECT_EQ(detail::bf16_operand(1.0f), 0x3F80);
  EXPECT_EQ(detail::bf16_operand(1.0f + 0x1p-8f), 0x3F80);       // a tie: to the even neighbour (down)
  EXPECT_EQ(detail::bf16_operand(1.0f + 3 * 0x1p-8f), 0x3F82);   // ... and up
  EXPECT_EQ(detail::bf16_operand(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);  // above the tie: up
  EXPECT_EQ(detail::bf16_operand(-0x1p-127f), 0x8000);           // a subnormal: signed zero
  EXPECT_EQ(detail::bf16_operand(0x1p-126f), 0x0080);            // the smallest normal stays
  EXPECT_EQ(detail::bf16_operand(3.4e38f), 0x7F80);              // beyond bfloat16's range: +inf
  EXPECT_TRUE(std::isnan(detail::bf16_value(detail::bf16_operand(kNaNf))));
}

// bfloat16 inputs as operands, every bit pattern, on every compiled target
// this CPU runs: bf16_operand's bits for their float32 values, and the flag
// for ±∞ and NaN; lengths that leave a tail.
TEST(Bf16Operands, BfloatInputsTakeTheOperandBitsOfTheirValues) {
  std::vector<uint16_t> all(65536), got(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i);
  const std::string names = for_each_target([&](int64_t) {
    for (const int64_t n : {int64_t(65536), int64_t(1), int64_t(37)})
      for (int64_t start = 0; start + n <= 65536; start += n == 65536 ? n : 4093) {
        const bool bad = detail::bf16_operand_bits_row(all.data() + start, n, got.data());
        bool want_bad = false;
        for (int64_t i = 0; i < n; ++i) {
          const uint16_t x = all[size_t(start + i)];
          want_bad = want_bad || (x & 0x7F80u) == 0x7F80u;
          ASSERT_EQ(got[size_t(i)], detail::bf16_operand(detail::bf16_value(x))) << x;
        }
        ASSERT_EQ(bad, want_bad) << start << " " << n;
      }
  });
  std::printf("bfloat16 input operands, targets run: %s\n", names.c_str());
}

// C = alpha·(A·B) or C += A·B with the instructions' documented order per
// pair: VDPBF16PS adds the odd element's product first, TDPBF16PS the even's
// (Intel SDM); each a float32 fused multiply-add (the products are exact).
void pair_loop(bool odd_first, int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* C,
               float alpha, bool accumulate) {
  const detail::FlushToZero ftz;  // as the kernels run
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = accumulate ? C[m * N + n] : 0.0f;
      for (int64_t k = 0; k < K; k += 2) {
        const float a0 = float(rounded(A[m * K + k])), b0 = float(rounded(B[k * N + n]));
        const float a1 = k + 1 < K ? float(rounded(A[m * K + k + 1])) : 0.0f;
        const float b1 = k + 1 < K ? float(rounded(B[(k + 1) * N + n])) : 0.0f;
        if (odd_first) acc = std::fma(a0, b0, std::fma(a1, b1, acc));
        else acc = std::fma(a1, b1, std::fma(a0, b0, acc));
      }
      C[m * N + n] = accumulate ? acc : acc * alpha;
    }
}

TEST(Bf16Gemm, EveryPathIsItsInstructionsDocumentedArithmetic) {
  std::mt19937_64 rng(5);
  for (Bf16Path path : runnable_paths())
    for (int64_t M : {1, 5, 16, 17, 33, 40})
      for (int64_t N : {16, 32, 48, 80})
        for (int64_t K : {1, 2, 7, 32, 64, 80, 130})
          for (bool accumulate : {false, true}) {
            const Tensor<float> A = random_tensor<float>({M, K}, rng), B = random_tensor<float>({K, N}, rng);
            const Tensor<float> C0 = random_tensor<float>({M, N}, rng);
            Tensor<float> got = C0, want = C0;
            const float alpha = 0.3f;
            detail::bf16_gemm(path, M, N, K, A.data(), K, B.data(), N, got.data(), N, alpha, accumulate);
            const bool amx = path == Bf16Path::amx || path == Bf16Path::amx_emulated;
            pair_loop(!amx, M, N, K, A.data(), B.data(), want.data(), alpha, accumulate);
            // (The native tiles round inside an instruction differently from
            // the SDM's pseudocode, docs/fused.md: only the bound holds them.)
            if (path != Bf16Path::amx) {
              ASSERT_TRUE(same_bits(got, want)) << detail::bf16_path_name(path) << " M=" << M << " N=" << N
                                                << " K=" << K << " accumulate=" << accumulate;
            }
            // And the arithmetic itself: the exact product of the rounded
            // operands within float32's accumulation bound, K·2^-24·Σ|a·b|.
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = 0; n < N; ++n) {
                double exact = 0, mag = accumulate ? std::abs(C0[size_t(m * N + n)]) : 0.0;
                for (int64_t k = 0; k < K; ++k) {
                  exact += rounded(A[size_t(m * K + k)]) * rounded(B[size_t(k * N + n)]);
                  mag += std::abs(rounded(A[size_t(m * K + k)]) * rounded(B[size_t(k * N + n)]));
                }
                exact = accumulate ? exact + C0[size_t(m * N + n)] : exact * alpha;
                ASSERT_NEAR(got[size_t(m * N + n)], exact, (K + 2) * kF * mag + 1e-30) << m << " " << n;
              }
          }
}

// A path's own conversion of the probabilities into pairs (VCVTNE2PS2BF16)
// is bf16_operand's, including ties, subnormals, NaN, and the rows past nk.
TEST(Bf16Gemm, ProbabilityPairsRoundAsOperands) {
  const float specials[] = {0.0f, 1.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 0x1p-127f, 0x1p-126f, 0.3f, kNaNf};
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (Bf16Path path : runnable_paths()) {
    const detail::Bf16Kernel kern = detail::bf16_kernel(path);
    if (!kern.pairs) continue;
    for (int64_t nrp : {8, 16, 24, 48})
      for (int64_t nk : {1, 2, 5, 32})
        for (int64_t K : {nk + nk % 2, int64_t(32)}) {
          const int64_t ld = 48;
          std::vector<float> st(size_t(nk * ld));
          for (size_t i = 0; i < st.size(); ++i) st[i] = i % 5 == 0 ? specials[(i / 5) % 8] : unit(rng);
          std::vector<uint32_t> pp(size_t(K / 2 * ld), 0xDEADBEEFu);
          kern.pairs(st.data(), ld, nk, K, nrp, pp.data());
          for (int64_t k = 0; k < K / 2; ++k)
            for (int64_t r = 0; r < nrp; ++r) {
              const uint32_t lo = 2 * k < nk ? detail::bf16_operand(st[size_t(2 * k * ld + r)]) : 0u;
              const uint32_t hi = 2 * k + 1 < nk ? detail::bf16_operand(st[size_t((2 * k + 1) * ld + r)]) : 0u;
              ASSERT_EQ(pp[size_t(k * ld + r)], lo | hi << 16)
                  << detail::bf16_path_name(path) << " nrp=" << nrp << " nk=" << nk << " k=" << k << " r=" << r;
            }
        }
  }
}

// The forward's one pass from scores to pairs (no dropout) gives what the
// exponentials (fused_exp2), a float32 sum in key order and the pairs'
// rounding (bf16_operand) give one after the other, bit for bit, on every
// compiled target: masked (−∞) and poisoned (NaN) scores, results that
// round to a subnormal, odd key counts, pairs of zeros up to K. Most
// vectors hold no special score (the pass's short rounding, for normal P),
// and every fourth row sits at its edge (s − shift from −126 up). Where
// the CPU has AVX512_BF16, its VCVTNE2PS2BF16 pairs too.
TEST(Bf16Gemm, ExponentialsGoStraightIntoThePairs) {
  std::vector<bool> cvts{false};
  if (detail::bf16_path_available(Bf16Path::avx512_bf16)) cvts.push_back(true);
  for (const bool cvt : cvts) {
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<float> score(-40.0f, 2.0f);
  const float specials[] = {-std::numeric_limits<float>::infinity(), kNaNf, -126.7f, -126.2f, -130.0f, 0.0f};
  const int64_t ld = 96;  // the kernel's loads and stores are aligned: tiles from the aligned allocator
  for_each_target([&](int64_t) {
    for (int64_t nrp : {16, 48, 96})
      for (int64_t nk : {1, 2, 5, 33, 144})
        for (int64_t K : {nk + nk % 2, (nk + 31) / 32 * 32}) {
          const size_t n = size_t(nk * ld);
          auto st = hwy::AllocateAligned<float>(n), shift = hwy::AllocateAligned<float>(size_t(ld));
          auto tsum = hwy::AllocateAligned<float>(size_t(ld));
          auto pp = hwy::AllocateAligned<uint32_t>(size_t(K / 2 * ld));
          for (int64_t r = 0; r < ld; ++r) shift[size_t(r)] = r % 5 == 0 ? 0.0f : score(rng) + 3.0f;
          for (size_t i = 0; i < n; ++i) {
            const float edge = shift[i % size_t(ld)] - 126.0f + 0.75f * float(i % 13) / 13.0f;
            st[i] = i % 97 == 3 ? specials[(i / 97) % 6] : (i / size_t(ld)) % 4 == 1 ? edge : score(rng);
          }
          std::fill(pp.get(), pp.get() + K / 2 * ld, 0xDEADBEEFu);
          std::vector<float> x(n), p(n);
          for (int64_t j = 0; j < nk; ++j)
            for (int64_t r = 0; r < ld; ++r) x[size_t(j * ld + r)] = st[size_t(j * ld + r)] - shift[size_t(r)];
          detail::fused_exp2(x.data(), p.data(), int64_t(n));
          detail::bf16_exp_pairs(st.get(), ld, nk, K, nrp, shift.get(), tsum.get(), pp.get(), cvt);
          const std::string at = "nrp=" + std::to_string(nrp) + " nk=" + std::to_string(nk) + " K=" + std::to_string(K) +
                                 (cvt ? " VCVTNE2PS2BF16" : "");
          for (int64_t r = 0; r < nrp; ++r) {
            float want = 0.0f;
            for (int64_t j = 0; j < nk; ++j) want += p[size_t(j * ld + r)];
            ASSERT_EQ(std::memcmp(&tsum[size_t(r)], &want, 4), 0) << at << " r=" << r << " sum " << tsum[size_t(r)]
                                                                 << " want " << want;
            for (int64_t k = 0; k < K / 2; ++k) {
              const uint32_t lo = 2 * k < nk ? detail::bf16_operand(p[size_t(2 * k * ld + r)]) : 0u;
              const uint32_t hi = 2 * k + 1 < nk ? detail::bf16_operand(p[size_t((2 * k + 1) * ld + r)]) : 0u;
              ASSERT_EQ(pp[size_t(k * ld + r)], lo | hi << 16) << at << " k=" << k << " r=" << r;
            }
          }
        }
  });
  }
}

// The bfloat16 forward's plan: fused_plan's promises (tiles.hpp), key tiles at
// least as long, its scratch within the budget for head sizes up to 256.
TEST(Bf16Compute, ItsPlanKeepsThePromises) {
  for (int64_t n : {1, 17, 81, 1030, 65536})
    for (int64_t e : {1, 64, 128, 256}) {
      detail::Problem p;
      p.B = p.H = p.Hkv = 1, p.L = p.S = n, p.E = p.Ev = e, p.bf16_products = true;
      const detail::FusedPlan t = detail::fused_plan_bf16(p), f = detail::fused_plan(p);
      EXPECT_EQ(t.q_block, f.q_block);
      // The AMX paths' plan: 192-query blocks from L = 2048, key tiles at
      // least as long as the other paths'.
      const detail::FusedPlan a = detail::fused_plan_bf16(p, true);
      EXPECT_EQ(a.q_block, n >= 2048 ? 192 : f.q_block) << n << " " << e;
      EXPECT_GE(a.k_block, t.k_block) << n << " " << e;
      for (const detail::FusedPlan& x : {t, a}) {
        EXPECT_EQ(x.k_block % detail::kRowMultiple, 0) << n << " " << e;
        EXPECT_GE(x.k_block, f.k_block);
        EXPECT_LE(x.k_block, (n + detail::kRowMultiple - 1) / detail::kRowMultiple * detail::kRowMultiple);
        for (int64_t lanes : {4, 8, 16})
          EXPECT_LE(detail::ForwardScratch(p, x, lanes, detail::Alloc::no).bytes(), detail::kScratchBudgetBytes)
              << n << " " << e << " " << lanes;
      }
      // The backward's: these blocks rounded up to whole pairs of rows and
      // keys and whole 16-row AMX tiles (multiples of 32).
      const detail::FusedPlan bw = detail::fused_backward_plan_bf16(p);
      EXPECT_TRUE(bw.q_block % 32 == 0 && bw.q_block >= t.q_block && bw.q_block < t.q_block + 32) << n << " " << e;
      EXPECT_TRUE(bw.k_block % 32 == 0 && bw.k_block >= t.k_block && bw.k_block < t.k_block + 32) << n << " " << e;
      EXPECT_EQ(bw.own_heads, t.own_heads);
      // On AMX tiles, heads of E + Ev >= 256 take the tile forward's key tiles.
      const detail::FusedPlan bt = detail::fused_backward_plan_bf16(p, true);
      EXPECT_EQ(bt.q_block, bw.q_block);
      EXPECT_EQ(bt.k_block, e >= 128 ? (a.k_block + 31) / 32 * 32 : bw.k_block) << n << " " << e;
    }
}

// ---- the forward against the rounded reference ----------------------------------

// The forward on one path, through the kernel's entry point.
Fwd forward_on(Bf16Path path, const SdpaArgs<float>& a, const SdpaOptions& opt, Tensor<float>* weights = nullptr) {
  const detail::Problem p = detail::make_problem(a, opt);
  Fwd r{Tensor<float>({p.B, p.H, p.L, p.Ev}), Tensor<float>({p.B, p.H, p.L})};
  if (weights) *weights = Tensor<float>({p.B, p.H, p.L, p.S});
  detail::fused_forward_bf16(p, a, r.out.view4(), weights ? weights->view4() : View4<float>{}, r.lse.view<3>(), path);
  return r;
}

// The cases: awkward lengths and head sizes, every rule, layouts, GQA.
std::vector<RandomSpec> forward_specs() {
  std::vector<RandomSpec> specs;
  RandomSpec s = shape_spec(1, 2, 1, 37, 53, 1, 1);
  specs.push_back(s);
  s = shape_spec(2, 2, 2, 29, 70, 7, 5);
  s.layout = Layout::strided, s.causal = true;
  specs.push_back(s);
  s = shape_spec(1, 3, 1, 130, 300, 64, 64);
  s.mask = 3;
  specs.push_back(s);
  s = shape_spec(2, 2, 1, 100, 97, 80, 48);
  s.layout = Layout::bnhd, s.causal = true, s.align = CausalAlign::bottom_right, s.key_lengths = true;
  specs.push_back(s);
  s = shape_spec(1, 2, 2, 65, 200, 128, 128);
  s.mask = 1;
  specs.push_back(s);
  s = shape_spec(1, 4, 2, 50, 161, 64, 16);
  s.softcap = 5.0, s.alibi = true, s.sinks = true;
  specs.push_back(s);
  s = shape_spec(1, 2, 1, 90, 190, 16, 24);
  s.layout = Layout::strided, s.mask = 2, s.window = {17, 5};
  specs.push_back(s);
  s = shape_spec(1, 2, 1, 3, 400, 40, 40);
  s.causal = true, s.align = CausalAlign::bottom_right, s.offset = 11, s.sinks = true;
  specs.push_back(s);
  for (size_t i = 0; i < specs.size(); ++i) specs[i].seed = 100 + i;
  return specs;
}

TEST(Bf16Compute, EveryPathMatchesTheRoundedReferenceWithinTheBound) {
  for (const RandomSpec& spec : forward_specs()) {
    const SdpaCase<float> c(spec);
    const Ref r = reference(c.args, c.opt);
    for (Bf16Path path : runnable_paths())
      EXPECT_TRUE(within_bound(forward_on(path, c.args, c.opt), r, spec.E, spec.softcap, false,
                               spec.str() + " on " + detail::bf16_path_name(path)));
  }
  // Random shapes and rules (variants included), on the best path and the portable one.
  std::mt19937_64 rng(7);
  for (uint64_t seed = 0; seed < 24; ++seed) {
    RandomSpec spec = random_spec(rng, 1000 + seed, 4e6);
    random_scale_and_variants(spec, rng, true);
    const SdpaCase<float> c(spec);
    const Ref r = reference(c.args, c.opt);
    for (Bf16Path path : {Bf16Path::portable, detail::bf16_best_path()})
      EXPECT_TRUE(within_bound(forward_on(path, c.args, c.opt), r, spec.E, spec.softcap, false,
                               spec.str() + " on " + detail::bf16_path_name(path)));
  }
}

// Against the exact float32 call on the unrounded inputs: the bound grows by
// what rounding q, k and v does to the scores and values.
TEST(Bf16Compute, TheExactFloat32CallIsWithinTheBoundOfTheInputsRounding) {
  for (const RandomSpec& spec : forward_specs()) {
    const SdpaCase<float> c(spec);
    Ref r = reference(c.args, c.opt);  // the weights and m of the rounded operands
    SdpaOptions exact = c.opt;
    exact.compute_dtype = Dtype::float32;
    const detail::Problem p = detail::make_problem(c.args, exact);
    Tensor<float> out({p.B, p.H, p.L, p.Ev}), lse({p.B, p.H, p.L});
    detail::fused_forward(p, c.args, out.view4(), {}, lse.view<3>());
    for (size_t i = 0; i < out.size(); ++i) r.out[i] = out[i];
    for (size_t i = 0; i < lse.size(); ++i) r.lse[i] = lse[i];
    for (Bf16Path path : {Bf16Path::portable, detail::bf16_best_path()})
      EXPECT_TRUE(within_bound(forward_on(path, c.args, c.opt), r, spec.E, spec.softcap, false,
                               spec.str() + " against float32 on " + detail::bf16_path_name(path), true));
  }
}

// Dropout (the reference drops the same entries; its weights, which the
// bound reads, are the dropped ones) and the weights output: exp(s − max)
// over the row's sum, within the scores' error of the exact weights.
TEST(Bf16Compute, DropoutAndTheWeightsOutput) {
  RandomSpec spec = shape_spec(2, 2, 1, 60, 130, 32, 24);
  spec.causal = true, spec.mask = 2, spec.seed = 31;
  SdpaCase<float> c(spec);
  c.opt.dropout_p = 0.2, c.opt.dropout_seed = 5;
  const Ref r = reference(c.args, c.opt);
  const double ds = (32 + 16) * kF * r.m;
  for (Bf16Path path : runnable_paths()) {
    Tensor<float> w;
    const Fwd f = forward_on(path, c.args, c.opt, &w);
    EXPECT_TRUE(within_bound(f, r, 32, 0, false, std::string("dropout on ") + detail::bf16_path_name(path)));
    double worst = 0;
    for (size_t i = 0; i < w.size(); ++i)
      worst = std::max(worst, std::abs(w[i] - r.w[i]) - (r.w[i] * (2 * ds + (130 + 16) * kF) + kF));
    EXPECT_LE(worst, 0.0) << detail::bf16_path_name(path);
  }
}

// With all keys in one tile the running maximum is the row's, so the kernel's
// P is 2^(s − max) rounded once: the reference rounds it too.
TEST(Bf16Compute, OneKeyTileRoundsPAsTheReference) {
  for (const RandomSpec& base : forward_specs()) {
    RandomSpec spec = base;
    spec.S = std::min<int64_t>(spec.S, 40);
    spec.key_lengths = false;
    spec.sinks = false;
    const SdpaCase<float> c(spec);
    ASSERT_GE(detail::fused_plan_bf16(detail::make_problem(c.args, c.opt)).k_block, spec.S);
    const Ref r = reference(c.args, c.opt);
    for (Bf16Path path : runnable_paths())
      EXPECT_TRUE(within_bound(forward_on(path, c.args, c.opt), r, spec.E, spec.softcap, true,
                               spec.str() + " on " + detail::bf16_path_name(path)));
  }
}

TEST(Bf16Compute, NativePathsGiveThePortableBitsAndAmxTheEmulatedValues) {
  for (const RandomSpec& spec : forward_specs()) {
    const SdpaCase<float> c(spec);
    const Fwd portable = forward_on(Bf16Path::portable, c.args, c.opt);
    const Fwd emulated = forward_on(Bf16Path::amx_emulated, c.args, c.opt);
    if (detail::bf16_path_available(Bf16Path::avx512_bf16)) {
      const Fwd dp = forward_on(Bf16Path::avx512_bf16, c.args, c.opt);
      EXPECT_TRUE(same_bits(dp.out, portable.out) && same_bits(dp.lse, portable.lse)) << spec.str();
    }
    // The AMX order of a pair's products differs from the portable one, and
    // the native tiles round inside one instruction differently again
    // (docs/fused.md): the same values up to float32 rounding and a rare
    // flip of P's rounding.
    const Ref r = reference(c.args, c.opt);
    double vmax = 0;
    for (size_t i = 0; i < r.v.size(); ++i) vmax = std::max(vmax, std::abs(r.v[i]));
    const double tol = 4 * 2 * kU * vmax + 4 * (spec.E + spec.S + 16) * kF * (1 + r.m) * vmax;
    EXPECT_TRUE(all_close(emulated.out, portable.out, tol, spec.str() + " emulated AMX vs portable"));
    if (detail::bf16_path_available(Bf16Path::amx)) {
      const Fwd amx = forward_on(Bf16Path::amx, c.args, c.opt);
      EXPECT_TRUE(all_close(amx.out, emulated.out, tol, spec.str() + " AMX vs emulated AMX"));
      EXPECT_TRUE(all_close(amx.lse, emulated.lse, 4 * (spec.E + 16) * kF * (1 + r.m), spec.str() + " AMX lse"));
    }
  }
}

// The unit and the portable products on every compiled SIMD target this CPU
// runs (their register tiles differ: 8 × 3 vectors with 32 registers, 4 × 2
// with 16): within the bound, and the native products give each target's
// portable bits.
TEST(Bf16Compute, EveryCompiledTargetKeepsTheBound) {
  const std::vector<RandomSpec> specs = forward_specs();
  std::vector<Ref> refs;
  for (const RandomSpec& spec : specs) {
    const SdpaCase<float> c(spec);
    refs.push_back(reference(c.args, c.opt));
  }
  const std::string names = for_each_target([&](int64_t) {
    for (size_t i = 0; i < specs.size(); ++i) {
      const SdpaCase<float> c(specs[i]);
      const Fwd portable = forward_on(Bf16Path::portable, c.args, c.opt);
      EXPECT_TRUE(within_bound(portable, refs[i], specs[i].E, specs[i].softcap, false, specs[i].str()));
      if (detail::bf16_path_available(Bf16Path::avx512_bf16)) {
        const Fwd dp = forward_on(Bf16Path::avx512_bf16, c.args, c.opt);
        EXPECT_TRUE(same_bits(dp.out, portable.out) && same_bits(dp.lse, portable.lse)) << specs[i].str();
      }
    }
  });
  std::printf("bfloat16 forward, targets run: %s\n", names.c_str());
}

TEST(Bf16Compute, AnyThreadCountGivesTheSameBits) {
  for (const RandomSpec& base : forward_specs()) {
    RandomSpec spec = base;
    spec.B = 2;
    spec.threads = 1;
    const SdpaCase<float> c(spec);
    for (Bf16Path path : {Bf16Path::portable, detail::bf16_best_path()}) {
      const Fwd one = forward_on(path, c.args, c.opt);
      for (int threads : {2, 3}) {
        SdpaOptions o = c.opt;
        o.num_threads = threads;
        const Fwd more = forward_on(path, c.args, o);
        EXPECT_TRUE(same_bits(one.out, more.out) && same_bits(one.lse, more.lse))
            << spec.str() << " " << threads << " threads on " << detail::bf16_path_name(path);
      }
    }
  }
}

// Long sequences on the AMX paths take 192-query blocks and key tiles of up
// to 384 (fused_plan_bf16): within the bound of the rounded reference, and
// the same bits for any thread count.
TEST(Bf16Compute, TheTilePathsLongSequencePlanKeepsTheBound) {
  RandomSpec spec = shape_spec(1, 2, 1, 2100, 800, 16, 8);
  spec.causal = true, spec.align = CausalAlign::bottom_right, spec.seed = 31;
  const SdpaCase<float> c(spec);
  const detail::FusedPlan t = detail::fused_plan_bf16(detail::make_problem(c.args, c.opt), true);
  ASSERT_EQ(t.q_block, 192);
  ASSERT_LT(t.k_block, spec.S);  // more than one key tile
  const Ref r = reference(c.args, c.opt);
  std::vector<Bf16Path> paths{Bf16Path::amx_emulated};
  if (detail::bf16_path_available(Bf16Path::amx)) paths.push_back(Bf16Path::amx);
  for (Bf16Path path : paths) {
    const Fwd one = forward_on(path, c.args, c.opt);
    EXPECT_TRUE(within_bound(one, r, spec.E, spec.softcap, false, spec.str() + " on " + detail::bf16_path_name(path)));
    SdpaOptions o = c.opt;
    o.num_threads = 3;
    const Fwd more = forward_on(path, c.args, o);
    EXPECT_TRUE(same_bits(one.out, more.out) && same_bits(one.lse, more.lse)) << detail::bf16_path_name(path);
  }
}

// ---- masked rows and non-finite inputs -------------------------------------------

TEST(Bf16Compute, FullyMaskedRowsAreZeroWithLseMinusInfinity) {
  RandomSpec spec = shape_spec(2, 2, 1, 40, 60, 16, 8);
  spec.mask = 1, spec.key_lengths = true, spec.seed = 3;
  const SdpaCase<float> c(spec);  // batch 0 sees no key; row 0 of the mask's slices none either
  for (Bf16Path path : runnable_paths()) {
    const Fwd f = forward_on(path, c.args, c.opt);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 40; ++i) {
        EXPECT_EQ(f.lse.view<3>()(0, h, i), -kInf);
        for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(f.out.view4()(0, h, i, e), 0.0f);
      }
    EXPECT_TRUE(all_finite(f.out)) << detail::bf16_path_name(path);
  }
}

// A non-finite (or beyond bfloat16's range) value put into one row of a
// tensor, in causal cases of this shape.
const CaseShape kPoisonShape{.B = 1, .H = 2, .Hkv = 1, .L = 50, .S = 50, .E = 16, .Ev = 16};
struct Poison {
  const char* tensor;
  int64_t row;
  float value;
};

// NaN or ±∞ in a row of q, k or v (or a float32 beyond bfloat16's range)
// poisons exactly the rows that see it; every other element keeps its bits.
TEST(Bf16Compute, NonFiniteInputsReachOnlyTheRowsThatSeeThem) {
  std::mt19937_64 rng(11);
  for (const Poison& x : {Poison{"q", 7, kNaNf}, Poison{"k", 20, kNaNf}, Poison{"v", 30, kInf},
                          Poison{"k", 45, 3.4e38f}, Poison{"q", 49, -kInf}})
    for (Bf16Path path : runnable_paths()) {
      SdpaCase<float> c(kPoisonShape, rng);
      c.opt.causal = true;
      const Fwd clean = forward_on(path, c.args, c.opt);
      Strided<float>& buf = x.tensor[0] == 'q' ? c.qbuf : x.tensor[0] == 'k' ? c.kbuf : c.vbuf;
      buf.view(0, 0, x.row, 3) = x.value;
      const Fwd f = forward_on(path, c.args, c.opt);
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < 50; ++i) {
          // A bad query poisons its own rows (head 0 only for q), a bad key the rows that see it.
          const bool hit = x.tensor[0] == 'q' ? (h == 0 && i == x.row) : i >= x.row;
          const std::string what = std::string(x.tensor) + " row " + std::to_string(x.row) + " h=" +
                                   std::to_string(h) + " i=" + std::to_string(i) + " " + detail::bf16_path_name(path);
          EXPECT_EQ(std::isnan(f.lse.view<3>()(0, h, i)), hit) << what;
          for (int64_t e = 0; e < 16; ++e) {
            const float got = f.out.view4()(0, h, i, e), want = clean.out.view4()(0, h, i, e);
            if (hit) EXPECT_TRUE(std::isnan(got)) << what;
            else EXPECT_EQ(std::memcmp(&got, &want, 4), 0) << what;
          }
        }
    }
}

// ---- the option: defaults, routing, validation ---------------------------------------

// q, k, v of a float32 case as bfloat16 (the float32 case holds the rounded values afterwards).
struct Bf16Inputs {
  std::vector<bfloat16_t> q, k, v;
  SdpaArgs<bfloat16_t> a;
  explicit Bf16Inputs(SdpaCase<float>& c) {
    const auto conv = [](Strided<float>& s, std::vector<bfloat16_t>& h, View4<const bfloat16_t>& view) {
      h.resize(s.size());
      for (size_t i = 0; i < s.size(); ++i) h[i] = bfloat16_t(s[i]), s[i] = float(h[i]);
      view = View4<const bfloat16_t>(h.data() + (s.view.data - s.data()), s.view.shape, s.view.strides);
    };
    conv(c.qbuf, q, a.q), conv(c.kbuf, k, a.k), conv(c.vbuf, v, a.v);
    static_cast<ScoreArgs<float>&>(a) = c.args;
    a.key_lengths = c.args.key_lengths;
  }
};

TEST(Bf16Compute, Bfloat16InputsUseItByDefaultFloat32InputsWhenAsked) {
  std::mt19937_64 rng(13);
  SdpaCase<float> c({.B = 1, .H = 2, .Hkv = 1, .L = 70, .S = 90, .E = 24, .Ev = 16, .layout = Layout::bnhd}, rng);
  c.opt.causal = true;
  const Bf16Inputs h(c);
  const Fwd best = forward_on(detail::bf16_best_path(), c.args, c.opt);
  // bfloat16 inputs: bfloat16 products unless compute_dtype says float32.
  const Fwd by_default = call(h.a, c.opt);
  EXPECT_TRUE(same_bits(by_default.out, best.out) && same_bits(by_default.lse, best.lse));
  SdpaOptions exact = c.opt;
  exact.compute_dtype = Dtype::float32;
  const Fwd f32 = call(c.args, c.opt);
  EXPECT_TRUE(same_bits(call(h.a, exact).out, f32.out));
  EXPECT_FALSE(same_bits(by_default.out, f32.out));
  // float32 inputs: exact by default, bfloat16 products when asked (also
  // from float16 inputs).
  SdpaOptions asked = c.opt;
  asked.compute_dtype = Dtype::bfloat16;
  EXPECT_TRUE(same_bits(call(c.args, asked).out, best.out));
  EXPECT_TRUE(same_bits(call(c.args, exact).out, f32.out));
  // float16 inputs holding the same (bfloat16) values: the same bits.
  std::vector<float16_t> q16, k16, v16;
  for (const auto& [from, to] : {std::pair{&c.qbuf, &q16}, {&c.kbuf, &k16}, {&c.vbuf, &v16}})
    for (size_t i = 0; i < from->size(); ++i) {
      to->push_back(float16_t(from->buf[i]));
      ASSERT_TRUE(float(to->back()) == from->buf[i] || std::isnan(from->buf[i]));  // exact in float16
    }
  SdpaArgs<float16_t> a16;
  const auto at = [](const std::vector<float16_t>& x, const Strided<float>& s) {
    return View4<const float16_t>(x.data() + (s.view.data - s.data()), s.view.shape, s.view.strides);
  };
  a16.q = at(q16, c.qbuf), a16.k = at(k16, c.kbuf), a16.v = at(v16, c.vbuf);
  EXPECT_TRUE(same_bits(call(a16, asked).out, best.out));
}

TEST(Bf16Compute, TheOptionIsValidated) {
  std::mt19937_64 rng(17);
  SdpaCase<float> c({.B = 1, .H = 1, .Hkv = 1, .L = 20, .S = 20, .E = 8, .Ev = 8}, rng);
  SdpaOptions o = c.opt;
  o.compute_dtype = Dtype::float16;
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { call(c.args, o); }, {"option 'compute_dtype' is float16"}));
  o.compute_dtype = Dtype::bfloat16;
  o.backend = Backend::reference;
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { call(c.args, o); }, {"option 'compute_dtype' is bfloat16", "reference"}));
  const Tensor<double> q = random_tensor<double>({1, 1, 20, 8}, rng);
  SdpaArgs<double> d;
  d.q = d.k = d.v = q.view4();
  Tensor<double> out({1, 1, 20, 8});
  o.backend = Backend::automatic;
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { scaled_dot_product_attention(d, {out.view4()}, o); },
                                           {"option 'compute_dtype' is bfloat16", "not double"}));
  // The reference backend stays exact for bfloat16 inputs by default.
  const Bf16Inputs h(c);
  SdpaOptions ref = c.opt;
  ref.backend = Backend::reference;
  EXPECT_TRUE(same_bits(call(h.a, ref).out, call(c.args, ref).out));
}

// ---- the backward with bfloat16 products ------------------------------------------

// Gradients of a call (through the public API), with or without the saved state.
struct Grads {
  Tensor<float> dq, dk, dv, dbias;
};
Grads zero_grads(const SdpaArgs<float>& a) {
  Grads g{Tensor<float>({a.q.dim(0), a.q.dim(1), a.q.dim(2), a.q.dim(3)}),
          Tensor<float>({a.k.dim(0), a.k.dim(1), a.k.dim(2), a.k.dim(3)}),
          Tensor<float>({a.v.dim(0), a.v.dim(1), a.v.dim(2), a.v.dim(3)}), {}};
  if (!a.bias.empty()) g.dbias = Tensor<float>({a.bias.dim(0), a.bias.dim(1), a.bias.dim(2), a.bias.dim(3)});
  return g;
}
template <class T>
Grads backward_of(const SdpaArgs<T>& a, const SdpaOptions& opt, const Tensor<float>& dout, const Fwd* saved) {
  Grads g{Tensor<float>({a.q.dim(0), a.q.dim(1), a.q.dim(2), a.q.dim(3)}),
          Tensor<float>({a.k.dim(0), a.k.dim(1), a.k.dim(2), a.k.dim(3)}),
          Tensor<float>({a.v.dim(0), a.v.dim(1), a.v.dim(2), a.v.dim(3)}), {}};
  SdpaSaved<float> s;
  if (saved) s = {saved->out.view4(), saved->lse.view<3>()};
  scaled_dot_product_attention_backward(a, dout.view4(), s, {g.dq.view4(), g.dk.view4(), g.dv.view4()}, opt);
  return g;
}
// The backward on one path, through the kernel's entry point, on the state
// of the forward on that path.
Grads backward_on(Bf16Path path, const SdpaArgs<float>& a, const SdpaOptions& opt, const Tensor<float>& dout,
                  const Fwd& state) {
  const detail::Problem p = detail::make_problem(a, opt);
  Grads g = zero_grads(a);
  detail::fused_backward_bf16(p, a, dout.view4(),
                              {g.dq.view4(), g.dk.view4(), g.dv.view4(), g.dbias.size() == 0 ? View4<float>{} : g.dbias.view4()},
                              state.out.view4(), state.lse.view<3>(), path);
  return g;
}
bool same_grads(const Grads& a, const Grads& b) {
  return same_bits(a.dq, b.dq) && same_bits(a.dk, b.dk) && same_bits(a.dv, b.dv) && (a.dbias.size() + b.dbias.size() == 0 || same_bits(a.dbias, b.dbias));
}

// What the gradients should be, and how far from it they may lie, per element.
struct BwdRef {
  Tensor<double> dq, dk, dv, dbias;  // the reference
  Tensor<double> tq, tk, tv, tbias;  // the tolerance
};

double bfr(double x) { return rounded(float(x)); }  // float32, then the operand's rounding
// How far the rounding of a value within d of x can land from x's rounding
// (the rounding is monotone: the ends of the interval bound it). Zero unless
// a rounding boundary lies within d of x.
double flip(double x, double d) {
  const double r = bfr(x);
  return std::max(std::abs(bfr(x - d) - r), std::abs(bfr(x + d) - r));
}

// The backward's reference in double, with its bound, on the kernel's saved
// state (out y, lse ℓ: the backward's inputs). With P the exact weights of
// the reference forward (dropout off) and m the keep factors,
//
// same_roundings: the arithmetic of the kernel on exact sums. q̂, k̂, v̂, dŶ
//   rounded; P_ij = W_ij·exp(lse*_i − ℓ_i) = exp(ŝ_ij − ℓ_i); dP = dŶ·v̂ᵀ;
//   D_i = dŶ_i·y_i; dS = P∘(dP∘m − D); dV = Σ bf(P∘m)ᵀ·dŶ, dQ = scale·bf(dS)·k̂,
//   dK = scale·bf(dS)ᵀ·q̂. The kernel's float32 values of P∘m and dS lie
//   within δ of these (u = 2^-24, M the largest magnitude of a score's terms):
//     δs  = (E + 16)·u·M + 2u·(|ℓ| + M)      the score's float32 sum, S − ℓ
//     δP  = P·(expm1(δs) + 16u)              and the exponential's few ulps
//     δdP = (Ev + 2)·u·Σ_e |dŶ v̂|,  δD = (Ev + 2)·u·Σ_e |dŶ y|
//     δdS = δP·(|dP|m + |D| + m·δdP + δD) + P·(m·δdP + δD) + 3u·(P + δP)·(...)
//   so their bfloat16 roundings differ from the reference's by at most
//   flip(x, δ), which is 0 unless a rounding boundary lies within δ. Each
//   gradient is a float32 sum of n such products (n = group·L for dK and dV,
//   S for dQ, each padded by at most 32 zeros): the tolerance is
//     Σ flip·|other operand| + (n + 34)·u·Σ |products| + 2u·|gradient|.
//   dbias (a bias given) is dS itself, summed in float32 over the axes the
//   bias broadcasts along (n terms): Σ δdS + (n + 2)·u·Σ |dS|.
// exact (same_roundings false): the gradients of the unrounded inputs
//   (P, y*, ℓ* of the exact forward); the kernel's values move by the
//   roundings (q̂·k̂ by (2^-7 + 2^-16)·|q||k|, v̂ and dŶ by 2^-8 relative,
//   bf(P∘m) and bf(dS) by 2^-8 relative), the forward's state by its own
//   measured error (|ℓ − ℓ*|, |y − y*|), and float32 as above; each bound is
//   propagated term by term to first order with exact expm1 for P.
BwdRef backward_reference(const SdpaArgs<float>& a, const SdpaOptions& opt, const Tensor<float>& dout,
                          const Fwd& st, bool same_roundings) {
  SdpaOptions no_drop = opt;
  no_drop.dropout_p = 0;
  const Ref r0 = reference(a, no_drop, same_roundings);
  const Ref rd = opt.dropout_p > 0 ? reference(a, opt, same_roundings) : r0;
  const Tensor<double> q = rounded_copy(a.q, same_roundings), k = rounded_copy(a.k, same_roundings);
  const Tensor<double> dy = rounded_copy(dout.view4(), same_roundings);
  const auto Q = q.view4(), K = k.view4(), V = r0.v.view4(), DY = dy.view4();
  const int64_t B = a.q.dim(0), H = a.q.dim(1), L = a.q.dim(2), E = a.q.dim(3), S = a.k.dim(2),
                Ev = a.v.dim(3), group = H / a.k.dim(1);
  const double u = kF, scale = opt.scale.value_or(1.0 / std::sqrt(double(E))), M = 1.01 * r0.m;
  BwdRef r;
  for (Tensor<double>* t : {&r.dq, &r.tq}) *t = Tensor<double>({B, H, L, E});
  for (Tensor<double>* t : {&r.dk, &r.tk}) *t = Tensor<double>({B, a.k.dim(1), S, E});
  for (Tensor<double>* t : {&r.dv, &r.tv}) *t = Tensor<double>({B, a.k.dim(1), S, Ev});
  // Σ |products| per element, for the float32 sums
  Tensor<double> aq({B, H, L, E}), ak({B, a.k.dim(1), S, E}), av({B, a.k.dim(1), S, Ev}), abias;
  const bool bias = !a.bias.empty() && same_roundings;
  if (bias) {
    for (Tensor<double>* t : {&r.dbias, &r.tbias, &abias})
      *t = Tensor<double>({a.bias.dim(0), a.bias.dim(1), a.bias.dim(2), a.bias.dim(3)});
  }
  // dbias(b, h, i, j) of the bias's (broadcast) shape
  const auto bias_at = [&](Tensor<double>& t, int64_t b, int64_t h, int64_t i, int64_t j) -> double& {
    const auto d = t.view4();
    return d(d.dim(0) == 1 ? 0 : b, d.dim(1) == 1 ? 0 : h, d.dim(2) == 1 ? 0 : i, d.dim(3) == 1 ? 0 : j);
  };
  const double w8 = kU, wqk = 2 * kU + kU * kU;  // bfloat16's relative rounding, of a product q̂·k̂
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        const int64_t hk = h / group;
        const double lk = st.lse.view<3>()(b, h, i), lref = r0.lse.view<3>()(b, h, i);
        if (lk == -INFINITY) continue;  // sees no key: no gradient (tested on its own)
        const double dl = same_roundings ? 0.0 : std::abs(lk - lref);
        const double ds_i = (E + 16) * u * M + 2 * u * (std::abs(lk) + M);
        double D = 0, AD = 0, eD = 0;
        for (int64_t e = 0; e < Ev; ++e) {
          const double yk = st.out.view4()(b, h, i, e);
          D += DY(b, h, i, e) * (same_roundings ? yk : rd.out.view4()(b, h, i, e));
          AD += std::abs(DY(b, h, i, e) * yk);
          if (!same_roundings)
            eD += std::abs(DY(b, h, i, e)) * (w8 * std::abs(yk) + std::abs(yk - rd.out.view4()(b, h, i, e)));
        }
        eD += (Ev + 2) * u * AD * (1 + w8);
        for (int64_t j = 0; j < S; ++j) {
          const double W = r0.w.view4()(b, h, i, j);
          if (W == 0) continue;
          const double m = rd.w.view4()(b, h, i, j) / W;  // the keep factor (1 without dropout)
          const double P = same_roundings ? W * std::exp(lref - lk) : W;
          double dP = 0, AdP = 0, qk = 0;
          for (int64_t e = 0; e < Ev; ++e) {
            dP += DY(b, h, i, e) * V(b, hk, j, e);
            AdP += std::abs(DY(b, h, i, e) * V(b, hk, j, e));
          }
          for (int64_t e = 0; !same_roundings && e < E; ++e) qk += std::abs(Q(b, h, i, e) * K(b, hk, j, e));
          const double es = same_roundings ? ds_i : scale * wqk * qk + ds_i + dl;
          const double eP = P * (std::expm1(es) + 16 * u * std::exp(es)) + 1e-37;
          const double edP = (same_roundings ? 0.0 : (wqk + w8) * AdP) + (Ev + 2) * u * AdP * (1 + w8);
          const double mag = std::abs(dP) * m + std::abs(D) + m * edP + eD;
          const double pm = P * m, dS = P * (dP * m - D);
          const double epm = m * eP + u * (pm + m * eP);
          const double edS = eP * mag + P * (m * edP + eD) + 3 * u * (P + eP) * mag;
          // The kernel's operands of the gradients' products and their error.
          double xpm, fpm, xdS, fdS;
          if (same_roundings) {
            xpm = bfr(pm), fpm = flip(pm, epm), xdS = bfr(dS), fdS = flip(dS, edS);
          } else {
            xpm = pm, fpm = epm + w8 * (pm + epm), xdS = dS, fdS = edS + w8 * (std::abs(dS) + edS);
          }
          if (bias) {
            bias_at(r.dbias, b, h, i, j) += dS;
            bias_at(r.tbias, b, h, i, j) += edS;
            bias_at(abias, b, h, i, j) += std::abs(dS) + edS;
          }
          for (int64_t e = 0; e < Ev; ++e) {
            const double y = DY(b, h, i, e);
            r.dv.view4()(b, hk, j, e) += xpm * y;
            r.tv.view4()(b, hk, j, e) += fpm * std::abs(y) * (1 + w8) + (same_roundings ? 0.0 : pm * w8 * std::abs(y));
            av.view4()(b, hk, j, e) += (std::abs(xpm) + fpm) * std::abs(y) * (1 + w8);
          }
          for (int64_t e = 0; e < E; ++e) {
            const double qe = Q(b, h, i, e), ke = K(b, hk, j, e);
            r.dk.view4()(b, hk, j, e) += scale * xdS * qe;
            r.dq.view4()(b, h, i, e) += scale * xdS * ke;
            const double extra = same_roundings ? 0.0 : w8 * std::abs(dS);
            r.tk.view4()(b, hk, j, e) += scale * (fdS * (1 + w8) + extra) * std::abs(qe);
            r.tq.view4()(b, h, i, e) += scale * (fdS * (1 + w8) + extra) * std::abs(ke);
            ak.view4()(b, hk, j, e) += scale * (std::abs(xdS) + fdS) * std::abs(qe) * (1 + w8);
            aq.view4()(b, h, i, e) += scale * (std::abs(xdS) + fdS) * std::abs(ke) * (1 + w8);
          }
        }
      }
  const auto finish = [&](Tensor<double>& t, const Tensor<double>& sum_abs, const Tensor<double>& ref, int64_t n) {
    for (size_t x = 0; x < t.size(); ++x) t[x] += (n + 34) * u * sum_abs[x] + 2 * u * std::abs(ref[x]) + 1e-30;
  };
  finish(r.tv, av, r.dv, group * L);
  finish(r.tk, ak, r.dk, group * L);
  finish(r.tq, aq, r.dq, S);
  if (bias) finish(r.tbias, abias, r.dbias, B * H * L * S / int64_t(r.dbias.size()) - 32);
  return r;
}

// Every gradient element within its tolerance (the worst one named).
::testing::AssertionResult grads_within(const Grads& g, const BwdRef& r, const std::string& what) {
  double worst = 0;
  std::string where;
  for (const auto& [name, got, want, tol] : {std::tuple{"dq", &g.dq, &r.dq, &r.tq}, {"dk", &g.dk, &r.dk, &r.tk},
                                             {"dv", &g.dv, &r.dv, &r.tv}, {"dbias", &g.dbias, &r.dbias, &r.tbias}})
    for (size_t x = 0; want->size() == got->size() && x < got->size(); ++x) {
      const double err = std::abs(double((*got)[x]) - (*want)[x]);
      if (!(err <= (*tol)[x]) && !(err / (*tol)[x] <= worst)) {
        worst = std::isnan(err) ? INFINITY : err / (*tol)[x];
        where = std::string(name) + "[" + std::to_string(x) + "] got " + std::to_string((*got)[x]) + " want " +
                std::to_string((*want)[x]) + " tol " + std::to_string((*tol)[x]);
      }
    }
  if (where.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << where << " (" << worst << " × the tolerance)";
}

// The backward's cases: the forward's (no soft-cap: this reference leaves
// out its derivative, which the float32 code shares), one with enough
// (batch, kv head) pairs for the plan's one-unit-per-head split, one with
// two of the AMX paths' key tiles, and dropout.
std::vector<RandomSpec> backward_specs() {
  std::vector<RandomSpec> specs = forward_specs();
  for (RandomSpec& s : specs) s.softcap = 0;
  RandomSpec s = shape_spec(4, 4, 2, 150, 170, 40, 24);
  s.causal = true, s.key_lengths = true, s.seed = 200;
  specs.push_back(s);
  s = shape_spec(1, 2, 1, 300, 310, 64, 32);
  s.window = {90, 20}, s.seed = 201;
  specs.push_back(s);
  // Two key tiles of the AMX paths' plan for heads of 128 (384 keys).
  s = shape_spec(1, 1, 1, 96, 420, 128, 128);
  s.causal = true, s.align = CausalAlign::bottom_right, s.seed = 202;
  specs.push_back(s);
#ifdef ATTN_TESTS_UNDER_SANITIZER
  // The double references of the large shapes take longer than a test may
  // under the sanitizers' Debug build: the small shapes there, all of them here.
  std::erase_if(specs, [](const RandomSpec& r) { return r.B * r.H * r.L * r.S * (r.E + r.Ev) > 2'000'000; });
#endif
  return specs;
}
Tensor<float> random_dout(const SdpaArgs<float>& a, uint64_t seed) {
  std::mt19937_64 rng(seed);
  return random_tensor<float>({a.q.dim(0), a.q.dim(1), a.q.dim(2), a.v.dim(3)}, rng);
}

TEST(Bf16Backward, EveryPathMatchesTheReferenceWithTheSameRoundings) {
  for (const RandomSpec& spec : backward_specs())
    for (const double dropout : {0.0, 0.25}) {
      SdpaCase<float> c(spec);
      c.opt.dropout_p = dropout, c.opt.dropout_seed = 9;
      const Tensor<float> dout = random_dout(c.args, spec.seed);
      for (Bf16Path path : runnable_paths()) {
        const Fwd st = forward_on(path, c.args, c.opt);
        const BwdRef r = backward_reference(c.args, c.opt, dout, st, true);
        const std::string what = spec.str() + " dropout " + std::to_string(dropout) + " on " + detail::bf16_path_name(path);
        EXPECT_TRUE(grads_within(backward_on(path, c.args, c.opt, dout, st), r, what));
        if (path == Bf16Path::portable && dropout == 0 && spec.seed == 100 + 2) {
          // The bound is tight enough to see the roundings: the float32
          // backward on the same state lies outside it.
          SdpaOptions exact = c.opt;
          exact.compute_dtype = Dtype::float32;
          EXPECT_FALSE(grads_within(backward_of(c.args, exact, dout, &st), r, what + " float32"));
        }
      }
    }
}

TEST(Bf16Backward, TheExactGradientsAreWithinTheBoundOfTheRoundings) {
  for (const RandomSpec& spec : backward_specs()) {
    SdpaCase<float> c(spec);
    const Tensor<float> dout = random_dout(c.args, spec.seed);
    for (Bf16Path path : {Bf16Path::portable, detail::bf16_best_path()}) {
      const Fwd st = forward_on(path, c.args, c.opt);
      const BwdRef r = backward_reference(c.args, c.opt, dout, st, false);
      EXPECT_TRUE(grads_within(backward_on(path, c.args, c.opt, dout, st), r,
                               spec.str() + " against the exact gradients on " + detail::bf16_path_name(path)));
    }
  }
}

// AVX512_BF16 gives the portable bits; the AMX code on emulated tiles and the
// native tiles differ from them in the order (and for native tiles the
// rounding) inside a pair or a tile: each is held to the same bound above.
TEST(Bf16Backward, NativePathsGiveThePortableBits) {
  if (!detail::bf16_path_available(Bf16Path::avx512_bf16)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  for (const RandomSpec& spec : backward_specs())
    for (const double dropout : {0.0, 0.1}) {  // without dropout AVX512_BF16 forms dS in one pass (fused_tile)
      SdpaCase<float> c(spec);
      c.opt.dropout_p = dropout;
      const Tensor<float> dout = random_dout(c.args, spec.seed);
      const Fwd st = forward_on(Bf16Path::portable, c.args, c.opt);
      EXPECT_TRUE(same_grads(backward_on(Bf16Path::avx512_bf16, c.args, c.opt, dout, st),
                             backward_on(Bf16Path::portable, c.args, c.opt, dout, st))) << spec.str() << dropout;
    }
}

// The backward's unit and portable products on every compiled SIMD target
// this CPU runs (lane counts 16, 8, 4, 1): within the bound, and
// AVX512_BF16 gives each target's portable bits.
TEST(Bf16Backward, EveryCompiledTargetKeepsTheBound) {
  const std::string names = for_each_target([&](int64_t) {
    for (const RandomSpec& spec : backward_specs()) {
      SdpaCase<float> c(spec);
      c.opt.dropout_p = 0.1;
      const Tensor<float> dout = random_dout(c.args, spec.seed);
      const Fwd st = forward_on(Bf16Path::portable, c.args, c.opt);
      const Grads g = backward_on(Bf16Path::portable, c.args, c.opt, dout, st);
      EXPECT_TRUE(grads_within(g, backward_reference(c.args, c.opt, dout, st, true), spec.str()));
      if (detail::bf16_path_available(Bf16Path::avx512_bf16)) {
        EXPECT_TRUE(same_grads(g, backward_on(Bf16Path::avx512_bf16, c.args, c.opt, dout, st))) << spec.str();
      }
    }
  });
  std::printf("bfloat16 backward, targets run: %s\n", names.c_str());
}

TEST(Bf16Backward, AnyThreadCountGivesTheSameBits) {
  for (const RandomSpec& base : backward_specs()) {
    RandomSpec spec = base;
    spec.threads = 1;
    SdpaCase<float> c(spec);
    c.opt.dropout_p = 0.1;
    const Tensor<float> dout = random_dout(c.args, spec.seed);
    for (Bf16Path path : {Bf16Path::portable, detail::bf16_best_path()}) {
      const Fwd st = forward_on(path, c.args, c.opt);
      const Grads one = backward_on(path, c.args, c.opt, dout, st);
      for (int threads : {2, 3}) {
        SdpaOptions o = c.opt;
        o.num_threads = threads;
        EXPECT_TRUE(same_grads(one, backward_on(path, c.args, o, dout, st)))
            << spec.str() << " " << threads << " threads on " << detail::bf16_path_name(path);
      }
    }
  }
}

// The operand buffers a thread keeps between calls (bf16.hpp, OperandBuffer)
// hold the last call's bytes: calls after larger ones with other values give
// the bits of the same calls on a fresh thread, whose buffers are new.
TEST(Bf16Backward, ReusedOperandBuffersGiveTheBitsOfNewOnes) {
  const std::vector<RandomSpec> specs = backward_specs();
  for (Bf16Path path : {Bf16Path::portable, detail::bf16_best_path()}) {
    std::vector<std::pair<Fwd, Grads>> fresh;
    for (const RandomSpec& spec : specs) {  // each on a new thread: nothing kept yet
      std::thread t([&] {
        SdpaCase<float> c(spec);
        const Fwd f = forward_on(path, c.args, c.opt);
        Grads g = backward_on(path, c.args, c.opt, random_dout(c.args, spec.seed), f);
        fresh.emplace_back(f, std::move(g));
      });
      t.join();
    }
    std::thread t([&] {  // all on one thread, in reverse order, each after a call with other values
      for (size_t i = specs.size(); i-- > 0;) {
        RandomSpec other = specs[i];
        other.seed += 1000;
        SdpaCase<float> o(other);
        backward_on(path, o.args, o.opt, random_dout(o.args, other.seed), forward_on(path, o.args, o.opt));
        SdpaCase<float> c(specs[i]);
        const Fwd f = forward_on(path, c.args, c.opt);
        const Grads g = backward_on(path, c.args, c.opt, random_dout(c.args, specs[i].seed), f);
        EXPECT_TRUE(same_bits(f.out, fresh[i].first.out) && same_bits(f.lse, fresh[i].first.lse) &&
                    same_grads(g, fresh[i].second))
            << specs[i].str() << " on " << detail::bf16_path_name(path);
      }
    });
    t.join();
  }
}

TEST(Bf16Backward, RowsThatSeeNoKeyHaveZeroGradients) {
  RandomSpec spec = shape_spec(2, 2, 1, 40, 60, 16, 8);
  spec.mask = 1, spec.key_lengths = true, spec.seed = 3;
  const SdpaCase<float> c(spec);  // batch 0 sees no key
  const Tensor<float> dout = random_dout(c.args, 4);
  for (Bf16Path path : runnable_paths()) {
    const Fwd st = forward_on(path, c.args, c.opt);
    const Grads g = backward_on(path, c.args, c.opt, dout, st);
    for (const Tensor<float>* t : {&g.dq, &g.dk, &g.dv}) {
      EXPECT_TRUE(all_finite(*t)) << detail::bf16_path_name(path);
      const size_t half = t->size() / 2;  // batch 0
      for (size_t x = 0; x < half; ++x) ASSERT_EQ((*t)[x], 0.0f) << detail::bf16_path_name(path) << " " << x;
    }
    EXPECT_TRUE(grads_within(g, backward_reference(c.args, c.opt, dout, st, true), detail::bf16_path_name(path)));
  }
}

// NaN or ±∞ in a row of q, k, v or dY (or a float32 beyond bfloat16's range)
// reaches exactly the gradients of the rows that see it (causal: a poisoned
// query row i reaches dq row i and dk, dv of keys ≤ i; a bad key j poisons
// rows ≥ j, the last of which see every key); every other element keeps its bits.
TEST(Bf16Backward, NonFiniteInputsReachOnlyTheGradientsTheyTouch) {
  std::mt19937_64 rng(11);
  for (const Poison& x : {Poison{"q", 7, kNaNf}, Poison{"k", 20, kNaNf}, Poison{"v", 30, kInf},
                          Poison{"dy", 12, kNaNf}, Poison{"dy", 33, 3.4e38f}, Poison{"q", 49, -kInf}})
    for (Bf16Path path : runnable_paths()) {
      SdpaCase<float> c(kPoisonShape, rng);
      c.opt.causal = true;
      Tensor<float> dout = random_dout(c.args, 5);
      const Grads clean = backward_on(path, c.args, c.opt, dout, forward_on(path, c.args, c.opt));
      const char t = x.tensor[0];
      if (t == 'd') dout.view4()(0, 0, x.row, 3) = x.value;
      else (t == 'q' ? c.qbuf : t == 'k' ? c.kbuf : c.vbuf).view(0, 0, x.row, 3) = x.value;
      const Grads g = backward_on(path, c.args, c.opt, dout, forward_on(path, c.args, c.opt));
      const bool key = t == 'k' || t == 'v';
      const std::string what = std::string(x.tensor) + " row " + std::to_string(x.row) + " " + detail::bf16_path_name(path);
      const auto expect = [&](float got, float want, bool hit, const std::string& at) {
        if (hit) EXPECT_TRUE(std::isnan(got)) << what << " " << at;
        else EXPECT_EQ(std::memcmp(&got, &want, 4), 0) << what << " " << at;
      };
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < 50; ++i)
          for (int64_t e = 0; e < 16; ++e)
            expect(g.dq.view4()(0, h, i, e), clean.dq.view4()(0, h, i, e), key ? i >= x.row : h == 0 && i == x.row,
                   "dq " + std::to_string(h) + "," + std::to_string(i));
      for (int64_t j = 0; j < 50; ++j)
        for (int64_t e = 0; e < 16; ++e) {
          const bool hit = key || j <= x.row;
          expect(g.dk.view4()(0, 0, j, e), clean.dk.view4()(0, 0, j, e), hit, "dk " + std::to_string(j));
          expect(g.dv.view4()(0, 0, j, e), clean.dv.view4()(0, 0, j, e), hit, "dv " + std::to_string(j));
        }
    }
}

// The public call: compute_dtype bfloat16 (asked, or by default for bfloat16
// inputs) runs this backward on the best path, with the saved state or
// without (the same bits); compute_dtype float32 the float32 one.
TEST(Bf16Backward, ThePublicCallRunsItWithOrWithoutTheSavedState) {
  std::mt19937_64 rng(23);
  for (const bool causal : {false, true}) {
    SdpaCase<float> c({.B = 1, .H = 2, .Hkv = 1, .L = 70, .S = 90, .E = 32, .Ev = 16}, rng);
    c.opt.causal = causal;
    SdpaOptions bf = c.opt, exact = c.opt;
    bf.compute_dtype = Dtype::bfloat16;
    exact.compute_dtype = Dtype::float32;
    const Tensor<float> dout = random_tensor<float>({1, 2, 70, 16}, rng);
    const Fwd fb = call(c.args, bf);
    const Grads saved = backward_of(c.args, bf, dout, &fb), recomputed = backward_of(c.args, bf, dout, nullptr);
    const Grads direct = backward_on(detail::bf16_best_path(), c.args, c.opt, dout, fb);
    EXPECT_TRUE(same_grads(saved, direct)) << "causal " << causal;
    EXPECT_TRUE(same_grads(recomputed, direct)) << "causal " << causal;
    const Grads f32 = backward_of(c.args, exact, dout, &fb);  // the float32 backward on the same state
    EXPECT_FALSE(same_bits(saved.dq, f32.dq));
    // bfloat16 inputs holding the same values: bfloat16 products by default.
    const Bf16Inputs h(c);
    const Fwd fh = call(c.args, bf);
    EXPECT_TRUE(same_grads(backward_of(h.a, c.opt, dout, nullptr),
                           backward_on(detail::bf16_best_path(), c.args, c.opt, dout, fh)));
    EXPECT_TRUE(same_grads(backward_of(h.a, exact, dout, nullptr), backward_of(c.args, exact, dout, nullptr)));
  }
}

// Calls with few query rows take the decode kernel's forward (docs/fused.md)
// and the float32 backward on its state: the same bits with the saved state
// or without, and the float32 backward's gradients on that state.
TEST(Bf16Backward, FewQueryRowsTakeTheFloat32BackwardOnTheDecodeForward) {
  std::mt19937_64 rng(29);
  for (const int64_t L : {1, 5, 32}) {
    SdpaCase<float> c({.B = 2, .H = 4, .Hkv = 2, .L = L, .S = 400, .E = 16, .Ev = 8}, rng);
    SdpaOptions bf = c.opt, exact = c.opt;
    bf.compute_dtype = Dtype::bfloat16;
    exact.compute_dtype = Dtype::float32;
    const Tensor<float> dout = random_tensor<float>({2, 4, L, 8}, rng);
    const Fwd fb = call(c.args, bf);
    const Grads saved = backward_of(c.args, bf, dout, &fb), recomputed = backward_of(c.args, bf, dout, nullptr);
    EXPECT_TRUE(same_grads(saved, recomputed)) << "L " << L;
    EXPECT_TRUE(same_grads(saved, backward_of(c.args, exact, dout, &fb))) << "L " << L;
    const Bf16Inputs h(c);  // bfloat16 inputs: bfloat16 compute by default, the same route
    EXPECT_TRUE(same_grads(backward_of(h.a, c.opt, dout, nullptr), backward_of(c.args, bf, dout, nullptr))) << L;
  }
}

// Without a rule that reads a score's value the products may leave the
// scores' scale to the pass after the rules (docs/fused.md): a zero float
// bias (a rule that reads the value, so the product scales) gives the same
// bits, forward and backward, on every path, causal or not.
TEST(Bf16Backward, DeferredScoreScaleGivesTheScaledBits) {
  std::mt19937_64 rng(31);
  for (Bf16Path path : runnable_paths())
    for (const bool causal : {false, true}) {
      SdpaCase<float> c({.B = 1, .H = 2, .Hkv = 1, .L = 70, .S = 300, .E = 40, .Ev = 24}, rng);
      c.opt.causal = causal;
      const Tensor<float> dout = random_tensor<float>({1, 2, 70, 24}, rng);
      const Fwd plain = forward_on(path, c.args, c.opt);
      const Grads g = backward_on(path, c.args, c.opt, dout, plain);
      const Tensor<float> zeros({1, 1, 1, 300});
      c.args.bias = zeros.view4();
      const Fwd biased = forward_on(path, c.args, c.opt);
      EXPECT_TRUE(same_bits(plain.out, biased.out) && same_bits(plain.lse, biased.lse)) << int(path) << causal;
      const Grads gb = backward_on(path, c.args, c.opt, dout, biased);  // (and the bias's gradient)
      EXPECT_TRUE(same_bits(g.dq, gb.dq) && same_bits(g.dk, gb.dk) && same_bits(g.dv, gb.dv)) << int(path) << causal;
    }
}

}  // namespace
