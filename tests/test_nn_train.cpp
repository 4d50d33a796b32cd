// Tasks, checkpoints and the training loop: a tiny run must learn, runs are
// bit-for-bit reproducible, a resumed run continues the same curve, and a
// checkpoint file (read back through attn::io) holds exactly the model and
// optimizer state. The safetensors format itself is tested in test_io.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "attn/io.hpp"
#include "attn/nn.hpp"
#include "testing.hpp"

namespace {

using attn::Tensor;
namespace nn = attn::nn;
namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("attn_nn_" + std::to_string(::getpid()) + "_" + name)).string();
}

TEST(NnTasks, SequencesFollowTheirDefinitions) {
  nn::Rng rng(1);
  for (auto kind : {nn::TaskKind::copy, nn::TaskKind::reverse, nn::TaskKind::sort}) {
    nn::Task task({kind, 5, 7});
    const auto b = task.sample(20, rng);
    ASSERT_EQ(b.N, 11);
    for (int64_t s = 0; s < b.B; ++s) {
      const int32_t* t = b.tokens.data() + s * b.N;
      const int32_t* y = b.targets.data() + s * b.N;
      std::vector<int32_t> x(t, t + 5), want = x;
      if (kind == nn::TaskKind::reverse) std::reverse(want.begin(), want.end());
      if (kind == nn::TaskKind::sort) std::sort(want.begin(), want.end());
      EXPECT_EQ(t[5], 0);  // separator
      for (int i = 0; i < 5; ++i) {
        EXPECT_GE(x[size_t(i)], 2);
        EXPECT_LT(x[size_t(i)], 9);
        EXPECT_EQ(y[i], -1);
        EXPECT_EQ(t[6 + i], 1);  // answer slot
        EXPECT_EQ(y[6 + i], want[size_t(i)]);
      }
    }
  }
  for (int64_t m : {1, 3, 0}) {  // single query, three, one per key (0)
    nn::Task recall({nn::TaskKind::recall, 4, 6, m});
    const int64_t queries = m == 0 ? 4 : m;
    EXPECT_EQ(recall.vocab_size(), 8);
    const auto b = recall.sample(50, rng);
    ASSERT_EQ(b.N, 9 + queries);
    for (int64_t s = 0; s < b.B; ++s) {
      const int32_t* t = b.tokens.data() + s * b.N;
      const int32_t* y = b.targets.data() + s * b.N;
      std::set<int32_t> keys, asked;
      for (int i = 0; i < 4; ++i) keys.insert(t[2 * i]);
      EXPECT_EQ(keys.size(), 4u);  // distinct keys
      EXPECT_EQ(t[8], 0);
      for (int i = 0; i < 9; ++i) EXPECT_EQ(y[i], -1);
      for (int64_t j = 0; j < queries; ++j) {
        const int32_t q = t[9 + j];
        asked.insert(q);
        int found = 0;
        for (int i = 0; i < 4; ++i)
          if (t[2 * i] == q) {
            ++found;
            EXPECT_EQ(y[9 + j], t[2 * i + 1]);
          }
        EXPECT_EQ(found, 1);
      }
      EXPECT_EQ(int64_t(asked.size()), queries);  // distinct queries
    }
  }
  EXPECT_TRUE(attn::testing::throws_with([] { nn::Task t({nn::TaskKind::recall, 9, 8}); }, {"distinct keys", "length (9)"}));
  EXPECT_TRUE(attn::testing::throws_with([] { nn::parse_task("shuffle"); }, {"unknown task 'shuffle'"}));
}

// A tiny configuration that learns `reverse` of 4 symbols in a few seconds.
nn::TrainConfig tiny_config() {
  nn::TrainConfig c;
  c.task = {nn::TaskKind::reverse, 4, 6};
  c.layers = 2;
  c.dim = 32;
  c.heads = 2;
  c.positions = nn::Positions::sinusoidal;
  c.steps = 150;
  c.warmup = 20;
  c.batch = 16;
  c.lr = 3e-3;
  c.eval_examples = 256;
  c.seed = 7;
  return c;
}

