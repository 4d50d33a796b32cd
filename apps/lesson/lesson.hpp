// The computations behind attn's explainers: the worked examples, one head of
// attention step by step, the permutation check and the five experiments.
// `attn explain`, `attn experiment` and `attn tour` print them; the browser
// explainer (web/) runs the same code compiled to WebAssembly and draws it.
// Attention itself always goes through the library (double precision,
// reference backend); random data comes from attn::Rng, so a seed gives the
// same numbers on every platform.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/attn.hpp"
#include "attn/rng.hpp"

namespace attn::lesson {

// Row-major dense matrix of doubles.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> a;
  Mat() = default;
  Mat(int64_t r, int64_t c, double fill = 0) : rows(r), cols(c), a(size_t(r * c), fill) {}
  Mat(int64_t r, int64_t c, std::vector<double> v) : rows(r), cols(c), a(std::move(v)) {}
  double& operator()(int64_t i, int64_t j) { return a[size_t(i * cols + j)]; }
  double operator()(int64_t i, int64_t j) const { return a[size_t(i * cols + j)]; }
};
Mat matmul(const Mat& x, const Mat& y);  // x · y
Mat transpose(const Mat& x);
Mat columns(const Mat& x, int64_t c0, int64_t c1);  // columns [c0, c1)
// softmax(q kᵀ · scale) v through attn::scaled_dot_product_attention (double,
// reference backend); optional mask (L x S, true = may attend).
void attention(const Mat& q, const Mat& k, const Mat& v, double scale, Mat& out, Mat* weights,
               const std::vector<bool>* mask = nullptr, bool causal = false);
// Adds the sinusoidal position encoding of row p to row p of x (width x.cols).
void add_positions(Mat& x);

// A worked example: one query against given keys and values.
struct WorkedExample {
  std::string intro;  // one sentence on what it shows
  Mat Q, K, V;
  std::vector<std::string> keys, queries;
  std::vector<int64_t> qpos;  // key position of each query (causal rule, window, ALiBi)
  int weight_decimals = 3, output_decimals = 2;
};
// "cat" ('the cat was hungry') or "two-tokens"; attn::InvalidArgument otherwise.
WorkedExample worked_example(const std::string& name);
const std::vector<std::string>& worked_example_names();

// Self-attention over typed words: X holds one embedding row per word (the
// same word always gets the same row: its entries come from a stream of
// `seed` named by the word), and W_Q, W_K, W_V of shape [d_k, D] (stored
// [out, in], so Q = X W_Qᵀ) from the stream of `seed`. Every entry is rounded
// to one decimal so each step can be checked by hand.
struct TokenExample {
  std::vector<std::string> words;
  Mat X, Wq, Wk, Wv;
};
TokenExample token_example(const std::vector<std::string>& words, int64_t dim, int64_t dk, uint64_t seed);

// The variants one head runs with (docs/variants.md).
struct HeadVariants {
  std::optional<double> scale;  // default 1/sqrt(d_k)
  bool causal = false;
  Window window;
  int64_t chunk_size = 0;  // 0 = off
  std::optional<double> softcap, slope, sink;
  bool masks() const { return causal || window.left >= 0 || window.right >= 0 || chunk_size > 0; }
};

// Every intermediate of one head, in the order the library applies them:
// S = Q Kᵀ, S·scale, softcap, ALiBi bias, the visible keys, softmax, A V.
struct HeadSteps {
  double scale = 0;
  Mat S, scaled;             // Q Kᵀ and S·scale
  std::optional<Mat> capped;  // softcap · tanh(scaled / softcap)
  std::optional<Mat> bias, biased;  // -m |p_i - j| and the scores with it added
  std::optional<Mat> visible;       // 1 where query i may attend to key j (with a band rule)
  Mat A, Y;                         // the weights and the output, from the library
  std::vector<double> lse;          // log-sum-exp of each row (with the sink when there is one)
  std::optional<Mat> on_sink;       // exp(sink - lse): each row's weight on the sink
  std::string rule;                 // the band rules in words ("causal: keys j <= p_i; ...")
};
// Query i sits at key position qpos[i]. The scores shown before the softmax
// are for reading; A, Y and lse come from attn::scaled_dot_product_attention.
HeadSteps head_steps(const Mat& Q, const Mat& K, const Mat& V, const std::vector<int64_t>& qpos,
                     const HeadVariants& var);

// Self-attention of the rows of X with projections W_Q, W_K, W_V stored
// [out, in] (Q = X W_Qᵀ), scale 1/sqrt(d_k), optional causal mask.
Mat self_attention(const Mat& X, const Mat& Wq, const Mat& Wk, const Mat& Wv, bool causal);
// Row i of the result is row perm[i] of m.
Mat permute_rows(const Mat& m, const std::vector<int64_t>& perm);
double max_abs_diff(const Mat& a, const Mat& b);

// Permutation equivariance of one self-attention layer: the outputs of the
// permuted tokens against the permuted outputs, with sinusoidal positions
// added to the (permuted) embeddings when `positions` is true.
struct PermutationCheck {
  Mat Y, Y_of_permuted, permuted_Y;  // Attn(X), Attn(PX), P Attn(X)
  double max_diff = 0;               // max |Attn(PX) - P Attn(X)|
};
PermutationCheck permutation_check(const Mat& X, const Mat& Wq, const Mat& Wk, const Mat& Wv,
                                   const std::vector<int64_t>& perm, bool positions, bool causal);

// ---- the experiments ----------------------------------------------------------
// Each returns its figures as JSON: {"experiment", "title", "columns", "rows",
// "conclusion", ...}. A row of the sweeps is computed on its own stream of
// the seed, so one d_k can be measured alone (the browser does) and gives
// the row the sweep prints.
const std::vector<std::string>& experiment_names();
// attn::InvalidArgument for an unknown name.
nlohmann::json run_experiment(const std::string& name, uint64_t seed);

inline constexpr int kVariancePairs = 5000;
inline constexpr int kSaturationTrials = 2000, kSaturationKeys = 4;
inline constexpr int64_t kJacobianTokens = 8;
// [d_k, sqrt(d_k), std(q.k), std/sqrt(d_k), std(q.k/sqrt(d_k))] over `pairs` pairs.
nlohmann::json variance_row(int64_t dk, uint64_t seed, int pairs = kVariancePairs);
// [d_k, then median gap, a1/a2, top a unscaled, the same three scaled].
nlohmann::json saturation_row(int64_t dk, uint64_t seed, int trials = kSaturationTrials);
// Softmax Jacobian over `batch` random sequences of kJacobianTokens tokens at
// head size d_k (model width D = d_k): per scale (unscaled, 1/sqrt(d_k)) the
// share of saturated rows (top weight > 0.99), the median and mean
// |diag(a) - a aᵀ|_F, the median |dL/dq_i|, |dL/dW_Q|_F and that norm over the
// unsaturated rows only.
struct JacobianRow {
  double scale, saturated_pct, median_jacobian, mean_jacobian, median_query_grad, grad_wq, grad_wq_unsaturated;
};
std::vector<JacobianRow> jacobian_rows(int64_t dk, uint64_t seed, int64_t batch);
// The Frobenius norm of diag(a) - a aᵀ for uniform weights over n keys,
// sqrt(n-1)/n. A saturated row (one-hot a) has 0; no row exceeds 1/2, the
// value for two keys sharing the weight.
double uniform_jacobian_norm(int64_t n);

}  // namespace attn::lesson
