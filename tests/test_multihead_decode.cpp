// The multi-head layer's incremental decoding (MultiheadAttention::decode):
// a sequence fed in steps of a few tokens through a KV cache gives, step
// after step, the rows of the explicit per-head computation in double over
// the whole prefix (multihead_reference.hpp), for packed and separate
// projections, with and without biases, with the score rules (window,
// soft-cap, ALiBi, sinks), a mask over the cache's positions, causal and
// not, contiguous and paged caches; a position-dependent Q/K transform at
// the cache's positions; sequences of their own lengths; NaN reaching only
// the rows that see it; and argument errors that leave the cache as it was.
#include <cmath>
#include <limits>
#include <vector>

#include "multihead_reference.hpp"

namespace {

using namespace attn;
using namespace attn::testing;

struct DecodeLayerCase {
  const char* name;
  MultiheadConfig cfg;
  int64_t B = 2;
  int64_t page = 0;  // 0: contiguous cache
  bool causal = true;
  SdpaOptions variants{};  // window and softcap
  bool alibi = false;
  bool mask = false;  // a random (B, 1, 1, C) mask over the cache's key positions
};

constexpr int64_t kCapacity = 16;
const std::vector<int64_t> kSteps = {3, 1, 1, 4, 2, 1};  // 12 tokens

KVCache cache_for(const MultiheadAttention<float>& m, int64_t B, int64_t page, KVDtype dtype = KVDtype::float32) {
  KVCacheConfig kc;
  kc.batch = B;
  kc.kv_heads = m.num_heads();
  kc.capacity = kCapacity;
  kc.head_dim = m.head_dim();
  kc.value_dim = m.v_head_dim();
  kc.page_size = page;
  kc.dtype = dtype;
  return KVCache(kc);
}

// Rows [first, first + n) of a (B, N, D) tensor as a (B, n, D) view.
View3<const float> rows(const Tensor<float>& x, int64_t first, int64_t n) {
  return View3<const float>(x.data() + first * x.dim(2), {x.dim(0), n, x.dim(2)}, {x.dim(1) * x.dim(2), x.dim(2), 1});
}

class MultiheadDecode : public ::testing::TestWithParam<DecodeLayerCase> {};

TEST_P(MultiheadDecode, EveryStepEqualsTheExplicitComputationOverThePrefix) {
  const DecodeLayerCase c = GetParam();
  std::mt19937_64 rng(41);
  MultiheadAttention<float> m(c.cfg, 5);
  randomize(m, rng, 0.5);
  const int64_t B = c.B, D = m.embed_dim(), H = m.num_heads();
  int64_t N = 0;
  for (int64_t n : kSteps) N += n;
  const Tensor<float> x = random_tensor<float>({B, N, D}, rng);
  Tensor<float> slopes = random_tensor<float>({H}, rng, 0.3);
  for (size_t h = 0; h < slopes.size(); ++h) slopes[h] = std::abs(slopes[h]);
  Tensor<bool> mask = random_bools({B, 1, 1, kCapacity}, rng, 0.75);
  KVCache cache = cache_for(m, B, c.page);
  MhaDecodeOptions opt;
  opt.sdpa = c.variants;
  opt.sdpa.causal = c.causal;
  int64_t len = 0;
  for (const int64_t n : kSteps) {
    SCOPED_TRACE(std::string(c.name) + " after " + std::to_string(len) + " tokens, " + std::to_string(n) + " more");
    MhaArgs<float> a;
    a.query = rows(x, len, n);
    if (c.alibi) a.alibi_slopes = slopes.view<1>();
    if (c.mask) a.attn_mask = mask.view4();
    Tensor<float> out({B, n, D});
    m.decode(a, cache, out.view<3>(), opt);
    len += n;
    for (int64_t b = 0; b < B; ++b) ASSERT_EQ(cache.length(b), len);
    // The reference over the whole prefix, with the mask cut to its keys.
    MhaArgs<float> r;
    r.query = rows(x, 0, len);
    r.alibi_slopes = a.alibi_slopes;
    if (c.mask) r.attn_mask = View4<const bool>(mask.data(), {B, 1, 1, len}, {kCapacity, kCapacity, kCapacity, 1});
    const RefResult want = reference_mha(m, r, c.causal, CausalAlign::top_left, c.variants);
    const View3<const double> want_new(want.y.data() + (len - n) * D, {B, n, D}, {len * D, D, 1});
    const double mag = std::max(max_abs(want.y.view<3>()), 1.0);
    EXPECT_TRUE(all_close(out.view<3>(), want_new, tolerance<float>(len * D, mag, 40), "decode"));
  }
}

std::vector<DecodeLayerCase> decode_cases() {
  std::vector<DecodeLayerCase> cs;
  cs.push_back({"packed", config(6, 2)});
  cs.push_back({"packed_nobias_paged", config(6, 3, false), 2, 5});
  cs.push_back({"separate_head_dims", config(5, 3, true, 0, 0, 2, 4), 3, 3});
  DecodeLayerCase c{"window_softcap_sinks", with_sinks(config(8, 2))};
  c.variants.window = {3, -1};
  c.variants.softcap = 1.5;
  cs.push_back(c);
  c = {"alibi_paged", config(6, 3), 1, 4};
  c.alibi = true;
  cs.push_back(c);
  c = {"mask_over_the_cache", with_sinks(config(6, 2)), 2, 3};
  c.mask = true;
  cs.push_back(c);
  c = {"not_causal", config(6, 2)};
  c.causal = false;
  cs.push_back(c);
  c = {"not_causal_window_right", config(6, 2), 1, 2};
  c.causal = false;
  c.variants.window = {2, 1};
  cs.push_back(c);
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Cases, MultiheadDecode, ::testing::ValuesIn(decode_cases()),
                         [](const auto& p) { return std::string(p.param.name); });

// A Q/K transform that depends on the position (row n scaled by 1 + n/4):
// decode applies forward_at at the cache's positions, so its rows equal
// those of forward() over the whole sequence, which applies `forward`.
QkTransform<float> position_scaling() {
  auto scale = [](View4<float> x, int64_t first) {
    for (int64_t b = 0; b < x.dim(0); ++b)
      for (int64_t h = 0; h < x.dim(1); ++h)
        for (int64_t n = 0; n < x.dim(2); ++n)
          for (int64_t e = 0; e < x.dim(3); ++e) x(b, h, n, e) *= float(1 + 0.25 * double(first + n));
  };
  QkTransform<float> t;
  t.forward = [scale](View4<float> q, View4<float> k) { scale(q, 0), scale(k, 0); };
  t.backward = t.forward;
  t.forward_at = [scale](View4<float> q, View4<float> k, int64_t first) { scale(q, first), scale(k, first); };
  return t;
}

TEST(MultiheadDecode, TheTransformRunsAtTheCachePositions) {
  std::mt19937_64 rng(7);
  MultiheadAttention<float> m(config(8, 2), 3);
  randomize(m, rng, 0.5);
  m.set_qk_transform(position_scaling());
  const int64_t B = 2, N = 9, D = 8;
  const Tensor<float> x = random_tensor<float>({B, N, D}, rng);
  MhaDecodeOptions opt;
  Tensor<float> full({B, N, D});
  m.forward({x.view<3>()}, {full.view<3>()}, opt);
  KVCache cache = cache_for(m, B, 4);
  int64_t len = 0;
  for (const int64_t n : {4, 1, 3, 1}) {
    Tensor<float> out({B, n, D});
    m.decode({rows(x, len, n)}, cache, out.view<3>(), opt);
    const View3<const float> want(full.data() + len * D, {B, n, D}, {N * D, D, 1});
    EXPECT_TRUE(all_close(out.view<3>(), want, tolerance<float>(N * D, max_abs(want), 40), "transform"));
    len += n;
  }
  // Without forward_at the layer cannot place the new rows and says so.
  QkTransform<float> only_forward = position_scaling();
  only_forward.forward_at = nullptr;
  m.set_qk_transform(only_forward);
  Tensor<float> out({B, 1, D});
  EXPECT_TRUE(throws_with([&] { m.decode({rows(x, 0, 1)}, cache, out.view<3>(), opt); },
                          {"MultiheadAttention::decode", "forward_at"}));
  EXPECT_EQ(cache.length(0), len);
}

// Each sequence has its own length: sequence 1 restarts (reset) while
// sequence 0 goes on, and each still equals the computation over its own
// tokens.
TEST(MultiheadDecode, SequencesKeepTheirOwnLengths) {
  std::mt19937_64 rng(8);
  MultiheadAttention<float> m(with_sinks(config(6, 3)), 4);
  randomize(m, rng, 0.5);
  const int64_t D = 6, N = 10;
  const Tensor<float> x = random_tensor<float>({2, N, D}, rng);
  KVCache cache = cache_for(m, 2, 3);
  const MhaDecodeOptions opt;
  Tensor<float> out({2, 5, D});
  m.decode({rows(x, 0, 5)}, cache, out.view<3>(), opt);
  cache.reset(1);
  // Sequence 0 continues with x[0, 5:10]; sequence 1 starts over with x[1, 0:5].
  Tensor<float> next({2, 5, D});
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t d = 0; d < D; ++d) {
      next[size_t(i * D + d)] = x[size_t((5 + i) * D + d)];
      next[size_t((5 + i) * D + d)] = x[size_t((N + i) * D + d)];
    }
  m.decode({next.view<3>()}, cache, out.view<3>(), opt);
  EXPECT_EQ(cache.length(0), 10);
  EXPECT_EQ(cache.length(1), 5);
  const RefResult r0 = reference_mha(m, MhaArgs<float>{View3<const float>(x.data(), {1, N, D})}, true);
  const RefResult r1 = reference_mha(m, MhaArgs<float>{View3<const float>(x.data() + N * D, {1, 5, D})}, true);
  const View3<const float> got0(out.data(), {1, 5, D}), got1(out.data() + 5 * D, {1, 5, D});
  EXPECT_TRUE(all_close(got0, View3<const double>(r0.y.data() + 5 * D, {1, 5, D}), tolerance<float>(N * D, 4, 40)));
  EXPECT_TRUE(all_close(got1, View3<const double>(r1.y.data(), {1, 5, D}), tolerance<float>(N * D, 4, 40)));
}

