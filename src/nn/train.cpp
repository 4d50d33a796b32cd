// The training loop: seeded data per step, forward/loss/backward, clipping,
// the optimizer step under the schedule, held-out evaluation, checkpoints
// and the curve.
#include "attn/nn/train.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn/detail/output.hpp"
#include "attn/io.hpp"
#include "attn/nn/optim.hpp"
#include "validate.hpp"

namespace attn::nn {

namespace {

constexpr uint64_t kModelStream = 1, kDataStream = 2, kEvalStream = 3, kDropoutStream = 4;
constexpr const char* kFormat = "attn.nn.checkpoint/1";

// A double as text that reads back to the same bits.
std::string fmt_exact(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

// Row-wise argmax accuracy of logits (B·N, V) against targets, per token and
// per sequence (a sequence counts when every scored token is right).
struct Accuracy {
  int64_t tokens = 0, tokens_right = 0, seqs = 0, seqs_right = 0;
};
template <class T>
Accuracy accuracy(const Tensor<T>& logits, const int32_t* targets, int64_t B, int64_t N) {
  Accuracy a;
  const int64_t V = logits.dim(1);
  for (int64_t b = 0; b < B; ++b) {
    bool all = true;
    for (int64_t n = 0; n < N; ++n) {
      const int32_t t = targets[b * N + n];
      if (t < 0) continue;
      const T* z = logits.data() + (b * N + n) * V;
      int64_t arg = 0;
      for (int64_t j = 1; j < V; ++j)
        if (z[j] > z[arg]) arg = j;
      ++a.tokens;
      if (arg == t) ++a.tokens_right;
      else all = false;
    }
    ++a.seqs;
    if (all) ++a.seqs_right;
  }
  return a;
}

nlohmann::json config_json(const TrainConfig& c) {
  return {{"task", task_name(c.task.kind)},
          {"length", c.task.length},
          {"symbols", c.task.symbols},
          {"queries", c.task.queries},
          {"layers", c.layers},
          {"dim", c.dim},
          {"heads", c.heads},
          {"positions", positions_name(c.positions)},
          {"causal", c.causal},
          {"window_left", c.window.left},
          {"window_right", c.window.right},
          {"chunk_size", c.chunk_size},
          {"sinks", c.sinks},
          {"scale_none", c.scale_none},
          {"dropout", c.dropout},
          {"precision", precision_name(c.precision)},
          {"optimizer", c.optimizer},
          {"lr", c.lr},
          {"min_lr", c.min_lr},
          {"warmup", c.warmup},
          {"steps", c.steps},
          {"batch", c.batch},
          {"clip", c.clip},
          {"weight_decay", c.weight_decay},
          {"momentum", c.momentum},
          {"seed", c.seed},
          {"curriculum", c.curriculum},
          {"curriculum_threshold", c.curriculum_threshold}};
}

// The fields of a stored configuration, each of exactly its JSON type: a
// length of 4.5 or "8" is refused, not rounded or converted.
class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& j, std::string who) : j_(j), who_(std::move(who)) {
    if (!j_.is_object()) throw InvalidArgument(who_ + "the config metadata is not a JSON object");
  }
  // The value of `key` as V when `ok` accepts its JSON value; `fallback`
  // when absent (required when there is none).
  template <class V>
  V get(const char* key, bool (nlohmann::json::*ok)() const noexcept, const char* expected,
        std::optional<V> fallback = std::nullopt) const {
    auto it = j_.find(key);
    if (it == j_.end()) {
      if (fallback) return *fallback;
      throw InvalidArgument(who_ + "config lacks '" + key + "'");
    }
    if (!((*it).*ok)() || (std::is_same_v<V, int64_t> && it->is_number_unsigned() &&
                           it->template get<uint64_t>() > uint64_t(INT64_MAX)))
      throw InvalidArgument(who_ + "config '" + key + "' is " + it->dump() + ", expected " + expected);
    return it->template get<V>();
  }
  int64_t integer(const char* key, std::optional<int64_t> fallback = std::nullopt) const {
    return get<int64_t>(key, &nlohmann::json::is_number_integer, "an integer", fallback);
  }
  double number(const char* key, std::optional<double> fallback = std::nullopt) const {
    return get<double>(key, &nlohmann::json::is_number, "a number", fallback);
  }
  uint64_t unsigned_integer(const char* key) const {
    return get<uint64_t>(key, &nlohmann::json::is_number_unsigned, "an integer >= 0");
  }
  bool boolean(const char* key) const { return get<bool>(key, &nlohmann::json::is_boolean, "true or false"); }
  std::string string(const char* key) const {
    return get<std::string>(key, &nlohmann::json::is_string, "a string");
  }

