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
//   with config.sinks: sinks [H], one learnable sink logit per head (gpt-oss's
//     name and definition: it joins every row's softmax denominator and adds
//     no value), starting at 0
// Biases exist only when config.bias is true. PyTorch's bias_k / bias_v /
// add_zero_attn are not supported.
//
// The score rules (attn/sdpa.hpp, docs/variants.md) are the dense call's:
// the options in MhaOptions::sdpa, the operands (mask, bias, per-head
// slopes) in MhaArgs's ScoreArgs (the standard slopes: attn/sdpa.hpp). The sinks are the layer's parameter above, trained
// like the weights (MhaArgs::sinks is refused).
//
// Mask polarity. PyTorch is inconsistent here (SDPA: true = attend;
// nn.MultiheadAttention attn_mask: true = blocked). attn uses one rule for
// attention masks everywhere: `mask` true = MAY attend. The exception is
// `key_padding_mask`, whose name says what true means: true = this key is
// padding and is ignored (the same as PyTorch).
#pragma once

#include <atomic>
#include <concepts>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attn/kv_cache.hpp"
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
  bool sinks = false;      // a learnable sink logit per head, parameter "sinks" [H]
};

// Everything the forward reads. key and value both empty means
// self-attention: key = value = query, one packed projection, and backward
// returns the total gradient of the input in dquery.
// ScoreArgs: mask (Bm, Hm, L, S) and bias (Bb, Hb, L, S) broadcastable
// (true = may attend; the bias is added to the scores), the per-head slopes
// (H); sinks must be empty (the layer's own parameter).
template <class T>
struct MhaArgs : ScoreArgs<T> {
  View3<const T> query;                 // (B, L, D)
  View3<const T> key{};                 // (B, S, kdim)
  View3<const T> value{};               // (B, S, vdim)
  View2<const bool> key_padding_mask{}; // (B, S); true = padding, ignored
  View1<const int64_t> key_lengths{};   // (B)
};

// Everything the forward writes. `out` is required; the weights, per head
// or averaged over heads (PyTorch's average_attn_weights), when given.
template <class T>
struct MhaOutputs {
  View3<T> out;             // (B, L, D)
  View4<T> head_weights{};  // (B, H, L, S)
  View3<T> avg_weights{};   // (B, L, S)
};

// Input gradients, each optional; overwritten, never accumulated into.
template <class T>
struct MhaGrads {
  View3<T> dquery;    // (B, L, D); after self-attention the total gradient of x
  View3<T> dkey{};    // (B, S, kdim); empty after self-attention
  View3<T> dvalue{};  // (B, S, vdim); empty after self-attention
};

// The attention options, passed to scaled_dot_product_attention (and to
// decode_attention) unchanged; check_finite also covers the layer's own
// inputs and dout. Attention dropout (sdpa.dropout_p, dropout_seed,
// dropout_offset) is a training forward's: the saved state keeps the
// options, so backward regenerates the forward's mask; decode refuses it.
// The layer's attention is one call over all heads, so the weight dropped
// at (b, h, i, j) is the dense call's on the projected q, k, v.
// sdpa.compute_dtype = bfloat16 (float layers) gives the projections'
// products bfloat16 operands too, forward and backward, with float32 sums
// and float32 parameters, gradients and outputs (the products of autocast
// in PyTorch); decode keeps float32 projections.
struct MhaOptions {
  SdpaOptions sdpa;
};

// A transform of the projected queries and keys before the attention, in
// place, e.g. rotary position embeddings. q is (B, H, L, E), k (B, H, S, E),
// any strides; axis 2 is the position in the sequence. `backward` receives
// the gradients with respect to the transformed Q and K and must overwrite
// them with the gradients with respect to the projections (for a linear
// transform: apply its transpose). Both run inside forward/backward, on the
// calling thread, and must not keep the views.
//
// `forward_at` is the same forward for rows at positions p, p + 1, ... of one
// sequence (q, k (1, H, L, E), p = first_position): decode() applies it to
// each sequence's new rows, which sit after the cache's earlier ones. A layer
// with a `forward` but no `forward_at` refuses to decode.
template <class T>
struct QkTransform {
  std::function<void(View4<T> q, View4<T> k)> forward;
  std::function<void(View4<T> dq, View4<T> dk)> backward;
  std::function<void(View4<T> q, View4<T> k, int64_t first_position)> forward_at{};
};

// What the forward saves for the backward. It owns everything (copies of
// the inputs and masks), so the caller's buffers may be reused or freed
// between forward and backward.
template <class T>
struct MhaSaved {
  int64_t B = 0, L = 0, S = 0;   // shapes of the forward call
  int64_t H = 0, E = 0, Ev = 0;  // the layer's heads
  bool self_attention = false;
  Tensor<T> query, key, value;   // inputs, dense (B, N, width); self-attention: query only
  // The projections after the Q/K transform, q (B, H, L, E), k (B, H, S, E)
  // and v (B, H, S, Ev). Float32 products: head-major in `proj`, each
  // contiguous, one after the other (the attention reads each head's rows
  // densely). bfloat16 products (heads_in_packed): where the GEMMs wrote
  // them in `packed`, each head a strided view (that attention copies its
  // operands into its own layouts, so a dense copy would be a pass for
  // nothing); `proj` is then empty. q(), k(), v() view either.
  Tensor<T> proj;
  Tensor<T> packed;              // the projections as the GEMMs write them (float32 products: scratch)
  bool heads_in_packed = false;
  Tensor<T> attn_out;            // concatenated head outputs, (B, L, H·Ev)
  Tensor<T> lse;                 // (B, H, L)
  Tensor<bool> mask;             // mask combined with key_padding_mask, in its broadcast shape
  Tensor<T> bias;                // bias, in its broadcast shape
  Tensor<int64_t> key_lengths;   // (B)
  std::vector<Tensor<T>> per_head;  // copies of ScoreArgs' per-head operands ((H) each; rank 0: not given)
  MhaOptions options;

