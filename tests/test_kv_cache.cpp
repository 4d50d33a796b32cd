// The KV cache: appends (in pieces, across page boundaries) read back
// exactly; float16/bfloat16 rounding to nearest even; pages taken from and
// returned to the pool; block tables: sharing a prefix, and the argument
// errors for bad tables, capacities and shapes; the storage's allocator;
// random operation sequences against a shadow model of the pages.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <iterator>
#include <fstream>
#include <filesystem>

#include "attn/detail/memory.hpp"
#include "../fuzz/kv_cache_ops.hpp"
#include "decode_case.hpp"
#include "kernels/decode/decode.hpp"
#include "testing.hpp"

namespace {

using namespace attn;
using namespace attn::testing;

// read(b) gives back exactly the (rounded) values appended.
void expect_reads_back(const DecodeCase& c, const Filled& f) {
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t n = c.lens[size_t(b)];
    ASSERT_EQ(f.cache.length(b), n);
    Tensor<float> k({c.Hkv, std::max<int64_t>(n, 1), c.E}), v({c.Hkv, std::max<int64_t>(n, 1), c.Ev});
    f.cache.read(b, View3<float>(k.data(), {c.Hkv, n, c.E}, {n * c.E, c.E, 1}),
                 View3<float>(v.data(), {c.Hkv, n, c.Ev}, {n * c.Ev, c.Ev, 1}));
    const int64_t ks = f.k[size_t(b)].dim(1);
    for (int64_t h = 0; h < c.Hkv; ++h)
      for (int64_t t = 0; t < n; ++t) {
        ASSERT_EQ(std::memcmp(&k[size_t((h * n + t) * c.E)], &f.k[size_t(b)][size_t((h * ks + t) * c.E)], size_t(c.E) * 4), 0)
            << c.str() << " b " << b << " head " << h << " token " << t;
        ASSERT_EQ(std::memcmp(&v[size_t((h * n + t) * c.Ev)], &f.v[size_t(b)][size_t((h * ks + t) * c.Ev)], size_t(c.Ev) * 4), 0)
            << c.str() << " b " << b << " head " << h << " token " << t;
      }
  }
}

TEST(KVCache, AppendsAcrossPagesReadBackExactly) {
  std::mt19937_64 rng(11);
  for (const Dtype t : {Dtype::float32, Dtype::float16, Dtype::bfloat16})
    for (const int64_t page : {0, 1, 3, 16})
      for (int i = 0; i < 4; ++i) {
        DecodeCase c;
        c.B = 3, c.Hkv = 2, c.E = 5 + i, c.Ev = 9 - i, c.page = page, c.dtype = t;
        c.lens = {int64_t(1 + 17 * i), 0, int64_t(40 + i)};
        const Filled f = fill(c, rng);
        expect_reads_back(c, f);
      }
}

