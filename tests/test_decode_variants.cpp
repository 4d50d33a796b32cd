// The score-rule variants in decoding (sliding window, soft-cap, ALiBi,
// sinks, a boolean mask, an additive bias) over the KV cache and through the dense call's decode route. The
// oracle is the reference backend on the cache's stored values, with the
// window and ALiBi written independently as a boolean mask and an additive
// bias (decode_case.hpp). Also: split-KV bitwise for any thread count, keys
// outside a window never touched (a NaN there changes nothing), poisoned
// inputs not hidden by the soft-cap, rows that see no key (output 0, lse the
// sink or −inf), the chunked-prefill path, half storage, and argument errors.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>

#include "decode_case.hpp"
#include "kernels/decode/decode.hpp"
#include "testing.hpp"

namespace {

using namespace attn;
using namespace attn::testing;

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// Random variants on a case: window sides from none to a few keys, causal
// or not, a soft-cap, ALiBi slopes and sinks (some −inf), each on or off.
void add_variants(DecodeCase& c, std::mt19937_64& rng) {
  const int64_t lefts[] = {-1, 0, 1, 3, 17, 60};
  const int64_t rights[] = {-1, 0, 2, 9};
  std::uniform_int_distribution<int> pick6(0, 5), pick4(0, 3), coin(0, 1);
  c.window.left = lefts[pick6(rng)];
  c.window.right = c.causal ? -1 : rights[pick4(rng)];
  c.softcap = coin(rng) ? 0.0 : 1.5;
  std::uniform_real_distribution<float> u(0.05f, 1.0f), sink(-2.0f, 3.0f);
  c.slopes.clear(), c.sinks.clear();
  if (coin(rng))
    for (int64_t h = 0; h < c.H; ++h) c.slopes.push_back(u(rng));
  if (coin(rng))
    for (int64_t h = 0; h < c.H; ++h) c.sinks.push_back(h % 3 == 2 ? -kInf : sink(rng));
}

TEST(DecodeVariants, RandomCasesMatchTheMaskAndBiasOracle) {
  std::mt19937_64 rng(31);
  for (int i = 0; i < 300; ++i) {
    DecodeCase c = random_case(rng);
    c.dtype = Dtype(i % 3);
    add_variants(c, rng);
    SCOPED_TRACE(c.str());
    const Filled f = fill(c, rng);
    expect_matches_oracle(c, f, run(c, f));
    if (::testing::Test::HasFailure()) break;
  }
}

// A random boolean mask (about 1 key in 5 hidden) and a random bias (some
// −inf) of random broadcast shapes over the cache's key positions.
void add_mask_and_bias(DecodeCase& c, std::mt19937_64& rng) {
  const int64_t C = c.capacity();
  std::uniform_int_distribution<int> pick(0, 4);
  const auto shape = [&]() -> std::vector<int64_t> {
    switch (pick(rng)) {
      case 0: return {c.B, 1, c.L, C};
      case 1: return {1, c.H, 1, C};
      case 2: return {1, 1, 1, C};
      case 3: return {c.B, c.H, c.L, 1};
      default: return {c.B, c.H, c.L, C};
    }
  };
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::normal_distribution<float> n;
  if (pick(rng) < 4) {
    c.mask = Tensor<bool>(shape());
    for (size_t e = 0; e < c.mask.size(); ++e) c.mask[e] = u(rng) > 0.2f;
  }
  if (pick(rng) < 3) {
    c.bias = Tensor<float>(shape());
    for (size_t e = 0; e < c.bias.size(); ++e) c.bias[e] = u(rng) < 0.1f ? -kInf : n(rng);
  }
}

TEST(DecodeVariants, MasksAndBiasesMatchTheOracle) {
  std::mt19937_64 rng(39);
  for (int i = 0; i < 200; ++i) {
    DecodeCase c = random_case(rng);
    c.dtype = Dtype(i % 3);
    if (i % 10 == 0) c.L = 40 + i % 7, c.H = c.Hkv * 4;  // chunked prefill
    if (i % 2) add_variants(c, rng);
    add_mask_and_bias(c, rng);
    SCOPED_TRACE(c.str());
    const Filled f = fill(c, rng);
    expect_matches_oracle(c, f, run(c, f));
    if (::testing::Test::HasFailure()) break;
  }
}

// A key the mask or a −inf bias hides never touches the row: NaN in its
// value and ±inf in its key change no bit; the same key visible poisons.
TEST(DecodeVariants, KeysTheMaskHidesAreNeverTouched) {
  std::mt19937_64 rng(40);
  for (const int64_t L : {int64_t(1), int64_t(3), int64_t(40)})
    for (const bool by_bias : {false, true}) {
      DecodeCase c;
      c.B = 1, c.H = 8, c.Hkv = 2, c.L = L, c.E = c.Ev = 16, c.page = 32, c.lens = {700};
      const int64_t hidden = 300;  // seen by every query under the causal rule
      if (by_bias) {
        c.bias = Tensor<float>({1, 1, 1, 700});
        c.bias[size_t(hidden)] = -kInf;
      } else {
        c.mask = Tensor<bool>({1, 1, 1, 700});
        for (size_t e = 0; e < c.mask.size(); ++e) c.mask[e] = e != size_t(hidden);
      }
      SCOPED_TRACE(c.str());
      Filled f = fill(c, rng);
      const Result clean = run(c, f);
      expect_matches_oracle(c, f, clean);
      for (int64_t hk = 0; hk < c.Hkv; ++hk) {
        f.k[0][size_t((hk * 700 + hidden) * c.E + 1)] = kInf;
        f.v[0][size_t((hk * 700 + hidden) * c.Ev + 2)] = kNaN;
      }
      KVCache poisoned(config_of(c));
      poisoned.append(0, f.k[0].view<3>(), f.v[0].view<3>());
      const Result r = run_on(c, poisoned, f.q);
      EXPECT_TRUE(bitwise_equal(r.out, clean.out));
      EXPECT_TRUE(bitwise_equal(r.lse, clean.lse));
      DecodeCase open = c;  // no mask, no bias: the key is seen and poisons every row
      open.mask = Tensor<bool>(), open.bias = Tensor<float>();
      const Result p = run_on(open, poisoned, f.q);
      for (size_t e = 0; e < p.lse.size(); ++e) ASSERT_TRUE(std::isnan(p.lse[e])) << e;
    }
}

// Each variant alone and all together, on long sequences cut into several
// chunks (split-KV) and pages: the oracle, then the same bits for 1, 2, 3
// and 8 threads.
TEST(DecodeVariants, LongCachesSplitBitwiseForAnyThreadCount) {
  std::mt19937_64 rng(32);
  for (int which = 0; which < 6; ++which) {
    DecodeCase c;
    c.B = 2, c.H = 8, c.Hkv = 2, c.L = which % 2 ? 3 : 1, c.E = c.Ev = 32, c.page = 48;
    c.dtype = which == 5 ? Dtype::bfloat16 : Dtype::float32;
    c.lens = {2500, 777};
    if (which == 0 || which >= 4) c.window.left = 1000;
    if (which == 1 || which >= 4) c.softcap = 2.0;
    if (which == 2 || which >= 4)
      for (int64_t h = 0; h < c.H; ++h) c.slopes.push_back(0.001f * float(h + 1));
    if (which == 3 || which >= 4)
      for (int64_t h = 0; h < c.H; ++h) c.sinks.push_back(0.5f * float(h) - 1.0f);
    if (which == 4) {  // and a mask and a bias (some −inf) over the 2500 key positions
      c.mask = Tensor<bool>({c.B, 1, 1, 2500});
      c.bias = Tensor<float>({1, c.H, 1, 2500});
      for (size_t e = 0; e < c.mask.size(); ++e) c.mask[e] = (e * 2654435761u) % 7 != 0;
      for (size_t e = 0; e < c.bias.size(); ++e) c.bias[e] = e % 11 == 0 ? -kInf : 0.01f * float(e % 13);
    }
    SCOPED_TRACE(c.str());
    const Filled f = fill(c, rng);
    DecodeCall o;
    o.num_threads = 1;
    const Result base = run(c, f, o);
    expect_matches_oracle(c, f, base);
    for (const int threads : {1, 2, 3, 8}) {
      o.num_threads = threads;
      const Result r = run(c, f, o);
      EXPECT_TRUE(bitwise_equal(r.out, base.out)) << threads << " threads";
      EXPECT_TRUE(bitwise_equal(r.lse, base.lse)) << threads << " threads";
    }
  }
}

// A sliding window reads only its keys: NaN in every key and value outside
// the window of every query changes no bit of the result.
TEST(DecodeVariants, KeysOutsideTheWindowAreNeverRead) {
  std::mt19937_64 rng(33);
  for (const Dtype t : {Dtype::float32, Dtype::float16})
    for (const int64_t L : {int64_t(1), int64_t(5), int64_t(40)}) {  // 40: the chunked-prefill path
      DecodeCase c;
      c.B = 1, c.H = 4, c.Hkv = 2, c.L = L, c.E = c.Ev = 16, c.page = 64, c.dtype = t, c.lens = {3000};
      c.window.left = 300;
      SCOPED_TRACE(c.str());
      Filled f = fill(c, rng);
      const Result clean = run(c, f);
      expect_matches_oracle(c, f, clean);
      const int64_t first_seen = 3000 - L - 300;  // query 0 sits at 3000 − L
      for (int64_t hk = 0; hk < c.Hkv; ++hk)
        for (int64_t j = 0; j < first_seen; ++j) {
          for (int64_t e = 0; e < c.E; ++e) f.k[0][size_t((hk * 3000 + j) * c.E + e)] = kNaN;
          for (int64_t e = 0; e < c.Ev; ++e) f.v[0][size_t((hk * 3000 + j) * c.Ev + e)] = kNaN;
        }
      KVCache poisoned(config_of(c));
      poisoned.append(0, f.k[0].view<3>(), f.v[0].view<3>());
      const Result r = run_on(c, poisoned, f.q);
      EXPECT_TRUE(bitwise_equal(r.out, clean.out));
      EXPECT_TRUE(bitwise_equal(r.lse, clean.lse));
    }
}

// The soft-cap maps ±inf to ±c, a plausible score: an infinite key the row
// sees must still poison it (and only the rows that see it).
TEST(DecodeVariants, SoftcapDoesNotHidePoisonedKeys) {
  std::mt19937_64 rng(34);
  for (const float bad : {kInf, -kInf, kNaN})
    for (const int64_t L : {int64_t(3), int64_t(40)}) {
      DecodeCase c;
      c.B = 1, c.H = 4, c.Hkv = 2, c.L = L, c.E = c.Ev = 8, c.page = 16, c.lens = {60};
      c.softcap = 1.0;
      Filled f = fill(c, rng);
      f.k[0][size_t((1 * 60 + 59) * c.E + 2)] = bad;  // kv head 1, the last key: only the last row sees it
      KVCache cache(config_of(c));
      cache.append(0, f.k[0].view<3>(), f.v[0].view<3>());
      const Result r = run_on(c, cache, f.q);
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.L; ++i) {
          const bool poisoned = h >= 2 && i == L - 1;
          const size_t row = size_t(h * c.L + i);
          EXPECT_EQ(std::isnan(r.lse[row]), poisoned) << bad << " L " << L << " head " << h << " row " << i;
          EXPECT_EQ(std::isnan(r.out[row * size_t(c.Ev)]), poisoned) << bad << " L " << L << " head " << h << " row " << i;
        }
    }
}