 private:
  const nlohmann::json& j_;
  std::string who_;
};

TrainConfig config_from_json(const nlohmann::json& j, const std::string& who) {
  const ConfigReader r(j, who);
  TrainConfig c;
  c.task.kind = parse_task(r.string("task"));
  c.task.length = r.integer("length");
  c.task.symbols = r.integer("symbols");
  c.task.queries = r.integer("queries", 0);
  c.layers = r.integer("layers");
  c.dim = r.integer("dim");
  c.heads = r.integer("heads");
  c.positions = parse_positions(r.string("positions"));
  c.causal = r.boolean("causal");
  c.window.left = r.integer("window_left", -1);  // absent in checkpoints older than windows
  c.window.right = r.integer("window_right", -1);
  c.chunk_size = r.integer("chunk_size", 0);  // absent in checkpoints older than chunks
  c.sinks = r.get<bool>("sinks", &nlohmann::json::is_boolean, "true or false", false);
  c.scale_none = r.boolean("scale_none");
  c.dropout = r.number("dropout", 0.0);  // absent in checkpoints older than dropout
  // absent in checkpoints older than mixed precision
  c.precision = parse_precision(r.get<std::string>("precision", &nlohmann::json::is_string, "a string", "fp32"));
  c.optimizer = r.string("optimizer");
  c.lr = r.number("lr");
  c.min_lr = r.number("min_lr");
  c.warmup = r.integer("warmup");
  c.steps = r.integer("steps");
  c.batch = r.integer("batch");
  c.clip = r.number("clip");
  c.weight_decay = r.number("weight_decay");
  c.momentum = r.number("momentum");
  c.seed = r.unsigned_integer("seed");
  c.curriculum = r.integer("curriculum", 0);
  c.curriculum_threshold = r.number("curriculum_threshold", 0.9);
  return c;
}

std::unique_ptr<Optimizer<float>> make_optimizer(const TrainConfig& c, std::vector<ParamRef<float>> params) {
  if (c.optimizer == "adamw") {
    AdamWConfig a;
    a.weight_decay = c.weight_decay;
    return std::make_unique<AdamW<float>>(std::move(params), a);
  }
  SgdConfig s;
  s.momentum = c.momentum;
  s.weight_decay = c.weight_decay;
  return std::make_unique<Sgd<float>>(std::move(params), s);
}

// The in_proj rows that make Q (rows [0, D)) and K (rows [D, 2D)), over all blocks.
template <class T>
void qk_grad_norms(Transformer<T>& model, double& q, double& k) {
  double sq = 0, sk = 0;
  for (auto& blk : model.blocks()) {
    const auto& g = blk.attn.layer.grad("in_proj_weight");
    const size_t DD = size_t(blk.attn.layer.embed_dim() * blk.attn.layer.embed_dim());
    for (size_t i = 0; i < DD; ++i) sq += double(g[i]) * double(g[i]);
    for (size_t i = DD; i < 2 * DD; ++i) sk += double(g[i]) * double(g[i]);
  }
  q = std::sqrt(sq);
  k = std::sqrt(sk);
}

// Checkpoints hold three tensors per parameter with AdamW; let the header
// size, not the tensor count, bound what is read.
io::Limits checkpoint_limits() {
  io::Limits lim;
  lim.max_tensors = 1 << 20;
  return lim;
}

// "nan", "inf" or "-inf" (std::to_string may print "-nan").
std::string non_finite_name(double x) { return std::isnan(x) ? "nan" : x > 0 ? "inf" : "-inf"; }

// A metadata value that must be present; `who` prefixes the error.
const std::string& metadata_value(const io::Metadata& meta, const char* key, const std::string& who) {
  auto it = meta.find(key);
  if (it == meta.end()) throw InvalidArgument(who + "metadata lacks '" + key + "' (not an attn training checkpoint?)");
  return it->second;
}

int64_t metadata_int(const io::Metadata& meta, const char* key, const std::string& who) {
  const std::string& v = metadata_value(meta, key, who);
  int64_t out = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || end != v.data() + v.size() || out < 0)
    throw InvalidArgument(who + "metadata '" + key + "' is '" + v + "', expected a non-negative integer");
  return out;
}

