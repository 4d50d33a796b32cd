// The decode kernel with bfloat16 products (compute_dtype bfloat16,
// kernels/decode/bf16.hpp, docs/decode.md "bfloat16 compute").
//
// The kernel applies the fused forward's roundings (q, k, v and P to
// bfloat16; sums, softmax and lse in float32), so docs/fused.md's bound
// holds once its sums are counted for this kernel: a score sums its E
// products in 16 float32 lanes and then across them by halving (each
// product passes at most E/32 + 4 + 1 roundings, within the bound's
// E + 16); an output sums a chunk's keys in order, and the n chunks of a
// row block are merged by the online softmax (each merge rescales both
// partials and adds them: three roundings), so the bound's (S + 16)·2^-24
// becomes (S + 16 + 3n)·2^-24 (bf16_reference.hpp's extra_sums = 3n).
//
// Checked, for float32 and bfloat16 storage of K and V: every path
// against the exact attention of the rounded operands (the reference
// backend in double) within that bound, and against the exact attention of
// the unrounded ones within the bound widened by the operands' rounding;
// AVX512_BF16 (where the CPU has it) against the portable path bit for bit,
// and the AMX tiles (native where the CPU has them, and emulated) within the
// bound, on every compiled SIMD target; 1, 2 and 3
// threads bit for bit; rows that see no key, and NaN and ±∞ reaching only
// the rows that see them; the routes of the public calls (bfloat16 q, k, v
// by default, compute_dtype either way, a paged cache as a contiguous one,
// the exact path unchanged without bfloat16 compute, float16 storage exact).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bf16_reference.hpp"
#include "decode_case.hpp"
#include "kernels/decode/bf16.hpp"
#include "kernels/decode/decode.hpp"
#include "kernels/problem.hpp"
#include "sdpa_case.hpp"
#include "simd_targets.hpp"

