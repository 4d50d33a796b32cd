// The transformer's layers, forward and backward side by side.
//
// Dimensions: M = B·N token rows, D model width, H heads of E = D/H features,
// V vocabulary, F hidden width of the MLP. All matrices are row-major; every
// product goes through the row-major GEMM helper (OpenBLAS), every reduction
// that is not a GEMM (norm statistics, softmax, bias sums) is accumulated in
// double so float and double differ only in storage rounding.
#include "attn/nn/layers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "kernels/gemm/gemm.hpp"
#include "nn/common.hpp"

namespace attn::nn {

using detail::gemm;

// ------------------------------------------------------------- Linear ----

template <class T>
Linear<T>::Linear(int64_t in, int64_t out, bool with_bias)
    : in_features(in), out_features(out), has_bias(with_bias), weight({out, in}), dweight({out, in}) {
  if (in < 1 || out < 1)
    throw Error("attn::nn::Linear: in_features and out_features must be >= 1, got " +
                std::to_string(in) + " and " + std::to_string(out));
  if (with_bias) {
    bias = Tensor<T>({out});
    dbias = Tensor<T>({out});
  }
}

template <class T>
void Linear<T>::reset_parameters(Rng& rng) {
  const double bound = 1.0 / std::sqrt(double(in_features));
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = T(rng.uniform(-bound, bound));
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = T(rng.uniform(-bound, bound));
}

template <class T>
void Linear<T>::forward(const Tensor<T>& x, Tensor<T>& y) const {
  const int64_t M = rows_of(x, in_features, "attn::nn::Linear::forward", "x");
  ensure_shape(y, {M, out_features});
  // y = x·Wᵀ
  gemm<T>({M, out_features, in_features}, false, x.data(), in_features, true, weight.data(),
          in_features, y.data(), out_features);
  // y += b (each row)
  if (has_bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t o = 0; o < out_features; ++o) y[size_t(m * out_features + o)] += bias[size_t(o)];
}

template <class T>
void Linear<T>::backward(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>* dx) {
  const int64_t M = rows_of(x, in_features, "attn::nn::Linear::backward", "x");
  rows_of(dy, out_features, "attn::nn::Linear::backward", "dy");
  // dW += dyᵀ·x
  gemm<T>({out_features, in_features, M}, true, dy.data(), out_features, false, x.data(),
          in_features, dweight.data(), in_features, T(1), T(1));
  // db += Σ_rows dy
  if (has_bias) add_column_sums(dy, M, out_features, dbias);
  // dx = dy·W
  if (dx) {
    ensure_shape(*dx, {M, in_features});
    gemm<T>({M, in_features, out_features}, false, dy.data(), out_features, false, weight.data(),
            in_features, dx->data(), in_features);
  }
}

template <class T>
void Linear<T>::zero_grad() {
  dweight.fill(T(0));
  dbias.fill(T(0));
}

template <class T>
void Linear<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  out.push_back({prefix + "weight", &weight, &dweight, true});
  if (has_bias) out.push_back({prefix + "bias", &bias, &dbias, false});
}

// ---------------------------------------------------------- Embedding ----

template <class T>
Embedding<T>::Embedding(int64_t v, int64_t d) : vocab(v), dim(d), weight({v, d}), dweight({v, d}) {
  if (v < 1 || d < 1)
    throw Error("attn::nn::Embedding: vocab and dim must be >= 1, got " + std::to_string(v) +
                " and " + std::to_string(d));
}

template <class T>
void Embedding<T>::reset_parameters(Rng& rng) {
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = T(rng.normal());
}

template <class T>
void Embedding<T>::forward(const int32_t* tokens, int64_t M, Tensor<T>& y) const {
  check_tokens(tokens, M, vocab, "attn::nn::Embedding::forward");
  ensure_shape(y, {M, dim});
  // y[m] = W[token m]
  for (int64_t m = 0; m < M; ++m)
    std::copy_n(weight.data() + int64_t(tokens[m]) * dim, dim, y.data() + m * dim);
}

template <class T>
void Embedding<T>::backward(const int32_t* tokens, int64_t M, const Tensor<T>& dy) {
  rows_of(dy, dim, "attn::nn::Embedding::backward", "dy");
  // dW[token m] += dy[m]
  for (int64_t m = 0; m < M; ++m) {
    T* g = dweight.data() + int64_t(tokens[m]) * dim;
    const T* d = dy.data() + m * dim;
    for (int64_t j = 0; j < dim; ++j) g[j] += d[j];
  }
}