// A row that sees no key (an empty sequence; a causal query before the
// first key) gets output 0 and lse = its head's sink, or −inf without one.
TEST(DecodeVariants, RowsThatSeeNoKeyGetTheSinkOrMinusInfinity) {
  std::mt19937_64 rng(35);
  for (const int64_t L : {int64_t(6), int64_t(40)}) {
    DecodeCase c;
    c.B = 3, c.H = 4, c.Hkv = 2, c.L = L, c.E = c.Ev = 8, c.lens = {0, 2, 50};
    c.sinks = {0.25f, -kInf, 1.5f, -3.0f};
    SCOPED_TRACE(c.str());
    const Filled f = fill(c, rng);
    const Result r = run(c, f);
    expect_matches_oracle(c, f, r);
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.L; ++i) {
        // Sequence 0 is empty; in sequence 1 query i sits at 2 − L + i and
        // sees no key while that is negative.
        for (const int64_t b : {int64_t(0), int64_t(1)}) {
          if (b == 1 && 2 - L + i >= 0) continue;
          const size_t row = size_t((b * c.H + h) * c.L + i);
          EXPECT_EQ(r.lse[row], c.sinks[size_t(h)]) << "b " << b << " h " << h << " i " << i;
          for (int64_t e = 0; e < c.Ev; ++e) ASSERT_EQ(r.out[row * size_t(c.Ev) + size_t(e)], 0.0f);
        }
      }
  }
}

