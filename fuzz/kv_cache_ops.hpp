// The property the KV-cache fuzzer checks, shared with the unit test that
// replays its seed corpus and random inputs (tests/test_kv_cache.cpp). The
// input bytes choose a configuration (extreme sizes included: near 2^31,
// 2^62, 2^63) and a sequence of operations (appends to one sequence or to
// all, resets, clears, truncations, block tables sharing another sequence's
// prefix pages, reads). Then:
// - a configuration is either built or refused with attn::InvalidArgument; one
//   whose bytes (computed here in 128-bit arithmetic) exceed the machine's
//   memory or overflow must be refused (too big to build here but legal
//   ones are skipped, not built);
// - each operation either succeeds or is refused with attn::InvalidArgument,
//   and a refused one changes nothing;
// - append_refusal(n) predicts whether appending n tokens to every sequence
//   succeeds;
// - after every operation each sequence reads back exactly the tokens of a
//   shadow model, the tables name distinct pages except shared full prefix
//   pages, and free_pages counts the pages no table names.
// Any other exception, a wrong value or a sanitizer report is a failure
// (std::abort, so libFuzzer keeps the input).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <limits>
#include <set>
#include <vector>

#include "attn/detail/memory.hpp"
#include "attn/kv_cache.hpp"

namespace attn::fuzz {

__extension__ typedef __int128 Wide;  // sizes past 2^64, exactly

class Bytes {
 public:
  Bytes(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  bool empty() const { return i_ >= n_; }
  uint8_t u8() { return i_ < n_ ? d_[i_++] : 0; }
  // A size: mostly small, sometimes an extreme value.
  int64_t size(int64_t small) {
    static const int64_t extremes[] = {0,
                                       -1,
                                       int64_t(1) << 31,
                                       (int64_t(1) << 31) - 1,
                                       int64_t(1) << 32,
                                       int64_t(1) << 40,
                                       int64_t(1) << 62,
                                       std::numeric_limits<int64_t>::max(),
                                       std::numeric_limits<int64_t>::max() / 2 + 1,
                                       std::numeric_limits<int64_t>::min()};
    const uint8_t b = u8();
    if (b >= 240) return extremes[(b - 240) % 10];
    return b % (small + 1);
  }

 private:
  const uint8_t* d_;
  size_t n_, i_ = 0;
};

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "kv_cache property violated: %s\n", what);
  std::abort();
}

// Whether the constructor must refuse `c`: an argument out of range, a page
// count past int32 (page ids) or int64, or more bytes (K, V, tables, counts;
// computed in 128 bits) than 2^64 or the machine's memory. `bytes` is the
// size of a cache it must build.
struct Verdict {
  bool refuse = false;
  Wide bytes = 0;
};

inline Verdict verdict(const KVCacheConfig& c) {
  if (c.batch < 1 || c.kv_heads < 1 || c.capacity < 1 || c.head_dim < 1 || c.value_dim < 0 || c.page_size < 0 ||
      c.num_pages < 0 || (c.page_size == 0 && c.num_pages != 0))
    return {true};
  const Wide elem = c.dtype == Dtype::float32 ? 4 : 2, Ev = c.value_dim ? c.value_dim : c.head_dim;
  const Wide page = c.page_size ? c.page_size : c.capacity;
  Wide pages = c.batch, width = 1;
  if (c.page_size > 0) {
    const Wide per_seq = (Wide(c.capacity) + c.page_size - 1) / c.page_size;
    pages = c.num_pages ? Wide(c.num_pages) : c.batch * per_seq;
    width = std::min(per_seq, pages);
  }
  if (pages > std::numeric_limits<int32_t>::max()) return {true};
  const Wide cap = Wide(1) << 100;  // products saturate here, far past 2^64
  auto mul = [&](Wide a, Wide b) { return b != 0 && a > cap / b ? cap : a * b; };
  const Wide total = mul(mul(mul(mul(pages, page), c.kv_heads), c.head_dim + Ev), elem) + mul(c.batch, width) * 4 +
                         pages * 4 + Wide(c.batch) * 8;
  const uint64_t phys = detail::physical_memory_bytes();
  return {total >= (Wide(1) << 64) || (phys != 0 && total > Wide(phys)), total};
}

