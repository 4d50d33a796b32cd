// attn/nn/train.hpp — the training loop behind `attn train` and
// examples/train.cpp.
//
// Every step draws a fresh batch of the task (and, with attention dropout,
// fresh masks) from generators seeded by (seed, step), so a run is a pure
// function of its configuration: the same
// seed gives the same loss curve bit for bit (same machine, same thread
// count), and a run resumed from a checkpoint written at step k continues
// exactly the curve of an uninterrupted run. Held-out evaluation uses a
// separate, fixed stream of examples.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "attn/nn/model.hpp"
#include "attn/nn/optim.hpp"
#include "attn/nn/tasks.hpp"

namespace attn::nn {

// Thrown by train() when the loss or the gradient norm becomes NaN or
// infinite. Training stops before the optimizer applies that step, so the
// checkpoints already written (periodic ones, or the one resumed from) are
// left as they were.
class TrainingDiverged : public Error {
 public:
  explicit TrainingDiverged(const std::string& what) : Error(what) {}
};

// Limits on the sizes a configuration (or a checkpoint's) may ask for: small
// models on synthetic tasks are what this trainer is for, and a hostile
// checkpoint must not make it allocate without bound.
struct TrainLimits {
  static constexpr int64_t max_length = 4096;   // task.length
  static constexpr int64_t max_layers = 64;
  static constexpr int64_t max_dim = 8192;
  static constexpr int64_t max_batch = 65536;
  static constexpr int64_t max_steps = int64_t(1) << 40;
  static constexpr int64_t max_eval_examples = 1 << 24;
};

struct TrainConfig {
  TaskConfig task;
  // model
  int64_t layers = 2, dim = 64, heads = 4;
  Positions positions = Positions::rope;  // the one encoding that learns both reverse and recall fast
  bool causal = false;
  Window window;            // sliding window (left, right), -1 = unbounded side
  int64_t chunk_size = 0;   // chunked attention (SdpaOptions::chunk_size), 0 = off
  bool sinks = false;       // a learnable sink logit per head and layer
  bool scale_none = false;  // scores not divided by √d_k
  // Attention dropout probability in training steps, 0 <= dropout < 1; step
  // k's masks are drawn from (seed, k), so a run stays reproducible. The
  // held-out evaluation drops nothing.
  double dropout = 0;
  // Mixed precision (ModelConfig::precision): bf16 computes the attention's
  // products in bfloat16 in training steps and evaluations; the weights,
  // gradients and optimizer state stay float32.
  Precision precision = Precision::fp32;
  // optimisation
  std::string optimizer = "adamw";  // "adamw" or "sgd"
  double lr = 3e-3;
  double min_lr = 3e-4;  // end of the cosine
  int64_t warmup = 100;
  int64_t steps = 2000;  // length of the schedule
  int64_t batch = 32;
  double clip = 1.0;  // global gradient-norm clip; 0 = off
  double weight_decay = 0.01;
  double momentum = 0.9;  // sgd only
  uint64_t seed = 0;
  // run control
  int64_t stop_at = 0;            // stop after this step (0 = steps); the schedule still spans `steps`
  double target_accuracy = 0;     // > 0: stop once a held-out evaluation reaches it
  int64_t eval_every = 0;         // held-out evaluation every n steps (0 = only at the end)
  int64_t eval_examples = 512;
  int64_t log_every = 50;         // progress callback period
  std::string save_path;          // checkpoint written at the end (and every save_every steps)
  int64_t save_every = 0;
  std::string resume_path;        // continue from this checkpoint
  std::string csv_path;           // per-step curve
  // curriculum: 0 = off; otherwise training starts on examples of this length
  // (items, or key-value pairs for recall) and moves up by one each time the
  // running training accuracy reaches curriculum_threshold, until task.length
  // (a start >= task.length trains at full length throughout). Held-out
  // evaluation always uses the full task.
  int64_t curriculum = 0;
  double curriculum_threshold = 0.9;

