// attn::dist under mpirun (ctest runs this binary with P = 1, 2, 3, 4 ranks).
//
// Every rank builds the same full inputs from a seed, computes the
// single-process fused result itself (the oracle), shards the inputs by the
// layout, runs the distributed call and compares its own shard of the
// outputs and gradients with the oracle's. Cases: causal and not, GQA, L ≠ S
// (sharded keys, causal of both alignments, position offsets), windows
// narrower and wider than a shard, ALiBi, soft-capping, sinks (and their
// gradient), blocks outside the band skipped, lengths not divisible by P or 2P (down to empty chunks),
// key padding that masks a rank's whole shard or a whole batch row, NaN
// inputs; the ring against a rank whose blocks are all −inf partials (the
// merge is exact there); bitwise repeatability; errors agreed on all ranks.
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <optional>
#include <limits>
#include <random>

#include "attn/dist.hpp"
#include "testing.hpp"

namespace {

using attn::Backend;
using attn::SdpaArgs;
using attn::SdpaGrads;
using attn::SdpaOptions;
using attn::Tensor;
using attn::View1;
using attn::View3;
using attn::View4;
using attn::dist::Layout;
using attn::testing::all_close;
using attn::testing::max_abs;
using attn::testing::random_tensor;
using attn::testing::tolerance;

int rank_() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int size_() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

enum class Strategy { ring, ulysses };
const char* name(Strategy s) { return s == Strategy::ring ? "ring" : "ulysses"; }

struct Case {
  int64_t B = 1, H = 2, Hkv = 2, L = 37, S = 37, E = 16, Ev = 16;
  bool causal = false;
  Layout layout = Layout::zigzag;
  std::vector<int64_t> key_lengths;  // global; empty = none
  bool nan_in_v = false;             // one NaN value element (global key row S / 2)
  bool nan_in_k = false;             // one NaN key element (global key row S / 2)
  // Variants (docs/variants.md), applied identically by the oracle.
  bool bottom_right = false;
  std::optional<int64_t> position_offset;
  attn::Window window;
  double softcap = 0;
  int64_t chunk = 0;   // chunk_size
  bool alibi = false;  // slopes 2^(-8(h+1)/H)
  bool sinks = false;  // per-head logits, one of them -inf (no sink)
  uint64_t seed = 1;
  std::vector<float> slopes() const {
    std::vector<float> s;
    for (int64_t h = 0; alibi && h < H; ++h) s.push_back(float(std::exp2(-8.0 * double(h + 1) / double(H))));
    return s;
  }
  std::vector<float> sink_values() const {
    std::vector<float> s;
    for (int64_t h = 0; sinks && h < H; ++h)
      s.push_back(h == 1 ? -std::numeric_limits<float>::infinity() : 0.5f * float(h) - 0.25f);
    return s;
  }
  SdpaOptions options() const {
    SdpaOptions o;
    o.causal = causal;
    o.causal_align = bottom_right ? attn::CausalAlign::bottom_right : attn::CausalAlign::top_left;
    o.position_offset = position_offset;
    o.window = window;
    o.softcap = softcap;
    o.chunk_size = chunk;
    o.backend = Backend::fused;
    return o;
  }
  std::string label() const {
    std::ostringstream os;
    os << "B" << B << " H" << H << " Hkv" << Hkv << " L" << L << " S" << S << " E" << E << " Ev" << Ev
       << (causal ? " causal" : "") << " " << attn::dist::layout_name(layout) << (key_lengths.empty() ? "" : " kl")
       << (nan_in_v ? " nan_v" : "") << (nan_in_k ? " nan_k" : "") << (bottom_right ? " bottom_right" : "")
       << (position_offset ? " offset" + std::to_string(*position_offset) : "") << " window(" << window.left << ","
       << window.right << ")" << (softcap > 0 ? " softcap" : "") << (chunk > 0 ? " chunk" + std::to_string(chunk) : "") << (alibi ? " alibi" : "") << (sinks ? " sinks" : "")
       << " P" << size_() << " rank" << rank_();
    return os.str();
  }
};

// The full problem and its single-process fused results (forward and backward).
struct Full {
  Tensor<float> q, k, v, dout, out, lse, dq, dk, dv;
  std::vector<float> slopes, sinks, dsinks;
};

// The variant arguments of a case (views of `slopes` and `sinks`).
void add_variants(SdpaArgs<float>& a, const std::vector<float>& slopes, const std::vector<float>& sinks) {
  if (!slopes.empty()) a.alibi_slopes = View1<const float>(slopes.data(), {int64_t(slopes.size())});
  if (!sinks.empty()) a.sinks = View1<const float>(sinks.data(), {int64_t(sinks.size())});
}

Full oracle(const Case& c) {
  std::mt19937_64 rng(c.seed);
  Full f;
  f.q = random_tensor<float>({c.B, c.H, c.L, c.E}, rng);
  f.k = random_tensor<float>({c.B, c.Hkv, c.S, c.E}, rng);
  f.v = random_tensor<float>({c.B, c.Hkv, c.S, c.Ev}, rng);
  f.dout = random_tensor<float>({c.B, c.H, c.L, c.Ev}, rng);
  if (c.nan_in_v) f.v[size_t((c.S / 2) * c.Ev)] = std::numeric_limits<float>::quiet_NaN();
  if (c.nan_in_k) f.k[size_t((c.S / 2) * c.E)] = std::numeric_limits<float>::quiet_NaN();
  f.out = Tensor<float>({c.B, c.H, c.L, c.Ev});
  f.lse = Tensor<float>({c.B, c.H, c.L});
  f.dq = Tensor<float>({c.B, c.H, c.L, c.E});
  f.dk = Tensor<float>({c.B, c.Hkv, c.S, c.E});
  f.dv = Tensor<float>({c.B, c.Hkv, c.S, c.Ev});
  SdpaArgs<float> a;
  a.q = f.q.view4();
  a.k = f.k.view4();
  a.v = f.v.view4();
  if (!c.key_lengths.empty()) a.key_lengths = View1<const int64_t>(c.key_lengths.data(), {c.B});
  f.slopes = c.slopes(), f.sinks = c.sink_values();
  add_variants(a, f.slopes, f.sinks);
  const SdpaOptions o = c.options();
  View3<float> lse(f.lse.data(), {c.B, c.H, c.L});
  attn::scaled_dot_product_attention(a, {f.out.view4(), {}, lse}, o);
  SdpaGrads<float> g{f.dq.view4(), f.dk.view4(), f.dv.view4(), {}};
  if (c.sinks) f.dsinks.resize(size_t(c.H)), g.dsinks = View1<float>(f.dsinks.data(), {c.H});
  attn::scaled_dot_product_attention_backward(a, View4<const float>(f.dout.view4()),
                                              {View4<const float>(f.out.view4()), View3<const float>(lse)}, g, o);
  return f;
}

Tensor<float> shard_of(const Tensor<float>& full, Layout layout) {
  const int P = size_(), r = rank_();
  if (full.rank() == 3) {
    Tensor<float> t({full.dim(0), full.dim(1), attn::dist::shard_length(full.dim(2), P, r, layout)});
    attn::dist::shard(full.view<3>(), t.view<3>(), P, r, layout);
    return t;
  }
  Tensor<float> t({full.dim(0), full.dim(1), attn::dist::shard_length(full.dim(2), P, r, layout), full.dim(3)});
  attn::dist::shard(full.view4(), t.view4(), P, r, layout);
  return t;
}

// The local shards and the distributed results.
struct Local {
  Tensor<float> q, k, v, dout, out, lse, dq, dk, dv;
  std::vector<int64_t> key_lengths;
  std::vector<float> slopes, sinks, dsinks;
  attn::dist::RingStats fwd_stats, bwd_stats;
  SdpaArgs<float> args() const {
    SdpaArgs<float> a;
    a.q = q.view4();
    a.k = k.view4();
    a.v = v.view4();
    if (!key_lengths.empty()) a.key_lengths = View1<const int64_t>(key_lengths.data(), {int64_t(key_lengths.size())});
    add_variants(a, slopes, sinks);
    return a;
  }
};

View3<float> v3(Tensor<float>& t) { return t.view<3>(); }

// This rank's shards of q, k, v and dout, and an output for its rows.
Local shards(const Case& c, const Full& f) {
  Local l;
  l.q = shard_of(f.q, c.layout), l.k = shard_of(f.k, c.layout), l.v = shard_of(f.v, c.layout);
  l.dout = shard_of(f.dout, c.layout);
  l.out = Tensor<float>({c.B, c.H, l.q.dim(2), c.Ev});
  return l;
}

Local run(const Case& c, const Full& f, Strategy s, bool saved_state = true) {
  Local l = shards(c, f);
  l.key_lengths = c.key_lengths;
  l.slopes = f.slopes, l.sinks = f.sinks;
  l.lse = Tensor<float>({c.B, c.H, l.q.dim(2)});
  l.dq = Tensor<float>(l.q.shape());
  l.dk = Tensor<float>(l.k.shape());
  l.dv = Tensor<float>(l.v.shape());
  attn::dist::DistOptions o;
  o.sdpa = c.options();
  o.sdpa.backend = Backend::automatic;
  o.layout = c.layout;
  const SdpaArgs<float> a = l.args();
  SdpaGrads<float> g{l.dq.view4(), l.dk.view4(), l.dv.view4(), {}};
  if (c.sinks) l.dsinks.assign(size_t(c.H), std::numeric_limits<float>::quiet_NaN()), g.dsinks = View1<float>(l.dsinks.data(), {c.H});
  attn::SdpaSaved<float> saved;
  if (saved_state) saved = {View4<const float>(l.out.view4()), View3<const float>(v3(l.lse))};
  const attn::SdpaOutputs<float> outputs{l.out.view4(), {}, v3(l.lse)};
  if (s == Strategy::ring) {
    attn::dist::ring_attention(MPI_COMM_WORLD, a, outputs, o, &l.fwd_stats);
    attn::dist::ring_attention_backward(MPI_COMM_WORLD, a, View4<const float>(l.dout.view4()), saved, g, o,
                                        &l.bwd_stats);
  } else {
    attn::dist::ulysses_attention(MPI_COMM_WORLD, a, outputs, o);
    attn::dist::ulysses_attention_backward(MPI_COMM_WORLD, a, View4<const float>(l.dout.view4()), saved, g, o);
  }
  return l;
}

void expect_matches(const Case& c, const Full& f, const Local& l, const std::string& what) {
  const std::string tag = what + " [" + c.label() + "]";
  const double t_out = tolerance<float>(c.S, 1.0, 40.0);
  EXPECT_TRUE(all_close(l.out.view4(), shard_of(f.out, c.layout).view4(), t_out, "out " + tag));
  EXPECT_TRUE(all_close(l.lse.view<3>(), shard_of(f.lse, c.layout).view<3>(), t_out, "lse " + tag));
  auto grad = [&](const Tensor<float>& got, const Tensor<float>& want, const char* n) {
    const double m = max_abs(want.view4());
    EXPECT_TRUE(all_close(got.view4(), shard_of(want, c.layout).view4(),
                          tolerance<float>(std::max(c.L, c.S), std::isfinite(m) ? m : 1.0, 60.0),
                          std::string(n) + " " + tag));
  };
  grad(l.dq, f.dq, "dq");
  grad(l.dk, f.dk, "dk");
  grad(l.dv, f.dv, "dv");
  if (c.sinks) {  // the whole (H) gradient on every rank
    Tensor<float> want({1, 1, 1, c.H}), got({1, 1, 1, c.H});
    std::copy(f.dsinks.begin(), f.dsinks.end(), want.data());
    std::copy(l.dsinks.begin(), l.dsinks.end(), got.data());
    const double m = max_abs(want.view4());
    EXPECT_TRUE(all_close(got.view4(), want.view4(), tolerance<float>(c.B * c.L, std::max(m, 1.0), 60.0), "dsinks " + tag));
  }
}

void check(const Case& c, Strategy s) {
  const Full f = oracle(c);
  const Local l = run(c, f, s);
  expect_matches(c, f, l, name(s));
}

bool ulysses_runs(const Case& c) { return c.H % size_() == 0 && c.Hkv % size_() == 0; }

// --- the cases ----------------------------------------------------------------

TEST(Dist, NonCausal) {
  for (Layout lay : {Layout::zigzag, Layout::contiguous}) {
    Case c;
    c.layout = lay;
    check(c, Strategy::ring);
  }
}

TEST(Dist, CausalZigzagAndContiguous) {
  for (Layout lay : {Layout::zigzag, Layout::contiguous}) {
    Case c;
    c.causal = true;
    c.layout = lay;
    c.L = c.S = 53;
    check(c, Strategy::ring);
  }
}

TEST(Dist, GroupedQueryHeadsAndUnequalFeatureSizes) {
  Case c;
  c.H = 6, c.Hkv = 2, c.E = 8, c.Ev = 12, c.causal = true, c.L = c.S = 41;
  check(c, Strategy::ring);
  c.causal = false, c.Hkv = 1;
  check(c, Strategy::ring);
}

TEST(Dist, CrossAttentionWithShardedKeys) {
  Case c;
  c.L = 19, c.S = 45, c.H = 4, c.Hkv = 2;
  check(c, Strategy::ring);
  c.layout = Layout::contiguous;
  check(c, Strategy::ring);
}

TEST(Dist, LengthsShorterThanTheChunks) {
  // 5 rows in 2P chunks: with P >= 3 some chunks, and some ranks' shards, are empty.
  Case c;
  c.L = c.S = 5, c.causal = true;
  check(c, Strategy::ring);
  c.causal = false, c.L = 3, c.S = 7;
  check(c, Strategy::ring);
}

TEST(Dist, KeyPaddingMasksWholeShardsAndRows) {
  // Batch 1 sees only its first 3 keys (all in rank 0's first chunk, so every
  // other rank's shard is fully masked there); batch 2 sees no key at all.
  Case c;
  c.B = 3, c.L = c.S = 43, c.key_lengths = {43, 3, 0};
  check(c, Strategy::ring);
  c.causal = true;
  check(c, Strategy::ring);
  c.key_lengths = {30, 3, 0};
  c.layout = Layout::contiguous;
  check(c, Strategy::ring);
  // Fully masked rows: output 0, lse −inf, zero gradients.
  const Full f = oracle(c);
  const Local l = run(c, f, Strategy::ring);
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t i = 0; i < l.q.dim(2); ++i) {
      EXPECT_EQ(l.lse[size_t((2 * c.H + h) * l.q.dim(2) + i)], -std::numeric_limits<float>::infinity());
      for (int64_t e = 0; e < c.Ev; ++e) EXPECT_EQ(l.out[size_t(((2 * c.H + h) * l.q.dim(2) + i) * c.Ev + e)], 0.0f);
    }
  for (size_t i = 0; i < size_t(c.H * l.q.dim(2) * c.E); ++i)
    EXPECT_EQ(l.dq[size_t(2 * c.H * l.q.dim(2) * c.E) + i], 0.0f);
}

