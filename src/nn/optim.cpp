// Optimizers, gradient clipping and the learning-rate schedule. Updates are
// computed in double per element and stored back in T, so the float and
// double instantiations follow the same formulas.
#include "attn/nn/optim.hpp"

#include <cmath>
#include <numbers>

namespace attn::nn {

namespace {
template <class T>
void check_params(const std::vector<ParamRef<T>>& params, const char* fn) {
  for (const auto& p : params)
    if (!p.value || !p.grad || p.value->shape() != p.grad->shape())
      throw InvalidArgument(std::string(fn) + ": parameter '" + p.name + "' has no value/grad or their shapes differ");
}
}  // namespace

template <class T>
Sgd<T>::Sgd(std::vector<ParamRef<T>> params, SgdConfig config) : params_(std::move(params)), cfg_(config) {
  check_params(params_, "attn::nn::Sgd");
  if (!(cfg_.momentum >= 0 && cfg_.momentum < 1))
    throw InvalidArgument("attn::nn::Sgd: momentum must be in [0, 1)");
  if (!(cfg_.weight_decay >= 0)) throw InvalidArgument("attn::nn::Sgd: weight_decay must be >= 0");
  for (const auto& p : params_) momentum_.emplace_back(p.value->shape());
}

template <class T>
void Sgd<T>::step(double lr) {
  for (size_t k = 0; k < params_.size(); ++k) {
    Tensor<T>& w = *params_[k].value;
    const Tensor<T>& g = *params_[k].grad;
    Tensor<T>& m = momentum_[k];
    const double wd = params_[k].decay ? cfg_.weight_decay : 0.0;
    for (size_t i = 0; i < w.size(); ++i) {
      const double gi = double(g[i]) + wd * double(w[i]);       // g ← g + λ·p
      const double mi = cfg_.momentum * double(m[i]) + gi;      // m ← μ·m + g
      m[i] = T(mi);
      w[i] = T(double(w[i]) - lr * mi);                         // p ← p − lr·m
    }
  }
  ++this->steps_taken;
}

std::vector<std::string> optimizer_state_names(const std::string& optimizer, const std::string& param) {
  if (optimizer == "sgd") return {"sgd.momentum." + param};
  if (optimizer == "adamw") return {"adamw.m." + param, "adamw.v." + param};
  return {};
}

template <class T>
std::vector<std::pair<std::string, Tensor<T>*>> Sgd<T>::state() {
  std::vector<std::pair<std::string, Tensor<T>*>> s;
  for (size_t k = 0; k < params_.size(); ++k) s.emplace_back(optimizer_state_names("sgd", params_[k].name)[0], &momentum_[k]);
  return s;
}

template <class T>
AdamW<T>::AdamW(std::vector<ParamRef<T>> params, AdamWConfig config) : params_(std::move(params)), cfg_(config) {
  check_params(params_, "attn::nn::AdamW");
  if (!(cfg_.beta1 >= 0 && cfg_.beta1 < 1 && cfg_.beta2 >= 0 && cfg_.beta2 < 1))
    throw InvalidArgument("attn::nn::AdamW: beta1 and beta2 must be in [0, 1)");
  if (!(cfg_.eps > 0)) throw InvalidArgument("attn::nn::AdamW: eps must be > 0");
  if (!(cfg_.weight_decay >= 0)) throw InvalidArgument("attn::nn::AdamW: weight_decay must be >= 0");
  for (const auto& p : params_) {
    m_.emplace_back(p.value->shape());
    v_.emplace_back(p.value->shape());
  }
}

template <class T>
void AdamW<T>::step(double lr) {
  const int64_t t = ++this->steps_taken;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, double(t));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, double(t));
  for (size_t k = 0; k < params_.size(); ++k) {
    Tensor<T>& w = *params_[k].value;
    const Tensor<T>& g = *params_[k].grad;
    Tensor<T>& m = m_[k];
    Tensor<T>& v = v_[k];
    const double decay = params_[k].decay ? 1.0 - lr * cfg_.weight_decay : 1.0;
    for (size_t i = 0; i < w.size(); ++i) {
      const double gi = double(g[i]);
      const double mi = cfg_.beta1 * double(m[i]) + (1 - cfg_.beta1) * gi;       // m ← β1·m + (1−β1)·g
      const double vi = cfg_.beta2 * double(v[i]) + (1 - cfg_.beta2) * gi * gi;  // v ← β2·v + (1−β2)·g²
      m[i] = T(mi);
      v[i] = T(vi);
      // p ← p·(1 − lr·λ) − lr·m̂/(√v̂ + ε)
      w[i] = T(double(w[i]) * decay - lr * (mi / bc1) / (std::sqrt(vi / bc2) + cfg_.eps));
    }
  }
}

template <class T>
std::vector<std::pair<std::string, Tensor<T>*>> AdamW<T>::state() {
  std::vector<std::pair<std::string, Tensor<T>*>> s;
  for (size_t k = 0; k < params_.size(); ++k) {
    const auto names = optimizer_state_names("adamw", params_[k].name);
    s.emplace_back(names[0], &m_[k]);
    s.emplace_back(names[1], &v_[k]);
  }
  return s;
}

template <class T>
double l2_norm(const Tensor<T>& t) {
  double s = 0;
  for (size_t i = 0; i < t.size(); ++i) s += double(t[i]) * double(t[i]);
  return std::sqrt(s);
}

template <class T>
double clip_grad_norm(const std::vector<ParamRef<T>>& params, double max_norm) {
  double s = 0;
  for (const auto& p : params)
    for (size_t i = 0; i < p.grad->size(); ++i) s += double((*p.grad)[i]) * double((*p.grad)[i]);
  const double norm = std::sqrt(s);
  if (max_norm > 0 && norm > max_norm) {
    const double c = max_norm / norm;
    for (const auto& p : params)
      for (size_t i = 0; i < p.grad->size(); ++i) (*p.grad)[i] = T(double((*p.grad)[i]) * c);
  }
  return norm;
}

double LrSchedule::at(int64_t step) const {
  if (warmup > 0 && step < warmup) return lr * double(step + 1) / double(warmup);
  const int64_t span = total - warmup;
  if (span <= 0 || step >= total) return min_lr;
  // cosine from lr (step = warmup) down to min_lr (step = total)
  const double progress = double(step - warmup) / double(span);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

template class Sgd<float>;
template class Sgd<double>;
template class AdamW<float>;
template class AdamW<double>;
template double clip_grad_norm<float>(const std::vector<ParamRef<float>>&, double);
template double clip_grad_norm<double>(const std::vector<ParamRef<double>>&, double);
template double l2_norm<float>(const Tensor<float>&);
template double l2_norm<double>(const Tensor<double>&);

}  // namespace attn::nn
