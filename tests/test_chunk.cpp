// Chunked attention (SdpaOptions::chunk_size, Llama 4's local layers): a
// query at position p sees only the keys of its own chunk, p / C == j / C
// rounding down, combined with causal, windows, key lengths and the rest.
// Every entry point is held to an independent formulation, the same call
// without chunks and with the rule written out as a boolean mask:
//   dense forward and backward, fused and reference (float32 and double)
//   varlen                  a packed batch against per-sequence mask calls
//   decode over a cache     contiguous and paged, float32 and float16
//                           storage, the decode kernel and chunked prefill
//   the multi-head layer    forward and decode
// and the tile skipping: a chunked forward visits about the visible
// fraction of the tiles (the band's classification).
#include <random>

#include "attn/kv_cache.hpp"
#include "attn/multihead.hpp"
#include "attn/sdpa.hpp"
#include "attn/varlen.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/fused/tiles.hpp"
#include "kernels/problem.hpp"
#include "testing.hpp"

namespace {

using namespace attn;
using namespace attn::testing;

// ⌊a / b⌋ for b > 0, written out (positions may be negative).
int64_t floor_div(int64_t a, int64_t b) { return int64_t(std::floor(double(a) / double(b))); }

// The chunk rule as a (1, 1, L, S) boolean mask: query i at position i + off.
Tensor<bool> chunk_mask(int64_t L, int64_t S, int64_t off, int64_t C) {
  Tensor<bool> m({1, 1, L, S});
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < S; ++j) m[size_t(i * S + j)] = floor_div(i + off, C) == floor_div(j, C);
  return m;
}

struct Shape {
  int64_t B, H, Hkv, L, S, E, Ev, chunk;
  bool causal;
  CausalAlign align;
  std::optional<int64_t> offset;
  Window window;
};

std::vector<Shape> shapes() {
  return {
      {2, 4, 2, 37, 37, 16, 8, 8, true, CausalAlign::top_left, {}, {}},
      {1, 2, 2, 45, 45, 9, 11, 16, false, CausalAlign::top_left, {}, {}},
      {2, 2, 1, 13, 50, 8, 8, 7, true, CausalAlign::bottom_right, {}, {}},
      {1, 3, 3, 30, 64, 16, 16, 1, true, CausalAlign::bottom_right, {}, {}},
      {1, 2, 1, 64, 64, 32, 32, 64, true, CausalAlign::top_left, {}, {}},
      {1, 2, 2, 20, 40, 8, 8, 6, false, CausalAlign::top_left, int64_t(-5), {}},
      {1, 2, 2, 33, 33, 8, 8, 10, true, CausalAlign::top_left, {}, {4, -1}},
      {1, 1, 1, 130, 130, 64, 64, 48, true, CausalAlign::top_left, {}, {}},
  };
}

SdpaOptions options_of(const Shape& s) {
  SdpaOptions o;
  o.causal = s.causal;
  o.causal_align = s.align;
  o.position_offset = s.offset;
  o.window = s.window;
  return o;
}
int64_t offset_of(const Shape& s) {
  if (s.offset) return *s.offset;
  return s.align == CausalAlign::bottom_right ? s.S - s.L : 0;
}

template <class T>
struct Outputs {
  Tensor<T> out, lse, dq, dk, dv;
};

template <class T>
Outputs<T> run(const Shape& s, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, const Tensor<T>& dout,
           const SdpaOptions& opt, const Tensor<bool>* mask) {
  SdpaArgs<T> a;
  a.q = q.view4(), a.k = k.view4(), a.v = v.view4();
  if (mask) a.mask = mask->view4();
  Outputs<T> r{Tensor<T>({s.B, s.H, s.L, s.Ev}), Tensor<T>({s.B, s.H, s.L}), Tensor<T>({s.B, s.H, s.L, s.E}),
           Tensor<T>({s.B, s.Hkv, s.S, s.E}), Tensor<T>({s.B, s.Hkv, s.S, s.Ev})};
  scaled_dot_product_attention(a, {r.out.view4(), {}, r.lse.template view<3>()}, opt);
  scaled_dot_product_attention_backward(a, View4<const T>(dout.view4()), {}, {r.dq.view4(), r.dk.view4(), r.dv.view4()},
                                        opt);
  return r;
}

