// The multi-head attention layer's construction (the configuration's
// checks), its initialisation as PyTorch's layer does it, its parameters
// and gradients by state_dict name. Forward and backward are in
// layer.cpp.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "attn/multihead.hpp"
#include "attn/rng.hpp"
#include "multihead/names.hpp"
#include "validate.hpp"

namespace attn {
namespace {

using detail::Checker;
using namespace detail::mha_names;

// U(-bound, bound) from the library's generator.
template <class T>
void fill_uniform(Tensor<T>& t, double bound, Rng& rng) {
  for (size_t i = 0; i < t.size(); ++i) t[i] = T(rng.uniform(-bound, bound));
}

}  // namespace

// ---------------------------------------------------------------------------
// Construction and parameters

template <class T>
MultiheadAttention<T>::MultiheadAttention(const MultiheadConfig& config, uint64_t seed) : cfg_(config) {
  const Checker c{"MultiheadAttention::MultiheadAttention"};
  auto at_least = [&](int64_t v, const char* name, int64_t lo, const char* note) {
    if (v < lo)
      c.fail(std::string("config '") + name + "' is " + std::to_string(v) + ", expected >= " +
             std::to_string(lo) + note);
  };
  at_least(cfg_.embed_dim, "embed_dim", 1, "");
  at_least(cfg_.num_heads, "num_heads", 1, "");
  at_least(cfg_.kdim, "kdim", 0, " (0 = embed_dim)");
  at_least(cfg_.vdim, "vdim", 0, " (0 = embed_dim)");
  at_least(cfg_.head_dim, "head_dim", 0, " (0 = embed_dim / num_heads)");
  at_least(cfg_.v_head_dim, "v_head_dim", 0, " (0 = head_dim)");
  const int64_t D = cfg_.embed_dim, H = cfg_.num_heads;
  // Keep every parameter and activation width far from int64 overflow.
  constexpr int64_t kMaxWidth = int64_t(1) << 24;
  for (auto [v, name] : {std::pair{D, "embed_dim"}, {H, "num_heads"}, {cfg_.kdim, "kdim"}, {cfg_.vdim, "vdim"},
                         {cfg_.head_dim, "head_dim"}, {cfg_.v_head_dim, "v_head_dim"}})
    if (v > kMaxWidth)
      c.fail(std::string("config '") + name + "' is " + std::to_string(v) + ", expected <= " +
             std::to_string(kMaxWidth));
  if (cfg_.head_dim == 0) {
    if (D % H != 0)
      c.fail("config 'embed_dim' = " + std::to_string(D) + " is not divisible by 'num_heads' = " +
             std::to_string(H) + "; set 'head_dim' (and 'v_head_dim') explicitly");
    cfg_.head_dim = D / H;
  }
  if (cfg_.v_head_dim == 0) cfg_.v_head_dim = cfg_.head_dim;
  if (cfg_.kdim == 0) cfg_.kdim = D;
  if (cfg_.vdim == 0) cfg_.vdim = D;
  if (H * std::max(cfg_.head_dim, cfg_.v_head_dim) > kMaxWidth)
    c.fail("config 'num_heads' * 'head_dim' = " + std::to_string(H * std::max(cfg_.head_dim, cfg_.v_head_dim)) +
           " is too large, expected <= " + std::to_string(kMaxWidth));
  packed_ = cfg_.kdim == D && cfg_.vdim == D && cfg_.head_dim == cfg_.v_head_dim && H * cfg_.head_dim == D;

  const int64_t HE = H * cfg_.head_dim, HEv = H * cfg_.v_head_dim;
  if (packed_) {
    params_.emplace(kInProjWeight, Tensor<T>({3 * D, D}));
  } else {
    params_.emplace(kQProjWeight, Tensor<T>({HE, D}));
    params_.emplace(kKProjWeight, Tensor<T>({HE, cfg_.kdim}));
    params_.emplace(kVProjWeight, Tensor<T>({HEv, cfg_.vdim}));
  }
  if (cfg_.bias) {
    params_.emplace(kInProjBias, Tensor<T>({2 * HE + HEv}));
    params_.emplace(kOutProjBias, Tensor<T>({D}));
  }
  params_.emplace(kOutProjWeight, Tensor<T>({D, HEv}));
  if (cfg_.sinks) params_.emplace(kSinks, Tensor<T>({H}));
  for (const auto& [name, p] : params_) grads_.emplace(name, Tensor<T>(p.shape()));
  reset_parameters(seed);
}

template <class T>
std::vector<std::string> MultiheadAttention<T>::parameter_names() const {
  // PyTorch's state_dict order.
  std::vector<std::string> names;
  if (packed_) {
    names.push_back(kInProjWeight);
  } else {
    names.insert(names.end(), {kQProjWeight, kKProjWeight, kVProjWeight});
  }
  if (cfg_.bias) names.push_back(kInProjBias);
  names.push_back(kOutProjWeight);
  if (cfg_.bias) names.push_back(kOutProjBias);
  if (cfg_.sinks) names.push_back(kSinks);
  return names;
}

namespace {
template <class Map>
auto& lookup(Map& m, const std::string& name, const char* fn, const std::vector<std::string>& valid) {
  auto it = m.find(name);
  if (it == m.end()) {
    std::string list;
    for (const auto& n : valid) list += (list.empty() ? "" : ", ") + n;
    throw InvalidArgument(std::string("attn::MultiheadAttention::") + fn + ": unknown parameter name '" + name +
                "', expected one of " + list);
  }
  return it->second;
}
}  // namespace

// The const accessors are the others with const added.
template <class T>
Tensor<T>& MultiheadAttention<T>::parameter(const std::string& name) {
  return lookup(params_, name, "parameter", parameter_names());
}
template <class T>
Tensor<T>& MultiheadAttention<T>::grad(const std::string& name) {
  return lookup(grads_, name, "grad", parameter_names());
}
template <class T>
const Tensor<T>& MultiheadAttention<T>::parameter(const std::string& name) const {
  return const_cast<MultiheadAttention*>(this)->parameter(name);
}
template <class T>
const Tensor<T>& MultiheadAttention<T>::grad(const std::string& name) const {
  return const_cast<MultiheadAttention*>(this)->grad(name);
}

template <class T>
void MultiheadAttention<T>::zero_grad() {
  for (auto& [name, g] : grads_) g.fill(T(0));
}

template <class T>
void MultiheadAttention<T>::reset_parameters(uint64_t seed) {
  // As torch.nn.MultiheadAttention._reset_parameters: Xavier-uniform input
  // projections, bound sqrt(6 / (fan_in + fan_out)) over the whole tensor
  // (the packed [3D, D] one included); out_proj keeps nn.Linear's default
  // kaiming_uniform_(a = sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); biases 0.
  Rng rng(seed);
  auto xavier = [&](Tensor<T>& w) {
    fill_uniform(w, std::sqrt(6.0 / double(w.dim(0) + w.dim(1))), rng);
  };
  if (packed_) {
    xavier(params_.at(kInProjWeight));
  } else {
    xavier(params_.at(kQProjWeight));
    xavier(params_.at(kKProjWeight));
    xavier(params_.at(kVProjWeight));
  }
  Tensor<T>& wo = params_.at(kOutProjWeight);
  fill_uniform(wo, 1.0 / std::sqrt(double(wo.dim(1))), rng);
  if (cfg_.bias) {
    params_.at(kInProjBias).fill(T(0));
    params_.at(kOutProjBias).fill(T(0));
  }
  // Sinks start at 0: each adds exp(0) = 1 to its rows' denominators.
  if (cfg_.sinks) params_.at(kSinks).fill(T(0));
}

template <class T>
void MultiheadAttention<T>::load_parameter(const std::string& name, View<const T, 2> w) {
  Tensor<T>& p = lookup(params_, name, "load_parameter", parameter_names());
  const Checker c{"MultiheadAttention::load_parameter"};
  if (p.rank() != 2 || w.shape[0] != p.dim(0) || w.shape[1] != p.dim(1))
    c.fail("parameter '" + name + "' has shape " + shape_str(p.shape()) + ", got a value of shape " +
           shape_str(w.shape));
  if (w.data == nullptr && w.numel() > 0) c.fail("the value for '" + name + "' has no data (null pointer)");
  for (int64_t i = 0; i < w.shape[0]; ++i)
    for (int64_t j = 0; j < w.shape[1]; ++j) p[size_t(i * w.shape[1] + j)] = w(i, j);
}

template <class T>
void MultiheadAttention<T>::load_parameter(const std::string& name, View<const T, 1> b) {
  Tensor<T>& p = lookup(params_, name, "load_parameter", parameter_names());
  const Checker c{"MultiheadAttention::load_parameter"};
  if (p.rank() != 1 || b.shape[0] != p.dim(0))
    c.fail("parameter '" + name + "' has shape " + shape_str(p.shape()) + ", got a value of shape " +
           shape_str(b.shape));
  if (b.data == nullptr && b.numel() > 0) c.fail("the value for '" + name + "' has no data (null pointer)");
  for (int64_t i = 0; i < b.shape[0]; ++i) p[size_t(i)] = b(i);
}

// The members defined here, for both element types (layer.cpp
// instantiates the class with the rest).
#define ATTN_MHA_PARAMS(T)                                                                         \
  template MultiheadAttention<T>::MultiheadAttention(const MultiheadConfig&, uint64_t);           \
  template std::vector<std::string> MultiheadAttention<T>::parameter_names() const;               \
  template Tensor<T>& MultiheadAttention<T>::parameter(const std::string&);                       \
  template const Tensor<T>& MultiheadAttention<T>::parameter(const std::string&) const;           \
  template Tensor<T>& MultiheadAttention<T>::grad(const std::string&);                            \
  template const Tensor<T>& MultiheadAttention<T>::grad(const std::string&) const;                \
  template void MultiheadAttention<T>::zero_grad();                                               \
  template void MultiheadAttention<T>::reset_parameters(uint64_t);                                \
  template void MultiheadAttention<T>::load_parameter(const std::string&, View<const T, 2>);      \
  template void MultiheadAttention<T>::load_parameter(const std::string&, View<const T, 1>);
ATTN_MHA_PARAMS(float)
ATTN_MHA_PARAMS(double)
#undef ATTN_MHA_PARAMS

}  // namespace attn
