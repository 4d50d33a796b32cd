// The decode kernel against the reference on the values the cache holds:
// every L from 1 to 17, lengths from 1 to several pages plus a partial page,
// page sizes that do not divide the lengths, GQA ratios 1, 2, 4, 8 and MQA,
// mixed and empty sequences, float16/bfloat16 storage; bitwise equality over
// thread counts and split-KV on/off; NaN; every compiled SIMD target; and
// the dense call's use of the same kernel for few query rows.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cstring>
#include <random>

#include "decode_case.hpp"
#include "kernels/decode/decode.hpp"
#include "testing.hpp"

namespace {

using namespace attn;
using namespace attn::testing;

TEST(Decode, EveryQueryCountMatchesReference) {
  std::mt19937_64 rng(1);
  for (int64_t L = 1; L <= 17; ++L) {
    DecodeCase c;
    c.B = 2, c.H = 8, c.Hkv = 2, c.L = L, c.E = 24, c.Ev = 20, c.page = 16;
    c.lens = {L + 37, 3 * 16 + 5};  // several pages plus a partial one
    const Filled f = fill(c, rng);
    expect_matches_oracle(c, f, run(c, f));
  }
}

TEST(Decode, RandomShapesMatchReference) {
  std::mt19937_64 rng(2);
  for (int i = 0; i < 120; ++i) {
    const DecodeCase c = random_case(rng);
    SCOPED_TRACE(c.str());
    const Filled f = fill(c, rng);
    expect_matches_oracle(c, f, run(c, f));
    if (::testing::Test::HasFailure()) break;
  }
}

TEST(Decode, GroupRatiosAndMultiQuery) {
  std::mt19937_64 rng(3);
  for (const int64_t H : {8, 16, 32, 64}) {  // ratios 8 / Hkv for Hkv = 8 ... and MQA below
    for (const int64_t Hkv : {int64_t(1), H / 8, H / 4, H / 2, H}) {
      DecodeCase c;
      c.H = H, c.Hkv = Hkv, c.E = c.Ev = 32, c.page = 24, c.lens = {200};
      const Filled f = fill(c, rng);
      expect_matches_oracle(c, f, run(c, f));
    }
  }
}

TEST(Decode, LengthsFromOneToSeveralPages) {
  std::mt19937_64 rng(4);
  for (int64_t S = 1; S <= 75; S += 3) {
    DecodeCase c;
    c.B = 3, c.H = 4, c.Hkv = 2, c.L = 1 + S % 5, c.E = c.Ev = 16, c.page = 7;
    c.lens = {S, 0, S / 2 + 1};  // an empty sequence in the middle
    const Filled f = fill(c, rng);
    const Result r = run(c, f);
    expect_matches_oracle(c, f, r);
    for (int64_t i = 0; i < c.H * c.L; ++i) {  // the empty sequence: output 0, lse −inf
      EXPECT_EQ(r.lse[size_t(c.H * c.L + i)], -std::numeric_limits<float>::infinity());
      for (int64_t e = 0; e < c.Ev; ++e) EXPECT_EQ(r.out[size_t((c.H * c.L + i) * c.Ev + e)], 0.0f);
    }
  }
}

TEST(Decode, HalfPrecisionStorageMatchesReferenceOnRoundedValues) {
  std::mt19937_64 rng(5);
  for (const Dtype t : {Dtype::float16, Dtype::bfloat16}) {
    for (int i = 0; i < 30; ++i) {
      DecodeCase c = random_case(rng);
      c.dtype = t;
      SCOPED_TRACE(c.str());
      const Filled f = fill(c, rng);
      expect_matches_oracle(c, f, run(c, f));
    }
  }
}

// A half-precision cache gives the float32 call's bits on the rounded values:
// the same tiles, products and sums in the same order, whatever register
// blocks each storage type takes (at Ev = 128 on AVX-512, float32 value
// blocks of 2 rows and half ones of 4).
TEST(Decode, HalfStorageGivesTheFloat32BitsOnRoundedValues) {
  std::mt19937_64 rng(13);
  for (const Dtype t : {Dtype::float16, Dtype::bfloat16})
    for (const int64_t Ev : {int64_t(33), int64_t(64), int64_t(128), int64_t(160)})
      for (const int64_t L : {int64_t(1), int64_t(3)}) {
        DecodeCase c;
        c.B = 2, c.H = 8, c.Hkv = 2, c.L = L, c.E = 128, c.Ev = Ev, c.dtype = t, c.page = L == 1 ? 0 : 100;
        c.lens = {300, 517};
        SCOPED_TRACE(c.str());
        const Filled half = fill(c, rng);
        DecodeCase c32 = c;
        c32.dtype = Dtype::float32;
        KVCache f32(config_of(c32));
        for (int64_t b = 0; b < c.B; ++b) {
          const int64_t n = c.lens[size_t(b)];
          f32.append(b, View3<const float>(half.k[size_t(b)].data(), {c.Hkv, n, c.E}, {n * c.E, c.E, 1}),
                     View3<const float>(half.v[size_t(b)].data(), {c.Hkv, n, c.Ev}, {n * c.Ev, c.Ev, 1}));
        }
        const Result a = run(c, half);
        Result b{Tensor<float>({c.B, c.H, c.L, c.Ev}), Tensor<float>({c.B, c.H, c.L})};
        decode_call(half.q.view4(), f32, b.out.view4(), {}, b.lse.view<3>());
        EXPECT_TRUE(bitwise_equal(a.out, b.out));
        EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
      }
}

// A tile is the same run of keys whatever the layout: in a paged cache it
// gathers the page runs it spans (up to kMaxRuns of them), so pages of 9
// tokens or more give the contiguous cache's bits, in every storage type,
// with the score rules, several chunks and sequences of different lengths.
TEST(Decode, PagedCachesGiveTheContiguousBits) {
  std::mt19937_64 rng(14);
  for (const Dtype t : {Dtype::float32, Dtype::float16, Dtype::bfloat16})
    for (const int64_t page : {int64_t(9), int64_t(16), int64_t(48), int64_t(100), int64_t(256)}) {
      DecodeCase c;
      c.B = 3, c.H = 8, c.Hkv = 2, c.L = page % 2 ? 3 : 1, c.E = 64, c.Ev = 40, c.dtype = t;
      c.lens = {1500, 0, 333};  // 1500: several chunks; an empty sequence
      if (page == 100) {
        c.window.left = 700, c.softcap = 3.0;
        for (int64_t h = 0; h < c.H; ++h) c.sinks.push_back(0.3f * float(h)), c.slopes.push_back(0.01f * float(h + 1));
      }
      SCOPED_TRACE(c.str() + " page " + std::to_string(page));
      const Filled contiguous = fill(c, rng);
      DecodeCase cp = c;
      cp.page = page;
      KVCache paged(config_of(cp));
      for (int64_t b = 0; b < c.B; ++b) {
        const int64_t n = c.lens[size_t(b)];
        if (n == 0) continue;
        // The stored values of the contiguous cache (rounded already), appended in pieces.
        for (int64_t t0 = 0; t0 < n; t0 += 77) {
          const int64_t m = std::min<int64_t>(77, n - t0);
          paged.append(b, View3<const float>(contiguous.k[size_t(b)].data() + t0 * c.E, {c.Hkv, m, c.E}, {n * c.E, c.E, 1}),
                       View3<const float>(contiguous.v[size_t(b)].data() + t0 * c.Ev, {c.Hkv, m, c.Ev}, {n * c.Ev, c.Ev, 1}));
        }
      }
      DecodeCall o;
      o.num_threads = 2;
      const Result a = run(c, contiguous, o), b = run_on(cp, paged, contiguous.q, o);
      expect_matches_oracle(c, contiguous, a);
      EXPECT_TRUE(bitwise_equal(a.out, b.out));
      EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
    }
}

// The chunks are fixed by the shape and merged in one order, so neither the
// thread count nor running the chunks of a sequence in parallel changes a bit.
TEST(Decode, BitwiseSameForAnyThreadCountSplitOrNot) {
  std::mt19937_64 rng(6);
  for (const Dtype t : {Dtype::float32, Dtype::float16}) {
    DecodeCase c;
    c.B = 2, c.H = 8, c.Hkv = 2, c.L = 3, c.E = c.Ev = 64, c.page = 48, c.dtype = t;
    c.lens = {1500, 777};  // several chunks each
    const Filled f = fill(c, rng);
    detail::Problem p;
    p.B = c.B, p.H = c.H, p.Hkv = c.Hkv, p.L = c.L, p.E = c.E, p.Ev = c.Ev;
    p.rules.key_end = c.lens, p.rules.offset = {0, 0};
    ASSERT_GT(c.lens[0], 2 * detail::decode_plan(p).chunk) << "the case must split";
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

// Rows of 128 features and more take longer tiles (128 keys at E = 128,
// 16384 / E beyond, a multiple of 8; 64 keys below E = 128): the plan says
// so, and the long tiles, cut by pages that do not divide them and by the
// causal end of each row, match the reference and stay bitwise the same for
// any thread count.
TEST(Decode, WideRowsTakeLongTilesAndMatchReference) {
  const auto tile = [](int64_t E, int64_t Ev) {
    detail::Problem p;
    p.B = 1, p.H = 4, p.Hkv = 1, p.L = 1, p.E = E, p.Ev = Ev;
    p.rules.key_end = {4096}, p.rules.offset = {0};
    return detail::decode_plan(p).tile;
  };
  EXPECT_EQ(tile(64, 64), 64);
  EXPECT_EQ(tile(16, 100), 64);
  EXPECT_EQ(tile(128, 128), 128);
  EXPECT_EQ(tile(128, 160), 96);  // 16384 / 160 = 102, down to a multiple of 8
  EXPECT_EQ(tile(256, 64), 64);
  std::mt19937_64 rng(12);
  for (const Dtype t : {Dtype::float32, Dtype::bfloat16})
    for (const int64_t page : {int64_t(0), int64_t(100)}) {
      DecodeCase c;
      c.B = 2, c.H = 8, c.Hkv = 2, c.L = 3, c.E = 128, c.Ev = page ? 160 : 128, c.page = page, c.dtype = t;
      c.causal = true;
      c.lens = {700, 131};  // several long tiles and chunks; a partial last tile
      SCOPED_TRACE(c.str());
      const Filled f = fill(c, rng);
      DecodeCall o;
      o.num_threads = 1;
      const Result base = run(c, f, o);
      expect_matches_oracle(c, f, base);
      for (const int threads : {2, 3}) {
        o.num_threads = threads;
        const Result r = run(c, f, o);
        EXPECT_TRUE(bitwise_equal(r.out, base.out)) << threads << " threads";
        EXPECT_TRUE(bitwise_equal(r.lse, base.lse)) << threads << " threads";
      }
    }
}

// ---- chunked prefill: many new rows go to the fused kernel ------------------

// Rows beyond what the decode kernel takes (decode_suits_rows) run the fused
// kernel on float32 views of the cache (kernels/decode/prefill.cpp): one view
// per float32 sequence in one page, else chunks of 4096 keys (at these sizes) widened or
// gathered across pages and merged by log-sum-exp. Lengths beyond one and two
// chunks, pages that divide the chunk (views) and that do not (gathers), half
// storage, queries that see no key (L > length), empty sequences.
TEST(Decode, ChunkedPrefillMatchesReference) {
  std::mt19937_64 rng(11);
  int n = 0;
  for (const Dtype t : {Dtype::float32, Dtype::float16, Dtype::bfloat16})
    for (const int64_t page : {int64_t(0), int64_t(300), int64_t(1024)})
      for (const bool causal : {true, false}) {
        DecodeCase c;
        c.B = 5, c.H = 4, c.Hkv = 2, c.L = 40 + n % 3 * 9, c.E = 24, c.Ev = 16 + n % 2 * 8, c.page = page;
        c.dtype = t, c.causal = causal;
        // three chunks; empty; fewer keys than queries; a last chunk of one key; one key
        c.lens = {8300 + n, 0, 30, 4097, 1};
        ASSERT_FALSE(detail::decode_suits_rows(c.L, c.H / c.Hkv));
        SCOPED_TRACE(c.str());
        const Filled f = fill(c, rng);
        const Result r = run(c, f);
        expect_matches_oracle(c, f, r);
        for (int64_t i = 0; i < c.H * c.L; ++i)  // the empty sequence: output 0, lse −inf
          EXPECT_EQ(r.lse[size_t(c.H * c.L + i)], -std::numeric_limits<float>::infinity());
        ++n;
      }
  // The first widened chunk holds one key (the scratch's first shape).
  for (const Dtype t : {Dtype::float16, Dtype::float32}) {
    DecodeCase c;
    c.B = 1, c.H = 4, c.Hkv = 2, c.L = 40, c.E = 24, c.Ev = 16, c.page = 1, c.dtype = t, c.lens = {1};
    SCOPED_TRACE(c.str());
    const Filled f = fill(c, rng);
    expect_matches_oracle(c, f, run(c, f));
  }
}

// The chunks are fixed by the shape and merged in order: any thread count
// gives the same bits; and a NaN key poisons exactly the rows that see it,
// whichever chunk it lies in.
TEST(Decode, ChunkedPrefillBitwiseForAnyThreadCountAndNaN) {
  std::mt19937_64 rng(12);
  for (const int64_t page : {int64_t(0), int64_t(256), int64_t(100)}) {
    DecodeCase c;
    c.B = 1, c.H = 8, c.Hkv = 2, c.L = 64, c.E = c.Ev = 32, c.page = page, c.lens = {8400};
    if (page == 100) c.dtype = Dtype::float16;  // widened chunks (by the threads) from half storage
    Filled f = fill(c, rng);
    expect_same_bits_for_threads(c, f, {2, 3, 8}, "page " + std::to_string(page));
    // Key 8350 (third chunk) of kv head 1 is NaN: rows i of heads 4..7 with
    // 8400 − 64 + i >= 8350, i.e. i >= 14, become NaN; nothing else does.
    KVCache cache(config_of(c));
    Tensor<float>& k = f.k[0];
    k[size_t((1 * 8400 + 8350) * c.E + 5)] = std::numeric_limits<float>::quiet_NaN();
    cache.append(0, k.view<3>(), f.v[0].view<3>());
    Tensor<float> out({1, c.H, c.L, c.Ev}), lse({1, c.H, c.L});
    decode_call(f.q.view4(), cache, out.view4(), {}, lse.view<3>());
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.L; ++i) {
        const bool poisoned = h >= 4 && i >= 14;
        const size_t row = size_t(h * c.L + i);
        EXPECT_EQ(std::isnan(lse[row]), poisoned) << "page " << page << " head " << h << " row " << i;
        EXPECT_EQ(std::isnan(out[row * size_t(c.Ev)]), poisoned) << "page " << page << " head " << h << " row " << i;
      }
  }
}

TEST(Decode, NaNReachesTheRowsThatSeeIt) {
  std::mt19937_64 rng(7);
  DecodeCase c;
  c.B = 2, c.H = 4, c.Hkv = 2, c.L = 2, c.E = c.Ev = 8, c.page = 4, c.lens = {600, 10};
  Filled f = fill(c, rng);
  // q: NaN in sequence 0, head 1, row 0; only that row becomes NaN.
  f.q[size_t(((0 * c.H + 1) * c.L + 0) * c.E + 3)] = std::numeric_limits<float>::quiet_NaN();
  const Result r = run(c, f);
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t i = 0; i < c.L; ++i) {
      const bool poisoned = h == 1 && i == 0;
      EXPECT_EQ(std::isnan(r.lse[size_t(h * c.L + i)]), poisoned) << h << " " << i;
      EXPECT_EQ(std::isnan(r.out[size_t((h * c.L + i) * c.Ev)]), poisoned) << h << " " << i;
    }
  // A key of sequence 1, kv head 0, seen by every row: heads 0 and 1 become NaN.
  KVCache cache(config_of(c));
  Tensor<float> k = random_tensor<float>({c.Hkv, 1, c.E}, rng), v = random_tensor<float>({c.Hkv, 1, c.Ev}, rng);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < 5; ++t) {
      k[0] = b == 1 && t == 2 ? std::numeric_limits<float>::quiet_NaN() : 0.5f;
      cache.append(b, k.view<3>(), v.view<3>());
    }
  Tensor<float> out({c.B, c.H, c.L, c.Ev}), lse({c.B, c.H, c.L});
  decode_call(f.q.view4(), cache, out.view4(), {}, lse.view<3>());
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t i = 0; i < c.L; ++i) {
      const size_t row = size_t((1 * c.H + h) * c.L + i);
      EXPECT_EQ(std::isnan(lse[row]), h < 2) << h << " " << i;
      EXPECT_EQ(std::isnan(out[row * size_t(c.Ev)]), h < 2) << h << " " << i;
    }
}