TEST(NnTrain, TinyRunLearnsReverse) {
  nn::TrainConfig c = tiny_config();
  const std::string csv = temp_path("curve.csv");
  c.csv_path = csv;
  int calls = 0;
  const auto res = nn::train(c, [&](const nn::TrainRecord&) { ++calls; });
  ASSERT_EQ(res.curve.size(), 150u);
  EXPECT_GT(calls, 0);
  // untrained: loss ≈ ln(8) = 2.08 and token accuracy ≈ 1/6 (a uniform guess
  // over the symbols); a model that cannot see positions stays near 1/6 too.
  EXPECT_GT(res.curve.front().loss, 1.5);
  EXPECT_LT(res.final_eval.loss, 0.3);
  EXPECT_GT(res.final_eval.token_acc, 0.95);
  EXPECT_GT(res.final_eval.seq_acc, 0.8);
  // the CSV has a header and one row per step
  std::ifstream in(csv);
  std::string line;
  int rows = 0;
  std::getline(in, line);
  EXPECT_EQ(line.rfind("step,lr,loss,token_acc", 0), 0u);
  while (std::getline(in, line)) ++rows;
  EXPECT_EQ(rows, 150);
  fs::remove(csv);
}

// Each attention variant trains: ALiBi as the only positions, a window, and
// learnable sinks; the loss falls well below its start (ln 6 ≈ 1.8 for a
// uniform guess). A window too narrow for reverse is no better than chance on
// the slots it cuts off, while a window wide enough learns the task.
TEST(NnTrain, VariantsTrain) {
  auto run = [](const char* what, auto edit) {
    nn::TrainConfig c = tiny_config();
    edit(c);
    const auto res = nn::train(c);
    EXPECT_GT(res.curve.front().loss, 1.5) << what;
    return res;
  };
  // A model without positions sees every answer slot alike and fills them all
  // with one symbol (exact-sequence accuracy near 0); ALiBi alone is enough
  // to tell them apart (8 heads: slopes 1/2 .. 1/256).
  const auto alibi = run("alibi", [](nn::TrainConfig& c) {
    c.positions = nn::Positions::alibi;
    c.dim = 64, c.heads = 8, c.batch = 32, c.steps = 500;
  });
  EXPECT_LT(alibi.final_eval.loss, 0.5);
  EXPECT_GT(alibi.final_eval.seq_acc, 0.3);
  const auto sinks = run("sinks", [](nn::TrainConfig& c) { c.sinks = true; });
  EXPECT_LT(sinks.final_eval.loss, 0.3);
  ASSERT_EQ(sinks.sinks.size(), 2u);  // one per layer, H values each
  double moved = 0;
  for (const auto& layer : sinks.sinks) {
    ASSERT_EQ(layer.size(), 2u);
    for (double v : layer) {
      EXPECT_TRUE(std::isfinite(v));
      moved = std::max(moved, std::abs(v));
    }
  }
  EXPECT_GT(moved, 1e-3);  // they start at 0 and are trained
  // reverse of 4 items: answer slot 5 + i reads item 3 - i, 2i + 2 positions
  // back; two layers of window 1 reach 2 positions, so slots i >= 1 can only guess.
  const auto narrow = run("narrow window", [](nn::TrainConfig& c) { c.window = {1, 1}; });
  const auto wide = run("wide window", [](nn::TrainConfig& c) { c.window = {8, 8}; });
  EXPECT_LT(narrow.final_eval.token_acc, 0.6);
  EXPECT_GT(wide.final_eval.token_acc, 0.95);
  EXPECT_LT(wide.final_eval.loss, 0.5 * narrow.final_eval.loss);
}

// The variants are part of the model a checkpoint describes: they are stored,
// read back, and a resumed run must use the same ones.
TEST(NnTrain, CheckpointKeepsTheVariants) {
  nn::TrainConfig c = tiny_config();
  c.steps = 4;
  c.window = {3, -1};
  c.sinks = true;
  c.positions = nn::Positions::alibi;
  const std::string path = temp_path("variants.safetensors");
  c.save_path = path;
  nn::train(c);
  const nn::TrainConfig back = nn::checkpoint_config(path);
  EXPECT_EQ(back.window.left, 3);
  EXPECT_EQ(back.window.right, -1);
  EXPECT_TRUE(back.sinks);
  EXPECT_EQ(back.positions, nn::Positions::alibi);
  nn::TrainConfig other = c;
  other.save_path.clear();
  other.resume_path = path;
  other.steps = 8;
  other.sinks = false;
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::train(other); }, {"different model"}));
  other.sinks = true;
  other.window = {3, -1};
  EXPECT_EQ(nn::train(other).start_step, 4);
  fs::remove(path);
}

