// merge_attention: two partial results over disjoint key sets merge into the
// attention over all keys (checked against one dense call in double), empty
// parts (lse −inf) are neutral, the merge is associative up to rounding,
// NaN reaches the merged row, any thread count gives the same bits, and bad
// shapes are argument errors.
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "attn/rng.hpp"
#include "testing.hpp"

namespace {

using attn::SdpaArgs;
using attn::SdpaOptions;
using attn::Tensor;
using attn::View3;
using attn::View4;
using attn::testing::all_close;
using attn::testing::random_tensor;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Attention of q over keys [j0, j1) of k and v (double, reference backend).
struct Part {
  Tensor<double> out, lse;
};
Part attend(const Tensor<double>& q, const Tensor<double>& k, const Tensor<double>& v, int64_t j0,
            int64_t j1) {
  const int64_t B = q.dim(0), H = q.dim(1), L = q.dim(2), E = q.dim(3);
  const int64_t S = k.dim(2), Ev = v.dim(3);
  // A view of the key range [j0, j1): same strides, shorter S axis.
  View4<const double> kv(k.data() + j0 * E, {B, H, j1 - j0, E}, {H * S * E, S * E, E, 1});
  View4<const double> vv(v.data() + j0 * Ev, {B, H, j1 - j0, Ev}, {H * S * Ev, S * Ev, Ev, 1});
  Part p{Tensor<double>({B, H, L, Ev}), Tensor<double>({B, H, L})};
  SdpaArgs<double> a;
  a.q = q.view4();
  a.k = kv;
  a.v = vv;
  SdpaOptions opt;
  opt.backend = attn::Backend::reference;
  attn::scaled_dot_product_attention<double>(a, {p.out.view4(), {}, p.lse.view<3>()}, opt);
  return p;
}

// Random q (B, H, L, E), k (B, H, S, E), v (B, H, S, Ev); scores of size ~stddev².
struct Qkv {
  Tensor<double> q, k, v;
};
Qkv random_qkv(uint64_t seed, std::array<int64_t, 6> dims, double stddev) {
  const auto [B, H, L, S, E, Ev] = dims;
  std::mt19937_64 rng(seed);
  Qkv t;
  t.q = random_tensor<double>({B, H, L, E}, rng, stddev);
  t.k = random_tensor<double>({B, H, S, E}, rng, stddev);
  t.v = random_tensor<double>({B, H, S, Ev}, rng);
  return t;
}

TEST(MergeAttention, TwoPartsEqualOneDenseCallAtEverySplit) {
  const int64_t S = 11;
  const auto [q, k, v] = random_qkv(7, {2, 3, 5, S, 4, 3}, 2.0);
  const Part full = attend(q, k, v, 0, S);
  for (int64_t split = 1; split < S; ++split) {
    Part a = attend(q, k, v, 0, split);
    const Part b = attend(q, k, v, split, S);
    attn::merge_attention<double>(a.out.view4(), a.lse.view<3>(), b.out.view4(), b.lse.view<3>());
    EXPECT_TRUE(all_close(a.out.view4(), full.out.view4(), 1e-13, "out, split " + std::to_string(split)));
    EXPECT_TRUE(all_close(a.lse.view<3>(), full.lse.view<3>(), 1e-13, "lse, split " + std::to_string(split)));
  }
}

TEST(MergeAttention, EmptyPartsAreNeutralAndTwoEmptyPartsStayEmpty) {
  const auto [q, k, v] = random_qkv(8, {1, 2, 3, 6, 4, 2}, 1.0);
  const Part full = attend(q, k, v, 0, 6);
  // An empty part: lse −inf, output 0 (what a fully masked part produces).
  Tensor<double> e_out({1, 2, 3, 2}), e_lse({1, 2, 3});
  e_lse.fill(-kInf);
  Part a = attend(q, k, v, 0, 6);
  attn::merge_attention<double>(a.out.view4(), a.lse.view<3>(), e_out.view4(), e_lse.view<3>());
  EXPECT_TRUE(all_close(a.out.view4(), full.out.view4(), 0.0, "full + empty"));
  EXPECT_TRUE(all_close(a.lse.view<3>(), full.lse.view<3>(), 0.0, "full + empty lse"));
  Tensor<double> e2_out = e_out, e2_lse = e_lse;
  attn::merge_attention<double>(e2_out.view4(), e2_lse.view<3>(), a.out.view4(), a.lse.view<3>());
  EXPECT_TRUE(all_close(e2_out.view4(), full.out.view4(), 0.0, "empty + full"));
  Tensor<double> e3_out = e_out, e3_lse = e_lse;
  attn::merge_attention<double>(e3_out.view4(), e3_lse.view<3>(), e_out.view4(), e_lse.view<3>());
  for (size_t i = 0; i < e3_out.size(); ++i) EXPECT_EQ(e3_out[i], 0.0);
  for (size_t i = 0; i < e3_lse.size(); ++i) EXPECT_EQ(e3_lse[i], -kInf);
  for (size_t i = 0; i < e3_out.size(); ++i) EXPECT_FALSE(std::isnan(e3_out[i]));
}

TEST(MergeAttention, IsAssociativeUpToRoundingInFloat) {
  const int64_t S = 30;
  const auto [q, k, v] = random_qkv(9, {1, 2, 4, S, 8, 8}, 3.0);
  auto to_float = [](const Tensor<double>& t) {
    Tensor<float> f(t.shape());
    for (size_t i = 0; i < t.size(); ++i) f[i] = float(t[i]);
    return f;
  };
  const Part p1 = attend(q, k, v, 0, 7), p2 = attend(q, k, v, 7, 19), p3 = attend(q, k, v, 19, S);
  // (1 + 2) + 3
  Tensor<float> lo = to_float(p1.out), ll = to_float(p1.lse);
  const Tensor<float> o2 = to_float(p2.out), l2 = to_float(p2.lse), o3 = to_float(p3.out), l3 = to_float(p3.lse);
  attn::merge_attention<float>(lo.view4(), ll.view<3>(), o2.view4(), l2.view<3>());
  attn::merge_attention<float>(lo.view4(), ll.view<3>(), o3.view4(), l3.view<3>());
  // 1 + (2 + 3)
  Tensor<float> ro = o2, rl = l2;
  attn::merge_attention<float>(ro.view4(), rl.view<3>(), o3.view4(), l3.view<3>());
  Tensor<float> fo = to_float(p1.out), fl = to_float(p1.lse);
  attn::merge_attention<float>(fo.view4(), fl.view<3>(), ro.view4(), rl.view<3>());
  const Part full = attend(q, k, v, 0, S);
  const double tol = attn::testing::tolerance<float>(3, 1.0);
  EXPECT_TRUE(all_close(lo.view4(), fo.view4(), tol, "(1+2)+3 vs 1+(2+3)"));
  EXPECT_TRUE(all_close(ll.view<3>(), fl.view<3>(), tol * 10, "lse"));
  EXPECT_TRUE(all_close(lo.view4(), full.out.view4(), tol, "against the dense call"));
}

TEST(MergeAttention, NanInEitherPartReachesTheMergedRow) {
  Tensor<float> oa({1, 1, 2, 2}), la({1, 1, 2}), ob({1, 1, 2, 2}), lb({1, 1, 2});
  oa.fill(1.0f);
  ob.fill(2.0f);
  la[0] = 0.5f;
  la[1] = 0.25f;
  lb[0] = std::numeric_limits<float>::quiet_NaN();  // row 0: NaN lse in part b
  lb[1] = 0.0f;
  ob[3] = std::numeric_limits<float>::quiet_NaN();  // row 1: NaN output in part b
  attn::merge_attention<float>(oa.view4(), la.view<3>(), ob.view4(), lb.view<3>());
  EXPECT_TRUE(std::isnan(la[0]));
  EXPECT_TRUE(std::isnan(oa[0]) && std::isnan(oa[1]));
  EXPECT_FALSE(std::isnan(la[1]));
  EXPECT_FALSE(std::isnan(oa[2]));
  EXPECT_TRUE(std::isnan(oa[3]));
}

TEST(MergeAttention, MismatchedShapesAreArgumentErrors) {
  Tensor<float> oa({1, 2, 3, 4}), la({1, 2, 3}), ob({1, 2, 3, 5}), lb({1, 2, 4});
  try {
    attn::merge_attention<float>(oa.view4(), la.view<3>(), ob.view4(), la.view<3>());
    FAIL() << "no error";
  } catch (const attn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'out_b' has shape (1, 2, 3, 5), expected (1, 2, 3, 4)"),
              std::string::npos)
        << e.what();
  }
  Tensor<float> ob2({1, 2, 3, 4});
  try {
    attn::merge_attention<float>(oa.view4(), la.view<3>(), ob2.view4(), lb.view<3>());
    FAIL() << "no error";
  } catch (const attn::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'lse_b' has shape (1, 2, 4)"), std::string::npos) << e.what();
  }
}