// Keys a row does not see never touch it: a NaN value at the last key (seen
// only by the last of the L rows) and an infinite key poison exactly the
// rows that see them.
TEST(Decode, NonFiniteKeysAndValuesPoisonOnlyTheRowsThatSeeThem) {
  std::mt19937_64 rng(9);
  const float inf = std::numeric_limits<float>::infinity(), qnan = std::numeric_limits<float>::quiet_NaN();
  for (const int which : {0, 1, 2}) {  // NaN in v, +inf in k, -inf in k
    DecodeCase c;
    c.B = 1, c.H = 4, c.Hkv = 2, c.L = 3, c.E = c.Ev = 8, c.page = 16, c.lens = {20};
    Filled f = fill(c, rng);
    KVCache cache(config_of(c));
    Tensor<float>& k = f.k[0];
    Tensor<float>& v = f.v[0];
    const int64_t t = 19;  // the last token: only query row 2 sees it
    if (which == 0) v[size_t((1 * 20 + t) * c.Ev + 3)] = qnan;  // kv head 1
    if (which == 1) k[size_t((1 * 20 + t) * c.E + 2)] = inf;
    if (which == 2) k[size_t((1 * 20 + t) * c.E + 2)] = -inf;
    cache.append(0, k.view<3>(), v.view<3>());
    Tensor<float> out({1, c.H, c.L, c.Ev}), lse({1, c.H, c.L});
    decode_call(f.q.view4(), cache, out.view4(), {}, lse.view<3>());
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.L; ++i) {
        const bool poisoned = h >= 2 && i == 2;  // heads 2, 3 read kv head 1
        const size_t row = size_t(h * c.L + i);
        EXPECT_EQ(std::isnan(lse[row]), poisoned) << which << " head " << h << " row " << i;
        for (int64_t e = 0; e < c.Ev; ++e)
          ASSERT_EQ(std::isnan(out[row * size_t(c.Ev) + size_t(e)]), poisoned) << which << " head " << h << " row " << i;
      }
  }
}