namespace {

using namespace attn;
using namespace attn::testing;
using detail::Bf16Path;

// The path whose bits a path gives: the portable one for AVX512_BF16 (its
// order of the sums); itself for the others (the native AMX tiles round
// inside an instruction differently from the emulation, docs/fused.md: the
// bound alone holds them).
Bf16Path twin(Bf16Path p) { return p == Bf16Path::avx512_bf16 ? Bf16Path::portable : p; }

// x's values stored as T (x then holds the stored values) and their view.
template <class T>
View4<const T> stored_as(Strided<float>& x, std::vector<T>& h) {
  h.resize(x.buf.size());
  for (size_t i = 0; i < x.buf.size(); ++i) h[i] = T(x.buf[i]), x.buf[i] = float(h[i]);
  return View4<const T>(h.data() + (x.view.data - x.buf.data()), x.view.shape, x.view.strides);
}

// A case's K and V in storage type t (the case's k and v then hold the stored values).
struct Storage {
  std::vector<float16_t> k16, v16;
  std::vector<bfloat16_t> kb, vb;
  detail::KVLayout kv;
  Storage(Dtype t, SdpaCase<float>& c) {
    if (t == Dtype::float16) kv = detail::KVLayout::dense(t, stored_as(c.kbuf, k16), stored_as(c.vbuf, v16));
    else if (t == Dtype::bfloat16) kv = detail::KVLayout::dense(t, stored_as(c.kbuf, kb), stored_as(c.vbuf, vb));
    else kv = detail::KVLayout::dense(t, c.args.k, c.args.v);
  }
};

// The kernel with bfloat16 products on `path`.
Fwd decode_on(Bf16Path path, const SdpaCase<float>& c, const detail::KVLayout& kv, const SdpaOptions& opt) {
  detail::Problem p = detail::make_problem(c.args, opt);
  p.bf16_products = true;
  Fwd r{Tensor<float>({p.B, p.H, p.L, p.Ev}), Tensor<float>({p.B, p.H, p.L})};
  detail::decode_forward_planned(p, kv, c.args.q, r.out.view4(), r.lse.view<3>(), detail::decode_plan(p), path);
  return r;
}

// 3n: the roundings the merges of a row block's n key chunks add.
int64_t merge_sums(const SdpaCase<float>& c) {
  const detail::Problem p = detail::make_problem(c.args, c.opt);
  return 3 * ((p.S + detail::decode_plan(p).chunk - 1) / detail::decode_plan(p).chunk);
}

// Decoding shapes (L <= 32 rows per head), awkward sizes, every rule.
std::vector<RandomSpec> decode_specs() {
  std::vector<RandomSpec> specs;
  RandomSpec s = shape_spec(1, 8, 2, 1, 700, 128, 128);  // 4 query heads per kv head
  specs.push_back(s);
  s = shape_spec(1, 4, 4, 1, 1030, 64, 64);
  s.mask = 1;
  specs.push_back(s);
  s = shape_spec(2, 6, 2, 3, 300, 40, 24);
  s.causal = true, s.align = CausalAlign::bottom_right, s.key_lengths = true;
  specs.push_back(s);
  s = shape_spec(1, 2, 1, 5, 97, 7, 5);
  s.layout = Layout::strided, s.causal = true, s.align = CausalAlign::bottom_right;
  s.softcap = 5.0, s.alibi = true, s.sinks = true;
  specs.push_back(s);
  s = shape_spec(1, 4, 2, 2, 261, 33, 65);
  s.mask = 2, s.window = {17, 5};
  specs.push_back(s);
  s = shape_spec(2, 2, 1, 1, 1, 16, 16);
  specs.push_back(s);
  s = shape_spec(1, 4, 1, 17, 600, 64, 80);
  s.layout = Layout::bnhd, s.causal = true, s.align = CausalAlign::bottom_right, s.mask = 3;
  specs.push_back(s);
  s = shape_spec(1, 16, 1, 8, 2000, 96, 32);  // 128 rows in one block, several chunks
  s.causal = true, s.align = CausalAlign::bottom_right;
  specs.push_back(s);
  for (size_t i = 0; i < specs.size(); ++i) specs[i].seed = 300 + i;
  return specs;
}

// The storage types the bfloat16 products read (float16 storage keeps the
// exact products: FloatSixteenStorageStaysExact).
const Dtype kStorage[] = {Dtype::float32, Dtype::bfloat16};

TEST(DecodeBf16, EveryPathAndStorageIsWithinTheBoundOfTheRoundedReference) {
  for (const RandomSpec& spec : decode_specs())
    for (Dtype t : kStorage) {
      SdpaCase<float> c(spec);
      ASSERT_TRUE(detail::decode_suits_dense(detail::make_problem(c.args, c.opt))) << spec.str();
      const Storage st(t, c);
      const Ref r = reference(c.args, c.opt);
      std::map<Bf16Path, Fwd> got;
      for (Bf16Path path : runnable_paths()) {
        got.emplace(path, decode_on(path, c, st.kv, c.opt));
        EXPECT_TRUE(within_bound(got.at(path), r, spec.E, spec.softcap, false,
                                 spec.str() + " " + dtype_name(t) + " on " + detail::bf16_path_name(path), false,
                                 merge_sums(c)));
      }
      for (const auto& [path, f] : got)  // a native path gives its twin's bits
        EXPECT_TRUE(same_bits(f.out, got.at(twin(path)).out) && same_bits(f.lse, got.at(twin(path)).lse))
            << spec.str() << " " << dtype_name(t) << " " << detail::bf16_path_name(path);
    }
}

// Against the exact attention of the unrounded inputs: the bound grows by
// what rounding q, k and v does to the scores and values (docs/fused.md).
TEST(DecodeBf16, TheExactAttentionOfTheUnroundedInputsIsWithinTheWiderBound) {
  for (const RandomSpec& spec : decode_specs()) {
    SdpaCase<float> c(spec);
    const Storage st(Dtype::float32, c);
    Ref r = reference(c.args, c.opt);  // the weights and m of the rounded operands
    const Ref exact = reference(c.args, c.opt, false);
    r.out = exact.out, r.lse = exact.lse;
    for (Bf16Path path : runnable_paths())
      EXPECT_TRUE(within_bound(decode_on(path, c, st.kv, c.opt), r, spec.E, spec.softcap, false,
                               spec.str() + " against float64 on " + detail::bf16_path_name(path), true,
                               merge_sums(c)));
  }
}

// The kernel compiled for every SIMD target this CPU runs: within the
// bound on each (the row sums of the softmax differ in their last bits
// between vector widths), and on each the native products give the
// portable bits.
TEST(DecodeBf16, EveryCompiledTargetKeepsTheBound) {
  const std::vector<RandomSpec> specs = decode_specs();
  std::vector<Ref> refs;
  for (Dtype t : kStorage)
    for (const RandomSpec& spec : specs) {
      SdpaCase<float> c(spec);
      const Storage st(t, c);
      refs.push_back(reference(c.args, c.opt));
    }
  const std::string names = for_each_target([&](int64_t) {
    size_t n = 0;
    for (Dtype t : kStorage)
      for (const RandomSpec& spec : specs) {
        SdpaCase<float> c(spec);
        const Storage st(t, c);
        std::map<Bf16Path, Fwd> got;
        for (Bf16Path path : runnable_paths()) got.emplace(path, decode_on(path, c, st.kv, c.opt));
        for (const auto& [path, f] : got) {
          if (path == twin(path))
            EXPECT_TRUE(within_bound(f, refs[n], spec.E, spec.softcap, false,
                                     spec.str() + " " + dtype_name(t) + " on " + detail::bf16_path_name(path), false,
                                     merge_sums(c)));
          else
            EXPECT_TRUE(same_bits(f.out, got.at(twin(path)).out) && same_bits(f.lse, got.at(twin(path)).lse))
                << spec.str() << " " << dtype_name(t) << " " << detail::bf16_path_name(path);
        }
        ++n;
      }
  });
  std::printf("decode with bfloat16 products, targets run: %s\n", names.c_str());
}

TEST(DecodeBf16, AnyThreadCountGivesTheSameBits) {
  for (const RandomSpec& spec : decode_specs())
    for (Dtype t : {Dtype::float32, Dtype::bfloat16}) {
      SdpaCase<float> c(spec);
      const Storage st(t, c);
      for (Bf16Path path : runnable_paths()) {
        const Fwd one = decode_on(path, c, st.kv, c.opt);
        for (int threads : {2, 3}) {
          SdpaOptions o = c.opt;
          o.num_threads = threads;
          const Fwd more = decode_on(path, c, st.kv, o);
          EXPECT_TRUE(same_bits(one.out, more.out) && same_bits(one.lse, more.lse))
              << spec.str() << " " << threads << " threads on " << detail::bf16_path_name(path);
        }
      }
    }
}

// ---- rows that see no key, non-finite inputs -------------------------------------

TEST(DecodeBf16, RowsThatSeeNoKeyAreZeroWithLseMinusInfinity) {
  RandomSpec spec = shape_spec(2, 4, 2, 3, 90, 16, 8);
  spec.key_lengths = true, spec.mask = 1, spec.seed = 5;  // batch 0 sees no key; row 0 of the mask none
  SdpaCase<float> c(spec);
  const Storage st(Dtype::bfloat16, c);
  for (Bf16Path path : runnable_paths()) {
    const Fwd f = decode_on(path, c, st.kv, c.opt);
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < 3; ++i) {
        EXPECT_EQ(f.lse.view<3>()(0, h, i), -kInf);
        for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(f.out.view4()(0, h, i, e), 0.0f);
      }
    EXPECT_TRUE(all_finite(f.out)) << detail::bf16_path_name(path);
  }
}

