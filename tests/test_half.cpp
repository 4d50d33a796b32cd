// Half-precision inputs (attn/half.hpp) in the dense call. The contract: with
// float16/bfloat16 q, k, v the result is the float32 call's on the rounded
// values, bitwise, forward and backward, on every route (the widened fused
// and reference kernels, and the decode kernel that reads half K/V
// directly); and that is the exact attention of the rounded values, checked
// against the reference in double to float32's bound. Shapes: GQA, (B, N, H,
// d) and padded strides, both causal alignments, boolean and additive masks
// with fully masked rows, key lengths, variants; NaN in a half input; the
// conversions themselves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "sdpa_case.hpp"
#include "kernels/decode/decode.hpp"
#include "validate.hpp"

namespace {

using namespace attn;
using namespace attn::testing;

// ---- the types ---------------------------------------------------------------

TEST(HalfTypes, Float16RoundsToNearestEvenAndWidensExactly) {
  EXPECT_EQ(float16_t(1.0f).bits, 0x3C00);
  EXPECT_EQ(float16_t(-2.0f).bits, 0xC000);
  EXPECT_EQ(float16_t(1.0f + 0x1p-11f).bits, 0x3C00);      // a tie goes to the even neighbour (down)
  EXPECT_EQ(float16_t(1.0f + 3 * 0x1p-11f).bits, 0x3C02);  // ... and here up
  EXPECT_EQ(float16_t(65504.0f).bits, 0x7BFF);             // the largest finite float16
  EXPECT_EQ(float16_t(65520.0f).bits, 0x7C00);             // beyond it: +inf
  EXPECT_EQ(float16_t(0x1p-24f).bits, 0x0001);             // the smallest subnormal
  EXPECT_TRUE(std::isnan(float(float16_t(std::nanf("")))));
  EXPECT_EQ(float(float16_t::from_bits(0x3C01)), 1.0f + 0x1p-10f);
  EXPECT_EQ(float(float16_t::from_bits(0x0001)), 0x1p-24f);
}

TEST(HalfTypes, Bfloat16RoundsToNearestEvenAndWidensExactly) {
  EXPECT_EQ(bfloat16_t(1.0f).bits, 0x3F80);
  EXPECT_EQ(bfloat16_t(1.0f + 0x1p-8f).bits, 0x3F80);      // tie to even (down)
  EXPECT_EQ(bfloat16_t(1.0f + 3 * 0x1p-8f).bits, 0x3F82);  // tie to even (up)
  EXPECT_EQ(bfloat16_t(-std::numeric_limits<float>::infinity()).bits, 0xFF80);
  EXPECT_TRUE(std::isnan(float(bfloat16_t(std::nanf("")))));
  EXPECT_EQ(float(bfloat16_t::from_bits(0x3F81)), 1.0f + 0x1p-7f);
}

// The types round exactly as the KV cache stores (one implementation).
#if defined(__FLT16_MAX__)
// An independent formulation: the compiler's own _Float16 (IEEE rounding to
// nearest even) against the bit-level conversions, on every float16 value and
// on floats spread over every exponent (every 997th bit pattern).
TEST(HalfTypes, Float16AgreesWithTheCompilersConversion) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    _Float16 h;
    const auto u = uint16_t(b);
    std::memcpy(&h, &u, 2);
    const float want = float(h), got = float(float16_t::from_bits(u));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << b;
    } else {
      ASSERT_EQ(std::memcmp(&want, &got, 4), 0) << "widening 0x" << std::hex << b;
    }
  }
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 997) {
    float x;
    const auto u = uint32_t(b);
    std::memcpy(&x, &u, 4);
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    const uint16_t got = float16_t(x).bits;
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(float(float16_t::from_bits(got)))) << u;
    } else {
      ASSERT_EQ(got, want) << "narrowing 0x" << std::hex << u;
    }
  }
}
#endif