// A decoding step in one call (the overload that appends the new tokens'
// keys and values first) gives the bits of an append followed by the call,
// and stores the same tokens: float32 and bfloat16 storage, contiguous and
// paged, grouped heads, k and v in the (B, n, Hkv, E) layout of a
// projection (strided), steps of 1 and of 3 causal rows.
TEST(Decode, StepAppendsThenAttendsBitwise) {
  std::mt19937_64 rng(21);
  for (const Dtype t : {Dtype::float32, Dtype::bfloat16})
    for (const int64_t page : {int64_t(0), int64_t(16)}) {
      DecodeCase c;
      c.B = 2, c.H = 6, c.Hkv = 2, c.E = 24, c.Ev = 20, c.page = page, c.dtype = t;
      c.lens = {70, 70};
      const KVCacheConfig cfg = config_of(c, 8);
      KVCache one(cfg), two(cfg);  // the step in one call; append, then the call
      const Tensor<float> k0 = random_tensor<float>({c.B, c.Hkv, 70, c.E}, rng);
      const Tensor<float> v0 = random_tensor<float>({c.B, c.Hkv, 70, c.Ev}, rng);
      for (KVCache* cache : {&one, &two}) cache->append(View4<const float>(k0.view4()), View4<const float>(v0.view4()));
      for (const int64_t n : {1, 3, 1}) {
        SCOPED_TRACE(c.str() + " step of " + std::to_string(n));
        const Tensor<float> q = random_tensor<float>({c.B, c.H, n, c.E}, rng);
        const Tensor<float> k = random_tensor<float>({c.B, n, c.Hkv, c.E}, rng);
        const Tensor<float> v = random_tensor<float>({c.B, n, c.Hkv, c.Ev}, rng);
        const auto kv = View4<const float>::bnhd(k.data(), c.B, n, c.Hkv, c.E);
        const auto vv = View4<const float>::bnhd(v.data(), c.B, n, c.Hkv, c.Ev);
        Tensor<float> out1({c.B, c.H, n, c.Ev}), lse1({c.B, c.H, n}), out2({c.B, c.H, n, c.Ev}), lse2({c.B, c.H, n});
        DecodeArgs a;
        a.q = q.view4();
        DecodeCall o;
        o.num_threads = 2;
        decode_attention(one, kv, vv, a, {out1.view4(), {}, lse1.view<3>()}, o);
        two.append(kv, vv);
        decode_call(q.view4(), two, out2.view4(), o, lse2.view<3>());
        EXPECT_TRUE(bitwise_equal(out1, out2));
        EXPECT_TRUE(bitwise_equal(lse1, lse2));
      }
      for (int64_t b = 0; b < c.B; ++b) {
        ASSERT_EQ(one.length(b), 75);
        ASSERT_EQ(two.length(b), 75);
        Tensor<float> k1({c.Hkv, 75, c.E}), v1({c.Hkv, 75, c.Ev}), k2({c.Hkv, 75, c.E}), v2({c.Hkv, 75, c.Ev});
        one.read(b, k1.view<3>(), v1.view<3>());
        two.read(b, k2.view<3>(), v2.view<3>());
        EXPECT_TRUE(bitwise_equal(k1, k2));
        EXPECT_TRUE(bitwise_equal(v1, v2));
      }
    }
}

