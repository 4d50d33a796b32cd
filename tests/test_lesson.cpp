// The explainers' computations (apps/lesson): the steps shown before the
// softmax reproduce the library's weights, the worked examples' published
// numbers, and a sweep's rows equal the rows measured alone.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "lesson.hpp"

namespace {

using attn::lesson::HeadVariants;
using attn::lesson::Mat;

Mat random_mat(int64_t r, int64_t c, attn::Rng& rng) {
  Mat m(r, c);
  for (auto& x : m.a) x = rng.normal();
  return m;
}

// softmax over the visible keys of the last score matrix shown, with the
// sink's logit in the denominator: an independent formulation of A.
Mat weights_from_steps(const attn::lesson::HeadSteps& st, const HeadVariants& v) {
  const Mat& s = st.biased ? *st.biased : st.capped ? *st.capped : st.scaled;
  Mat a(s.rows, s.cols);
  for (int64_t i = 0; i < s.rows; ++i) {
    double m = v.sink.value_or(-std::numeric_limits<double>::infinity()), z = 0;
    for (int64_t j = 0; j < s.cols; ++j)
      if (!st.visible || (*st.visible)(i, j) == 1) m = std::max(m, s(i, j));
    for (int64_t j = 0; j < s.cols; ++j)
      if (!st.visible || (*st.visible)(i, j) == 1) z += std::exp(s(i, j) - m);
    if (v.sink) z += std::exp(*v.sink - m);
    for (int64_t j = 0; j < s.cols; ++j)
      a(i, j) = (!st.visible || (*st.visible)(i, j) == 1) ? std::exp(s(i, j) - m) / z : 0.0;
  }
  return a;
}

TEST(Lesson, StepsReproduceTheLibraryWeightsWithEveryVariant) {
  attn::Rng rng(3);
  const int64_t n = 7, E = 5;
  const Mat Q = random_mat(n, E, rng), K = random_mat(n, E, rng), V = random_mat(n, 3, rng);
  std::vector<int64_t> pos;
  for (int64_t i = 0; i < n; ++i) pos.push_back(i);
  std::vector<HeadVariants> cases(6);
  cases[1].causal = true;
  cases[2].window = {2, 1};
  cases[3].chunk_size = 3;
  cases[4].softcap = 1.5, cases[4].slope = 0.3, cases[4].sink = 0.5;
  cases[5].scale = 1.0, cases[5].causal = true, cases[5].window = {1, -1}, cases[5].chunk_size = 4,
  cases[5].softcap = 2.0, cases[5].slope = 0.7, cases[5].sink = -1.0;
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto st = attn::lesson::head_steps(Q, K, V, pos, cases[c]);
    EXPECT_EQ(st.visible.has_value(), cases[c].masks()) << "case " << c;
    const Mat a = weights_from_steps(st, cases[c]);
    for (int64_t i = 0; i < n; ++i) {
      double row = 0;
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_NEAR(st.A(i, j), a(i, j), 1e-14) << "case " << c << " (" << i << ", " << j << ")";
        row += st.A(i, j);
      }
      const double sink = st.on_sink ? (*st.on_sink)(i, 0) : 0.0;
      EXPECT_NEAR(row + sink, 1.0, 1e-14) << "case " << c << " row " << i;
      for (int64_t e = 0; e < V.cols; ++e) {
        double y = 0;
        for (int64_t j = 0; j < n; ++j) y += st.A(i, j) * V(j, e);
        EXPECT_NEAR(st.Y(i, e), y, 1e-14);
      }
    }
  }
  // the band rules themselves, spelled out
  const auto st = attn::lesson::head_steps(Q, K, V, pos, cases[5]);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j)
      EXPECT_EQ((*st.visible)(i, j), (j <= i && j >= i - 1 && i / 4 == j / 4) ? 1.0 : 0.0) << i << ", " << j;
}

TEST(Lesson, WorkedExamples) {
  const auto cat = attn::lesson::worked_example("cat");
  const auto st = attn::lesson::head_steps(cat.Q, cat.K, cat.V, cat.qpos, {});
  // scores (-2, 4, 0, 0) / 2: weights e^{s_j} / sum
  const double z = std::exp(-1.0) + std::exp(2.0) + 2.0;
  const double want[4] = {std::exp(-1.0) / z, std::exp(2.0) / z, 1 / z, 1 / z};
  for (int j = 0; j < 4; ++j) EXPECT_NEAR(st.A(0, j), want[j], 1e-15);
  EXPECT_NEAR(st.A(0, 0), 0.038, 5e-4);
  EXPECT_NEAR(st.A(0, 1), 0.757, 5e-4);
  EXPECT_NEAR(st.Y(0, 0), 0.76, 5e-3);
  EXPECT_NEAR(st.Y(0, 1), 0.20, 5e-3);
  const auto two = attn::lesson::worked_example("two-tokens");
  const auto st2 = attn::lesson::head_steps(two.Q, two.K, two.V, two.qpos, {});
  EXPECT_NEAR(st2.A(0, 0), 0.80, 5e-3);
  EXPECT_THROW(attn::lesson::worked_example("dog"), attn::InvalidArgument);
}

TEST(Lesson, SweepRowsEqualRowsMeasuredAlone) {
  const auto sweep = attn::lesson::run_experiment("variance", 5);
  for (const auto& row : sweep["rows"]) {
    const auto alone = attn::lesson::variance_row(row[0].get<int64_t>(), 5);
    EXPECT_EQ(row, alone);
  }
  const auto sat = attn::lesson::run_experiment("saturation", 5);
  EXPECT_EQ(sat["rows"][2], attn::lesson::saturation_row(16, 5));
  EXPECT_THROW(attn::lesson::variance_row(0, 5), attn::InvalidArgument);
  EXPECT_THROW(attn::lesson::run_experiment("nonsense", 5), attn::InvalidArgument);
}

TEST(Lesson, PermutationAndTokens) {
  const auto t = attn::lesson::token_example({"the", "cat", "sat", "on", "the", "mat"}, 8, 4, 1);
  for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(t.X(0, d), t.X(4, d));  // the same word, the same row
  const std::vector<int64_t> perm = {2, 0, 1, 5, 3, 4};
  EXPECT_LT(attn::lesson::permutation_check(t.X, t.Wq, t.Wk, t.Wv, perm, false, false).max_diff, 1e-12);
  EXPECT_GT(attn::lesson::permutation_check(t.X, t.Wq, t.Wk, t.Wv, perm, true, false).max_diff, 1e-3);
  EXPECT_GT(attn::lesson::permutation_check(t.X, t.Wq, t.Wk, t.Wv, perm, false, true).max_diff, 1e-3);
  EXPECT_THROW(attn::lesson::token_example({}, 8, 4, 1), attn::InvalidArgument);
}

}  // namespace