template <class T>
void Embedding<T>::zero_grad() {
  dweight.fill(T(0));
}

template <class T>
void Embedding<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  out.push_back({prefix + "weight", &weight, &dweight, false});
}

// ---------------------------------------------------------- Positions ----

const char* positions_name(Positions p) {
  switch (p) {
    case Positions::none: return "none";
    case Positions::sinusoidal: return "sinusoidal";
    case Positions::learned: return "learned";
    case Positions::rope: return "rope";
  }
  return "?";
}

Positions parse_positions(const std::string& name) {
  if (name == "none") return Positions::none;
  if (name == "sinusoidal") return Positions::sinusoidal;
  if (name == "learned") return Positions::learned;
  if (name == "rope") return Positions::rope;
  throw Error("attn::nn::parse_positions: unknown positions '" + name +
              "', expected one of none, sinusoidal, learned, rope");
}

template <class T>
void add_sinusoidal_positions(Tensor<T>& x, int64_t B, int64_t N, int64_t offset) {
  if (x.rank() != 2 || x.dim(0) != B * N)
    throw Error("attn::nn::add_sinusoidal_positions: x must be (B·N, D) = (" + std::to_string(B * N) +
                ", D)");
  const int64_t D = x.dim(1);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) {
      // ω_i = 10000^(-2i/D) for the pair i = d/2
      const double w = std::pow(10000.0, -double(2 * (d / 2)) / double(D));
      const double pos = double(offset + n);
      const T pe = T(d % 2 == 0 ? std::sin(pos * w) : std::cos(pos * w));
      for (int64_t b = 0; b < B; ++b) x[size_t((b * N + n) * D + d)] += pe;
    }
}

template <class T>
LearnedPositions<T>::LearnedPositions(int64_t len, int64_t d)
    : max_len(len), dim(d), weight({len, d}), dweight({len, d}) {}

template <class T>
void LearnedPositions<T>::reset_parameters(Rng& rng) {
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = T(rng.normal());
}

template <class T>
void LearnedPositions<T>::forward(Tensor<T>& x, int64_t B, int64_t N, int64_t offset) const {
  if (offset < 0 || offset + N > max_len)
    throw Error("attn::nn::LearnedPositions::forward: positions " + std::to_string(offset) + ".." +
                std::to_string(offset + N - 1) + " exceed max_len " + std::to_string(max_len));
  rows_of(x, dim, "attn::nn::LearnedPositions::forward", "x");
  // x[b, n] += P[n]
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t d = 0; d < dim; ++d) x[size_t((b * N + n) * dim + d)] += weight[size_t((offset + n) * dim + d)];
}

template <class T>
void LearnedPositions<T>::backward(const Tensor<T>& dx, int64_t B, int64_t N) {
  // dP[n] += Σ_b dx[b, n]
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t d = 0; d < dim; ++d) dweight[size_t(n * dim + d)] += dx[size_t((b * N + n) * dim + d)];
}

template <class T>
void LearnedPositions<T>::zero_grad() {
  dweight.fill(T(0));
}

template <class T>
void LearnedPositions<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  out.push_back({prefix + "weight", &weight, &dweight, false});
}

template <class T>
void apply_rotary(View4<T> x, bool inverse, int64_t offset) {
  const int64_t B = x.dim(0), H = x.dim(1), N = x.dim(2), E = x.dim(3);
  if (E % 2 != 0)
    throw Error("attn::nn::apply_rotary: head dimension E = " + std::to_string(E) +
                " must be even (features rotate in pairs)");
  const double sign = inverse ? -1.0 : 1.0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < E / 2; ++i) {
      // angle n·θ_i with θ_i = 10000^(-2i/E)
      const double ang = double(offset + n) * std::pow(10000.0, -double(2 * i) / double(E));
      const double c = std::cos(ang), s = sign * std::sin(ang);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
          T& x0 = x(b, h, n, 2 * i);
          T& x1 = x(b, h, n, 2 * i + 1);
          const double a0 = double(x0), a1 = double(x1);
          // (x0, x1) ← (x0·cos − x1·sin, x0·sin + x1·cos)
          x0 = T(a0 * c - a1 * s);
          x1 = T(a0 * s + a1 * c);
        }
    }
}

// ---------------------------------------------------------- LayerNorm ----

template <class T>
LayerNorm<T>::LayerNorm(int64_t d, double e)
    : dim(d), eps(e), weight({d}), bias({d}), dweight({d}), dbias({d}) {
  reset_parameters();
}