// Two runs with the same curve, bit for bit: loss and gradient norm at every
// step, and the held-out loss.
void expect_same_run(const nn::TrainResult& a, const nn::TrainResult& b) {
  ASSERT_EQ(a.curve.size(), b.curve.size());
  for (size_t i = 0; i < a.curve.size(); ++i) {
    EXPECT_EQ(a.curve[i].loss, b.curve[i].loss) << "step " << i;
    EXPECT_EQ(a.curve[i].grad_norm, b.curve[i].grad_norm) << "step " << i;
  }
  EXPECT_EQ(a.final_eval.loss, b.final_eval.loss);
}

TEST(NnTrain, SameSeedSameCurveBitForBit) {
  nn::TrainConfig c = tiny_config();
  c.steps = 12;
  const auto a = nn::train(c), b = nn::train(c);
  c.seed = 8;
  const auto other = nn::train(c);
  expect_same_run(a, b);
  EXPECT_NE(a.curve[5].loss, other.curve[5].loss);
}

TEST(NnTrain, ResumeContinuesTheSameCurve) {
  for (const char* optimizer : {"adamw", "sgd"}) {
    nn::TrainConfig c = tiny_config();
    c.optimizer = optimizer;
    c.steps = 16;
    c.warmup = 4;
    const std::string full_ckpt = temp_path("full.safetensors"), half_ckpt = temp_path("half.safetensors");
    c.save_path = full_ckpt;
    const auto full = nn::train(c);
    c.stop_at = 8;
    c.save_path = half_ckpt;
    const auto first = nn::train(c);
    ASSERT_EQ(first.curve.size(), 8u);
    c.stop_at = 0;
    c.resume_path = half_ckpt;
    c.save_path = "";
    const auto second = nn::train(c);
    ASSERT_EQ(second.start_step, 8);
    ASSERT_EQ(second.curve.size(), 8u);
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_EQ(first.curve[i].loss, full.curve[i].loss) << optimizer << " step " << i;
      EXPECT_EQ(second.curve[i].step, int64_t(8 + i));
      EXPECT_EQ(second.curve[i].loss, full.curve[8 + i].loss) << optimizer << " step " << 8 + i;
    }
    EXPECT_EQ(second.final_eval.loss, full.final_eval.loss) << optimizer;
    // the stored configuration comes back
    const auto stored = nn::checkpoint_config(half_ckpt);
    EXPECT_EQ(stored.dim, 32);
    EXPECT_EQ(stored.task.kind, nn::TaskKind::reverse);
    EXPECT_EQ(stored.optimizer, optimizer);
    // resuming into a different model is refused
    c.dim = 16;
    EXPECT_TRUE(attn::testing::throws_with([&] { nn::train(c); }, {"different model", half_ckpt}));
    fs::remove(full_ckpt);
    fs::remove(half_ckpt);
  }
}

// One optimizer step on a batch, so that parameters and state are not at their
// initial values.
void take_one_step(nn::Transformer<float>& model, nn::Optimizer<float>& opt, const nn::TrainConfig& c) {
  nn::Task task(c.task);
  nn::Rng rng(5);
  const auto batch = task.sample(4, rng);
  Tensor<float> logits, dlogits;
  model.zero_grad();
  model.forward(batch.tokens.data(), batch.B, batch.N, logits);
  nn::softmax_cross_entropy<float>(logits, batch.targets.data(), &dlogits);
  model.backward(dlogits);
  opt.step(1e-2);
}

std::vector<double> values(const Tensor<float>& t) { return std::vector<double>(t.data(), t.data() + t.size()); }