// NaN in one token's input reaches that sequence's rows from that token on
// (every later row sees its key), and no row of the other sequence.
TEST(MultiheadDecode, NanReachesTheRowsThatSeeIt) {
  std::mt19937_64 rng(9);
  MultiheadAttention<float> m(config(6, 2), 2);
  randomize(m, rng, 0.5);
  const int64_t D = 6;
  Tensor<float> x = random_tensor<float>({2, 6, D}, rng);
  x[size_t(2 * D + 1)] = std::numeric_limits<float>::quiet_NaN();  // sequence 0, token 2
  KVCache cache = cache_for(m, 2, 0);
  const MhaDecodeOptions opt;
  for (int64_t t = 0; t < 6; ++t) {
    Tensor<float> out({2, 1, D});
    m.decode({rows(x, t, 1)}, cache, out.view<3>(), opt);
    for (int64_t d = 0; d < D; ++d) {
      EXPECT_EQ(std::isnan(out[size_t(d)]), t >= 2) << "sequence 0, token " << t;
      EXPECT_TRUE(std::isfinite(out[size_t(D + d)])) << "sequence 1, token " << t;
    }
  }
}

// Without options decoding is causal (bottom-right), as decode_attention
// and Python's decode are: a chunk of 5 tokens gives the causal forward's
// rows. MhaDecodeOptions(MhaOptions{}) takes the forward's default, not
// causal, and gives the non-causal rows.
TEST(MultiheadDecode, IsCausalUnlessToldOtherwise) {
  std::mt19937_64 rng(11);
  MultiheadAttention<float> m(config(6, 2), 6);
  randomize(m, rng, 0.5);
  const int64_t B = 2, N = 5, D = 6;
  const Tensor<float> x = random_tensor<float>({B, N, D}, rng);
  MhaOptions causal;
  causal.sdpa.causal = true;
  Tensor<float> want_causal({B, N, D}), want_full({B, N, D}), got({B, N, D});
  m.forward({x.view<3>()}, {want_causal.view<3>()}, causal);
  m.forward({x.view<3>()}, {want_full.view<3>()});
  const double tol_mag = std::max(max_abs(want_causal.view<3>()), 1.0);
  KVCache a = cache_for(m, B, 0);
  m.decode({x.view<3>()}, a, got.view<3>());
  EXPECT_TRUE(all_close(got.view<3>(), View3<const float>(want_causal.view<3>()), tolerance<float>(N * D, tol_mag, 40),
                        "default"));
  KVCache b = cache_for(m, B, 0);
  m.decode({x.view<3>()}, b, got.view<3>(), MhaDecodeOptions(MhaOptions{}));
  EXPECT_TRUE(all_close(got.view<3>(), View3<const float>(want_full.view<3>()), tolerance<float>(N * D, tol_mag, 40),
                        "not causal"));
  EXPECT_FALSE(all_close(want_causal.view<3>(), View3<const float>(want_full.view<3>()), 1e-3, "the two differ"));
}