// NaN or ±∞ in a row of q, k or v (or a float32 beyond bfloat16's range)
// poisons exactly the rows that see it; every other element keeps its bits.
TEST(DecodeBf16, NonFiniteInputsReachOnlyTheRowsThatSeeThem) {
  const int64_t S = 300, L = 4;
  struct Poison {
    const char* tensor;
    int64_t row;
    float value;
  };
  for (Dtype t : kStorage)
    for (const Poison& x : {Poison{"q", 1, kNaNf}, Poison{"k", S - 3, kNaNf}, Poison{"v", S - 1, kInf},
                            Poison{"k", S - 2, 3.4e38f}, Poison{"v", 7, -kInf}, Poison{"q", 3, kInf}})
      for (Bf16Path path : runnable_paths()) {
        if (t != Dtype::float32 && x.value == 3.4e38f) continue;  // bfloat16 stores it as ∞ (the ∞ case)
        RandomSpec spec = shape_spec(1, 4, 2, L, S, 24, 20);
        spec.causal = true, spec.align = CausalAlign::bottom_right, spec.seed = 9;
        SdpaCase<float> clean_case(spec), c(spec);
        const Storage clean_st(t, clean_case);
        const Fwd clean = decode_on(path, clean_case, clean_st.kv, clean_case.opt);
        Strided<float>& buf = x.tensor[0] == 'q' ? c.qbuf : x.tensor[0] == 'k' ? c.kbuf : c.vbuf;
        buf.view(0, 0, x.row, 3) = x.value;
        const Storage st(t, c);
        const Fwd f = decode_on(path, c, st.kv, c.opt);
        for (int64_t h = 0; h < 4; ++h)
          for (int64_t i = 0; i < L; ++i) {
            // A bad query poisons its own row (head 0), a bad key the rows that
            // see it (kv head 0: heads 0 and 1; query i sees keys <= S − L + i).
            const bool hit = x.tensor[0] == 'q' ? (h == 0 && i == x.row) : (h < 2 && x.row <= S - L + i);
            const std::string what = std::string(x.tensor) + " row " + std::to_string(x.row) + " " + dtype_name(t) +
                                     " h=" + std::to_string(h) + " i=" + std::to_string(i) + " " +
                                     detail::bf16_path_name(path);
            EXPECT_EQ(std::isnan(f.lse.view<3>()(0, h, i)), hit) << what;
            for (int64_t e = 0; e < 20; ++e) {
              const float got = f.out.view4()(0, h, i, e), want = clean.out.view4()(0, h, i, e);
              if (hit) EXPECT_TRUE(std::isnan(got)) << what;
              else EXPECT_EQ(std::memcmp(&got, &want, 4), 0) << what;
            }
          }
      }
}