// The configuration stored in a checkpoint's metadata, validated.
TrainConfig stored_config(const io::Metadata& meta, const std::string& who) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(metadata_value(meta, "config", who));
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(who + "malformed config metadata: " + e.what());
  }
  TrainConfig c = config_from_json(j, who);
  try {
    c.validate();
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(who + e.what());
  }
  return c;
}

}  // namespace

void TrainConfig::validate() const {
  const attn::detail::Checker c{"nn::TrainConfig"};
  auto bounded = [&](const char* field, int64_t v, int64_t lo, int64_t hi, const char* why = "") {
    if (v < lo || v > hi)
      c.fail(std::string(field) + " is " + std::to_string(v) + ", expected " + std::to_string(lo) + " to " +
             std::to_string(hi) + why);
  };
  task.validate();
  bounded("length", task.length, 1, TrainLimits::max_length);
  bounded("layers", layers, 1, TrainLimits::max_layers, " (a model needs at least one attention layer)");
  bounded("dim", dim, 1, TrainLimits::max_dim);
  bounded("batch", batch, 1, TrainLimits::max_batch);
  bounded("steps", steps, 1, TrainLimits::max_steps);
  bounded("eval_examples", eval_examples, 1, TrainLimits::max_eval_examples);
  if (optimizer != "adamw" && optimizer != "sgd") c.fail("optimizer is '" + optimizer + "', expected adamw or sgd");
  if (!(lr > 0) || !std::isfinite(lr)) c.fail("lr must be finite and > 0");
  if (!(min_lr >= 0) || min_lr > lr) c.fail("min_lr must be in [0, lr]");
  if (warmup < 0) c.fail("warmup must be >= 0");
  if (!(dropout >= 0 && dropout < 1)) {
    std::ostringstream os;
    os << "dropout is " << dropout << ", expected 0 <= dropout < 1 (the attention dropout probability)";
    c.fail(os.str());
  }
  if (!(clip >= 0) || !std::isfinite(clip)) c.fail("clip must be finite and >= 0 (0 = off)");
  if (!(weight_decay >= 0) || !std::isfinite(weight_decay)) c.fail("weight_decay must be finite and >= 0");
  if (!(momentum >= 0 && momentum < 1)) c.fail("momentum must be in [0, 1)");
  if (stop_at < 0) c.fail("stop_at must be >= 0");
  if (eval_every < 0 || log_every < 0 || save_every < 0) c.fail("eval_every, log_every and save_every must be >= 0");
  if (curriculum < 0) c.fail("curriculum is " + std::to_string(curriculum) + ", expected 0 (off) or a starting length");
  if (!(curriculum_threshold > 0 && curriculum_threshold <= 1)) c.fail("curriculum_threshold must be in (0, 1]");
  model_config(*this).validate();
}

TrainConfig default_config(TaskKind kind) {
  TrainConfig c;
  c.task.kind = kind;
  if (kind == TaskKind::recall) {
    c.task.queries = 1;
    c.curriculum = 3;
    c.steps = 4000;
  }
  return c;
}

Curriculum::Curriculum(const TrainConfig& c)
    : task_(c.task),
      full_(c.task.length),
      length_(c.curriculum > 0 ? std::min(c.curriculum, c.task.length) : c.task.length),
      threshold_(c.curriculum_threshold) {}

bool Curriculum::record(double batch_token_accuracy) {
  if (done()) return false;
  running_ = 0.9 * running_ + 0.1 * batch_token_accuracy;
  if (running_ < threshold_) return false;
  ++length_;
  running_ = 0;
  return true;
}

