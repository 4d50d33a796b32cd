// Trains a small transformer on a synthetic task (the library function
// attn::nn::train with a command line). Run with --help for the flags.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <string>

#include "attn/nn.hpp"
#include "plot_png.hpp"

int main(int argc, char** argv) {
  namespace nn = attn::nn;
  nn::TrainConfig c;
  std::string task = "reverse", positions = "rope", scale = "default";
  CLI::App app{"Train a small transformer on a synthetic task (copy, reverse, sort, recall)."};
  app.add_option("--task", task, "copy | reverse | sort | recall")->capture_default_str();
  app.add_option("--length", c.task.length, "items per example (key-value pairs for recall)")->capture_default_str();
  app.add_option("--symbols", c.task.symbols, "alphabet size")->capture_default_str();
  app.add_option("--queries", c.task.queries, "recall: queries per example (0 = one per key; 1 = the single-query task)")->capture_default_str();
  app.add_option("--layers", c.layers)->capture_default_str();
  app.add_option("--dim", c.dim)->capture_default_str();
  app.add_option("--heads", c.heads)->capture_default_str();
  app.add_option("--positions", positions, "sinusoidal | learned | rope | none")->capture_default_str();
  app.add_option("--scale", scale, "default (1/sqrt(d_k)) | none")->capture_default_str();
  app.add_flag("--causal", c.causal, "causal attention mask");
  app.add_option("--optimizer", c.optimizer, "adamw | sgd")->capture_default_str();
  app.add_option("--lr", c.lr)->capture_default_str();
  app.add_option("--min-lr", c.min_lr)->capture_default_str();
  app.add_option("--warmup", c.warmup)->capture_default_str();
  app.add_option("--steps", c.steps, "length of the schedule")->capture_default_str();
  app.add_option("--stop-at", c.stop_at, "stop after this step (0 = --steps)")->capture_default_str();
  app.add_option("--batch", c.batch)->capture_default_str();
  app.add_option("--clip", c.clip, "gradient-norm clip (0 = off)")->capture_default_str();
  app.add_option("--weight-decay", c.weight_decay)->capture_default_str();
  app.add_option("--seed", c.seed)->capture_default_str();
  app.add_option("--eval-every", c.eval_every, "held-out evaluation period (0 = end only)")->capture_default_str();
  app.add_option("--eval-examples", c.eval_examples)->capture_default_str();
  app.add_option("--target-accuracy", c.target_accuracy, "stop when held-out token accuracy reaches this")
      ->capture_default_str();
  app.add_option("--log-every", c.log_every)->capture_default_str();
  app.add_option("--save", c.save_path, "checkpoint (.safetensors)");
  app.add_option("--save-every", c.save_every)->capture_default_str();
  app.add_option("--resume", c.resume_path, "continue from this checkpoint");
  app.add_option("--csv", c.csv_path, "write the per-step curve here");
  std::string png_path;
  app.add_option("--png", png_path, "plot loss and accuracy (batch and held-out) here");
  CLI11_PARSE(app, argc, argv);

  try {
    c.task.kind = nn::parse_task(task);
    c.positions = nn::parse_positions(positions);
    if (scale != "default" && scale != "none") throw attn::Error("--scale must be default or none, got '" + scale + "'");
    c.scale_none = scale == "none";
    const bool tty = ::isatty(::fileno(stdout));
    const int64_t stop = c.stop_at > 0 ? std::min(c.stop_at, c.steps) : c.steps;
    auto progress = [&](const nn::TrainRecord& r) {
      char line[256];
      std::snprintf(line, sizeof line, "step %6lld/%lld  loss %.4f  acc %.3f  seq %.3f  lr %.2e  |g| %.3f  %.0f tok/s",
                    static_cast<long long>(r.step + 1), static_cast<long long>(stop), r.loss, r.token_acc, r.seq_acc,
                    r.lr, r.grad_norm, r.tokens_per_s);
      std::string s = line;
      if (r.eval_token_acc >= 0) {
        std::snprintf(line, sizeof line, "  held-out acc %.4f seq %.4f", r.eval_token_acc, r.eval_seq_acc);
        s += line;
      }
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
    std::printf("parameters %lld, steps %lld..%lld in %.1f s\n", static_cast<long long>(res.num_parameters),
                static_cast<long long>(res.start_step), static_cast<long long>(res.start_step + res.steps_done),
                res.seconds);
    std::printf("at start: score std %.4f, mean top attention weight %.4f\n", res.init_score_std, res.init_top_weight);
    if (!png_path.empty()) {
      plot::Series loss{"loss", {}, {}}, acc{"token acc", {}, {}}, held{"held-out acc", {}, {}};
      for (const auto& r : res.curve) {
        loss.x.push_back(double(r.step + 1));
        loss.y.push_back(r.loss);
        acc.x.push_back(double(r.step + 1));
        acc.y.push_back(r.token_acc);
        if (r.eval_token_acc >= 0) {
          held.x.push_back(double(r.step + 1));
          held.y.push_back(r.eval_token_acc);
        }
      }
      plot::write_line_plot(png_path, {loss, acc, held}, false, "training curve: loss and token accuracy by step");
    }
    std::printf("held-out (%lld examples): loss %.4f, token accuracy %.4f, exact-sequence accuracy %.4f\n",
                static_cast<long long>(res.final_eval.examples), res.final_eval.loss, res.final_eval.token_acc,
                res.final_eval.seq_acc);
  } catch (const attn::Error& e) {
    std::cerr << "train: " << e.what() << '\n';
    return 2;
  } catch (const std::runtime_error& e) {
    std::cerr << "train: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