TEST(HalfTypes, AgreeWithTheKVCacheStorage) {
  std::mt19937_64 rng(7);
  const Tensor<float> x = random_tensor<float>({1, 1, 64, 8}, rng, 100.0);
  for (Dtype t : {Dtype::float16, Dtype::bfloat16}) {
    KVCache cache({.batch = 1, .kv_heads = 1, .capacity = 64, .head_dim = 8, .value_dim = 8, .dtype = t});
    cache.append(x.view4(), x.view4());
    Tensor<float> k({1, 64, 8}), v({1, 64, 8});
    cache.read(0, k.view<3>(), v.view<3>());
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(k[i], t == Dtype::float16 ? float(float16_t(x[i])) : float(bfloat16_t(x[i]))) << i;
  }
}

// The bulk conversions give the scalar conversions' bits, element by element
// (random values over the whole range, ties, subnormals, ±∞, NaN), across
// block edges and unaligned starts, the same for 1, 2 and 3 threads; bad
// arguments are refused by name.
// f() throws attn::InvalidArgument whose message contains `what`.
template <class F>
void expect_invalid(const F& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error naming " << what;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

template <class Hf>
void bulk_conversions_match_scalar() {
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<uint32_t> bits;
  const int64_t n = 70001;  // past the parallel threshold, and not a whole number of blocks
  std::vector<float> x(size_t(n) + 1);
  for (float& v : x) {
    const uint32_t b = bits(rng);
    std::memcpy(&v, &b, 4);
  }
  const float special[] = {0.0f, -0.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-9f, 65504.0f, 65520.0f, 0x1p-140f, -0x1p-20f,
                           INFINITY, -INFINITY, NAN, -NAN};
  std::copy(std::begin(special), std::end(special), x.begin() + 3);
  std::vector<Hf> h(x.size()), h2(x.size());
  std::vector<float> w(x.size()), w2(x.size());
  from_float(x.data() + 1, n, h.data() + 1, 2);  // unaligned starts
  to_float(h.data() + 1, n, w.data() + 1, 2);
  for (int64_t i = 1; i <= n; ++i) {
    ASSERT_EQ(h[size_t(i)].bits, Hf(x[size_t(i)]).bits) << i;
    const float want = float(h[size_t(i)]);
    ASSERT_EQ(std::memcmp(&w[size_t(i)], &want, 4), 0) << i;
  }
  for (int threads : {1, 3}) {
    from_float(x.data() + 1, n, h2.data() + 1, threads);
    to_float(h.data() + 1, n, w2.data() + 1, threads);
    ASSERT_EQ(std::memcmp(h2.data(), h.data(), h.size() * 2), 0) << threads;
    ASSERT_EQ(std::memcmp(w2.data(), w.data(), w.size() * 4), 0) << threads;
  }
  expect_invalid([&] { from_float(x.data(), -1, h.data()); }, "'n'");
  expect_invalid([&] { from_float(nullptr, 4, h.data()); }, "'src'");
  expect_invalid([&] { to_float(h.data(), 4, nullptr); }, "'dst'");
  expect_invalid([&] { to_float(h.data(), 4, w.data(), -1); }, "num_threads");
  // float32 values over their own bits, and half values inside the float32 buffer they widen into.
  expect_invalid([&] { from_float(x.data(), 4, reinterpret_cast<Hf*>(x.data() + 1)); }, "overlap");
  expect_invalid([&] { to_float(reinterpret_cast<const Hf*>(w.data() + 3), 4, w.data()); }, "overlap");
  from_float(x.data(), 0, static_cast<Hf*>(nullptr));  // nothing to do
}

TEST(HalfTypes, BulkConversionsGiveTheScalarBits) {
  bulk_conversions_match_scalar<float16_t>();
  bulk_conversions_match_scalar<bfloat16_t>();
}

// The bfloat16 rows' two loops (the baseline one, and the AVX-512 one where
// the CPU runs it) give the scalar conversions' bits, at every length and
// start around a vector's width.
TEST(HalfTypes, BfloatRowsGiveTheScalarBitsOnBothLoops) {
  std::mt19937_64 rng(12);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> x(4099);
  for (float& v : x) {
    const uint32_t b = bits(rng);
    std::memcpy(&v, &b, 4);
  }
  const float special[] = {0.0f, -0.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-9f, 1.0f + 3 * 0x1p-9f, 0x1p-140f, -0x1p-130f,
                           0x1.fffffep127f, INFINITY, -INFINITY, NAN, -NAN};
  std::copy(std::begin(special), std::end(special), x.begin() + 5);
  std::vector<bool> loops{false};
  if (detail::bf16_rows_wide()) loops.push_back(true);
  RecordProperty("avx512_loop", detail::bf16_rows_wide() ? "ran" : "not on this CPU");
  for (bool wide : loops)
    for (int64_t start : {0, 1, 7})
      for (int64_t n : {int64_t(0), int64_t(1), int64_t(15), int64_t(16), int64_t(17), int64_t(63), int64_t(4090)}) {
        std::vector<uint16_t> h(size_t(n) + 1, 0xABCD);
        std::vector<float> w(size_t(n) + 1, 7.0f);
        detail::bf16_round_rows(x.data() + start, n, h.data(), wide);
        detail::bf16_widen_rows(h.data(), n, w.data(), wide);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(h[size_t(i)], bfloat16_t(x[size_t(start + i)]).bits) << wide << " " << start << " " << i;
          const float want = float(bfloat16_t::from_bits(h[size_t(i)]));
          ASSERT_EQ(std::memcmp(&w[size_t(i)], &want, 4), 0) << wide << " " << start << " " << i;
        }
        EXPECT_EQ(h[size_t(n)], 0xABCD) << "wrote past n";
        EXPECT_EQ(w[size_t(n)], 7.0f) << "wrote past n";
      }
}