// The rows are shared among threads, each merged on its own: every thread
// count gives the same bits, on a part set that holds all the special rows
// (an empty part on either side, both empty, NaN) between ordinary ones, and
// enough rows (2·3·40 of 64 features) for the threads to start.
TEST(MergeAttention, AnyThreadCountGivesTheSameBits) {
  const float ninf = -std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  Tensor<float> oa({2, 3, 40, 64}), la({2, 3, 40}), ob({2, 3, 40, 64}), lb({2, 3, 40});
  attn::Rng rng(17);
  for (size_t i = 0; i < oa.size(); ++i) oa[i] = float(rng.normal()), ob[i] = float(rng.normal());
  for (size_t i = 0; i < la.size(); ++i) la[i] = float(3 * rng.normal()), lb[i] = float(3 * rng.normal());
  la[5] = ninf, lb[6] = ninf, la[7] = lb[7] = ninf, lb[8] = nan;
  Tensor<float> want_o = oa, want_l = la;
  attn::merge_attention<float>(want_o.view4(), want_l.view<3>(), ob.view4(), lb.view<3>(), 1);
  EXPECT_EQ(want_l[7], ninf);
  EXPECT_EQ(want_o[7 * 64], 0.0f);
  EXPECT_TRUE(std::isnan(want_l[8]) && std::isnan(want_o[8 * 64 + 3]));
  for (int threads : {0, 2, 3, 8}) {
    Tensor<float> o = oa, l = la;
    attn::merge_attention<float>(o.view4(), l.view<3>(), ob.view4(), lb.view<3>(), threads);
    EXPECT_EQ(std::memcmp(o.data(), want_o.data(), o.size() * sizeof(float)), 0) << threads << " threads";
    EXPECT_EQ(std::memcmp(l.data(), want_l.data(), l.size() * sizeof(float)), 0) << threads << " threads";
  }
  using attn::testing::throws_with;
  EXPECT_TRUE(throws_with([&] { attn::merge_attention<float>(oa.view4(), la.view<3>(), ob.view4(), lb.view<3>(), -1); },
                          {"attn::merge_attention", "'num_threads' is -1"}));
}