template <class T>
void LayerNorm<T>::reset_parameters() {
  weight.fill(T(1));
  bias.fill(T(0));
}

template <class T>
void LayerNorm<T>::forward(const Tensor<T>& x, Tensor<T>& y) {
  const int64_t M = rows_of(x, dim, "attn::nn::LayerNorm::forward", "x");
  ensure_shape(y, {M, dim});
  mean_.resize(size_t(M));
  rstd_.resize(size_t(M));
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x.data() + m * dim;
    T* yr = y.data() + m * dim;
    double mu = 0;
    for (int64_t j = 0; j < dim; ++j) mu += double(xr[j]);
    mu /= double(dim);
    double var = 0;
    for (int64_t j = 0; j < dim; ++j) var += (double(xr[j]) - mu) * (double(xr[j]) - mu);
    var /= double(dim);
    const double rs = 1.0 / std::sqrt(var + eps);
    mean_[size_t(m)] = T(mu);
    rstd_[size_t(m)] = T(rs);
    // y = x̂·γ + β with x̂ = (x − μ)·rstd
    for (int64_t j = 0; j < dim; ++j)
      yr[j] = T((double(xr[j]) - mu) * rs * double(weight[size_t(j)]) + double(bias[size_t(j)]));
  }
}

template <class T>
void LayerNorm<T>::backward(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>* dx) {
  const int64_t M = rows_of(x, dim, "attn::nn::LayerNorm::backward", "x");
  rows_of(dy, dim, "attn::nn::LayerNorm::backward", "dy");
  if (dx) ensure_shape(*dx, {M, dim});
  std::vector<double> xhat(static_cast<size_t>(dim)), g(static_cast<size_t>(dim));
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x.data() + m * dim;
    const T* dyr = dy.data() + m * dim;
    const double mu = double(mean_[size_t(m)]), rs = double(rstd_[size_t(m)]);
    double mean_g = 0, mean_gx = 0;
    for (int64_t j = 0; j < dim; ++j) {
      xhat[size_t(j)] = (double(xr[j]) - mu) * rs;
      // dγ += dy·x̂, dβ += dy
      dweight[size_t(j)] += T(double(dyr[j]) * xhat[size_t(j)]);
      dbias[size_t(j)] += dyr[j];
      g[size_t(j)] = double(dyr[j]) * double(weight[size_t(j)]);  // dx̂ = dy·γ
      mean_g += g[size_t(j)];
      mean_gx += g[size_t(j)] * xhat[size_t(j)];
    }
    mean_g /= double(dim);
    mean_gx /= double(dim);
    // dx = rstd · (dx̂ − mean(dx̂) − x̂ · mean(dx̂ · x̂))
    if (dx)
      for (int64_t j = 0; j < dim; ++j)
        (*dx)[size_t(m * dim + j)] = T(rs * (g[size_t(j)] - mean_g - xhat[size_t(j)] * mean_gx));
  }
}

template <class T>
void LayerNorm<T>::zero_grad() {
  dweight.fill(T(0));
  dbias.fill(T(0));
}

template <class T>
void LayerNorm<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  out.push_back({prefix + "weight", &weight, &dweight, false});
  out.push_back({prefix + "bias", &bias, &dbias, false});
}

// --------------------------------------------------------------- GELU ----

template <class T>
void gelu_forward(const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = double(x[i]);
    // y = x·Φ(x) = x·(1 + erf(x/√2))/2
    y[i] = T(0.5 * v * (1.0 + std::erf(v * std::numbers::sqrt2 / 2)));
  }
}

template <class T>
void gelu_backward(const T* x, const T* dy, T* dx, int64_t n) {
  const double inv_sqrt_2pi = 0.5 * std::numbers::inv_sqrtpi * std::numbers::sqrt2;
  for (int64_t i = 0; i < n; ++i) {
    const double v = double(x[i]);
    // dy/dx = Φ(x) + x·φ(x)
    const double d = 0.5 * (1.0 + std::erf(v * std::numbers::sqrt2 / 2)) + v * inv_sqrt_2pi * std::exp(-0.5 * v * v);
    dx[i] = T(double(dy[i]) * d);
  }
}

// ---------------------------------------------------------------- MLP ----

template <class T>
Mlp<T>::Mlp(int64_t dim, int64_t hidden) : fc1(dim, hidden), fc2(hidden, dim) {}

template <class T>
void Mlp<T>::reset_parameters(Rng& rng) {
  fc1.reset_parameters(rng);
  fc2.reset_parameters(rng);
}