// A float attn_bias over the cache's key positions gives the rows of the
// forward with the same bias over the prefix; the output may be any strided
// view (here the (L, B, D) layout), with the same bits as a dense one.
TEST(MultiheadDecode, BiasOverTheCacheAndAStridedOutput) {
  std::mt19937_64 rng(12);
  MultiheadAttention<float> m(config(6, 3), 7);
  randomize(m, rng, 0.5);
  const int64_t B = 2, D = 6;
  int64_t N = 0;
  for (int64_t n : kSteps) N += n;
  const Tensor<float> x = random_tensor<float>({B, N, D}, rng);
  const Tensor<float> bias = random_tensor<float>({B, 1, 1, kCapacity}, rng, 2.0);
  KVCache cache = cache_for(m, B, 3), twin = cache_for(m, B, 3);
  int64_t len = 0;
  for (const int64_t n : kSteps) {
    SCOPED_TRACE("after " + std::to_string(len) + " tokens, " + std::to_string(n) + " more");
    MhaArgs<float> a;
    a.query = rows(x, len, n);
    a.attn_bias = bias.view4();
    Tensor<float> dense({B, n, D}), lbd({n, B, D});
    m.decode(a, cache, dense.view<3>());
    m.decode(a, twin, View3<float>(lbd.data(), {B, n, D}, {D, B * D, 1}));
    len += n;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; ++d)
          ASSERT_EQ(dense[size_t((b * n + i) * D + d)], lbd[size_t((i * B + b) * D + d)]) << b << "," << i << "," << d;
    MhaArgs<float> f;
    f.query = rows(x, 0, len);
    f.attn_bias = View4<const float>(bias.data(), {B, 1, 1, len}, {kCapacity, kCapacity, kCapacity, 1});
    MhaOptions causal;
    causal.sdpa.causal = true;
    Tensor<float> full({B, len, D});
    m.forward(f, {full.view<3>()}, causal);
    const View3<const float> want(full.data() + (len - n) * D, {B, n, D}, {len * D, D, 1});
    EXPECT_TRUE(all_close(dense.view<3>(), want, tolerance<float>(len * D, std::max(max_abs(want), 1.0), 40), "bias"));
  }
}