template <class T>
void expect_same(const Outputs<T>& got, const Outputs<T>& want, double tol, const std::string& what) {
  EXPECT_TRUE(all_close(got.out, want.out, tol, what + " out"));
  // A row that sees no key has lse −∞ in both.
  EXPECT_TRUE(all_close(got.lse, want.lse, tol, what + " lse"));
  EXPECT_TRUE(all_close(got.dq, want.dq, tol, what + " dq"));
  EXPECT_TRUE(all_close(got.dk, want.dk, tol, what + " dk"));
  EXPECT_TRUE(all_close(got.dv, want.dv, tol, what + " dv"));
}

template <class T>
void dense_case(Backend backend, double tol) {
  std::mt19937_64 rng(17);
  for (const Shape& s : shapes()) {
    const std::string what = std::string(backend_name(backend)) + " L=" + std::to_string(s.L) +
                             " S=" + std::to_string(s.S) + " C=" + std::to_string(s.chunk);
    SCOPED_TRACE(what);
    const auto q = random_tensor<T>({s.B, s.H, s.L, s.E}, rng), k = random_tensor<T>({s.B, s.Hkv, s.S, s.E}, rng),
               v = random_tensor<T>({s.B, s.Hkv, s.S, s.Ev}, rng), dout = random_tensor<T>({s.B, s.H, s.L, s.Ev}, rng);
    SdpaOptions chunked = options_of(s), masked = options_of(s);
    chunked.chunk_size = s.chunk;
    chunked.backend = masked.backend = backend;
    const Tensor<bool> m = chunk_mask(s.L, s.S, offset_of(s), s.chunk);
    expect_same(run(s, q, k, v, dout, chunked, nullptr), run(s, q, k, v, dout, masked, &m), tol, what);
  }
}

TEST(Chunk, DenseFusedIsTheBooleanMask) { dense_case<float>(Backend::fused, 2e-5); }
TEST(Chunk, DenseReferenceIsTheBooleanMask) { dense_case<double>(Backend::reference, 1e-12); }

// Several tile sizes and thread counts: the same bits (the chunk boundaries
// cut tiles anywhere).
TEST(Chunk, FusedBitsDoNotDependOnThreads) {
  std::mt19937_64 rng(5);
  const Shape s{2, 4, 2, 150, 150, 32, 32, 40, true, CausalAlign::top_left, {}, {}};
  const auto q = random_tensor<float>({s.B, s.H, s.L, s.E}, rng), k = random_tensor<float>({s.B, s.Hkv, s.S, s.E}, rng),
             v = random_tensor<float>({s.B, s.Hkv, s.S, s.Ev}, rng), dout = random_tensor<float>({s.B, s.H, s.L, s.Ev}, rng);
  SdpaOptions o = options_of(s);
  o.chunk_size = s.chunk;
  o.num_threads = 1;
  const Outputs<float> one = run(s, q, k, v, dout, o, nullptr);
  for (int t : {2, 3}) {
    o.num_threads = t;
    const Outputs<float> r = run(s, q, k, v, dout, o, nullptr);
    EXPECT_TRUE(all_close(r.out, one.out, 0.0, "out")) << t;
    EXPECT_TRUE(all_close(r.dq, one.dq, 0.0, "dq")) << t;
    EXPECT_TRUE(all_close(r.dk, one.dk, 0.0, "dk")) << t;
  }
}

