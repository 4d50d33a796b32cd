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
// validation and defaults, and the backward that reads the bfloat16
// forward's saved state.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>

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

// The bfloat16 forward's plan: fused_plan's promises (tiles.hpp), key tiles at
// least as long, its scratch within the budget for head sizes up to 256.
TEST(Bf16Compute, ItsPlanKeepsThePromises) {
  for (int64_t n : {1, 17, 81, 1030, 65536})
    for (int64_t e : {1, 64, 128, 256}) {
      detail::Problem p;
      p.B = p.H = p.Hkv = 1, p.L = p.S = n, p.E = p.Ev = e, p.bf16_products = true;
      const detail::FusedPlan t = detail::fused_plan_bf16(p), f = detail::fused_plan(p);
      EXPECT_EQ(t.q_block, f.q_block);
      EXPECT_EQ(t.k_block % detail::kRowMultiple, 0) << n << " " << e;
      EXPECT_GE(t.k_block, f.k_block);
      EXPECT_LE(t.k_block, (n + detail::kRowMultiple - 1) / detail::kRowMultiple * detail::kRowMultiple);
      for (int64_t lanes : {4, 8, 16})
        EXPECT_LE(detail::ForwardScratch(p, t, lanes, detail::Alloc::no).bytes(), detail::kScratchBudgetBytes)
            << n << " " << e << " " << lanes;
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

// NaN or ±∞ in a row of q, k or v (or a float32 beyond bfloat16's range)
// poisons exactly the rows that see it; every other element keeps its bits.
TEST(Bf16Compute, NonFiniteInputsReachOnlyTheRowsThatSeeThem) {
  const CaseShape shape{.B = 1, .H = 2, .Hkv = 1, .L = 50, .S = 50, .E = 16, .Ev = 16};
  std::mt19937_64 rng(11);
  struct Poison {
    const char* tensor;
    int64_t row;
    float value;
  };
  for (const Poison& x : {Poison{"q", 7, kNaNf}, Poison{"k", 20, kNaNf}, Poison{"v", 30, kInf},
                          Poison{"k", 45, 3.4e38f}, Poison{"q", 49, -kInf}})
    for (Bf16Path path : runnable_paths()) {
      SdpaCase<float> c(shape, rng);
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

}  // namespace

// ---- the backward: float32 arithmetic on the bfloat16 forward's state --------------

// Gradients of a call (through the public API), with or without the saved state.
struct Grads {
  Tensor<float> dq, dk, dv;
};
Grads backward_of(const SdpaArgs<float>& a, const SdpaOptions& opt, const Tensor<float>& dout, const Fwd* saved) {
  Grads g{Tensor<float>({a.q.dim(0), a.q.dim(1), a.q.dim(2), a.q.dim(3)}),
          Tensor<float>({a.k.dim(0), a.k.dim(1), a.k.dim(2), a.k.dim(3)}),
          Tensor<float>({a.v.dim(0), a.v.dim(1), a.v.dim(2), a.v.dim(3)})};
  SdpaSaved<float> s;
  if (saved) s = {saved->out.view4(), saved->lse.view<3>()};
  scaled_dot_product_attention_backward(a, dout.view4(), s, {g.dq.view4(), g.dk.view4(), g.dv.view4()}, opt);
  return g;
}

// With bfloat16 products the backward is the float32 backward on the saved
// output and lse of the bfloat16 forward (recomputed by it when not given),
// bit for bit; and it is within the first-order bound those two carry of the
// exact gradients: with P the exact probabilities, δℓ_i = lse_i − lse*_i and
// δD_i = dY_i·(y_i − y*_i) the forward's errors,
//   |δdS_ij| ≤ P_ij (|δℓ_i|·|dP_ij − D_i| + |δD_i|),
//   |δdQ_ie| ≤ scale Σ_j |δdS_ij| |k_je|,  |δdK_je| ≤ scale Σ_i |δdS_ij| |q_ie|,
//   |δdV_je| ≤ Σ_i P_ij |δℓ_i| |dY_ie|   (doubled, plus float32's tolerance).
TEST(Bf16Compute, TheBackwardReadsTheBfloat16ForwardsState) {
  std::mt19937_64 rng(23);
  for (const bool causal : {false, true}) {
    SdpaCase<float> c({.B = 1, .H = 2, .Hkv = 1, .L = 70, .S = 90, .E = 32, .Ev = 16}, rng);
    c.opt.causal = causal;
    SdpaOptions bf = c.opt, exact = c.opt;
    bf.compute_dtype = Dtype::bfloat16;
    exact.compute_dtype = Dtype::float32;
    const Tensor<float> dout = random_tensor<float>({1, 2, 70, 16}, rng);
    const Fwd fb = call(c.args, bf), fe = call(c.args, exact);
    const Grads saved = backward_of(c.args, bf, dout, &fb), recomputed = backward_of(c.args, bf, dout, nullptr);
    const Grads f32 = backward_of(c.args, exact, dout, &fb);  // the float32 backward on the same state
    for (const auto& [x, y] : {std::pair{&saved.dq, &f32.dq}, {&saved.dk, &f32.dk}, {&saved.dv, &f32.dv},
                               {&recomputed.dq, &f32.dq}, {&recomputed.dk, &f32.dk}, {&recomputed.dv, &f32.dv}})
      EXPECT_TRUE(same_bits(*x, *y)) << "causal " << causal;
    // The bound against the exact gradients (the reference in double on the float32 inputs).
    const Grads want = backward_of(c.args, exact, dout, &fe);
    const auto q = c.args.q, k = c.args.k, v = c.args.v;
    const auto dy = dout.view4();
    const double scale = 1.0 / std::sqrt(32.0);
    Tensor<double> bq({1, 2, 70, 32}), bk({1, 1, 90, 32}), bv({1, 1, 90, 16});
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 70; ++i) {
        const double dl = double(fb.lse.view<3>()(0, h, i)) - double(fe.lse.view<3>()(0, h, i));
        double D = 0, dD = 0;
        for (int64_t e = 0; e < 16; ++e) {
          D += double(dy(0, h, i, e)) * fe.out.view4()(0, h, i, e);
          dD += double(dy(0, h, i, e)) * (double(fb.out.view4()(0, h, i, e)) - fe.out.view4()(0, h, i, e));
        }
        std::vector<double> s(90);
        double m = -INFINITY, sum = 0;
        for (int64_t j = 0; j < 90; ++j) {
          double x = 0;
          for (int64_t e = 0; e < 32; ++e) x += double(q(0, h, i, e)) * k(0, 0, j, e);
          s[size_t(j)] = causal && j > i ? -INFINITY : scale * x;
          m = std::max(m, s[size_t(j)]);
        }
        for (double& x : s) sum += (x = std::exp(x - m));
        for (int64_t j = 0; j < 90; ++j) {
          const double p = s[size_t(j)] / sum;
          double dp = 0;
          for (int64_t e = 0; e < 16; ++e) dp += double(dy(0, h, i, e)) * v(0, 0, j, e);
          const double ds = p * (std::abs(dl) * std::abs(dp - D) + std::abs(dD));
          for (int64_t e = 0; e < 32; ++e) {
            bq.view4()(0, h, i, e) += scale * ds * std::abs(k(0, 0, j, e));
            bk.view4()(0, 0, j, e) += scale * ds * std::abs(q(0, h, i, e));
          }
          for (int64_t e = 0; e < 16; ++e) bv.view4()(0, 0, j, e) += p * std::abs(dl) * std::abs(dy(0, h, i, e));
        }
      }
    const auto check = [&](const Tensor<float>& got, const Tensor<float>& exp, const Tensor<double>& bound,
                           const char* name) {
      double m = 0;
      for (size_t i = 0; i < exp.size(); ++i) m = std::max(m, double(std::abs(exp[i])));
      const double slack = tolerance<float>(70 + 90 + 32, m, 80);
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_LE(std::abs(double(got[i]) - exp[i]), 2 * bound[i] + slack)
            << name << " element " << i << " causal " << causal << " got " << got[i] << " want " << exp[i];
    };
    check(saved.dq, want.dq, bq, "dq");
    check(saved.dk, want.dk, bk, "dk");
    check(saved.dv, want.dv, bv, "dv");
  }
}