// The file as attn::io reads it: every parameter and optimizer state tensor
// under its name with its exact values, and the run's metadata; an F64 copy
// loads back; a mismatching file is refused naming the path, tensor and shapes.
TEST(NnTrain, CheckpointFileHoldsModelStateAndMetadata) {
  for (const std::string optimizer : {"adamw", "sgd"}) {
    nn::TrainConfig c = tiny_config();
    c.optimizer = optimizer;
    const nn::ModelConfig mc = nn::model_config(c);
    nn::Transformer<float> model(mc, 1);
    auto make_optimizer = [&](std::vector<nn::ParamRef<float>> ps) -> std::unique_ptr<nn::Optimizer<float>> {
      if (optimizer == "adamw") return std::make_unique<nn::AdamW<float>>(std::move(ps), nn::AdamWConfig{});
      return std::make_unique<nn::Sgd<float>>(std::move(ps), nn::SgdConfig{});
    };
    auto params = model.parameters();
    const auto opt = make_optimizer(params);
    take_one_step(model, *opt, c);
    const std::string path = temp_path("state.safetensors"), path64 = temp_path("state64.safetensors");
    nn::save_training_checkpoint<float>(path, model, opt.get(), 7, c);

    attn::io::Metadata meta;
    const auto file = attn::io::read_safetensors<double>(path, {}, &meta);
    EXPECT_EQ(meta.size(), 4u);
    EXPECT_EQ(meta.at("format"), "attn.nn.checkpoint/1");
    EXPECT_EQ(meta.at("step"), "7");
    EXPECT_EQ(meta.at("optimizer_steps"), "1");
    const auto config = nlohmann::json::parse(meta.at("config"));
    EXPECT_EQ(config.at("task"), "reverse");
    EXPECT_EQ(config.at("dim"), 32);
    EXPECT_EQ(config.at("optimizer"), optimizer);
    size_t expected = 0, nonzero_state = 0;
    for (const auto& p : params) {
      const auto& a = file.at(p.name);
      EXPECT_EQ(a.stored, attn::io::DType::f32) << p.name;
      EXPECT_EQ(a.shape, p.value->shape()) << p.name;
      EXPECT_EQ(a.data, values(*p.value)) << p.name;
      ++expected;
    }
    std::map<std::string, Tensor<float>*> state;
    for (const auto& [name, t] : opt->state()) state[name] = t;
    for (const auto& p : params)
      for (const std::string& prefix : optimizer == "sgd" ? std::vector<std::string>{"sgd.momentum."}
                                                         : std::vector<std::string>{"adamw.m.", "adamw.v."}) {
        const std::string name = prefix + p.name;
        ASSERT_EQ(state.count(name), 1u) << name;
        const auto& a = file.at(name);
        EXPECT_EQ(a.shape, p.value->shape()) << name;
        EXPECT_EQ(a.data, values(*state[name])) << name;
        for (double v : a.data) nonzero_state += v != 0;
        ++expected;
      }
    EXPECT_EQ(state.size(), expected - params.size());
    EXPECT_EQ(file.size(), expected);
    EXPECT_GT(nonzero_state, 0u);

    // The same values stored as F64 load into a fresh float model and optimizer.
    attn::io::write_safetensors(path64, file, meta);
    EXPECT_EQ(attn::io::read_safetensors<float>(path64).at(params[0].name).stored, attn::io::DType::f64);
    nn::Transformer<float> other(mc, 2);
    auto other_params = other.parameters();
    const auto other_opt = make_optimizer(other_params);
    EXPECT_EQ(nn::load_training_checkpoint<float>(path64, other, other_opt.get()), 7);
    EXPECT_EQ(other_opt->steps_taken, 1);
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_EQ(values(*other_params[i].value), values(*params[i].value)) << params[i].name;
    for (const auto& [name, t] : other_opt->state()) EXPECT_EQ(values(*t), values(*state.at(name))) << name;

    // A tensor of another shape (the last matrix, so others load before it is
    // reached): the error names the file, the tensor and both shapes, and the
    // model is left untouched.
    auto wrong = file;
    std::string matrix;
    for (const auto& p : params)
      if (p.value->shape().size() == 2) matrix = p.name;
    const auto shape = file.at(matrix).shape;
    ASSERT_NE(shape[0], shape[1]) << matrix;
    wrong.at(matrix).shape = {shape[1], shape[0]};
    attn::io::write_safetensors(path64, wrong, meta);
    const std::string want = "has shape " + attn::shape_str({shape[1], shape[0]}) + ", the model expects " +
                             attn::shape_str(shape);
    nn::Transformer<float> fresh(mc, 3);
    const auto before = values(*fresh.parameters()[0].value);
    EXPECT_TRUE(attn::testing::throws_with([&] { nn::load_training_checkpoint<float>(path64, fresh, nullptr); },
                                           {path64, "tensor '" + matrix + "'", want}));
    EXPECT_EQ(values(*fresh.parameters()[0].value), before);
    EXPECT_NE(before, values(*params[0].value));
    // Metadata that is missing or not a count.
    auto bad = meta;
    bad.erase("format");
    attn::io::write_safetensors(path64, file, bad);
    EXPECT_TRUE(attn::testing::throws_with([&] { nn::load_training_checkpoint<float>(path64, other, nullptr); },
                                           {path64, "metadata lacks 'format'"}));
    bad = meta;
    bad["step"] = "7x";
    attn::io::write_safetensors(path64, file, bad);
    EXPECT_TRUE(attn::testing::throws_with([&] { nn::load_training_checkpoint<float>(path64, other, nullptr); },
                                           {path64, "metadata 'step' is '7x'", "non-negative integer"}));
    bad = meta;
    bad["config"] = "{\"task\": 3}";
    attn::io::write_safetensors(path64, file, bad);
    EXPECT_TRUE(attn::testing::throws_with([&] { nn::checkpoint_config(path64); },
                                           {path64, "config 'task' is 3, expected a string"}));
    bad["config"] = "{\"task\": ";
    attn::io::write_safetensors(path64, file, bad);
    EXPECT_TRUE(attn::testing::throws_with([&] { nn::checkpoint_config(path64); }, {path64, "malformed config"}));
    fs::remove(path);
    fs::remove(path64);
  }
}

