// Shared by the KV-cache and decode tests: a cache filled with random keys
// and values appended in pieces of random sizes, the test's own copy of the
// stored (rounded) values, and the oracle: the reference backend of the
// dense call on that copy, one sequence at a time.
#pragma once

#include <cmath>
#include <cstring>
#include <initializer_list>
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
  Dtype dtype = Dtype::float32;
  bool causal = true;
  std::vector<int64_t> lens;  // per sequence
  // The score-rule variants (none by default).
  Window window;
  double softcap = 0;
  std::vector<float> slopes, sinks;  // (H) each, or empty
  // Elementwise rules over key positions: (B|1, H|1, L|1, capacity), or empty.
  Tensor<bool> mask;
  Tensor<float> bias;
  bool variants() const {
    return window.left >= 0 || window.right >= 0 || softcap > 0 || !slopes.empty() || !sinks.empty() ||
           mask.size() > 0 || bias.size() > 0;
  }
  std::string str() const {
    std::string s = "B=" + std::to_string(B) + " H=" + std::to_string(H) + " Hkv=" + std::to_string(Hkv) +
                    " L=" + std::to_string(L) + " E=" + std::to_string(E) + " Ev=" + std::to_string(Ev) +
                    " page=" + std::to_string(page) + " " + dtype_name(dtype) + (causal ? " causal" : "") +
                    " lens=";
    for (auto n : lens) s += std::to_string(n) + ",";
    if (window.left >= 0 || window.right >= 0)
      s += " window=(" + std::to_string(window.left) + "," + std::to_string(window.right) + ")";
    if (softcap > 0) s += " softcap=" + std::to_string(softcap);
    if (!slopes.empty()) s += " alibi";
    if (!sinks.empty()) s += " sinks";
    if (mask.size() > 0) s += " mask" + shape_str(mask.shape());
    if (bias.size() > 0) s += " bias" + shape_str(bias.shape());
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
inline float round_to(Dtype t, float x) {
  if (t == Dtype::float32 || !std::isfinite(x) || x == 0.0f) return x;
  int e = 0;
  std::frexp(double(x), &e);  // x = m·2^e, 0.5 <= |m| < 1
  const int bits = t == Dtype::float16 ? 11 : 8;
  if (t == Dtype::float16) e = std::max(e, -13);
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

// Element (b, h, i, j) of a broadcastable (B|1, H|1, L|1, K) tensor.
template <class T>
T at_broadcast(const Tensor<T>& x, int64_t b, int64_t h, int64_t i, int64_t j) {
  const auto& s = x.shape();
  const int64_t bb = s[0] == 1 ? 0 : b, hh = s[1] == 1 ? 0 : h, ii = s[2] == 1 ? 0 : i, jj = s[3] == 1 ? 0 : j;
  return x[size_t(((bb * s[1] + hh) * s[2] + ii) * s[3] + jj)];
}

// The oracle: per sequence, the dense reference on the stored values, the
// queries being the last L tokens (bottom-right causal). The window and
// ALiBi are written here independently of the library's rules, as a boolean
// mask and an additive bias over positions (query i at S − L + i), combined
// with the case's own mask and bias; the soft-cap and the sinks go to the
// reference as options.
inline void oracle(const DecodeCase& c, const Filled& f, Tensor<float>& out, Tensor<float>& lse) {
  out = Tensor<float>({c.B, c.H, c.L, c.Ev});
  lse = Tensor<float>({c.B, c.H, c.L});
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t S = c.lens[size_t(b)];
    if (S == 0) {
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.L; ++i)
          lse[size_t((b * c.H + h) * c.L + i)] = c.sinks.empty() ? -std::numeric_limits<float>::infinity() : c.sinks[size_t(h)];
      continue;
    }
    Tensor<bool> mask({1, c.H, c.L, S});
    Tensor<float> bias({1, c.H, c.L, S});
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.L; ++i)
        for (int64_t j = 0; j < S; ++j) {
          const int64_t pos = S - c.L + i;
          const bool seen = (!c.causal || j <= pos) && (c.window.left < 0 || j >= pos - c.window.left) &&
                            (c.window.right < 0 || j <= pos + c.window.right);
          const size_t e = size_t((h * c.L + i) * S + j);
          mask[e] = seen && (c.mask.size() == 0 || at_broadcast(c.mask, b, h, i, j));
          bias[e] = (c.slopes.empty() ? 0.0f : -c.slopes[size_t(h)] * float(std::abs(pos - j))) +
                    (c.bias.size() == 0 ? 0.0f : at_broadcast(c.bias, b, h, i, j));
        }
    const int64_t kstride = f.k[size_t(b)].dim(1);  // allocated rows (>= 1)
    SdpaArgs<float> a;
    a.q = View4<const float>(f.q.data() + b * c.H * c.L * c.E, {1, c.H, c.L, c.E});
    a.k = View4<const float>(f.k[size_t(b)].data(), {1, c.Hkv, S, c.E}, {0, kstride * c.E, c.E, 1});
    a.v = View4<const float>(f.v[size_t(b)].data(), {1, c.Hkv, S, c.Ev}, {0, kstride * c.Ev, c.Ev, 1});
    if (c.variants()) {
      a.mask = mask.view4();
      if (!c.slopes.empty() || c.bias.size() > 0) a.bias = bias.view4();
      if (!c.sinks.empty()) a.sinks = View1<const float>(c.sinks.data(), {c.H}, {1});
    }
    SdpaOptions o;
    o.backend = Backend::reference;
    o.causal = c.causal && !c.variants();  // else in the mask
    o.causal_align = CausalAlign::bottom_right;
    o.softcap = c.softcap;
    scaled_dot_product_attention(a,
                                 {View4<float>(out.data() + b * c.H * c.L * c.Ev, {1, c.H, c.L, c.Ev}), {},
                                  View3<float>(lse.data() + b * c.H * c.L, {1, c.H, c.L})},
                                 o);
  }
}