template <class T>
void Mlp<T>::forward(const Tensor<T>& x, Tensor<T>& y) {
  fc1.forward(x, pre_);
  ensure_shape(act_, pre_.shape());
  gelu_forward(pre_.data(), act_.data(), int64_t(pre_.size()));
  fc2.forward(act_, y);
}

template <class T>
void Mlp<T>::backward(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>* dx) {
  Tensor<T> dact, dpre(pre_.shape());
  fc2.backward(act_, dy, &dact);
  gelu_backward(pre_.data(), dact.data(), dpre.data(), int64_t(pre_.size()));
  fc1.backward(x, dpre, dx);
}

template <class T>
void Mlp<T>::zero_grad() {
  fc1.zero_grad();
  fc2.zero_grad();
}

template <class T>
void Mlp<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  fc1.collect(prefix + "fc1.", out);
  fc2.collect(prefix + "fc2.", out);
}

// ----------------------------------------------------- SelfAttention ----

template <class T>
SelfAttention<T>::SelfAttention(int64_t d, int64_t h, AttentionOptions opt)
    : dim(d), heads(h), options(opt) {
  if (d < 1 || h < 1 || d % h != 0)
    throw Error("attn::nn::SelfAttention: dim = " + std::to_string(d) + " must be a positive multiple of heads = " +
                std::to_string(h));
  head_dim = d / h;
  if (opt.rope && head_dim % 2 != 0)
    throw Error("attn::nn::SelfAttention: rotary positions need an even head dimension, got E = " +
                std::to_string(head_dim));
  in_proj_weight = Tensor<T>({3 * d, d});
  in_proj_bias = Tensor<T>({3 * d});
  out_proj_weight = Tensor<T>({d, d});
  out_proj_bias = Tensor<T>({d});
  d_in_proj_weight = Tensor<T>({3 * d, d});
  d_in_proj_bias = Tensor<T>({3 * d});
  d_out_proj_weight = Tensor<T>({d, d});
  d_out_proj_bias = Tensor<T>({d});
}

template <class T>
void SelfAttention<T>::reset_parameters(Rng& rng) {
  // As torch.nn.MultiheadAttention: Xavier-uniform over the packed [3D, D]
  // in_proj, Linear's default for out_proj's weight, zero biases.
  const double a = std::sqrt(6.0 / double(3 * dim + dim));
  for (size_t i = 0; i < in_proj_weight.size(); ++i) in_proj_weight[i] = T(rng.uniform(-a, a));
  const double b = 1.0 / std::sqrt(double(dim));
  for (size_t i = 0; i < out_proj_weight.size(); ++i) out_proj_weight[i] = T(rng.uniform(-b, b));
  in_proj_bias.fill(T(0));
  out_proj_bias.fill(T(0));
}

template <class T>
SdpaOptions SelfAttention<T>::sdpa_options() const {
  SdpaOptions o;
  o.scale = options.scale;
  o.causal = options.causal;
  o.backend = options.backend;
  return o;
}

template <class T>
View4<T> SelfAttention<T>::head_view(Tensor<T>& packed, int which) {
  // Row m = b·N + n of the (M, 3D) matrix holds [q | k | v]; head h of part
  // `which` starts at column which·D + h·E.
  const int64_t D3 = 3 * dim;
  return View4<T>(packed.data() + which * dim, {B_, heads, N_, head_dim}, {N_ * D3, head_dim, D3, 1});
}

template <class T>
void SelfAttention<T>::forward(const Tensor<T>& x, int64_t B, int64_t N, Tensor<T>& y, View4<T> weights) {
  const int64_t M = rows_of(x, dim, "attn::nn::SelfAttention::forward", "x");
  if (M != B * N)
    throw Error("attn::nn::SelfAttention::forward: x has " + std::to_string(M) + " rows, expected B·N = " +
                std::to_string(B * N));
  B_ = B;
  N_ = N;
  // [Q | K | V] = x·W_inᵀ + b_in
  ensure_shape(qkv_, {M, 3 * dim});
  gemm<T>({M, 3 * dim, dim}, false, x.data(), dim, true, in_proj_weight.data(), dim, qkv_.data(), 3 * dim);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < 3 * dim; ++j) qkv_[size_t(m * 3 * dim + j)] += in_proj_bias[size_t(j)];
  // RoPE: rotate Q and K by their positions
  if (options.rope) {
    apply_rotary(head_view(qkv_, 0));
    apply_rotary(head_view(qkv_, 1));
  }
  // O_h = softmax(scale·Q_h·K_hᵀ)·V_h, written head-interleaved into (M, D)
  ensure_shape(attn_out_, {M, dim});
  ensure_shape(lse_, {B, heads, N});
  SdpaArgs<T> args;
  args.q = head_view(qkv_, 0);
  args.k = head_view(qkv_, 1);
  args.v = head_view(qkv_, 2);
  scaled_dot_product_attention<T>(
      args, {View4<T>::bnhd(attn_out_.data(), B, N, heads, head_dim), weights, lse_.template view<3>()},
      sdpa_options());
  // y = O·W_oᵀ + b_o
  ensure_shape(y, {M, dim});
  gemm<T>({M, dim, dim}, false, attn_out_.data(), dim, true, out_proj_weight.data(), dim, y.data(), dim);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < dim; ++j) y[size_t(m * dim + j)] += out_proj_bias[size_t(j)];
}