// Chunked prefill (many new rows: the fused kernel over chunks of the
// cache) with each variant, contiguous and paged, every storage type.
TEST(DecodeVariants, ChunkedPrefillMatchesTheOracle) {
  std::mt19937_64 rng(36);
  int n = 0;
  for (const Dtype t : {Dtype::float32, Dtype::float16, Dtype::bfloat16})
    for (const int64_t page : {int64_t(0), int64_t(300)})
      for (int which = 0; which < 3; ++which) {
        DecodeCase c;
        c.B = 3, c.H = 4, c.Hkv = 2, c.L = 45, c.E = 24, c.Ev = 16, c.page = page, c.dtype = t;
        c.causal = which != 2;
        c.lens = {4400 + n, 0, 30};       // two chunks of keys (4096 each at most)
        if (which == 0) c.window.left = 4300;  // still two chunks, the sinks in the first
        if (which == 2) c.window = {400, 20};
        c.softcap = which == 1 ? 3.0 : 0.0;
        for (int64_t h = 0; which >= 1 && h < c.H; ++h) c.slopes.push_back(0.01f * float(h + 1));
        // Sinks near the log of the key count weigh like many keys: a sink
        // counted in each chunk instead of once moves the output visibly.
        for (int64_t h = 0; which != 1 && h < c.H; ++h) c.sinks.push_back(float(h) + 6.0f);
        ASSERT_FALSE(detail::decode_suits_rows(c.L, c.H / c.Hkv));
        SCOPED_TRACE(c.str());
        const Filled f = fill(c, rng);
        expect_matches_oracle(c, f, run(c, f));
        ++n;
      }
}