struct Result {
  Tensor<float> out, lse;
};

// A decode_attention call as the tests spell it: the options and the rule
// operands in one value, causal by default (the tests' new rows are the last
// tokens of their sequences).
struct DecodeCall : SdpaOptions, ScoreArgs<float> {
  DecodeCall() { causal = true; }
};
inline void decode_call(View4<const float> q, const KVCache& cache, View4<float> out, const DecodeCall& o = {},
                        View3<float> lse = {}) {
  DecodeArgs a;
  static_cast<ScoreArgs<float>&>(a) = o;
  a.q = q;
  a.cache = &cache;
  decode_attention(a, {out, {}, lse}, static_cast<const SdpaOptions&>(o));
}

// o with the case's score rules (causal, window, soft-cap, ALiBi, sinks).
inline DecodeCall with_rules(const DecodeCase& c, DecodeCall o = {}) {
  o.causal = c.causal;
  o.window = c.window;
  o.softcap = c.softcap;
  if (!c.slopes.empty()) o.alibi_slopes = View1<const float>(c.slopes.data(), {c.H}, {1});
  if (!c.sinks.empty()) o.sinks = View1<const float>(c.sinks.data(), {c.H}, {1});
  if (c.mask.size() > 0) o.mask = c.mask.view4();
  if (c.bias.size() > 0) o.bias = c.bias.view4();
  return o;
}

// decode_attention of q over a cache with the case's rules (o gives the
// rest: threads, backend).
inline Result run_on(const DecodeCase& c, const KVCache& cache, const Tensor<float>& q, const DecodeCall& o = {}) {
  Result r{Tensor<float>({c.B, c.H, c.L, c.Ev}), Tensor<float>({c.B, c.H, c.L})};
  decode_call(q.view4(), cache, r.out.view4(), with_rules(c, o), r.lse.view<3>());
  return r;
}
inline Result run(const DecodeCase& c, const Filled& f, const DecodeCall& o = {}) { return run_on(c, f.cache, f.q, o); }

// Tolerances from the reduction length (keys plus features) and magnitudes.
inline void expect_matches_oracle(const DecodeCase& c, const Filled& f, const Result& got) {
  Tensor<float> out, lse;
  oracle(c, f, out, lse);
  const int64_t n = c.capacity() + c.E;
  EXPECT_TRUE(all_close(got.out, out, tolerance<float>(n, 1.0, 40), "out " + c.str()));
  EXPECT_TRUE(all_close(got.lse, lse, tolerance<float>(n, max_abs(lse.view<3>()), 40), "lse " + c.str()));
}

inline bool bitwise_equal(const Tensor<float>& a, const Tensor<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The call on one thread matches the oracle, and each of `threads` gives
// its bits.
inline void expect_same_bits_for_threads(const DecodeCase& c, const Filled& f, std::initializer_list<int> threads,
                                         const std::string& label) {
  DecodeCall o;
  o.num_threads = 1;
  const Result base = run(c, f, o);
  expect_matches_oracle(c, f, base);
  for (const int t : threads) {
    o.num_threads = t;
    const Result r = run(c, f, o);
    EXPECT_TRUE(bitwise_equal(r.out, base.out)) << label << ", " << t << " threads";
    EXPECT_TRUE(bitwise_equal(r.lse, base.lse)) << label << ", " << t << " threads";
  }
}

// A random shape: GQA ratio 1-8, 1-3 sequences of 0-120 tokens, L 1-17,
// odd feature sizes, pages of 5-24 tokens or none, causal or not.
inline DecodeCase random_case(std::mt19937_64& rng) {
  const int64_t ratios[] = {1, 2, 4, 8};
  std::uniform_int_distribution<int> pick(0, 3);
  DecodeCase c;
  c.Hkv = std::uniform_int_distribution<int64_t>(1, 3)(rng);
  c.H = c.Hkv * ratios[pick(rng)];
  c.B = std::uniform_int_distribution<int64_t>(1, 3)(rng);
  c.L = std::uniform_int_distribution<int64_t>(1, 17)(rng);
  const int64_t dims[] = {1, 7, 16, 33, 64};
  c.E = dims[std::uniform_int_distribution<int>(0, 4)(rng)];
  c.Ev = dims[std::uniform_int_distribution<int>(0, 4)(rng)];
  const int64_t pages[] = {0, 5, 16, 24};
  c.page = pages[pick(rng)];
  c.causal = pick(rng) != 0;
  const int64_t maxlen = std::uniform_int_distribution<int64_t>(1, 120)(rng);
  for (int64_t b = 0; b < c.B; ++b) c.lens.push_back(std::uniform_int_distribution<int64_t>(0, maxlen)(rng));
  return c;
}

}  // namespace attn::testing