TEST(KVCache, HalfPrecisionRoundsToNearestEven) {
  const float f16_tie = 1.0f + 1.0f / 2048;         // halfway between 1 and 1 + 2^-10
  const float bf16_tie_up = 1.0f + 3.0f / 256;      // halfway between 1 + 2^-7 and 1 + 2^-6
  const float specials[] = {0.0f, -0.0f, 1.0f, f16_tie, bf16_tie_up, 65504.0f, 1e-7f, -3.3e-5f,
                            std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  for (const Dtype t : {Dtype::float16, Dtype::bfloat16}) {
    KVCacheConfig cfg;
    cfg.capacity = 1, cfg.head_dim = 10, cfg.dtype = t;
    KVCache cache(cfg);
    Tensor<float> k({1, 1, 10}), back({1, 1, 10}), vb({1, 1, 10});
    std::copy(std::begin(specials), std::end(specials), k.data());
    cache.append(0, k.view<3>(), k.view<3>());
    cache.read(0, back.view<3>(), vb.view<3>());
    for (int e = 0; e < 10; ++e) {
      if (std::isnan(specials[e])) {
        EXPECT_TRUE(std::isnan(back[size_t(e)]));
        continue;
      }
      EXPECT_EQ(back[size_t(e)], round_to(t, specials[e])) << dtype_name(t) << " " << specials[e];
    }
  }
  EXPECT_EQ(round_to(Dtype::float16, 1.0f + 1.0f / 2048), 1.0f);  // the oracle's ties go to even
  EXPECT_EQ(round_to(Dtype::bfloat16, 1.0f + 3.0f / 256), 1.0f + 4.0f / 256);
}

KVCacheConfig paged(int64_t B, int64_t capacity, int64_t page, int64_t pages = 0) {
  KVCacheConfig cfg;
  cfg.batch = B, cfg.kv_heads = 1, cfg.capacity = capacity, cfg.head_dim = 2, cfg.page_size = page;
  cfg.num_pages = pages;
  return cfg;
}

void append_tokens(KVCache& c, int64_t b, int64_t n, float value) {
  Tensor<float> k({1, n, 2});
  k.fill(value);
  c.append(b, k.view<3>(), k.view<3>());
}

TEST(KVCache, PagesComeFromThePoolAndReturnToIt) {
  KVCache c(paged(2, 10, 4, 5));
  EXPECT_EQ(c.free_pages(), 5);
  append_tokens(c, 0, 5, 1.0f);  // pages 0, 1
  append_tokens(c, 1, 3, 2.0f);  // page 2
  append_tokens(c, 0, 3, 3.0f);  // page 1 filled, then page 3
  EXPECT_EQ(c.block_table(0), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(c.block_table(1), (std::vector<int32_t>{2}));
  EXPECT_EQ(c.length(0), 8);
  append_tokens(c, 0, 1, 3.0f);
  EXPECT_EQ(c.block_table(0), (std::vector<int32_t>{0, 1, 3}));
  EXPECT_EQ(c.free_pages(), 1);
  append_tokens(c, 1, 2, 2.0f);  // fills page 2 (4 tokens), takes page 4
  EXPECT_EQ(c.free_pages(), 0);
  EXPECT_TRUE(throws_with([&] { append_tokens(c, 1, 4, 0.0f); }, {"KVCache::append", "exhausted"}));
  EXPECT_EQ(c.length(1), 5);  // the failed append took nothing
  EXPECT_EQ(c.block_table(1), (std::vector<int32_t>{2, 4}));
  EXPECT_TRUE(throws_with([&] { append_tokens(c, 0, 2, 0.0f); }, {"capacity 10"}));
  c.reset(0);
  EXPECT_EQ(c.free_pages(), 3);
  EXPECT_EQ(c.length(0), 0);
}

// Appending to every sequence checks all of them before writing any: a
// pool that runs out at the second sequence leaves the first one as it was.
TEST(KVCache, AFailedBatchAppendChangesNoSequence) {
  KVCache c(paged(2, 12, 4, 3));
  append_tokens(c, 0, 4, 1.0f);  // page 0, full
  append_tokens(c, 1, 1, 2.0f);  // page 1
  Tensor<float> k({2, 1, 4, 2});
  k.fill(5.0f);
  // Four more tokens each: sequence 0 needs a new page, sequence 1 one
  // more after page 1's three free slots; one page is free.
  EXPECT_TRUE(throws_with([&] { c.append(k.view4(), k.view4()); },
                          {"KVCache::append", "exhausted", "needs 2 new pages", "1 of 3 are free"}));
  EXPECT_EQ(c.length(0), 4);
  EXPECT_EQ(c.length(1), 1);
  EXPECT_EQ(c.free_pages(), 1);
  EXPECT_EQ(c.block_table(0), (std::vector<int32_t>{0}));
  EXPECT_EQ(c.block_table(1), (std::vector<int32_t>{1}));
  // Three tokens each fit (sequence 0 takes page 2, sequence 1 fills page 1).
  Tensor<float> k3({2, 1, 3, 2});
  k3.fill(6.0f);
  c.append(k3.view4(), k3.view4());
  EXPECT_EQ(c.length(0), 7);
  EXPECT_EQ(c.length(1), 4);
  EXPECT_EQ(c.free_pages(), 0);
  Tensor<float> back({1, 4, 2}), vb({1, 4, 2});
  c.read(1, back.view<3>(), vb.view<3>());
  EXPECT_EQ(back[0], 2.0f);
  EXPECT_EQ(back[2], 6.0f);
}

TEST(KVCache, SharedPrefixPagesAreReadOnlyAndGiveTheSameAttention) {
  std::mt19937_64 rng(12);
  DecodeCase c;
  c.B = 2, c.H = 4, c.Hkv = 2, c.L = 3, c.E = c.Ev = 8, c.page = 4, c.causal = true;
  c.lens = {10, 0};
  KVCacheConfig cfg = config_of(c, 20);
  KVCache cache(cfg);
  Tensor<float> k = random_tensor<float>({c.Hkv, 16, c.E}, rng), v = random_tensor<float>({c.Hkv, 16, c.Ev}, rng);
  cache.append(0, View3<const float>(k.data(), {c.Hkv, 10, c.E}, {16 * c.E, c.E, 1}),
               View3<const float>(v.data(), {c.Hkv, 10, c.Ev}, {16 * c.Ev, c.Ev, 1}));
  // Sequence 1 reuses the two full pages (8 tokens) of sequence 0 and goes on with its own.
  const std::vector<int32_t> t0 = cache.block_table(0);
  ASSERT_EQ(t0.size(), 3u);
  cache.set_block_table(1, std::span<const int32_t>(t0.data(), 2), 8);
  cache.append(1, View3<const float>(k.data() + 8 * c.E, {c.Hkv, 8, c.E}, {16 * c.E, c.E, 1}),
               View3<const float>(v.data() + 8 * c.Ev, {c.Hkv, 8, c.Ev}, {16 * c.Ev, c.Ev, 1}));
  EXPECT_EQ(cache.length(1), 16);
  EXPECT_EQ(cache.block_table(1)[0], t0[0]);
  EXPECT_NE(cache.block_table(1)[2], t0[2]);
  // Sequence 1 now holds tokens 0..15 of k/v; its attention equals the dense reference.
  Tensor<float> q = random_tensor<float>({c.B, c.H, c.L, c.E}, rng);
  Tensor<float> out({c.B, c.H, c.L, c.Ev}), ref({c.B, c.H, c.L, c.Ev});
  decode_call(q.view4(), cache, out.view4());
  DecodeCall ro;
  ro.backend = Backend::reference;
  decode_call(q.view4(), cache, ref.view4(), ro);
  EXPECT_TRUE(all_close(out, ref, tolerance<float>(30, 1.0, 40), "shared prefix"));
  Filled f{KVCache(cfg), {}, {}, std::move(q)};
  DecodeCase c1 = c;
  c1.lens = {10, 16};
  f.k = {k, k};
  f.v = {v, v};
  Tensor<float> want, want_lse;
  oracle(c1, f, want, want_lse);
  EXPECT_TRUE(all_close(out, want, tolerance<float>(30, 1.0, 40), "shared prefix vs dense"));
  // Sequence 0 can still write its partial page (page 2); a third table may not take it.
  cache.append(0, View3<const float>(k.data() + 10 * c.E, {c.Hkv, 1, c.E}, {16 * c.E, c.E, 1}),
               View3<const float>(v.data() + 10 * c.Ev, {c.Hkv, 1, c.Ev}, {16 * c.Ev, c.Ev, 1}));
  EXPECT_EQ(cache.length(0), 11);
}

// Appending A, dropping all but its first keep tokens and appending C holds
// what appending A[:keep] then C holds, and decoding over it gives the same
// bits, for every storage type and layout; a paged sequence that keeps part
// of a page it shares gets a copy of its own, which the other sequence
// never sees written.
TEST(KVCache, TruncateThenAppendEqualsTheShorterHistory) {
  std::mt19937_64 rng(21);
  const int64_t Hkv = 2, E = 5, Ev = 3, cap = 24;
  for (const Dtype t : {Dtype::float32, Dtype::bfloat16})
    for (const int64_t page : {0, 3, 4})
      for (const int64_t keep : {0, 1, 4, 7, 11}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " page " + std::to_string(page) + " keep " + std::to_string(keep));
        KVCacheConfig cfg;
        cfg.batch = 1, cfg.kv_heads = Hkv, cfg.capacity = cap, cfg.head_dim = E, cfg.value_dim = Ev;
        cfg.page_size = page, cfg.dtype = t;
        KVCache cut(cfg), fresh(cfg);
        const Tensor<float> ka = random_tensor<float>({Hkv, 11, E}, rng), va = random_tensor<float>({Hkv, 11, Ev}, rng);
        const Tensor<float> kc = random_tensor<float>({Hkv, 6, E}, rng), vc = random_tensor<float>({Hkv, 6, Ev}, rng);
        cut.append(0, ka.view<3>(), va.view<3>());
        cut.truncate(0, keep);
        ASSERT_EQ(cut.length(0), keep);
        if (page) {
          ASSERT_EQ(int64_t(cut.block_table(0).size()), (keep + page - 1) / page);
          ASSERT_EQ(cut.free_pages(), cut.num_pages() - (keep + page - 1) / page);
        }
        cut.append(0, kc.view<3>(), vc.view<3>());
        if (keep)
          fresh.append(0, View3<const float>(ka.data(), {Hkv, keep, E}, {11 * E, E, 1}),
                       View3<const float>(va.data(), {Hkv, keep, Ev}, {11 * Ev, Ev, 1}));
        fresh.append(0, kc.view<3>(), vc.view<3>());
        const int64_t n = keep + 6;
        Tensor<float> k1({Hkv, n, E}), v1({Hkv, n, Ev}), k2({Hkv, n, E}), v2({Hkv, n, Ev});
        cut.read(0, k1.view<3>(), v1.view<3>());
        fresh.read(0, k2.view<3>(), v2.view<3>());
        ASSERT_EQ(std::memcmp(k1.data(), k2.data(), k1.size() * 4), 0);
        ASSERT_EQ(std::memcmp(v1.data(), v2.data(), v1.size() * 4), 0);
        const Tensor<float> q = random_tensor<float>({1, 4, 2, E}, rng);
        Tensor<float> o1({1, 4, 2, Ev}), o2({1, 4, 2, Ev});
        decode_call(q.view4(), cut, o1.view4());
        decode_call(q.view4(), fresh, o2.view4());
        ASSERT_EQ(std::memcmp(o1.data(), o2.data(), o1.size() * 4), 0);
      }
  // Sequence 1 shares sequence 0's two full pages, keeps 6 of their 8 tokens
  // and writes 2 new ones: into a copy of page 1, not page 1 itself.
  KVCache c(paged(2, 12, 4, 5));
  Tensor<float> k = random_tensor<float>({1, 8, 2}, rng), k0({1, 8, 2}), v0({1, 8, 2});
  c.append(0, k.view<3>(), k.view<3>());
  const std::vector<int32_t> prefix = c.block_table(0);
  c.set_block_table(1, prefix, 8);
  c.truncate(1, 6);
  EXPECT_EQ(c.block_table(1)[0], prefix[0]);
  EXPECT_NE(c.block_table(1)[1], prefix[1]);
  EXPECT_EQ(c.free_pages(), 2);
  const Tensor<float> two = random_tensor<float>({1, 2, 2}, rng);
  c.append(1, two.view<3>(), two.view<3>());
  c.read(0, k0.view<3>(), v0.view<3>());
  EXPECT_EQ(std::memcmp(k0.data(), k.data(), k.size() * 4), 0) << "sequence 0 changed";
  Tensor<float> k1({1, 8, 2}), v1({1, 8, 2});
  c.read(1, k1.view<3>(), v1.view<3>());
  EXPECT_EQ(std::memcmp(k1.data(), k.data(), 12 * 4), 0);
  EXPECT_EQ(std::memcmp(k1.data() + 12, two.data(), 4 * 4), 0);
  // The same with no free page for the copy: refused, nothing changes.
  KVCache full(paged(2, 8, 4, 2));
  full.append(0, k.view<3>(), k.view<3>());
  full.set_block_table(1, full.block_table(0), 8);
  EXPECT_TRUE(throws_with([&] { full.truncate(1, 5); }, {"KVCache::truncate", "page pool is exhausted", "copy"}));
  EXPECT_EQ(full.length(1), 8);
  EXPECT_EQ(full.block_table(1), full.block_table(0));
  full.truncate(1, 4);  // a whole page dropped: no copy needed
  EXPECT_EQ(full.block_table(1), std::vector<int32_t>{full.block_table(0)[0]});
  EXPECT_EQ(full.free_pages(), 0);
  EXPECT_TRUE(throws_with([&] { full.truncate(1, 5); }, {"'length' is 5", "length(1) = 4"}));
  EXPECT_TRUE(throws_with([&] { full.truncate(1, -1); }, {"'length'"}));
  EXPECT_TRUE(throws_with([&] { full.truncate(2, 0); }, {"'b' is 2"}));
}

TEST(KVCache, BadBlockTablesAreArgumentErrors) {
  KVCache c(paged(3, 12, 4, 8));
  append_tokens(c, 0, 6, 1.0f);  // pages 0 (full), 1 (partial)
  const auto set = [&](int64_t b, std::vector<int32_t> t, int64_t len) {
    return [&c, b, t, len] { c.set_block_table(b, std::span<const int32_t>(t), len); };
  };
  EXPECT_TRUE(throws_with(set(1, {8}, 2), {"set_block_table", "entry 0 is page 8", "num_pages = 8"}));
  EXPECT_TRUE(throws_with(set(1, {-1}, 2), {"page -1"}));
  EXPECT_TRUE(throws_with(set(1, {3, 3}, 6), {"entry 1 is page 3", "appears earlier"}));
  EXPECT_TRUE(throws_with(set(1, {0}, 2), {"entry 0 is page 0", "cannot be shared"}));  // 0 would be writable here
  EXPECT_TRUE(throws_with(set(1, {0, 1}, 8), {"entry 1 is page 1", "may still write"}));  // 1 is seq 0's partial page
  EXPECT_TRUE(throws_with(set(1, {4}, 5), {"'length' is 5"}));
  EXPECT_TRUE(throws_with(set(1, {4, 5, 6, 7}, 4), {"at most", "3"}));
  EXPECT_NO_THROW(set(1, {0, 5}, 4)());  // page 0 full in both tables: shared
  EXPECT_TRUE(throws_with(set(2, {5}, 0), {"entry 0 is page 5", "cannot be shared"}));
  KVCacheConfig contiguous = paged(1, 4, 0);
  KVCache cc(contiguous);
  EXPECT_TRUE(throws_with([&] { cc.block_table(0); }, {"contiguous"}));
}

TEST(KVCache, ConfigAndAppendErrors) {
  KVCacheConfig cfg;
  cfg.capacity = 4, cfg.head_dim = 0;
  EXPECT_TRUE(throws_with([&] { KVCache c(cfg); }, {"KVCache", "'head_dim' is 0"}));
  cfg.head_dim = 2, cfg.page_size = -1;
  EXPECT_TRUE(throws_with([&] { KVCache c(cfg); }, {"'page_size' is -1"}));
  cfg.page_size = 0, cfg.capacity = int64_t(1) << 50;
  EXPECT_TRUE(throws_with([&] { KVCache c(cfg); }, {"bytes"}));
  cfg.capacity = 4;
  KVCache c(cfg);
  Tensor<float> k({1, 2, 3});
  EXPECT_TRUE(throws_with([&] { c.append(0, k.view<3>(), k.view<3>()); }, {"argument 'k'", "(1, n, 2)"}));
  Tensor<float> k2({1, 2, 2});
  EXPECT_TRUE(throws_with([&] { c.append(1, k2.view<3>(), k2.view<3>()); }, {"argument 'b' is 1"}));
  EXPECT_TRUE(throws_with([] { parse_dtype("fp8"); }, {"attn::parse_dtype", "fp8"}));
  EXPECT_EQ(parse_dtype("bf16"), Dtype::bfloat16);
  // The boundary's Checker: each missing view by name, shapes against each other,
  // outputs that cannot be written.
  EXPECT_TRUE(throws_with([&] { c.append(0, {}, k2.view<3>()); }, {"KVCache::append", "'k' is required"}));
  EXPECT_TRUE(throws_with([&] { c.append(0, k2.view<3>(), {}); }, {"'v' is required"}));
  Tensor<float> v3({1, 3, 2});
  EXPECT_TRUE(throws_with([&] { c.append(0, k2.view<3>(), v3.view<3>()); },
                          {"argument 'v' has shape (1, 3, 2), expected (Hkv, n, Ev) = (1, 2, 2) (n of 'k')"}));
  EXPECT_TRUE(throws_with([&] { c.append(0, View3<const float>(k2.data(), {1, -2, 2}), k2.view<3>()); }, {"'k'", "dimensions >= 0"}));
  c.append(0, k2.view<3>(), k2.view<3>());
  Tensor<float> kv({1, 2, 2});
  EXPECT_TRUE(throws_with([&] { c.read(0, kv.view<3>(), kv.view<3>()); }, {"KVCache::read", "'k' overlaps output 'v'"}));
  EXPECT_TRUE(throws_with([&] { c.read(0, View3<float>(kv.data(), {1, 2, 2}, {4, 0, 1}), k2.view<3>()); },
                          {"output 'k' has stride 0 on axis 1"}));
}

// Sizes are checked with overflow-checked arithmetic before anything is
// allocated: page sizes and capacities near 2^63, a default pool whose page
// count overflows, page ids past int32, and caches larger than the machine
// are argument errors naming the configuration; a block table never has more
// entries than the pool has pages, so a huge capacity over a small pool costs
// only the pool.
TEST(KVCache, SizesThatOverflowAreRefusedBeforeAllocating) {
  const int64_t huge = std::numeric_limits<int64_t>::max();
  auto config = [](int64_t batch, int64_t capacity, int64_t page_size, int64_t num_pages) {
    KVCacheConfig cfg;
    cfg.batch = batch, cfg.kv_heads = 1, cfg.capacity = capacity, cfg.head_dim = 4;
    cfg.page_size = page_size, cfg.num_pages = num_pages;
    return cfg;
  };
  EXPECT_TRUE(throws_with([&] { KVCache c(config(1, 9, huge, 0)); },
                          {"attn::KVCache", "page_size " + std::to_string(huge), "more than 2^64 bytes"}));
  EXPECT_TRUE(throws_with([&] { KVCache c(config(1, 9, huge, 2)); }, {"attn::KVCache", "of memory of this machine"}));
  EXPECT_TRUE(throws_with([&] { KVCache c(config(int64_t(1) << 40, int64_t(1) << 40, 1, 0)); },
                          {"attn::KVCache", "more than 2^63 pages"}));
  EXPECT_TRUE(throws_with([&] { KVCache c(config(1, int64_t(1) << 32, 1, 0)); },
                          {"attn::KVCache", "4294967296 pages", "int32"}));
  EXPECT_TRUE(throws_with([&] { KVCache c(config(1, huge, 0, 0)); }, {"attn::KVCache", "capacity " + std::to_string(huge)}));
  // The reported wrap: a table of capacity / page_size = 2^62 entries.
  // Now the table has num_pages = 4 entries, and the pool, not the
  // capacity, bounds each sequence.
  KVCache c(config(4, int64_t(1) << 62, 1, 4));
  EXPECT_EQ(c.free_pages(), 4);
  Tensor<float> k({1, 4, 4});
  for (size_t i = 0; i < k.size(); ++i) k[i] = float(i);
  c.append(0, k.view<3>(), k.view<3>());
  EXPECT_EQ(c.length(0), 4);
  EXPECT_EQ(c.block_table(0), (std::vector<int32_t>{0, 1, 2, 3}));
  Tensor<float> one({1, 1, 4});
  EXPECT_TRUE(throws_with([&] { c.append(0, one.view<3>(), one.view<3>()); }, {"more pages than the pool's 4"}));
  EXPECT_TRUE(throws_with([&] { c.append(1, one.view<3>(), one.view<3>()); }, {"the page pool is exhausted"}));
  EXPECT_EQ(c.length(1), 0);
  Tensor<float> rk({1, 4, 4}), rv({1, 4, 4});
  c.read(0, rk.view<3>(), rv.view<3>());
  for (size_t i = 0; i < k.size(); ++i) ASSERT_EQ(rk[i], k[i]);
  const std::vector<int32_t> five{0, 1, 2, 3, 0};
  EXPECT_TRUE(throws_with([&] { c.set_block_table(1, five, 5); }, {"'pages' has 5 entries", "= 4"}));
  // The same wrap through the default pool size: 2 · 2^62 pages.
  EXPECT_TRUE(throws_with([&] { KVCache d(config(2, int64_t(1) << 62, 1, 0)); }, {"attn::KVCache", "2^63 pages"}));
}

// The cache's plain widening (appends and reads) and the decode kernel's
// vector widening give the same bits for every 16-bit pattern (NaN: both NaN).
TEST(KVCache, PlainAndVectorWideningAgreeOnEveryPattern) {
  std::vector<uint16_t> bits(65536);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = uint16_t(i);
  for (const Dtype t : {Dtype::float16, Dtype::bfloat16}) {
    std::vector<float> plain(bits.size()), vec(bits.size());
    detail::widen_from_storage(t, bits.data(), int64_t(bits.size()), plain.data());
    detail::convert_from_storage(t, bits.data(), int64_t(bits.size()), vec.data());
    for (size_t i = 0; i < bits.size(); ++i) {
      if (std::isnan(plain[i])) {
        ASSERT_TRUE(std::isnan(vec[i])) << dtype_name(t) << " bits " << i;
        continue;
      }
      uint32_t a, b;
      std::memcpy(&a, &plain[i], 4);
      std::memcpy(&b, &vec[i], 4);
      ASSERT_EQ(a, b) << dtype_name(t) << " bits " << i;
    }
  }
}

// The KV-cache fuzzer's property (fuzz/kv_cache_ops.hpp) over its seed corpus
// and over random inputs: configurations refused exactly when they cannot be
// held, every operation read back against a shadow model.
TEST(KVCache, FuzzPropertyOnTheCorpusAndRandomInputs) {
  namespace fs = std::filesystem;
  int files = 0, built = 0;
  for (const auto& e : fs::directory_iterator(fs::path(ATTN_FUZZ_CORPUS) / "kv_cache")) {
    std::ifstream f(e.path(), std::ios::binary);
    const std::vector<uint8_t> b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    built += attn::fuzz::check_kv_cache(b.data(), b.size());
    ++files;
  }
  EXPECT_GE(files, 4);
  EXPECT_GE(built, 2);
  std::mt19937 rng(5);
  for (int i = 0; i < 3000; ++i) {
    std::vector<uint8_t> b(size_t(8 + rng() % 120));
    for (auto& x : b) x = uint8_t(rng());
    for (size_t j = 0; j < 8; ++j) b[j] = uint8_t(rng() % 64);  // mostly small, valid configurations
    built += attn::fuzz::check_kv_cache(b.data(), b.size());
  }
  EXPECT_GE(built, 1000);
}

// The storage's allocator: 2 MiB alignment (huge-page candidates) from
// 2 MiB on, 64 bytes below; every byte writable and read back; a vector on
// it zero-fills like any vector.
TEST(KVCache, StreamedAllocatorAlignsAndHoldsItsBytes) {
  for (const size_t bytes : {size_t(1), size_t(100), (size_t(2) << 20) - 1, size_t(2) << 20, (size_t(5) << 20) + 3}) {
    auto* p = static_cast<unsigned char*>(detail::allocate_streamed(bytes));
    const size_t align = bytes >= (size_t(2) << 20) ? size_t(2) << 20 : 64;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % align, 0u) << bytes << " bytes";
    for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(i * 7);
    size_t wrong = 0;
    for (size_t i = 0; i < bytes; ++i) wrong += p[i] != static_cast<unsigned char>(i * 7);
    EXPECT_EQ(wrong, 0u) << bytes << " bytes";
    detail::free_streamed(p, bytes);
  }
  std::vector<float, detail::StreamedAllocator<float>> v(size_t(1) << 20, 0.0f);  // 4 MiB
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % (size_t(2) << 20), 0u);
  EXPECT_EQ(std::count(v.begin(), v.end(), 0.0f), int64_t(v.size()));
}

}  // namespace