// A refused step names the argument and leaves the cache as it was.
TEST(Decode, RefusedStepLeavesTheCache) {
  KVCacheConfig cfg;
  cfg.batch = 2, cfg.kv_heads = 2, cfg.capacity = 8, cfg.head_dim = 4;
  KVCache cache(cfg), other(cfg);
  Tensor<float> k({2, 2, 1, 4}), v({2, 2, 1, 4}), q({2, 4, 1, 4}), out({2, 4, 1, 4});
  cache.append(View4<const float>(k.view4()), View4<const float>(v.view4()));
  DecodeArgs a;
  a.q = q.view4();
  auto step = [&](DecodeArgs args, View4<const float> kk, View4<const float> vv, View4<float> o) {
    return [&cache, args, kk, vv, o] { decode_attention(cache, kk, vv, args, {o, {}, {}}); };
  };
  const View4<const float> kv = k.view4(), vv = v.view4();
  Tensor<float> q3({2, 3, 1, 4}), k5({2, 2, 1, 5}), v3({2, 2, 3, 4});
  DecodeArgs bad_q = a;
  bad_q.q = q3.view4();
  EXPECT_TRUE(throws_with(step(bad_q, kv, vv, out.view4()), {"decode_attention", "'q'", "Hkv = 2"}));
  EXPECT_TRUE(throws_with(step(a, k5.view4(), vv, out.view4()), {"decode_attention", "argument 'k' has shape"}));
  EXPECT_TRUE(throws_with(step(a, kv, v3.view4(), out.view4()), {"decode_attention", "argument 'v' has shape",
                                                                    "(n of 'k')"}));
  EXPECT_TRUE(throws_with(step(a, kv, {}, out.view4()), {"decode_attention", "'v' is required"}));
  EXPECT_TRUE(throws_with(step(a, kv, vv, {}), {"decode_attention", "'out' is required"}));
  DecodeArgs elsewhere = a;
  elsewhere.cache = &other;
  EXPECT_TRUE(throws_with(step(elsewhere, kv, vv, out.view4()), {"decode_attention", "'args.cache'"}));
  Tensor<float> k8({2, 2, 8, 4}), v8({2, 2, 8, 4});
  EXPECT_TRUE(throws_with(step(a, k8.view4(), v8.view4(), out.view4()),
                          {"decode_attention", "argument 'cache' cannot take the 8 new tokens"}));
  for (int64_t b = 0; b < 2; ++b) EXPECT_EQ(cache.length(b), 1);
  for (int64_t b = 0; b < 2; ++b) EXPECT_EQ(other.length(b), 0);
  decode_attention(cache, kv, vv, a, {out.view4(), {}, {}});
  for (int64_t b = 0; b < 2; ++b) EXPECT_EQ(cache.length(b), 2);
}

