// attn/multihead.hpp — the multi-head attention layer.
//
//   Q = query·W_qᵀ + b_q      (B, L, H·E)   viewed as (B, H, L, E)
//   K = key  ·W_kᵀ + b_k      (B, S, H·E)
//   V = value·W_vᵀ + b_v      (B, S, H·Ev)
//   O_h = sdpa(Q_h, K_h, V_h)  per head, concatenated to (B, L, H·Ev)
//   Y = O·W_oᵀ + b_o          (B, L, D)
//
// Token matrices are rank-3 strided views with logical axes (B, N, features);
// PyTorch's default (N, B, D) layout (batch_first=False) is the same data
// with the first two strides swapped, no copy needed.
//
// Parameters carry the names and layouts of torch.nn.MultiheadAttention's
// state_dict, weights stored [out, in], so exported weights load unchanged:
//   packed (kdim = vdim = D and E = Ev = D/H):
//     in_proj_weight [3D, D], in_proj_bias [3D]          (rows: q, k, v)
//   otherwise:
//     q_proj_weight [H·E, D], k_proj_weight [H·E, kdim], v_proj_weight [H·Ev, vdim],
//     in_proj_bias [2·H·E + H·Ev]
//   always: out_proj.weight [D, H·Ev], out_proj.bias [D]
// Biases exist only when config.bias is true. PyTorch's bias_k / bias_v /
// add_zero_attn are not supported.
//
// Mask polarity. PyTorch is inconsistent here (SDPA: true = attend;
// nn.MultiheadAttention attn_mask: true = blocked). attn uses one rule for
// attention masks everywhere: `attn_mask` true = MAY attend. The exception is
// `key_padding_mask`, whose name says what true means: true = this key is
// padding and is ignored (the same as PyTorch).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"

namespace attn {

struct MultiheadConfig {
  int64_t embed_dim = 0;   // D
  int64_t num_heads = 1;   // H
  bool bias = true;
  int64_t kdim = 0;        // key input width; 0 = D
  int64_t vdim = 0;        // value input width; 0 = D
  int64_t head_dim = 0;    // E; 0 = D / H (then D must be divisible by H)
  int64_t v_head_dim = 0;  // Ev; 0 = head_dim
};

template <class T>
struct MhaMasks {
  View4<const bool> attn_mask;        // (Bm, Hm, L, S) broadcastable; true = may attend
  View4<const T> attn_bias;           // (Bb, Hb, L, S) broadcastable; added to scores
  View2<const bool> key_padding_mask; // (B, S); true = padding, ignored
  View1<const int64_t> key_lengths;   // (B)
};

struct MhaOptions {
  bool causal = false;
  CausalAlign causal_align = CausalAlign::top_left;
  Backend backend = Backend::automatic;
  int num_threads = 0;
  bool check_finite = false;
};

// What the forward saves for the backward (owned copies, so the caller's
// buffers may be reused between forward and backward).
template <class T>
struct MhaCache {
  bool self_attention = false;  // forward_self: query = key = value
  Tensor<T> query, key, value;  // inputs, contiguous (B, N, width); self-attention: query only
  Tensor<T> q, k, v;            // projections, (B, N, H·E|H·Ev); heads are View4::bnhd views
  Tensor<T> attn_out;           // concatenated head outputs, (B, L, H·Ev)
  Tensor<T> lse;                // (B, H, L)
  Tensor<bool> mask;            // combined bool mask, when one was built
  MhaMasks<T> masks;            // the caller's masks (views; must outlive backward)
  MhaOptions options;
};

template <class T>
class MultiheadAttention {
 public:
  // Validates the configuration; parameters start as PyTorch initialises
  // them (Xavier-uniform weights, zero biases) from `seed`.
  explicit MultiheadAttention(const MultiheadConfig& config, uint64_t seed = 0);

  const MultiheadConfig& config() const { return cfg_; }
  int64_t embed_dim() const { return cfg_.embed_dim; }
  int64_t num_heads() const { return cfg_.num_heads; }
  int64_t head_dim() const { return cfg_.head_dim; }
  int64_t v_head_dim() const { return cfg_.v_head_dim; }
  int64_t kdim() const { return cfg_.kdim; }
  int64_t vdim() const { return cfg_.vdim; }
  bool packed_in_proj() const { return packed_; }

  // Parameters and their gradients, by PyTorch state_dict name.
  std::vector<std::string> parameter_names() const;
  Tensor<T>& parameter(const std::string& name);
  const Tensor<T>& parameter(const std::string& name) const;
  Tensor<T>& grad(const std::string& name);
  const Tensor<T>& grad(const std::string& name) const;
  void zero_grad();
  void reset_parameters(uint64_t seed);
  // Copies a parameter in; the shape must match exactly (throws otherwise).
  void load_parameter(const std::string& name, View<const T, 2> w);
  void load_parameter(const std::string& name, View<const T, 1> b);

  // Forward for (query, key, value): query (B, L, D), key (B, S, kdim),
  // value (B, S, vdim) -> out (B, L, D). Optional attention weights, per head
  // (B, H, L, S) and/or averaged over heads (B, L, S). When `cache` is given it
  // receives what backward needs.
  void forward(View3<const T> query, View3<const T> key, View3<const T> value, View3<T> out,
               const MhaMasks<T>& masks = {}, const MhaOptions& opt = {},
               MhaCache<T>* cache = nullptr, View4<T> head_weights = {},
               View3<T> avg_weights = {}) const;
  // Self-attention: query = key = value = x.
  void forward_self(View3<const T> x, View3<T> out, const MhaMasks<T>& masks = {},
                    const MhaOptions& opt = {}, MhaCache<T>* cache = nullptr,
                    View4<T> head_weights = {}, View3<T> avg_weights = {}) const;

  // Backward from dout = dL/dY (B, L, D). Parameter gradients are ADDED to
  // grad(name) (call zero_grad() between steps). Input gradients are
  // overwritten: after forward it fills dquery, dkey, dvalue (each optional);
  // after forward_self the total gradient of x goes to dquery and dkey/dvalue
  // must be empty.
  void backward(const MhaCache<T>& cache, View3<const T> dout, View3<T> dquery = {},
                View3<T> dkey = {}, View3<T> dvalue = {});

 private:
  MultiheadConfig cfg_;
  bool packed_ = false;
  std::map<std::string, Tensor<T>> params_;
  std::map<std::string, Tensor<T>> grads_;
};

}  // namespace attn