  void validate() const;  // throws attn::InvalidArgument naming the field (TrainLimits bound the sizes)
};

// The length schedule of a curriculum. The running accuracy is an exponential
// average (factor 0.9) of the batch token accuracy, restarted from 0 at every
// new length, so a length is kept for at least ~22 steps even at 100%.
class Curriculum {
 public:
  explicit Curriculum(const TrainConfig& c);
  int64_t length() const { return length_; }
  double running_accuracy() const { return running_; }
  bool done() const { return length_ >= full_; }
  // Records one step's batch token accuracy at the current length; returns
  // true when that moves the curriculum to the next length.
  bool record(double batch_token_accuracy);
  // The task a step trains on: the configured one at the current length.
  TaskConfig task() const;
  // Checkpoints store the state so that a resumed run continues exactly.
  void restore(int64_t length, double running);

 private:
  TaskConfig task_;
  int64_t full_ = 0, length_ = 0;
  double threshold_ = 0, running_ = 0;
};

// The default configuration for a task: the member defaults above, except for
// recall, which defaults to the classic single-query form (task.queries = 1)
// trained with a curriculum from 3 pairs over a 4000-step schedule (without
// the curriculum that form stays on its plateau; docs/training.md has the
// measurements).
TrainConfig default_config(TaskKind kind);

// The model a configuration trains.
ModelConfig model_config(const TrainConfig& c);

struct TrainRecord {
  int64_t step = 0;
  double lr = 0, loss = 0, token_acc = 0, seq_acc = 0;
  double grad_norm = 0;               // global, before clipping
  double grad_norm_q = 0, grad_norm_k = 0;  // the W_Q and W_K rows of every in_proj
  double tokens_per_s = 0, elapsed_s = 0;
  double eval_token_acc = -1, eval_seq_acc = -1;  // -1 when not evaluated at this step
  int64_t length = 0;  // the example length trained on (below task.length during a curriculum)
};

struct EvalResult {
  double loss = 0, token_acc = 0, seq_acc = 0;
  int64_t examples = 0;
};

struct TrainResult {
  std::vector<TrainRecord> curve;
  EvalResult final_eval;
  int64_t start_step = 0, steps_done = 0;
  double seconds = 0;
  int64_t num_parameters = 0;
  // at initialisation (or at resume), over the layers, on the first batch
  double init_score_std = 0, init_top_weight = 0;
  // with sinks: the learned sink logits at the end, [layer][head]
  std::vector<std::vector<double>> sinks;
};

using ProgressCallback = std::function<void(const TrainRecord&)>;

TrainResult train(const TrainConfig& config, const ProgressCallback& progress = {});

// Token and exact-sequence accuracy on `examples` held-out examples drawn from
// the stream `seed`.
template <class T>
EvalResult evaluate(Transformer<T>& model, const Task& task, int64_t examples, uint64_t seed);

// Checkpoints of a training run, safetensors files written through attn::io:
// all parameters, the optimizer state, and the step and configuration as
// metadata. Errors name the path (and the tensor and shapes on a mismatch).
// `curriculum`, when given, is stored too.
template <class T>
void save_training_checkpoint(const std::string& path, Transformer<T>& model, Optimizer<T>* optimizer,
                              int64_t step, const TrainConfig& config, const Curriculum* curriculum = nullptr);
// Loads parameters (and optimizer state when given) and returns the step;
// restores `curriculum` when given and stored. A NaN or infinite value in a
// stored tensor is refused (training never writes one: it stops first).
template <class T>
int64_t load_training_checkpoint(const std::string& path, Transformer<T>& model, Optimizer<T>* optimizer,
                                 Curriculum* curriculum = nullptr);
// The configuration stored in a checkpoint (to rebuild its model), validated
// (TrainConfig::validate; integers must be JSON integers) and checked against
// the tensors stored: every parameter of the model it describes is there with
// its shape (parameter_shapes), so building that model allocates no more than
// the file holds. Throws attn::InvalidArgument naming the path and the field or tensor.
TrainConfig checkpoint_config(const std::string& path);

// Writes the curve as CSV (atomically).
void write_curve_csv(const std::string& path, const std::vector<TrainRecord>& curve);

}  // namespace attn::nn