// ---- a half case: the float32 case rounded, and the same values in Hf ---------

// Rounds the float32 buffer to Hf in place and returns the Hf copy.
template <class Hf>
Tensor<Hf> round_to(Strided<float>& x) {
  Tensor<Hf> h({int64_t(x.size())});
  for (size_t i = 0; i < x.size(); ++i) {
    h[i] = Hf(x[i]);
    x[i] = float(h[i]);
  }
  return h;
}

// The view of `h` with the layout `v` has in `buf`.
template <class Hf>
View4<const Hf> same_layout(const Tensor<Hf>& h, const Strided<float>& buf, const View4<const float>& v) {
  return View4<const Hf>(h.data() + (v.data - buf.data()), v.shape, v.strides);
}

template <class Hf>
struct HalfCase {
  SdpaCase<float> f;  // q, k, v hold Hf-rounded values
  Tensor<Hf> qh, kh, vh;
  Tensor<float> alibi, sinks;
  HalfCase(const CaseShape& s, std::mt19937_64& rng, double stddev = 1.0) : f(s, rng, stddev) {
    qh = round_to<Hf>(f.qbuf), kh = round_to<Hf>(f.kbuf), vh = round_to<Hf>(f.vbuf);
    // The exact arithmetic (bfloat16 inputs otherwise compute with bfloat16
    // products: test_bf16_compute.cpp).
    f.opt.compute_dtype = Dtype::float32;
  }
  // The half request: f's masks, variants and options, Hf q, k, v.
  SdpaArgs<Hf> args() const {
    SdpaArgs<Hf> a;
    a.q = same_layout(qh, f.qbuf, f.args.q);
    a.k = same_layout(kh, f.kbuf, f.args.k);
    a.v = same_layout(vh, f.vbuf, f.args.v);
    a.mask = f.args.mask, a.bias = f.args.bias, a.key_lengths = f.args.key_lengths;
    a.alibi_slopes = f.args.alibi_slopes, a.sinks = f.args.sinks;
    return a;
  }
  void add_variants(std::mt19937_64& rng) {
    alibi = random_tensor<float>({f.s.H}, rng, 0.3);
    sinks = random_tensor<float>({f.s.H}, rng, 1.0);
    for (size_t i = 0; i < alibi.size(); ++i) alibi[i] = std::abs(alibi[i]);
    f.args.alibi_slopes = alibi.view<1>();
    f.args.sinks = sinks.view<1>();
    f.opt.window = {9, 3};
    f.opt.softcap = 4.0;
  }
};

// Forward and backward results, contiguous.
struct Run {
  Tensor<float> out, lse, dq, dk, dv, dbias, dsinks;
};