TaskConfig Curriculum::task() const {
  TaskConfig t = task_;
  t.length = length_;
  if (t.queries > length_) t.queries = length_;
  return t;
}

void Curriculum::restore(int64_t length, double running) {
  if (length < 1 || length > full_)
    throw InvalidArgument("attn::nn::Curriculum::restore: length " + std::to_string(length) + " is outside 1.." +
                std::to_string(full_));
  length_ = length;
  running_ = running;
}

ModelConfig model_config(const TrainConfig& c) {
  const Task task(c.task);
  ModelConfig m;
  m.vocab = task.vocab_size();
  m.max_len = task.seq_len();
  m.dim = c.dim;
  m.heads = c.heads;
  m.layers = c.layers;
  m.positions = c.positions;
  m.causal = c.causal;
  m.window = c.window;
  m.chunk_size = c.chunk_size;
  m.sinks = c.sinks;
  m.dropout = c.dropout;
  m.precision = c.precision;
  if (c.scale_none) m.attn_scale = 1.0;
  return m;
}

template <class T>
EvalResult evaluate(Transformer<T>& model, const Task& task, int64_t examples, uint64_t seed) {
  Rng rng(derive_seed(seed, kEvalStream));
  EvalResult r;
  Accuracy total;
  double loss_sum = 0;
  Tensor<T> logits;
  for (int64_t done = 0; done < examples;) {
    const int64_t B = std::min<int64_t>(128, examples - done);
    const Batch b = task.sample(B, rng);
    model.forward(b.tokens.data(), b.B, b.N, logits);
    const auto ce = softmax_cross_entropy<T>(logits, b.targets.data(), nullptr);
    const Accuracy a = accuracy(logits, b.targets.data(), b.B, b.N);
    loss_sum += ce.loss * double(ce.count);
    total.tokens += a.tokens;
    total.tokens_right += a.tokens_right;
    total.seqs += a.seqs;
    total.seqs_right += a.seqs_right;
    done += B;
  }
  r.examples = examples;
  r.loss = loss_sum / double(std::max<int64_t>(1, total.tokens));
  r.token_acc = double(total.tokens_right) / double(std::max<int64_t>(1, total.tokens));
  r.seq_acc = double(total.seqs_right) / double(std::max<int64_t>(1, total.seqs));
  return r;
}

// Checkpoints are safetensors files written and read by attn::io: every
// parameter and optimizer state tensor under its name, stored as T (F32 for
// float); the format tag, step, optimizer step count and configuration go in
// the metadata. Loading accepts F32 and F64 files into either type.
template <class T>
void save_training_checkpoint(const std::string& path, Transformer<T>& model, Optimizer<T>* optimizer, int64_t step,
                              const TrainConfig& config, const Curriculum* curriculum) {
  std::map<std::string, io::Array<T>> tensors;
  auto store = [&](const std::string& name, const Tensor<T>& t) {
    io::Array<T>& a = tensors[name];
    a.shape = t.shape();
    a.data.assign(t.data(), t.data() + t.size());
    a.stored = std::is_same_v<T, float> ? io::DType::f32 : io::DType::f64;
  };
  for (const auto& p : model.parameters()) store(p.name, *p.value);
  io::Metadata meta;
  if (optimizer) {
    for (const auto& [name, t] : optimizer->state()) store(name, *t);
    meta["optimizer_steps"] = std::to_string(optimizer->steps_taken);
  }
  meta["format"] = kFormat;
  meta["step"] = std::to_string(step);
  meta["config"] = config_json(config).dump();
  if (curriculum) {
    meta["curriculum_length"] = std::to_string(curriculum->length());
    meta["curriculum_running"] = fmt_exact(curriculum->running_accuracy());
  }
  io::write_safetensors(path, tensors, meta);
}

