// The tool as a whole: --help of every subcommand, `attn bench`, `attn tour`.
#include "cli_test.hpp"

#include <string>

namespace attn_cli_test {
namespace {

TEST_F(Cli, BenchRunsAttnBenchOrSaysItIsMissing) {
  const fs::path bench = fs::path(kCli).parent_path().parent_path() / "bench" / "attn-bench";
  if (fs::exists(bench)) {
    // Built: `attn bench` hands its arguments to attn-bench.
    const Result h = run("bench --help");
    EXPECT_EQ(h.rc, 0) << h.err;
    EXPECT_TRUE(contains(h.out, "attn-bench: validate, then time")) << h.out;
    return;
  }
  const Result r = run("bench");
  EXPECT_EQ(r.rc, 4);
  EXPECT_TRUE(contains(r.err, "attn-bench is not built")) << r.err;
}

TEST_F(Cli, TourRunsEndToEnd) {
  const Result r = run("tour --quick --heatmap tour.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  for (const char* part : {"1. Attention by hand", "weights 0.038 0.757 0.102 0.102", "2. Five claims about attention, measured",
                           "[variance]", "[saturation]", "[jacobian]", "[equivariance]", "[lookup]",
                           "3. Multi-head attention on a sentence", "4. Speed", "reference", "Tour finished"})
    EXPECT_TRUE(contains(r.out, part)) << part;
  EXPECT_EQ(slurp(path("tour.png")).substr(1, 3), "PNG");
  EXPECT_FALSE(contains(r.out, "\r")) << "no progress bar when stdout is not a terminal";
}

TEST_F(Cli, HelpOfEveryCommandDocumentsTheExitCodes) {
  Result r = run("--help");
  EXPECT_EQ(r.rc, 0);
  EXPECT_TRUE(contains(r.out, "Exit codes: 0 success; 1 invalid input")) << r.out;
  for (const char* sub : {"sdpa", "mha", "explain", "experiment", "heatmap", "train", "tour"}) {
    r = run(std::string(sub) + " --help");
    EXPECT_EQ(r.rc, 0) << sub;
    EXPECT_TRUE(contains(r.out, "Exit codes")) << sub;
  }
}

// OpenMP threads of the tool wait passively unless the user chose a policy
// (apps/passive_wait). libgomp prints what it uses with OMP_DISPLAY_ENV: an
// unset policy shows as PASSIVE too, but with a spin count of 300000; passive
// waiting spins 0 times. `generate` runs a decode loop: its threads spin
// briefly between regions (GOMP_SPINCOUNT=10000) unless the user chose a
// policy.
TEST_F(Cli, OpenMPWaitsPassivelyUnlessTheUserSaysOtherwise) {
  struct Case {
    const char *args, *env, *shown;
  };
  const char* unset = "-u OMP_WAIT_POLICY -u GOMP_SPINCOUNT ";
  for (const Case& c : {Case{"--help", unset, "GOMP_SPINCOUNT = '0'"},
                        Case{"train --help", unset, "GOMP_SPINCOUNT = '0'"},
                        Case{"generate --help", unset, "GOMP_SPINCOUNT = '10000'"},
                        Case{"--help", "OMP_WAIT_POLICY=active ", "OMP_WAIT_POLICY = 'ACTIVE'"},
                        Case{"generate --help", "OMP_WAIT_POLICY=passive ", "GOMP_SPINCOUNT = '0'"},
                        Case{"--help", "-u OMP_WAIT_POLICY GOMP_SPINCOUNT=1000 ", "GOMP_SPINCOUNT = '1000'"},
                        Case{"generate --help", "-u OMP_WAIT_POLICY GOMP_SPINCOUNT=1000 ", "GOMP_SPINCOUNT = '1000'"}}) {
    const Result r = run(c.args, std::string(c.env) + "OMP_DISPLAY_ENV=verbose");
    ASSERT_EQ(r.rc, 0) << c.args << " with " << c.env << ": " << r.err;
    EXPECT_TRUE(contains(r.err, c.shown)) << c.args << " with " << c.env << ": " << r.err;
  }
}

}  // namespace
}  // namespace attn_cli_test
