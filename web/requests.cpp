// The explainer's requests (requests.hpp): JSON in, the lesson's and the
// library's computations, JSON out. Nothing here computes attention itself.
#include "requests.hpp"

#include <algorithm>
#include <map>
#include <memory>
#include <string>

#include "attn/nn.hpp"
#include "lesson.hpp"

namespace attn::web {
namespace {

using json = nlohmann::json;
using lesson::Mat;

[[noreturn]] void fail(const std::string& what) { throw InvalidArgument("explainer: " + what); }

const json& field(const json& r, const char* name) {
  if (!r.contains(name)) fail(std::string("request has no '") + name + "'");
  return r.at(name);
}

Mat to_mat(const json& j, const char* name) {
  if (!j.is_array() || j.empty() || !j[0].is_array() || j[0].empty())
    fail(std::string("'") + name + "' must be a non-empty array of rows");
  Mat m(int64_t(j.size()), int64_t(j[0].size()));
  if (m.rows > 64 || m.cols > 1024) fail(std::string("'") + name + "' is larger than 64 x 1024");
  for (int64_t i = 0; i < m.rows; ++i) {
    const json& row = j[size_t(i)];
    if (!row.is_array() || int64_t(row.size()) != m.cols)
      fail(std::string("'") + name + "': row " + std::to_string(i) + " has a different length");
    for (int64_t c = 0; c < m.cols; ++c) {
      if (!row[size_t(c)].is_number()) fail(std::string("'") + name + "' holds a value that is not a number");
      m(i, c) = row[size_t(c)].get<double>();
    }
  }
  return m;
}

json from_mat(const Mat& m) {
  json rows = json::array();
  for (int64_t i = 0; i < m.rows; ++i) {
    json row = json::array();
    for (int64_t c = 0; c < m.cols; ++c) row.push_back(m(i, c));
    rows.push_back(std::move(row));
  }
  return rows;
}

int64_t integer(const json& r, const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  if (!r.contains(name)) return fallback;
  const json& v = r.at(name);
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
    fail(std::string("'") + name + "' must be an integer in " + std::to_string(lo) + ".." + std::to_string(hi));
  return v.get<int64_t>();
}

std::optional<double> number(const json& r, const char* name) {
  if (!r.contains(name) || r.at(name).is_null()) return std::nullopt;
  if (!r.at(name).is_number()) fail(std::string("'") + name + "' must be a number");
  return r.at(name).get<double>();
}

json example(const json& r) {
  const lesson::WorkedExample e = lesson::worked_example(field(r, "name").get<std::string>());
  return {{"intro", e.intro}, {"Q", from_mat(e.Q)}, {"K", from_mat(e.K)}, {"V", from_mat(e.V)},
          {"keys", e.keys},   {"queries", e.queries}, {"qpos", e.qpos}};
}

json tokens(const json& r) {
  const auto words = field(r, "words").get<std::vector<std::string>>();
  const lesson::TokenExample t = lesson::token_example(words, integer(r, "dim", 1, 64, 8), integer(r, "dk", 1, 64, 4),
                                                       uint64_t(integer(r, "seed", 0, int64_t(1) << 40, 1)));
  return {{"words", t.words}, {"X", from_mat(t.X)}, {"Wq", from_mat(t.Wq)}, {"Wk", from_mat(t.Wk)}, {"Wv", from_mat(t.Wv)}};
}

lesson::HeadVariants variants(const json& r) {
  lesson::HeadVariants v;
  if (!r.contains("variants")) return v;
  const json& j = r.at("variants");
  v.scale = number(j, "scale");
  v.causal = j.value("causal", false);
  if (j.contains("window") && !j.at("window").is_null()) {
    const auto w = j.at("window").get<std::vector<int64_t>>();
    if (w.size() != 2) fail("'window' must be [left, right]");
    v.window = {w[0], w[1]};
  }
  v.chunk_size = integer(j, "chunk_size", 0, 1 << 20, 0);
  v.softcap = number(j, "softcap");
  v.slope = number(j, "slope");
  v.sink = number(j, "sink");
  return v;
}

json head(const json& r) {
  json out;
  Mat Q, K, V;
  if (r.contains("X")) {
    const Mat X = to_mat(r.at("X"), "X"), Wq = to_mat(field(r, "Wq"), "Wq"), Wk = to_mat(field(r, "Wk"), "Wk"),
              Wv = to_mat(field(r, "Wv"), "Wv");
    for (const Mat* w : {&Wq, &Wk, &Wv})
      if (w->cols != X.cols) fail("the weights must have as many columns as X (the model width D)");
    if (Wq.rows != Wk.rows) fail("Wq and Wk must have the same number of rows (d_k)");
    Q = lesson::matmul(X, lesson::transpose(Wq));
    K = lesson::matmul(X, lesson::transpose(Wk));
    V = lesson::matmul(X, lesson::transpose(Wv));
    out["Q"] = from_mat(Q), out["K"] = from_mat(K), out["V"] = from_mat(V);
  } else {
    Q = to_mat(field(r, "Q"), "Q"), K = to_mat(field(r, "K"), "K"), V = to_mat(field(r, "V"), "V");
  }
  std::vector<int64_t> qpos;
  if (r.contains("qpos")) qpos = r.at("qpos").get<std::vector<int64_t>>();
  else
    for (int64_t i = 0; i < Q.rows; ++i) qpos.push_back(i);
  const lesson::HeadSteps st = lesson::head_steps(Q, K, V, qpos, variants(r));
  out["scale"] = st.scale;
  out["S"] = from_mat(st.S);
  out["scaled"] = from_mat(st.scaled);
  if (st.capped) out["capped"] = from_mat(*st.capped);
  if (st.bias) out["bias"] = from_mat(*st.bias), out["biased"] = from_mat(*st.biased);
  if (st.visible) out["visible"] = from_mat(*st.visible), out["rule"] = st.rule;
  out["A"] = from_mat(st.A);
  out["Y"] = from_mat(st.Y);
  out["lse"] = st.lse;
  if (st.on_sink) out["on_sink"] = from_mat(*st.on_sink);
  return out;
}

json dk(const json& r) {
  const int64_t d = integer(r, "dk", 1, 512, 16);
  const auto seed = uint64_t(integer(r, "seed", 0, int64_t(1) << 40, 0));
  json jac = json::array();
  for (const lesson::JacobianRow& j : lesson::jacobian_rows(d, seed, integer(r, "batch", 1, 64, 4)))
    jac.push_back({{"scale", j.scale}, {"saturated_pct", j.saturated_pct}, {"median_jacobian", j.median_jacobian},
                   {"mean_jacobian", j.mean_jacobian}, {"median_query_grad", j.median_query_grad}});
  return {{"variance", lesson::variance_row(d, seed, int(integer(r, "pairs", 2, lesson::kVariancePairs, 500)))},
          {"saturation", lesson::saturation_row(d, seed, int(integer(r, "trials", 1, lesson::kSaturationTrials, 200)))},
          {"jacobian", jac},
          {"uniform_jacobian", lesson::uniform_jacobian_norm(lesson::kJacobianTokens)},
          {"keys", lesson::kSaturationKeys},
          {"tokens", lesson::kJacobianTokens}};
}

json permute(const json& r) {
  const Mat X = to_mat(field(r, "X"), "X");
  const auto perm = field(r, "perm").get<std::vector<int64_t>>();
  std::vector<int64_t> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i)
    if (sorted[i] != int64_t(i) || int64_t(sorted.size()) != X.rows) fail("'perm' must be a permutation of X's rows");
  const lesson::PermutationCheck c =
      lesson::permutation_check(X, to_mat(field(r, "Wq"), "Wq"), to_mat(field(r, "Wk"), "Wk"), to_mat(field(r, "Wv"), "Wv"),
                                perm, r.value("positions", false), r.value("causal", false));
  return {{"Y", from_mat(c.Y)},
          {"Y_of_permuted", from_mat(c.Y_of_permuted)},
          {"permuted_Y", from_mat(c.permuted_Y)},
          {"max_diff", c.max_diff}};
}

// The trained model, loaded once per path.
struct LoadedModel {
  nn::TrainConfig config;
  std::unique_ptr<nn::Transformer<float>> model;
  int64_t step = 0;
};

LoadedModel& load(const std::string& path) {
  static std::map<std::string, LoadedModel> models;
  auto it = models.find(path);
  if (it != models.end()) return it->second;
  LoadedModel m;
  m.config = nn::checkpoint_config(path);
  nn::ModelConfig mc = nn::model_config(m.config);
  mc.backend = Backend::reference;  // the portable build has only the reference backend
  m.model = std::make_unique<nn::Transformer<float>>(mc);
  m.step = nn::load_training_checkpoint<float>(path, *m.model, nullptr);
  return models.emplace(path, std::move(m)).first->second;
}

json model(const json& r) {
  LoadedModel& m = load(field(r, "path").get<std::string>());
  const nn::Task task(m.config.task);
  const int64_t V = task.vocab_size();
  std::map<std::string, int32_t> ids;
  for (int32_t t = 0; t < V; ++t) ids[task.token_label(t)] = t;
  std::vector<int32_t> toks;
  for (const auto& w : field(r, "words").get<std::vector<std::string>>()) {
    auto it = ids.find(w);
    if (it == ids.end()) fail("'" + w + "' is not in the model's vocabulary");
    toks.push_back(it->second);
  }
  const auto N = int64_t(toks.size());
  if (N < 1 || N > m.model->config().max_len)
    fail("the model takes 1.." + std::to_string(m.model->config().max_len) + " tokens, got " + std::to_string(N));
  Tensor<float> logits;
  std::vector<Tensor<float>> att;
  m.model->forward(toks.data(), 1, N, logits, &att);
  const int64_t H = m.model->config().heads;
  json layers = json::array();
  for (const Tensor<float>& a : att) {  // (1, H, N, N)
    json heads = json::array();
    for (int64_t h = 0; h < H; ++h) {
      Mat w(N, N);
      for (int64_t i = 0; i < N * N; ++i) w.a[size_t(i)] = double(a[size_t(h * N * N + i)]);
      heads.push_back(from_mat(w));
    }
    layers.push_back(heads);
  }
  std::vector<std::string> labels, predicted;
  for (int64_t i = 0; i < N; ++i) {
    labels.push_back(task.token_label(toks[size_t(i)]));
    const float* row = logits.data() + i * V;
    predicted.push_back(task.token_label(int32_t(std::max_element(row, row + V) - row)));
  }
  std::vector<std::string> symbols;
  for (int32_t t = 2; t < V; ++t) symbols.push_back(task.token_label(t));
  return {{"task", nn::task_name(m.config.task.kind)},
          {"length", m.config.task.length},
          {"symbols", symbols},
          {"layers", layers},
          {"labels", labels},
          {"predicted", predicted},
          {"step", m.step},
          {"dim", m.model->config().dim},
          {"heads", H}};
}

}  // namespace

json handle(const json& request) {
  try {
    const std::string op = field(request, "op").get<std::string>();
    if (op == "example") return example(request);
    if (op == "tokens") return tokens(request);
    if (op == "head") return head(request);
    if (op == "dk") return dk(request);
    if (op == "permute") return permute(request);
    if (op == "model") return model(request);
    fail("unknown op '" + op + "'; expected example, tokens, head, dk, permute or model");
  } catch (const std::exception& e) {  // attn's errors and JSON type errors alike
    return {{"error", e.what()}};
  }
}

}  // namespace attn::web
