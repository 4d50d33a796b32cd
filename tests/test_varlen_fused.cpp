// The fused backend's packed varlen path (all sequences' units in one
// parallel region) against its oracle, varlen's reference backend (a loop of
// dense reference calls, itself checked against copied dense sequences in
// test_variants.cpp), on random awkward packings and option combinations,
// forward and backward; bitwise identical results for any thread count, for
// both backward plans; NaN confined to the sequence and rows it reaches.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "kernels/fused/fused.hpp"
#include "testing.hpp"
#include "varlen_internal.hpp"

namespace {

using attn::Backend;
using attn::CausalAlign;
using attn::Tensor;
using attn::testing::max_abs;
using attn::testing::tolerance;

// A packed batch with random values and the sinks/ALiBi arrays.
struct Batch {
  std::vector<int64_t> cu_q{0}, cu_k{0};
  int64_t H, Hkv, E, Ev, longest_q = 0, longest_k = 0;
  Tensor<float> q, k, v, dout, slopes, sinks;
  Batch(const std::vector<int64_t>& lq, const std::vector<int64_t>& lk, int64_t h, int64_t hkv, int64_t e, int64_t ev,
        std::mt19937_64& rng)
      : H(h), Hkv(hkv), E(e), Ev(ev) {
    for (size_t b = 0; b < lq.size(); ++b) {
      cu_q.push_back(cu_q.back() + lq[b]), cu_k.push_back(cu_k.back() + lk[b]);
      longest_q = std::max(longest_q, lq[b]), longest_k = std::max(longest_k, lk[b]);
    }
    q = attn::testing::random_tensor<float>({cu_q.back(), H, E}, rng);
    k = attn::testing::random_tensor<float>({cu_k.back(), Hkv, E}, rng);
    v = attn::testing::random_tensor<float>({cu_k.back(), Hkv, Ev}, rng);
    dout = attn::testing::random_tensor<float>({cu_q.back(), H, Ev}, rng);
    slopes = attn::testing::random_tensor<float>({H}, rng, 0.2);
    sinks = attn::testing::random_tensor<float>({H}, rng);
  }
  attn::VarlenArgs<float> args(bool alibi, bool sink) const {
    attn::VarlenArgs<float> a;
    a.q = q.view<3>(), a.k = k.view<3>(), a.v = v.view<3>();
    a.cu_seqlens_q = attn::View1<const int64_t>(cu_q.data(), {int64_t(cu_q.size())});
    a.cu_seqlens_k = attn::View1<const int64_t>(cu_k.data(), {int64_t(cu_k.size())});
    a.max_seqlen_q = longest_q, a.max_seqlen_k = longest_k;
    if (alibi) a.alibi_slopes = slopes.view<1>();
    if (sink) a.sinks = sinks.view<1>();
    return a;
  }
};

struct Results {
  Tensor<float> out, lse, dq, dk, dv, dsinks;
};

// Forward then backward; with `saved` false the backward recomputes the
// forward's state itself.
Results run(const Batch& x, bool alibi, bool sink, attn::SdpaOptions opt, bool saved = true) {
  const int64_t tq = x.cu_q.back(), tk = x.cu_k.back();
  Results r{Tensor<float>({tq, x.H, x.Ev}), Tensor<float>({x.H, tq}), Tensor<float>({tq, x.H, x.E}),
            Tensor<float>({tk, x.Hkv, x.E}), Tensor<float>({tk, x.Hkv, x.Ev}), Tensor<float>({x.H})};
  const auto a = x.args(alibi, sink);
  attn::varlen_attention<float>(a, {r.out.view<3>(), r.lse.view<2>()}, opt);
  attn::VarlenGrads<float> g{r.dq.view<3>(), r.dk.view<3>(), r.dv.view<3>(), {}};
  if (sink) g.dsinks = r.dsinks.view<1>();
  attn::VarlenSaved<float> s{};
  if (saved) s = {r.out.view<3>(), r.lse.view<2>()};
  attn::varlen_attention_backward<float>(a, x.dout.view<3>(), s, g, opt);
  return r;
}

bool bitwise_equal(const Tensor<float>& a, const Tensor<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Options {
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  attn::Window window{};
  double softcap = 0;
  std::optional<int64_t> offset;
  bool alibi = false, sinks = false;
  std::string str() const {
    return std::string("causal=") + (causal ? "1" : "0") + (align == CausalAlign::bottom_right ? " br" : " tl") +
           " window=(" + std::to_string(window.left) + "," + std::to_string(window.right) +
           ") softcap=" + std::to_string(softcap) + " offset=" + (offset ? std::to_string(*offset) : "none") +
           " alibi=" + (alibi ? "1" : "0") + " sinks=" + (sinks ? "1" : "0");
  }
  attn::SdpaOptions sdpa(Backend be, int threads) const {
    attn::SdpaOptions o;
    o.backend = be, o.causal = causal, o.causal_align = align, o.window = window, o.softcap = softcap;
    o.position_offset = offset, o.num_threads = threads;
    return o;
  }
};

void expect_close(const Results& f, const Results& r, const Batch& x, bool sinks) {
  const int64_t n = x.longest_k + x.E;
  const double vmag = max_abs(x.v.view<3>());
  EXPECT_TRUE(attn::testing::all_close(f.out, r.out, tolerance<float>(n, vmag), "out"));
  EXPECT_TRUE(attn::testing::all_close(f.lse, r.lse, tolerance<float>(n, max_abs(r.lse.view<2>())), "lse"));
  // Gradients: reductions over both axes of the score tile.
  const int64_t m = x.longest_q + x.longest_k + x.E;
  EXPECT_TRUE(attn::testing::all_close(f.dq, r.dq, tolerance<float>(m, max_abs(r.dq.view<3>()), 40), "dq"));
  EXPECT_TRUE(attn::testing::all_close(f.dk, r.dk, tolerance<float>(m, max_abs(r.dk.view<3>()), 40), "dk"));
  EXPECT_TRUE(attn::testing::all_close(f.dv, r.dv, tolerance<float>(m, max_abs(r.dv.view<3>()), 40), "dv"));
  if (sinks) {
    const int64_t rows = x.cu_q.back();
    EXPECT_TRUE(attn::testing::all_close(f.dsinks, r.dsinks, tolerance<float>(rows * x.Ev, max_abs(r.dsinks.view<1>()), 40),
                                         "dsinks"));
  }
}

// Random packings: lengths around the tile sizes (q_block 16..96, k_block
// 12..240), empty sequences on either side, L != S; options drawn from the
// variants and their combinations; GQA; both backward plans (own_heads when
// sequences × kv heads >= 8).
TEST(VarlenFused, MatchesTheLoopOfDenseReferenceCalls) {
  std::mt19937_64 rng(2027);
  const int64_t lens[] = {0, 1, 2, 11, 12, 13, 17, 47, 95, 96, 97, 130, 241, 300};
  auto pick = [&](auto const& xs) { return xs[std::uniform_int_distribution<size_t>(0, std::size(xs) - 1)(rng)]; };
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t nseq = std::uniform_int_distribution<int64_t>(1, 6)(rng);
    std::vector<int64_t> lq, lk;
    for (int64_t b = 0; b < nseq; ++b) {
      lq.push_back(pick(lens));
      lk.push_back(trial % 3 == 0 ? lq.back() : pick(lens));  // self-attention packings too
    }
    const int64_t hkv = trial % 2 ? 1 : 2, h = hkv * (trial % 4 < 2 ? 2 : 1);
    const int64_t e = pick(std::vector<int64_t>{3, 16, 24}), ev = pick(std::vector<int64_t>{1, 8, 16});
    Batch x(lq, lk, h, hkv, e, ev, rng);
    Options o;
    o.causal = trial % 2 == 0;
    o.align = trial % 4 < 2 ? CausalAlign::top_left : CausalAlign::bottom_right;
    if (trial % 3 == 1) o.window = {int64_t(trial) + 3, trial % 2 ? int64_t(5) : int64_t(-1)};
    if (trial % 5 == 2) o.softcap = 2.5;
    if (trial % 7 == 3) o.offset = int64_t(trial) - 10;
    o.alibi = trial % 3 == 2;
    o.sinks = trial % 2 == 1;
    std::string shape = "lengths q/k:";
    for (int64_t b = 0; b < nseq; ++b) shape += " " + std::to_string(lq[size_t(b)]) + "/" + std::to_string(lk[size_t(b)]);
    SCOPED_TRACE("trial " + std::to_string(trial) + " " + shape + " H=" + std::to_string(h) + " Hkv=" +
                 std::to_string(hkv) + " E=" + std::to_string(e) + " Ev=" + std::to_string(ev) + " " + o.str());
    const Results f = run(x, o.alibi, o.sinks, o.sdpa(Backend::fused, 2));
    const Results r = run(x, o.alibi, o.sinks, o.sdpa(Backend::reference, 1));
    expect_close(f, r, x, o.sinks);
  }
}

// Bitwise identical for 1, 2, 3 and 8 threads, with both backward plans:
// 5 sequences × 2 kv heads (own_heads) and 5 × 1 (the two passes).
TEST(VarlenFused, BitwiseDeterministicAcrossThreadCounts) {
  const std::vector<int64_t> lq = {200, 1, 0, 97, 33}, lk = {130, 7, 5, 241, 33};
  for (int64_t hkv : {1, 2}) {
    std::mt19937_64 rng(77);
    Batch x(lq, lk, 4, hkv, 24, 16, rng);
    Options o;
    o.causal = true, o.align = CausalAlign::bottom_right, o.window = {40, -1}, o.softcap = 3.0, o.sinks = true;
    {
      // The plan for these shapes is the one this test means to cover.
      std::vector<attn::detail::FusedSequence> seqs(5);
      for (auto& s : seqs) s.p.B = 1, s.p.H = 4, s.p.Hkv = hkv, s.p.E = 24, s.p.Ev = 16, s.p.L = 200, s.p.S = 241;
      EXPECT_EQ(attn::detail::fused_packed_plan(seqs).own_heads, hkv == 2);
    }
    Results first;
    for (int t : {1, 2, 3, 8}) {
      SCOPED_TRACE("Hkv=" + std::to_string(hkv) + " threads=" + std::to_string(t));
      Results r = run(x, false, true, o.sdpa(Backend::fused, t));
      if (t == 1) {
        first = std::move(r);
        continue;
      }
      EXPECT_TRUE(bitwise_equal(r.out, first.out));
      EXPECT_TRUE(bitwise_equal(r.lse, first.lse));
      EXPECT_TRUE(bitwise_equal(r.dq, first.dq));
      EXPECT_TRUE(bitwise_equal(r.dk, first.dk));
      EXPECT_TRUE(bitwise_equal(r.dv, first.dv));
      EXPECT_TRUE(bitwise_equal(r.dsinks, first.dsinks));
    }
    // Without the saved state the backward recomputes it: the same bits.
    const Results again = run(x, false, true, o.sdpa(Backend::fused, 2), /*saved=*/false);
    EXPECT_TRUE(bitwise_equal(again.dq, first.dq));
    EXPECT_TRUE(bitwise_equal(again.dk, first.dk));
    EXPECT_TRUE(bitwise_equal(again.dv, first.dv));
    EXPECT_TRUE(bitwise_equal(again.dsinks, first.dsinks));
  }
}

// A NaN in one key row of sequence 1 poisons the rows of sequence 1 that see
// that key, and nothing of the other sequences.
TEST(VarlenFused, NaNStaysInsideItsSequence) {
  std::mt19937_64 rng(5);
  Batch x({40, 50, 30}, {40, 50, 30}, 2, 1, 16, 8, rng);
  const int64_t j = 10;  // key 10 of sequence 1
  x.k.view<3>()(x.cu_k[1] + j, 0, 3) = std::numeric_limits<float>::quiet_NaN();
  Options o;
  o.causal = true;  // rows i >= 10 of sequence 1 see the key
  const Results r = run(x, false, false, o.sdpa(Backend::fused, 2));
  for (int64_t t = 0; t < x.cu_q.back(); ++t)
    for (int64_t h = 0; h < 2; ++h) {
      const bool reached = t >= x.cu_q[1] + j && t < x.cu_q[2];
      SCOPED_TRACE("token " + std::to_string(t) + " head " + std::to_string(h));
      EXPECT_EQ(std::isnan(r.out.view<3>()(t, h, 0)), reached);
      EXPECT_EQ(std::isnan(r.lse.view<2>()(h, t)), reached);
      EXPECT_EQ(std::isnan(r.dq.view<3>()(t, h, 0)), reached);
    }
  for (int64_t t = 0; t < x.cu_k.back(); ++t) {
    // dK/dV of sequence 1's keys 0..49 are reached by its poisoned rows (all
    // keys <= the row); the other sequences' stay finite.
    const bool other = t < x.cu_k[1] || t >= x.cu_k[2];
    if (!other) continue;
    EXPECT_FALSE(std::isnan(r.dk.view<3>()(t, 0, 0))) << t;
    EXPECT_FALSE(std::isnan(r.dv.view<3>()(t, 0, 0))) << t;
  }
}

// With several K/V heads the bad keys are marked in memory order (key by
// key, heads fastest, in the packed layout): a NaN in K/V head 1 of one key
// poisons exactly the query heads of that group, in that sequence, from the
// rows that see the key, and a NaN in V alone does the same.
TEST(VarlenFused, NaNInOneKvHeadPoisonsOnlyItsGroup) {
  for (const bool in_v : {false, true}) {
    std::mt19937_64 rng(6);
    Batch x({40, 50, 30}, {40, 50, 30}, 4, 2, 16, 8, rng);
    const int64_t j = 17;  // key 17 of sequence 1, K/V head 1 (query heads 2 and 3)
    if (in_v)
      x.v.view<3>()(x.cu_k[1] + j, 1, 5) = std::numeric_limits<float>::quiet_NaN();
    else
      x.k.view<3>()(x.cu_k[1] + j, 1, 3) = std::numeric_limits<float>::quiet_NaN();
    Options o;
    o.causal = true;
    const Results r = run(x, false, false, o.sdpa(Backend::fused, 2));
    for (int64_t t = 0; t < x.cu_q.back(); ++t)
      for (int64_t h = 0; h < 4; ++h) {
        const bool reached = h >= 2 && t >= x.cu_q[1] + j && t < x.cu_q[2];
        SCOPED_TRACE("in_v " + std::to_string(in_v) + " token " + std::to_string(t) + " head " + std::to_string(h));
        EXPECT_EQ(std::isnan(r.out.view<3>()(t, h, 0)), reached);
        EXPECT_EQ(std::isnan(r.lse.view<2>()(h, t)), reached);
      }
  }
}

// The forward of a packed batch (rows not adjacent) runs in groups of
// sequences copied head-major (varlen.cpp); every group on the plan of the
// whole batch, so the output and lse are bitwise those of the same batch in
// one group and of the same call on head-major views (read in place, no
// groups): with one sequence per group, a few per group, and all in one,
// for 1, 2 and 3 threads, with the options of the variants.
TEST(VarlenFused, ForwardInGroupsIsBitwiseTheCallInPlace) {
  std::mt19937_64 rng(8);
  // E = Ev = 128, so the plan of a group of short-query sequences alone
  // would tile the keys differently (the 70-row sequence's 90 keys in one
  // tile of 96 instead of two of 48): the test sees a group on its own plan.
  const Batch x({70, 0, 130, 5, 97, 40}, {90, 12, 130, 0, 200, 40}, 4, 2, 128, 128, rng);
  const int64_t tq = x.cu_q.back();
  // The same values in head-major memory, viewed in the packed index order.
  auto head_major = [](const Tensor<float>& t) {
    const int64_t n = t.shape()[0], hx = t.shape()[1], f = t.shape()[2];
    Tensor<float> m({hx, n, f});
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < hx; ++h)
        for (int64_t e = 0; e < f; ++e) m[size_t((h * n + i) * f + e)] = t.view<3>()(i, h, e);
    return m;
  };
  const Tensor<float> qh = head_major(x.q), kh = head_major(x.k), vh = head_major(x.v);
  auto hm_view = [](const Tensor<float>& m) {
    const int64_t hx = m.shape()[0], n = m.shape()[1], f = m.shape()[2];
    return attn::View3<const float>(m.data(), {n, hx, f}, {f, n * f, 1});
  };
  const int64_t saved = attn::detail::varlen_group_bytes;
  Options plain, variants;
  variants.causal = true, variants.align = CausalAlign::bottom_right, variants.window = {50, -1};
  variants.alibi = true, variants.sinks = true;
  for (const Options& o : {plain, variants})
    for (const int threads : {1, 2, 3}) {
      attn::VarlenArgs<float> in_place = x.args(o.alibi, o.sinks);
      in_place.q = hm_view(qh), in_place.k = hm_view(kh), in_place.v = hm_view(vh);
      Tensor<float> out0({tq, x.H, x.Ev}), lse0({x.H, tq});
      attn::varlen_attention<float>(in_place, {out0.view<3>(), lse0.view<2>()}, o.sdpa(Backend::fused, threads));
      for (const int64_t bytes : {int64_t(1), int64_t(700000), int64_t(1) << 30}) {
        SCOPED_TRACE(o.str() + " threads " + std::to_string(threads) + " group bytes " + std::to_string(bytes));
        attn::detail::varlen_group_bytes = bytes;
        Tensor<float> out({tq, x.H, x.Ev}), lse({x.H, tq});
        attn::varlen_attention<float>(x.args(o.alibi, o.sinks), {out.view<3>(), lse.view<2>()},
                                      o.sdpa(Backend::fused, threads));
        EXPECT_TRUE(bitwise_equal(out, out0));
        EXPECT_TRUE(bitwise_equal(lse, lse0));
      }
      attn::detail::varlen_group_bytes = saved;
    }
}

