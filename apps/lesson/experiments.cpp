// The five experiments behind `attn experiment`, the tour and the browser
// explainer. Every figure is measured on random data from attn::Rng; nothing
// is tabulated by hand. Attention itself always goes through the library
// (double precision, reference backend), so these are also end-to-end checks
// of attn.
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include <fmt/format.h>

#include "lesson.hpp"

namespace attn::lesson {
namespace {

using json = nlohmann::json;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double stddev(const std::vector<double>& v) {
  const double mean = std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
  double ss = 0;
  for (double x : v) ss += (x - mean) * (x - mean);
  return std::sqrt(ss / double(v.size() - 1));
}

Mat randn(int64_t r, int64_t c, Rng& rng, double sd = 1.0) {
  Mat m(r, c);
  for (auto& x : m.a) x = sd * rng.normal();
  return m;
}

// The stream of one row of a sweep: d_k's own, so a row needs no other row.
Rng row_rng(uint64_t seed, int64_t dk) { return Rng(derive_seed(seed, uint64_t(dk))); }

void check_dk(const char* fn, int64_t dk, int64_t most) {
  if (dk < 1 || dk > most)
    throw InvalidArgument(fmt::format("{}: argument 'dk' is {}, expected 1..{}", fn, dk, most));
}

json variance(uint64_t seed) {
  json rows = json::array();
  for (int dk = 1; dk <= 512; dk *= 2) rows.push_back(variance_row(dk, seed));
  return {{"experiment", "variance"},
          {"title", "Spread of the score q.k for random unit-variance q, k (5000 pairs per d_k)"},
          {"columns", {"d_k", "sqrt(d_k)", "std(q.k)", "std/sqrt(d_k)", "std(q.k/sqrt(d_k))"}},
          {"rows", rows},
          {"conclusion", "The unscaled score's standard deviation tracks sqrt(d_k); dividing by sqrt(d_k) "
                         "holds it at 1 for every head size."}};
}

json saturation(uint64_t seed) {
  json rows = json::array();
  for (int dk : {1, 4, 16, 64, 256}) rows.push_back(saturation_row(dk, seed));
  return {{"experiment", "saturation"},
          {"title", "Softmax over 4 random keys: medians over 2000 draws of the top-two score gap, the ratio "
                    "of the top two weights and the top weight"},
          {"columns", {"d_k", "gap", "a1/a2", "top a", "gap scaled", "a1/a2 scaled", "top a scaled"}},
          {"rows", rows},
          {"conclusion", "Unscaled, the gap grows like sqrt(d_k) and the top key takes almost all the weight "
                         "(hard attention by accident); scaled, the weights stay a genuine blend at every d_k."}};
}

// Softmax Jacobian norm and the gradient reaching W_Q at d_k = 256.
json jacobian(uint64_t seed) {
  const int64_t dk = 256;
  json rows = json::array();
  const std::vector<JacobianRow> measured = jacobian_rows(dk, seed, 64);
  for (const JacobianRow& r : measured)
    rows.push_back({r.scale == 1.0 ? "unscaled" : "scaled 1/sqrt(256)", r.scale, r.saturated_pct, r.median_jacobian,
                    r.mean_jacobian, r.median_query_grad, r.grad_wq});
  const double unsat_share = measured[0].grad_wq_unsaturated / measured[0].grad_wq;  // unscaled
  const double ratio_j = rows[1][3].get<double>() / rows[0][3].get<double>();
  const double ratio_g = rows[1][5].get<double>() / rows[0][5].get<double>();
  const double ratio_w = rows[1][6].get<double>() / rows[0][6].get<double>();
  return {{"experiment", "jacobian"},
          {"title", "d_k = 256, 64 random sequences of 8 tokens: softmax Jacobian and the gradient that reaches W_Q"},
          {"columns", {"scores", "scale", "% rows top a>0.99", "median |J|_F", "mean |J|_F", "median |dL/dq_i|",
                       "|dL/dW_Q|_F"}},
          {"rows", rows},
          {"scaled_over_unscaled", {{"median_jacobian", ratio_j}, {"median_query_grad", ratio_g}, {"grad_wq", ratio_w}}},
          {"unscaled_grad_wq_share_of_unsaturated_rows", unsat_share},
          {"conclusion",
           fmt::format("Without the scale most rows are born saturated: the typical row's Jacobian is {:.3g}x smaller "
                       "and its query gets {:.3g}x less gradient. The total |dL/dW_Q| is still {:.3g}x the scaled "
                       "one (the raw scores are 16x larger), and summing only the {:.0f}% of rows that are not "
                       "saturated gives {:.3f} of that norm: the saturated rows contribute next to nothing.",
                       ratio_j, ratio_g, 1 / ratio_w, 100 - rows[0][2].get<double>(), unsat_share)}};
}

json equivariance(uint64_t seed) {
  Rng rng(seed);
  const int64_t n = 6, D = 16, dk = 8;
  const Mat X = randn(n, D, rng);
  const Mat Wq = randn(dk, D, rng, 0.5), Wk = randn(dk, D, rng, 0.5), Wv = randn(dk, D, rng, 0.5);
  const std::vector<int64_t> perm = {3, 0, 5, 1, 4, 2};  // row i of PX is row perm[i] of X
  json rows = json::array();
  auto add = [&](const char* what, bool positions, bool causal) {
    const double err = permutation_check(X, Wq, Wk, Wv, perm, positions, causal).max_diff;
    rows.push_back({what, err, err < 1e-9 ? "yes" : "no"});
  };
  add("plain self-attention", false, false);
  add("causal mask", false, true);
  add("sinusoidal positions added", true, false);
  return {{"experiment", "equivariance"},
          {"title", "Permute 6 tokens (order 3 0 5 1 4 2): does the output permute the same way?"},
          {"columns", {"layer", "max |Attn(PX) - P Attn(X)|", "equivariant"}},
          {"rows", rows},
          {"permutation", perm},
          {"conclusion", "Plain attention only relabels its outputs when the tokens are shuffled, so it cannot "
                         "tell word order; a causal mask or positional information breaks the symmetry."}};
}

// A hand-programmed layer over one-hot embeddings that looks up a dictionary.
json lookup(uint64_t seed) {
  Rng rng(seed);
  const int64_t m = 8, dv = 4;
  Mat table(m, dv);  // the dictionary: key t -> value row t
  for (auto& x : table.a) x = double(rng.below(19) - 9);
  // Context: the m dictionary entries as one-hot tokens, in shuffled order (Fisher-Yates).
  std::vector<int64_t> order(static_cast<size_t>(m));
  std::iota(order.begin(), order.end(), 0);
  for (int64_t i = m - 1; i > 0; --i) std::swap(order[size_t(i)], order[size_t(rng.below(i + 1))]);
  Mat ctx(m, m), queries(m, m);
  for (int64_t i = 0; i < m; ++i) {
    ctx(i, order[size_t(i)]) = 1;
    queries(i, i) = 1;  // query i asks for key i
  }
  Mat Wk(m, m), Wq(m, m);
  for (int64_t i = 0; i < m; ++i) Wk(i, i) = 1;  // W_K = I: a token's key is its one-hot id
  const Mat& Wv = table;                         // W_V = the table: a token's value is its entry
  json rows = json::array();
  for (double c : {1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0}) {
    for (int64_t i = 0; i < m; ++i) Wq(i, i) = c;  // W_Q = c I: the matching key scores c, the rest 0
    Mat Y, A;
    attention(matmul(queries, Wq), matmul(ctx, Wk), matmul(ctx, Wv), 1 / std::sqrt(double(m)), Y, &A);
    double min_w = 1, err = 0;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < m; ++j)
        if (order[size_t(j)] == i) min_w = std::min(min_w, A(i, j));
      for (int64_t e = 0; e < dv; ++e) err = std::max(err, std::abs(Y(i, e) - table(i, e)));
    }
    rows.push_back({c, c / std::sqrt(double(m)), min_w, err});
  }
  return {{"experiment", "lookup"},
          {"title", "A dictionary of 8 keys as one attention layer: W_K = I, W_V = the table, W_Q = c I "
                    "over one-hot tokens"},
          {"columns", {"c", "score gap c/sqrt(8)", "min weight on the match", "max |Y - table|"}},
          {"rows", rows},
          {"conclusion", "As the query scale c grows the softmax saturates onto the matching key and the layer "
                         "becomes an exact lookup: here saturation is what we want."}};
}

}  // namespace

