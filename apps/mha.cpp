// `attn mha`: multi-head self-attention with parameters stored under
// PyTorch's nn.MultiheadAttention state_dict names, so a PyTorch layer saved
// with safetensors runs unchanged.
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>

#include "attn/detail/memory.hpp"
#include "commands.hpp"
#include "common.hpp"

namespace attn::cli {
namespace {

struct MhaCliOpts {
  std::string weights, x, out, weights_out;
  int64_t heads = 1;
  bool causal = false;
};

struct MhaPaths {
  std::string out, weights_out;  // where to write them (Outputs::add)
};

template <class T>
void run_mha_typed(const MhaCliOpts& o, const MhaPaths& paths, const io::Array<double>& xa,
                   const std::map<std::string, io::Array<double>>& sd) {
  const bool batched = xa.shape.size() == 3;
  const int64_t B = batched ? xa.shape[0] : 1, N = xa.shape[xa.shape.size() - 2], D = xa.shape.back();
  const bool bias = sd.count("in_proj_bias") > 0;
  MultiheadConfig cfg;
  cfg.embed_dim = D;
  cfg.num_heads = o.heads;
  cfg.bias = bias;
  MultiheadAttention<T> layer(cfg);
  for (const auto& [name, a] : sd) {
    const std::vector<T> v(a.data.begin(), a.data.end());
    const Tensor<T>& want = layer.parameter(name);
    if (std::vector<int64_t>(a.shape) != want.shape())
      throw Error(fmt::format("attn mha: tensor '{}' in {} has shape {}, expected {} for embed_dim {} (from --x {})",
                              name, o.weights, io::shape_string(a.shape), io::shape_string(want.shape()), D, o.x));
    if (a.shape.size() == 2) layer.load_parameter(name, View2<const T>(v.data(), {a.shape[0], a.shape[1]}));
    else layer.load_parameter(name, View1<const T>(v.data(), {a.shape[0]}));
  }
  const std::vector<T> x(xa.data.begin(), xa.data.end());
  std::vector<T> y(x.size()), w;
  View4<T> wv;
  if (!o.weights_out.empty()) {
    const uint64_t bytes = attn::detail::checked_bytes({B, o.heads, N, N}, sizeof(T));
    attn::detail::check_fits_in_memory(bytes, fmt::format("attn mha: --weights-out ({} x {} x {} x {} weights)", B,
                                                           o.heads, N, N));
    w.resize(size_t(bytes / sizeof(T)));
    wv = View4<T>::bhnd(w.data(), B, o.heads, N, N);
  }
  MhaOptions opt;
  opt.sdpa.causal = o.causal;
  MhaArgs<T> args;
  args.query = View3<const T>(x.data(), {B, N, D});
  layer.forward(args, {View3<T>(y.data(), {B, N, D}), wv, {}}, opt);
  io::write_npy(paths.out, xa.shape, y.data());
  if (!o.weights_out.empty()) {
    std::vector<int64_t> ws = {o.heads, N, N};
    if (batched) ws.insert(ws.begin(), B);
    io::write_npy(paths.weights_out, ws, w.data());
  }
  fmt::print(stderr, "attn mha: {} tokens x {} features, {} head(s) -> {}\n", N, D, o.heads, o.out);
}

void run_mha(const MhaCliOpts& o) {
  Outputs outputs;  // checked before anything is read, renamed into place together
  const MhaPaths paths{outputs.add("--out", o.out), outputs.add("--weights-out", o.weights_out)};
  const auto xa = io::read_npy<double>(o.x);
  require_float(xa, "attn mha: --x", o.x);
  const auto sd = io::read_safetensors<double>(o.weights);
  if (xa.shape.size() != 2 && xa.shape.size() != 3)
    throw Error(fmt::format("attn mha: --x {} has shape {}; expected (N, D) or (B, N, D)", o.x, io::shape_string(xa.shape)));
  const int64_t D = xa.shape.back();
  if (D < 1 || xa.shape[xa.shape.size() - 2] < 1) throw Error("attn mha: --x " + o.x + " is empty");
  if (o.heads < 1 || D % o.heads != 0)
    throw Error(fmt::format("attn mha: --heads {} must be >= 1 and divide the model width D = {} (last axis of {})",
                            o.heads, D, o.x));
  const std::set<std::string> allowed = {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"};
  for (const auto& [name, a] : sd)
    if (!allowed.count(name))
      throw Error(fmt::format("attn mha: {} holds tensor '{}'; expected only in_proj_weight, in_proj_bias, "
                              "out_proj.weight, out_proj.bias (nn.MultiheadAttention's state_dict with packed "
                              "projections)",
                              o.weights, name));
  for (const char* need : {"in_proj_weight", "out_proj.weight"})
    if (!sd.count(need)) throw Error(fmt::format("attn mha: {} lacks tensor '{}'", o.weights, need));
  if (sd.count("in_proj_bias") != sd.count("out_proj.bias"))
    throw Error(fmt::format("attn mha: {} has only one of in_proj_bias and out_proj.bias; give both or neither",
                            o.weights));
  bool f32 = xa.stored == io::DType::f32;
  for (const auto& [name, a] : sd) f32 = f32 && a.stored == io::DType::f32;
  if (f32) run_mha_typed<float>(o, paths, xa, sd);
  else run_mha_typed<double>(o, paths, xa, sd);
  outputs.commit();
}

}  // namespace

void add_mha(CLI::App& app) {
  auto o = std::make_shared<MhaCliOpts>();
  auto* c = app.add_subcommand("mha", "Multi-head self-attention with weights from a PyTorch state_dict (.safetensors)");
  c->add_option("--weights", o->weights,
                ".safetensors with in_proj_weight [3D, D], out_proj.weight [D, D] and optionally in_proj_bias [3D], "
                "out_proj.bias [D]")
      ->required();
  c->add_option("--x", o->x, "tokens .npy, (N, D) or (B, N, D)")->required();
  c->add_option("--heads", o->heads, "number of heads H (must divide D)")->capture_default_str();
  c->add_flag("--causal", o->causal, "token i attends only to tokens j <= i");
  c->add_option("--out", o->out, "output .npy, the shape of X")->required();
  c->add_option("--weights-out", o->weights_out, "also write per-head attention weights (.npy), ([B,] H, N, N)");
  c->footer(std::string("Computation is float32 when every input is float32, else float64.\n") + kExitCodesHelp);
  c->callback([o] { run_mha(*o); });
}

}  // namespace attn::cli