  bool filled() const { return B > 0; }
  // Per-head views (B, H, N, E|Ev) of the saved projections.
  View4<const T> q() const { return head(0, L, E); }
  View4<const T> k() const { return head(1, S, E); }
  View4<const T> v() const { return head(2, S, Ev); }

 private:
  View4<const T> head(int part, int64_t N, int64_t F) const {
    const int64_t offset = part == 0 ? 0 : B * L * H * E + (part == 2 ? B * S * H * E : 0);
    if (!heads_in_packed) return View4<const T>::bhnd(proj.data() + offset, B, H, N, F);
    // packed: self-attention's rows [q | k | v] (2·H·E + H·Ev wide), else q, k, v one after the other
    const int64_t ld = self_attention ? 2 * H * E + H * Ev : part == 2 ? H * Ev : H * E;
    return View4<const T>(packed.data() + (self_attention ? part * H * E : offset), {B, H, N, F},
                          {N * ld, F, ld, 1});
  }
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

  bool has_sinks() const { return cfg_.sinks; }

  // Parameters and their gradients, by PyTorch state_dict name ("sinks"
  // last, when the layer has them).
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

  // The Q/K transform applied by every later forward and backward (empty
  // functions: none, the default).
  void set_qk_transform(QkTransform<T> transform) { qk_ = std::move(transform); }

  // Forward: query (B, L, D), key (B, S, kdim), value (B, S, vdim) -> out
  // (B, L, D), or self-attention when key and value are empty. When `saved`
  // is given it receives what backward needs. Without it (inference) the
  // call's buffers come from the layer's spare state, which one call holds
  // at a time: a call that finds it taken (several threads calling forward
  // on one layer at once, which is safe) allocates its own, and the state
  // goes back to the layer when the call ends, so it holds the buffers of
  // the last such call until the next one or the layer's end.
  void forward(const MhaArgs<T>& args, const MhaOutputs<T>& outputs, const MhaOptions& opt = {},
               MhaSaved<T>* saved = nullptr) const;

  // Incremental decoding (self-attention; float only): args.query (B, L, D)
  // holds the next L tokens of each of the KV cache's B sequences
  // (attn/kv_cache.hpp; kv_heads = H, head_dim = E, value_dim = Ev). The
  // layer projects them, applies the Q/K transform's forward_at at positions
  // length(b) .. length(b) + L − 1, appends their keys and values to `cache`,
  // attends over everything the cache holds (decode_attention) and projects
  // the result into out (B, L, D). With opt.sdpa.causal the rows equal
  // forward() with causal over the whole sequence so far (one token per
  // sequence needs no causal rule: it sees every key either way).
  //   taken: every rule of opt.sdpa as decode_attention takes it (backend
  //          reference, or else the decode kernel; check_finite also of the
  //          query and of its projections, before they reach the cache);
  //          the layer's sinks; args' mask, bias and slopes, the mask and
  //          bias as (B|1, H|1, L|1, C|1) over the cache's key positions
  //          (C = capacity; see DecodeArgs)
  //   refused: key, value, key_padding_mask, key_lengths, position_offset
  // Only MultiheadAttention<float> decodes (the cache stores float32 or
  // narrower).
  // Every argument, and whether the cache can take L more tokens of each
  // sequence (capacity, pages), is checked before the cache changes, so an
  // error leaves the cache as it was.
  void decode(const MhaArgs<T>& args, KVCache& cache, View3<T> out, const MhaOptions& opt = {}) const
    requires std::same_as<T, float>;

  // Backward from dout = dL/dY (B, L, D) of the forward that filled `saved`.
  // Parameter gradients are ADDED to grad(name) (call zero_grad() between
  // steps); the input gradients given are overwritten.
  void backward(const MhaSaved<T>& saved, View3<const T> dout, const MhaGrads<T>& grads = {});

 private:
  MultiheadConfig cfg_;
  bool packed_ = false;
  std::map<std::string, Tensor<T>> params_;
  std::map<std::string, Tensor<T>> grads_;
  QkTransform<T> qk_;
  // The backward's buffers, reused from call to call: dY of the attention
  // and the projections' gradients in the GEMM layout, and dense-head
  // copies of dY, Y and the gradients for the attention.
  Tensor<T> d_attn_, dproj_, heads_dy_, heads_y_, heads_dproj_;
  // The inference forwards' state, lent to one call at a time (forward
  // without `saved`): allocating it afresh took 1.05-1.07x the time of the
  // float32 forward at (8, 128, 256, 4) and (1, 2048, 768, 12), a page fault
  // per page. A copy or move of the layer starts without one.
  class Spare {
   public:
    Spare() = default;
    Spare(const Spare&) {}
    Spare& operator=(const Spare&) { return *this; }
    ~Spare() { delete state_.load(); }
    // The state, or a new one when another call holds it.
    std::unique_ptr<MhaSaved<T>> take() const {
      std::unique_ptr<MhaSaved<T>> s(state_.exchange(nullptr));
      return s ? std::move(s) : std::make_unique<MhaSaved<T>>();
    }
    // Back to the layer (replacing the state of a concurrent call returned first).
    void give(std::unique_ptr<MhaSaved<T>> s) const { delete state_.exchange(s.release()); }

   private:
    mutable std::atomic<MhaSaved<T>*> state_{nullptr};
  };
  Spare spare_;
};

}  // namespace attn