TEST(NnTrain, CheckpointRestoresTheModelExactly) {
  nn::TrainConfig c = tiny_config();
  const nn::ModelConfig mc = nn::model_config(c);
  nn::Transformer<float> a(mc, 1), b(mc, 2);
  const std::string path = temp_path("model.safetensors");
  nn::save_training_checkpoint<float>(path, a, nullptr, 0, c);
  EXPECT_EQ(nn::load_training_checkpoint<float>(path, b, nullptr), 0);
  nn::Task task(c.task);
  nn::Rng rng(3);
  const auto batch = task.sample(4, rng);
  Tensor<float> la, lb;
  a.forward(batch.tokens.data(), batch.B, batch.N, la);
  b.forward(batch.tokens.data(), batch.B, batch.N, lb);
  EXPECT_TRUE(attn::testing::all_close(lb, la, 0.0, "logits"));
  // a checkpoint without optimizer state cannot resume an optimizer
  auto params = b.parameters();
  nn::AdamW<float> opt(params, {});
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::load_training_checkpoint<float>(path, b, &opt); },
                                         {"adamw.m.embed.weight"}));
  fs::remove(path);
}

TEST(NnTrain, CurriculumLengthensOnRunningAccuracy) {
  nn::TrainConfig c;
  c.task = {nn::TaskKind::recall, 5, 8, 1};
  c.curriculum = 2;
  nn::Curriculum cur(c);
  EXPECT_EQ(cur.length(), 2);
  EXPECT_EQ(cur.task().length, 2);
  EXPECT_EQ(cur.task().queries, 1);
  // below the threshold it never moves: the running accuracy tends to 0.85
  for (int i = 0; i < 200; ++i) EXPECT_FALSE(cur.record(0.85));
  EXPECT_EQ(cur.length(), 2);
  EXPECT_NEAR(cur.running_accuracy(), 0.85, 1e-6);
  // at 100% it reaches 0.9 after k steps from 0, 1 - 0.9^k >= 0.9: k = 22
  cur.restore(2, 0.0);
  for (int64_t len = 2; len < 5; ++len) {
    for (int i = 1; i < 22; ++i) ASSERT_FALSE(cur.record(1.0)) << "length " << len << " record " << i;
    EXPECT_TRUE(cur.record(1.0));
    EXPECT_EQ(cur.length(), len + 1);
    EXPECT_EQ(cur.running_accuracy(), 0.0);
  }
  EXPECT_TRUE(cur.done());
  EXPECT_FALSE(cur.record(1.0));
  EXPECT_EQ(cur.task().length, 5);
  // the multi-query form asks every key of the shorter example
  c.task.queries = 0;
  EXPECT_EQ(nn::Task(nn::Curriculum(c).task()).seq_len(), 2 * 2 + 1 + 2);
  c.task.queries = 4;
  EXPECT_EQ(nn::Curriculum(c).task().queries, 2);
  // off: the full length from the start
  c.curriculum = 0;
  EXPECT_TRUE(nn::Curriculum(c).done());
  c.curriculum = 6;  // starting at or past the full length: no curriculum
  EXPECT_NO_THROW(c.validate());
  EXPECT_TRUE(nn::Curriculum(c).done());
  EXPECT_EQ(nn::Curriculum(c).length(), 5);
  c.curriculum = -1;
  EXPECT_TRUE(attn::testing::throws_with([&] { c.validate(); }, {"curriculum is -1"}));
  c.curriculum = 2;
  c.curriculum_threshold = 0;
  EXPECT_TRUE(attn::testing::throws_with([&] { c.validate(); }, {"curriculum_threshold"}));
}

