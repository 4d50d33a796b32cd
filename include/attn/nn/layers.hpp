// attn/nn/layers.hpp — the layers of a small transformer, each with an
// explicit forward and backward (no autograd).
//
// Conventions
// -----------
// Token activations are contiguous row-major matrices (M, D) with M = B·N
// rows (batch B, sequence N, row b·N + n); layers that need the sequence
// structure (positions, attention) take B and N explicitly.
//
// A layer's forward(x, ..., y) writes y and keeps in the layer whatever its
// backward needs beyond x (LayerNorm's row statistics, the MLP's hidden
// activations, attention's projections and log-sum-exp). backward(x, dy, dx)
// receives the same x again, ADDS the parameter gradients into the layer's
// grad tensors (call zero_grad between steps) and OVERWRITES dx (dx may be
// null when the input gradient is not needed). One forward, then its
// backward: a second forward replaces the saved state.
//
// Every layer is a template on the scalar type; float trains, double is used
// by the finite-difference gradient checks.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/multihead.hpp"
#include "attn/rng.hpp"
#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"

namespace attn::nn {

// The library's generator (attn/rng.hpp), under the names the layers use.
using attn::derive_seed;
using attn::Rng;

// A parameter as the optimizers and checkpoints see it.
template <class T>
struct ParamRef {
  std::string name;
  Tensor<T>* value = nullptr;
  Tensor<T>* grad = nullptr;
  bool decay = false;  // weight decay applies (matrices of linear maps only)
};

// y = x·Wᵀ + b. weight [out, in], bias [out] (PyTorch layout).
template <class T>
class Linear {
 public:
  Linear() = default;
  Linear(int64_t in_features, int64_t out_features, bool bias = true);
  // PyTorch's default: W, b ~ U(-1/√in, 1/√in).
  void reset_parameters(Rng& rng);
  void forward(const Tensor<T>& x, Tensor<T>& y) const;  // (M, in) -> (M, out)
  void backward(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>* dx);
  void zero_grad();
  void collect(const std::string& prefix, std::vector<ParamRef<T>>& out);

  int64_t in_features = 0, out_features = 0;
  bool has_bias = true;
  Tensor<T> weight, bias, dweight, dbias;
};

// Token embedding: row t of weight [V, D] for token t.
template <class T>
class Embedding {
 public:
  Embedding() = default;
  Embedding(int64_t vocab, int64_t dim);
  void reset_parameters(Rng& rng);  // N(0, 1), as PyTorch
  // tokens: M ids in [0, V); y (M, D). Throws on an id out of range.
  void forward(const int32_t* tokens, int64_t M, Tensor<T>& y) const;
  void backward(const int32_t* tokens, int64_t M, const Tensor<T>& dy);
  void zero_grad();
  void collect(const std::string& prefix, std::vector<ParamRef<T>>& out);

  int64_t vocab = 0, dim = 0;
  Tensor<T> weight, dweight;
};

// Positional information: none, sinusoidal (added to the embeddings),
// learned (a trained [max_len, D] table added to the embeddings), rotary
// (RoPE: Q and K of every head rotated by a position-dependent angle) or
// ALiBi (no embedding: head h's scores get -slope_h·|i - j|, with the
// standard slopes attn::alibi_slopes(H)).
enum class Positions { none, sinusoidal, learned, rope, alibi };
const char* positions_name(Positions p);
Positions parse_positions(const std::string& name);  // throws attn::InvalidArgument

// x (B·N, D) += PE(n, ·) with PE(n, 2i) = sin(n·ω_i), PE(n, 2i+1) = cos(n·ω_i),
// ω_i = 10000^(-2i/D). Its backward is the identity. `offset`: the N rows
// are positions offset .. offset + N − 1 (incremental decoding).
template <class T>
void add_sinusoidal_positions(Tensor<T>& x, int64_t B, int64_t N, int64_t offset = 0);

// x (B·N, D) += P[n] for a trained table P [max_len, D].
template <class T>
class LearnedPositions {
 public:
  LearnedPositions() = default;
  LearnedPositions(int64_t max_len, int64_t dim);
  void reset_parameters(Rng& rng);  // N(0, 1)
  void forward(Tensor<T>& x, int64_t B, int64_t N, int64_t offset = 0) const;  // in place; positions offset + n
  void backward(const Tensor<T>& dx, int64_t B, int64_t N);
  void zero_grad();
  void collect(const std::string& prefix, std::vector<ParamRef<T>>& out);

  int64_t max_len = 0, dim = 0;
  Tensor<T> weight, dweight;
};

// Rotary embedding of a (B, H, N, E) view, E even: each feature pair
// (2i, 2i+1) of position n is rotated by the angle n·θ_i, θ_i = 10000^(-2i/E).
// The rotation is orthogonal, so the backward is the rotation by -n·θ_i
// (inverse = true). In place; any strides. Position n of the view is
// position offset + n of the sequence.
template <class T>
void apply_rotary(View4<T> x, bool inverse = false, int64_t offset = 0);

// LayerNorm over the last axis: y = (x - mean)/sqrt(var + eps)·γ + β.
template <class T>
class LayerNorm {
 public:
  LayerNorm() = default;
  explicit LayerNorm(int64_t dim, double eps = 1e-5);
  void reset_parameters();  // γ = 1, β = 0
  void forward(const Tensor<T>& x, Tensor<T>& y);
  void backward(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>* dx);
  void zero_grad();
  void collect(const std::string& prefix, std::vector<ParamRef<T>>& out);

