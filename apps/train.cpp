// `attn train` (attn::nn::train with a command line) and the checkpoint mode
// of `attn heatmap`, which runs a trained model on one example and draws the
// attention of every head of every layer.
#include "train.hpp"

#include <algorithm>
#include <cstdio>
#include <cerrno>
#include <filesystem>
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "common.hpp"
#include "plot.hpp"

namespace attn::cli {

void require_file(const std::string& path, const char* flag) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw FileError(path, fmt::format("no such file (given as {})", flag), ENOENT);
}

namespace {

void plot_curve(const std::vector<nn::TrainRecord>& curve, const std::string& path) {
  Chart ch;
  ch.title = "training curve: loss and token accuracy by step";
  ch.xlabel = "step";
  ch.ylabel = "loss / accuracy";
  Series loss{"loss", {}, {}, {31, 119, 180}, false, false};
  Series acc{"token acc (batch)", {}, {}, {255, 127, 14}, false, false};
  Series held{"held-out token acc", {}, {}, {44, 160, 44}, true, true};
  for (const auto& r : curve) {
    loss.x.push_back(double(r.step + 1));
    loss.y.push_back(r.loss);
    acc.x.push_back(double(r.step + 1));
    acc.y.push_back(r.token_acc);
    if (r.eval_token_acc >= 0) {
      held.x.push_back(double(r.step + 1));
      held.y.push_back(r.eval_token_acc);
    }
  }
  ch.series = {loss, acc};
  if (!held.x.empty()) ch.series.push_back(held);
  draw_chart(ch, path);
}

}  // namespace

void add_train_flags(CLI::App& app, TrainOpts& o) {
  nn::TrainConfig& c = o.config;
  app.add_option("--task", o.task, "copy | reverse | sort | recall")
      ->check(CLI::IsMember({"copy", "reverse", "sort", "recall"}))
      ->capture_default_str();
  app.add_option("--length", c.task.length, "items per example (key-value pairs for recall)")->capture_default_str();
  app.add_option("--symbols", c.task.symbols, "alphabet size")->capture_default_str();
  // --queries, --steps and --curriculum default per task (nn::default_config)
  const nn::TrainConfig recall = nn::default_config(nn::TaskKind::recall);
  app.add_option_function<int64_t>(
         "--queries",
         [&o](const int64_t& v) {
           o.config.task.queries = v;
           o.queries_given = true;
         },
         "recall: queries per example (1 = the single-query task, the default; 0 = one per key)")
      ->default_str(std::to_string(recall.task.queries));
  app.add_option("--layers", c.layers, "transformer blocks")->capture_default_str();
  app.add_option("--dim", c.dim, "model width D")->capture_default_str();
  app.add_option("--heads", c.heads, "attention heads (must divide --dim)")->capture_default_str();
  app.add_option("--positions", o.positions,
                 "sinusoidal | learned | rope | alibi (no embedding: scores get -slope_h*|i-j|) | none")
      ->check(CLI::IsMember({"sinusoidal", "learned", "rope", "alibi", "none"}))
      ->capture_default_str();
  app.add_option("--chunk-size", o.chunk_size, "chunked attention: token i sees tokens of its own chunk of N positions (0 = off)")
      ->check(integer_value(0));
  app.add_option("--window", o.window, "sliding window LEFT,RIGHT: token i sees tokens i-LEFT..i+RIGHT, -1 = unbounded")
      ->delimiter(',')
      ->expected(2)
      ->check(integer_value());
  app.add_flag("--sinks", c.sinks, "a learnable attention sink logit per head (gpt-oss)");
  app.add_option("--scale", o.scale, "default (1/sqrt(d_k)) | none")
      ->check(CLI::IsMember({"default", "none"}))
      ->capture_default_str();
  app.add_flag("--causal", c.causal, "causal attention mask");
  app.add_option("--dropout", c.dropout,
                 "attention dropout probability in training steps, 0 <= P < 1 (held-out evaluation drops nothing)")
      ->check(probability_below_one())
      ->capture_default_str();
  app.add_option("--precision", o.precision,
                 "fp32 | bf16 (mixed precision: float32 weights and optimizer state, the attention's products in "
                 "bfloat16; the other matrix products stay float32)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--optimizer", c.optimizer, "adamw | sgd")->check(CLI::IsMember({"adamw", "sgd"}))->capture_default_str();
  app.add_option("--lr", c.lr, "peak learning rate")->capture_default_str();
  app.add_option("--min-lr", c.min_lr, "learning rate at the end of the cosine")->capture_default_str();
  app.add_option("--warmup", c.warmup, "linear warm-up steps")->capture_default_str();
  app.add_option_function<int64_t>(
         "--steps",
         [&o](const int64_t& v) {
           o.config.steps = v;
           o.steps_given = true;
         },
         "length of the schedule (default " + std::to_string(c.steps) + "; " + std::to_string(recall.steps) +
             " for recall)");
  app.add_option("--stop-at", c.stop_at, "stop after this step (0 = --steps)")->capture_default_str();
  app.add_option("--batch", c.batch, "examples per step")->capture_default_str();
  app.add_option("--clip", c.clip, "gradient-norm clip (0 = off)")->capture_default_str();
  app.add_option("--weight-decay", c.weight_decay)->capture_default_str();
  app.add_option("--seed", c.seed, "seeds the model, the data and the held-out set")->capture_default_str();
  app.add_option("--eval-every", c.eval_every, "held-out evaluation period (0 = end only)")->capture_default_str();
  app.add_option("--eval-examples", c.eval_examples, "held-out examples per evaluation")->capture_default_str();
  app.add_option("--target-accuracy", c.target_accuracy, "stop when held-out token accuracy reaches this")
      ->capture_default_str();
  app.add_option_function<int64_t>(
         "--curriculum",
         [&o](const int64_t& v) {
           o.config.curriculum = v;
           o.curriculum_given = true;
         },
         "start training on examples of this length and lengthen them by one whenever the running training "
         "accuracy reaches --curriculum-threshold; 0 = off (the default; " +
             std::to_string(recall.curriculum) + " for recall). Held-out examples are always full length");
  app.add_option("--curriculum-threshold", c.curriculum_threshold, "running training accuracy that lengthens the examples")
      ->capture_default_str();
  app.add_option("--log-every", c.log_every, "progress line period (steps)")->capture_default_str();
  app.add_option("--save", c.save_path, "write a checkpoint (.safetensors) at the end");
  app.add_option("--save-every", c.save_every, "also checkpoint every n steps (0 = end only)")->capture_default_str();
  app.add_option("--resume", c.resume_path, "continue from this checkpoint (same model, task and optimizer)");
  app.add_option("--csv", c.csv_path, "write the per-step curve here (CSV)");
  app.add_option("--png", o.png, "plot loss and accuracy (batch and held-out) here");
}