TEST(NnTrain, DefaultConfigPerTask) {
  // recall: the single-query task with a curriculum from 3 pairs over 4000 steps
  const nn::TrainConfig r = nn::default_config(nn::TaskKind::recall), plain;
  EXPECT_EQ(r.task.kind, nn::TaskKind::recall);
  EXPECT_EQ(r.task.queries, 1);
  EXPECT_EQ(r.curriculum, 3);
  EXPECT_EQ(r.steps, 4000);
  EXPECT_EQ(r.task.length, plain.task.length);
  EXPECT_EQ(r.lr, plain.lr);
  EXPECT_EQ(r.batch, plain.batch);
  // the other tasks: the member defaults
  for (auto kind : {nn::TaskKind::copy, nn::TaskKind::reverse, nn::TaskKind::sort}) {
    const nn::TrainConfig d = nn::default_config(kind);
    EXPECT_EQ(d.task.kind, kind);
    EXPECT_EQ(d.task.queries, plain.task.queries);
    EXPECT_EQ(d.curriculum, 0);
    EXPECT_EQ(d.steps, plain.steps);
  }
}

// A curriculum run trains on short examples first, evaluates on full-length
// ones, and resumes mid-curriculum onto the same curve.
TEST(NnTrain, CurriculumRunsAndResumes) {
  nn::TrainConfig c = tiny_config();
  c.task.length = 4;
  c.positions = nn::Positions::rope;  // offsets mean the same at every length
  c.curriculum = 2;
  c.curriculum_threshold = 0.8;
  c.steps = 200;
  const auto res = nn::train(c);
  ASSERT_EQ(res.curve.size(), 200u);
  EXPECT_EQ(res.curve.front().length, 2);
  std::string moves;
  for (size_t i = 1; i < res.curve.size(); ++i)
    if (res.curve[i].length != res.curve[i - 1].length) moves += " " + std::to_string(i);
  EXPECT_EQ(res.curve.back().length, 4) << "lengthened at steps" << moves;  // reverse of 2, 3 is learnt in the run
  for (size_t i = 1; i < res.curve.size(); ++i) {
    EXPECT_GE(res.curve[i].length, res.curve[i - 1].length);
    EXPECT_LE(res.curve[i].length, res.curve[i - 1].length + 1);
  }
  // the held-out set is the full task, whatever length training reached
  const std::string ckpt = temp_path("curriculum.safetensors");
  c.steps = 30;
  c.save_path = ckpt;
  c.curriculum_threshold = 1.0;  // not reached by a running average started at 0 within 30 steps
  const auto early = nn::train(c);
  c.curriculum_threshold = 0.8;
  EXPECT_EQ(early.curve.back().length, 2);
  nn::Transformer<float> model(nn::model_config(c), 0);
  nn::load_training_checkpoint<float>(ckpt, model, nullptr);
  const auto on_full = nn::evaluate(model, nn::Task(c.task), c.eval_examples, c.seed);
  nn::TaskConfig short_task = c.task;
  short_task.length = 2;
  const auto on_short = nn::evaluate(model, nn::Task(short_task), c.eval_examples, c.seed);
  EXPECT_EQ(early.final_eval.loss, on_full.loss);
  EXPECT_NE(early.final_eval.loss, on_short.loss);
  // resuming in the middle of a length continues the same curve: stop a few
  // steps before the first lengthening of the 200-step run above, resume, and
  // the rest must be that run's steps exactly (the curriculum moves inside it)
  size_t first_move = 0;
  for (size_t i = 1; i < res.curve.size() && first_move == 0; ++i)
    if (res.curve[i].length != res.curve[i - 1].length) first_move = i;
  ASSERT_GT(first_move, 5u) << "the curriculum never moved (or at once)";
  const size_t stop = first_move - 5;
  c.steps = 200;
  c.stop_at = int64_t(stop);
  c.save_path = ckpt;
  nn::train(c);
  c.stop_at = 0;
  c.save_path = "";
  c.resume_path = ckpt;
  const auto rest = nn::train(c);
  ASSERT_EQ(rest.curve.size(), 200u - stop);
  for (size_t i = 0; i < rest.curve.size(); ++i) {
    EXPECT_EQ(rest.curve[i].length, res.curve[stop + i].length) << "step " << stop + i;
    EXPECT_EQ(rest.curve[i].loss, res.curve[stop + i].loss) << "step " << stop + i;
  }
  fs::remove(ckpt);
}