// Half storage with the variants gives the float32 call's bits on the
// rounded values (the kernel's widening is exact; the rules run in float32),
// although half storage interleaves the values of a tile with the scores of
// the next and float32 runs them in turn: with a window, the soft-cap, ALiBi
// and sinks on pages that cut the tiles, and with a mask and a bias whose
// holes send tiles row by row, on whole tiles of 128 keys.
TEST(DecodeVariants, HalfStorageGivesTheFloat32BitsOnRoundedValues) {
  std::mt19937_64 rng(37);
  for (const Dtype t : {Dtype::float16, Dtype::bfloat16})
    for (const bool holes : {false, true}) {
      DecodeCase c;
      c.B = 2, c.H = 8, c.Hkv = 2, c.L = 2, c.E = 64, c.Ev = 33, c.page = 40, c.dtype = t, c.lens = {900, 130};
      if (!holes) {
        c.window.left = 200, c.softcap = 2.0;
        for (int64_t h = 0; h < c.H; ++h) c.slopes.push_back(0.02f * float(h + 1)), c.sinks.push_back(0.1f * float(h));
      } else {
        c.L = 3, c.E = c.Ev = 128, c.page = 0;
        c.mask = Tensor<bool>({c.B, 1, c.L, c.capacity()});
        c.bias = Tensor<float>({1, c.H, 1, c.capacity()});
        for (size_t e = 0; e < c.mask.size(); ++e) c.mask[e] = (e * 2654435761u) % 9 != 0;
        for (size_t e = 0; e < c.bias.size(); ++e) c.bias[e] = e % 37 == 0 ? -kInf : 0.01f * float(e % 13);
      }
      SCOPED_TRACE(c.str());
      const Filled f = fill(c, rng);  // f.k, f.v hold the rounded values
      DecodeCase c32 = c;
      c32.dtype = Dtype::float32;
      KVCache cache32(config_of(c32));
      for (int64_t b = 0; b < c.B; ++b) {
        const int64_t n = c.lens[size_t(b)];
        cache32.append(b, View3<const float>(f.k[size_t(b)].data(), {c.Hkv, n, c.E}),
                       View3<const float>(f.v[size_t(b)].data(), {c.Hkv, n, c.Ev}));
      }
      const Result half = run(c, f), full = run_on(c32, cache32, f.q);
      expect_matches_oracle(c, f, half);
      EXPECT_TRUE(bitwise_equal(half.out, full.out)) << dtype_name(t);
      EXPECT_TRUE(bitwise_equal(half.lse, full.lse)) << dtype_name(t);
    }
}

