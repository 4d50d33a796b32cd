// attn._attn — the nanobind extension behind the Python package.
//
// This layer is deliberately thin: it turns already-shaped, rank-4 (or
// rank-3) NumPy arrays into attn::View's — pointer, shape and element strides,
// never a copy — calls the library with the GIL released, and lets
// the library's errors surface with its own message: attn::InvalidArgument as
// ValueError, attn::FileError as OSError (FileNotFoundError and the other
// errno subclasses where the errno says so). Each operation is one function,
// overloaded for float32 and float64 arrays, with keyword arguments. The
// PyTorch argument conventions (leading batch dimensions, mask polarity,
// enable_gqa, dtype checks) live in the Python package (python/attn/), which
// also allocates every output array.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "views.hpp"

namespace nb = nanobind;

// The half storage types as ndarray dtypes: float16 is NumPy's float16;
// bfloat16, which NumPy lacks, travels as its uint16 bit patterns (the Python
// layer views torch.bfloat16 and ml_dtypes.bfloat16 arrays that way and
// calls the *_bf16 functions, so no uint16 array is taken for bfloat16 by
// accident).
namespace nanobind::detail {
template <>
struct dtype_traits<attn::float16_t> {
  static constexpr dlpack::dtype value{uint8_t(dlpack::dtype_code::Float), 16, 1};
  static constexpr auto name = const_name("float16");
};
template <>
struct dtype_traits<attn::bfloat16_t> {
  static constexpr dlpack::dtype value{uint8_t(dlpack::dtype_code::UInt), 16, 1};
  static constexpr auto name = const_name("uint16 (bfloat16 bits)");
};
}  // namespace nanobind::detail