// Attention dropout in training steps: it changes the steps (the first step's
// loss, from the same initialisation and batch, differs from the run without
// it), a run is still the same bit for bit and resumes onto the same curve
// (step k's masks come from (seed, k)), a tiny run still learns, and the
// checkpoint keeps the probability (one written before the field existed
// reads as 0).
TEST(NnTrain, DropoutTrainsReproduciblyAndIsStored) {
  nn::TrainConfig c = tiny_config();
  c.steps = 16;
  c.warmup = 4;
  c.dropout = 0.2;
  const std::string full_ckpt = temp_path("drop_full.safetensors"), half_ckpt = temp_path("drop_half.safetensors");
  c.save_path = full_ckpt;
  const auto a = nn::train(c);
  c.save_path.clear();
  const auto b = nn::train(c);
  nn::TrainConfig plain = c;
  plain.dropout = 0;
  const auto p = nn::train(plain);
  expect_same_run(a, b);
  EXPECT_NE(a.curve[0].loss, p.curve[0].loss);
  EXPECT_NE(a.curve[0].grad_norm, p.curve[0].grad_norm);
  // the held-out evaluation drops nothing: the model the checkpoint holds
  // scores exactly the run's final evaluation in a model built without dropout
  nn::Transformer<float> model(nn::model_config(plain));
  nn::load_training_checkpoint<float>(full_ckpt, model, nullptr);
  const auto ev = nn::evaluate(model, nn::Task(c.task), c.eval_examples, c.seed);
  EXPECT_EQ(ev.loss, a.final_eval.loss);
  EXPECT_EQ(ev.token_acc, a.final_eval.token_acc);
  // the checkpoint keeps the probability; a resumed run continues the curve
  EXPECT_EQ(nn::checkpoint_config(full_ckpt).dropout, 0.2);
  c.stop_at = 8;
  c.save_path = half_ckpt;
  nn::train(c);
  c.stop_at = 0;
  c.save_path.clear();
  c.resume_path = half_ckpt;
  const auto rest = nn::train(c);
  ASSERT_EQ(rest.curve.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(rest.curve[i].loss, a.curve[8 + i].loss) << "step " << 8 + i;
  EXPECT_EQ(rest.final_eval.loss, a.final_eval.loss);
  // a checkpoint whose config has no "dropout" (written before it existed)
  attn::io::Metadata meta;
  const auto file = attn::io::read_safetensors<float>(half_ckpt, {}, &meta);
  auto config = nlohmann::json::parse(meta.at("config"));
  ASSERT_EQ(config.at("dropout"), 0.2);
  config.erase("dropout");
  meta["config"] = config.dump();
  attn::io::write_safetensors(half_ckpt, file, meta);
  EXPECT_EQ(nn::checkpoint_config(half_ckpt).dropout, 0.0);
  config["dropout"] = 1.0;
  meta["config"] = config.dump();
  attn::io::write_safetensors(half_ckpt, file, meta);
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::checkpoint_config(half_ckpt); }, {half_ckpt, "dropout is 1"}));
  fs::remove(full_ckpt);
  fs::remove(half_ckpt);
  // a tiny run with dropout still learns reverse
  nn::TrainConfig learn = tiny_config();
  learn.dropout = 0.1;
  const auto res = nn::train(learn);
  EXPECT_GT(res.final_eval.token_acc, 0.95);
}