// A call below the plan's work threshold runs on one thread (waking a team
// would cost more than the work); the bits are those of any thread count
// on both sides of the threshold.
TEST(Decode, SmallCallsRunOnOneThreadSameBits) {
  const auto serial = [](int64_t S) {
    detail::Problem p;
    p.B = 1, p.H = 9, p.Hkv = 3, p.L = 1, p.E = p.Ev = 64;
    p.rules.key_end = {S}, p.rules.offset = {S - 1};
    return detail::decode_plan(p).serial;
  };
  EXPECT_TRUE(serial(200));    // 9 × 200 × 128 multiply-adds < 2^18
  EXPECT_FALSE(serial(2000));  // 9 × 2000 × 128
  std::mt19937_64 rng(22);
  for (const int64_t S : {200, 2000}) {
    DecodeCase c;
    c.H = 9, c.Hkv = 3, c.E = c.Ev = 64, c.dtype = Dtype::bfloat16, c.lens = {S};
    expect_same_bits_for_threads(c, fill(c, rng), {2, 3, 8}, std::to_string(S) + " keys");
  }
}

TEST(Decode, ArgumentErrors) {
  KVCacheConfig cfg;
  cfg.batch = 2, cfg.kv_heads = 2, cfg.capacity = 8, cfg.head_dim = 4;
  KVCache cache(cfg);
  Tensor<float> q({2, 3, 1, 4}), out({2, 3, 1, 4});
  EXPECT_TRUE(throws_with([&] { decode_call(q.view4(), cache, out.view4()); }, {"decode_attention", "'q'", "Hkv = 2"}));
  Tensor<float> q2({2, 4, 1, 4}), out2({2, 4, 2, 4});
  EXPECT_TRUE(throws_with([&] { decode_call(q2.view4(), cache, out2.view4()); }, {"'out'", "(2, 4, 1, 4)"}));
  Tensor<float> out3({2, 4, 1, 4});
  DecodeCall o;
  o.scale = -1.0;
  EXPECT_TRUE(throws_with([&] { decode_call(q2.view4(), cache, out3.view4(), o); }, {"'scale'"}));
  // The boundary's Checker: thread counts, outputs that alias or broadcast.
  DecodeCall t;
  t.num_threads = -1;
  EXPECT_TRUE(throws_with([&] { decode_call(q2.view4(), cache, out3.view4(), t); },
                          {"decode_attention", "option 'num_threads' is -1, expected 0 (the default) to"}));
  EXPECT_TRUE(throws_with([&] { decode_call(q2.view4(), cache, {}); }, {"'out' is required"}));
  EXPECT_TRUE(throws_with([&] { decode_call(q2.view4(), cache, View4<float>(q2.data(), {2, 4, 1, 4})); },
                          {"output 'out' overlaps input 'q'"}));
  Tensor<float> lse({2, 4, 1});
  auto with_lse = [&](View3<float> l) { return [&, l] { decode_call(q2.view4(), cache, out3.view4(), {}, l); }; };
  EXPECT_TRUE(throws_with(with_lse(View3<float>(lse.data(), {2, 4, 1}, {0, 1, 1})), {"output 'lse' has stride 0 on axis 0"}));
  EXPECT_TRUE(throws_with(with_lse(View3<float>(out3.data(), {2, 4, 1})), {"output 'out' overlaps output 'lse'"}));
}