// The boundary's Checker: missing, negative, aliased and broadcast views.
TEST(MergeAttention, BadViewsAreArgumentErrors) {
  using attn::testing::throws_with;
  Tensor<float> oa({1, 2, 3, 4}), la({1, 2, 3}), ob({1, 2, 3, 4}), lb({1, 2, 3});
  auto merge = [&](View4<float> o, View3<float> l, View4<const float> o2, View3<const float> l2) {
    return [=] { attn::merge_attention<float>(o, l, o2, l2); };
  };
  EXPECT_TRUE(throws_with(merge(oa.view4(), la.view<3>(), {}, lb.view<3>()), {"attn::merge_attention", "'out_b' is required"}));
  EXPECT_TRUE(throws_with(merge(View4<float>(oa.data(), {1, 2, -3, 4}), la.view<3>(), ob.view4(), lb.view<3>()),
                          {"'out_a' has shape (1, 2, -3, 4), expected dimensions >= 0"}));
  EXPECT_TRUE(throws_with(merge(oa.view4(), la.view<3>(), oa.view4(), lb.view<3>()), {"output 'out_a' overlaps input 'out_b'"}));
  EXPECT_TRUE(throws_with(merge(oa.view4(), View3<float>(oa.data(), {1, 2, 3}), ob.view4(), lb.view<3>()),
                          {"output 'out_a' overlaps output 'lse_a'"}));
  EXPECT_TRUE(throws_with(merge(oa.view4(), View3<float>(la.data(), {1, 2, 3}, {0, 0, 1}), ob.view4(), lb.view<3>()),
                          {"output 'lse_a' has stride 0 on axis 1"}));
}

}  // namespace