TEST(Dist, MergeIsExactForEmptyPartials) {
  // Non-causal, batch 0 sees only keys of rank 0's first chunk: on every rank
  // the ring's result is then exactly one fused call on rank 0's shard (all
  // other blocks are −inf partials, which the merge must leave bit for bit).
  const int P = size_();
  Case c;
  c.L = c.S = 40;
  const int64_t first = attn::dist::chunk_layout(c.S, P, 0, Layout::zigzag)[0].length;
  c.key_lengths = {first - 1};
  const Full f = oracle(c);
  const Local l = run(c, f, Strategy::ring);
  // The block rank 0's shard gives these queries, computed here directly.
  Tensor<float> k0({c.B, c.Hkv, attn::dist::shard_length(c.S, P, 0, Layout::zigzag), c.E}), v0;
  v0 = Tensor<float>({c.B, c.Hkv, k0.dim(2), c.Ev});
  attn::dist::shard(f.k.view4(), k0.view4(), P, 0, Layout::zigzag);
  attn::dist::shard(f.v.view4(), v0.view4(), P, 0, Layout::zigzag);
  std::vector<int64_t> kl = {first - 1};
  SdpaArgs<float> a;
  a.q = l.q.view4();
  a.k = k0.view4();
  a.v = v0.view4();
  a.key_lengths = View1<const int64_t>(kl.data(), {1});
  SdpaOptions o;
  o.backend = Backend::fused;
  Tensor<float> out({c.B, c.H, l.q.dim(2), c.Ev}), lse({c.B, c.H, l.q.dim(2)});
  attn::scaled_dot_product_attention(a, {out.view4(), {}, lse.view<3>()}, o);
  EXPECT_EQ(std::memcmp(out.data(), l.out.data(), out.size() * sizeof(float)), 0) << c.label();
  EXPECT_EQ(std::memcmp(lse.data(), l.lse.data(), lse.size() * sizeof(float)), 0) << c.label();
}