struct Shadow {
  std::vector<std::vector<float>> tokens;  // per sequence: one value per token
};

inline void check_state(const KVCache& cache, const Shadow& s) {
  const int64_t Hkv = cache.kv_heads(), E = cache.head_dim(), Ev = cache.value_dim();
  std::set<int32_t> pages;
  for (int64_t b = 0; b < cache.batch(); ++b) {
    const auto& want = s.tokens[size_t(b)];
    const int64_t n = int64_t(want.size());
    if (cache.length(b) != n) fail("length differs from the shadow model");
    std::vector<float> k(size_t(std::max<int64_t>(Hkv * n * E, 1))), v(size_t(std::max<int64_t>(Hkv * n * Ev, 1)));
    cache.read(b, View3<float>(k.data(), {Hkv, n, E}), View3<float>(v.data(), {Hkv, n, Ev}));
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t e = 0; e < E; ++e)
          if (k[size_t((h * n + t) * E + e)] != want[size_t(t)]) fail("a key reads back wrong");
        for (int64_t e = 0; e < Ev; ++e)
          if (v[size_t((h * n + t) * Ev + e)] != -want[size_t(t)]) fail("a value reads back wrong");
      }
    if (cache.paged()) {
      const auto table = cache.block_table(b);
      if (int64_t(table.size()) < (n + cache.page_size() - 1) / cache.page_size()) fail("a table is too short");
      for (int32_t p : table) {
        if (p < 0 || p >= cache.num_pages()) fail("a table names a page outside the pool");
        pages.insert(p);
      }
    }
  }
  if (cache.paged() && cache.free_pages() != cache.num_pages() - int64_t(pages.size()))
    fail("free_pages does not count the pages no table names");
}

// Appends n tokens to sequence b, or to all when b < 0: token x has keys x
// and values −x in every head and feature, x = next, next + 1, ... mod 100
// (exact in every storage type; a page never written reads as x = 0).
inline bool append(KVCache& cache, Shadow& s, int64_t b, int64_t n, int& next) {
  const int64_t Hkv = cache.kv_heads(), E = cache.head_dim(), Ev = cache.value_dim();
  const int64_t B = b < 0 ? cache.batch() : 1;
  std::vector<float> k(size_t(std::max<int64_t>(B * Hkv * n * E, 1))), v(size_t(std::max<int64_t>(B * Hkv * n * Ev, 1)));
  std::vector<std::vector<float>> vals(static_cast<size_t>(B));
  for (int64_t s2 = 0; s2 < B; ++s2)
    for (int64_t t = 0; t < n; ++t) {
      const float x = float(next++ % 100);
      vals[size_t(s2)].push_back(x);
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t e = 0; e < E; ++e) k[size_t(((s2 * Hkv + h) * n + t) * E + e)] = x;
        for (int64_t e = 0; e < Ev; ++e) v[size_t(((s2 * Hkv + h) * n + t) * Ev + e)] = -x;
      }
    }
  try {
    if (b < 0)
      cache.append(View4<const float>(k.data(), {B, Hkv, n, E}), View4<const float>(v.data(), {B, Hkv, n, Ev}));
    else
      cache.append(b, View3<const float>(k.data(), {Hkv, n, E}), View3<const float>(v.data(), {Hkv, n, Ev}));
  } catch (const InvalidArgument&) {
    return false;
  }
  for (int64_t s2 = 0; s2 < B; ++s2) {
    auto& dst = s.tokens[size_t(b < 0 ? s2 : b)];
    dst.insert(dst.end(), vals[size_t(s2)].begin(), vals[size_t(s2)].end());
  }
  return true;
}