template <class T>
Run run(const SdpaArgs<T>& a, const SdpaOptions& opt, const Tensor<float>& dout) {
  const int64_t B = a.q.dim(0), H = a.q.dim(1), L = a.q.dim(2), E = a.q.dim(3);
  const int64_t Hkv = a.k.dim(1), S = a.k.dim(2), Ev = a.v.dim(3);
  Run r{Tensor<float>({B, H, L, Ev}), Tensor<float>({B, H, L}), Tensor<float>({B, H, L, E}),
        Tensor<float>({B, Hkv, S, E}), Tensor<float>({B, Hkv, S, Ev}), {}, {}};
  scaled_dot_product_attention(a, {r.out.view4(), {}, r.lse.view<3>()}, opt);
  SdpaGrads<float> g{r.dq.view4(), r.dk.view4(), r.dv.view4()};
  if (!a.bias.empty()) {
    r.dbias = Tensor<float>({a.bias.dim(0), a.bias.dim(1), a.bias.dim(2), a.bias.dim(3)});
    g.dbias = r.dbias.view4();
  }
  if (!a.sinks.empty()) {
    r.dsinks = Tensor<float>({H});
    g.dsinks = r.dsinks.view<1>();
  }
  scaled_dot_product_attention_backward(a, dout.view4(), {r.out.view4(), r.lse.view<3>()}, g, opt);
  return r;
}

template <class T, int R>
Tensor<double> to_double(const View<const T, R>& v) {
  Tensor<double> t(std::vector<int64_t>(v.shape.begin(), v.shape.end()));
  size_t f = 0;
  detail::for_each(v, [&](T x, const std::array<int64_t, R>&) { t[f++] = double(x); });
  return t;
}

// The reference backend in double on the (rounded) float32 request.
struct RefRun {
  Tensor<double> out, lse, dq, dk, dv;
};
RefRun reference(const SdpaArgs<float>& a, SdpaOptions opt, const Tensor<float>& dout) {
  const Tensor<double> q = to_double(a.q), k = to_double(a.k), v = to_double(a.v);
  Tensor<double> bias, alibi, sinks;
  SdpaArgs<double> d;
  d.q = q.view4(), d.k = k.view4(), d.v = v.view4(), d.mask = a.mask, d.key_lengths = a.key_lengths;
  if (!a.bias.empty()) bias = to_double(a.bias), d.bias = bias.view4();
  if (!a.alibi_slopes.empty()) alibi = to_double(a.alibi_slopes), d.alibi_slopes = alibi.view<1>();
  if (!a.sinks.empty()) sinks = to_double(a.sinks), d.sinks = sinks.view<1>();
  opt.backend = Backend::reference;
  RefRun r{Tensor<double>({q.dim(0), q.dim(1), q.dim(2), v.dim(3)}), Tensor<double>({q.dim(0), q.dim(1), q.dim(2)}),
           Tensor<double>(q.shape()), Tensor<double>(k.shape()), Tensor<double>(v.shape())};
  scaled_dot_product_attention(d, {r.out.view4(), {}, r.lse.view<3>()}, opt);
  const Tensor<double> g = to_double(dout.view4());
  scaled_dot_product_attention_backward(d, g.view4(), {}, {r.dq.view4(), r.dk.view4(), r.dv.view4()}, opt);
  return r;
}