void run_train(const TrainOpts& o) {
  nn::TrainConfig c = o.config;
  c.task.kind = nn::parse_task(o.task);
  const nn::TrainConfig d = nn::default_config(c.task.kind);
  if (!o.queries_given) c.task.queries = d.task.queries;
  if (!o.steps_given) c.steps = d.steps;
  if (!o.curriculum_given) c.curriculum = d.curriculum;
  c.positions = nn::parse_positions(o.positions);
  c.precision = nn::parse_precision(o.precision);
  if (!o.window.empty()) c.window = {o.window[0], o.window[1]};
  c.chunk_size = o.chunk_size;
  c.scale_none = o.scale == "none";
  if (!c.resume_path.empty()) require_file(c.resume_path, "--resume");
  c.validate();  // before any output, so a bad value fails fast with the field's name
  // Every output is checked before training starts. The checkpoint is written
  // in place as training goes (--save-every); the curve and the plot are
  // written at the end and renamed into place together.
  Outputs outputs;
  outputs.check("--save", c.save_path);
  c.csv_path = outputs.add("--csv", c.csv_path);
  const std::string png = outputs.add("--png", o.png);
  const bool tty = stdout_is_tty();
  const int64_t stop = c.stop_at > 0 ? std::min(c.stop_at, c.steps) : c.steps;
  auto progress = [&](const nn::TrainRecord& r) {
    std::string s = fmt::format("step {:6}/{}  loss {:.4f}  acc {:.3f}  seq {:.3f}  lr {:.2e}  |g| {:.3f}  {:.0f} tok/s",
                                r.step + 1, stop, r.loss, r.token_acc, r.seq_acc, r.lr, r.grad_norm, r.tokens_per_s);
    if (c.curriculum > 0 && c.curriculum < c.task.length) s += fmt::format("  len {}", r.length);
    if (r.eval_token_acc >= 0) s += fmt::format("  held-out acc {:.4f} seq {:.4f}", r.eval_token_acc, r.eval_seq_acc);
    if (tty) {
      const int width = 20, filled = int(width * double(r.step + 1) / double(stop));
      std::cout << "\r[" << std::string(size_t(filled), '#') << std::string(size_t(width - filled), '.') << "] " << s
                << std::flush;
      if (r.eval_token_acc >= 0) std::cout << '\n';
    } else {
      std::cout << s << std::endl;  // flushed: progress is read live from pipes too
    }
  };
  const nn::TrainResult res = nn::train(c, progress);
  if (tty) std::cout << '\n';
  std::cout << fmt::format("parameters {}, steps {}..{} in {:.1f} s\n", res.num_parameters, res.start_step,
                           res.start_step + res.steps_done, res.seconds);
  std::cout << fmt::format("at start: score std {:.4f}, mean top attention weight {:.4f}\n", res.init_score_std,
                           res.init_top_weight);
  for (size_t l = 0; l < res.sinks.size(); ++l) {
    std::string s;
    for (double v : res.sinks[l]) s += fmt::format("{}{:.3f}", s.empty() ? "" : " ", v);
    std::cout << fmt::format("learned sinks, layer {}: {}\n", l, s);
  }
  if (!png.empty()) plot_curve(res.curve, png);
  outputs.commit();
  std::cout << fmt::format("held-out ({} examples): loss {:.4f}, token accuracy {:.4f}, exact-sequence accuracy {:.4f}\n",
                           res.final_eval.examples, res.final_eval.loss, res.final_eval.token_acc,
                           res.final_eval.seq_acc);
  if (!c.save_path.empty()) std::cout << "checkpoint written to " << c.save_path << '\n';
  std::cout << std::flush;
}

