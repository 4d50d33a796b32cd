// `attn explain`: every step of attention on a small input, printed. The two
// built-in examples are 'the cat was hungry' and the two-token example; `random` builds a small
// multi-head layer and also shows the per-head pieces, the concatenation and
// the output projection W_O. Weights are printed as the library (and
// PyTorch's state_dict) hold them, [out, in]: a token x is
// projected as q = W_Q·x, so the token rows X project as Q = X·W_Qᵀ.
// --window, --alibi and --sinks add the variants (docs/variants.md) to every
// head, each printed as its own step, and --png draws the weights as a
// heatmap (a window shows as a band along the diagonal).
#include <cmath>
#include <optional>
#include <random>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "plot.hpp"

namespace attn::cli {
namespace {

struct ExplainOpts {
  std::string example = "cat";
  int64_t dk = 0, dim = 8, heads = 2, tokens = 4;
  bool causal = false;
  uint64_t seed = 1;
  std::vector<int64_t> window;  // LEFT, RIGHT when given
  bool alibi = false;
  std::vector<double> alibi_slopes, sinks;  // H values, or one for every head
  std::string png;
};

using lesson::HeadVariants;

// The variants of head h of H from the flags.
HeadVariants head_variants(const ExplainOpts& o, int64_t h, int64_t H) {
  HeadVariants v;
  v.causal = o.causal;
  if (!o.window.empty()) v.window = {o.window[0], o.window[1]};
  if (o.alibi) v.slope = alibi_slopes(H)[size_t(h)];
  if (!o.alibi_slopes.empty()) v.slope = per_head_values(o.alibi_slopes, H, "attn explain", "--alibi-slopes")[size_t(h)];
  if (!o.sinks.empty()) v.sink = per_head_values(o.sinks, H, "attn explain", "--sinks")[size_t(h)];
  return v;
}

// The flags of every head of H through the library on a one-token example,
// so that a bad value fails before any step is printed.
void check_variants(const ExplainOpts& o, int64_t H) {
  const Mat one(1, 1, {0});
  for (int64_t h = 0; h < H; ++h) (void)lesson::head_steps(one, one, one, {0}, head_variants(o, h, H));
}

// Scores, scaling, the variants, softmax and aggregation for one head
// (lesson::head_steps), printed. Query i sits at key position qpos[i]
// (consecutive) for the causal rule, the window and ALiBi. Returns (A, Y).
std::pair<Mat, Mat> explain_head(const Mat& Q, const Mat& K, const Mat& V, const std::vector<std::string>& qlab,
                                 const std::vector<int64_t>& qpos, const HeadVariants& var,
                                 const std::string& suffix) {
  const lesson::HeadSteps st = lesson::head_steps(Q, K, V, qpos, var);
  print_mat("S" + suffix + " = Q" + suffix + " K" + suffix + "^T   (entry i,j: query i . key j)", st.S, qlab);
  print_mat(fmt::format("S{} / sqrt(d_k) = S{} / {:.4g}", suffix, suffix, 1 / st.scale), st.scaled, qlab);
  std::string scores = "S" + suffix + " / sqrt(d_k)";
  if (st.bias) {
    print_mat(fmt::format("ALiBi bias{} = -m |p_i - j|, slope m = {:.6g}   (p_i: query i's position)", suffix, *var.slope),
              *st.bias, qlab);
    print_mat(fmt::format("S{} / sqrt(d_k) + ALiBi bias", suffix), *st.biased, qlab);
    scores += " + bias";
  }
  if (st.visible)
    print_mat("visible" + suffix + " (1 = the query may attend to the key; " + st.rule + ")", *st.visible, qlab, 0);
  std::string how = "A" + suffix + " = softmax(" + scores + "), row by row";
  if (var.masks()) how += " over the visible keys";
  if (var.sink) how += fmt::format(", with a sink logit {:.6g} in every denominator", *var.sink);
  print_mat(how, st.A, qlab);
  if (st.on_sink)
    print_mat("weight on the sink" + suffix + " = exp(sink - lse) = 1 - row sum of A" + suffix, *st.on_sink, qlab);
  print_mat("Y" + suffix + " = A" + suffix + " V" + suffix + "   (each row a weighted average of V's rows)", st.Y, qlab);
  return {st.A, st.Y};
}

// The heatmap of the heads' weights (--png), written when the run succeeds.
void draw_weights(const ExplainOpts& o, const std::vector<Mat>& heads, const std::vector<std::string>& qlab,
                  const std::vector<std::string>& klab, Outputs& outputs, const std::string& png) {
  if (png.empty()) return;
  std::vector<double> w;
  for (const Mat& a : heads) w.insert(w.end(), a.a.begin(), a.a.end());
  std::string title = "attention weights (" + o.example;
  if (o.causal) title += ", causal";
  if (!o.window.empty()) title += fmt::format(", window {},{}", o.window[0], o.window[1]);
  if (o.alibi || !o.alibi_slopes.empty()) title += ", ALiBi";
  if (!o.sinks.empty()) title += ", sinks";
  const std::string sub = o.sinks.empty() ? "" : "rows: queries, columns: keys; each row sums to 1 minus its weight on the sink";
  draw_heatmap(w, int64_t(heads.size()), heads[0].rows, heads[0].cols, qlab, klab, title + ")", png, {}, 0, sub);
  outputs.commit();
  fmt::print(stderr, "attn explain: wrote {} ({} head(s) of {} x {})\n", o.png, heads.size(), heads[0].rows, heads[0].cols);
}

std::string row_string(const Mat& m, int64_t r, int decimals) {
  std::string s;
  for (int64_t j = 0; j < m.cols; ++j) s += fmt::format("{}{:.{}f}", j ? " " : "", m(r, j), decimals);
  return s;
}

void run_builtin(const ExplainOpts& o) {
  check_variants(o, 1);  // the flags, before any output
  Outputs outputs;
  const std::string png = outputs.add("--png", o.png);
  const lesson::WorkedExample ex = lesson::worked_example(o.example);
  const Mat &Q = ex.Q, &K = ex.K, &V = ex.V;
  const std::vector<std::string>&keys = ex.keys, &qlab = ex.queries;
  fmt::print("{}\n\n", ex.intro);
  print_mat("Q (given)", Q, qlab);
  print_mat("K (given)", K, keys);
  print_mat("V (given)", V, keys);
  const auto [A, Y] = explain_head(Q, K, V, qlab, ex.qpos, head_variants(o, 0, 1), "");
  fmt::print("\nResult for \"{}\": weights {}  ->  output {}\n", qlab[0], row_string(A, 0, ex.weight_decimals), row_string(Y, 0, ex.output_decimals));
  draw_weights(o, {A}, qlab, keys, outputs, png);
}

void run_random(const ExplainOpts& o) {
  const int64_t H = o.heads, D = o.dim, n = o.tokens;
  const int64_t dk = o.dk ? o.dk : D / H;
  if (H < 1 || D < 1 || n < 1 || n > 16 || D > 64 || H > 8)
    throw UsageError("attn explain: --tokens must be 1..16, --dim 1..64, --heads 1..8");
  if (!o.dk && D % H != 0)
    throw UsageError(fmt::format("attn explain: --dim {} is not divisible by --heads {}; give --dk", D, H));
  if (dk < 1 || dk > 64) throw UsageError("attn explain: --dk must be 1..64");
  check_variants(o, H);  // the flags, before any output
  Outputs outputs;
  const std::string png = outputs.add("--png", o.png);
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> nd;
  // Entries rounded to one decimal so every step can be checked by hand.
  auto rnd = [&](int64_t r, int64_t c, double sd) {
    Mat m(r, c);
    for (auto& x : m.a) x = std::round(nd(rng) * sd * 10) / 10;
    return m;
  };
  static const char* words[] = {"the", "cat", "was", "hungry", "and", "it", "sat", "on",
                                "a",   "warm", "mat", "by",    "the", "old", "red", "door"};
  std::vector<std::string> tok;
  std::vector<int64_t> pos;
  for (int64_t i = 0; i < n; ++i) tok.push_back(words[i]), pos.push_back(i);
  fmt::print("A random multi-head self-attention layer: {} tokens, model width D = {}, H = {} head(s) of d_k = d_v = "
             "{}{} (seed {}).\n\n",
             n, D, H, dk, o.causal ? ", causal" : "", o.seed);
  std::vector<Mat> weights;
  const Mat X = rnd(n, D, 1.0);
  const double sd = 1 / std::sqrt(double(D));
  // [out, in] = [H·d_k, D], the layout of the library's q_proj_weight (the
  // row blocks of PyTorch's in_proj_weight)
  const Mat Wq = rnd(H * dk, D, sd), Wk = rnd(H * dk, D, sd), Wv = rnd(H * dk, D, sd);
  print_mat("X (token embeddings, one row per token)", X, tok, 1);
  fmt::print("Weights are stored [out, in] as in the library and PyTorch (W_Q is {} x {}: q = W_Q x for a token\n"
             "column x), so the token rows X project as Q = X W_Q^T.\n\n",
             H * dk, D);
  print_mat(fmt::format("W_Q  [out, in] = [H*d_k, D] = [{}, {}]", H * dk, D), Wq, {}, 1);
  print_mat("W_K  [out, in]", Wk, {}, 1);
  print_mat("W_V  [out, in]", Wv, {}, 1);
  const Mat Q = matmul(X, transpose(Wq)), K = matmul(X, transpose(Wk)), V = matmul(X, transpose(Wv));
  print_mat("Q = X W_Q^T", Q, tok);
  print_mat("K = X W_K^T", K, tok);
  print_mat("V = X W_V^T", V, tok);
  Mat concat(n, H * dk);
  for (int64_t h = 0; h < H; ++h) {
    const std::string sfx = H > 1 ? fmt::format("_{}", h) : "";
    if (H > 1) {
      fmt::print("\n-- head {}: columns {}..{} of Q, K and V --\n", h, h * dk, (h + 1) * dk - 1);
      print_mat("Q" + sfx, columns(Q, h * dk, (h + 1) * dk), tok);
      print_mat("K" + sfx, columns(K, h * dk, (h + 1) * dk), tok);
      print_mat("V" + sfx, columns(V, h * dk, (h + 1) * dk), tok);
    }
    const auto [A, Y] = explain_head(columns(Q, h * dk, (h + 1) * dk), columns(K, h * dk, (h + 1) * dk),
                                     columns(V, h * dk, (h + 1) * dk), tok, pos, head_variants(o, h, H), sfx);
    weights.push_back(A);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < dk; ++j) concat(i, h * dk + j) = Y(i, j);
  }
  if (H > 1) {
    fmt::print("\n-- combining the heads --\n");
    print_mat("O = [Y_0 | Y_1 | ...] (heads side by side)", concat, tok);
    const Mat Wo = rnd(D, H * dk, 1 / std::sqrt(double(H * dk)));  // out_proj.weight [D, H·d_v]
    print_mat(fmt::format("W_O  [out, in] = [D, H*d_v] = [{}, {}]", D, H * dk), Wo, {}, 1);
    print_mat("output = O W_O^T", matmul(concat, transpose(Wo)), tok);
  }
  draw_weights(o, weights, tok, tok, outputs, png);
}

}  // namespace