// A packed batch: each sequence as its own dense call with the mask.
TEST(Chunk, VarlenIsTheDenseMaskCallPerSequence) {
  std::mt19937_64 rng(9);
  const int64_t H = 2, E = 8, C = 5;
  const std::vector<int64_t> lens = {7, 0, 23, 12};
  std::vector<int64_t> cu{0};
  for (int64_t n : lens) cu.push_back(cu.back() + n);
  const int64_t total = cu.back();
  const auto q = random_tensor<float>({total, H, E}, rng), k = random_tensor<float>({total, H, E}, rng),
             v = random_tensor<float>({total, H, E}, rng);
  Tensor<int64_t> cut({int64_t(cu.size())});
  for (size_t i = 0; i < cu.size(); ++i) cut[i] = cu[i];
  VarlenArgs<float> a;
  a.q = q.view<3>(), a.k = k.view<3>(), a.v = v.view<3>();
  a.cu_seqlens_q = a.cu_seqlens_k = cut.view<1>();
  a.max_seqlen_q = a.max_seqlen_k = 23;
  Tensor<float> out({total, H, E});
  SdpaOptions o;
  o.causal = true;
  o.chunk_size = C;
  varlen_attention(a, {out.view<3>(), {}}, o);
  for (size_t b = 0; b < lens.size(); ++b) {
    const int64_t n = lens[b];
    if (n == 0) continue;
    // The dense call on a copy of the sequence, with the rule as a mask.
    Tensor<float> qs({1, H, n, E}), ks({1, H, n, E}), vs({1, H, n, E}), ys({1, H, n, E});
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < E; ++e) {
          const size_t src = size_t(((cu[b] + i) * H + h) * E + e), dst = size_t((h * n + i) * E + e);
          qs[dst] = q[src], ks[dst] = k[src], vs[dst] = v[src];
        }
    const Tensor<bool> m = chunk_mask(n, n, 0, C);
    SdpaArgs<float> d;
    d.q = qs.view4(), d.k = ks.view4(), d.v = vs.view4(), d.mask = m.view4();
    SdpaOptions dense;
    dense.causal = true;
    scaled_dot_product_attention(d, {ys.view4()}, dense);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < E; ++e)
          EXPECT_NEAR(out[size_t(((cu[b] + i) * H + h) * E + e)], ys[size_t((h * n + i) * E + e)], 2e-5)
              << "sequence " << b << " row " << i;
  }
}

// Over a cache the new rows sit at length(b) − L + i; the mask over the
// cache's key positions states the same rule.
TEST(Chunk, DecodeOverACacheIsTheMaskOverItsPositions) {
  std::mt19937_64 rng(21);
  const int64_t B = 2, Hkv = 2, H = 4, E = 16, cap = 300, C = 64;
  for (const Dtype dt : {Dtype::float32, Dtype::float16})
    for (const int64_t page : {int64_t(0), int64_t(16)})
      for (const int64_t L : {int64_t(1), int64_t(5), int64_t(70)}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " page " + std::to_string(page) + " L " + std::to_string(L));
        KVCacheConfig cfg;
        cfg.batch = B, cfg.kv_heads = Hkv, cfg.capacity = cap, cfg.head_dim = E, cfg.dtype = dt, cfg.page_size = page;
        KVCache cache(cfg);
        const std::vector<int64_t> lens = {200, 131};
        for (int64_t b = 0; b < B; ++b) {
          const auto kv = random_tensor<float>({Hkv, lens[size_t(b)], E}, rng);
          cache.append(b, kv.view<3>(), kv.view<3>());
        }
        const auto q = random_tensor<float>({B, H, L, E}, rng);
        Tensor<bool> m({B, 1, L, cap});
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = 0; i < L; ++i)
            for (int64_t j = 0; j < cap; ++j)
              m[size_t((b * L + i) * cap + j)] = (lens[size_t(b)] - L + i) / C == j / C;
        SdpaOptions chunked, masked;
        chunked.causal = masked.causal = true;
        chunked.chunk_size = C;
        DecodeArgs a;
        a.q = q.view4(), a.cache = &cache;
        Tensor<float> y1({B, H, L, E}), y2({B, H, L, E}), l1({B, H, L}), l2({B, H, L});
        decode_attention(a, {y1.view4(), {}, l1.view<3>()}, chunked);
        a.mask = m.view4();
        decode_attention(a, {y2.view4(), {}, l2.view<3>()}, masked);
        EXPECT_TRUE(all_close(y1, y2, 2e-5, "out"));
        EXPECT_TRUE(all_close(l1, l2, 2e-5, "lse"));
        // And the reference backend on the cache read back.
        chunked.backend = Backend::reference;
        a.mask = {};
        decode_attention(a, {y2.view4(), {}, l2.view<3>()}, chunked);
        EXPECT_TRUE(all_close(y1, y2, 2e-5, "reference out"));
      }
}