bool bitwise_equal(const Tensor<float>& a, const Tensor<float>& b) {
  return a.size() == b.size() && (a.size() == 0 || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

template <class Hf>
void expect_matches(const HalfCase<Hf>& c, const std::string& what, std::mt19937_64& rng) {
  const SdpaOptions& opt = c.f.opt;
  const Tensor<float> dout = random_tensor<float>({c.f.s.B, c.f.s.H, c.f.s.L, c.f.s.Ev}, rng);
  const Run half = run(c.args(), opt, dout);
  const Run f32 = run(c.f.args, opt, dout);
  // The float32 call on the rounded values, bit for bit.
  EXPECT_TRUE(bitwise_equal(half.out, f32.out)) << what << ": out";
  EXPECT_TRUE(bitwise_equal(half.lse, f32.lse)) << what << ": lse";
  EXPECT_TRUE(bitwise_equal(half.dq, f32.dq)) << what << ": dq";
  EXPECT_TRUE(bitwise_equal(half.dk, f32.dk)) << what << ": dk";
  EXPECT_TRUE(bitwise_equal(half.dv, f32.dv)) << what << ": dv";
  EXPECT_TRUE(bitwise_equal(half.dbias, f32.dbias)) << what << ": dbias";
  EXPECT_TRUE(bitwise_equal(half.dsinks, f32.dsinks)) << what << ": dsinks";
  // The exact attention of the rounded values, to float32's bound.
  const RefRun ref = reference(c.f.args, opt, dout);
  const int64_t n = c.f.s.S + c.f.s.E;
  EXPECT_TRUE(all_close(half.out, ref.out, tolerance<float>(n, 1.0, 40), what + " out"));
  EXPECT_TRUE(all_close(half.lse, ref.lse, tolerance<float>(n, max_abs(ref.lse.view<3>()), 40), what + " lse"));
  EXPECT_TRUE(all_close(half.dq, ref.dq, tolerance<float>(n, max_abs(ref.dq.view4()), 80), what + " dq"));
  EXPECT_TRUE(all_close(half.dk, ref.dk, tolerance<float>(n, max_abs(ref.dk.view4()), 80), what + " dk"));
  EXPECT_TRUE(all_close(half.dv, ref.dv, tolerance<float>(n, max_abs(ref.dv.view4()), 80), what + " dv"));
}

template <class Hf>
class HalfInputs : public ::testing::Test {};
using HalfTypesList = ::testing::Types<float16_t, bfloat16_t>;
TYPED_TEST_SUITE(HalfInputs, HalfTypesList);

// The widened route (fused and reference) on awkward shapes, layouts, masks.
TYPED_TEST(HalfInputs, EqualTheFloat32CallOnTheRoundedValues) {
  std::mt19937_64 rng(13);
  struct Config {
    CaseShape s;
    MaskKind mask;
    bool causal;
    CausalAlign align;
    Backend backend;
    bool variants;
  };
  const Config configs[] = {
      {{.B = 2, .H = 4, .Hkv = 2, .L = 37, .S = 53, .E = 24, .Ev = 20}, MaskKind::none, false, CausalAlign::top_left,
       Backend::automatic, false},
      {{.B = 1, .H = 3, .Hkv = 1, .L = 45, .S = 30, .E = 16, .Ev = 16, .layout = Layout::bnhd}, MaskKind::none, true,
       CausalAlign::top_left, Backend::fused, false},
      {{.B = 2, .H = 2, .Hkv = 2, .L = 40, .S = 70, .E = 9, .Ev = 5, .pad = 3}, MaskKind::bool_full, true,
       CausalAlign::bottom_right, Backend::automatic, false},
      {{.B = 2, .H = 4, .Hkv = 4, .L = 36, .S = 29, .E = 8, .Ev = 12}, MaskKind::bias_broadcast, false,
       CausalAlign::top_left, Backend::automatic, false},
      {{.B = 3, .H = 2, .Hkv = 1, .L = 33, .S = 41, .E = 16, .Ev = 8, .layout = Layout::bnhd}, MaskKind::key_lengths, false,
       CausalAlign::top_left, Backend::automatic, true},
      {{.B = 1, .H = 2, .Hkv = 1, .L = 34, .S = 19, .E = 7, .Ev = 6}, MaskKind::bool_broadcast, false,
       CausalAlign::top_left, Backend::reference, true},
  };
  for (const Config& cfg : configs) {
    HalfCase<TypeParam> c(cfg.s, rng);
    c.f.add_mask(cfg.mask, rng);
    if (cfg.variants) c.add_variants(rng);
    c.f.opt.causal = cfg.causal;
    c.f.opt.causal_align = cfg.align;
    c.f.opt.backend = cfg.backend;
    const std::string what = "L=" + std::to_string(cfg.s.L) + " S=" + std::to_string(cfg.s.S) + " mask " +
                             std::to_string(int(cfg.mask)) + " backend " + backend_name(cfg.backend);
    expect_matches(c, what, rng);
  }
}

// Few query rows: the decode route reads the half K and V in place.
TYPED_TEST(HalfInputs, DecodeRouteEqualsTheFloat32Call) {
  std::mt19937_64 rng(17);
  for (int64_t L : {1, 3}) {
    HalfCase<TypeParam> c({.B = 2, .H = 8, .Hkv = 2, .L = L, .S = 700, .E = 40, .Ev = 24}, rng);
    c.f.opt.causal = true;
    c.f.opt.causal_align = CausalAlign::bottom_right;
    c.f.add_mask(MaskKind::key_lengths, rng);  // batch 0 sees no key
    expect_matches(c, "decode L=" + std::to_string(L), rng);
    // Batch 0 sees no key: output 0, lse -inf.
    Tensor<float> out({2, 8, L, 24}), lse({2, 8, L});
    scaled_dot_product_attention(c.args(), {out.view4(), {}, lse.view<3>()}, c.f.opt);
    for (int64_t h = 0; h < 8; ++h) {
      EXPECT_EQ(lse.view<3>()(0, h, 0), -std::numeric_limits<float>::infinity());
      EXPECT_EQ(out.view4()(0, h, 0, 0), 0.0f);
    }
    // Any thread count, the same bits.
    for (int threads : {1, 3}) {
      SdpaOptions o = c.f.opt;
      o.num_threads = threads;
      Tensor<float> o2({2, 8, L, 24});
      scaled_dot_product_attention(c.args(), {o2.view4()}, o);
      EXPECT_TRUE(bitwise_equal(o2, out)) << threads << " threads";
    }
  }
}

// A row whose visible key (or query) is NaN is NaN; the others are untouched.
TYPED_TEST(HalfInputs, NaNReachesOnlyTheRowsItTouches) {
  std::mt19937_64 rng(19);
  for (int64_t L : {2, 40}) {  // the decode route and the widened fused route
    HalfCase<TypeParam> c({.B = 1, .H = 2, .Hkv = 1, .L = L, .S = 50, .E = 8, .Ev = 8}, rng);
    c.f.opt.causal = true;
    c.f.opt.causal_align = CausalAlign::bottom_right;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    c.qh[size_t(1 * 8 + 3)] = TypeParam(nan);  // q(0, 0, 1, 3)
    c.f.qbuf[size_t(1 * 8 + 3)] = nan;
    Tensor<float> out({1, 2, L, 8}), lse({1, 2, L});
    scaled_dot_product_attention(c.args(), {out.view4(), {}, lse.view<3>()}, c.f.opt);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < L; ++i) {
        const bool poisoned = h == 0 && i == 1;
        EXPECT_EQ(std::isnan(lse.view<3>()(0, h, i)), poisoned) << h << " " << i;
        for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(std::isnan(out.view4()(0, h, i, e)), poisoned);
      }
    // Backward: the NaN query row's gradient is NaN, and every key it sees gets NaN in dk.
    const Tensor<float> dout = random_tensor<float>({1, 2, L, 8}, rng);
    const Run r = run(c.args(), c.f.opt, dout);
    EXPECT_TRUE(std::isnan(r.dq.view4()(0, 0, 1, 0)));
    EXPECT_FALSE(std::isnan(r.dq.view4()(0, 0, 0, 0)));
    EXPECT_TRUE(std::isnan(r.dk.view4()(0, 0, 0, 0)));
    // check_finite refuses it, naming q.
    SdpaOptions strict = c.f.opt;
    strict.check_finite = true;
    try {
      scaled_dot_product_attention(c.args(), {out.view4()}, strict);
      ADD_FAILURE() << "check_finite accepted a NaN";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("argument 'q' contains NaN"), std::string::npos) << e.what();
    }
  }
}

TYPED_TEST(HalfInputs, BadArgumentsNameTheArgument) {
  std::mt19937_64 rng(23);
  HalfCase<TypeParam> c({.B = 1, .H = 2, .Hkv = 1, .L = 4, .S = 6, .E = 8, .Ev = 8}, rng);
  SdpaArgs<TypeParam> a = c.args();
  a.k.shape[3] = 7;
  Tensor<float> out({1, 2, 4, 8});
  try {
    scaled_dot_product_attention(a, {out.view4()});
    ADD_FAILURE() << "a mismatched k was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'k' has shape (1, 1, 6, 7)"), std::string::npos) << e.what();
  }
  Tensor<float> small({1, 2, 4, 7});
  EXPECT_THROW(scaled_dot_product_attention(c.args(), {small.view4()}), InvalidArgument);
  EXPECT_EQ(resolve_backend(c.args(), {}), Backend::fused);
}

}  // namespace