template <class T>
int64_t load_training_checkpoint(const std::string& path, Transformer<T>& model, Optimizer<T>* optimizer,
                                 Curriculum* curriculum) {
  const std::string who = "attn::nn::load_training_checkpoint: '" + path + "': ";
  io::Metadata meta;
  const auto tensors = io::read_safetensors<T>(path, checkpoint_limits(), &meta);
  if (metadata_value(meta, "format", who) != kFormat)
    throw InvalidArgument(who + "format '" + meta.at("format") + "', expected " + kFormat);
  // Check every tensor and count first, so a mismatching file leaves the model untouched.
  std::vector<std::pair<const io::Array<T>*, Tensor<T>*>> copies;
  auto check = [&](const std::string& name, Tensor<T>& dst) {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw InvalidArgument(who + "no tensor '" + name + "' (was it written for a different model?)");
    if (it->second.shape != dst.shape())
      throw InvalidArgument(who + "tensor '" + name + "' has shape " + shape_str(it->second.shape) +
                  ", the model expects " + shape_str(dst.shape()));
    const auto& d = it->second.data;
    const auto bad = std::find_if(d.begin(), d.end(), [](T x) { return !std::isfinite(x); });
    if (bad != d.end())
      throw InvalidArgument(who + "tensor '" + name + "' holds " + non_finite_name(double(*bad)) + " at flat index " +
                  std::to_string(bad - d.begin()) + " (training never writes a non-finite value: the file is "
                  "corrupted)");
    copies.emplace_back(&it->second, &dst);
  };
  for (const auto& p : model.parameters()) check(p.name, *p.value);
  int64_t optimizer_steps = 0;
  if (optimizer) {
    for (const auto& [name, t] : optimizer->state()) check(name, *t);
    optimizer_steps = metadata_int(meta, "optimizer_steps", who);
  }
  // Every stored tensor must be one of the model's or the optimizer's, name
  // for name: without an optimizer to load, the state of the optimizer the
  // checkpoint names is passed over, and nothing else.
  std::set<std::string> known;
  const std::string stored_optimizer = optimizer ? "" : stored_config(meta, who).optimizer;
  for (const auto& p : model.parameters()) {
    known.insert(p.name);
    for (auto& n : optimizer_state_names(stored_optimizer, p.name)) known.insert(std::move(n));
  }
  if (optimizer)
    for (const auto& [name, t] : optimizer->state()) known.insert(name);
  for (const auto& [name, t] : tensors)
    if (!known.count(name))
      throw InvalidArgument(who + "holds a tensor '" + name + "' " + shape_str(t.shape) +
                            " that the model and its optimizer do not have (was it written for a different model?)");
  const int64_t step = metadata_int(meta, "step", who);
  const bool has_curriculum = curriculum && meta.count("curriculum_length");
  const int64_t curriculum_length = has_curriculum ? metadata_int(meta, "curriculum_length", who) : 0;
  double curriculum_running = 0;
  if (has_curriculum) {
    const std::string& v = metadata_value(meta, "curriculum_running", who);
    char* end = nullptr;
    curriculum_running = std::strtod(v.c_str(), &end);
    if (v.empty() || end != v.c_str() + v.size() || !(curriculum_running >= 0 && curriculum_running <= 1))
      throw InvalidArgument(who + "metadata 'curriculum_running' is '" + v + "', expected a number in [0, 1]");
  }
  if (has_curriculum) curriculum->restore(curriculum_length, curriculum_running);  // checks the length
  for (const auto& [src, dst] : copies) std::copy(src->data.begin(), src->data.end(), dst->data());
  if (optimizer) optimizer->steps_taken = optimizer_steps;
  return step;
}

TrainConfig checkpoint_config(const std::string& path) {
  const std::string who = "attn::nn::checkpoint_config: '" + path + "': ";
  io::Metadata meta;
  const auto tensors = io::read_safetensors<float>(path, checkpoint_limits(), &meta);
  const TrainConfig c = stored_config(meta, who);
  // The model this configuration builds must be the one whose tensors are stored.
  for (const auto& [name, shape] : parameter_shapes(model_config(c))) {
    auto it = tensors.find(name);
    if (it == tensors.end())
      throw InvalidArgument(who + "the config describes a model with a tensor '" + name + "' " + shape_str(shape) +
                  ", which the file does not hold: " + config_json(c).dump());
    if (it->second.shape != shape)
      throw InvalidArgument(who + "the config describes a model whose tensor '" + name + "' is " + shape_str(shape) +
                  ", the file holds " + shape_str(it->second.shape) + ": " + config_json(c).dump());
  }
  return c;
}