// scaled_dot_product_attention with few query rows and the variants takes
// the decode kernel (bitwise its result) and matches the reference, in
// both layouts, with key lengths and position offsets.
TEST(DecodeVariants, DenseCallTakesTheKernelWithVariants) {
  std::mt19937_64 rng(38);
  for (int i = 0; i < 40; ++i) {
    const int64_t Hkv = 1 + i % 3, H = Hkv * (int64_t(1) << (i % 4)), B = 1 + i % 2;
    const int64_t L = 1 + i % 9, S = 1 + (i * 37) % 700, E = 8 + i % 5 * 8, Ev = E + (i % 2) * 8;
    Tensor<float> q = random_tensor<float>({B, H, L, E}, rng);
    Tensor<float> k = random_tensor<float>({B, S, Hkv, E}, rng), v = random_tensor<float>({B, S, Hkv, Ev}, rng);
    Tensor<int64_t> kl({B});
    for (int64_t b = 0; b < B; ++b) kl[size_t(b)] = std::uniform_int_distribution<int64_t>(0, S)(rng);
    std::vector<float> slopes, sinks;
    for (int64_t h = 0; h < H; ++h) slopes.push_back(0.01f * float(h + 1)), sinks.push_back(0.3f * float(h % 4));
    SdpaArgs<float> a;
    a.q = q.view4();
    a.k = i % 3 == 0 ? View4<const float>::bnhd(k.data(), B, S, Hkv, E) : View4<const float>(k.data(), {B, Hkv, S, E});
    a.v = i % 3 == 0 ? View4<const float>::bnhd(v.data(), B, S, Hkv, Ev) : View4<const float>(v.data(), {B, Hkv, S, Ev});
    if (i % 4 == 1) a.key_lengths = kl.view<1>();
    if (i % 2 == 0) a.alibi_slopes = View1<const float>(slopes.data(), {H}, {1});
    if (i % 3 != 1) a.sinks = View1<const float>(sinks.data(), {H}, {1});
    Tensor<bool> mask({B, 1, L, S});
    for (size_t e = 0; e < mask.size(); ++e) mask[e] = (e * 7919) % 5 != 0;
    Tensor<float> bias = random_tensor<float>({1, H, L, S}, rng);
    if (i % 5 == 4) a.mask = mask.view4();
    if (i % 6 == 1) a.bias = bias.view4();
    SdpaOptions o;
    o.causal = i % 2 == 0;
    o.causal_align = i % 4 == 0 ? CausalAlign::top_left : CausalAlign::bottom_right;
    o.window = {int64_t(i % 5) * 40 - 1, o.causal ? -1 : int64_t(i % 3) * 7 - 1};
    o.softcap = i % 3 == 2 ? 2.5 : 0.0;
    if (i % 7 == 3) o.position_offset = S / 2;
    Tensor<float> out({B, H, L, Ev}), lse({B, H, L}), ref({B, H, L, Ev}), ref_lse({B, H, L});
    scaled_dot_product_attention(a, {out.view4(), {}, lse.view<3>()}, o);
    SdpaOptions ro = o;
    ro.backend = Backend::reference;
    scaled_dot_product_attention(a, {ref.view4(), {}, ref_lse.view<3>()}, ro);
    EXPECT_TRUE(all_close(out, ref, tolerance<float>(S + E, 1.0, 40), "out case " + std::to_string(i)));
    EXPECT_TRUE(all_close(lse, ref_lse, tolerance<float>(S + E, max_abs(ref_lse.view<3>()), 40), "lse case " + std::to_string(i)));
    const detail::Problem p = detail::make_problem(a, o);
    ASSERT_TRUE(detail::decode_suits_dense(p)) << "case " << i;
    Tensor<float> direct({B, H, L, Ev});
    detail::decode_forward_dense(p, a, direct.view4(), {});
    EXPECT_TRUE(bitwise_equal(direct, out)) << "case " << i;
  }
}