// A sequence's call is checked under the varlen function's name (the fused
// packed path once said "resolve_backend"), in both backends.
TEST(VarlenFused, ErrorsNameTheVarlenFunction) {
  std::mt19937_64 rng(5);
  const Batch x({3, 5}, {4, 5}, 2, 1, 4, 4, rng);
  for (Backend be : {Backend::fused, Backend::reference}) {
    SCOPED_TRACE(attn::backend_name(be));
    attn::SdpaOptions opt;
    opt.backend = be;
    opt.softcap = -1;
    EXPECT_TRUE(attn::testing::throws_with([&] { run(x, false, false, opt); },
                                           {"attn::varlen_attention: ", "softcap"}));
    opt.softcap = 0;
    Tensor<float> out({8, 2, 4}), lse({2, 8}), dq({8, 2, 4}), dk({9, 1, 4}), dv({9, 1, 4});
    attn::varlen_attention<float>(x.args(false, false), {out.view<3>(), lse.view<2>()}, opt);
    opt.window = {-2, 0};
    EXPECT_TRUE(attn::testing::throws_with(
        [&] {
          attn::varlen_attention_backward<float>(x.args(false, false), x.dout.view<3>(), {out.view<3>(), lse.view<2>()},
                                                 {dq.view<3>(), dk.view<3>(), dv.view<3>(), {}}, opt);
        },
        {"attn::varlen_attention_backward: ", "window"}));
  }
}