// The kernel is compiled for several SIMD targets; Highway can pretend the
// CPU supports fewer, so each target this CPU can run is checked here
// (including the portable one and the float16/bfloat16 widening of each).
TEST(Decode, EveryCompiledTargetThisCpuRunsMatchesReference) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  std::string names;
  for (const int64_t t : targets) {
    if (t == HWY_SSSE3) continue;  // not compiled into the library (cmake/attn_kernels.cmake)
    hwy::SetSupportedTargetsForTest(t);
    hwy::GetChosenTarget().Update(hwy::SupportedTargets());
    EXPECT_STREQ(detail::decode_target_name(), hwy::TargetName(t));
    names += std::string(names.empty() ? "" : ", ") + detail::decode_target_name();
    std::mt19937_64 rng(100 + uint64_t(t));
    for (int i = 0; i < 24; ++i) {
      DecodeCase c = random_case(rng);
      c.dtype = Dtype(i % 3);
      SCOPED_TRACE(std::string(hwy::TargetName(t)) + " " + c.str());
      const Filled f = fill(c, rng);
      expect_matches_oracle(c, f, run(c, f));
      if (::testing::Test::HasFailure()) break;
    }
  }
  hwy::SetSupportedTargetsForTest(0);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  std::printf("decode targets run: %s\n", names.c_str());
}

