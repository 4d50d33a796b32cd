// Shared by the KV-cache and decode tests: a cache filled with random keys
// and values appended in pieces of random sizes, the test's own copy of the
// stored (rounded) values, and the oracle: the reference backend of the
// dense call on that copy, one sequence at a time.
#pragma once

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attn/kv_cache.hpp"
#include "testing.hpp"

namespace attn::testing {

struct DecodeCase {
  int64_t B = 1, H = 4, Hkv = 1, L = 1, E = 16, Ev = 16;
  int64_t page = 0;  // 0 = contiguous
  KVDtype dtype = KVDtype::float32;
  bool causal = true;
  std::vector<int64_t> lens;  // per sequence
  std::string str() const {
    std::string s = "B=" + std::to_string(B) + " H=" + std::to_string(H) + " Hkv=" + std::to_string(Hkv) +
                    " L=" + std::to_string(L) + " E=" + std::to_string(E) + " Ev=" + std::to_string(Ev) +
                    " page=" + std::to_string(page) + " " + kv_dtype_name(dtype) + (causal ? " causal" : "") +
                    " lens=";
    for (auto n : lens) s += std::to_string(n) + ",";
    return s;
  }
  int64_t capacity() const {
    int64_t c = 1;
    for (auto n : lens) c = std::max(c, n);
    return c;
  }
};

// x rounded to the storage type, written independently of the library:
// keep `bits` significant bits (11 for float16, 8 for bfloat16), ties to
// even (nearbyint in the default rounding mode); float16 has a fixed
// quantum 2^-24 below its smallest normal 2^-14.
inline float round_to(KVDtype t, float x) {
  if (t == KVDtype::float32 || !std::isfinite(x) || x == 0.0f) return x;
  int e = 0;
  std::frexp(double(x), &e);  // x = m·2^e, 0.5 <= |m| < 1
  const int bits = t == KVDtype::float16 ? 11 : 8;
  if (t == KVDtype::float16) e = std::max(e, -13);
  const double ulp = std::ldexp(1.0, e - bits);
  return float(std::nearbyint(double(x) / ulp) * ulp);
}

struct Filled {
  KVCache cache;
  std::vector<Tensor<float>> k, v;  // per sequence: (Hkv, len, E|Ev), rounded
  Tensor<float> q;                  // (B, H, L, E)
};

inline KVCacheConfig config_of(const DecodeCase& c, int64_t extra_capacity = 0) {
  KVCacheConfig cfg;
  cfg.batch = c.B;
  cfg.kv_heads = c.Hkv;
  cfg.capacity = c.capacity() + extra_capacity;
  cfg.head_dim = c.E;
  cfg.value_dim = c.Ev;
  cfg.dtype = c.dtype;
  cfg.page_size = c.page;
  return cfg;
}

// Appends each sequence's tokens in pieces of 1..13 tokens (crossing page
// boundaries at random places) and keeps the rounded copy.
inline Filled fill(const DecodeCase& c, std::mt19937_64& rng) {
  Filled f{KVCache(config_of(c)), {}, {}, random_tensor<float>({c.B, c.H, c.L, c.E}, rng)};
  std::uniform_int_distribution<int64_t> piece(1, 13);
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t n = c.lens[size_t(b)];
    Tensor<float> kb = random_tensor<float>({c.Hkv, std::max<int64_t>(n, 1), c.E}, rng);
    Tensor<float> vb = random_tensor<float>({c.Hkv, std::max<int64_t>(n, 1), c.Ev}, rng);
    for (int64_t t = 0; t < n;) {
      const int64_t m = std::min(piece(rng), n - t);
      f.cache.append(b, View3<const float>(&kb[size_t(t * c.E)], {c.Hkv, m, c.E}, {std::max<int64_t>(n, 1) * c.E, c.E, 1}),
                     View3<const float>(&vb[size_t(t * c.Ev)], {c.Hkv, m, c.Ev}, {std::max<int64_t>(n, 1) * c.Ev, c.Ev, 1}));
      t += m;
    }
    for (size_t i = 0; i < kb.size(); ++i) kb[i] = round_to(c.dtype, kb[i]);
    for (size_t i = 0; i < vb.size(); ++i) vb[i] = round_to(c.dtype, vb[i]);
    f.k.push_back(std::move(kb));
    f.v.push_back(std::move(vb));
  }
  return f;
}

// The oracle: per sequence, the dense reference on the stored values, the
// queries being the last L tokens (bottom-right causal).
inline void oracle(const DecodeCase& c, const Filled& f, Tensor<float>& out, Tensor<float>& lse) {
  out = Tensor<float>({c.B, c.H, c.L, c.Ev});
  lse = Tensor<float>({c.B, c.H, c.L});
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t S = c.lens[size_t(b)];
    if (S == 0) {
      for (int64_t i = 0; i < c.H * c.L; ++i) lse[size_t(b * c.H * c.L + i)] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const int64_t kstride = f.k[size_t(b)].dim(1);  // allocated rows (>= 1)
    SdpaArgs<float> a;
    a.q = View4<const float>(f.q.data() + b * c.H * c.L * c.E, {1, c.H, c.L, c.E});
    a.k = View4<const float>(f.k[size_t(b)].data(), {1, c.Hkv, S, c.E}, {0, kstride * c.E, c.E, 1});
    a.v = View4<const float>(f.v[size_t(b)].data(), {1, c.Hkv, S, c.Ev}, {0, kstride * c.Ev, c.Ev, 1});
    SdpaOptions o;
    o.backend = Backend::reference;
    o.causal = c.causal;
    o.causal_align = CausalAlign::bottom_right;
    scaled_dot_product_attention(a,
                                 {View4<float>(out.data() + b * c.H * c.L * c.Ev, {1, c.H, c.L, c.Ev}), {},
                                  View3<float>(lse.data() + b * c.H * c.L, {1, c.H, c.L})},
                                 o);
  }
}

}  // namespace attn::testing
