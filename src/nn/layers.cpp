// The transformer's layers, forward and backward side by side.
//
// Dimensions: M = B·N token rows, D model width, H heads of E = D/H features,
// V vocabulary, F hidden width of the MLP. All matrices are row-major; every
// product goes through the row-major GEMM helper (kernels/gemm/), every reduction
// that is not a GEMM (norm statistics, softmax, bias sums) is accumulated in
// double so float and double differ only in storage rounding.
#include "attn/nn/layers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "kernels/gemm/gemm.hpp"
#include "kernels/softmax.hpp"
#include "nn/common.hpp"
#include "validate.hpp"

namespace attn::nn {

using detail::gemm;

// ------------------------------------------------------------- Linear ----

template <class T>
Linear<T>::Linear(int64_t in, int64_t out, bool with_bias)
    : in_features(in), out_features(out), has_bias(with_bias), weight({out, in}), dweight({out, in}) {
  if (in < 1 || out < 1)
    throw InvalidArgument("attn::nn::Linear: in_features and out_features must be >= 1, got " +
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

// A layer's weight (and bias, where it has one), as the optimizers see them
// (weight decay on a linear map's matrix only).
template <class T, class Layer>
void collect_weight_and_bias(Layer& l, const std::string& prefix, std::vector<ParamRef<T>>& out, bool decay,
                             bool bias) {
  out.push_back({prefix + "weight", &l.weight, &l.dweight, decay});
  if constexpr (requires { l.bias; })
    if (bias) out.push_back({prefix + "bias", &l.bias, &l.dbias, false});
}

template <class T>
void Linear<T>::zero_grad() {
  for (Tensor<T>* g : {&dweight, &dbias}) g->fill(T(0));
}

template <class T>
void Linear<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  collect_weight_and_bias(*this, prefix, out, /*decay=*/true, has_bias);
}

// ---------------------------------------------------------- Embedding ----

template <class T>
Embedding<T>::Embedding(int64_t v, int64_t d) : vocab(v), dim(d), weight({v, d}), dweight({v, d}) {
  if (v < 1 || d < 1)
    throw InvalidArgument("attn::nn::Embedding: vocab and dim must be >= 1, got " + std::to_string(v) +
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
  collect_weight_and_bias(*this, prefix, out, /*decay=*/false, /*bias=*/false);
}

// ---------------------------------------------------------- Positions ----

namespace {
constexpr detail::NamedValue<Positions> kPositions[] = {{Positions::none, "none"},
                                                        {Positions::sinusoidal, "sinusoidal"},
                                                        {Positions::learned, "learned"},
                                                        {Positions::rope, "rope"},
                                                        {Positions::alibi, "alibi"}};
}  // namespace

const char* positions_name(Positions p) { return detail::name_of(kPositions, p); }

Positions parse_positions(const std::string& name) {
  return detail::Checker{"nn::parse_positions"}.parse(kPositions, name, "positions");
}

template <class T>
void add_sinusoidal_positions(Tensor<T>& x, int64_t B, int64_t N, int64_t offset) {
  if (x.rank() != 2 || x.dim(0) != B * N)
    throw InvalidArgument("attn::nn::add_sinusoidal_positions: x must be (B·N, D) = (" + std::to_string(B * N) +
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
    throw InvalidArgument("attn::nn::LearnedPositions::forward: positions " + std::to_string(offset) + ".." +
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
void LearnedPositions<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  collect_weight_and_bias(*this, prefix, out, /*decay=*/false, /*bias=*/false);
}

template <class T>
void LearnedPositions<T>::zero_grad() {
  dweight.fill(T(0));
}

template <class T>
void apply_rotary(View4<T> x, bool inverse, int64_t offset) {
  const int64_t B = x.dim(0), H = x.dim(1), N = x.dim(2), E = x.dim(3);
  if (E % 2 != 0)
    throw InvalidArgument("attn::nn::apply_rotary: head dimension E = " + std::to_string(E) +
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
  for (Tensor<T>* g : {&dweight, &dbias}) g->fill(T(0));
}

template <class T>
void LayerNorm<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  collect_weight_and_bias(*this, prefix, out, /*decay=*/false, /*bias=*/true);
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

namespace {
MultiheadConfig self_attention_config(int64_t d, int64_t h, bool sinks) {
  if (d < 1 || h < 1 || d % h != 0)
    throw InvalidArgument("attn::nn::SelfAttention: dim = " + std::to_string(d) + " must be a positive multiple of heads = " +
                std::to_string(h));
  MultiheadConfig c;
  c.embed_dim = d;
  c.num_heads = h;
  c.sinks = sinks;
  return c;
}
}  // namespace

template <class T>
SelfAttention<T>::SelfAttention(int64_t d, int64_t h, const MhaOptions& opt, Positions positions, bool sinks)
    : layer(self_attention_config(d, h, sinks)), options(opt), rope(positions == Positions::rope) {
  if (positions == Positions::alibi) {
    const std::vector<double> s = attn::alibi_slopes(h);
    alibi_slopes = Tensor<T>({h});
    for (int64_t i = 0; i < h; ++i) alibi_slopes[size_t(i)] = T(s[size_t(i)]);
  }
  if (rope && layer.head_dim() % 2 != 0)
    throw InvalidArgument("attn::nn::SelfAttention: rotary positions need an even head dimension, got E = " +
                std::to_string(layer.head_dim()));
  // RoPE rotates Q and K between the projection and the attention; a
  // rotation's transpose is its inverse, which carries dQ, dK back.
  if (rope)
    layer.set_qk_transform({[](View4<T> q, View4<T> k) {
                              apply_rotary(q);
                              apply_rotary(k);
                            },
                            [](View4<T> dq, View4<T> dk) {
                              apply_rotary(dq, /*inverse=*/true);
                              apply_rotary(dk, /*inverse=*/true);
                            },
                            [](View4<T> q, View4<T> k, int64_t first) {
                              apply_rotary(q, false, first);
                              apply_rotary(k, false, first);
                            }});
}

template <class T>
void SelfAttention<T>::reset_parameters(Rng& rng) {
  layer.reset_parameters(rng.next());
}

namespace {
// The layer's arguments for x's rows as B sequences of N tokens (checked),
// with y shaped to match.
template <class T>
MhaArgs<T> sequences_of(const Tensor<T>& x, int64_t B, int64_t N, int64_t D, const Tensor<T>& alibi_slopes,
                        Tensor<T>& y, const std::string& fn) {
  const int64_t M = rows_of(x, D, fn.c_str(), "x");
  if (B < 1 || N < 1 || M != B * N)
    throw InvalidArgument(fn + ": x has " + std::to_string(M) + " rows, expected B·N = " + std::to_string(B) + "·" +
                          std::to_string(N));
  ensure_shape(y, {M, D});
  MhaArgs<T> args;
  args.query = View3<const T>(x.data(), {B, N, D});
  if (alibi_slopes.rank() == 1) args.alibi_slopes = alibi_slopes.template view<1>();
  return args;
}
}  // namespace

template <class T>
void SelfAttention<T>::forward(const Tensor<T>& x, int64_t B, int64_t N, Tensor<T>& y, View4<T> weights,
                               const AttentionDropout& dropout) {
  const int64_t D = layer.embed_dim();
  const MhaArgs<T> args = sequences_of(x, B, N, D, alibi_slopes, y, "attn::nn::SelfAttention::forward");
  MhaOptions opt = options;
  opt.sdpa.dropout_p = dropout.p, opt.sdpa.dropout_seed = dropout.seed, opt.sdpa.dropout_offset = dropout.offset;
  layer.forward(args, {View3<T>(y.data(), {B, N, D}), weights, {}}, opt, &cache_);
}

template <class T>
void SelfAttention<T>::decode(const Tensor<T>& x, int64_t B, int64_t n, KVCache& cache, Tensor<T>& y) const
  requires std::same_as<T, float>
{
  const int64_t D = layer.embed_dim();
  const MhaArgs<T> args = sequences_of(x, B, n, D, alibi_slopes, y, "attn::nn::SelfAttention::decode");
  // `if constexpr`: clang 14 (the WebAssembly build, web/) instantiates this body for double too.
  if constexpr (std::same_as<T, float>) layer.decode(args, cache, View3<T>(y.data(), {B, n, D}), options);
}

template <class T>
void SelfAttention<T>::backward(const Tensor<T>& x, const Tensor<T>& dy, Tensor<T>* dx) {
  const int64_t D = layer.embed_dim(), M = cache_.B * cache_.L;
  rows_of(dy, D, "attn::nn::SelfAttention::backward", "dy");
  if (M == 0 || dy.dim(0) != M || x.dim(0) != M)
    throw InvalidArgument("attn::nn::SelfAttention::backward: x and dy must have the forward's B·N = " +
                std::to_string(M) + " rows");
  MhaGrads<T> g;
  if (dx) {
    ensure_shape(*dx, {M, D});
    g.dquery = View3<T>(dx->data(), {cache_.B, cache_.L, D});
  }
  layer.backward(cache_, View3<const T>(dy.data(), {cache_.B, cache_.L, D}), g);
}

template <class T>
typename SelfAttention<T>::ScoreStats SelfAttention<T>::score_stats() const {
  ScoreStats st;
  if (!cache_.filled()) return st;
  const auto q = cache_.q(), k = cache_.k();  // after the rotation, as the attention saw them
  const int64_t B = q.dim(0), H = q.dim(1), N = q.dim(2), E = q.dim(3);
  const double scale = options.sdpa.scale ? *options.sdpa.scale : 1.0 / std::sqrt(double(E));
  double sum = 0, sum2 = 0, top = 0;
  int64_t count = 0, rows = 0;
  std::vector<double> z(static_cast<size_t>(N));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i) {
        // the keys row i sees: causal and the window (self-attention, so p = i)
        const Window& w = options.sdpa.window;
        const int64_t right = options.sdpa.causal ? (w.right < 0 ? 0 : std::min<int64_t>(w.right, 0)) : w.right;
        const int64_t begin = w.left < 0 ? 0 : std::max<int64_t>(0, i - w.left);
        const int64_t end = right < 0 ? N : std::min(N, i + right + 1);
        double zmax = -std::numeric_limits<double>::infinity();
        for (int64_t j = begin; j < end; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += double(q(b, h, i, e)) * double(k(b, h, j, e));
          z[size_t(j)] = scale * dot;
          zmax = std::max(zmax, z[size_t(j)]);
          sum += z[size_t(j)];
          sum2 += z[size_t(j)] * z[size_t(j)];
          ++count;
        }
        // the largest softmax weight of the row is 1 / Σ_j exp(z_j − max)
        double denom = 0;
        for (int64_t j = begin; j < end; ++j) denom += std::exp(z[size_t(j)] - zmax);
        top += 1.0 / denom;
        ++rows;
      }
  const double mean = sum / double(count);
  st.score_std = std::sqrt(std::max(0.0, sum2 / double(count) - mean * mean));
  st.mean_top_weight = top / double(rows);
  return st;
}

template <class T>
void SelfAttention<T>::collect(const std::string& prefix, std::vector<ParamRef<T>>& out) {
  for (const std::string& name : layer.parameter_names()) {
    Tensor<T>& p = layer.parameter(name);
    out.push_back({prefix + name, &p, &layer.grad(name), p.rank() == 2});
  }
}

// ------------------------------------------------------ cross-entropy ----

template <class T>
CrossEntropyResult softmax_cross_entropy(const Tensor<T>& logits, const int32_t* targets, Tensor<T>* dlogits) {
  if (logits.rank() != 2) throw InvalidArgument("attn::nn::softmax_cross_entropy: logits must be (M, V)");
  const int64_t M = logits.dim(0), V = logits.dim(1);
  CrossEntropyResult r;
  for (int64_t m = 0; m < M; ++m) {
    if (targets[m] >= V)
      throw InvalidArgument("attn::nn::softmax_cross_entropy: target " + std::to_string(targets[m]) + " at row " +
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
    // loss_m = log Σ_j exp(z_j) − z_t = lse − z_t
    r.loss += detail::softmax(z, p.data(), V) - double(z[t]);
    if (arg == t) ++r.correct;
    // d(mean loss)/dz_j = (softmax_j − [j = t]) / count
    if (dlogits)
      for (int64_t j = 0; j < V; ++j)
        (*dlogits)[size_t(m * V + j)] = T((p[size_t(j)] - (j == t ? 1.0 : 0.0)) / double(r.count));
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