void run_checkpoint_heatmap(const CheckpointHeatmapOpts& o) {
  Outputs outputs;
  const std::string png = outputs.add("--out", o.out);
  require_file(o.checkpoint, "--checkpoint");
  nn::TrainConfig c = nn::checkpoint_config(o.checkpoint);  // validated against the tensors stored
  const nn::ModelConfig mc = nn::model_config(c);
  if (!o.task.empty()) c.task.kind = nn::parse_task(o.task);
  const nn::Task task(c.task);
  if (task.vocab_size() != mc.vocab || task.seq_len() > mc.max_len)
    throw UsageError(fmt::format("attn heatmap: --task {} makes sequences of {} tokens over {} symbols; the checkpoint's "
                                 "model takes at most {} tokens over {}",
                                 o.task, task.seq_len(), task.vocab_size(), mc.max_len, mc.vocab));
  if (o.example < 0 || o.example >= 100000)
    throw UsageError(fmt::format("attn heatmap: --example {} is outside 0..99999", o.example));
  if (mc.layers * mc.heads > 64)
    throw InvalidArgument(fmt::format("attn heatmap: {} layers x {} heads is too many panels to draw (at most 64)", mc.layers,
                            mc.heads));
  if (task.seq_len() > 512)
    throw InvalidArgument(fmt::format("attn heatmap: the checkpoint's examples are {} tokens long, too many to draw (at most "
                            "512 x 512 per panel)",
                            task.seq_len()));
  nn::Transformer<float> model(mc);
  const int64_t step = nn::load_training_checkpoint<float>(o.checkpoint, model, nullptr);

  // Example K of the stream seeded by --seed: the (K+1)-th row of one batch.
  nn::Rng rng(o.seed);
  const nn::Batch b = task.sample(o.example + 1, rng);
  const int64_t N = b.N;
  const std::vector<int32_t> tokens(b.tokens.begin() + o.example * N, b.tokens.begin() + (o.example + 1) * N);
  const std::vector<int32_t> targets(b.targets.begin() + o.example * N, b.targets.begin() + (o.example + 1) * N);
  Tensor<float> logits;
  std::vector<Tensor<float>> att;
  model.forward(tokens.data(), 1, N, logits, &att);

  std::vector<std::string> labels;
  for (int32_t t : tokens) labels.push_back(task.token_label(t));
  std::string in, want, got;
  int64_t right = 0, scored = 0;
  const int64_t V = mc.vocab;
  for (int64_t i = 0; i < N; ++i) {
    in += (i ? " " : "") + labels[size_t(i)];
    if (targets[size_t(i)] < 0) continue;
    const float* row = logits.data() + i * V;
    const auto pred = int32_t(std::max_element(row, row + V) - row);
    want += (want.empty() ? "" : " ") + task.token_label(targets[size_t(i)]);
    got += (got.empty() ? "" : " ") + task.token_label(pred);
    ++scored;
    right += pred == targets[size_t(i)];
  }
  fmt::print("{} example {} (seed {}), checkpoint at step {}\n", nn::task_name(c.task.kind), o.example, o.seed, step);
  fmt::print("  input      {}\n  target     {}\n  predicted  {}   ({}/{} right)\n", in, want, got, right, scored);

  const int64_t L = mc.layers, H = mc.heads;
  std::vector<double> w;
  w.reserve(size_t(L * H * N * N));
  std::vector<std::string> titles;
  for (int64_t l = 0; l < L; ++l) {
    const Tensor<float>& a = att[size_t(l)];  // (1, H, N, N)
    for (size_t i = 0; i < size_t(H * N * N); ++i) w.push_back(double(a[i]));
    for (int64_t h = 0; h < H; ++h) titles.push_back(fmt::format("layer {} head {}", l, h));
  }
  const std::string title =
      o.title.empty() ? fmt::format("{}: {} example {}", std::filesystem::path(o.checkpoint).filename().string(),
                                    nn::task_name(c.task.kind), o.example)
                      : o.title;
  draw_heatmap(w, L * H, N, N, labels, labels, title, png, titles, int(std::min<int64_t>(H, 8)));
  outputs.commit();
  fmt::print(stderr, "attn heatmap: wrote {} ({} layer(s) x {} head(s) of {} x {})\n", o.out, L, H, N, N);
}

void add_train(CLI::App& app) {
  auto o = std::make_shared<TrainOpts>();
  auto* c = app.add_subcommand("train", "Train a small transformer on a synthetic task (copy, reverse, sort, recall)");
  add_train_flags(*c, *o);
  c->footer(std::string("Progress goes to stdout, one line per --log-every steps. A run is a pure function of its "
                        "flags: the same --seed gives the same curve, and --resume continues it exactly.\n") +
            kExitCodesHelp);
  c->callback([o] { run_train(*o); });
}

}  // namespace attn::cli
