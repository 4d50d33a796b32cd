// One head of attention step by step, the worked examples and the
// permutation check (lesson.hpp).
#include <cmath>
#include <memory>

#include "lesson.hpp"

namespace attn::lesson {

Mat matmul(const Mat& x, const Mat& y) {
  Mat z(x.rows, y.cols);
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t k = 0; k < x.cols; ++k)
      for (int64_t j = 0; j < y.cols; ++j) z(i, j) += x(i, k) * y(k, j);
  return z;
}

Mat transpose(const Mat& x) {
  Mat t(x.cols, x.rows);
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t j = 0; j < x.cols; ++j) t(j, i) = x(i, j);
  return t;
}

Mat columns(const Mat& x, int64_t c0, int64_t c1) {
  Mat s(x.rows, c1 - c0);
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t j = c0; j < c1; ++j) s(i, j - c0) = x(i, j);
  return s;
}

void attention(const Mat& q, const Mat& k, const Mat& v, double scale, Mat& out, Mat* weights,
               const std::vector<bool>* mask, bool causal) {
  out = Mat(q.rows, v.cols);
  SdpaArgs<double> args;
  args.q = View4<const double>::bhnd(q.a.data(), 1, 1, q.rows, q.cols);
  args.k = View4<const double>::bhnd(k.a.data(), 1, 1, k.rows, k.cols);
  args.v = View4<const double>::bhnd(v.a.data(), 1, 1, v.rows, v.cols);
  std::unique_ptr<bool[]> mb;
  if (mask) {
    mb.reset(new bool[mask->size()]);
    for (size_t i = 0; i < mask->size(); ++i) mb[i] = (*mask)[i];
    args.mask = View4<const bool>::bhnd(mb.get(), 1, 1, q.rows, k.rows);
  }
  SdpaOptions opt;
  opt.scale = scale;
  opt.causal = causal;
  opt.backend = Backend::reference;
  View4<double> w;
  if (weights) {
    *weights = Mat(q.rows, k.rows);
    w = View4<double>::bhnd(weights->a.data(), 1, 1, q.rows, k.rows);
  }
  scaled_dot_product_attention<double>(args, {View4<double>::bhnd(out.a.data(), 1, 1, q.rows, v.cols), w}, opt);
}

void add_positions(Mat& x) {
  for (int64_t p = 0; p < x.rows; ++p)
    for (int64_t i = 0; i < x.cols; ++i) {
      const double f = std::pow(10000.0, -double(i / 2 * 2) / double(x.cols));
      x(p, i) += (i % 2 == 0) ? std::sin(double(p) * f) : std::cos(double(p) * f);
    }
}

const std::vector<std::string>& worked_example_names() {
  static const std::vector<std::string> n = {"cat", "two-tokens"};
  return n;
}

WorkedExample worked_example(const std::string& name) {
  WorkedExample e;
  if (name == "cat") {
    e.intro = "The example \"the cat was hungry\": the query of \"hungry\" against the four tokens' keys,\n"
              "d_k = 4 (so sqrt(d_k) = 2), values of width d_v = 2.";
    e.Q = Mat(1, 4, {2, 0, 0, 0});
    e.K = Mat(4, 4, {-1, 0, 0, 0, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0});
    e.V = Mat(4, 2, {0, 0, 1, 0, 0, 1, 0, 1});
    e.keys = {"the", "cat", "was", "hungry"};
    e.queries = {"hungry"};
    e.qpos = {3};
  } else if (name == "two-tokens") {
    e.intro = "The two-token example: token 1's query q1 = [1, 1] against both tokens, d_k = 2.";
    e.Q = Mat(1, 2, {1, 1});
    e.K = Mat(2, 2, {1, 1, 1, -1});
    e.V = Mat(2, 2, {1, 0, 0, 1});
    e.keys = {"token 1", "token 2"};
    e.queries = {"token 1"};
    e.qpos = {0};
    e.weight_decimals = 2;
  } else {
    throw InvalidArgument("worked_example: unknown example '" + name + "'; expected cat or two-tokens");
  }
  return e;
}