// float16 storage keeps the exact products under bfloat16 compute: the
// kernel's float32 bits, on every path asked for.
TEST(DecodeBf16, FloatSixteenStorageStaysExact) {
  for (const RandomSpec& spec : decode_specs()) {
    SdpaCase<float> c(spec);
    const Storage st(Dtype::float16, c);
    detail::Problem p = detail::make_problem(c.args, c.opt);
    ASSERT_FALSE(p.bf16_products);
    Fwd exact{Tensor<float>({p.B, p.H, p.L, p.Ev}), Tensor<float>({p.B, p.H, p.L})};
    detail::decode_forward(p, st.kv, c.args.q, exact.out.view4(), exact.lse.view<3>());
    for (Bf16Path path : runnable_paths()) {
      const Fwd f = decode_on(path, c, st.kv, c.opt);
      EXPECT_TRUE(same_bits(f.out, exact.out) && same_bits(f.lse, exact.lse))
          << spec.str() << " on " << detail::bf16_path_name(path);
    }
  }
}

// ---- the public calls ---------------------------------------------------------------

// bfloat16 q, k, v with few rows take the kernel's bfloat16 products by
// default (bitwise the float32 call's with compute_dtype bfloat16 on the same
// values), the exact ones with compute_dtype float32; float32 inputs stay
// exact unless asked.
TEST(DecodeBf16, TheDenseCallTakesItWithBfloat16Compute) {
  RandomSpec spec = shape_spec(1, 8, 2, 2, 500, 64, 48);
  spec.causal = true, spec.align = CausalAlign::bottom_right, spec.seed = 21;
  SdpaCase<float> c(spec);
  std::vector<bfloat16_t> q, k, v;
  SdpaArgs<bfloat16_t> h;
  h.q = stored_as(c.qbuf, q), h.k = stored_as(c.kbuf, k), h.v = stored_as(c.vbuf, v);
  const Storage f32(Dtype::float32, c);
  SdpaOptions asked = c.opt, exact = c.opt;
  asked.compute_dtype = Dtype::bfloat16;
  exact.compute_dtype = Dtype::float32;
  const Fwd f32_call = call(c.args, c.opt);
  // Where the products pay, the kernel's bfloat16 ones; elsewhere the exact ones.
  const Fwd best = detail::decode_bf16_pays() ? decode_on(detail::decode_bf16_path(), c, f32.kv, c.opt) : f32_call;
  EXPECT_TRUE(same_bits(call(h, c.opt).out, best.out));
  EXPECT_TRUE(same_bits(call(c.args, asked).out, best.out));
  EXPECT_TRUE(same_bits(call(h, exact).out, f32_call.out));
  EXPECT_EQ(same_bits(best.out, f32_call.out), !detail::decode_bf16_pays());
  // The exact path: the kernel's float32 products.
  const detail::Problem p = detail::make_problem(c.args, c.opt);
  ASSERT_FALSE(p.bf16_products);
  Tensor<float> direct({p.B, p.H, p.L, p.Ev});
  detail::decode_forward_dense(p, c.args, direct.view4(), {});
  EXPECT_TRUE(same_bits(direct, f32_call.out));
}