void write_curve_csv(const std::string& path, const std::vector<TrainRecord>& curve) {
  std::ostringstream os;
  os.precision(9);
  os << "step,lr,loss,token_acc,seq_acc,grad_norm,grad_norm_q,grad_norm_k,tokens_per_s,elapsed_s,eval_token_acc,"
        "eval_seq_acc,length\n";
  for (const auto& r : curve)
    os << r.step << ',' << r.lr << ',' << r.loss << ',' << r.token_acc << ',' << r.seq_acc << ',' << r.grad_norm << ','
       << r.grad_norm_q << ',' << r.grad_norm_k << ',' << r.tokens_per_s << ',' << r.elapsed_s << ','
       << r.eval_token_acc << ',' << r.eval_seq_acc << ',' << r.length << '\n';
  const std::string text = os.str();
  io::write_file_atomic(path, text.data(), text.size());
}

TrainResult train(const TrainConfig& cfg, const ProgressCallback& progress) {
  cfg.validate();
  {
    // Outputs are checked before training, not found unwritable at the end.
    io::detail::OutputTransaction outputs;
    if (!cfg.save_path.empty()) outputs.check(cfg.save_path, "save_path");
    if (!cfg.csv_path.empty()) outputs.check(cfg.csv_path, "csv_path");
  }
  const Task task(cfg.task);
  Transformer<float> model(model_config(cfg), derive_seed(cfg.seed, kModelStream));
  auto params = model.parameters();
  auto opt = make_optimizer(cfg, params);
  const LrSchedule sched{cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps};

  Curriculum curriculum(cfg);
  TrainResult res;
  int64_t start = 0;
  if (!cfg.resume_path.empty()) {
    const TrainConfig stored = checkpoint_config(cfg.resume_path);
    const ModelConfig a = model_config(stored), b = model_config(cfg);
    if (a.vocab != b.vocab || a.max_len != b.max_len || a.dim != b.dim || a.heads != b.heads || a.layers != b.layers ||
        a.positions != b.positions || a.causal != b.causal || a.attn_scale != b.attn_scale ||
        a.window.left != b.window.left || a.window.right != b.window.right || a.sinks != b.sinks ||
        stored.optimizer != cfg.optimizer)
      throw InvalidArgument("attn::nn::train: checkpoint '" + cfg.resume_path +
                  "' was written for a different model, task or optimizer: " + config_json(stored).dump());
    start = load_training_checkpoint(cfg.resume_path, model, opt.get(), &curriculum);
  }
  const int64_t stop = cfg.stop_at > 0 ? std::min(cfg.stop_at, cfg.steps) : cfg.steps;
  res.start_step = start;
  res.num_parameters = model.num_parameters();

  // A non-finite loss or gradient ends the run before the optimizer applies
  // it, so no checkpoint with NaN parameters is ever written.
  int64_t saved_step = -1;
  auto diverged = [&](const std::string& what, int64_t at) {
    std::string kept;
    if (saved_step >= 0) kept = "; the checkpoint of step " + std::to_string(saved_step) + " in '" + cfg.save_path + "' is kept";
    else if (!cfg.resume_path.empty()) kept = "; '" + cfg.resume_path + "' is unchanged";
    throw TrainingDiverged("attn::nn::train: training diverged at step " + std::to_string(at + 1) + ": " + what +
                           " (lower lr, or clip the gradient)" + kept);
  };
  const auto t0 = std::chrono::steady_clock::now();
  Tensor<float> logits, dlogits;
  bool evaluated_last = false;
  int64_t tokens_seen = 0;
  int64_t step = start;
  for (; step < stop; ++step) {
    Rng data(derive_seed(derive_seed(cfg.seed, kDataStream), uint64_t(step)));
    const int64_t length = curriculum.length();
    const Batch batch = curriculum.done() ? task.sample(cfg.batch, data) : Task(curriculum.task()).sample(cfg.batch, data);
    model.zero_grad();
    // Step k's dropout masks: a key of its own, from the run's seed.
    const DropoutKey dropout{derive_seed(derive_seed(cfg.seed, kDropoutStream), uint64_t(step)), 0};
    model.forward(batch.tokens.data(), batch.B, batch.N, logits, nullptr, dropout);
    const auto ce = softmax_cross_entropy<float>(logits, batch.targets.data(), &dlogits);
    if (!std::isfinite(ce.loss)) diverged("the loss is " + non_finite_name(ce.loss), step);
    const Accuracy acc = accuracy(logits, batch.targets.data(), batch.B, batch.N);
    if (step == start) {
      double sd = 0, top = 0;
      for (auto& blk : model.blocks()) {
        const auto st = blk.attn.score_stats();
        sd += st.score_std;
        top += st.mean_top_weight;
      }
      const double nl = double(std::max<size_t>(1, model.blocks().size()));
      res.init_score_std = sd / nl;
      res.init_top_weight = top / nl;
    }
    model.backward(dlogits);

    TrainRecord rec;
    rec.step = step;
    rec.loss = ce.loss;
    rec.token_acc = double(acc.tokens_right) / double(std::max<int64_t>(1, acc.tokens));
    rec.seq_acc = double(acc.seqs_right) / double(acc.seqs);
    rec.length = length;
    curriculum.record(rec.token_acc);
    qk_grad_norms(model, rec.grad_norm_q, rec.grad_norm_k);
    rec.grad_norm = clip_grad_norm(params, cfg.clip);
    if (!std::isfinite(rec.grad_norm)) diverged("the gradient norm is " + non_finite_name(rec.grad_norm), step);
    rec.lr = sched.at(step);
    opt->step(rec.lr);

    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rec.elapsed_s = elapsed;
    tokens_seen += batch.B * batch.N;
    rec.tokens_per_s = double(tokens_seen) / std::max(elapsed, 1e-9);
    const bool last = step + 1 == stop;
    evaluated_last = false;
    if ((cfg.eval_every > 0 && (step + 1) % cfg.eval_every == 0) || last) {
      const EvalResult ev = evaluate(model, task, cfg.eval_examples, cfg.seed);
      rec.eval_token_acc = ev.token_acc;
      rec.eval_seq_acc = ev.seq_acc;
      res.final_eval = ev;
      evaluated_last = true;
    }
    res.curve.push_back(rec);
    if (progress && ((cfg.log_every > 0 && (step + 1) % cfg.log_every == 0) || last || rec.eval_token_acc >= 0))
      progress(rec);
    if (!cfg.save_path.empty() && cfg.save_every > 0 && (step + 1) % cfg.save_every == 0) {
      save_training_checkpoint(cfg.save_path, model, opt.get(), step + 1, cfg, &curriculum);
      saved_step = step + 1;
    }
    if (cfg.target_accuracy > 0 && rec.eval_token_acc >= cfg.target_accuracy) {
      ++step;
      break;
    }
  }
  if (!evaluated_last) res.final_eval = evaluate(model, task, cfg.eval_examples, cfg.seed);
  res.steps_done = step - start;
  if (cfg.sinks)
    for (auto& blk : model.blocks()) {
      const Tensor<float>& s = blk.attn.layer.parameter("sinks");
      res.sinks.emplace_back(s.data(), s.data() + s.size());
    }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!cfg.save_path.empty()) save_training_checkpoint(cfg.save_path, model, opt.get(), step, cfg, &curriculum);
  if (!cfg.csv_path.empty()) write_curve_csv(cfg.csv_path, res.curve);
  return res;
}

template EvalResult evaluate<float>(Transformer<float>&, const Task&, int64_t, uint64_t);
template EvalResult evaluate<double>(Transformer<double>&, const Task&, int64_t, uint64_t);
template void save_training_checkpoint<float>(const std::string&, Transformer<float>&, Optimizer<float>*, int64_t,
                                              const TrainConfig&, const Curriculum*);
template void save_training_checkpoint<double>(const std::string&, Transformer<double>&, Optimizer<double>*, int64_t,
                                               const TrainConfig&, const Curriculum*);
template int64_t load_training_checkpoint<float>(const std::string&, Transformer<float>&, Optimizer<float>*,
                                                 Curriculum*);
template int64_t load_training_checkpoint<double>(const std::string&, Transformer<double>&, Optimizer<double>*,
                                                  Curriculum*);

}  // namespace attn::nn