// ---------------------------------------------------------------------------
// Random operations against a shadow model of the paged cache: its own page
// pool (lowest free page first), block tables, reference counts and page
// contents, and the block-table rules written out as the header states
// them. After every operation, success or failure must match the model
// (a failed operation changes nothing), and the lengths, free pages, block
// tables and every stored token must agree; every few operations the
// decode kernel over the (shared, reused) pages is compared with the
// reference backend.
namespace shadow {

struct Model {
  int64_t B, capacity, page, pages, width;
  std::vector<int64_t> len;
  std::vector<std::vector<int32_t>> table;  // per sequence, in token order
  std::vector<int32_t> refs;
  std::vector<std::vector<float>> content;  // per page, a value per slot
  int copies = 0;                           // shared pages truncate copied

  Model(int64_t b, int64_t cap, int64_t ps, int64_t np)
      : B(b), capacity(cap), page(ps), pages(np), width((cap + ps - 1) / ps), len(size_t(b), 0),
        table(size_t(b)), refs(size_t(np), 0), content(size_t(np), std::vector<float>(size_t(ps), 0.0f)) {}

  int64_t free_pages() const { return std::count(refs.begin(), refs.end(), 0); }
  // New pages appending n tokens to b takes, or -1 when it would write a shared page.
  int64_t wanted(int64_t b, int64_t n) const {
    int64_t count = 0;
    for (int64_t slot = len[size_t(b)] / page; slot <= (len[size_t(b)] + n - 1) / page; ++slot) {
      if (slot >= int64_t(table[size_t(b)].size())) ++count;
      else if (refs[size_t(table[size_t(b)][size_t(slot)])] > 1) return -1;
    }
    return count;
  }
  void write(int64_t b, int64_t n, float first) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = len[size_t(b)] + i;
      auto& tb = table[size_t(b)];
      if (t / page >= int64_t(tb.size())) {
        const int32_t p = int32_t(std::find(refs.begin(), refs.end(), 0) - refs.begin());
        ++refs[size_t(p)];
        tb.push_back(p);
      }
      content[size_t(tb[size_t(t / page)])][size_t(t % page)] = first + float(i);
    }
    len[size_t(b)] += n;
  }
  bool append(int64_t b, int64_t n, float first) {
    const int64_t w = wanted(b, n);
    if (len[size_t(b)] + n > capacity || w < 0 || w > free_pages()) return false;
    write(b, n, first);
    return true;
  }
  bool append_all(int64_t n, float first) {
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t w = wanted(b, n);
      if (len[size_t(b)] + n > capacity || w < 0) return false;
      total += w;
    }
    if (total > free_pages()) return false;
    for (int64_t b = 0; b < B; ++b) write(b, n, first + float(b * n));
    return true;
  }
  void reset(int64_t b) {
    for (int32_t p : table[size_t(b)]) --refs[size_t(p)];
    table[size_t(b)].clear();
    len[size_t(b)] = 0;
  }
  // Pages past the kept tokens go back to the pool; a shared page kept in
  // part is first copied to the lowest free page (false: none is free).
  bool truncate(int64_t b, int64_t length) {
    auto& tb = table[size_t(b)];
    if (length < 0 || length > len[size_t(b)]) return false;
    const int64_t keep = (length + page - 1) / page, part = length % page;
    int32_t own = -1;
    if (part != 0 && refs[size_t(tb[size_t(keep - 1)])] > 1) {
      const auto it = std::find(refs.begin(), refs.end(), 0);
      if (it == refs.end()) return false;
      own = int32_t(it - refs.begin());
    }
    for (size_t s = size_t(keep); s < tb.size(); ++s) --refs[size_t(tb[s])];
    tb.resize(size_t(keep));
    if (own >= 0) {
      ++copies;
      const int32_t last = tb[size_t(keep - 1)];
      for (int64_t i = 0; i < part; ++i) content[size_t(own)][size_t(i)] = content[size_t(last)][size_t(i)];
      --refs[size_t(last)];
      ++refs[size_t(own)];
      tb[size_t(keep - 1)] = own;
    }
    len[size_t(b)] = length;
    return true;
  }
  // The header's rules: ids in range, none twice, a page another sequence
  // uses must be full here and full there.
  bool set_table(int64_t b, const std::vector<int32_t>& pg, int64_t length) {
    const int64_t n = int64_t(pg.size());
    if (n > width || length < 0 || length > n * page || length > capacity) return false;
    for (int64_t s = 0; s < n; ++s) {
      const int32_t p = pg[size_t(s)];
      if (p < 0 || p >= pages || std::count(pg.begin(), pg.begin() + s, p) > 0) return false;
      for (int64_t o = 0; o < B; ++o) {
        if (o == b) continue;
        const auto& to = table[size_t(o)];
        const auto at = std::find(to.begin(), to.end(), p);
        if (at == to.end()) continue;
        const bool full_there = (at - to.begin() + 1) * page <= len[size_t(o)];
        const bool full_here = (s + 1) * page <= length;
        if (!full_there || !full_here) return false;
      }
    }
    reset(b);
    table[size_t(b)] = pg;
    for (int32_t p : pg) ++refs[size_t(p)];
    len[size_t(b)] = length;
    return true;
  }
};

}  // namespace shadow