// Runs the input; returns true when the configuration was built.
inline bool check_kv_cache(const uint8_t* data, size_t size) {
  Bytes in(data, size);
  KVCacheConfig cfg;
  cfg.batch = in.size(3);
  cfg.kv_heads = in.size(2);
  cfg.capacity = in.size(24);
  cfg.head_dim = in.size(4);
  cfg.value_dim = in.size(3);
  cfg.dtype = Dtype(in.u8() % 3);
  cfg.page_size = in.size(6);
  cfg.num_pages = cfg.page_size > 0 ? in.size(12) : 0;
  const Verdict want = verdict(cfg);
  if (!want.refuse && want.bytes > (Wide(64) << 20)) return false;  // legal, but not built here
  std::vector<KVCache> built;
  try {
    built.emplace_back(cfg);
  } catch (const InvalidArgument&) {
    if (!want.refuse) fail("a configuration that fits was refused");
    return false;
  }
  if (want.refuse) fail("a configuration that does not fit was built");
  KVCache& cache = built.back();
  Shadow s;
  s.tokens.assign(size_t(cfg.batch), {});
  int next = 1;
  while (!in.empty()) {
    const uint8_t op = in.u8() % 7;
    const int64_t b = in.u8() % (cfg.batch + 1) - 1;  // -1: every sequence, where the operation has that form
    const int64_t seq = b < 0 ? 0 : b;
    switch (op) {
      case 0:
      case 1: {
        const int64_t n = in.size(9);
        if (n < 0 || n > (int64_t(1) << 20)) break;
        const bool predicted = b >= 0 || cache.append_refusal(n).empty();  // a batch append's verdict
        if (append(cache, s, b, n, next) != predicted && b < 0) fail("append_refusal mispredicted a batch append");
        break;
      }
      case 2:
        if (b < 0)
          cache.clear(), s.tokens.assign(size_t(cfg.batch), {});
        else
          cache.reset(b), s.tokens[size_t(b)].clear();
        break;
      case 3: {
        const int64_t len = in.size(24);
        try {
          cache.truncate(seq, len);
          s.tokens[size_t(seq)].resize(size_t(len));
        } catch (const InvalidArgument&) {
          if (len >= 0 && len <= int64_t(s.tokens[size_t(seq)].size()) && !cache.paged())
            fail("a truncation within the length was refused");
        }
        break;
      }
      case 4: {  // share the full prefix pages of sequence `from` with `seq`
        if (!cache.paged()) break;
        const int64_t from = in.u8() % cfg.batch, full = int64_t(s.tokens[size_t(from)].size()) / cache.page_size();
        const int64_t keep = std::min<int64_t>(in.u8() % (full + 1), full);
        auto pages = cache.block_table(from);
        pages.resize(size_t(keep));
        const int64_t length = keep * cache.page_size();
        try {
          cache.set_block_table(seq, pages, length);
          if (from != seq) s.tokens[size_t(seq)].assign(s.tokens[size_t(from)].begin(), s.tokens[size_t(from)].begin() + length);
          else s.tokens[size_t(seq)].resize(size_t(length));
        } catch (const InvalidArgument&) {
        }
        break;
      }
      case 5: {  // a table of arbitrary page ids
        if (!cache.paged()) break;
        std::vector<int32_t> pages(in.u8() % 4);
        for (auto& p : pages) p = int32_t(in.size(16));
        try {
          cache.set_block_table(seq, pages, in.size(12));
          s.tokens[size_t(seq)].clear();  // whatever those pages held: read it back as the new truth
          std::vector<float> k(size_t(cache.kv_heads() * cache.length(seq) * cache.head_dim() + 1)),
              v(size_t(cache.kv_heads() * cache.length(seq) * cache.value_dim() + 1));
          const int64_t n = cache.length(seq);
          cache.read(seq, View3<float>(k.data(), {cache.kv_heads(), n, cache.head_dim()}),
                     View3<float>(v.data(), {cache.kv_heads(), n, cache.value_dim()}));
          for (int64_t t = 0; t < n; ++t) s.tokens[size_t(seq)].push_back(-v[size_t(t * cache.value_dim())]);
        } catch (const InvalidArgument&) {
        }
        break;
      }
      default:
        break;
    }
    check_state(cache, s);
  }
  return true;
}

}  // namespace attn::fuzz