// ---- the dense call ---------------------------------------------------------

struct Dense {
  Tensor<float> q, k, v, out, lse;
};

// scaled_dot_product_attention with few query rows takes the decode kernel:
// its output is bitwise the kernel's, and matches the reference.
TEST(Decode, DenseCallWithFewRowsUsesTheKernel) {
  std::mt19937_64 rng(8);
  for (int i = 0; i < 40; ++i) {
    const int64_t Hkv = 1 + i % 3, H = Hkv * (int64_t(1) << (i % 4)), B = 1 + i % 2;
    const int64_t L = 1 + i % 9, S = 1 + (i * 37) % 700, E = 8 + i % 5 * 8, Ev = E + (i % 2) * 8;
    const bool bnhd = i % 3 == 0;  // (B, S, H, E) memory, viewed as (B, H, S, E)
    Tensor<float> q = random_tensor<float>({B, H, L, E}, rng);
    Tensor<float> k = random_tensor<float>({B, S, Hkv, E}, rng), v = random_tensor<float>({B, S, Hkv, Ev}, rng);
    Tensor<int64_t> kl({B});
    for (int64_t b = 0; b < B; ++b) kl[size_t(b)] = std::uniform_int_distribution<int64_t>(0, S)(rng);
    SdpaArgs<float> a;
    a.q = q.view4();
    a.k = bnhd ? View4<const float>::bnhd(k.data(), B, S, Hkv, E) : View4<const float>(k.data(), {B, Hkv, S, E});
    a.v = bnhd ? View4<const float>::bnhd(v.data(), B, S, Hkv, Ev) : View4<const float>(v.data(), {B, Hkv, S, Ev});
    if (i % 4 == 1) a.key_lengths = kl.view<1>();
    SdpaOptions o;
    o.causal = i % 2 == 0;
    o.causal_align = i % 4 == 0 ? CausalAlign::top_left : CausalAlign::bottom_right;
    Tensor<float> out({B, H, L, Ev}), lse({B, H, L}), ref({B, H, L, Ev}), ref_lse({B, H, L});
    scaled_dot_product_attention(a, {out.view4(), {}, lse.view<3>()}, o);
    SdpaOptions ro = o;
    ro.backend = Backend::reference;
    scaled_dot_product_attention(a, {ref.view4(), {}, ref_lse.view<3>()}, ro);
    EXPECT_TRUE(all_close(out, ref, tolerance<float>(S + E, 1.0, 40), "out"));
    EXPECT_TRUE(all_close(lse, ref_lse, tolerance<float>(S + E, max_abs(ref_lse.view<3>()), 40), "lse"));
    // Bitwise the kernel's own result: the dense call went this way.
    SdpaOptions po = o;
    po.num_threads = 2;
    const detail::Problem p = detail::make_problem(a, po);
    ASSERT_TRUE(detail::decode_suits_dense(p));
    Tensor<float> direct({B, H, L, Ev});
    detail::decode_forward_dense(p, a, direct.view4(), {});
    EXPECT_TRUE(bitwise_equal(direct, out)) << "case " << i;
  }
}

}  // namespace