// The dense decode route reads K and V with any strides (features that are
// not contiguous are gathered per tile): the same bits as contiguous K/V.
// And the backward gives the same bits with the forward's saved out and lse
// or without them (it then recomputes them with the decode kernel too).
TEST(DecodeVariants, StridedFeaturesAndTheSavedStateDoNotChangeABit) {
  std::mt19937_64 rng(41);
  const int64_t B = 2, H = 4, Hkv = 2, L = 3, S = 200, E = 12, Ev = 8;
  Tensor<float> q = random_tensor<float>({B, H, L, E}, rng), k = random_tensor<float>({B, Hkv, S, E}, rng),
                v = random_tensor<float>({B, Hkv, S, Ev}, rng), bias = random_tensor<float>({B, 1, L, S}, rng);
  Tensor<float> k2({B, Hkv, S, E * 3}), v2({B, Hkv, S, Ev * 2});  // every third / second element
  for (size_t e = 0; e < k.size(); ++e) k2[3 * e] = k[e];
  for (size_t e = 0; e < v.size(); ++e) v2[2 * e] = v[e];
  std::vector<float> sinks{0.5f, -1.0f, 2.0f, 0.0f};
  SdpaArgs<float> a;
  a.q = q.view4(), a.k = k.view4(), a.v = v.view4(), a.bias = bias.view4();
  a.sinks = View1<const float>(sinks.data(), {H}, {1});
  SdpaArgs<float> a2 = a;
  a2.k = View4<const float>(k2.data(), {B, Hkv, S, E}, {Hkv * S * E * 3, S * E * 3, E * 3, 3});
  a2.v = View4<const float>(v2.data(), {B, Hkv, S, Ev}, {Hkv * S * Ev * 2, S * Ev * 2, Ev * 2, 2});
  SdpaOptions o;
  o.causal = true, o.causal_align = CausalAlign::bottom_right, o.window = {50, 0}, o.softcap = 3.0;
  Tensor<float> out({B, H, L, Ev}), lse({B, H, L}), out2({B, H, L, Ev}), lse2({B, H, L});
  scaled_dot_product_attention(a, {out.view4(), {}, lse.view<3>()}, o);
  scaled_dot_product_attention(a2, {out2.view4(), {}, lse2.view<3>()}, o);
  EXPECT_TRUE(bitwise_equal(out, out2));
  EXPECT_TRUE(bitwise_equal(lse, lse2));
  const detail::Problem p = detail::make_problem(a2, o);
  ASSERT_TRUE(detail::decode_suits_dense(p));
  Tensor<float> dout = random_tensor<float>({B, H, L, Ev}, rng);
  struct Grads {
    Tensor<float> dq, dk, dv, dbias, dsinks;
  };
  auto backward = [&](const SdpaSaved<float>& saved) {
    Grads g{Tensor<float>({B, H, L, E}), Tensor<float>({B, Hkv, S, E}), Tensor<float>({B, Hkv, S, Ev}),
            Tensor<float>({B, 1, L, S}), Tensor<float>({H})};
    scaled_dot_product_attention_backward(a, View4<const float>(dout.view4()), saved,
                                          {g.dq.view4(), g.dk.view4(), g.dv.view4(), g.dbias.view4(), g.dsinks.view<1>()}, o);
    return g;
  };
  const Grads with = backward({out.view4(), lse.view<3>()}), without = backward({});
  EXPECT_TRUE(bitwise_equal(with.dq, without.dq));
  EXPECT_TRUE(bitwise_equal(with.dk, without.dk));
  EXPECT_TRUE(bitwise_equal(with.dv, without.dv));
  EXPECT_TRUE(bitwise_equal(with.dbias, without.dbias));
  EXPECT_TRUE(bitwise_equal(with.dsinks, without.dsinks));
}