// decode_attention with compute_dtype bfloat16: the kernel's bfloat16
// products (where they pay), a paged cache (pages of 5 and 16 tokens:
// key pairs across pages) giving the contiguous cache's bits, within the
// bound of the exact attention of the stored values with q rounded.
TEST(DecodeBf16, TheCacheCallTakesItWhenAsked) {
  for (Dtype t : kStorage) {
    DecodeCase base;
    base.B = 2, base.H = 8, base.Hkv = 2, base.L = 3, base.E = 40, base.Ev = 24, base.dtype = t;
    base.lens = {301, 150};
    std::vector<Result> results;
    for (int64_t page : {0, 5, 16}) {
      DecodeCase dc = base;
      dc.page = page;
      std::mt19937_64 rng(41);
      const Filled f = fill(dc, rng);
      DecodeCall o;
      o.compute_dtype = Dtype::bfloat16;
      results.push_back(run(dc, f, o));
      if (page != 0) continue;
      // The exact call where the bfloat16 products do not pay (bf16.hpp).
      EXPECT_EQ(bitwise_equal(results.back().out, run(dc, f).out), !detail::decode_bf16_pays()) << dtype_name(t);
      // The bound of docs/fused.md: P rounded (2^-8), the scores moved by q's
      // and k's rounding (2·2^-8·m) and their float32 sums, v's rounding (2^-8).
      Tensor<float> out, lse;
      oracle(dc, f, out, lse);
      double m = 0, vmax = 0;
      const double scale = 1 / std::sqrt(double(dc.E));
      for (int64_t b = 0; b < dc.B; ++b) {
        for (size_t i = 0; i < f.v[size_t(b)].size(); ++i) vmax = std::max(vmax, double(std::abs(f.v[size_t(b)][i])));
        for (int64_t h = 0; h < dc.H; ++h)
          for (int64_t i = 0; i < dc.L; ++i)
            for (int64_t j = 0; j < dc.lens[size_t(b)]; ++j) {
              double s = 0;
              for (int64_t e = 0; e < dc.E; ++e)
                s += std::abs(double(f.q.view4()(b, h, i, e)) *
                              f.k[size_t(b)][size_t((h / (dc.H / dc.Hkv) * f.k[size_t(b)].dim(1) + j) * dc.E + e)]);
              m = std::max(m, scale * s);
            }
      }
      const double ds = (dc.E + 16) * kF * m + 2 * kU * m;
      const double tol = vmax * (kU + 2 * ds + kU + (301 + 16 + 6) * kF);
      EXPECT_TRUE(all_close(results.back().out, out, tol, std::string("out ") + dtype_name(t)));
    }
    EXPECT_TRUE(bitwise_equal(results[1].out, results[0].out) && bitwise_equal(results[1].lse, results[0].lse))
        << "pages of 5, " << dtype_name(t);
    EXPECT_TRUE(bitwise_equal(results[2].out, results[0].out) && bitwise_equal(results[2].lse, results[0].lse))
        << "pages of 16, " << dtype_name(t);
  }
  // The reference backend is exact: it refuses bfloat16 compute.
  DecodeCase dc;
  dc.lens = {10};
  std::mt19937_64 rng(1);
  const Filled f = fill(dc, rng);
  DecodeCall o;
  o.compute_dtype = Dtype::bfloat16;
  o.backend = Backend::reference;
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { run(dc, f, o); },
                                           {"decode_attention", "option 'compute_dtype' is bfloat16", "reference"}));
}

}  // namespace