// Mixed precision (TrainConfig::precision bf16): the attention's products in
// bfloat16, the weights and optimizer state float32. Examples of 16 items
// (33 tokens: calls with at most 32 query rows take the exact decode kernel).
// It changes the steps (the first step's loss differs from float32's), a run
// is the same bit for bit, the held-out evaluation of the stored model in a
// bf16 model is the run's own, the checkpoint keeps the precision (one
// written before the field existed reads as fp32), and a small run learns.
TEST(NnTrain, Bf16PrecisionTrainsReproduciblyAndIsStored) {
  nn::TrainConfig c = tiny_config();
  c.task.length = 16;
  c.steps = 6;
  c.warmup = 2;
  c.eval_examples = 64;
  c.precision = nn::Precision::bf16;
  const std::string ckpt = temp_path("bf16.safetensors");
  c.save_path = ckpt;
  const auto a = nn::train(c);
  c.save_path.clear();
  const auto b = nn::train(c);
  nn::TrainConfig plain = c;
  plain.precision = nn::Precision::fp32;
  const auto p = nn::train(plain);
  expect_same_run(a, b);
  EXPECT_NE(a.curve[0].loss, p.curve[0].loss);
  EXPECT_NE(a.final_eval.loss, p.final_eval.loss);
  EXPECT_EQ(nn::checkpoint_config(ckpt).precision, nn::Precision::bf16);
  nn::Transformer<float> model(nn::model_config(nn::checkpoint_config(ckpt)));
  nn::load_training_checkpoint<float>(ckpt, model, nullptr);
  const auto ev = nn::evaluate(model, nn::Task(c.task), c.eval_examples, c.seed);
  EXPECT_EQ(ev.loss, a.final_eval.loss);
  // a checkpoint whose config has no "precision" (written before it existed)
  attn::io::Metadata meta;
  const auto file = attn::io::read_safetensors<float>(ckpt, {}, &meta);
  auto config = nlohmann::json::parse(meta.at("config"));
  ASSERT_EQ(config.at("precision"), "bf16");
  config.erase("precision");
  meta["config"] = config.dump();
  attn::io::write_safetensors(ckpt, file, meta);
  EXPECT_EQ(nn::checkpoint_config(ckpt).precision, nn::Precision::fp32);
  config["precision"] = "fp16";
  meta["config"] = config.dump();
  attn::io::write_safetensors(ckpt, file, meta);
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::checkpoint_config(ckpt); }, {"precision", "'fp16'"}));
  fs::remove(ckpt);
  // a small run in bf16 learns reverse on those 33-token sequences
  nn::TrainConfig learn = tiny_config();
  learn.task.length = 16;
  learn.steps = 400;
  learn.precision = nn::Precision::bf16;
  const auto res = nn::train(learn);
  EXPECT_GT(res.final_eval.token_acc, 0.95);
}

TEST(NnTrain, RejectsBadConfig) {
  nn::TrainConfig c = tiny_config();
  c.optimizer = "adam";
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::train(c); }, {"TrainConfig", "optimizer is 'adam'"}));
  c = tiny_config();
  c.batch = 0;
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::train(c); }, {"batch is 0"}));
  for (const double p : {-0.1, 1.0, std::nan("")}) {
    c = tiny_config();
    c.dropout = p;
    EXPECT_TRUE(attn::testing::throws_with([&] { nn::train(c); }, {"TrainConfig", "dropout is", "0 <= dropout < 1"}));
  }
  c = tiny_config();
  c.resume_path = temp_path("missing.safetensors");
  EXPECT_TRUE(attn::testing::throws_with([&] { nn::train(c); }, {"missing.safetensors", "cannot open"}));
}

}  // namespace