// The layer passes the rule through (forward and decode).
TEST(Chunk, MultiheadLayerForwardAndDecode) {
  std::mt19937_64 rng(4);
  MultiheadConfig cfg;
  cfg.embed_dim = 16, cfg.num_heads = 2;
  MultiheadAttention<float> m(cfg, 3);
  const int64_t B = 2, N = 29, C = 6;
  const auto x = random_tensor<float>({B, N, 16}, rng);
  MhaOptions chunked, masked;
  chunked.sdpa.causal = masked.sdpa.causal = true;
  chunked.sdpa.chunk_size = C;
  const Tensor<bool> mask = chunk_mask(N, N, 0, C);
  Tensor<float> y1({B, N, 16}), y2({B, N, 16});
  MhaArgs<float> a;
  a.query = x.view<3>();
  m.forward(a, {y1.view<3>()}, chunked);
  a.mask = mask.view4();
  m.forward(a, {y2.view<3>()}, masked);
  EXPECT_TRUE(all_close(y1, y2, 2e-5, "forward"));
  // Decoding token by token gives the forward's rows.
  KVCacheConfig kc;
  kc.batch = B, kc.kv_heads = 2, kc.capacity = N, kc.head_dim = 8;
  KVCache cache(kc);
  for (int64_t t = 0; t < N; ++t) {
    MhaArgs<float> d;
    d.query = View3<const float>(x.data() + t * 16, {B, 1, 16}, {N * 16, 16, 1});
    Tensor<float> y({B, 1, 16});
    m.decode(d, cache, y.view<3>(), chunked);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t e = 0; e < 16; ++e)
        EXPECT_NEAR(y[size_t(b * 16 + e)], y1[size_t((b * N + t) * 16 + e)], 2e-5) << "token " << t;
  }
}

// The fused forward visits only the tiles some query's chunk reaches: the
// visited scores stay within 1.3× the visible ones plus one tile per block.
TEST(Chunk, TilesVisitedFollowTheVisibleFraction) {
  const int64_t S = 16384, C = 2048;
  SdpaOptions o;
  o.causal = true;
  o.chunk_size = C;
  SdpaArgs<float> a;
  a.q = View4<const float>(nullptr, {1, 1, S, 64});
  a.k = View4<const float>(nullptr, {1, 1, S, 64});
  a.v = View4<const float>(nullptr, {1, 1, S, 64});
  const detail::Problem p = detail::make_problem(a, o);
  const detail::FusedPlan t = detail::fused_plan(p);
  const detail::rules::Band band = p.band(0);
  int64_t visited = 0, visible = 0;
  for (int64_t i0 = 0; i0 < S; i0 += t.q_block) {
    const int64_t nr = std::min(t.q_block, S - i0);
    const auto keys = band.keys_of_rows(i0, i0 + nr);
    for (int64_t j0 = keys.lo; j0 < keys.hi; j0 += t.k_block)
      if (band.classify(i0, nr, j0, std::min(t.k_block, keys.hi - j0)) != detail::rules::Tile::empty)
        visited += nr * std::min(t.k_block, keys.hi - j0);
    for (int64_t i = i0; i < i0 + nr; ++i) visible += band.keys(i).hi - band.keys(i).lo;
  }
  EXPECT_EQ(visible, (S / C) * C * (C + 1) / 2);  // causal within each chunk
  EXPECT_LE(double(visited), 1.3 * double(visible)) << "q_block " << t.q_block << " k_block " << t.k_block;
}

TEST(Chunk, BadChunkSizeIsAnArgumentError) {
  Tensor<float> q({1, 1, 2, 4}), y({1, 1, 2, 4});
  SdpaArgs<float> a;
  a.q = a.k = a.v = q.view4();
  SdpaOptions o;
  o.chunk_size = -1;
  EXPECT_TRUE(throws_with<InvalidArgument>([&] { scaled_dot_product_attention(a, {y.view4()}, o); },
                                           {"scaled_dot_product_attention", "'chunk_size' is -1"}));
}

}  // namespace