// Standard deviation of q.k over `pairs` pairs of unit-variance vectors.
json variance_row(int64_t dk, uint64_t seed, int pairs) {
  check_dk("variance_row", dk, 4096);
  if (pairs < 2) throw InvalidArgument(fmt::format("variance_row: argument 'pairs' is {}, expected >= 2", pairs));
  Rng rng = row_rng(seed, dk);
  std::vector<double> s(static_cast<size_t>(pairs)), scaled(static_cast<size_t>(pairs));
  for (int p = 0; p < pairs; ++p) {
    double dot = 0;
    for (int64_t e = 0; e < dk; ++e) dot += rng.normal() * rng.normal();  // q_e * k_e
    s[size_t(p)] = dot;
    scaled[size_t(p)] = dot / std::sqrt(double(dk));
  }
  const double sd = stddev(s);
  return {dk, std::sqrt(double(dk)), sd, sd / std::sqrt(double(dk)), stddev(scaled)};
}

// Top-two score gap, weight ratio and top weight over 4 keys, unscaled and scaled.
json saturation_row(int64_t dk, uint64_t seed, int trials) {
  check_dk("saturation_row", dk, 4096);
  if (trials < 1) throw InvalidArgument(fmt::format("saturation_row: argument 'trials' is {}, expected >= 1", trials));
  Rng rng = row_rng(seed, dk);
  constexpr int n = kSaturationKeys;
  std::vector<double> gap[2], ratio[2], top[2];
  for (int t = 0; t < trials; ++t) {
    std::vector<double> q(static_cast<size_t>(dk));
    for (auto& x : q) x = rng.normal();
    double s[n];
    for (int j = 0; j < n; ++j) {
      s[j] = 0;
      for (int64_t e = 0; e < dk; ++e) s[j] += q[size_t(e)] * rng.normal();
    }
    for (int sc = 0; sc < 2; ++sc) {
      double x[n], a[n];
      for (int j = 0; j < n; ++j) x[j] = sc ? s[j] / std::sqrt(double(dk)) : s[j];
      attn::softmax<double>(x, a, n);
      std::sort(x, x + n, std::greater<>());
      std::sort(a, a + n, std::greater<>());
      gap[sc].push_back(x[0] - x[1]);
      ratio[sc].push_back(a[0] / a[1]);
      top[sc].push_back(a[0]);
    }
  }
  return {dk, median(gap[0]), median(ratio[0]), median(top[0]), median(gap[1]), median(ratio[1]), median(top[1])};
}

