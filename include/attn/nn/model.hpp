// attn/nn/model.hpp — a small pre-LayerNorm transformer built from the layers
// in attn/nn/layers.hpp.
//
//   h_0 = Embed(tokens) [+ positions]                 (B·N, D)
//   for each block l:
//     a   = h + Attn(LN1(h))                          residual 1
//     h'  = a + MLP(LN2(a))                           residual 2
//   logits = LN_f(h_L)·W_headᵀ + b_head               (B·N, V)
//
// Parameter names (the checkpoint keys) follow PyTorch's nesting:
//   embed.weight, pos.weight (learned only), blocks.<l>.ln1.{weight,bias},
//   blocks.<l>.attn.{in_proj_weight,in_proj_bias,out_proj.weight,out_proj.bias},
//   blocks.<l>.attn.sinks (with sinks only),
//   blocks.<l>.ln2.*, blocks.<l>.mlp.{fc1,fc2}.{weight,bias}, ln_f.*, head.*
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attn/kv_cache.hpp"
#include "attn/nn/layers.hpp"

namespace attn::nn {

// The arithmetic of training and evaluation. fp32: float32 throughout. bf16
// (mixed precision): the parameters, their gradients and the optimizer
// state stay float32, and every attention call computes its products
// (Q·Kᵀ, P·V, and the backward's) with bfloat16 operands summed in float32
// (SdpaOptions::compute_dtype = bfloat16), as do the attention layers'
// projection GEMMs (MhaOptions); the GEMMs of the MLP and the head stay
// float32.
enum class Precision { fp32, bf16 };
const char* precision_name(Precision p);
Precision parse_precision(const std::string& name);  // throws attn::InvalidArgument

struct ModelConfig {
  int64_t vocab = 0;    // V
  int64_t max_len = 0;  // longest sequence N
  int64_t dim = 64;     // D
  int64_t heads = 4;    // H (E = D / H)
  int64_t layers = 2;
  int64_t mlp_hidden = 0;  // 0 = 4·D
  Positions positions = Positions::sinusoidal;
  bool causal = false;
  Window window;       // sliding window of every attention layer; default unbounded
  int64_t chunk_size = 0;  // chunked attention in every layer (SdpaOptions::chunk_size); 0 = off
  bool sinks = false;  // a learnable sink logit per head in every attention layer
  std::optional<double> attn_scale;  // default 1/√E; 1.0 = no scaling
  Backend backend = Backend::automatic;
  // Attention dropout probability (0 <= dropout < 1) of training forwards,
  // those given a DropoutKey; evaluation and decoding drop nothing.
  double dropout = 0;
  // bf16: bfloat16 products in every attention layer (Transformer<float>
  // only; not with Backend::reference, which is exact).
  Precision precision = Precision::fp32;

  // Throws attn::InvalidArgument naming the field when a value is out of range.
  void validate() const;
};

// The names and shapes Transformer::parameters() lists for a model of this
// configuration, computed without building it: a checkpoint is checked
// against them before anything is allocated.
using ParameterShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;
ParameterShapes parameter_shapes(const ModelConfig& config);

// Which attention weights a training forward drops (ModelConfig::dropout):
// block l draws its mask with SdpaOptions::dropout_seed = seed and
// dropout_offset = offset + l, so every block has its own and backward()
// regenerates them. A training loop gives each step a fresh key.
struct DropoutKey {
  uint64_t seed = 0, offset = 0;
};

template <class T>
struct TransformerBlock {
  LayerNorm<T> ln1, ln2;
  SelfAttention<T> attn;
  Mlp<T> mlp;
  Tensor<T> x1, a, x2;  // saved: LN1(h), h + attn, LN2(a)
};

// The state of incremental decoding: one KV cache per block holding the keys
// and values of every token fed so far, and how many tokens that is.
struct DecodeState {
  std::vector<KVCache> caches;  // per block: (B, H, capacity = max_len, E)
  int64_t B = 0;
  int64_t length = 0;  // tokens fed per sequence
};

template <class T>
class Transformer {
 public:
  explicit Transformer(const ModelConfig& config, uint64_t seed = 0);
  const ModelConfig& config() const { return cfg_; }

  // Seeded initialisation: the same seed gives the same parameters bit for bit.
  void reset_parameters(uint64_t seed);

  // tokens (B·N ids, row-major (B, N)) -> logits (B·N, V). When `attention`
  // is given it receives one (B, H, N, N) tensor of weights per layer (with
  // dropout: the dropped ones, what multiplies V). With `dropout` (a training
  // step) attention weights are dropped with probability config().dropout;
  // without it (evaluation) none are.
  void forward(const int32_t* tokens, int64_t B, int64_t N, Tensor<T>& logits,
               std::vector<Tensor<T>>* attention = nullptr, std::optional<DropoutKey> dropout = std::nullopt);
  // dlogits (B·N, V) from the loss; ADDS every parameter gradient (through
  // the forward's dropout masks).
  void backward(const Tensor<T>& dlogits);

  // forward + cross-entropy (+ backward when `with_grad`); gradients are
  // added, so call zero_grad() first.
  CrossEntropyResult loss(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t N,
                          bool with_grad, std::optional<DropoutKey> dropout = std::nullopt);

  // Incremental decoding (causal models, float32; every kind of positions,
  // windows and sinks): start_decoding makes the
  // caches (storage float32, float16 or bfloat16; page_size > 0 pages them);
  // decode_step feeds the next n tokens of every sequence (tokens (B, n),
  // row-major), appends their keys and values to the caches and writes the
  // logits (B·n, V) of those positions: the rows forward() would give for
  // them on the whole prefix, without recomputing the prefix.
  DecodeState start_decoding(int64_t B, Dtype dtype = Dtype::float32, int64_t page_size = 0) const
    requires std::same_as<T, float>;
  void decode_step(DecodeState& state, const int32_t* tokens, int64_t n, Tensor<T>& logits)
    requires std::same_as<T, float>;

  std::vector<ParamRef<T>> parameters();
  void zero_grad();
  int64_t num_parameters();

  std::vector<TransformerBlock<T>>& blocks() { return blocks_; }

 private:
  ModelConfig cfg_;
  Embedding<T> embed_;
  LearnedPositions<T> pos_;
  std::vector<TransformerBlock<T>> blocks_;
  LayerNorm<T> ln_f_;
  Linear<T> head_;
  // Saved by forward: the tokens, the residual stream entering each block
  // (hs_[l], with hs_[layers] the last block's output) and LN_f's output.
  std::vector<int32_t> tokens_;
  int64_t B_ = 0, N_ = 0;
  std::vector<Tensor<T>> hs_;
  Tensor<T> hf_;
};

}  // namespace attn::nn
