// One KV cache shared by threads (the contract in attn/kv_cache.hpp): each
// writer thread owns one sequence of a paged pool and appends, truncates,
// resets and refills it while reader threads run batch decodes over every
// sequence. Every key and value of sequence b is the constant b + 1, so a
// decode of a sequence that reads its own tokens gives exactly b + 1 in every
// output (softmax weights summing to 1 over equal values), 0 when it is
// empty; a page taken by two sequences, or read half-written, shows as
// another value. Afterwards the pages are counted: every table page belongs
// to one sequence, and the free count is the rest. Run under
// ThreadSanitizer by `make test-tsan`.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "attn/kv_cache.hpp"

namespace {

using namespace attn;

constexpr int64_t kHkv = 2, kE = 8, kPage = 4;

// n tokens of sequence b: every element b + 1.
Tensor<float> tokens(int64_t b, int64_t n, int64_t E = kE) {
  Tensor<float> t({kHkv, n, E});
  t.fill(float(b + 1));
  return t;
}

// One writer's loop over sequence b: append in pieces up to the capacity,
// truncate back, reset, refill. Returns how many of its operations failed.
int write_sequence(KVCache& cache, int64_t b, int rounds) {
  int failures = 0;
  for (int r = 0; r < rounds; ++r) {
    for (int64_t n : {1, 3, 2, 5, 1}) {
      if (cache.length(b) + n > cache.capacity()) break;
      const Tensor<float> k = tokens(b, n), v = tokens(b, n);
      try {
        cache.append(b, k.view<3>(), v.view<3>());
      } catch (const InvalidArgument&) {
        ++failures;  // the pool is shared: only when it is exhausted
      }
    }
    if (r % 3 == 1) cache.truncate(b, cache.length(b) / 2);
    if (r % 3 == 2) cache.reset(b);
  }
  return failures;
}

// Batch decodes of one query per sequence; returns the worst deviation of an
// output from b + 1 (or from 0 for an empty sequence).
double decode_and_check(const KVCache& cache, int rounds) {
  const int64_t B = cache.batch(), H = 2 * kHkv;
  Tensor<float> q({B, H, 1, kE}), out({B, H, 1, kE}), lse({B, H, 1});
  for (size_t i = 0; i < q.size(); ++i) q[i] = float(i % 7) * 0.25f - 0.5f;
  double worst = 0;
  SdpaOptions opt;
  opt.num_threads = 1;
  for (int r = 0; r < rounds; ++r) {
    decode_attention({{}, q.view4(), &cache}, {out.view4(), {}, lse.view<3>()}, opt);
    const auto o = out.view4();
    const auto l = lse.view<3>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const bool empty = std::isinf(l(b, h, 0));
        for (int64_t e = 0; e < kE; ++e) {
          const double want = empty ? 0.0 : double(b + 1), got = o(b, h, 0, e);
          worst = std::max(worst, std::isnan(got) ? INFINITY : std::abs(got - want));
        }
      }
  }
  return worst;
}

// The pages of every table are distinct across sequences, and free_pages
// counts the rest; each sequence reads back its own value.
void expect_consistent(const KVCache& cache) {
  std::set<int32_t> used;
  int64_t entries = 0;
  for (int64_t b = 0; b < cache.batch(); ++b) {
    const int64_t n = cache.length(b);
    const std::vector<int32_t> table = cache.block_table(b);
    EXPECT_EQ(int64_t(table.size()), (n + kPage - 1) / kPage) << "sequence " << b;
    for (int32_t p : table) used.insert(p);
    entries += int64_t(table.size());
    Tensor<float> k({kHkv, std::max<int64_t>(n, 1), kE}), v({kHkv, std::max<int64_t>(n, 1), kE});
    cache.read(b, View3<float>(k.data(), {kHkv, n, kE}), View3<float>(v.data(), {kHkv, n, kE}));
    for (int64_t i = 0; i < kHkv * n * kE; ++i) {
      ASSERT_EQ(k.data()[i], float(b + 1)) << "sequence " << b << " key element " << i;
      ASSERT_EQ(v.data()[i], float(b + 1)) << "sequence " << b << " value element " << i;
    }
  }
  EXPECT_EQ(int64_t(used.size()), entries) << "a page is in two tables";
  EXPECT_EQ(cache.free_pages(), cache.num_pages() - entries);
}

TEST(KVCacheThreads, WritersOfDifferentSequencesAndBatchDecodes) {
  const int64_t B = 4, capacity = 24;
  KVCacheConfig cfg;
  cfg.batch = B, cfg.kv_heads = kHkv, cfg.capacity = capacity, cfg.head_dim = kE, cfg.page_size = kPage;
  KVCache cache(cfg);  // B · capacity / page pages: appends never run out
  std::vector<std::thread> threads;
  std::vector<int> failures(size_t(B), 0);
  std::atomic<double> worst{0};
  for (int64_t b = 0; b < B; ++b)
    threads.emplace_back([&, b] { failures[size_t(b)] = write_sequence(cache, b, 400); });
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&] {
      const double w = decode_and_check(cache, 300);
      for (double cur = worst.load(); w > cur && !worst.compare_exchange_weak(cur, w);) {
      }
    });
  for (auto& t : threads) t.join();
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(failures[size_t(b)], 0) << "sequence " << b;
  EXPECT_LE(worst.load(), 1e-5) << "a decode read another sequence's tokens or a page in flux";
  expect_consistent(cache);
}

// A pool smaller than the sequences need: appends compete for pages, and a
// refused append (the pool exhausted) changes nothing.
TEST(KVCacheThreads, WritersCompetingForAShortPool) {
  const int64_t B = 4;
  KVCacheConfig cfg;
  cfg.batch = B, cfg.kv_heads = kHkv, cfg.capacity = 32, cfg.head_dim = kE, cfg.page_size = kPage;
  cfg.num_pages = 12;
  KVCache cache(cfg);
  std::vector<std::thread> threads;
  for (int64_t b = 0; b < B; ++b) threads.emplace_back([&, b] { write_sequence(cache, b, 400); });
  threads.emplace_back([&] { EXPECT_LE(decode_and_check(cache, 300), 1e-5); });
  for (auto& t : threads) t.join();
  expect_consistent(cache);
}

// Whole-batch appends and clears from one thread against reads from others.
TEST(KVCacheThreads, BatchAppendsAndClearsAgainstReaders) {
  const int64_t B = 3;
  KVCacheConfig cfg;
  cfg.batch = B, cfg.kv_heads = kHkv, cfg.capacity = 16, cfg.head_dim = kE, cfg.page_size = kPage;
  cfg.dtype = Dtype::bfloat16;  // b + 1 is exact in bfloat16
  KVCache cache(cfg);
  std::thread writer([&] {
    Tensor<float> k({B, kHkv, 2, kE});
    for (size_t i = 0; i < k.size(); ++i) k[i] = float(int64_t(i) / (kHkv * 2 * kE) + 1);
    for (int r = 0; r < 1000; ++r) {
      if (cache.max_length() + 2 > cache.capacity()) cache.clear();
      cache.append(k.view4(), k.view4());
    }
  });
  std::thread reader([&] { EXPECT_LE(decode_and_check(cache, 300), 1e-5); });
  std::thread counter([&] {
    for (int r = 0; r < 1000; ++r) {
      const int64_t free = cache.free_pages();
      EXPECT_GE(free, 0);
      EXPECT_LE(free, cache.num_pages());
      EXPECT_EQ(cache.append_refusal(-1).empty(), false);
    }
  });
  writer.join();
  reader.join();
  counter.join();
  expect_consistent(cache);
}

}  // namespace