// Outputs share memory with no other output and no input, as in the dense
// call: refused under the varlen function's name, in both backends.
TEST(VarlenFused, OutputsThatShareMemoryAreRefused) {
  std::mt19937_64 rng(6);
  const Batch x({3, 5}, {4, 5}, 2, 1, 4, 4, rng);
  const int64_t tq = 8, tk = 9;
  using attn::testing::throws_with;
  for (Backend be : {Backend::fused, Backend::reference}) {
    SCOPED_TRACE(attn::backend_name(be));
    attn::SdpaOptions opt;
    opt.backend = be;
    Tensor<float> q = x.q, out({tq, 2, 4}), lse({2, tq});
    attn::VarlenArgs<float> a = x.args(false, false);
    a.q = q.view<3>();
    // out written over q (E = Ev, so the shapes agree).
    EXPECT_TRUE(throws_with([&] { attn::varlen_attention<float>(a, {q.view<3>(), lse.view<2>()}, opt); },
                            {"attn::varlen_attention: ", "output 'out' overlaps input 'q'"}));
    // lse inside out.
    const attn::View2<float> lse_in_out(out.data() + 4, {2, tq}, {tq, 1});
    EXPECT_TRUE(throws_with([&] { attn::varlen_attention<float>(a, {out.view<3>(), lse_in_out}, opt); },
                            {"attn::varlen_attention: ", "output 'out' overlaps output 'lse'"}));

    attn::varlen_attention<float>(a, {out.view<3>(), lse.view<2>()}, opt);
    Tensor<float> dout = x.dout, dq({tq, 2, 4}), dk({tk, 1, 4}), dv({tk, 1, 4});
    auto backward = [&](const attn::VarlenGrads<float>& g) {
      attn::varlen_attention_backward<float>(a, dout.view<3>(), {out.view<3>(), lse.view<2>()}, g, opt);
    };
    // dk inside dq.
    const attn::View3<float> dk_in_dq(dq.data(), {tk, 1, 4}, {4, 4, 1});
    EXPECT_TRUE(throws_with([&] { backward({dq.view<3>(), dk_in_dq, dv.view<3>(), {}}); },
                            {"attn::varlen_attention_backward: ", "output 'dq' overlaps output 'dk'"}));
    // dq written over the incoming gradient (E = Ev).
    EXPECT_TRUE(throws_with([&] { backward({dout.view<3>(), dk.view<3>(), dv.view<3>(), {}}); },
                            {"attn::varlen_attention_backward: ", "output 'dq' overlaps input 'dout'"}));
  }
}

}  // namespace
