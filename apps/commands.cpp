// `attn sdpa`, `attn experiment`, `attn heatmap` and `attn bench` (`attn train` is in train.cpp).
#include "commands.hpp"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <sstream>
#include <filesystem>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "attn/detail/memory.hpp"
#include "common.hpp"
#include "dist.hpp"
#include "experiments.hpp"
#include "plot.hpp"
#include "train.hpp"

namespace attn::cli {
namespace {

struct SdpaOpts {
  std::string q, k, v, mask, out, weights, lse, backend = "auto", context_parallel;
  double scale = 0;
  bool causal = false;
  bool check_finite = false;  // refuse NaN/Inf in q, k, v (exit 1) instead of propagating it
  // The variants (docs/variants.md).
  std::vector<int64_t> window;             // left, right
  double softcap = 0;
  int64_t chunk_size = 0;                  // 0 = off
  bool alibi = false;                      // the ALiBi paper's slopes 2^(-8(h+1)/H)
  std::vector<double> alibi_slopes, sinks;  // H values (one value: every head)
  std::optional<int64_t> position_offset;
  int64_t offset_value = 0;  // what --position-offset parsed
  std::string compute;       // --compute: the products' arithmetic (empty: the inputs' default)
};

// A per-head list from the command line: H values, or one for every head.
template <class T>
std::vector<T> per_head(const std::vector<double>& v, int64_t H, const char* flag) {
  const std::vector<double> d = per_head_values(v, H, "attn sdpa", flag);
  return std::vector<T>(d.begin(), d.end());
}

// The variant options into opt, and the per-head values for H heads into
// slopes and sinks (which args then views).
template <class T>
void apply_variants(const SdpaOpts& o, int64_t H, SdpaOptions& opt, SdpaArgs<T>& args,
                    std::vector<compute_t<T>>& slopes, std::vector<compute_t<T>>& sinks) {
  using R = compute_t<T>;  // float32 slopes and sinks for half q, k, v
  if (!o.window.empty()) opt.window = {o.window[0], o.window[1]};
  opt.softcap = o.softcap;
  opt.chunk_size = o.chunk_size;
  opt.position_offset = o.position_offset;
  if (!o.compute.empty()) opt.compute_dtype = parse_dtype(o.compute);
  if (o.alibi) {
    for (double s : alibi_slopes(H)) slopes.push_back(R(s));
  } else if (!o.alibi_slopes.empty()) {
    slopes = per_head<R>(o.alibi_slopes, H, "--alibi-slopes");
  }
  if (!slopes.empty()) args.alibi_slopes = View1<const R>(slopes.data(), {H});
  if (!o.sinks.empty()) {
    sinks = per_head<R>(o.sinks, H, "--sinks");
    args.sinks = View1<const R>(sinks.data(), {H});
  }
}

// An empty input (some axis of length 0) is named as such.
void require_nonempty(const io::Array<double>& a, const std::string& flag, const std::string& path) {
  for (size_t i = 0; i < a.shape.size(); ++i)
    if (a.shape[i] == 0)
      throw InvalidArgument(fmt::format("attn sdpa: {} {} has shape {}: axis {} has length 0, every axis needs at least 1",
                              flag, path, shape_str(a.shape), i));
}

// The inputs as rank-4 (B, H, N, F) shapes; ranks 2 and 3 get leading 1s.
std::array<int64_t, 4> as4(const io::Array<double>& a, const std::string& flag, const std::string& path) {
  const size_t r = a.shape.size();
  if (r < 2 || r > 4)
    throw InvalidArgument(fmt::format("attn sdpa: {} {} has shape {}; expected (N, F), (H, N, F) or (B, H, N, F)", flag, path,
                            shape_str(a.shape)));
  require_nonempty(a, flag, path);
  std::array<int64_t, 4> s{1, 1, 1, 1};
  for (size_t i = 0; i < r; ++i) s[4 - r + i] = a.shape[i];
  return s;
}

template <class T>
std::vector<T> convert(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// Where the outputs of one `attn sdpa` run are written (Outputs::add).
struct SdpaPaths {
  std::string out, weights, lse;
};

// The bytes an output of `shape` needs, refused up front when more than the machine has.
template <class T>
size_t output_elements(std::initializer_list<int64_t> shape, const char* flag, const char* what) {
  const uint64_t bytes = attn::detail::checked_bytes(shape, sizeof(T));
  std::string dims;
  for (int64_t d : shape) dims += (dims.empty() ? "" : " x ") + std::to_string(d);
  attn::detail::check_fits_in_memory(bytes, fmt::format("{} ({}: {} {} values)", flag, what, dims,
                                                         std::is_same_v<T, float> ? "float32" : "float64"));
  return size_t(bytes / sizeof(T));
}

// T: the element type of q, k, v (float, double, or float16_t for float16
// files); the outputs, slopes and sinks are R = compute_t<T> (float32 for
// float16 inputs, see attn/sdpa.hpp).
template <class T, class R = compute_t<T>>
void run_sdpa_typed(const SdpaOpts& o, const SdpaPaths& paths, const io::Array<double>& qa,
                    const io::Array<double>& ka, const io::Array<double>& va, const io::Array<double>* ma) {
  const auto qs = as4(qa, "--q", o.q), ks = as4(ka, "--k", o.k), vs = as4(va, "--v", o.v);
  const std::vector<T> q = convert<T>(qa.data), k = convert<T>(ka.data), v = convert<T>(va.data);
  SdpaArgs<T> args;
  args.q = View4<const T>(q.data(), qs);
  args.k = View4<const T>(k.data(), ks);
  args.v = View4<const T>(v.data(), vs);
  std::unique_ptr<bool[]> mask;
  if (ma) {
    const size_t r = ma->shape.size();
    if (r < 2 || r > 4 || r > qa.shape.size())
      throw InvalidArgument(fmt::format("attn sdpa: --mask {} has shape {}; expected (L, S) or a shape broadcastable to "
                              "(B, H, L, S) with no more axes than --q",
                              o.mask, shape_str(ma->shape)));
    require_nonempty(*ma, "--mask", o.mask);
    std::array<int64_t, 4> ms{1, 1, 1, 1};
    for (size_t i = 0; i < r; ++i) ms[4 - r + i] = ma->shape[i];
    mask.reset(new bool[ma->data.size()]);
    for (size_t i = 0; i < ma->data.size(); ++i) {
      const double x = ma->data[i];
      if (x != 0 && x != 1)
        throw InvalidArgument(fmt::format("attn sdpa: --mask {} holds {} at flat index {}; a mask holds 1 or True (may "
                                "attend) and 0 or False (blocked)",
                                o.mask, x, i));
      mask[i] = x == 1;
    }
    args.mask = View4<const bool>(mask.get(), ms);
  }
  SdpaOptions opt;
  if (o.scale != 0) opt.scale = o.scale;
  opt.causal = o.causal;
  opt.check_finite = o.check_finite;
  opt.backend = parse_backend(o.backend);
  const int64_t B = qs[0], H = qs[1], L = qs[2], S = ks[2], Ev = vs[3];
  std::vector<R> slopes, sinks;
  apply_variants(o, H, opt, args, slopes, sinks);
  Backend used;
  std::vector<R> out, w, lse;
  View4<R> wv;
  View3<R> lv;
  try {
    // Validates the inputs before any output is allocated.
    used = resolve_backend(args, opt);
    out.resize(output_elements<R>({B, H, L, Ev}, "--out", "B x H x L x Ev"));
    if (!o.weights.empty()) {
      w.resize(output_elements<R>({B, H, L, S}, "--weights", "B x H x L x S"));
      wv = View4<R>::bhnd(w.data(), B, H, L, S);
    }
    if (!o.lse.empty()) {
      lse.resize(output_elements<R>({B, H, L}, "--lse", "B x H x L"));
      lv = View3<R>(lse.data(), {B, H, L});
    }
    scaled_dot_product_attention<T>(args, {View4<R>::bhnd(out.data(), B, H, L, Ev), wv, lv}, opt);
  } catch (const InvalidArgument& e) {
    // The library names arguments q, k, v, mask; say which files those are.
    throw InvalidArgument(fmt::format("attn sdpa: {} (q = {}, k = {}, v = {}{})", e.what(), o.q, o.k, o.v,
                            o.mask.empty() ? "" : ", mask = " + o.mask));
  }
  // Outputs keep the rank of the query file.
  const size_t r = qa.shape.size();
  auto tail = [&](std::vector<int64_t> full) { return std::vector<int64_t>(full.end() - long(r), full.end()); };
  io::write_npy(paths.out, tail({B, H, L, Ev}), out.data());
  if (!o.weights.empty()) io::write_npy(paths.weights, tail({B, H, L, S}), w.data());
  if (!o.lse.empty()) {
    const std::vector<int64_t> full = {B, H, L};
    io::write_npy(paths.lse, std::vector<int64_t>(full.end() - long(r - 1), full.end()), lse.data());
  }
  fmt::print(stderr, "attn sdpa: {} -> {} ({}, backend {}{})\n", shape_str(qa.shape), o.out,
             is_half_v<T> ? "float16 in, float32 out" : io::dtype_name(std::is_same_v<T, float> ? io::DType::f32 : io::DType::f64),
             backend_name(used), opt.compute_dtype == Dtype::bfloat16 ? ", bfloat16 products" : "");
}

void run_sdpa(const SdpaOpts& o) {
  if (!o.context_parallel.empty())
    return run_sdpa_context_parallel({o.q, o.k, o.v, o.out, o.lse, o.context_parallel, o.backend, o.scale, o.causal,
                                      !o.mask.empty(), !o.weights.empty(),
                                      [&o](int64_t H, SdpaOptions& opt, SdpaArgs<float>& args, std::vector<float>& slopes,
                                           std::vector<float>& sinks) { apply_variants(o, H, opt, args, slopes, sinks); }});
  // Every output path is checked before anything is read or computed.
  Outputs outputs;
  const SdpaPaths paths{outputs.add("--out", o.out), outputs.add("--weights", o.weights), outputs.add("--lse", o.lse)};
  const auto qa = io::read_npy<double>(o.q), ka = io::read_npy<double>(o.k), va = io::read_npy<double>(o.v);
  require_float(qa, "attn sdpa: --q", o.q);
  require_float(ka, "attn sdpa: --k", o.k);
  require_float(va, "attn sdpa: --v", o.v);
  std::unique_ptr<io::Array<double>> ma;
  if (!o.mask.empty()) ma = std::make_unique<io::Array<double>>(io::read_npy<double>(o.mask));
  if (qa.shape.size() != ka.shape.size() || qa.shape.size() != va.shape.size())
    throw InvalidArgument(fmt::format("attn sdpa: --q {} {}, --k {} {} and --v {} {} must have the same number of axes", o.q,
                            shape_str(qa.shape), o.k, shape_str(ka.shape), o.v,
                            shape_str(va.shape)));
  const size_t r = qa.shape.size();
  if (r >= 1 && r <= 4) {
    if (qa.shape[r - 1] != ka.shape[r - 1])
      throw InvalidArgument(fmt::format("attn sdpa: --k {} has shape {} but --q {} has shape {}: queries and keys need the "
                              "same feature size E (last axis)",
                              o.k, shape_str(ka.shape), o.q, shape_str(qa.shape)));
    if (r >= 2 && ka.shape[r - 2] != va.shape[r - 2])
      throw InvalidArgument(fmt::format("attn sdpa: --v {} has shape {} but --k {} has shape {}: keys and values need the "
                              "same length S (second-to-last axis)",
                              o.v, shape_str(va.shape), o.k, shape_str(ka.shape)));
  }
  const auto all = [&](io::DType t) { return qa.stored == t && ka.stored == t && va.stored == t; };
  if (all(io::DType::f16)) run_sdpa_typed<float16_t>(o, paths, qa, ka, va, ma.get());  // float32 outputs
  else if (all(io::DType::f32)) run_sdpa_typed<float>(o, paths, qa, ka, va, ma.get());
  else run_sdpa_typed<double>(o, paths, qa, ka, va, ma.get());
  outputs.commit();
}

struct ExperimentOpts {
  std::string name, plot;
  bool json = false;
  uint64_t seed = 0;
};

struct HeatmapOpts {
  std::string weights, labels, out, title;
  std::optional<int64_t> batch;  // (B, H, L, S) weights only; default 0
};

void run_heatmap(const HeatmapOpts& o) {
  Outputs outputs;
  const std::string png = outputs.add("--out", o.out);
  const auto a = io::read_npy<double>(o.weights);
  const auto& s = a.shape;
  int64_t H = 1, L = 0, S = 0, offset = 0;
  if (o.batch && s.size() != 4)
    throw InvalidArgument(fmt::format("attn heatmap: --batch picks a batch entry of (B, H, L, S) weights; --weights {} "
                                      "has shape {}, which has none", o.weights, shape_str(s)));
  if (s.size() == 2) L = s[0], S = s[1];
  else if (s.size() == 3) H = s[0], L = s[1], S = s[2];
  else if (s.size() == 4) {
    const int64_t b = o.batch.value_or(0);
    if (b < 0 || b >= s[0])
      throw InvalidArgument(fmt::format("attn heatmap: --batch {} is outside the {} batch entries of {}", b, s[0], o.weights));
    H = s[1], L = s[2], S = s[3];
    offset = b * H * L * S;
  } else {
    throw InvalidArgument(fmt::format("attn heatmap: --weights {} has shape {}; expected (L, S), (H, L, S) or (B, H, L, S)",
                            o.weights, shape_str(s)));
  }
  if (H < 1 || L < 1 || S < 1) throw InvalidArgument("attn heatmap: --weights " + o.weights + " is empty");
  if (H > 64 || L > 512 || S > 512)
    throw InvalidArgument(fmt::format("attn heatmap: {} heads of {} x {} is too large to draw (at most 64 heads of 512 x 512)",
                            H, L, S));
  std::vector<std::string> words;
  {
    std::istringstream is(o.labels);
    for (std::string w; is >> w;) words.push_back(w);
  }
  std::vector<std::string> rows, cols;
  if (!words.empty()) {
    if (int64_t(words.size()) == S + L && L != S) {
      rows.assign(words.begin(), words.begin() + L);
      cols.assign(words.begin() + L, words.end());
    } else if (int64_t(words.size()) == S && (L == S || L == 1)) {
      cols = words;
      rows = L == S ? words : std::vector<std::string>{};
    } else {
      throw InvalidArgument(fmt::format("attn heatmap: --labels has {} words; the weights are {} x {}, so give {} words (or "
                              "{} query words then {} key words)",
                              words.size(), L, S, S, L, S));
    }
  }
  std::vector<double> w(a.data.begin() + offset, a.data.begin() + offset + H * L * S);
  const std::string title = o.title.empty() ? "attention weights from " + std::filesystem::path(o.weights).filename().string() : o.title;
  draw_heatmap(w, H, L, S, rows, cols, title, png);
  outputs.commit();
  fmt::print(stderr, "attn heatmap: wrote {} ({} head(s) of {} x {})\n", o.out, H, L, S);
}

}  // namespace

void add_sdpa(CLI::App& app) {
  auto o = std::make_shared<SdpaOpts>();
  auto* c = app.add_subcommand("sdpa", "Scaled dot-product attention on .npy files: Y = softmax(Q K^T * scale) V");
  c->add_option("--q", o->q, "queries (L, E), (H, L, E) or (B, H, L, E), float32/float64 .npy")->required();
  c->add_option("--k", o->k, "keys (S, E) with the same leading axes (Hkv may divide H)")->required();
  c->add_option("--v", o->v, "values (S, Ev) with the same leading axes")->required();
  c->add_option("--mask", o->mask,
                 ".npy of bool (np.save of a NumPy bool array) or 0/1 numbers: True/1 = the query may attend to the "
                 "key, False/0 = blocked (PyTorch's polarity); (L, S) or broadcastable to (B, H, L, S)");
  c->add_flag("--causal", o->causal, "query i sees keys j <= i");
  c->add_flag("--check-finite", o->check_finite,
              "refuse NaN or Inf in q, k, v (exit 1, naming the file's argument) instead of letting it reach "
              "the outputs it touches");
  c->add_option("--window", o->window, "sliding window LEFT,RIGHT: keys p-LEFT..p+RIGHT, -1 = unbounded")
      ->delimiter(',')->expected(2)->check(integer_value());
  c->add_option("--softcap", o->softcap, "soft-cap the scores: c*tanh(s/c) (0 = off; else 2^-64 to 2^64)")
      ->check(non_negative_number());
  c->add_option("--chunk-size", o->chunk_size, "chunked attention: a query sees only keys of its own chunk of N positions (0 = off)")
      ->check(integer_value(0));
  auto* alibi = c->add_flag("--alibi", o->alibi, "ALiBi with the paper's slopes (2^(-8(h+1)/H) for H a power of two)");
  add_number_list(c, "--alibi-slopes", o->alibi_slopes, "ALiBi with these slopes (H values, or one for all)")
      ->excludes(alibi);
  add_number_list(c, "--sinks", o->sinks, "attention sinks: one logit per head (H values, or one for all)");
  auto* offset = c->add_option("--position-offset", o->offset_value,
                               "query row i sits at key position i + N (replaces the causal alignment)");
  c->add_option("--scale", o->scale, "score scale (default 1/sqrt(E); 2^-64 to 2^64)")->check(positive_number());
  c->add_option("--backend", o->backend, "auto | reference | fused")->capture_default_str();
  c->add_option("--compute", o->compute,
                "the products' arithmetic: float32 (exact, the default) or bfloat16 (q, k, v and the "
                "probabilities rounded to bfloat16, float32 sums; faster on CPUs with bfloat16 dot products)")
      ->check(CLI::IsMember({"float32", "bfloat16", "f32", "bf16"}));
  c->add_option("--out", o->out, "output Y (.npy), same leading axes as Q, last axis Ev")->required();
  c->add_option("--weights", o->weights, "also write the attention weights A (.npy), (.., L, S)");
  c->add_option("--lse", o->lse, "also write each row's log-sum-exp (.npy), (.., L)");
  c->add_option("--context-parallel", o->context_parallel,
                "ring | ulysses: split the sequence over the processes of `mpirun -np P attn sdpa ...` "
                "(float32; docs/distributed.md)")
      ->check(CLI::IsMember({"ring", "ulysses"}));
  c->footer(std::string("Computation is float32 when every input is float32, else float64; outputs use that type.\n") +
            kExitCodesHelp);
  c->callback([o, offset] {
    if (offset->count() > 0) o->position_offset = o->offset_value;
    run_sdpa(*o);
  });
}

void add_experiment(CLI::App& app) {
  auto o = std::make_shared<ExperimentOpts>();
  auto* c = app.add_subcommand("experiment", "Measure five claims about attention and print a table");
  c->add_option("name", o->name, "variance | saturation | jacobian | equivariance | lookup")
      ->required()
      ->check(CLI::IsMember(experiment_names()));
  c->add_flag("--json", o->json, "print the figures as JSON instead of a table");
  c->add_option("--plot", o->plot, "also draw a chart as PNG (variance, saturation, lookup)");
  c->add_option("--seed", o->seed, "random seed")->capture_default_str();
  c->footer(kExitCodesHelp);
  c->callback([o] {
    if (!o->plot.empty() && !experiment_has_plot(o->name))
      throw UsageError("attn experiment: '" + o->name + "' has no plot (plots: variance, saturation, lookup)");
    Outputs outputs;
    const std::string png = outputs.add("--plot", o->plot);
    const auto r = run_experiment(o->name, o->seed);
    if (o->json) fmt::print("{}\n", r.dump(2));
    else print_experiment(r);
    if (!png.empty()) {
      plot_experiment(r, png);
      outputs.commit();
      fmt::print(stderr, "attn experiment: wrote {}\n", o->plot);
    }
  });
}

void add_heatmap(CLI::App& app) {
  auto o = std::make_shared<HeatmapOpts>();
  auto k = std::make_shared<CheckpointHeatmapOpts>();
  auto* c = app.add_subcommand("heatmap",
                               "Draw attention weights as a PNG heatmap (one panel per head): from a .npy of weights, "
                               "or a trained checkpoint run on one example");
  auto* w = c->add_option("--weights", o->weights, "weights .npy: (L, S), (H, L, S) or (B, H, L, S)");
  auto* ck = c->add_option("--checkpoint", k->checkpoint,
                           "a checkpoint of `attn train` (.safetensors): draw every head of every layer on one example");
  w->excludes(ck);
  // Options of one source are refused with the other (a usage error), not silently ignored.
  c->add_option("--labels", o->labels, "--weights: space-separated tokens: S words (rows too when L = S), or L + S words")
      ->excludes(ck);
  c->add_option("--batch", o->batch, "--weights: which batch entry of a (B, H, L, S) file (default 0)")
      ->excludes(ck);
  c->add_option("--task", k->task, "--checkpoint: copy | reverse | sort | recall (default: the checkpoint's task)")
      ->check(CLI::IsMember({"copy", "reverse", "sort", "recall"}))
      ->excludes(w);
  c->add_option("--example", k->example, "--checkpoint: which example of the seeded stream")
      ->capture_default_str()
      ->excludes(w);
  c->add_option("--seed", k->seed, "--checkpoint: seed of the example stream")->capture_default_str()->excludes(w);
  c->add_option("--title", o->title, "title above the panels");
  c->add_option("--out", o->out, "output .png")->required();
  c->footer(kExitCodesHelp);
  c->callback([o, k] {
    if (!k->checkpoint.empty()) {
      k->out = o->out;
      k->title = o->title;
      run_checkpoint_heatmap(*k);
    } else if (!o->weights.empty()) {
      run_heatmap(*o);
    } else {
      throw UsageError("attn heatmap: give --weights A.npy or --checkpoint ckpt.safetensors");
    }
  });
}

void add_bench(CLI::App& app) {
  auto* c = app.add_subcommand("bench", "Run the benchmark binary attn-bench, passing every argument (--help too) to it");
  c->allow_extras();
  c->prefix_command();
  c->set_help_flag();  // `attn bench --help` shows attn-bench's own help
  c->footer(kExitCodesHelp);
  c->callback([c] {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    std::vector<fs::path> candidates;
    if (!ec) {
      candidates.push_back(self.parent_path() / "attn-bench");
      candidates.push_back(self.parent_path().parent_path() / "bench" / "attn-bench");
    }
    for (const auto& p : candidates) {
      if (::access(p.c_str(), X_OK) != 0) continue;
      std::vector<std::string> args = {p.string()};
      for (const auto& a : c->remaining()) args.push_back(a);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      std::fflush(stdout);
      ::execv(p.c_str(), argv.data());
      throw InvalidArgument(fmt::format("attn bench: cannot run {}: {}", p.string(), std::strerror(errno)));
    }
    std::string looked;
    for (const auto& p : candidates) looked += "\n  " + p.string();
    throw Unavailable("attn bench: the benchmark binary attn-bench is not built in this tree (looked for:" + looked +
                        "). Build it with `cmake --build build --target attn-bench` once bench/ exists.");
  });
}

}  // namespace attn::cli
