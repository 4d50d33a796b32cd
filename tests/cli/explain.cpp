// `attn explain`: the seeds' worked examples, number for number.
#include "cli_test.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace attn_cli_test {
namespace {

// ---- golden: the seeds' worked examples ------------------------------------------

TEST_F(Cli, ExplainCatReproducesTheSeedsNumbers) {
  const Result r = run("explain --example cat");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "S / sqrt(d_k) = S / 2")) << r.out;
  EXPECT_TRUE(contains(r.out, "hungry   -1.000    2.000    0.000    0.000")) << r.out;  // scaled scores
  EXPECT_TRUE(contains(r.out, "hungry    0.038    0.757    0.102    0.102")) << r.out;  // weights
  EXPECT_TRUE(contains(r.out, "Result for \"hungry\": weights 0.038 0.757 0.102 0.102  ->  output 0.76 0.20"))
      << r.out;
}

TEST_F(Cli, ExplainTwoTokensReproducesTheSeedsNumbers) {
  const Result r = run("explain --example two-tokens");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "token 1    1.414    0.000")) << r.out;  // 2 / sqrt(2), 0 / sqrt(2)
  EXPECT_TRUE(contains(r.out, "Result for \"token 1\": weights 0.80 0.20  ->  output 0.80 0.20")) << r.out;
  // Causal: token 1 may only see itself.
  const Result c = run("explain --example two-tokens --causal");
  ASSERT_EQ(c.rc, 0) << c.err;
  EXPECT_TRUE(contains(c.out, "weights 1.00 0.00  ->  output 1.00 0.00")) << c.out;
}

TEST_F(Cli, ExplainRandomShowsHeadsConcatenationAndOutputProjection) {
  const Result r = run("explain --example random --heads 2 --dim 6 --tokens 3");
  ASSERT_EQ(r.rc, 0) << r.err;
  // Weights [out, in] as the library stores them: Q = X W_Q^T, output = O W_O^T.
  for (const char* part : {"X (token embeddings", "W_Q  [out, in] = [H*d_k, D] = [6, 6]", "Q = X W_Q^T", "head 0",
                           "head 1", "S_1 = Q_1 K_1^T", "A_0 = softmax", "O = [Y_0 | Y_1",
                           "W_O  [out, in] = [D, H*d_v] = [6, 6]", "output = O W_O^T"})
    EXPECT_TRUE(contains(r.out, part)) << part;
}

}  // namespace
}  // namespace attn_cli_test

namespace attn_cli_test {
namespace {

// ---- the variants ------------------------------------------------------------------

// printf-style text (the tests do not link fmt).
template <class... A>
std::string text(const char* f, A... a) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

// The rows of the printed matrix titled `title`: n rows of numbers after a label.
std::vector<std::vector<double>> printed_rows(const std::string& out, const std::string& title, int n) {
  std::istringstream in(out.substr(out.find(title)));
  std::string line;
  std::getline(in, line);  // the title
  std::vector<std::vector<double>> rows;
  for (int i = 0; i < n && std::getline(in, line); ++i) {
    std::istringstream ls(line);
    std::string label;
    ls >> label;
    std::vector<double> r;
    for (double x; ls >> x;) r.push_back(x);
    rows.push_back(r);
  }
  return rows;
}

// The cat example's query "hungry" (position 3) with window (1, 0), ALiBi of
// slope 0.5 and a sink 0.5, against the formula: it sees "was" (scaled score
// 0, bias -0.5) and itself (0, 0); the sink adds exp(0.5) to the denominator.
TEST_F(Cli, ExplainCatWithWindowAlibiAndSinkFollowsTheFormula) {
  const Result r = run("explain --example cat --window 1,0 --alibi-slopes 0.5 --sinks 0.5");
  ASSERT_EQ(r.rc, 0) << r.err;
  const double was = std::exp(-0.5), self = 1.0, sink = std::exp(0.5), z = was + self + sink;
  EXPECT_TRUE(contains(r.out, "hungry   -2.500    1.000   -0.500    0.000")) << r.out;  // S / 2 - 0.5 (3 - j)
  EXPECT_TRUE(contains(r.out, "hungry     0     0     1     1")) << r.out;               // visible keys
  EXPECT_TRUE(contains(r.out, text("weights 0.000 0.000 %.3f %.3f", was / z, self / z))) << r.out;
  EXPECT_TRUE(contains(r.out, text("hungry %8.3f", sink / z))) << r.out;  // weight on the sink
}

// A window keeps exactly the band p - left <= j <= p + right: zero weight
// outside it, positive inside; with sinks every row gives 1 minus its sink
// weight to the keys. The heatmap of the same weights is written.
TEST_F(Cli, ExplainRandomWindowIsABandAndTheHeatmapIsWritten) {
  const int n = 8;
  for (const bool sinks : {false, true}) {
    const Result r = run(std::string("explain --example random --tokens 8 --heads 2 --dim 4 --window 2,1 --alibi --png w.png") +
                         (sinks ? " --sinks 1,-1" : ""));
    ASSERT_EQ(r.rc, 0) << r.err;
    for (const char* head : {"_0", "_1"}) {
      const auto A = printed_rows(r.out, std::string("A") + head + " = softmax", n);
      const auto on_sink = sinks ? printed_rows(r.out, std::string("weight on the sink") + head, n)
                                 : std::vector<std::vector<double>>();
      ASSERT_EQ(A.size(), size_t(n)) << head;
      for (int i = 0; i < n; ++i) {
        ASSERT_EQ(A[size_t(i)].size(), size_t(n)) << head << " row " << i;
        double sum = 0;
        for (int j = 0; j < n; ++j) {
          const double w = A[size_t(i)][size_t(j)];
          sum += w;
          if (j < i - 2 || j > i + 1)
            EXPECT_EQ(w, 0.0) << head << " (" << i << ", " << j << ") is outside the window";
          else
            EXPECT_GE(w, 0.0) << head << " (" << i << ", " << j << ")";
        }
        const double rest = sinks ? on_sink[size_t(i)][0] : 0.0;
        if (sinks) {
          EXPECT_GT(rest, 0.0) << head << " row " << i;
        }
        EXPECT_NEAR(sum + rest, 1.0, 3e-3) << head << " row " << i;  // printed to 3 decimals
      }
    }
    EXPECT_TRUE(contains(r.out, "visible_0 (1 = the query may attend to the key; window (2, 1)")) << r.out;
    EXPECT_TRUE(contains(r.out, "ALiBi bias_0 = -m |p_i - j|, slope m = 0.0625")) << r.out;  // 2^(-8/2) for 2 heads
    const auto [w, h] = png_size(slurp(path("w.png")));
    EXPECT_GT(w, 200u);
    EXPECT_GT(h, 200u);
  }
  const Result bad = run("explain --example random --heads 2 --dim 4 --sinks 1,2,3 --png x.png");
  EXPECT_EQ(bad.rc, 1);
  EXPECT_TRUE(contains(bad.err, "--sinks has 3 values; expected 1 (every head) or H = 2")) << bad.err;
  EXPECT_FALSE(fs::exists(path("x.png")));
}

}  // namespace
}  // namespace attn_cli_test