TEST(DecodeVariants, ArgumentErrors) {
  KVCacheConfig cfg;
  cfg.batch = 1, cfg.kv_heads = 2, cfg.capacity = 8, cfg.head_dim = 4;
  KVCache cache(cfg);
  Tensor<float> q({1, 4, 1, 4}), out({1, 4, 1, 4});
  auto call = [&](const DecodeCall& o) { return [&, o] { decode_call(q.view4(), cache, out.view4(), o); }; };
  DecodeCall o;
  o.window.left = -2;
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "option 'window.left' is -2, expected >= 0 or -1"}));
  o = {}, o.softcap = -1.0;
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "option 'softcap'"}));
  o = {}, o.softcap = kNaN;
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "option 'softcap'"}));
  std::vector<float> three{1, 2, 3}, four{1, 2, 3, 4}, bad{1, kNaN, 0, 0}, plus_inf{0, kInf, 0, 0};
  o = {}, o.alibi_slopes = View1<const float>(three.data(), {3}, {1});
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "'alibi_slopes'", "one slope per query head"}));
  o = {}, o.alibi_slopes = View1<const float>(bad.data(), {4}, {1});
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "'alibi_slopes'"}));
  o = {}, o.sinks = View1<const float>(three.data(), {3}, {1});
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "'sinks'", "one logit per query head"}));
  o = {}, o.sinks = View1<const float>(plus_inf.data(), {4}, {1});
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "'sinks'"}));
  o = {}, o.sinks = View1<const float>(out.data(), {4}, {1});
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "output 'out' overlaps input 'sinks'"}));
  Tensor<bool> mask({1, 4, 1, 7});
  o = {}, o.mask = mask.view4();
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "argument 'mask' has shape (1, 4, 1, 7)", "(1, 4, 1, 8)"}));
  Tensor<float> bias({1, 1, 1, 8});
  bias[3] = kNaN;
  o = {}, o.bias = bias.view4();
  EXPECT_TRUE(throws_with(call(o), {"decode_attention", "'bias'"}));
  o = {}, o.alibi_slopes = View1<const float>(four.data(), {4}, {1}), o.sinks = View1<const float>(four.data(), {4}, {1});
  Tensor<float> ok({1, 4, 1, 4});
  EXPECT_NO_THROW(decode_call(q.view4(), cache, ok.view4(), o));
}

}  // namespace
