// `attn heatmap` from a weights file, `attn train` (save, resume, curves,
// variants, dropout) and `attn heatmap --checkpoint` on what it trained.
#include "cli_test.hpp"

#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace attn_cli_test {
namespace {

TEST_F(Cli, HeatmapWritesAPngOfTheRightSize) {
  std::vector<double> w(2 * 3 * 3, 1.0 / 3);
  attn::io::write_npy(path("a.npy"), {2, 3, 3}, w.data());
  const Result r = run("heatmap --weights a.npy --labels 'the cat sat' --out h.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto [width, height] = png_size(slurp(path("h.png")));
  EXPECT_GT(width, 200u);  // two panels side by side
  EXPECT_GT(height, 100u);
}

// ---- train and the checkpoint heatmap -------------------------------------------------

// The CSV's rows as (step, loss).
std::vector<std::pair<int64_t, double>> curve_rows(const std::string& csv) {
  std::vector<std::pair<int64_t, double>> rows;
  std::istringstream is(csv);
  std::string line;
  std::getline(is, line);  // header
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string step, lr, loss;
    std::getline(ls, step, ',');
    std::getline(ls, lr, ',');
    std::getline(ls, loss, ',');
    rows.emplace_back(std::stoll(step), std::stod(loss));
  }
  return rows;
}

// The words after `label` on the line that starts with it (e.g. "  input").
std::vector<std::string> words_after(const std::string& text, const std::string& label) {
  std::vector<std::string> w;
  const size_t at = text.find(label);
  if (at == std::string::npos) return w;
  std::istringstream ls(text.substr(at + label.size(), text.find('\n', at) - at - label.size()));
  for (std::string x; ls >> x && x[0] != '(';) w.push_back(x);
  return w;
}

TEST_F(Cli, TrainSavesResumesAndDrawsTheCheckpointsAttention) {
  const std::string cfg =
      "train --task reverse --length 3 --symbols 4 --layers 2 --dim 8 --heads 2 --batch 4 --warmup 2 --eval-examples 8 "
      "--log-every 1 --seed 5 --steps 6";
  // Three steps of six, checkpointed; then the other three from the checkpoint.
  Result r = run(cfg + " --stop-at 3 --save c.safetensors --csv a.csv --png a.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "step      3/3")) << r.out;
  EXPECT_TRUE(contains(r.out, "steps 0..3")) << r.out;
  EXPECT_TRUE(contains(r.out, "held-out (8 examples)")) << r.out;
  EXPECT_FALSE(contains(r.out, "\r")) << "no progress bar when stdout is not a terminal";
  const auto first = curve_rows(slurp(path("a.csv")));
  ASSERT_EQ(first.size(), 3u);
  EXPECT_EQ(first[0].first, 0);
  EXPECT_EQ(first[2].first, 2);
  for (const auto& [step, loss] : first) EXPECT_TRUE(std::isfinite(loss) && loss > 0) << step;
  EXPECT_EQ(slurp(path("a.png")).substr(1, 3), "PNG");
  ASSERT_TRUE(fs::exists(path("c.safetensors")));

  r = run(cfg + " --resume c.safetensors --csv b.csv");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "steps 3..6")) << r.out;
  const auto resumed = curve_rows(slurp(path("b.csv")));
  ASSERT_EQ(resumed.size(), 3u);
  // An uninterrupted run of the same flags gives the same losses at steps 3..5.
  r = run(cfg + " --csv full.csv");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto full = curve_rows(slurp(path("full.csv")));
  ASSERT_EQ(full.size(), 6u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed[i].first, full[3 + i].first);
    EXPECT_NEAR(resumed[i].second, full[3 + i].second, 1e-6 * full[3 + i].second) << "step " << full[3 + i].first;
    EXPECT_NEAR(first[i].second, full[i].second, 1e-6 * full[i].second) << "step " << i;
  }

  // The checkpoint's attention on example 2: 2 layers x 2 heads of 7 x 7.
  r = run("heatmap --checkpoint c.safetensors --task reverse --example 2 --out h.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "reverse example 2")) << r.out;
  EXPECT_TRUE(contains(r.err, "2 layer(s) x 2 head(s) of 7 x 7")) << r.err;
  const auto in = words_after(r.out, "input"), want = words_after(r.out, "target"),
             got = words_after(r.out, "predicted");
  ASSERT_EQ(in.size(), 7u) << r.out;  // x1 x2 x3 : _ _ _
  EXPECT_EQ(in[3], ":");
  ASSERT_EQ(want.size(), 3u) << r.out;
  EXPECT_EQ(got.size(), 3u) << r.out;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(want[i], in[2 - i]) << "the target of reverse is the input backwards";
    EXPECT_EQ(in[4 + i], "_");
  }
  const std::string png = slurp(path("h.png"));
  const auto [w, h] = png_size(png);
  // Default task and a different example: same model, a different picture.
  r = run("heatmap --checkpoint c.safetensors --example 0 --out h0.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(slurp(path("h0.png")), png);
  // Two rows of panels (one per layer) are taller than a one-layer picture.
  r = run("train --task reverse --length 3 --symbols 4 --layers 1 --dim 8 --heads 2 --batch 2 --steps 1 "
          "--eval-examples 2 --save one.safetensors");
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("heatmap --checkpoint one.safetensors --example 2 --out h1.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto [w1, h1] = png_size(slurp(path("h1.png")));
  EXPECT_EQ(w1, w) << "same width: two heads side by side";
  EXPECT_GT(h, h1);
  EXPECT_GT(w, 200u);
}

// recall defaults to one query and a curriculum from 3 pairs; the flags override both.
TEST_F(Cli, TrainRecallDefaultsToSingleQueryWithACurriculum) {
  const std::string cfg =
      "train --task recall --length 5 --symbols 6 --layers 1 --dim 8 --heads 2 --batch 4 --eval-examples 8 "
      "--log-every 1 --stop-at 2";
  Result r = run(cfg + " --save d.safetensors");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "len 3")) << r.out;
  r = run("heatmap --checkpoint d.safetensors --example 0 --out d.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_EQ(words_after(r.out, "input").size(), 12u) << r.out;  // k v x 5, ':', one query
  EXPECT_EQ(words_after(r.out, "target").size(), 1u) << r.out;
  r = run(cfg + " --queries 0 --curriculum 0 --save m.safetensors");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_FALSE(contains(r.out, "len ")) << r.out;
  r = run("heatmap --checkpoint m.safetensors --example 0 --out m.png");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_EQ(words_after(r.out, "target").size(), 5u) << r.out;  // every key asked
}

