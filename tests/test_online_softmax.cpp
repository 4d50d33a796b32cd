// The online softmax unit on its own: streaming updates and merges of
// partial results against the plain two-pass softmax, split-independence,
// the −∞ guards, and NaN (or +∞) scores poisoning the row for good.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/fused/online_softmax.hpp"
#include "testing.hpp"

namespace {

namespace os = attn::detail::online_softmax;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Plain log-sum-exp and softmax-weighted sum of values v (double).
struct Plain {
  double lse, y;
};
Plain plain(const std::vector<double>& s, const std::vector<double>& v) {
  double m = -kInf;
  for (double x : s) m = std::max(m, x);
  if (m == -kInf) return {-kInf, 0.0};
  double sum = 0, acc = 0;
  for (size_t j = 0; j < s.size(); ++j) {
    sum += std::exp(s[j] - m);
    acc += std::exp(s[j] - m) * v[j];
  }
  return {m + std::log(sum), acc / sum};
}

// One partial result: state plus the accumulator Σ p_j v_j.
struct Partial {
  os::State<double> st;
  double acc = 0;
};

// Streams s[lo, hi) through update() in pieces of `piece` keys.
Partial stream(const std::vector<double>& s, const std::vector<double>& v, size_t lo, size_t hi,
               size_t piece) {
  Partial r;
  std::vector<double> p(piece);
  for (size_t j0 = lo; j0 < hi; j0 += piece) {
    const int n = int(std::min(piece, hi - j0));
    const double alpha = os::update(r.st, &s[j0], n, p.data());
    r.acc *= alpha;  // acc <- acc · exp(old max − new max)
    for (int j = 0; j < n; ++j) r.acc += p[size_t(j)] * v[j0 + size_t(j)];
  }
  return r;
}

TEST(OnlineSoftmax, StreamingMatchesPlainForAnyPieceSize) {
  std::mt19937_64 rng(1);
  std::normal_distribution<double> nd(0, 3);
  for (size_t n : {1u, 2u, 7u, 64u, 257u}) {
    std::vector<double> s(n), v(n);
    for (size_t j = 0; j < n; ++j) {
      s[j] = nd(rng);
      v[j] = nd(rng);
    }
    const Plain want = plain(s, v);
    for (size_t piece : {size_t(1), size_t(3), size_t(16), n}) {
      const Partial r = stream(s, v, 0, n, piece);
      const auto f = os::finalize(r.st);
      EXPECT_NEAR(f.lse, want.lse, 1e-12 * (1 + std::abs(want.lse))) << "n=" << n << " piece=" << piece;
      EXPECT_NEAR(r.acc * f.inv_sum, want.y, 1e-12) << "n=" << n << " piece=" << piece;
    }
  }
}

TEST(OnlineSoftmax, MergeDoesNotDependOnHowKeysAreSplit) {
  std::mt19937_64 rng(2);
  std::normal_distribution<double> nd(0, 5);
  const size_t n = 200;
  std::vector<double> s(n), v(n);
  for (size_t j = 0; j < n; ++j) {
    s[j] = nd(rng);
    v[j] = nd(rng);
  }
  // Masked keys too, including a fully masked split.
  for (size_t j = 40; j < 60; ++j) s[j] = -kInf;
  const Plain want = plain(s, v);
  std::uniform_int_distribution<size_t> cut(0, n);
  for (int trial = 0; trial < 50; ++trial) {
    // Split [0, n) into up to 4 parts at random cut points, stream each with a
    // random piece size, and merge left to right.
    std::vector<size_t> cuts = {0, cut(rng), cut(rng), cut(rng), n};
    std::sort(cuts.begin(), cuts.end());
    if (trial == 0) cuts = {0, 40, 60, 60, n};  // one part is fully masked, one empty
    Partial total;
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const Partial part = stream(s, v, cuts[k], cuts[k + 1], 1 + size_t(trial % 9));
      const auto w = os::merge(total.st, part.st);
      total.acc = w.wa * total.acc + w.wb * part.acc;
    }
    const auto f = os::finalize(total.st);
    EXPECT_NEAR(f.lse, want.lse, 1e-12 * (1 + std::abs(want.lse))) << "trial " << trial;
    EXPECT_NEAR(total.acc * f.inv_sum, want.y, 1e-12) << "trial " << trial;
  }
}