// One NaN in V (key row j = S / 2, kv head 0, feature 0): every query row
// of that group that sees key j gets NaN in out[..., 0] and in its dq. (Rows
// that do not see it may get NaN too: the fused kernel multiplies the masked
// zeros of a tile by the NaN, so that is not a property of the ring either.)
void check_nan(Case c, Strategy s) {
  c.nan_in_v = true;
  const Full f = oracle(c);
  const Local l = run(c, f, s);
  const int64_t j = c.S / 2, Lr = l.q.dim(2);
  int64_t li = 0;
  for (const auto& ch : attn::dist::chunk_layout(c.L, size_(), rank_(), c.layout))
    for (int64_t gi = ch.begin; gi < ch.begin + ch.length; ++gi, ++li)
      for (int64_t h = 0; h < c.H / c.Hkv; ++h) {
        const size_t row = size_t(h * Lr + li);
        if (!c.causal || gi >= j) {
          EXPECT_TRUE(std::isnan(l.out[row * size_t(c.Ev)])) << "out row " << gi << " " << name(s) << " " << c.label();
          bool dq_nan = false;
          for (int64_t e = 0; e < c.E; ++e) dq_nan = dq_nan || std::isnan(l.dq[row * size_t(c.E) + size_t(e)]);
          EXPECT_TRUE(dq_nan) << "dq row " << gi << " " << name(s) << " " << c.label();
        }
      }
}