// What a cache holds: lengths, tables, free pages and the stored rows.
struct CacheState {
  std::vector<int64_t> lengths;
  std::vector<std::vector<int32_t>> tables;
  int64_t free_pages = 0;
  std::vector<std::vector<float>> rows;  // per sequence: its k, then its v
  bool operator==(const CacheState&) const = default;
};

CacheState state_of(const KVCache& c) {
  CacheState s;
  s.free_pages = c.free_pages();
  for (int64_t b = 0; b < c.batch(); ++b) {
    const int64_t n = c.length(b), Hkv = c.kv_heads(), E = c.head_dim(), Ev = c.value_dim();
    s.lengths.push_back(n);
    if (c.paged()) s.tables.push_back(c.block_table(b));
    std::vector<float> kv(size_t(Hkv * n * (E + Ev)));
    c.read(b, View3<float>(kv.data(), {Hkv, n, E}), View3<float>(kv.data() + Hkv * n * E, {Hkv, n, Ev}));
    s.rows.push_back(std::move(kv));
  }
  return s;
}

// Every refused argument names itself, and the cache keeps its lengths,
// tables, pages and contents.
TEST(MultiheadDecode, BadArgumentsLeaveTheCacheAsItWas) {
  std::mt19937_64 rng(10);
  MultiheadAttention<float> m(config(6, 2), 2);
  KVCache cache = cache_for(m, 2, 4);
  const Tensor<float> x = random_tensor<float>({2, 3, 6}, rng);
  Tensor<float> out({2, 3, 6});
  m.decode({x.view<3>()}, cache, out.view<3>());
  auto refused = [&](const MhaArgs<float>& a, const std::vector<std::string>& words, KVCache& c,
                     const MhaDecodeOptions& opt = {}, View3<float> o = {}) {
    if (o.empty()) o = out.view<3>();
    const CacheState before = state_of(c);
    bool ok = false;
    try {
      m.decode(a, c, o, opt);
    } catch (const InvalidArgument& e) {
      ok = true;
      for (const auto& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
    }
    EXPECT_TRUE(ok) << "no error for " << words.back();
    EXPECT_TRUE(state_of(c) == before) << "the cache changed: " << words.back();
  };
  const MhaArgs<float> good{x.view<3>()};
  MhaArgs<float> a = good;
  a.key = x.view<3>();
  a.value = x.view<3>();
  refused(a, {"MultiheadAttention::decode", "'key'", "self-attention"}, cache);
  a = good;
  Tensor<bool> kpm({2, 3});
  a.key_padding_mask = kpm.view<2>();
  refused(a, {"'key_padding_mask'"}, cache);
  MhaDecodeOptions with_offset;
  with_offset.sdpa.position_offset = 2;
  refused(good, {"'position_offset'"}, cache, with_offset);
  a = good;
  Tensor<bool> mask({2, 1, 3, 5});  // S = 5 instead of the capacity 16
  a.attn_mask = mask.view4();
  refused(a, {"'attn_mask'", "16"}, cache);
  a = good;
  Tensor<float> slopes({3});
  a.alibi_slopes = slopes.view<1>();
  refused(a, {"'alibi_slopes'"}, cache);
  MhaDecodeOptions bad_window;
  bad_window.sdpa.window = {-3, -1};
  refused(good, {"window"}, cache, bad_window);
  Tensor<float> narrow({2, 3, 5});
  refused(MhaArgs<float>{narrow.view<3>()}, {"'query'", "(B, L, D)"}, cache);
  refused(good, {"'out'"}, cache, {}, Tensor<float>({2, 2, 6}).view<3>());
  KVCache other = cache_for(m, 3, 0);
  refused(good, {"'query'", "batch"}, other);
  KVCacheConfig kc;
  kc.batch = 2, kc.kv_heads = 1, kc.capacity = 16, kc.head_dim = 3;
  KVCache one_head(kc);
  refused(good, {"'cache'", "(H, E, Ev)"}, one_head);
  // 3 + 3·4 = 15 tokens fit in 16; the fifth call would need 18.
  for (int i = 0; i < 4; ++i) m.decode(good, cache, out.view<3>());
  refused(good, {"'cache'", "capacity 16"}, cache);
  // A pool of 3 pages of 4 tokens for 2 sequences: 3 tokens each take a
  // page each; 2 more need a page for each sequence, and one is free.
  kc = KVCacheConfig{};
  kc.batch = 2, kc.kv_heads = 2, kc.capacity = 16, kc.head_dim = 3, kc.page_size = 4, kc.num_pages = 3;
  KVCache small_pool(kc);
  m.decode(good, small_pool, out.view<3>());
  const Tensor<float> x2 = random_tensor<float>({2, 2, 6}, rng);
  Tensor<float> out2({2, 2, 6});
  refused({x2.view<3>()}, {"'cache'", "page pool is exhausted"}, small_pool, {}, out2.view<3>());
  // With check_finite, projections that are not finite (here the keys, from
  // a NaN in the key rows of the packed weight) never reach the cache.
  MultiheadAttention<float> poisoned = m;
  poisoned.parameter("in_proj_weight")[size_t(6 * 6)] = std::numeric_limits<float>::quiet_NaN();  // row D: k
  MhaDecodeOptions checked;
  checked.sdpa.check_finite = true;
  KVCache fresh = cache_for(m, 2, 4);
  const CacheState empty = state_of(fresh);
  EXPECT_TRUE(throws_with([&] { poisoned.decode(good, fresh, out.view<3>(), checked); },
                          {"MultiheadAttention::decode", "'k (the projected keys)'", "NaN"}));
  EXPECT_TRUE(state_of(fresh) == empty);
  Tensor<float> nan_query = x;
  nan_query[0] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_with([&] { m.decode({nan_query.view<3>()}, fresh, out.view<3>(), checked); }, {"'query'"}));
  EXPECT_TRUE(state_of(fresh) == empty);
  // Without it the NaN goes in and reaches every row that sees that key.
  poisoned.decode(good, fresh, out.view<3>());
  EXPECT_EQ(fresh.length(0), 3);
  for (size_t i = 0; i < out.size(); ++i) EXPECT_TRUE(std::isnan(out[i])) << i;
}

// Decoding exists for float layers only: MultiheadAttention<double> has no decode.
template <class T>
constexpr bool can_decode = requires(const MultiheadAttention<T>& l, KVCache& c) { l.decode({}, c, View3<T>{}); };
static_assert(can_decode<float> && !can_decode<double>);

}  // namespace