// Chunked prefill (more than 32 new rows) with compute_dtype bfloat16: the
// fused forward's bfloat16 products, so one chunk of keys gives the dense
// call's bits with the same rounding (q, k, v rounded, bottom-right causal);
// several chunks (pages of 300 tokens, bfloat16 storage widened in chunks of
// 4096 keys) stay within the bound against the exact attention of the
// stored values and differ from the exact call; float16 storage stays exact.
TEST(DecodeBf16, ChunkedPrefillTakesTheBfloat16ForwardWhenAsked) {
  for (Dtype t : {Dtype::float32, Dtype::bfloat16, Dtype::float16})
    for (int64_t len : {int64_t(700), int64_t(5000)}) {
      DecodeCase dc;
      dc.B = 1, dc.H = 4, dc.Hkv = 2, dc.L = 40, dc.E = 64, dc.Ev = 48, dc.dtype = t, dc.lens = {len};
      ASSERT_FALSE(detail::decode_suits_rows(dc.L, dc.H / dc.Hkv));
      SCOPED_TRACE(dc.str());
      std::mt19937_64 rng(51);
      const Filled f = fill(dc, rng);
      DecodeCall asked;
      asked.compute_dtype = Dtype::bfloat16;
      const Result got = run(dc, f, asked), exact = run(dc, f);
      EXPECT_EQ(bitwise_equal(got.out, exact.out), t == Dtype::float16);
      if (t == Dtype::float16) continue;
      // The dense call on the stored values, compute_dtype bfloat16.
      SdpaArgs<float> a;
      a.q = f.q.view4();
      a.k = View4<const float>(f.k[0].data(), {1, dc.Hkv, len, dc.E}, {dc.Hkv * len * dc.E, len * dc.E, dc.E, 1});
      a.v = View4<const float>(f.v[0].data(), {1, dc.Hkv, len, dc.Ev}, {dc.Hkv * len * dc.Ev, len * dc.Ev, dc.Ev, 1});
      SdpaOptions o;
      o.causal = true, o.causal_align = CausalAlign::bottom_right, o.compute_dtype = Dtype::bfloat16;
      Tensor<float> dense({1, dc.H, dc.L, dc.Ev}), dlse({1, dc.H, dc.L});
      scaled_dot_product_attention(a, {dense.view4(), {}, dlse.view<3>()}, o);
      if (len <= 4096) {  // one chunk
        EXPECT_TRUE(bitwise_equal(got.out, dense));
        EXPECT_TRUE(bitwise_equal(got.lse, dlse));
      }
      // Several chunks: merged in order; docs/fused.md's bound, with
      // 2^-8 of P and of v, 2·2^-7·m·max|v| of q and k's rounding.
      Tensor<float> out, lse;
      oracle(dc, f, out, lse);
      double vmax = 0, diff = 0;
      for (size_t i = 0; i < f.v[0].size(); ++i) vmax = std::max(vmax, double(std::abs(f.v[0][i])));
      for (size_t i = 0; i < out.size(); ++i) diff = std::max(diff, double(std::abs(got.out[i] - out[i])));
      double m = 0;  // the largest magnitude of a score's terms
      for (int64_t h = 0; h < dc.H; ++h)
        for (int64_t i = 0; i < dc.L; ++i)
          for (int64_t j = 0; j < len; ++j) {
            double sum = 0;
            for (int64_t e = 0; e < dc.E; ++e) sum += std::abs(double(a.q(0, h, i, e)) * a.k(0, h / 2, j, e));
            m = std::max(m, sum / std::sqrt(double(dc.E)));
          }
      EXPECT_LE(diff, (0x1p-8 + 0x1p-8) * vmax + 2 * 0x1p-7 * m * vmax);
      EXPECT_GT(diff, 1e-4) << "the products were exact";
    }
}