TEST(Dist, NanReachesTheOutputsItTouches) {
  // A NaN key poisons exactly the rows that see it, forward and backward, as
  // in the single-process kernel (all_close requires NaN exactly where the
  // oracle has it): its score is NaN, so the block's lse is, and the merge
  // and the backward's exp(S - lse) carry it.
  for (bool causal : {false, true}) {
    Case k;
    k.nan_in_k = true, k.causal = causal;
    check(k, Strategy::ring);
    k.H = k.Hkv = 12;
    if (ulysses_runs(k)) check(k, Strategy::ulysses);
  }
  Case c;
  check_nan(c, Strategy::ring);
  c.causal = true;
  check_nan(c, Strategy::ring);
  c.H = c.Hkv = 12;
  if (ulysses_runs(c)) check_nan(c, Strategy::ulysses);
}

TEST(Dist, BackwardRecomputesTheForwardWhenNotGiven) {
  Case c;
  c.causal = true, c.H = 4, c.Hkv = 4;
  const Full f = oracle(c);
  const Local with = run(c, f, Strategy::ring, true), without = run(c, f, Strategy::ring, false);
  EXPECT_EQ(std::memcmp(with.dq.data(), without.dq.data(), with.dq.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(with.dk.data(), without.dk.data(), with.dk.size() * sizeof(float)), 0);
  if (ulysses_runs(c)) expect_matches(c, f, run(c, f, Strategy::ulysses, false), "ulysses recompute");
}

TEST(Dist, BitwiseRepeatable) {
  for (Strategy s : {Strategy::ring, Strategy::ulysses}) {
    Case c;
    c.causal = true, c.H = 12, c.Hkv = 12, c.L = c.S = 97, c.B = 2, c.key_lengths = {97, 50};
    if (s == Strategy::ulysses && !ulysses_runs(c)) continue;
    const Full f = oracle(c);
    const Local a = run(c, f, s), b = run(c, f, s);
    for (auto [x, y] : {std::pair{&a.out, &b.out}, {&a.lse, &b.lse}, {&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}})
      EXPECT_EQ(std::memcmp(x->data(), y->data(), x->size() * sizeof(float)), 0) << name(s) << " " << c.label();
  }
}

TEST(Dist, Ulysses) {
  // 12 heads divide by P = 1, 2, 3, 4.
  Case c;
  c.H = 12, c.Hkv = 12, c.L = c.S = 37;
  check(c, Strategy::ulysses);
  c.causal = true;
  check(c, Strategy::ulysses);
  c.H = 24, c.key_lengths = {20};  // GQA, key padding
  check(c, Strategy::ulysses);
  c.causal = false, c.L = 19, c.S = 45, c.layout = Layout::contiguous;  // cross-attention
  check(c, Strategy::ulysses);
  c.L = c.S = 5, c.causal = true, c.key_lengths.clear();  // empty shards
  check(c, Strategy::ulysses);
}

// --- variants: windows, ALiBi, soft-cap, sinks, position offsets ----------------

// The ring on the case, then Ulysses on the same case with heads that divide
// by P = 1..4 (12 or 24 query heads, 12 K/V heads).
void check_both(Case c) {
  check(c, Strategy::ring);
  c.H = c.Hkv < c.H ? 24 : 12, c.Hkv = 12;
  if (ulysses_runs(c)) check(c, Strategy::ulysses);
}

TEST(DistVariants, WindowsNarrowerAndWiderThanAShard) {
  // 61 rows: not divisible by P or 2P for P = 2, 3, 4; shards of 8 to 31 rows.
  for (Layout lay : {Layout::zigzag, Layout::contiguous}) {
    Case c;
    c.L = c.S = 61, c.H = 4, c.Hkv = 2, c.layout = lay;
    c.causal = true, c.window = {3, -1};  // narrower than a chunk
    check_both(c);
    c.causal = false, c.window = {2, 3};  // both sides bounded
    check_both(c);
    c.causal = true, c.window = {40, -1};  // wider than a shard
    check_both(c);
    c.causal = false, c.window = {-1, 20};  // right side only
    check_both(c);
  }
}

TEST(DistVariants, AlibiSoftcapAndSinks) {
  Case c;
  c.L = c.S = 53, c.H = 4, c.Hkv = 2;
  c.alibi = true;
  check_both(c);
  c.causal = true;
  check_both(c);
  c.alibi = false, c.softcap = 2.5, c.window = {9, 4};
  check_both(c);
  c.sinks = true;  // forward, backward and dsinks
  check_both(c);
  c.alibi = true, c.softcap = 0, c.window = {-1, -1}, c.B = 2, c.key_lengths = {53, 17};
  check_both(c);
  c.causal = false, c.window = {12, 12}, c.softcap = 4;
  check_both(c);
}

// Chunked attention: chunk boundaries are global positions, so they fall
// anywhere in a rank's shard (chunks of 5 and 7 rows cut the 8-31 row shard
// chunks; 64 spans several shards).
TEST(DistVariants, ChunksCutTheShardsAnywhere) {
  for (Layout lay : {Layout::zigzag, Layout::contiguous}) {
    Case c;
    c.L = c.S = 61, c.H = 4, c.Hkv = 2, c.layout = lay;
    c.causal = true, c.chunk = 5;
    check_both(c);
    c.causal = false, c.chunk = 7;
    check_both(c);
    c.causal = true, c.chunk = 64, c.window = {9, -1};
    check_both(c);
    c.chunk = 6, c.window = {-1, -1}, c.alibi = true, c.sinks = true;
    check_both(c);
    c.L = 29, c.S = 41, c.alibi = false, c.sinks = false, c.bottom_right = true, c.chunk = 8;
    check_both(c);
    c.bottom_right = false, c.position_offset = 7, c.chunk = 10;
    check_both(c);
  }
}

TEST(DistVariants, CausalCrossAttentionAndPositionOffsets) {
  Case c;
  c.L = 23, c.S = 47, c.H = 4, c.Hkv = 2, c.causal = true;  // top-left: query i sees keys 0..i
  check_both(c);
  c.bottom_right = true;  // query i sees keys 0..i + S − L
  check_both(c);
  c.L = 47, c.S = 23;  // more queries than keys: the first rows see nothing
  check_both(c);
  c.L = 29, c.S = 41, c.bottom_right = false, c.position_offset = -10, c.alibi = true;  // rows 0..9 see no key
  check_both(c);
  c.position_offset = 30, c.causal = false, c.window = {6, 2}, c.alibi = false, c.sinks = true;
  check_both(c);
  // Rows that see no key: out 0, zero dq, lse = the sink (−inf without one).
  c.position_offset = -10, c.causal = true, c.window = {-1, -1};
  const Full f = oracle(c);
  const Local l = run(c, f, Strategy::ring);
  const std::vector<float> sinks = c.sink_values();
  int64_t li = 0;
  for (const auto& ch : attn::dist::chunk_layout(c.L, size_(), rank_(), c.layout))
    for (int64_t gi = ch.begin; gi < ch.begin + ch.length; ++gi, ++li)
      for (int64_t h = 0; gi < 10 && h < c.H; ++h) {
        const size_t row = size_t(h * l.q.dim(2) + li);
        EXPECT_EQ(l.lse[row], sinks[size_t(h)]) << "row " << gi << " head " << h << " " << c.label();
        for (int64_t e = 0; e < c.Ev; ++e) EXPECT_EQ(l.out[row * size_t(c.Ev) + size_t(e)], 0.0f);
        for (int64_t e = 0; e < c.E; ++e) EXPECT_EQ(l.dq[row * size_t(c.E) + size_t(e)], 0.0f);
      }
}

TEST(DistVariants, BlocksOutsideTheBandAreSkipped) {
  // A causal window of 3 keys on chunks of >= 8 rows: a query chunk sees its
  // own chunk and at most the one before. The ring's block calls (summed over
  // ranks, forward) are at most the (query chunk, key chunk) pairs with a
  // visible score, counted here by brute force; without the window every
  // earlier chunk is visible.
  const int P = size_();
  for (Layout lay : {Layout::zigzag, Layout::contiguous}) {
    Case c;
    c.L = c.S = 64 * P, c.causal = true, c.layout = lay, c.window = {3, -1};
    const Full f = oracle(c);
    const Local l = run(c, f, Strategy::ring);
    expect_matches(c, f, l, "ring");
    int64_t blocks = l.fwd_stats.blocks;
    MPI_Allreduce(MPI_IN_PLACE, &blocks, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    int64_t visible = 0, causal_pairs = 0;
    for (int p = 0; p < P; ++p)
      for (const auto& qc : attn::dist::chunk_layout(c.L, P, p, lay))
        for (int o = 0; o < P; ++o)
          for (const auto& kc : attn::dist::chunk_layout(c.S, P, o, lay)) {
            bool any = false, any_causal = false;
            for (int64_t i = qc.begin; i < qc.begin + qc.length; ++i)
              for (int64_t j = kc.begin; j < kc.begin + kc.length; ++j) {
                any_causal = any_causal || j <= i;
                any = any || (j <= i && j >= i - 3);
              }
            visible += any, causal_pairs += any_causal;
          }
    EXPECT_LE(blocks, visible) << c.label();
    EXPECT_GT(blocks, 0) << c.label();
    if (2 * attn::dist::chunk_layout(c.L, P, 0, lay).size() * size_t(P) > 4) {  // more than 2 chunks in all
      EXPECT_LT(visible, causal_pairs) << c.label();
    }
    EXPECT_EQ(l.bwd_stats.blocks, l.fwd_stats.blocks) << c.label();
  }
}

// --- errors: every rank throws, none waits ------------------------------------

TEST(DistErrors, AgreedOnEveryRank) {
  const int P = size_(), r = rank_();
  Case c;
  const Full f = oracle(c);
  Local l = shards(c, f);
  attn::dist::DistOptions o;
  // A bad argument on the last rank only.
  SdpaArgs<float> a = l.args();
  std::unique_ptr<bool[]> m(new bool[1]{true});
  if (r == P - 1) a.mask = View4<const bool>(m.get(), {1, 1, 1, 1});
  EXPECT_TRUE(attn::testing::throws_with([&] { attn::dist::ring_attention(MPI_COMM_WORLD, a, {l.out.view4()}, o); },
                                         {"attn::dist::ring_attention"}));
  // Options that differ between ranks.
  attn::dist::DistOptions o2;
  o2.sdpa.causal = r == 0;
  if (P > 1) {
    EXPECT_TRUE(attn::testing::throws_with(
        [&] { attn::dist::ring_attention(MPI_COMM_WORLD, l.args(), {l.out.view4()}, o2); }, {"disagree", "causal"}));
  }
  // A shard that does not match the layout: rank 0 holds d query rows too
  // few, with d chosen so that the shorter sequence's layout disagrees.
  int64_t d = 1;
  while (P > 1 && attn::dist::shard_length(c.L - d, P, 0, c.layout) == attn::dist::shard_length(c.L, P, 0, c.layout) - d) ++d;
  if (P > 1) {
    SdpaArgs<float> short_q = l.args();
    View4<float> short_out = l.out.view4();
    if (r == 0) short_q.q.shape[2] -= d, short_out.shape[2] -= d;
    EXPECT_TRUE(attn::testing::throws_with(
        [&] { attn::dist::ring_attention(MPI_COMM_WORLD, short_q, {short_out}, o); }, {"layout"}));
  }
  // Causal ring cross-attention, ulysses with heads not divisible by P, reference backend.
  Case x;
  x.L = 19, x.S = 45;
  const Full fx = oracle(x);
  Local lx;
  lx.q = shard_of(fx.q, x.layout), lx.k = shard_of(fx.k, x.layout), lx.v = shard_of(fx.v, x.layout);
  lx.out = Tensor<float>({x.B, x.H, lx.q.dim(2), x.Ev});
  // Variant options that differ between ranks, and bad variant values.
  attn::dist::DistOptions ow;
  ow.sdpa.window = {r == 0 ? 3 : 4, -1};
  if (P > 1) {
    EXPECT_TRUE(attn::testing::throws_with(
        [&] { attn::dist::ring_attention(MPI_COMM_WORLD, lx.args(), {lx.out.view4()}, ow); }, {"disagree", "window.left"}));
  }
  std::vector<float> slopes(size_t(x.H), 0.5f), sinks(size_t(x.H), 0.0f);
  if (P > 1 && r == P - 1) slopes[0] = 0.25f;
  SdpaArgs<float> ax = lx.args();
  ax.alibi_slopes = View1<const float>(slopes.data(), {x.H});
  if (P > 1) {
    EXPECT_TRUE(attn::testing::throws_with(
        [&] { attn::dist::ring_attention(MPI_COMM_WORLD, ax, {lx.out.view4()}, {}); }, {"disagree", "alibi_slopes"}));
  }
  sinks[1] = std::numeric_limits<float>::quiet_NaN();
  SdpaArgs<float> as = lx.args();
  as.sinks = View1<const float>(sinks.data(), {x.H});
  EXPECT_TRUE(attn::testing::throws_with(
      [&] { attn::dist::ulysses_attention(MPI_COMM_WORLD, as, {lx.out.view4()}, {}); }, {"'sinks' contains NaN", "at (1,)"}));
  attn::dist::DistOptions ooff;
  ooff.sdpa.position_offset = (int64_t(1) << 52) - 10;  // a block's offset would leave the kernel's range
  EXPECT_TRUE(attn::testing::throws_with(
      [&] { attn::dist::ring_attention(MPI_COMM_WORLD, lx.args(), {lx.out.view4()}, ooff); }, {"position_offset", "2^52"}));
  attn::dist::DistOptions obad;
  obad.sdpa.window = {-2, -1};
  EXPECT_TRUE(attn::testing::throws_with(
      [&] { attn::dist::ring_attention(MPI_COMM_WORLD, lx.args(), {lx.out.view4()}, obad); }, {"window.left", "-2"}));
  if (x.H % P != 0) {
    EXPECT_TRUE(attn::testing::throws_with(
        [&] { attn::dist::ulysses_attention(MPI_COMM_WORLD, lx.args(), {lx.out.view4()}, {}); }, {"divisible"}));
  }
  attn::dist::DistOptions orf;
  orf.sdpa.backend = Backend::reference;
  EXPECT_TRUE(attn::testing::throws_with(
      [&] { attn::dist::ring_attention(MPI_COMM_WORLD, lx.args(), {lx.out.view4()}, orf); }, {"backend"}));
  // Still in step after all of that.
  int ok = 1;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  EXPECT_EQ(ok, 1);
}

// Ranks that make different calls, or ask for different outputs, fail on
// every rank naming the difference, before any message whose size depends
// on it (ctest runs these with a short timeout: a hang is a failure).
TEST(DistAgreement, DifferentCallsAndOutputsFailEverywhere) {
  const int P = size_(), r = rank_();
  if (P < 2) GTEST_SKIP() << "needs two ranks";
  Case c;
  c.H = 12, c.Hkv = 12;  // ulysses on 2, 3 or 4 ranks
  const Full f = oracle(c);
  Local l = shards(c, f);
  l.lse = Tensor<float>({c.B, c.H, l.q.dim(2)});
  l.dq = Tensor<float>(l.q.shape()), l.dk = Tensor<float>(l.k.shape()), l.dv = Tensor<float>(l.v.shape());
  const attn::dist::DistOptions o;
  const View3<float> lse(l.lse.data(), {c.B, c.H, l.q.dim(2)});
  const SdpaGrads<float> g{l.dq.view4(), l.dk.view4(), l.dv.view4(), {}};
  const View4<const float> dout = l.dout.view4();
  auto forward = [&](bool ring, bool with_lse) {
    const attn::SdpaOutputs<float> out{l.out.view4(), {}, with_lse ? lse : View3<float>{}};
    if (ring) attn::dist::ring_attention(MPI_COMM_WORLD, l.args(), out, o);
    else attn::dist::ulysses_attention(MPI_COMM_WORLD, l.args(), out, o);
  };
  auto backward = [&](bool ring) {
    if (ring) attn::dist::ring_attention_backward(MPI_COMM_WORLD, l.args(), dout, {}, g, o);
    else attn::dist::ulysses_attention_backward(MPI_COMM_WORLD, l.args(), dout, {}, g, o);
  };
  const std::string other = r == 0 ? "rank 1" : "rank " + std::to_string(r);
  // ring on rank 0, ulysses elsewhere
  EXPECT_TRUE(attn::testing::throws_with<attn::InvalidArgument>(
      [&] { forward(r == 0, true); },
      {"ranks disagree on the call", "attn::dist::ulysses_attention, rank 0 attn::dist::ring_attention"}));
  // the forward on rank 0, the backward elsewhere
  EXPECT_TRUE(attn::testing::throws_with<attn::InvalidArgument>(
      [&] { r == 0 ? forward(true, true) : backward(true); },
      {"ranks disagree on the call", "attn::dist::ring_attention_backward, rank 0 attn::dist::ring_attention"}));
  // lse asked for on rank 0 only, for both strategies
  for (bool ring : {true, false})
    EXPECT_TRUE(attn::testing::throws_with<attn::InvalidArgument>(
        [&] { forward(ring, r == 0); }, {"ranks disagree on whether an lse output was given", "rank 0 1"}));
  // the forward's saved state given on the last rank only
  const attn::SdpaSaved<float> saved{View4<const float>(l.out.view4()), View3<const float>(lse)};
  for (bool ring : {true, false})
    EXPECT_TRUE(attn::testing::throws_with<attn::InvalidArgument>(
        [&] {
          const attn::SdpaSaved<float> s = r == P - 1 ? saved : attn::SdpaSaved<float>{};
          if (ring) attn::dist::ring_attention_backward(MPI_COMM_WORLD, l.args(), dout, s, g, o);
          else attn::dist::ulysses_attention_backward(MPI_COMM_WORLD, l.args(), dout, s, g, o);
        },
        {"ranks disagree on whether the saved out and lse were given"}));
  // Agreed again, every call still works and matches the oracle.
  forward(true, true);
  EXPECT_TRUE(all_close(l.out, shard_of(f.out, c.layout), 1e-5));
  forward(false, true);
  EXPECT_TRUE(all_close(l.out, shard_of(f.out, c.layout), 1e-5));
}

// A rank that stops calling: the others give up after the bounded wait and
// abort the job with a message (ctest checks the message and that it ends
// well within its timeout; the normal runs leave this test out).
TEST(DistWatchdog, AStuckRankAbortsTheJobWithAMessage) {
  const int P = size_(), r = rank_();
  if (P < 2) GTEST_SKIP() << "needs two ranks";
  if (r != 0) {
    std::this_thread::sleep_for(std::chrono::seconds(60));  // stuck elsewhere; the abort ends it
    return;
  }
  Case c;
  const Full f = oracle(c);
  Local l = shards(c, f);
  attn::dist::DistOptions o;
  o.timeout_s = 1.0;
  attn::dist::ring_attention(MPI_COMM_WORLD, l.args(), {l.out.view4()}, o);
  ADD_FAILURE() << "ring_attention returned without the other ranks";
}

// A front end's own verdict (first_failed_rank), and a bad bound.
TEST(DistAgreement, FrontEndVerdictsAndTheBound) {
  const int P = size_(), r = rank_();
  EXPECT_EQ(attn::dist::first_failed_rank(MPI_COMM_WORLD, false), -1);
  EXPECT_EQ(attn::dist::first_failed_rank(MPI_COMM_WORLD, r == P - 1), P - 1);
  EXPECT_EQ(attn::dist::first_failed_rank(MPI_COMM_WORLD, r >= P / 2), P / 2);
  attn::dist::DistOptions bad;
  bad.timeout_s = r == 0 ? -1.0 : 5.0;
  Case c;
  const Full f = oracle(c);
  Local l = shards(c, f);
  EXPECT_TRUE(attn::testing::throws_with<attn::InvalidArgument>(
      [&] { attn::dist::ring_attention(MPI_COMM_WORLD, l.args(), {l.out.view4()}, bad); },
      {r == 0 ? "option 'timeout_s' is -1" : "rank 0 rejected its arguments"}));
  attn::dist::DistOptions fine;
  fine.timeout_s = r == 0 ? 30.0 : std::numeric_limits<double>::infinity();  // need not agree
  attn::dist::ring_attention(MPI_COMM_WORLD, l.args(), {l.out.view4()}, fine);
  EXPECT_TRUE(all_close(l.out, shard_of(f.out, c.layout), 1e-5));
}

TEST(DistShard, RoundTripAndLayouts) {
  const int P = size_(), r = rank_();
  for (Layout lay : {Layout::contiguous, Layout::zigzag}) {
    for (int64_t n : {1, 5, 37, 64}) {
      // The chunks of all ranks tile [0, n) exactly once.
      std::vector<int> seen(size_t(n), 0);
      for (int p = 0; p < P; ++p)
        for (const auto& ch : attn::dist::chunk_layout(n, P, p, lay))
          for (int64_t i = ch.begin; i < ch.begin + ch.length; ++i) ++seen[size_t(i)];
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(seen[size_t(i)], 1) << "row " << i << " n " << n;
      std::mt19937_64 rng{uint64_t(n)};
      const Tensor<float> full = random_tensor<float>({2, 3, n, 4}, rng);
      Tensor<float> local({2, 3, attn::dist::shard_length(n, P, r, lay), 4}), back({2, 3, n, 4});
      attn::dist::shard(full.view4(), local.view4(), P, r, lay);
      attn::dist::unshard(local.view4(), back.view4(), P, r, lay);
      int64_t li = 0;
      for (const auto& ch : attn::dist::chunk_layout(n, P, r, lay))
        for (int64_t i = 0; i < ch.length; ++i, ++li)
          EXPECT_EQ(local[size_t((1 * 3 + 2) * local.dim(2) * 4 + li * 4 + 3)],
                    full[size_t((1 * 3 + 2) * n * 4 + (ch.begin + i) * 4 + 3)]);
      for (const auto& ch : attn::dist::chunk_layout(n, P, r, lay))
        for (int64_t i = ch.begin; i < ch.begin + ch.length; ++i)
          EXPECT_EQ(back[size_t(i * 4)], full[size_t(i * 4)]);
    }
  }
  Tensor<float> full({1, 1, 8, 2}), wrong({1, 1, 3, 2});
  if (attn::dist::shard_length(8, P, r, Layout::zigzag) != 3) {
    EXPECT_TRUE(attn::testing::throws_with(
        [&] { attn::dist::shard(full.view4(), wrong.view4(), P, r, Layout::zigzag); }, {"shard", "expected"}));
  }
}

// Prints failures of ranks other than 0 (their default printer is removed).
class RankFailures : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_(), r.file_name() ? r.file_name() : "?", r.line_number(),
                   r.summary());
  }
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  if (rank_() != 0) {
    auto& ls = ::testing::UnitTest::GetInstance()->listeners();
    delete ls.Release(ls.default_result_printer());
    ls.Append(new RankFailures);
  }
  int rc = RUN_ALL_TESTS();
  MPI_Allreduce(MPI_IN_PLACE, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank_() == 0) std::printf("attn::dist tests on %d rank(s): %s\n", size_(), rc == 0 ? "all passed" : "FAILED");
  MPI_Finalize();
  return rc;
}