TokenExample token_example(const std::vector<std::string>& words, int64_t dim, int64_t dk, uint64_t seed) {
  if (words.empty() || words.size() > 16)
    throw InvalidArgument("token_example: argument 'words' has " + std::to_string(words.size()) + " words, expected 1..16");
  if (dim < 1 || dim > 64) throw InvalidArgument("token_example: argument 'dim' is " + std::to_string(dim) + ", expected 1..64");
  if (dk < 1 || dk > 64) throw InvalidArgument("token_example: argument 'dk' is " + std::to_string(dk) + ", expected 1..64");
  auto rounded = [](Rng& rng, double sd) { return std::round(rng.normal() * sd * 10) / 10; };
  TokenExample t;
  t.words = words;
  t.X = Mat(int64_t(words.size()), dim);
  for (int64_t i = 0; i < t.X.rows; ++i) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a of the word: its stream
    for (unsigned char c : words[size_t(i)]) h = (h ^ c) * 1099511628211ull;
    Rng rng(derive_seed(seed, h));
    for (int64_t d = 0; d < dim; ++d) t.X(i, d) = rounded(rng, 1.0);
  }
  Rng rng(derive_seed(seed, 0));
  const double sd = 1 / std::sqrt(double(dim));
  for (Mat* w : {&t.Wq, &t.Wk, &t.Wv}) {
    *w = Mat(dk, dim);
    for (auto& x : w->a) x = rounded(rng, sd);
  }
  return t;
}

HeadSteps head_steps(const Mat& Q, const Mat& K, const Mat& V, const std::vector<int64_t>& qpos,
                     const HeadVariants& var) {
  if (int64_t(qpos.size()) != Q.rows)
    throw InvalidArgument("head_steps: qpos has " + std::to_string(qpos.size()) + " positions for " +
                          std::to_string(Q.rows) + " queries");
  HeadSteps st;
  st.scale = var.scale.value_or(1 / std::sqrt(double(Q.cols)));
  st.S = matmul(Q, transpose(K));
  st.scaled = st.S;
  for (auto& x : st.scaled.a) x *= st.scale;
  Mat scores = st.scaled;
  if (var.softcap) {
    // softcap · tanh(s / softcap): scores squashed into (-softcap, softcap)
    st.capped = scores;
    for (auto& x : st.capped->a) x = *var.softcap * std::tanh(x / *var.softcap);
    scores = *st.capped;
  }
  if (var.slope) {
    // ALiBi: -m·|p_i - j|, added to the scores
    st.bias = Mat(Q.rows, K.rows);
    st.biased = scores;
    for (int64_t i = 0; i < Q.rows; ++i)
      for (int64_t j = 0; j < K.rows; ++j) {
        (*st.bias)(i, j) = -*var.slope * double(std::abs(qpos[size_t(i)] - j));
        (*st.biased)(i, j) += (*st.bias)(i, j);
      }
  }
  if (var.masks()) {
    // Which keys each query sees: causal j <= p_i, window p_i - left <= j <= p_i + right,
    // chunks p_i / C == j / C.
    st.visible = Mat(Q.rows, K.rows);
    for (int64_t i = 0; i < Q.rows; ++i)
      for (int64_t j = 0; j < K.rows; ++j) {
        const int64_t p = qpos[size_t(i)];
        bool see = !var.causal || j <= p;
        if (var.window.left >= 0 && j < p - var.window.left) see = false;
        if (var.window.right >= 0 && j > p + var.window.right) see = false;
        if (var.chunk_size > 0 && p / var.chunk_size != j / var.chunk_size) see = false;
        (*st.visible)(i, j) = see ? 1 : 0;
      }
    auto bound = [](int64_t b) { return b < 0 ? std::string("inf") : std::to_string(b); };
    auto add = [&](const std::string& s) { st.rule += (st.rule.empty() ? "" : "; ") + s; };
    if (var.causal) add("causal: keys j <= p_i");
    if (var.window.left >= 0 || var.window.right >= 0)
      add("window (" + std::to_string(var.window.left) + ", " + std::to_string(var.window.right) + "): keys p_i - " +
          bound(var.window.left) + " <= j <= p_i + " + bound(var.window.right));
    if (var.chunk_size > 0) add("chunks of " + std::to_string(var.chunk_size) + ": keys with j / C == p_i / C");
  }
  // The head through the library (reference backend, double).
  SdpaArgs<double> args;
  args.q = View4<const double>::bhnd(Q.a.data(), 1, 1, Q.rows, Q.cols);
  args.k = View4<const double>::bhnd(K.a.data(), 1, 1, K.rows, K.cols);
  args.v = View4<const double>::bhnd(V.a.data(), 1, 1, V.rows, V.cols);
  const double slope = var.slope.value_or(0), sink = var.sink.value_or(0);
  if (var.slope) args.alibi_slopes = View1<const double>(&slope, {1});
  if (var.sink) args.sinks = View1<const double>(&sink, {1});
  SdpaOptions opt;
  opt.scale = st.scale;
  opt.causal = var.causal;
  opt.window = var.window;
  opt.chunk_size = var.chunk_size;
  if (var.softcap) opt.softcap = *var.softcap;
  opt.position_offset = qpos.empty() ? 0 : qpos[0];
  opt.backend = Backend::reference;
  st.Y = Mat(Q.rows, V.cols);
  st.A = Mat(Q.rows, K.rows);
  st.lse.assign(size_t(Q.rows), 0.0);
  scaled_dot_product_attention<double>(args,
                                       {View4<double>::bhnd(st.Y.a.data(), 1, 1, Q.rows, V.cols),
                                        View4<double>::bhnd(st.A.a.data(), 1, 1, Q.rows, K.rows),
                                        View3<double>(st.lse.data(), {1, 1, Q.rows})},
                                       opt);
  if (var.sink) {
    // The sink takes exp(sink - lse) of each row and contributes no value.
    st.on_sink = Mat(Q.rows, 1);
    for (int64_t i = 0; i < Q.rows; ++i) (*st.on_sink)(i, 0) = std::exp(sink - st.lse[size_t(i)]);
  }
  return st;
}