std::vector<JacobianRow> jacobian_rows(int64_t dk, uint64_t seed, int64_t batch) {
  check_dk("jacobian_rows", dk, 1024);
  if (batch < 1 || batch > 1024)
    throw InvalidArgument(fmt::format("jacobian_rows: argument 'batch' is {}, expected 1..1024", batch));
  Rng rng = row_rng(seed, dk);
  const int64_t B = batch, n = kJacobianTokens, D = dk;
  const Mat X = randn(B * n, D, rng);
  const Mat Wq = randn(D, dk, rng, 1 / std::sqrt(double(D)));  // keeps q, k entries at unit variance
  const Mat Wk = randn(D, dk, rng, 1 / std::sqrt(double(D)));
  const Mat Wv = randn(D, dk, rng, 1 / std::sqrt(double(D)));
  const Mat Q = matmul(X, Wq), K = matmul(X, Wk), V = matmul(X, Wv);
  const Mat G = randn(B * n, dk, rng);  // dL/dY of a random linear loss
  std::vector<JacobianRow> out;
  for (int sc = 0; sc < 2; ++sc) {
    const double scale = sc ? 1 / std::sqrt(double(dk)) : 1.0;
    SdpaArgs<double> args;
    args.q = View4<const double>::bhnd(Q.a.data(), B, 1, n, dk);
    args.k = View4<const double>::bhnd(K.a.data(), B, 1, n, dk);
    args.v = View4<const double>::bhnd(V.a.data(), B, 1, n, dk);
    SdpaOptions opt;
    opt.scale = scale;
    opt.backend = Backend::reference;
    Mat Y(B * n, dk), A(B * n, n), dQ(B * n, dk), dK(B * n, dk), dV(B * n, dk);
    scaled_dot_product_attention<double>(
        args, {View4<double>::bhnd(Y.a.data(), B, 1, n, dk), View4<double>::bhnd(A.a.data(), B, 1, n, n)}, opt);
    SdpaGrads<double> g;
    g.dq = View4<double>::bhnd(dQ.a.data(), B, 1, n, dk);
    g.dk = View4<double>::bhnd(dK.a.data(), B, 1, n, dk);
    g.dv = View4<double>::bhnd(dV.a.data(), B, 1, n, dk);
    scaled_dot_product_attention_backward<double>(args, View4<const double>::bhnd(G.a.data(), B, 1, n, dk), {}, g,
                                                  opt);
    // Per query row: Frobenius norm of the softmax Jacobian diag(a) - a aᵀ,
    // the top weight, and |dL/dq_i| (query i's share of dL/dW_Q = Σ_i x_i dq_iᵀ).
    std::vector<double> jn, topw, gq;
    for (int64_t r = 0; r < B * n; ++r) {
      double f = 0, t = 0, g2 = 0;
      for (int64_t j = 0; j < n; ++j) {
        t = std::max(t, A(r, j));
        for (int64_t l = 0; l < n; ++l) {
          const double e = A(r, j) * ((j == l ? 1.0 : 0.0) - A(r, l));
          f += e * e;
        }
      }
      for (int64_t e = 0; e < dk; ++e) g2 += dQ(r, e) * dQ(r, e);
      jn.push_back(std::sqrt(f));
      topw.push_back(t);
      gq.push_back(std::sqrt(g2));
    }
    // |dL/dW_Q|_F with dL/dW_Q = Xᵀ dQ, over every row and over the unsaturated rows only (top weight <= 0.99).
    auto grad_wq = [&](bool unsaturated_only) {
      Mat dq = dQ;
      if (unsaturated_only)
        for (int64_t r = 0; r < B * n; ++r)
          if (topw[size_t(r)] > 0.99)
            for (int64_t e = 0; e < dk; ++e) dq(r, e) = 0;
      double s = 0;
      for (double x : matmul(transpose(X), dq).a) s += x * x;
      return std::sqrt(s);
    };
    const double saturated = double(std::count_if(topw.begin(), topw.end(), [](double t) { return t > 0.99; })) /
                             double(topw.size());
    out.push_back({scale, 100 * saturated, median(jn), std::accumulate(jn.begin(), jn.end(), 0.0) / double(jn.size()),
                   median(gq), grad_wq(false), grad_wq(true)});
  }
  return out;
}

double uniform_jacobian_norm(int64_t n) { return std::sqrt(double(n - 1)) / double(n); }

const std::vector<std::string>& experiment_names() {
  static const std::vector<std::string> n = {"variance", "saturation", "jacobian", "equivariance", "lookup"};
  return n;
}

json run_experiment(const std::string& name, uint64_t seed) {
  if (name == "variance") return variance(seed);
  if (name == "saturation") return saturation(seed);
  if (name == "jacobian") return jacobian(seed);
  if (name == "equivariance") return equivariance(seed);
  if (name == "lookup") return lookup(seed);
  throw InvalidArgument("run_experiment: unknown experiment '" + name +
                        "'; expected one of variance, saturation, jacobian, equivariance, lookup");
}

}  // namespace attn::lesson
