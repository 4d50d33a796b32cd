// Option values at the edges: score factors the float32 kernels cannot carry
// (exit 1 with the bound), malformed numbers and lists (exit 2, short
// messages naming the value, never clamped or dropped), checkpoints holding
// tensors the model does not have (exit 1 naming the tensor), and options
// that only apply to some inputs (refused, not ignored).
#include <nlohmann/json.hpp>

#include "attn/io.hpp"
#include "cli/cli_test.hpp"

namespace attn_cli_test {
namespace {

class Limits : public Cli {
 public:
  void write_qkv() {
    std::mt19937_64 rng(3);
    write_random<float>("q.npy", {2, 3, 8}, rng);
    write_random<float>("k.npy", {2, 5, 8}, rng);
    write_random<float>("v.npy", {2, 5, 4}, rng);
  }
  Result sdpa(const std::string& flags) { return run("sdpa --q q.npy --k k.npy --v v.npy --out y.npy " + flags); }
  double max_diff(const std::string& a, const std::string& b) const {
    const auto x = attn::io::read_npy<float>(path(a)), y = attn::io::read_npy<float>(path(b));
    EXPECT_EQ(x.shape, y.shape);
    double m = 0;
    for (size_t i = 0; i < x.data.size() && i < y.data.size(); ++i)
      m = std::max(m, std::isnan(x.data[i]) ? INFINITY : double(std::abs(x.data[i] - y.data[i])));
    return m;
  }
  // Copies checkpoint `from` to `to` with one more tensor, named `name`.
  void add_tensor(const std::string& from, const std::string& to, const std::string& name) {
    attn::io::Metadata meta;
    auto t = attn::io::read_safetensors<float>(path(from), {}, &meta);
    attn::io::Array<float>& a = t[name];
    a.shape = {2};
    a.data = {1.0f, 2.0f};
    a.stored = attn::io::DType::f32;
    attn::io::write_safetensors(path(to), t, meta);
  }
};

TEST_F(Limits, ScoreFactorsBeyondFloat32AreRefusedWithTheBound) {
  write_qkv();
  for (const char* flag : {"--scale 1e38", "--scale 1e-30", "--softcap 1e37", "--softcap 2.4e38", "--softcap 1e-38"})
    for (const char* backend : {"fused", "reference"}) {
      const Result r = sdpa(std::string(flag) + " --backend " + backend);
      EXPECT_EQ(r.rc, 1) << flag << " " << r.err;
      EXPECT_TRUE(contains(r.err, "within [2^-64, 2^64]")) << flag << " " << r.err;
      EXPECT_FALSE(fs::exists(path("y.npy")));
    }
  // At the bounds the fused kernel agrees with the reference.
  for (const char* flag : {"--scale 18446744073709551616", "--softcap 18446744073709551616",
                           "--softcap 5.421010862427522e-20 --scale 18446744073709551616"}) {
    ASSERT_EQ(sdpa(std::string(flag) + " --backend reference").rc, 0) << flag;
    fs::rename(path("y.npy"), path("ref.npy"));
    const Result r = sdpa(std::string(flag) + " --backend fused");
    ASSERT_EQ(r.rc, 0) << flag << " " << r.err;
    EXPECT_LT(max_diff("y.npy", "ref.npy"), 1e-5) << flag;
  }
}

TEST_F(Limits, MalformedNumbersAreUsageErrorsNamingTheValue) {
  write_qkv();
  struct Case {
    const char* flags;
    const char* message;
  };
  for (const Case& c : {Case{"--softcap inf", "--softcap: expected a finite number >= 0, got 'inf'"},
                        Case{"--softcap nan", "--softcap: expected a finite number >= 0, got 'nan'"},
                        Case{"--window 99999999999999999999,0", "got '99999999999999999999'"},
                        Case{"--window 0,-99999999999999999999", "got '-99999999999999999999'"},
                        Case{"--chunk-size -1", "--chunk-size: expected an integer from 0 to 2^63 - 1, got '-1'"},
                        Case{"--sinks ''", "--sinks: expected comma-separated numbers, got ''"},
                        Case{"--sinks 1,,2", "--sinks: expected comma-separated numbers, got ''"},
                        Case{"--alibi-slopes ''", "--alibi-slopes: expected comma-separated numbers, got ''"}}) {
    const Result r = sdpa(c.flags);
    EXPECT_EQ(r.rc, 2) << c.flags << " " << r.err;
    EXPECT_TRUE(contains(r.err, c.message)) << c.flags << " " << r.err;
    EXPECT_LT(r.err.size(), 300u) << c.flags << " " << r.err;
    EXPECT_FALSE(fs::exists(path("y.npy")));
  }
  // A window side out of range (not malformed) is the library's: exit 1.
  EXPECT_EQ(sdpa("--window -3,0").rc, 1);
}

TEST_F(Limits, ExplainChecksItsFlagsBeforePrintingAnything) {
  for (const char* flags : {"--window -3,0", "--sinks nan", "--example random --heads 2 --dim 4 --sinks 0,inf"}) {
    const Result r = run(std::string("explain ") + flags);
    EXPECT_EQ(r.rc, 1) << flags << " " << r.err;
    EXPECT_EQ(r.out, "") << flags;
    EXPECT_TRUE(contains(r.err, "window.left") || contains(r.err, "'sinks'")) << flags << " " << r.err;
  }
  EXPECT_EQ(run("explain --window 1,0 --sinks 0.5").rc, 0);
}

TEST_F(Limits, HeatmapBatchAppliesOnlyToFourAxes) {
  std::mt19937_64 rng(4);
  write_random<double>("w3.npy", {2, 3, 3}, rng);
  write_random<double>("w4.npy", {2, 2, 3, 3}, rng);
  for (const char* b : {"0", "1"}) {
    const Result r = run(std::string("heatmap --weights w3.npy --batch ") + b + " --out h.png");
    EXPECT_EQ(r.rc, 1) << r.err;
    EXPECT_TRUE(contains(r.err, "--batch picks a batch entry of (B, H, L, S) weights; --weights w3.npy has shape (2, 3, 3)"))
        << r.err;
    EXPECT_FALSE(fs::exists(path("h.png")));
  }
  EXPECT_EQ(run("heatmap --weights w3.npy --out h.png").rc, 0);
  EXPECT_EQ(run("heatmap --weights w4.npy --batch 1 --out h4.png").rc, 0);
  EXPECT_EQ(run("heatmap --weights w4.npy --batch 2 --out h5.png").rc, 1);
}

TEST_F(Limits, CheckpointsWithTensorsTheModelDoesNotHaveAreRefused) {
  const std::string cfg = "train --task copy --length 4 --symbols 4 --causal --layers 1 --dim 8 --heads 2 --steps 4 "
                          "--eval-examples 4";
  ASSERT_EQ(run(cfg + " --stop-at 2 --save c.safetensors").rc, 0);
  add_tensor("c.safetensors", "x.safetensors", "blocks.0.extra");
  for (const std::string& cmd : {std::string("generate --checkpoint x.safetensors"),
                                 std::string("heatmap --checkpoint x.safetensors --out h.png"),
                                 cfg + " --resume x.safetensors --save y.safetensors"}) {
    const Result r = run(cmd);
    EXPECT_EQ(r.rc, 1) << cmd << " " << r.err;
    EXPECT_TRUE(contains(r.err, "tensor 'blocks.0.extra' (2,)")) << cmd << " " << r.err;
    EXPECT_TRUE(contains(r.err, "x.safetensors")) << r.err;
  }
  EXPECT_FALSE(fs::exists(path("h.png")));
  EXPECT_FALSE(fs::exists(path("y.safetensors")));
  // The unedited checkpoint, optimizer state included, still loads everywhere.
  EXPECT_EQ(run("generate --checkpoint c.safetensors").rc, 0);
  EXPECT_EQ(run("heatmap --checkpoint c.safetensors --out h.png").rc, 0);
  EXPECT_EQ(run(cfg + " --resume c.safetensors").rc, 0);
}

TEST_F(Limits, GenerateTokensMustBeNonNegative) {
  ASSERT_EQ(run("train --task copy --length 4 --symbols 4 --causal --layers 1 --dim 8 --heads 2 --steps 2 "
                "--eval-examples 4 --save c.safetensors").rc, 0);
  const Result neg = run("generate --checkpoint c.safetensors --prompt 1,2 --tokens -1");
  EXPECT_EQ(neg.rc, 2) << neg.err;
  EXPECT_TRUE(contains(neg.err, "--tokens: expected an integer from 0 to 2^63 - 1, got '-1'")) << neg.err;
  const Result many = run("generate --checkpoint c.safetensors --prompt 1,2 --tokens 1000");
  EXPECT_EQ(many.rc, 2) << many.err;
  EXPECT_TRUE(contains(many.err, "a prompt of 2 tokens plus --tokens 1000 exceeds")) << many.err;
  EXPECT_EQ(run("generate --checkpoint c.safetensors --prompt 1,2 --tokens 1").rc, 0);
}

}  // namespace
}  // namespace attn_cli_test