namespace {

using attn_python::Arr;
using attn_python::view_of;

// The variant options (docs/variants.md) as one bundle: window (left,
// right; -1 unbounded), softcap (0 = off), position_offset and chunk_size
// (0 = off).
struct Variants {
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  std::optional<int64_t> position_offset;
  int64_t chunk_size = 0;
};

attn::SdpaOptions sdpa_options(std::optional<double> scale, bool causal, const std::string& backend,
                               int num_threads, const Variants& var = {}, bool check_finite = false) {
  attn::SdpaOptions opt;
  opt.check_finite = check_finite;
  opt.scale = scale;
  opt.causal = causal;
  opt.backend = attn::parse_backend(backend);
  opt.num_threads = num_threads;
  opt.window = {var.window_left, var.window_right};
  opt.softcap = var.softcap;
  opt.position_offset = var.position_offset;
  opt.chunk_size = var.chunk_size;
  return opt;
}

template <class T>
using Opt = std::optional<T>;

// Attention dropout (SdpaOptions::dropout_p, dropout_seed, dropout_offset).
attn::SdpaOptions with_dropout(attn::SdpaOptions opt, double p, uint64_t seed, uint64_t offset) {
  opt.dropout_p = p, opt.dropout_seed = seed, opt.dropout_offset = offset;
  return opt;
}

// compute_dtype (SdpaOptions::compute_dtype): None = the inputs' default;
// the library checks the value.
attn::SdpaOptions with_compute(attn::SdpaOptions opt, const std::optional<std::string>& compute_dtype) {
  if (compute_dtype) opt.compute_dtype = attn::parse_dtype(*compute_dtype);
  return opt;
}

Variants variants(int64_t window_left, int64_t window_right, double softcap, int64_t chunk_size,
                  Opt<int64_t> position_offset) {
  return Variants{window_left, window_right, softcap, position_offset, chunk_size};
}

// The fields the dense and the packed call share: q, k, v and the per-head arrays.
// With half q, k, v (T) the per-head arrays are float32 (C = compute_t<T>).
template <class T, int R, class A, class C = attn::compute_t<T>>
void fill_common(A& a, const Arr<const T, R>& q, const Arr<const T, R>& k, const Arr<const T, R>& v,
                 const Opt<Arr<const C, 1>>& alibi_slopes, const Opt<Arr<const C, 1>>& sinks) {
  a.q = view_of<const T, R>(q, "q");
  a.k = view_of<const T, R>(k, "k");
  a.v = view_of<const T, R>(v, "v");
  a.alibi_slopes = view_of<const C, 1>(alibi_slopes, "alibi_slopes");
  a.sinks = view_of<const C, 1>(sinks, "sinks");
}

template <class T, class C = attn::compute_t<T>>
attn::SdpaArgs<T> sdpa_args(const Arr<const T, 4>& q, const Arr<const T, 4>& k, const Arr<const T, 4>& v,
                            const Opt<Arr<const bool, 4>>& mask, const Opt<Arr<const C, 4>>& bias,
                            const Opt<Arr<const C, 1>>& alibi_slopes = {}, const Opt<Arr<const C, 1>>& sinks = {}) {
  attn::SdpaArgs<T> a;
  fill_common<T, 4>(a, q, k, v, alibi_slopes, sinks);
  a.mask = view_of<const bool, 4>(mask, "mask");
  a.bias = view_of<const C, 4>(bias, "bias");
  return a;
}

template <class T>
attn::VarlenArgs<T> varlen_args(const Arr<const T, 3>& q, const Arr<const T, 3>& k, const Arr<const T, 3>& v,
                                const Arr<const int64_t, 1>& cu_q, const Arr<const int64_t, 1>& cu_k,
                                int64_t max_q, int64_t max_k, const Opt<Arr<const T, 1>>& alibi_slopes,
                                const Opt<Arr<const T, 1>>& sinks) {
  attn::VarlenArgs<T> a;
  fill_common<T, 3>(a, q, k, v, alibi_slopes, sinks);
  a.cu_seqlens_q = view_of<const int64_t, 1>(cu_q, "cu_seqlens_q");
  a.cu_seqlens_k = view_of<const int64_t, 1>(cu_k, "cu_seqlens_k");
  a.max_seqlen_q = max_q;
  a.max_seqlen_k = max_k;
  return a;
}

// One definition per operation; bind_sdpa<T> adds the overload of one input
// dtype under the given names (nanobind picks the one whose arrays match,
// never converting: noconvert): float32 and float64, and float16 and
// bfloat16 (under names ending in "_bf16") whose outputs are float32 (R =
// compute_t<T>, as are bias, alibi_slopes, sinks, dout and the saved state).
template <class T, class R = attn::compute_t<T>>
void bind_sdpa(nb::module_& m) {
  constexpr bool bf16 = std::is_same_v<T, attn::bfloat16_t>;
  using namespace nb::literals;
  m.def(
      bf16 ? "sdpa_forward_bf16" : "sdpa_forward",
      [](const Arr<const T, 4>& q, const Arr<const T, 4>& k, const Arr<const T, 4>& v, const Arr<R, 4>& out,
         const Opt<Arr<const bool, 4>>& mask, const Opt<Arr<const R, 4>>& bias, const Opt<Arr<R, 4>>& weights,
         const Opt<Arr<R, 3>>& lse, std::optional<double> scale, bool causal, const std::string& backend,
         int num_threads, const Opt<Arr<const R, 1>>& alibi_slopes, const Opt<Arr<const R, 1>>& sinks,
         int64_t window_left, int64_t window_right, double softcap, int64_t chunk_size, Opt<int64_t> position_offset, double dropout_p, uint64_t dropout_seed, uint64_t dropout_offset,
         bool check_finite, const std::optional<std::string>& compute_dtype) {
        const attn::SdpaArgs<T> args = sdpa_args<T>(q, k, v, mask, bias, alibi_slopes, sinks);
        const attn::SdpaOptions opt = with_compute(with_dropout(
            sdpa_options(scale, causal, backend, num_threads,
                         variants(window_left, window_right, softcap, chunk_size, position_offset), check_finite), dropout_p, dropout_seed, dropout_offset), compute_dtype);
        const attn::View4<R> o = view_of<R, 4>(out, "out");
        const attn::View4<R> w = view_of<R, 4>(weights, "weights");
        const attn::View3<R> l = view_of<R, 3>(lse, "lse");
        nb::gil_scoped_release release;
        attn::scaled_dot_product_attention<T>(args, {o, w, l}, opt);
      },
      "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "out"_a.noconvert(), nb::kw_only(),
      "mask"_a.noconvert().none() = nb::none(), "bias"_a.noconvert().none() = nb::none(),
      "weights"_a.noconvert().none() = nb::none(), "lse"_a.noconvert().none() = nb::none(),
      "scale"_a.none() = nb::none(), "causal"_a = false, "backend"_a = "auto", "num_threads"_a = 0,
      "alibi_slopes"_a.noconvert().none() = nb::none(), "sinks"_a.noconvert().none() = nb::none(),
      "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0, "chunk_size"_a = 0, "position_offset"_a.none() = nb::none(), "dropout_p"_a = 0.0, "dropout_seed"_a = 0,
      "dropout_offset"_a = 0,
      "check_finite"_a = false, "compute_dtype"_a.none() = nb::none(),
      "Scaled dot-product attention on rank-4 (B, H, N, d) arrays of one dtype (float32 or float64; or\n"
      "float16/bfloat16 q, k, v with everything else float32): "
      "writes out (B, H, L, Ev), and weights (B, H, L, S) and lse (B, H, L) when given. mask: bool,\n"
      "True = may attend; bias: added to the scores; both broadcastable to (B, H, L, S). Variants:\n"
      "alibi_slopes, sinks (H), window_left/right (-1 unbounded), softcap (0 off), position_offset.\n"
      "compute_dtype: 'float32' (exact) or 'bfloat16' (bfloat16 products); None: bfloat16 for bfloat16\n"
      "q, k, v, else float32.");
  m.def(
      bf16 ? "sdpa_backward_bf16" : "sdpa_backward",
      [](const Arr<const T, 4>& q, const Arr<const T, 4>& k, const Arr<const T, 4>& v,
         const Arr<const R, 4>& dout, const Arr<R, 4>& dq, const Arr<R, 4>& dk, const Arr<R, 4>& dv,
         const Opt<Arr<const bool, 4>>& mask, const Opt<Arr<const R, 4>>& bias, const Opt<Arr<R, 4>>& dbias,
         const Opt<Arr<const R, 4>>& out, const Opt<Arr<const R, 3>>& lse, std::optional<double> scale,
         bool causal, const std::string& backend, int num_threads, const Opt<Arr<const R, 1>>& alibi_slopes,
         const Opt<Arr<const R, 1>>& sinks, const Opt<Arr<R, 1>>& dsinks, int64_t window_left,
         int64_t window_right, double softcap, int64_t chunk_size, Opt<int64_t> position_offset, double dropout_p, uint64_t dropout_seed, uint64_t dropout_offset, bool check_finite,
         const std::optional<std::string>& compute_dtype) {
        const attn::SdpaArgs<T> args = sdpa_args<T>(q, k, v, mask, bias, alibi_slopes, sinks);
        const attn::SdpaOptions opt = with_compute(with_dropout(
            sdpa_options(scale, causal, backend, num_threads,
                         variants(window_left, window_right, softcap, chunk_size, position_offset), check_finite), dropout_p, dropout_seed, dropout_offset), compute_dtype);
        attn::SdpaGrads<R> g;
        g.dq = view_of<R, 4>(dq, "dq");
        g.dk = view_of<R, 4>(dk, "dk");
        g.dv = view_of<R, 4>(dv, "dv");
        g.dbias = view_of<R, 4>(dbias, "dbias");
        g.dsinks = view_of<R, 1>(dsinks, "dsinks");
        const attn::View4<const R> d = view_of<const R, 4>(dout, "dout");
        const attn::View4<const R> o = view_of<const R, 4>(out, "out");
        const attn::View3<const R> l = view_of<const R, 3>(lse, "lse");
        nb::gil_scoped_release release;
        attn::scaled_dot_product_attention_backward<T>(args, d, {o, l}, g, opt);
      },
      "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "dout"_a.noconvert(), "dq"_a.noconvert(),
      "dk"_a.noconvert(), "dv"_a.noconvert(), nb::kw_only(), "mask"_a.noconvert().none() = nb::none(),
      "bias"_a.noconvert().none() = nb::none(), "dbias"_a.noconvert().none() = nb::none(),
      "out"_a.noconvert().none() = nb::none(), "lse"_a.noconvert().none() = nb::none(),
      "scale"_a.none() = nb::none(), "causal"_a = false, "backend"_a = "auto", "num_threads"_a = 0,
      "alibi_slopes"_a.noconvert().none() = nb::none(), "sinks"_a.noconvert().none() = nb::none(),
      "dsinks"_a.noconvert().none() = nb::none(), "window_left"_a = -1, "window_right"_a = -1,
      "softcap"_a = 0.0, "chunk_size"_a = 0, "position_offset"_a.none() = nb::none(), "dropout_p"_a = 0.0, "dropout_seed"_a = 0,
      "dropout_offset"_a = 0, "check_finite"_a = false, "compute_dtype"_a.none() = nb::none(),
      "Backward of sdpa_forward from dout = dL/dout: overwrites dq, dk, dv (and dbias, the bias's\n"
      "shape; dsinks, the sinks'). out and lse, the forward's saved state, spare the fused backend\n"
      "recomputing them.");
  m.def(
      bf16 ? "resolve_backend_bf16" : "resolve_backend",
      [](const Arr<const T, 4>& q, const Arr<const T, 4>& k, const Arr<const T, 4>& v,
         const Opt<Arr<const bool, 4>>& mask, const Opt<Arr<const R, 4>>& bias, std::optional<double> scale,
         bool causal, const std::string& backend, const Opt<Arr<const R, 1>>& alibi_slopes,
         const Opt<Arr<const R, 1>>& sinks, int64_t window_left, int64_t window_right, double softcap, int64_t chunk_size,
         Opt<int64_t> position_offset) {
        const attn::SdpaArgs<T> args = sdpa_args<T>(q, k, v, mask, bias, alibi_slopes, sinks);
        const attn::SdpaOptions opt =
            sdpa_options(scale, causal, backend, 0, variants(window_left, window_right, softcap, chunk_size, position_offset));
        return std::string(attn::backend_name(attn::resolve_backend<T>(args, opt)));
      },
      "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), nb::kw_only(),
      "mask"_a.noconvert().none() = nb::none(), "bias"_a.noconvert().none() = nb::none(),
      "scale"_a.none() = nb::none(), "causal"_a = false, "backend"_a = "auto",
      "alibi_slopes"_a.noconvert().none() = nb::none(), "sinks"_a.noconvert().none() = nb::none(),
      "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0, "chunk_size"_a = 0, "position_offset"_a.none() = nb::none(),
      "Name of the backend (\"reference\" or \"fused\") sdpa_forward would run for these arguments.");
}

// The packed (varlen) call, float32 and float64.
template <class T>
void bind_varlen(nb::module_& m) {
  using namespace nb::literals;
  m.def(
      "varlen_forward",
      [](const Arr<const T, 3>& q, const Arr<const T, 3>& k, const Arr<const T, 3>& v,
         const Arr<const int64_t, 1>& cu_q, const Arr<const int64_t, 1>& cu_k, int64_t max_q, int64_t max_k,
         const Arr<T, 3>& out, const Opt<Arr<T, 2>>& lse, std::optional<double> scale, bool causal,
         const std::string& backend, int num_threads, const Opt<Arr<const T, 1>>& alibi_slopes,
         const Opt<Arr<const T, 1>>& sinks, int64_t window_left, int64_t window_right, double softcap, int64_t chunk_size,
         Opt<int64_t> position_offset, double dropout_p, uint64_t dropout_seed,
         uint64_t dropout_offset) {
        const attn::VarlenArgs<T> a = varlen_args<T>(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks);
        const attn::SdpaOptions opt = with_dropout(
            sdpa_options(scale, causal, backend, num_threads,
                                                   variants(window_left, window_right, softcap, chunk_size, position_offset)), dropout_p, dropout_seed, dropout_offset);
        const attn::VarlenOutputs<T> o{view_of<T, 3>(out, "out"), view_of<T, 2>(lse, "lse")};
        nb::gil_scoped_release release;
        attn::varlen_attention<T>(a, o, opt);
      },
      "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "cu_seqlens_q"_a.noconvert(),
      "cu_seqlens_k"_a.noconvert(), "max_seqlen_q"_a, "max_seqlen_k"_a, "out"_a.noconvert(), nb::kw_only(),
      "lse"_a.noconvert().none() = nb::none(), "scale"_a.none() = nb::none(), "causal"_a = false,
      "backend"_a = "auto", "num_threads"_a = 0, "alibi_slopes"_a.noconvert().none() = nb::none(), "sinks"_a.noconvert().none() = nb::none(),
      "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0, "chunk_size"_a = 0, "position_offset"_a.none() = nb::none(), "dropout_p"_a = 0.0, "dropout_seed"_a = 0,
      "dropout_offset"_a = 0,
      "Packed variable-length attention: q (total_q, H, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev),\n"
      "int64 cu_seqlens (B + 1); writes out (total_q, H, Ev) and lse (H, total_q) when given.");
  m.def(
      "varlen_backward",
      [](const Arr<const T, 3>& q, const Arr<const T, 3>& k, const Arr<const T, 3>& v,
         const Arr<const int64_t, 1>& cu_q, const Arr<const int64_t, 1>& cu_k, int64_t max_q, int64_t max_k,
         const Arr<const T, 3>& dout, const Arr<T, 3>& dq, const Arr<T, 3>& dk, const Arr<T, 3>& dv,
         const Opt<Arr<T, 1>>& dsinks, const Opt<Arr<const T, 3>>& out, const Opt<Arr<const T, 2>>& lse,
         std::optional<double> scale, bool causal, const std::string& backend, int num_threads,
         const Opt<Arr<const T, 1>>& alibi_slopes, const Opt<Arr<const T, 1>>& sinks, int64_t window_left,
         int64_t window_right, double softcap, int64_t chunk_size, Opt<int64_t> position_offset, double dropout_p, uint64_t dropout_seed,
         uint64_t dropout_offset) {
        const attn::VarlenArgs<T> a = varlen_args<T>(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, sinks);
        const attn::SdpaOptions opt = with_dropout(
            sdpa_options(scale, causal, backend, num_threads,
                                                   variants(window_left, window_right, softcap, chunk_size, position_offset)), dropout_p, dropout_seed, dropout_offset);
        attn::VarlenGrads<T> g{view_of<T, 3>(dq, "dq"), view_of<T, 3>(dk, "dk"), view_of<T, 3>(dv, "dv")};
        g.dsinks = view_of<T, 1>(dsinks, "dsinks");
        const attn::View3<const T> d = view_of<const T, 3>(dout, "dout");
        const attn::VarlenSaved<T> saved{view_of<const T, 3>(out, "out"), view_of<const T, 2>(lse, "lse")};
        nb::gil_scoped_release release;
        attn::varlen_attention_backward<T>(a, d, saved, g, opt);
      },
      "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(), "cu_seqlens_q"_a.noconvert(),
      "cu_seqlens_k"_a.noconvert(), "max_seqlen_q"_a, "max_seqlen_k"_a, "dout"_a.noconvert(),
      "dq"_a.noconvert(), "dk"_a.noconvert(), "dv"_a.noconvert(), nb::kw_only(),
      "dsinks"_a.noconvert().none() = nb::none(), "out"_a.noconvert().none() = nb::none(),
      "lse"_a.noconvert().none() = nb::none(), "scale"_a.none() = nb::none(), "causal"_a = false,
      "backend"_a = "auto", "num_threads"_a = 0, "alibi_slopes"_a.noconvert().none() = nb::none(), "sinks"_a.noconvert().none() = nb::none(),
      "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0, "chunk_size"_a = 0, "position_offset"_a.none() = nb::none(), "dropout_p"_a = 0.0, "dropout_seed"_a = 0,
      "dropout_offset"_a = 0,
      "Backward of varlen_forward from dout: overwrites dq, dk, dv (and dsinks).");
}

// A copy of a parameter as a fresh NumPy array (the layer keeps its own).
template <class T>
nb::ndarray<nb::numpy, T> numpy_copy(const attn::Tensor<T>& t) {
  T* buf = new T[t.size() ? t.size() : 1];
  std::copy(t.data(), t.data() + t.size(), buf);
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  std::vector<size_t> shape(t.shape().begin(), t.shape().end());
  return nb::ndarray<nb::numpy, T>(buf, shape.size(), shape.data(), owner);
}

// attn::MultiheadAttention<T> and its cache (which owns copies of everything
// the backward needs, masks included) as the classes `name` and
// `cache_name`; the Python layer picks the class of its dtype.
template <class T>
void bind_multihead(nb::module_& m, const char* name, const char* cache_name) {
  using namespace nb::literals;
  using Layer = attn::MultiheadAttention<T>;
  using Cache = attn::MhaSaved<T>;
  nb::class_<Cache>(m, cache_name, "What backward needs from one forward call (inputs, projections, masks).")
      .def(nb::init<>())
      .def_prop_ro("filled", &Cache::filled, "True once a forward call filled it.")
      .def_prop_ro("self_attention", [](const Cache& c) { return c.self_attention; });
  nb::class_<Layer>(m, name, "attn::MultiheadAttention; use attn.MultiheadAttention instead.")
      .def(
          "__init__",
          [](Layer* self, int64_t embed_dim, int64_t num_heads, bool bias, int64_t kdim, int64_t vdim,
             uint64_t seed, bool sinks) {
            attn::MultiheadConfig c;
            c.embed_dim = embed_dim;
            c.num_heads = num_heads;
            c.bias = bias;
            c.kdim = kdim;
            c.vdim = vdim;
            c.sinks = sinks;
            new (self) Layer(c, seed);
          },
          "embed_dim"_a, "num_heads"_a, nb::kw_only(), "bias"_a = true, "kdim"_a = 0, "vdim"_a = 0, "seed"_a = 0,
          "sinks"_a = false,
          "A layer with PyTorch's initialisation drawn from seed; kdim, vdim 0 = embed_dim; sinks: a learnable\n"
          "sink logit per head (parameter 'sinks', starting at 0).")
      .def_prop_ro("embed_dim", &Layer::embed_dim)
      .def_prop_ro("num_heads", &Layer::num_heads)
      .def_prop_ro("head_dim", &Layer::head_dim)
      .def_prop_ro("kdim", &Layer::kdim)
      .def_prop_ro("vdim", &Layer::vdim)
      .def_prop_ro("packed_in_proj", &Layer::packed_in_proj)
      .def_prop_ro("has_sinks", &Layer::has_sinks)
      .def("parameter_names", &Layer::parameter_names, "The state_dict names, in PyTorch's order.")
      .def(
          "get_parameter", [](const Layer& l, const std::string& n) { return numpy_copy(l.parameter(n)); },
          "name"_a, "A copy of the parameter `name`.")
      .def(
          "set_parameter",
          [](Layer& l, const std::string& n, const nb::ndarray<const T, nb::device::cpu>& a) {
            if (a.ndim() == 2) return l.load_parameter(n, view_of<const T, 2>(a, "value"));
            if (a.ndim() == 1) return l.load_parameter(n, view_of<const T, 1>(a, "value"));
            throw attn::InvalidArgument("attn::MultiheadAttention::load_parameter: parameter '" + n + "' was given " +
                              std::to_string(a.ndim()) + " dimensions, expected 1 (bias) or 2 (weight)");
          },
          "name"_a, "value"_a.noconvert(), "Copies `value` (the parameter's exact shape) into the layer.")
      .def(
          "forward",
          [](const Layer& l, const Arr<const T, 3>& query, const Opt<Arr<const T, 3>>& key,
             const Opt<Arr<const T, 3>>& value, const Arr<T, 3>& out, const Opt<Arr<const bool, 4>>& attn_mask,
             const Opt<Arr<const T, 4>>& attn_bias, const Opt<Arr<const bool, 2>>& key_padding_mask,
             const Opt<Arr<T, 4>>& head_weights, const Opt<Arr<T, 3>>& avg_weights, bool causal,
             const std::string& backend, int num_threads, Cache* cache, const Opt<Arr<const T, 1>>& alibi_slopes,
             int64_t window_left, int64_t window_right, double softcap, int64_t chunk_size, Opt<int64_t> position_offset,
             double dropout_p, uint64_t dropout_seed, uint64_t dropout_offset,
             const std::optional<std::string>& compute_dtype) {
            attn::MhaArgs<T> a;
            a.query = view_of<const T, 3>(query, "query");
            a.key = view_of<const T, 3>(key, "key");
            a.value = view_of<const T, 3>(value, "value");
            a.mask = view_of<const bool, 4>(attn_mask, "attn_mask");
            a.bias = view_of<const T, 4>(attn_bias, "attn_bias");
            a.key_padding_mask = view_of<const bool, 2>(key_padding_mask, "key_padding_mask");
            a.alibi_slopes = view_of<const T, 1>(alibi_slopes, "alibi_slopes");
            const attn::MhaOutputs<T> o{view_of<T, 3>(out, "out"), view_of<T, 4>(head_weights, "head_weights"),
                                        view_of<T, 3>(avg_weights, "avg_weights")};
            attn::MhaOptions opt;
            opt.sdpa = with_compute(with_dropout(sdpa_options(std::nullopt, causal, backend, num_threads,
                                                              variants(window_left, window_right, softcap, chunk_size,
                                                                       position_offset)),
                                                 dropout_p, dropout_seed, dropout_offset),
                                    compute_dtype);
            nb::gil_scoped_release release;
            l.forward(a, o, opt, cache);
          },
          "query"_a.noconvert(), "key"_a.noconvert().none(), "value"_a.noconvert().none(), "out"_a.noconvert(),
          nb::kw_only(), "attn_mask"_a.noconvert().none() = nb::none(),
          "attn_bias"_a.noconvert().none() = nb::none(), "key_padding_mask"_a.noconvert().none() = nb::none(),
          "head_weights"_a.noconvert().none() = nb::none(), "avg_weights"_a.noconvert().none() = nb::none(),
          "causal"_a = false, "backend"_a = "auto", "num_threads"_a = 0, "cache"_a.none() = nb::none(),
          "alibi_slopes"_a.noconvert().none() = nb::none(), "window_left"_a = -1, "window_right"_a = -1,
          "softcap"_a = 0.0, "chunk_size"_a = 0, "position_offset"_a.none() = nb::none(), "dropout_p"_a = 0.0,
          "dropout_seed"_a = 0, "dropout_offset"_a = 0, "compute_dtype"_a.none() = nb::none(),
          "Forward on (B, N, width) arrays (key and value None: self-attention); writes out and the\n"
          "weights given, and fills cache (which then owns copies of everything backward needs).\n"
          "alibi_slopes (H), window_left/right (-1 unbounded), softcap (0 off), position_offset: the variants;\n"
          "dropout_p, dropout_seed, dropout_offset: attention dropout (the cache keeps them for backward);\n"
          "compute_dtype: the attention's products, 'float32' or 'bfloat16' (None: float32).")
      .def(
          "decode",
          [](const Layer& l, const Arr<const T, 3>& query, attn::KVCache& kv, const Arr<T, 3>& out,
             const Opt<Arr<const bool, 4>>& attn_mask, const Opt<Arr<const T, 4>>& attn_bias, bool causal,
             const std::string& backend, int num_threads, const Opt<Arr<const T, 1>>& alibi_slopes,
             int64_t window_left, int64_t window_right, double softcap, int64_t chunk_size) {
            attn::MhaArgs<T> a;
            a.query = view_of<const T, 3>(query, "query");
            a.mask = view_of<const bool, 4>(attn_mask, "attn_mask");
            a.bias = view_of<const T, 4>(attn_bias, "attn_bias");
            a.alibi_slopes = view_of<const T, 1>(alibi_slopes, "alibi_slopes");
            if constexpr (std::is_same_v<T, float>) {
              const attn::View3<T> o = view_of<T, 3>(out, "out");
              attn::MhaOptions opt;
              opt.sdpa = sdpa_options(std::nullopt, causal, backend, num_threads,
                                      variants(window_left, window_right, softcap, chunk_size, std::nullopt));
              nb::gil_scoped_release release;
              l.decode(a, kv, o, opt);
            } else {
              (void)l, (void)kv, (void)a;
              throw attn::InvalidArgument(
                  "attn::MultiheadAttention::decode: decoding over a KV cache is float32 only (the cache stores "
                  "float32 or narrower); use a float32 layer");
            }
          },
          "query"_a.noconvert(), "cache"_a, "out"_a.noconvert(), nb::kw_only(),
          "attn_mask"_a.noconvert().none() = nb::none(), "attn_bias"_a.noconvert().none() = nb::none(),
          "causal"_a = false, "backend"_a = "auto", "num_threads"_a = 0,
          "alibi_slopes"_a.noconvert().none() = nb::none(), "window_left"_a = -1, "window_right"_a = -1,
          "softcap"_a = 0.0, "chunk_size"_a = 0,
          "Incremental decoding on (B, L, D) arrays: appends the new tokens' keys and values to cache and\n"
          "writes their attention over it; attn_mask (True = attend) / attn_bias are (B|1, H|1, L|1, C|1).")
      .def(
          "backward",
          [](Layer& l, const Cache& cache, const Arr<const T, 3>& dout, const Opt<Arr<T, 3>>& dquery,
             const Opt<Arr<T, 3>>& dkey, const Opt<Arr<T, 3>>& dvalue) {
            const attn::View3<const T> d = view_of<const T, 3>(dout, "dout");
            const attn::MhaGrads<T> g{view_of<T, 3>(dquery, "dquery"), view_of<T, 3>(dkey, "dkey"),
                                      view_of<T, 3>(dvalue, "dvalue")};
            nb::gil_scoped_release release;
            l.backward(cache, d, g);
          },
          "cache"_a, "dout"_a.noconvert(), nb::kw_only(), "dquery"_a.noconvert().none() = nb::none(),
          "dkey"_a.noconvert().none() = nb::none(), "dvalue"_a.noconvert().none() = nb::none(),
          "Backward from dout (B, L, D): adds to the parameter gradients, overwrites the input gradients\n"
          "given (after a self-attention forward, the gradient of the input goes to dquery).")
      .def("zero_grad", &Layer::zero_grad, "Sets every parameter gradient to zero.")
      .def(
          "get_grad", [](const Layer& l, const std::string& n) { return numpy_copy(l.grad(n)); }, "name"_a,
          "A copy of the accumulated gradient of parameter `name`.");
}

// The KV cache and decode_attention (python/attn/_decode.py wraps them).
void bind_decode(nb::module_& m) {
  using attn::KVCache;
  using namespace nb::literals;
  nb::class_<KVCache>(m, "KVCache")
      .def(
          "__init__",
          [](KVCache* self, int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, int64_t value_dim,
             const std::string& dtype, int64_t page_size, int64_t num_pages) {
            attn::KVCacheConfig c;
            c.batch = batch, c.kv_heads = kv_heads, c.capacity = capacity, c.head_dim = head_dim;
            c.value_dim = value_dim, c.dtype = attn::parse_dtype(dtype), c.page_size = page_size;
            c.num_pages = num_pages;
            new (self) KVCache(c);
          },
          "batch"_a, "kv_heads"_a, "capacity"_a, "head_dim"_a, "value_dim"_a, "dtype"_a, "page_size"_a, "num_pages"_a)
      .def_prop_ro("batch", &KVCache::batch)
      .def_prop_ro("kv_heads", &KVCache::kv_heads)
      .def_prop_ro("capacity", &KVCache::capacity)
      .def_prop_ro("head_dim", &KVCache::head_dim)
      .def_prop_ro("value_dim", &KVCache::value_dim)
      .def_prop_ro("page_size", &KVCache::page_size)
      .def_prop_ro("paged", &KVCache::paged)
      .def_prop_ro("num_pages", &KVCache::num_pages)
      .def_prop_ro("free_pages", &KVCache::free_pages)
      .def_prop_ro("storage_bytes", &KVCache::storage_bytes)
      .def_prop_ro("dtype", [](const KVCache& c) { return std::string(attn::dtype_name(c.dtype())); })
      .def("length", &KVCache::length, "b"_a)
      .def(
          "append",
          [](KVCache& c, int64_t b, const Arr<const float, 3>& k, const Arr<const float, 3>& v) {
            const auto kv = view_of<const float, 3>(k, "k"), vv = view_of<const float, 3>(v, "v");
            nb::gil_scoped_release release;
            c.append(b, kv, vv);
          },
          "b"_a, "k"_a.noconvert(), "v"_a.noconvert())
      .def(
          "append_all",
          [](KVCache& c, const Arr<const float, 4>& k, const Arr<const float, 4>& v) {
            const auto kv = view_of<const float, 4>(k, "k"), vv = view_of<const float, 4>(v, "v");
            nb::gil_scoped_release release;
            c.append(attn::View4<const float>(kv), attn::View4<const float>(vv));
          },
          "k"_a.noconvert(), "v"_a.noconvert())
      .def("reset", &KVCache::reset, "b"_a)
      .def("truncate", &KVCache::truncate, "b"_a, "length"_a)
      .def("clear", &KVCache::clear)
      .def("block_table", &KVCache::block_table, "b"_a)
      .def(
          "set_block_table",
          [](KVCache& c, int64_t b, const std::vector<int32_t>& pages, int64_t length) {
            c.set_block_table(b, std::span<const int32_t>(pages), length);
          },
          "b"_a, "pages"_a, "length"_a)
      .def(
          "read",
          [](const KVCache& c, int64_t b, const Arr<float, 3>& k, const Arr<float, 3>& v) {
            c.read(b, view_of<float, 3>(k, "k"), view_of<float, 3>(v, "v"));
          },
          "b"_a, "k"_a.noconvert(), "v"_a.noconvert());
  // k and v, when given, are the step's new tokens, appended before
  // attending: a decoding step in one call (attn.hf's AttnCache).
  m.def(
      "decode_attention",
      [](const Arr<const float, 4>& q, KVCache& cache, const Arr<float, 4>& out, const std::optional<Arr<float, 3>>& lse,
         std::optional<double> scale, bool causal, const std::string& backend, int num_threads, int64_t window_left,
         int64_t window_right, double softcap, int64_t chunk_size, const Opt<Arr<const float, 1>>& alibi_slopes,
         const Opt<Arr<const float, 1>>& sinks, const Opt<Arr<const bool, 4>>& mask,
         const Opt<Arr<const float, 4>>& bias, const Opt<Arr<const float, 4>>& k, const Opt<Arr<const float, 4>>& v) {
        attn::DecodeArgs a;
        a.q = view_of<const float, 4>(q, "q");
        a.cache = &cache;
        a.alibi_slopes = view_of<const float, 1>(alibi_slopes, "alibi_slopes");
        a.sinks = view_of<const float, 1>(sinks, "sinks");
        a.mask = view_of<const bool, 4>(mask, "mask");
        a.bias = view_of<const float, 4>(bias, "bias");
        const attn::SdpaOptions o = sdpa_options(scale, causal, backend, num_threads,
                                                 variants(window_left, window_right, softcap, chunk_size, std::nullopt));
        const attn::SdpaOutputs<float> outs{view_of<float, 4>(out, "out"), {}, view_of<float, 3>(lse, "lse")};
        const auto kv = view_of<const float, 4>(k, "k"), vv = view_of<const float, 4>(v, "v");
        nb::gil_scoped_release release;
        if (k || v)
          attn::decode_attention(cache, kv, vv, a, outs, o);
        else
          attn::decode_attention(a, outs, o);
      },
      "q"_a.noconvert(), "cache"_a, "out"_a.noconvert(), "lse"_a.noconvert().none(), "scale"_a.none(), "causal"_a,
      "backend"_a, "num_threads"_a, "window_left"_a = -1, "window_right"_a = -1, "softcap"_a = 0.0,
      "chunk_size"_a = 0, "alibi_slopes"_a.noconvert().none() = nb::none(), "sinks"_a.noconvert().none() = nb::none(),
      "mask"_a.noconvert().none() = nb::none(), "bias"_a.noconvert().none() = nb::none(),
      "k"_a.noconvert().none() = nb::none(), "v"_a.noconvert().none() = nb::none(),
      "Attention of q (B, H, L, E) over the cache into out (and lse); the score rules as in sdpa;\n"
      "mask (bool) / bias (float) of shape (B|1, H|1, L|1, capacity|1). With k (B, Hkv, n, E) and\n"
      "v (B, Hkv, n, Ev), the new tokens are appended first (nothing changes when the call is refused).");
}

// A C-contiguous array of any rank (bfloat16 as its uint16 bits, above).
template <class T>
using Arr1 = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

// dst = f(src) over arrays of as many elements, the GIL released meanwhile.
template <class S, class D>
void bulk_convert(const Arr1<const S>& src, const Arr1<D>& dst, void (*f)(const S*, int64_t, D*, int)) {
  if (src.size() != dst.size())
    throw attn::InvalidArgument("attn: argument 'dst' has " + std::to_string(dst.size()) +
                                " elements, expected as many as 'src' (" + std::to_string(src.size()) + ")");
  nb::gil_scoped_release unlocked;
  f(src.data(), int64_t(src.size()), dst.data(), 0);
}

}  // namespace