// The two features of token x's key and value: distinct in every feature, so
// a swap of k and v or of features, or a lost write to either, shows.
// Tokens count from 1; x = 0 is a slot never written, which holds zeros.
static void fill_token(float* k, float* v, float x) {
  if (x == 0) {
    k[0] = k[1] = v[0] = v[1] = 0;
    return;
  }
  k[0] = x, k[1] = x + 0.5f, v[0] = -x, v[1] = 0.25f - x;
}

TEST(KVCache, RandomOperationsMatchAShadowModel) {
  int copies = 0;  // over the seeds: truncations that copied a shared page
  for (const uint64_t seed : {1, 2, 3, 4}) {
    std::mt19937_64 rng(seed);
    const int64_t B = 3, capacity = 10, page = seed % 2 ? 3 : 4, pages = seed < 3 ? 7 : 12;
    KVCacheConfig cfg;
    cfg.batch = B, cfg.kv_heads = 1, cfg.capacity = capacity, cfg.head_dim = 2, cfg.page_size = page;
    cfg.num_pages = pages;
    KVCache cache(cfg);
    shadow::Model m(B, capacity, page, pages);
    auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
    float next = 1;
    int successes = 0, failures = 0, table_successes = 0, truncations = 0;
    for (int op = 0; op < 600; ++op) {
      SCOPED_TRACE("seed " + std::to_string(seed) + " op " + std::to_string(op));
      const int64_t kind = pick(0, 11), b = pick(0, B - 1);
      bool ok = true, want = true;
      try {
        if (kind <= 3) {  // append to one sequence
          const int64_t n = pick(1, 5);
          Tensor<float> k({1, n, 2}), v({1, n, 2});
          for (int64_t i = 0; i < n; ++i) fill_token(&k[size_t(2 * i)], &v[size_t(2 * i)], next + float(i));
          want = m.append(b, n, next);
          next += float(n);
          cache.append(b, k.view<3>(), v.view<3>());
        } else if (kind <= 5) {  // append to every sequence
          const int64_t n = pick(1, 3);
          Tensor<float> k({B, 1, n, 2}), v({B, 1, n, 2});
          for (int64_t i = 0; i < B * n; ++i) fill_token(&k[size_t(2 * i)], &v[size_t(2 * i)], next + float(i));
          want = m.append_all(n, next);
          next += float(B * n);
          cache.append(k.view4(), v.view4());
        } else if (kind == 6) {
          m.reset(b);
          cache.reset(b);
        } else if (kind >= 10) {  // drop a tail (now and then a length out of range)
          const int64_t length = pick(-1, m.len[size_t(b)] + 1);
          want = m.truncate(b, length);
          if (want) ++truncations;
          cache.truncate(b, length);
        } else {  // a new table: another sequence's full prefix and maybe a page of its own, or noise
          std::vector<int32_t> pg;
          int64_t length = 0;
          const int64_t a = pick(0, B - 1);
          if (kind <= 8) {
            const int64_t full = m.len[size_t(a)] / page;
            const int64_t k = pick(0, full);
            pg.assign(m.table[size_t(a)].begin(), m.table[size_t(a)].begin() + k);
            length = k * page;
            if (pick(0, 1) && k < m.width) {
              pg.push_back(int32_t(pick(0, pages - 1)));
              length += pick(0, page);
            }
          } else {
            for (int64_t s = pick(0, m.width + 1); s > 0; --s) pg.push_back(int32_t(pick(-1, pages)));
            length = pick(-1, int64_t(pg.size()) * page + 1);
          }
          want = m.set_table(b, pg, length);
          if (want) ++table_successes;
          cache.set_block_table(b, pg, length);
        }
      } catch (const InvalidArgument&) {
        ok = false;
      }
      ASSERT_EQ(ok, want) << "operation kind " << kind << " on sequence " << b;
      (ok ? successes : failures) += 1;
      ASSERT_EQ(cache.free_pages(), m.free_pages());
      for (int64_t s = 0; s < B; ++s) {
        ASSERT_EQ(cache.length(s), m.len[size_t(s)]) << "sequence " << s;
        ASSERT_EQ(cache.block_table(s), m.table[size_t(s)]) << "sequence " << s;
        const int64_t n = m.len[size_t(s)];
        Tensor<float> k({1, std::max<int64_t>(n, 1), 2}), v({1, std::max<int64_t>(n, 1), 2});
        cache.read(s, View3<float>(k.data(), {1, n, 2}), View3<float>(v.data(), {1, n, 2}));
        for (int64_t t = 0; t < n; ++t) {
          const float x = m.content[size_t(m.table[size_t(s)][size_t(t / page)])][size_t(t % page)];
          float kw[2], vw[2];
          fill_token(kw, vw, x);
          for (int e = 0; e < 2; ++e) {
            ASSERT_EQ(k[size_t(2 * t + e)], kw[e]) << "k of sequence " << s << " token " << t << " feature " << e;
            ASSERT_EQ(v[size_t(2 * t + e)], vw[e]) << "v of sequence " << s << " token " << t << " feature " << e;
          }
        }
      }
      if (op % 10 == 0) {  // the kernel follows the tables as the reference does
        Tensor<float> q = random_tensor<float>({B, 2, 2, 2}, rng), out({B, 2, 2, 2}), ref({B, 2, 2, 2});
        DecodeCall o;
        o.causal = false;
        decode_call(q.view4(), cache, out.view4(), o);
        o.backend = Backend::reference;
        decode_call(q.view4(), cache, ref.view4(), o);
        ASSERT_TRUE(all_close(out, ref, tolerance<float>(capacity, 60, 40), "decode over the tables"));
      }
    }
    EXPECT_GT(successes, 150) << "seed " << seed;
    EXPECT_GT(failures, 50) << "seed " << seed;
    EXPECT_GT(table_successes, 20) << "seed " << seed;
    EXPECT_GT(truncations, 40) << "seed " << seed;
    copies += m.copies;
  }
  EXPECT_GT(copies, 3);
}