template <class T>
void SelfAttention<T>::backward(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>* dx) {
  const int64_t M = B_ * N_;
  rows_of(dy, dim, "attn::nn::SelfAttention::backward", "dy");
  if (dy.dim(0) != M || x.dim(0) != M)
    throw Error("attn::nn::SelfAttention::backward: x and dy must have the forward's B·N = " +
                std::to_string(M) + " rows");
  // y = O·W_oᵀ + b_o  ->  dW_o += dyᵀ·O, db_o += Σ dy, dO = dy·W_o
  gemm<T>({dim, dim, M}, true, dy.data(), dim, false, attn_out_.data(), dim, d_out_proj_weight.data(), dim,
          T(1), T(1));
  add_column_sums(dy, M, dim, d_out_proj_bias);
  Tensor<T> dO({M, dim});
  gemm<T>({M, dim, dim}, false, dy.data(), dim, false, out_proj_weight.data(), dim, dO.data(), dim);
  // attention backward into the packed (M, 3D) gradient [dQ | dK | dV]
  Tensor<T> dqkv({M, 3 * dim});
  SdpaArgs<T> args;
  args.q = head_view(qkv_, 0);
  args.k = head_view(qkv_, 1);
  args.v = head_view(qkv_, 2);
  SdpaGrads<T> g;
  g.dq = head_view(dqkv, 0);
  g.dk = head_view(dqkv, 1);
  g.dv = head_view(dqkv, 2);
  const SdpaSaved<T> saved{View4<T>::bnhd(attn_out_.data(), B_, N_, heads, head_dim), lse_.template view<3>()};
  scaled_dot_product_attention_backward<T>(args, View4<T>::bnhd(dO.data(), B_, N_, heads, head_dim), saved, g,
                                           sdpa_options());
  // RoPE is a rotation: its transpose (the inverse rotation) carries dQ, dK back
  if (options.rope) {
    apply_rotary(head_view(dqkv, 0), /*inverse=*/true);
    apply_rotary(head_view(dqkv, 1), /*inverse=*/true);
  }
  // [Q | K | V] = x·W_inᵀ + b_in  ->  dW_in += dqkvᵀ·x, db_in += Σ dqkv, dx = dqkv·W_in
  gemm<T>({3 * dim, dim, M}, true, dqkv.data(), 3 * dim, false, x.data(), dim, d_in_proj_weight.data(), dim,
          T(1), T(1));
  add_column_sums(dqkv, M, 3 * dim, d_in_proj_bias);
  if (dx) {
    ensure_shape(*dx, {M, dim});
    gemm<T>({M, dim, 3 * dim}, false, dqkv.data(), 3 * dim, false, in_proj_weight.data(), dim, dx->data(), dim);
  }
}

template <class T>
typename SelfAttention<T>::ScoreStats SelfAttention<T>::score_stats() const {
  ScoreStats st;
  if (B_ == 0) return st;
  const double scale = options.scale ? *options.scale : 1.0 / std::sqrt(double(head_dim));
  const int64_t D3 = 3 * dim;
  double sum = 0, sum2 = 0, top = 0;
  int64_t count = 0, rows = 0;
  std::vector<double> z(static_cast<size_t>(N_));
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < N_; ++i) {
        const int64_t end = options.causal ? i + 1 : N_;
        const T* q = qkv_.data() + (b * N_ + i) * D3 + h * head_dim;
        double zmax = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < end; ++j) {
          const T* k = qkv_.data() + (b * N_ + j) * D3 + dim + h * head_dim;
          double dot = 0;
          for (int64_t e = 0; e < head_dim; ++e) dot += double(q[e]) * double(k[e]);
          z[size_t(j)] = scale * dot;
          zmax = std::max(zmax, z[size_t(j)]);
          sum += z[size_t(j)];
          sum2 += z[size_t(j)] * z[size_t(j)];
          ++count;
        }
        // the largest softmax weight of the row is 1 / Σ_j exp(z_j − max)
        double denom = 0;
        for (int64_t j = 0; j < end; ++j) denom += std::exp(z[size_t(j)] - zmax);
        top += 1.0 / denom;
        ++rows;
      }
  const double mean = sum / double(count);
  st.score_std = std::sqrt(std::max(0.0, sum2 / double(count) - mean * mean));
  st.mean_top_weight = top / double(rows);
  return st;
}