void explain_example(const std::string& name) {
  ExplainOpts o;
  o.example = name;
  if (name == "random") run_random(o);
  else run_builtin(o);
}

void add_explain(CLI::App& app) {
  auto o = std::make_shared<ExplainOpts>();
  auto* c = app.add_subcommand("explain", "Print every step of attention on a small example");
  c->add_option("--example", o->example, "cat | two-tokens (the worked examples) | random")
      ->check(CLI::IsMember({"cat", "two-tokens", "random"}))
      ->capture_default_str();
  c->add_option("--dk", o->dk, "head size d_k for --example random (default dim/heads)");
  c->add_option("--dim", o->dim, "model width D for --example random")->capture_default_str();
  c->add_option("--heads", o->heads, "number of heads for --example random")->capture_default_str();
  c->add_option("--tokens", o->tokens, "number of tokens for --example random")->capture_default_str();
  c->add_option("--seed", o->seed, "random seed for --example random")->capture_default_str();
  c->add_flag("--causal", o->causal, "mask keys after each query's position");
  c->add_option("--window", o->window, "sliding window LEFT,RIGHT: keys p-LEFT..p+RIGHT of the query's position p, "
                                       "-1 = unbounded")
      ->delimiter(',')
      ->expected(2)
      ->check(integer_value());
  auto* alibi =
      c->add_flag("--alibi", o->alibi, "ALiBi: add -m|p - j| with the paper's slopes (2^(-8(h+1)/H) for H a power of two)");
  add_number_list(c, "--alibi-slopes", o->alibi_slopes, "ALiBi with these slopes m (H values, or one for all)")
      ->excludes(alibi);
  add_number_list(c, "--sinks", o->sinks, "attention sinks: one logit per head (H values, or one for all)");
  c->add_option("--png", o->png, "draw the attention weights of every head as a heatmap (.png)");
  c->footer(kExitCodesHelp);
  c->callback([o, c] {
    if (o->example == "random") return run_random(*o);
    for (const char* opt : {"--dk", "--dim", "--heads", "--tokens", "--seed"})
      if (c->count(opt)) throw UsageError(std::string("attn explain: ") + opt + " applies only to --example random");
    run_builtin(*o);
  });
}

}  // namespace attn::cli