Mat self_attention(const Mat& X, const Mat& Wq, const Mat& Wk, const Mat& Wv, bool causal) {
  Mat y;
  attention(matmul(X, transpose(Wq)), matmul(X, transpose(Wk)), matmul(X, transpose(Wv)),
            1 / std::sqrt(double(Wq.rows)), y, nullptr, nullptr, causal);
  return y;
}

Mat permute_rows(const Mat& m, const std::vector<int64_t>& perm) {
  if (int64_t(perm.size()) != m.rows) throw InvalidArgument("permute_rows: perm must have one entry per row");
  Mat p(m.rows, m.cols);
  for (int64_t i = 0; i < m.rows; ++i) {
    if (perm[size_t(i)] < 0 || perm[size_t(i)] >= m.rows) throw InvalidArgument("permute_rows: perm entry out of range");
    for (int64_t j = 0; j < m.cols; ++j) p(i, j) = m(perm[size_t(i)], j);
  }
  return p;
}

double max_abs_diff(const Mat& a, const Mat& b) {
  double e = 0;
  for (size_t i = 0; i < a.a.size(); ++i) e = std::max(e, std::abs(a.a[i] - b.a[i]));
  return e;
}

PermutationCheck permutation_check(const Mat& X, const Mat& Wq, const Mat& Wk, const Mat& Wv,
                                   const std::vector<int64_t>& perm, bool positions, bool causal) {
  Mat x = X, px = permute_rows(X, perm);
  if (positions) {
    add_positions(x);
    add_positions(px);
  }
  PermutationCheck c;
  c.Y = self_attention(x, Wq, Wk, Wv, causal);
  c.Y_of_permuted = self_attention(px, Wq, Wk, Wv, causal);
  c.permuted_Y = permute_rows(c.Y, perm);
  c.max_diff = max_abs_diff(c.Y_of_permuted, c.permuted_Y);
  return c;
}

}  // namespace attn::lesson