template <class T>
void SelfAttention<T>::zero_grad() {
  d_in_proj_weight.fill(T(0));
  d_in_proj_bias.fill(T(0));
  d_out_proj_weight.fill(T(0));
  d_out_proj_bias.fill(T(0));
}

template <class T>
void SelfAttention<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  out.push_back({prefix + "in_proj_weight", &in_proj_weight, &d_in_proj_weight, true});
  out.push_back({prefix + "in_proj_bias", &in_proj_bias, &d_in_proj_bias, false});
  out.push_back({prefix + "out_proj.weight", &out_proj_weight, &d_out_proj_weight, true});
  out.push_back({prefix + "out_proj.bias", &out_proj_bias, &d_out_proj_bias, false});
}

// ------------------------------------------------------ cross-entropy ----

template <class T>
CrossEntropyResult softmax_cross_entropy(const Tensor<T>& logits, const int32_t* targets, Tensor<T>* dlogits) {
  if (logits.rank() != 2) throw Error("attn::nn::softmax_cross_entropy: logits must be (M, V)");
  const int64_t M = logits.dim(0), V = logits.dim(1);
  CrossEntropyResult r;
  for (int64_t m = 0; m < M; ++m) {
    if (targets[m] >= V)
      throw Error("attn::nn::softmax_cross_entropy: target " + std::to_string(targets[m]) + " at row " +
                  std::to_string(m) + " is outside [0, V = " + std::to_string(V) + ")");
    if (targets[m] >= 0) ++r.count;
  }
  if (dlogits) {
    ensure_shape(*dlogits, {M, V});
    dlogits->fill(T(0));
  }
  if (r.count == 0) return r;
  std::vector<double> p(static_cast<size_t>(V));
  for (int64_t m = 0; m < M; ++m) {
    const int32_t t = targets[m];
    if (t < 0) continue;
    const T* z = logits.data() + m * V;
    int64_t arg = 0;
    for (int64_t j = 1; j < V; ++j)
      if (z[j] > z[arg]) arg = j;
    // loss_m = log Σ_j exp(z_j) − z_t, with the max subtracted first
    const double zmax = double(z[arg]);
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += (p[size_t(j)] = std::exp(double(z[j]) - zmax));
    r.loss += std::log(s) + zmax - double(z[t]);
    if (arg == t) ++r.correct;
    // d(mean loss)/dz_j = (softmax_j − [j = t]) / count
    if (dlogits)
      for (int64_t j = 0; j < V; ++j)
        (*dlogits)[size_t(m * V + j)] = T((p[size_t(j)] / s - (j == t ? 1.0 : 0.0)) / double(r.count));
  }
  r.loss /= double(r.count);
  return r;
}

#define ATTN_NN_INSTANTIATE(T)                                                                  \
  template class Linear<T>;                                                                     \
  template class Embedding<T>;                                                                  \
  template class LearnedPositions<T>;                                                           \
  template class LayerNorm<T>;                                                                  \
  template class Mlp<T>;                                                                        \
  template class SelfAttention<T>;                                                              \
  template void add_sinusoidal_positions<T>(Tensor<T>&, int64_t, int64_t, int64_t);                      \
  template void apply_rotary<T>(View4<T>, bool, int64_t);                                                \
  template void gelu_forward<T>(const T*, T*, int64_t);                                         \
  template void gelu_backward<T>(const T*, const T*, T*, int64_t);                              \
  template CrossEntropyResult softmax_cross_entropy<T>(const Tensor<T>&, const int32_t*, Tensor<T>*);

ATTN_NN_INSTANTIATE(float)
ATTN_NN_INSTANTIATE(double)
#undef ATTN_NN_INSTANTIATE

}  // namespace attn::nn
