// The experiments behind `attn experiment` and the tour. Every figure is
// measured on random data from a seeded generator; nothing is tabulated by
// hand. Attention itself always goes through the library (double precision,
// reference backend), so these are also end-to-end checks of attn.
#include "experiments.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "common.hpp"
#include "plot.hpp"

namespace attn::cli {
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

Mat randn(int64_t r, int64_t c, std::mt19937_64& rng, double sd = 1.0) {
  Mat m(r, c);
  std::normal_distribution<double> nd(0.0, sd);
  for (auto& x : m.a) x = nd(rng);
  return m;
}

// Standard deviation of q.k over 5000 pairs of unit-variance vectors.
json variance(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd;
  const int pairs = 5000;
  json rows = json::array();
  for (int dk = 1; dk <= 512; dk *= 2) {
    std::vector<double> s(pairs), scaled(pairs);
    for (int p = 0; p < pairs; ++p) {
      double dot = 0;
      for (int e = 0; e < dk; ++e) dot += nd(rng) * nd(rng);  // q_e * k_e
      s[size_t(p)] = dot;
      scaled[size_t(p)] = dot / std::sqrt(double(dk));
    }
    const double sd = stddev(s);
    rows.push_back({dk, std::sqrt(double(dk)), sd, sd / std::sqrt(double(dk)), stddev(scaled)});
  }
  return {{"experiment", "variance"},
          {"title", "Spread of the score q.k for random unit-variance q, k (5000 pairs per d_k)"},
          {"columns", {"d_k", "sqrt(d_k)", "std(q.k)", "std/sqrt(d_k)", "std(q.k/sqrt(d_k))"}},
          {"rows", rows},
          {"conclusion", "The unscaled score's standard deviation tracks sqrt(d_k); dividing by sqrt(d_k) "
                         "holds it at 1 for every head size."}};
}

// Top-two score gap, weight ratio and top weight over 4 keys, unscaled and scaled.
json saturation(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd;
  const int trials = 2000, n = 4;
  json rows = json::array();
  for (int dk : {1, 4, 16, 64, 256}) {
    std::vector<double> gap[2], ratio[2], top[2];
    for (int t = 0; t < trials; ++t) {
      std::vector<double> q(size_t(dk), 0.0);
      for (auto& x : q) x = nd(rng);
      double s[n];
      for (int j = 0; j < n; ++j) {
        s[j] = 0;
        for (int e = 0; e < dk; ++e) s[j] += q[size_t(e)] * nd(rng);
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
    rows.push_back({dk, median(gap[0]), median(ratio[0]), median(top[0]), median(gap[1]), median(ratio[1]),
                    median(top[1])});
  }
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
  std::mt19937_64 rng(seed);
  const int64_t B = 64, n = 8, D = 256, dk = 256;
  const Mat X = randn(B * n, D, rng);
  const Mat Wq = randn(D, dk, rng, 1 / std::sqrt(double(D)));  // keeps q, k entries at unit variance
  const Mat Wk = randn(D, dk, rng, 1 / std::sqrt(double(D)));
  const Mat Wv = randn(D, dk, rng, 1 / std::sqrt(double(D)));
  const Mat Q = matmul(X, Wq), K = matmul(X, Wk), V = matmul(X, Wv);
  const Mat G = randn(B * n, dk, rng);  // dL/dY of a random linear loss
  json rows = json::array();
  double unsat_share = 0;  // |dL/dW_Q| from unsaturated rows / total, unscaled
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
    const Mat dWq = matmul(transpose(X), dQ);  // dL/dW_Q = Xᵀ dQ
    double gn = 0;
    for (double x : dWq.a) gn += x * x;
    // The same sum over the unsaturated rows only (top weight <= 0.99).
    Mat dQu = dQ;
    for (int64_t r = 0; r < B * n; ++r)
      if (topw[size_t(r)] > 0.99)
        for (int64_t e = 0; e < dk; ++e) dQu(r, e) = 0;
    const Mat dWqu = matmul(transpose(X), dQu);
    double gu = 0;
    for (double x : dWqu.a) gu += x * x;
    if (!sc) unsat_share = std::sqrt(gu / gn);
    const double saturated = double(std::count_if(topw.begin(), topw.end(), [](double t) { return t > 0.99; })) /
                             double(topw.size());
    rows.push_back({sc ? "scaled 1/sqrt(256)" : "unscaled", scale, 100 * saturated, median(jn),
                    std::accumulate(jn.begin(), jn.end(), 0.0) / double(jn.size()), median(gq), std::sqrt(gn)});
  }
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

// Sinusoidal positional encoding row for position p (width D).
void add_positions(Mat& x) {
  for (int64_t p = 0; p < x.rows; ++p)
    for (int64_t i = 0; i < x.cols; ++i) {
      const double f = std::pow(10000.0, -double(i / 2 * 2) / double(x.cols));
      x(p, i) += (i % 2 == 0) ? std::sin(double(p) * f) : std::cos(double(p) * f);
    }
}

json equivariance(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t n = 6, D = 16, dk = 8;
  const Mat X = randn(n, D, rng);
  const Mat Wq = randn(D, dk, rng, 0.5), Wk = randn(D, dk, rng, 0.5), Wv = randn(D, dk, rng, 0.5);
  const std::vector<int64_t> perm = {3, 0, 5, 1, 4, 2};  // row i of PX is row perm[i] of X
  auto permute = [&](const Mat& m) {
    Mat p(m.rows, m.cols);
    for (int64_t i = 0; i < m.rows; ++i)
      for (int64_t j = 0; j < m.cols; ++j) p(i, j) = m(perm[size_t(i)], j);
    return p;
  };
  auto layer = [&](const Mat& x, bool causal) {
    Mat y;
    attention(matmul(x, Wq), matmul(x, Wk), matmul(x, Wv), 1 / std::sqrt(double(dk)), y, nullptr, nullptr, causal);
    return y;
  };
  auto max_err = [](const Mat& a, const Mat& b) {
    double e = 0;
    for (size_t i = 0; i < a.a.size(); ++i) e = std::max(e, std::abs(a.a[i] - b.a[i]));
    return e;
  };
  json rows = json::array();
  auto add = [&](const char* what, double err) { rows.push_back({what, err, err < 1e-9 ? "yes" : "no"}); };
  add("plain self-attention", max_err(layer(permute(X), false), permute(layer(X, false))));
  add("causal mask", max_err(layer(permute(X), true), permute(layer(X, true))));
  Mat xp = X, pxp = permute(X);
  add_positions(xp);
  add_positions(pxp);
  add("sinusoidal positions added", max_err(layer(pxp, false), permute(layer(xp, false))));
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
  std::mt19937_64 rng(seed);
  const int64_t m = 8, dv = 4;
  Mat table(m, dv);  // the dictionary: key t -> value row t
  std::uniform_int_distribution<int> ud(-9, 9);
  for (auto& x : table.a) x = ud(rng);
  // Context: the m dictionary entries as one-hot tokens, in shuffled order.
  std::vector<int64_t> order(static_cast<size_t>(m));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
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
  throw UsageError("unknown experiment '" + name + "'; expected one of variance, saturation, jacobian, "
                   "equivariance, lookup");
}

void print_experiment(const json& r) {
  fmt::print("{}\n", r["title"].get<std::string>());
  const auto& cols = r["columns"];
  std::vector<std::vector<std::string>> cells;
  std::vector<size_t> width(cols.size());
  for (size_t c = 0; c < cols.size(); ++c) width[c] = cols[c].get<std::string>().size();
  for (const auto& row : r["rows"]) {
    std::vector<std::string> line;
    for (size_t c = 0; c < row.size(); ++c) {
      const auto& v = row[c];
      std::string s;
      if (v.is_string()) s = v.get<std::string>();
      else if (v.is_number_integer()) s = std::to_string(v.get<int64_t>());
      else {
        const double d = v.get<double>();
        s = (d == 0 || (std::abs(d) >= 1e-3 && std::abs(d) < 1e5)) ? fmt::format("{:.4g}", d) : fmt::format("{:.3e}", d);
      }
      width[c] = std::max(width[c], s.size());
      line.push_back(s);
    }
    cells.push_back(line);
  }
  auto rule = [&] {
    std::string s = "  ";
    for (size_t c = 0; c < cols.size(); ++c) s += std::string(width[c] + (c ? 2 : 0), '-');
    fmt::print("{}\n", s);
  };
  std::string head = "  ";
  for (size_t c = 0; c < cols.size(); ++c) head += fmt::format("{}{:>{}}", c ? "  " : "", cols[c].get<std::string>(), width[c]);
  fmt::print("{}\n", head);
  rule();
  for (const auto& line : cells) {
    std::string s = "  ";
    for (size_t c = 0; c < line.size(); ++c) s += fmt::format("{}{:>{}}", c ? "  " : "", line[c], width[c]);
    fmt::print("{}\n", s);
  }
  fmt::print("  => {}\n", r["conclusion"].get<std::string>());
}

bool experiment_has_plot(const std::string& name) {
  return name == "variance" || name == "saturation" || name == "lookup";
}

void plot_experiment(const json& r, const std::string& path) {
  const std::string name = r["experiment"];
  auto col = [&](size_t c) {
    std::vector<double> v;
    for (const auto& row : r["rows"]) v.push_back(row[c].get<double>());
    return v;
  };
  const Rgb blue{31, 119, 180}, orange{255, 127, 14}, grey{120, 120, 120}, green{44, 160, 44};
  Chart ch;
  if (name == "variance") {
    ch.title = "Score spread vs head size (5000 random pairs)";
    ch.xlabel = "d_k";
    ch.ylabel = "standard deviation of the score";
    ch.logx = ch.logy = true;
    ch.xticks = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
    ch.yticks = {0.5, 1, 2, 4, 8, 16, 32};
    ch.series = {{"sqrt(d_k)", col(0), col(1), grey, true, false},
                 {"std(q.k) unscaled", col(0), col(2), blue},
                 {"std(q.k / sqrt(d_k)) scaled", col(0), col(4), orange}};
  } else if (name == "saturation") {
    ch.title = "Weight on the top key (median, 4 random keys)";
    ch.xlabel = "d_k";
    ch.ylabel = "top attention weight";
    ch.logx = true;
    ch.xticks = {1, 4, 16, 64, 256};
    ch.yticks = {0.25, 0.5, 0.75, 1.0};
    ch.legend_bottom = true;
    ch.series = {{"unscaled", col(0), col(3), blue}, {"scaled by 1/sqrt(d_k)", col(0), col(6), orange}};
  } else if (name == "lookup") {
    ch.title = "Attention as a dictionary lookup: error vs query scale c";
    ch.xlabel = "query scale c";
    ch.ylabel = "error (log scale)";
    ch.logx = ch.logy = true;
    ch.legend_bottom = true;
    ch.xticks = {1, 2, 4, 8, 16, 32, 64, 128};
    std::vector<double> miss = col(2);
    for (auto& x : miss) x = 1 - x;
    std::vector<double> err = col(3);
    for (auto& x : err) x = std::max(x, 1e-17);  // an exact zero sits on the floor of the plot
    ch.series = {{"max |Y - table|", col(0), err, blue}, {"1 - weight on the match", col(0), miss, green}};
  } else {
    throw UsageError("experiment '" + name + "' has no plot (plots: variance, saturation, lookup)");
  }
  draw_chart(ch, path);
}

}  // namespace attn::cli
