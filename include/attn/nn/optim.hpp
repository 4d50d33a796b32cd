// attn/nn/optim.hpp — optimizers, gradient clipping and the learning-rate
// schedule.
//
//   SGD (PyTorch's form):  g ← g + λ·p;  m ← μ·m + g;  p ← p − lr·m
//   AdamW (decoupled):     p ← p·(1 − lr·λ)            (decay parameters only)
//                          m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
//                          p ← p − lr · (m/(1−β1ᵗ)) / (√(v/(1−β2ᵗ)) + ε)
// Weight decay applies only to parameters marked `decay` (linear-map
// matrices), not to biases, norms, embeddings or position tables.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "attn/nn/layers.hpp"

namespace attn::nn {

template <class T>
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of every parameter from its grad, at learning rate lr.
  virtual void step(double lr) = 0;
  // The optimizer's state tensors by name (e.g. "adamw.m.<param>"), for
  // checkpoints; loading writes into them.
  virtual std::vector<std::pair<std::string, Tensor<T>*>> state() = 0;
  int64_t steps_taken = 0;  // t, saved in checkpoints
};

// The names of the state tensors optimizer `optimizer` ("sgd" or "adamw")
// keeps for parameter `param`, in the order of state(): "sgd.momentum.<param>";
// "adamw.m.<param>", "adamw.v.<param>". Empty for another optimizer.
std::vector<std::string> optimizer_state_names(const std::string& optimizer, const std::string& param);

struct SgdConfig {
  double momentum = 0.9;
  double weight_decay = 0.0;
};

template <class T>
class Sgd : public Optimizer<T> {
 public:
  Sgd(std::vector<ParamRef<T>> params, SgdConfig config);
  void step(double lr) override;
  std::vector<std::pair<std::string, Tensor<T>*>> state() override;

 private:
  std::vector<ParamRef<T>> params_;
  SgdConfig cfg_;
  std::vector<Tensor<T>> momentum_;
};

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;
};

template <class T>
class AdamW : public Optimizer<T> {
 public:
  AdamW(std::vector<ParamRef<T>> params, AdamWConfig config);
  void step(double lr) override;
  std::vector<std::pair<std::string, Tensor<T>*>> state() override;

 private:
  std::vector<ParamRef<T>> params_;
  AdamWConfig cfg_;
  std::vector<Tensor<T>> m_, v_;
};

// Global L2 norm of all gradients; when it exceeds max_norm (> 0) every
// gradient is scaled by max_norm / norm. Returns the norm before clipping.
template <class T>
double clip_grad_norm(const std::vector<ParamRef<T>>& params, double max_norm);

// L2 norm of one tensor (accumulated in double).
template <class T>
double l2_norm(const Tensor<T>& t);

// Linear warm-up from lr/warmup to lr over `warmup` steps, then a cosine
// decay from lr to min_lr at step `total` (constant min_lr after).
struct LrSchedule {
  double lr = 3e-3;
  double min_lr = 0.0;
  int64_t warmup = 0;
  int64_t total = 1;
  double at(int64_t step) const;  // step counts from 0
};

}  // namespace attn::nn
