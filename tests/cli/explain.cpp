// `attn explain`: the seeds' worked examples, number for number.
#include "cli_test.hpp"

#include <string>

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
