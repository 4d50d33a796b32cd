// `attn experiment`: every experiment's figures against conditions any
// honest run satisfies, for two seeds; tables and plots.
#include "cli_test.hpp"

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

namespace attn_cli_test {
namespace {

using json = nlohmann::json;

// ---- experiments: conditions any honest run satisfies, for two seeds ---------------

json experiment(const Cli& t, const std::string& name, int seed) {
  const Result r = t.run("experiment " + name + " --json --seed " + std::to_string(seed));
  EXPECT_EQ(r.rc, 0) << r.err;
  return json::parse(r.out);
}

TEST_F(Cli, ExperimentVariance) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "variance", seed);
    ASSERT_EQ(j["rows"].size(), 10u);  // d_k = 1, 2, ..., 512
    for (const auto& row : j["rows"]) {
      const double dk = row[0], sd = row[2], scaled = row[4];
      if (dk >= 4) {
        EXPECT_NEAR(sd / std::sqrt(dk), 1.0, 0.10) << "d_k " << dk << " seed " << seed;
      }
      EXPECT_NEAR(scaled, 1.0, 0.10) << "d_k " << dk << " seed " << seed;
    }
  }
}

TEST_F(Cli, ExperimentSaturation) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "saturation", seed);
    const auto& rows = j["rows"];
    ASSERT_EQ(rows.size(), 5u);  // d_k = 1, 4, 16, 64, 256
    EXPECT_EQ(rows[4][0].get<int>(), 256);
    EXPECT_GT(rows[4][3].get<double>(), 0.99) << "unscaled top weight at d_k = 256";
    EXPECT_LT(rows[4][6].get<double>(), 0.9) << "scaled top weight at d_k = 256";
    EXPECT_GT(rows[4][2].get<double>(), 1000.0) << "unscaled ratio of the top two weights at d_k = 256";
    for (size_t i = 1; i < rows.size(); ++i) {
      EXPECT_GE(rows[i][3].get<double>(), rows[i - 1][3].get<double>()) << "unscaled top weight grows with d_k";
      EXPECT_GT(rows[i][6].get<double>(), 0.3);
      EXPECT_LT(rows[i][6].get<double>(), 0.75) << "scaled weights stay a blend";
    }
    // The unscaled gap grows like sqrt(d_k): 64x the head size, about 8x the gap.
    const double growth = rows[4][1].get<double>() / rows[1][1].get<double>();
    EXPECT_GT(growth, 5.0);
    EXPECT_LT(growth, 13.0);
  }
}

TEST_F(Cli, ExperimentJacobian) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "jacobian", seed);
    const auto& un = j["rows"][0];
    const auto& sc = j["rows"][1];
    EXPECT_EQ(un[0].get<std::string>(), "unscaled");
    EXPECT_GT(un[2].get<double>(), 50.0) << "most unscaled rows are saturated";
    EXPECT_LT(sc[2].get<double>(), 5.0) << "almost no scaled row is saturated";
    EXPECT_GT(sc[3].get<double>(), 20 * un[3].get<double>()) << "median Jacobian norm";
    EXPECT_GT(sc[5].get<double>(), 3 * un[5].get<double>()) << "median gradient per query";
    // Dropping the saturated rows' terms barely changes the unscaled dL/dW_Q.
    EXPECT_NEAR(j["unscaled_grad_wq_share_of_unsaturated_rows"].get<double>(), 1.0, 0.05);
    // A softmax Jacobian's Frobenius norm is at most 1/2 (two equal weights, the rest 0).
    EXPECT_LE(sc[4].get<double>(), 0.5);
    EXPECT_LE(un[4].get<double>(), 0.5);
  }
}

TEST_F(Cli, ExperimentEquivariance) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "equivariance", seed);
    const auto& rows = j["rows"];
    ASSERT_EQ(rows.size(), 3u);
    EXPECT_LT(rows[0][1].get<double>(), 1e-12) << "plain attention is permutation-equivariant";
    EXPECT_GT(rows[1][1].get<double>(), 1e-3) << "a causal mask breaks it";
    EXPECT_GT(rows[2][1].get<double>(), 1e-3) << "positions break it";
  }
}

TEST_F(Cli, ExperimentLookup) {
  for (int seed : {0, 7}) {
    const json j = experiment(*this, "lookup", seed);
    const auto& rows = j["rows"];
    ASSERT_GE(rows.size(), 6u);
    EXPECT_LT(rows[0][2].get<double>(), 0.5) << "at c = 1 the lookup is a blur";
    for (size_t i = 1; i < rows.size(); ++i) {
      EXPECT_LE(rows[i][3].get<double>(), rows[i - 1][3].get<double>()) << "error shrinks as c grows";
      EXPECT_GE(rows[i][2].get<double>(), rows[i - 1][2].get<double>());
    }
    EXPECT_LT(rows.back()[3].get<double>(), 1e-9) << "large c: an exact lookup";
  }
}

TEST_F(Cli, ExperimentTablesAndPlots) {
  Result r = run("experiment variance --plot v.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "std(q.k/sqrt(d_k))"));
  const std::string png = slurp(path("v.png"));
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
  for (const char* e : {"saturation", "lookup"}) {
    r = run(std::string("experiment ") + e + " --plot p.png");
    ASSERT_EQ(r.rc, 0) << e << r.err;
    EXPECT_EQ(png_size(slurp(path("p.png"))), (std::pair<uint32_t, uint32_t>{900, 600})) << e << ": a 900 x 600 chart";
  }
}

}  // namespace
}  // namespace attn_cli_test