  int64_t dim = 0;
  double eps = 1e-5;
  Tensor<T> weight, bias, dweight, dbias;

 private:
  std::vector<T> mean_, rstd_;  // per row, saved by forward
};

// GELU, the exact form x·Φ(x) (Φ the standard normal CDF).
template <class T>
void gelu_forward(const T* x, T* y, int64_t n);
template <class T>
void gelu_backward(const T* x, const T* dy, T* dx, int64_t n);

// Two-layer perceptron: y = fc2(GELU(fc1(x))), hidden width `hidden`.
template <class T>
class Mlp {
 public:
  Mlp() = default;
  Mlp(int64_t dim, int64_t hidden);
  void reset_parameters(Rng& rng);
  void forward(const Tensor<T>& x, Tensor<T>& y);
  void backward(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>* dx);
  void zero_grad();
  void collect(const std::string& prefix, std::vector<ParamRef<T>>& out);

  Linear<T> fc1, fc2;

 private:
  Tensor<T> pre_, act_;  // fc1 output and its GELU, saved by forward
};

// Attention dropout of one training forward: the probability and the
// (seed, offset) that pick the dropped weights (SdpaOptions::dropout_p,
// dropout_seed, dropout_offset); p = 0 drops nothing.
struct AttentionDropout {
  double p = 0;
  uint64_t seed = 0, offset = 0;
};

// Multi-head self-attention inside a transformer block: a thin wrapper over
// attn::MultiheadAttention (packed projections, parameters named and laid
// out as torch.nn.MultiheadAttention's state_dict, PyTorch's initialisation)
// that adapts it to the nn conventions above ((B·N, D) activations, the
// forward's state kept here). `positions` rope installs rotary position
// embeddings as the layer's Q/K transform, alibi passes the standard ALiBi
// slopes to every forward (the other schemes act on the embeddings, outside
// this layer); `sinks` gives the layer its learnable per-head sink logits
// (parameter "sinks" [H]). Every attention option (scale, causal, window,
// chunk_size, backend, threads, ...) is the layer's own MhaOptions.
template <class T>
class SelfAttention {
 public:
  SelfAttention(int64_t dim, int64_t heads, const MhaOptions& opt = {}, Positions positions = Positions::none,
                bool sinks = false);
  // Draws a seed from `rng` and initialises as MultiheadAttention does.
  void reset_parameters(Rng& rng);
  // x (B·N, D) -> y (B·N, D). `weights`, when non-empty, receives the
  // attention matrices (B, H, N, N). The attention runs with `options`, its
  // dropout fields replaced by `dropout` (none by default); backward
  // regenerates the same mask.
  void forward(const Tensor<T>& x, int64_t B, int64_t N, Tensor<T>& y, View4<T> weights = {},
               const AttentionDropout& dropout = {});
  void backward(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>* dx);
  // Incremental decoding (MultiheadAttention::decode, float only): x (B·n, D)
  // holds the next n tokens of each of the cache's B sequences; their keys
  // and values join `cache`, y (B·n, D) gets their attention over it
  // (inference: nothing is dropped).
  void decode(const Tensor<T>& x, int64_t B, int64_t n, KVCache& cache, Tensor<T>& y) const
    requires std::same_as<T, float>;
  void zero_grad() { layer.zero_grad(); }
  void collect(const std::string& prefix, std::vector<ParamRef<T>>& out);

  // Statistics of the last forward's attention, for the scale experiment:
  // the standard deviation of the scaled scores scale·q·k over all visible
  // (query, key) pairs, and the mean over query rows of the largest weight.
  struct ScoreStats {
    double score_std = 0, mean_top_weight = 0;
  };
  ScoreStats score_stats() const;

  MultiheadAttention<T> layer;
  MhaOptions options;
  bool rope = false;
  Tensor<T> alibi_slopes;  // (H) with ALiBi positions, else empty

 private:
  MhaSaved<T> cache_;  // the last forward's state
};

// Softmax cross-entropy over the rows of logits (M, V) against targets
// (M ids; a negative target marks a row that does not count). Returns the
// mean loss over the counted rows and how many argmaxes were right; when
// dlogits is given it receives d(mean loss)/d(logits) (0 on ignored rows).
struct CrossEntropyResult {
  double loss = 0;
  int64_t count = 0, correct = 0;
};
template <class T>
CrossEntropyResult softmax_cross_entropy(const Tensor<T>& logits, const int32_t* targets,
                                         Tensor<T>* dlogits);

}  // namespace attn::nn