// The variant flags reach the model: ALiBi positions, a window and sinks
// train, the sinks are printed, the checkpoint keeps them (a resume with
// other variants is refused) and the heatmap of its attention is drawn.
TEST_F(Cli, TrainWithAlibiWindowAndSinks) {
  const std::string cfg =
      "train --task reverse --length 3 --symbols 4 --layers 2 --dim 8 --heads 2 --batch 4 --warmup 2 --eval-examples 8 "
      "--log-every 1 --seed 5 --steps 4 --positions alibi --window 2,-1 --sinks";
  Result r = run(cfg + " --save v.safetensors");
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "learned sinks, layer 0: ")) << r.out;
  EXPECT_TRUE(contains(r.out, "learned sinks, layer 1: ")) << r.out;
  EXPECT_EQ(words_after(r.out, "learned sinks, layer 1:").size(), 2u) << r.out;  // one per head
  r = run("train --task reverse --length 3 --symbols 4 --layers 2 --dim 8 --heads 2 --batch 4 --warmup 2 "
          "--eval-examples 8 --seed 5 --steps 8 --positions alibi --sinks --resume v.safetensors");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_TRUE(contains(r.err, "different model")) << r.err;
  r = run("heatmap --checkpoint v.safetensors --out h.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(slurp(path("h.png")).substr(1, 3), "PNG");
  EXPECT_EQ(run(cfg + " --window 1").rc, 2);  // LEFT,RIGHT: two values
}

// Trains a small reverse model on examples of `length` items for `steps`
// steps with `flag`, with 1 and 2 threads (the first run also writes
// `save`), and without it: the curve and the held-out result are the same
// for both thread counts, and the first step's loss differs from the run
// without the flag. Returns the stored configuration.
std::string expect_threads_agree_and_flag_acts(const Cli& t, int length, size_t steps, const std::string& flag,
                                               const std::string& save) {
  const std::string cfg = "train --task reverse --length " + std::to_string(length) +
                          " --symbols 4 --layers 2 --dim 8 --heads 2 --batch 4 --warmup 2 --eval-examples 8 "
                          "--log-every 1 --seed 5 --steps " + std::to_string(steps);
  Result r = t.run(cfg + " " + flag + " --csv one.csv --save " + save, "OMP_NUM_THREADS=1");
  EXPECT_EQ(r.rc, 0) << r.err << r.out;
  auto held_out = [](const std::string& out) {
    const size_t at = out.find("held-out (");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  const std::string one_thread = held_out(r.out);
  r = t.run(cfg + " " + flag + " --csv two.csv", "OMP_NUM_THREADS=2");
  EXPECT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_FALSE(one_thread.empty()) << r.out;
  EXPECT_EQ(held_out(r.out), one_thread);
  EXPECT_EQ(t.run(cfg + " --csv plain.csv").rc, 0);
  const auto one = curve_rows(slurp(t.path("one.csv"))), two = curve_rows(slurp(t.path("two.csv"))),
             plain = curve_rows(slurp(t.path("plain.csv")));
  EXPECT_EQ(one.size(), steps);
  EXPECT_EQ(one, two);
  if (!one.empty() && !plain.empty()) {
    EXPECT_NE(one[0].second, plain[0].second);
  }
  attn::io::Metadata meta;
  attn::io::read_safetensors<float>(t.path(save), {}, &meta);
  return meta.at("config");
}

// --dropout reaches the training steps: the first step's loss differs from a
// run without it, the curve and the held-out result are the same with 1 and 2
// threads, the checkpoint keeps the probability, and the checkpoint's
// heatmap (inference) is drawn.
TEST_F(Cli, TrainWithDropout) {
  const std::string config = expect_threads_agree_and_flag_acts(*this, 3, 5, "--dropout 0.1", "d.safetensors");
  EXPECT_TRUE(contains(config, "\"dropout\":0.1")) << config;
  const Result r = run("heatmap --checkpoint d.safetensors --out h.png");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(slurp(path("h.png")).substr(1, 3), "PNG");
}

// --precision bf16 reaches the training steps (examples of 16 items: 33
// tokens, more query rows than the exact decode kernel takes): the first
// step's loss differs from fp32's, the curve and the held-out result are the
// same with 1 and 2 threads, and the checkpoint keeps the precision.
TEST_F(Cli, TrainWithBf16Precision) {
  const std::string config = expect_threads_agree_and_flag_acts(*this, 16, 4, "--precision bf16", "p.safetensors");
  EXPECT_TRUE(contains(config, "\"precision\":\"bf16\"")) << config;
}

}  // namespace
}  // namespace attn_cli_test