TEST(OnlineSoftmax, BaseTwoScoresGiveTheSameProbabilitiesAndLse) {
  // The fused forward measures scores in base 2 (s·log2 e). Streaming the
  // same row in base 2, split unevenly, gives the same probabilities, and an
  // lse that is the natural one divided by ln 2.
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd(0.0, 4.0);
  std::vector<double> s(37), s2(37), p(37), p2(37);
  for (size_t j = 0; j < s.size(); ++j) s2[j] = (s[j] = nd(rng)) / std::log(2.0);
  os::State<double> st, st2;
  double acc = 0, acc2 = 0;
  for (int j0 = 0, n = 0; j0 < 37; j0 += n) {
    n = std::min(37 - j0, 1 + j0 % 7);
    acc *= os::update(st, &s[size_t(j0)], n, &p[size_t(j0)]);
    acc2 *= os::update<os::Base2>(st2, &s2[size_t(j0)], n, &p2[size_t(j0)]);
    for (int j = j0; j < j0 + n; ++j) acc += p[size_t(j)] * j, acc2 += p2[size_t(j)] * j;
  }
  const auto f = os::finalize(st), f2 = os::finalize<os::Base2>(st2);
  EXPECT_NEAR(f2.lse * std::log(2.0), f.lse, 1e-12 * (1 + std::abs(f.lse)));
  EXPECT_NEAR(acc2 * f2.inv_sum, acc * f.inv_sum, 1e-12 * 37);
  for (size_t j = 0; j < s.size(); ++j) EXPECT_NEAR(p2[j], p[j], 1e-12 * (1 + p[j])) << j;
}

TEST(OnlineSoftmax, FullyMaskedRowGivesZeroAndMinusInfinityNeverNaN) {
  std::vector<float> s(5, -std::numeric_limits<float>::infinity()), p(5, 1.0f);
  os::State<float> st;
  const float alpha = os::update(st, s.data(), 5, p.data());
  EXPECT_EQ(alpha, 0.0f);
  for (float x : p) EXPECT_EQ(x, 0.0f);
  const auto f = os::finalize(st);
  EXPECT_EQ(f.inv_sum, 0.0f);
  EXPECT_TRUE(std::isinf(f.lse) && f.lse < 0);
  // Merging two empty partials stays empty; merging with a real one keeps it.
  os::State<float> empty;
  auto w = os::merge(st, empty);
  EXPECT_EQ(w.wa, 0.0f);
  EXPECT_EQ(w.wb, 0.0f);
  EXPECT_EQ(st.sum, 0.0f);
  os::State<float> real;
  real.max = 2.0f;
  real.sum = 3.0f;
  w = os::merge(st, real);
  EXPECT_EQ(w.wb, 1.0f);
  EXPECT_EQ(st.max, 2.0f);
  EXPECT_EQ(st.sum, 3.0f);
  // The backward's shift for an lse of −∞ makes every probability exp(s − ∞) = 0.
  EXPECT_EQ(std::exp(1e4f - os::lse_shift(-std::numeric_limits<float>::infinity())), 0.0f);
}

// A NaN or +∞ score, in any tile, leaves the row NaN however many finite
// tiles follow; −∞ scores (masked keys) around it change nothing of that.
TEST(OnlineSoftmax, NanOrPlusInfinityScorePoisonsTheRowForGood) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), inf})
    for (int where = 0; where < 3; ++where) {  // first, middle or last tile
      std::vector<float> s = {0.5f, -inf, 2.0f, 1.0f, -inf, -3.0f}, p(6);
      s[size_t(2 * where)] = bad;
      os::State<float> st;
      for (int tile = 0; tile < 3; ++tile) os::update(st, s.data() + 2 * tile, 2, p.data() + 2 * tile);
      const auto f = os::finalize(st);
      EXPECT_TRUE(std::isnan(f.lse)) << bad << " in tile " << where;
      EXPECT_TRUE(std::isnan(f.inv_sum)) << bad << " in tile " << where;
      // A merge with a clean partial stays poisoned, in either order.
      os::State<float> clean;
      os::update(clean, s.data() + 2 * ((where + 1) % 3), 2, p.data());
      os::State<float> a = st, b = clean;
      os::merge(a, clean);
      os::merge(b, st);
      EXPECT_TRUE(std::isnan(os::finalize(a).lse) && std::isnan(os::finalize(b).lse)) << bad;
    }
  // −∞ alone is the masked row, not a poison.
  std::vector<float> s(4, -inf), p(4);
  os::State<float> st;
  os::update(st, s.data(), 4, p.data());
  EXPECT_FALSE(std::isnan(os::finalize(st).lse));
}

TEST(OnlineSoftmax, HugeScoresStayFinite) {
  std::vector<float> s = {1e4f, -1e4f, 9999.0f, 3e4f}, p(4);
  os::State<float> st;
  os::update(st, s.data(), 2, p.data());
  const float alpha = os::update(st, s.data() + 2, 2, p.data() + 2);
  EXPECT_TRUE(std::isfinite(alpha));
  const auto f = os::finalize(st);
  EXPECT_FLOAT_EQ(f.lse, 3e4f);
  for (float x : p) EXPECT_TRUE(std::isfinite(x));
}

}  // namespace