NB_MODULE(_attn, m) {
  using namespace nb::literals;
  m.doc() = "Low-level bindings of libattn; use the functions of the attn package instead.";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const attn::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const attn::FileError& e) {
      // OSError(errno, message, filename) is FileNotFoundError for ENOENT,
      // PermissionError for EACCES, ...; a malformed file (errno 0) is a plain OSError.
      if (e.error_code() != 0) {
        nb::object err = nb::borrow<nb::object>(PyExc_OSError)(e.error_code(), e.what(), e.path());
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
      } else {
        PyErr_SetString(PyExc_OSError, e.what());
      }
    }
  });
  bind_sdpa<float>(m);
  bind_sdpa<double>(m);
  bind_sdpa<attn::float16_t>(m);
  bind_sdpa<attn::bfloat16_t>(m);
  bind_varlen<float>(m);
  bind_varlen<double>(m);
  bind_multihead<float>(m, "MultiheadAttentionF32", "MhaSavedF32");
  bind_multihead<double>(m, "MultiheadAttentionF64", "MhaSavedF64");
  bind_decode(m);
  // The bulk bfloat16 conversions (attn/half.hpp), for the bfloat16 layer's
  // inputs and outputs (bulk_convert).
  m.def(
      "to_float_bf16",
      [](Arr1<const attn::bfloat16_t> src, Arr1<float> dst) { bulk_convert(src, dst, attn::to_float); },
      "src"_a.noconvert(), "dst"_a.noconvert(), "dst = src (bfloat16 bits) widened to float32, exactly.");
  m.def(
      "from_float_bf16",
      [](Arr1<const float> src, Arr1<attn::bfloat16_t> dst) { bulk_convert(src, dst, attn::from_float); },
      "src"_a.noconvert(), "dst"_a.noconvert(), "dst = src (float32) rounded to bfloat16 bits, nearest even.");
  m.def(
      "parse_backend", [](const std::string& name) { return std::string(attn::backend_name(attn::parse_backend(name))); },
      nb::arg("name"), "Validates a backend name; returns it, or raises ValueError.");
}
