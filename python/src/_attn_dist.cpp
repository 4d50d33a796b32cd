// attn._attn_dist — the mpi4py bridge to attn::dist (context-parallel
// attention over MPI), a separate extension so that the core module attn._attn
// never depends on MPI. Built only when CMake finds an MPI (python/CMakeLists.txt).
//
// The communicator comes from mpi4py as the address of its MPI_Comm handle
// (`MPI._addressof(comm)`), which is portable across MPI implementations
// (Open MPI's handle is a pointer, MPICH's an int): the C++ side reads the
// handle there. mpi4py must be built against the same MPI library as this
// module (pip install mpi4py builds it with the mpicc on PATH). Arrays are
// this rank's float32 shards, rank 4 (B, H, N, d), viewed without a copy; the
// Python layer (attn/dist.py) checks dtypes and allocates the outputs, and
// shares its verdict through first_failed_rank. Every attn::Error surfaces
// as ValueError with the library's message (all ranks raise together:
// attn::dist agrees on the verdict before any message).
#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attn/dist.hpp"
#include "views.hpp"

namespace nb = nanobind;

namespace {

using attn_python::Arr;
using attn_python::view_of;
template <class T>
using Opt = std::optional<T>;

// The MPI_Comm stored at the address mpi4py's MPI._addressof(comm) returns.
MPI_Comm comm_at(uintptr_t address) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    throw attn::InvalidArgument("attn.dist: MPI is not initialised (import mpi4py.MPI first) or already finalised");
  if (address == 0) throw attn::InvalidArgument("attn.dist: argument 'comm' has no MPI handle (address 0)");
  return *reinterpret_cast<const MPI_Comm*>(address);
}

attn::dist::Layout parse_layout(const std::string& s) {
  if (s == "zigzag") return attn::dist::Layout::zigzag;
  if (s == "contiguous") return attn::dist::Layout::contiguous;
  throw attn::InvalidArgument("attn.dist: layout '" + s + "', expected 'zigzag' or 'contiguous'");
}

bool is_ring(const std::string& strategy) {
  if (strategy != "ring" && strategy != "ulysses")
    throw attn::InvalidArgument("attn.dist: strategy '" + strategy + "', expected 'ring' or 'ulysses'");
  return strategy == "ring";
}

// One prepared call: the strategy, the communicator, the views of the
// inputs and the options, shared by forward and backward. It holds the
// input arrays so that the views stay valid for as long as it lives.
struct Call {
  bool ring = true;
  MPI_Comm comm = MPI_COMM_NULL;
  attn::dist::DistOptions opt;
  attn::SdpaArgs<float> args;
  std::vector<nb::object> keep;
};

Call prepare(const std::string& strategy, uintptr_t comm, const Arr<const float, 4>& q, const Arr<const float, 4>& k,
             const Arr<const float, 4>& v, const Opt<Arr<const int64_t, 1>>& key_lengths,
             const Opt<Arr<const float, 1>>& alibi_slopes, const Opt<Arr<const float, 1>>& sinks,
             std::optional<double> scale, bool causal, int64_t window_left, int64_t window_right, double softcap,
             int64_t chunk_size, Opt<int64_t> position_offset, const std::string& layout, int num_threads,
             Opt<double> timeout) {
  Call c;
  c.ring = is_ring(strategy);
  c.comm = comm_at(comm);
  c.args.q = view_of<const float, 4>(q, "q");
  c.args.k = view_of<const float, 4>(k, "k");
  c.args.v = view_of<const float, 4>(v, "v");
  c.args.key_lengths = view_of<const int64_t, 1>(key_lengths, "key_lengths");
  c.args.alibi_slopes = view_of<const float, 1>(alibi_slopes, "alibi_slopes");
  c.args.sinks = view_of<const float, 1>(sinks, "sinks");
  c.keep = {nb::cast(q), nb::cast(k), nb::cast(v), nb::cast(key_lengths), nb::cast(alibi_slopes), nb::cast(sinks)};
  c.opt.sdpa.scale = scale;
  c.opt.sdpa.causal = causal;
  c.opt.sdpa.window = {window_left, window_right};
  c.opt.sdpa.softcap = softcap;
  c.opt.sdpa.chunk_size = chunk_size;
  c.opt.sdpa.position_offset = position_offset;
  c.opt.sdpa.num_threads = num_threads;
  c.opt.layout = parse_layout(layout);
  c.opt.timeout_s = timeout;
  return c;
}

}  // namespace

NB_MODULE(_attn_dist, m) {
  using namespace nb::literals;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const attn::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.def(
      "chunk_layout",
      [](int64_t n, int P, int r, const std::string& layout) {
        std::vector<std::pair<int64_t, int64_t>> v;
        for (const attn::dist::Chunk& c : attn::dist::chunk_layout(n, P, r, parse_layout(layout)))
          v.emplace_back(c.begin, c.length);
        return v;
      },
      "n"_a, "P"_a, "r"_a, "layout"_a = "zigzag",
      "The chunks (begin, length) of a length-n sequence that rank r of P holds, in order.");
  m.def(
      "first_failed_rank",
      [](uintptr_t comm, bool failed, Opt<double> timeout, const std::string& caller) {
        attn::dist::DistOptions opt;
        opt.timeout_s = timeout;
        const MPI_Comm c = comm_at(comm);
        nb::gil_scoped_release release;
        return attn::dist::first_failed_rank(c, failed, opt, caller);
      },
      "comm"_a, "failed"_a, "timeout"_a.none() = nb::none(), "caller"_a = "attn.dist",
      "Every rank says whether its own checks failed; the lowest failing rank, or -1, on every rank.");
  nb::class_<Call>(m, "Call", "A prepared context-parallel call (attn.dist builds it).");
  m.def("prepare", &prepare, "strategy"_a, "comm"_a, "q"_a.noconvert(), "k"_a.noconvert(), "v"_a.noconvert(),
        nb::kw_only(), "key_lengths"_a.noconvert().none() = nb::none(),
        "alibi_slopes"_a.noconvert().none() = nb::none(), "sinks"_a.noconvert().none() = nb::none(),
        "scale"_a.none() = nb::none(), "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1,
        "softcap"_a = 0.0, "chunk_size"_a = 0, "position_offset"_a.none() = nb::none(), "layout"_a = "zigzag", "num_threads"_a = 0,
        "timeout"_a.none() = nb::none(),
        "A call of strategy 'ring' or 'ulysses' on this rank's float32 shards q, k, v (rank 4); comm is\n"
        "MPI._addressof(mpi4py communicator).");
  m.def(
      "forward",
      [](const Call& c, const Arr<float, 4>& out, const Opt<Arr<float, 3>>& lse) {
        const attn::SdpaOutputs<float> o{view_of<float, 4>(out, "out"), {}, view_of<float, 3>(lse, "lse")};
        nb::gil_scoped_release release;
        if (c.ring) attn::dist::ring_attention(c.comm, c.args, o, c.opt);
        else attn::dist::ulysses_attention(c.comm, c.args, o, c.opt);
      },
      "call"_a, "out"_a.noconvert(), "lse"_a.noconvert().none() = nb::none(),
      "The forward: writes this rank's out (and lse when given).");
  m.def(
      "backward",
      [](const Call& c, const Arr<const float, 4>& dout, const Arr<float, 4>& dq, const Arr<float, 4>& dk,
         const Arr<float, 4>& dv, const Opt<Arr<const float, 4>>& out, const Opt<Arr<const float, 3>>& lse,
         const Opt<Arr<float, 1>>& dsinks) {
        attn::SdpaGrads<float> g;
        g.dq = view_of<float, 4>(dq, "dq");
        g.dk = view_of<float, 4>(dk, "dk");
        g.dv = view_of<float, 4>(dv, "dv");
        g.dsinks = view_of<float, 1>(dsinks, "dsinks");
        const attn::SdpaSaved<float> saved{view_of<const float, 4>(out, "out"), view_of<const float, 3>(lse, "lse")};
        const attn::View4<const float> d = view_of<const float, 4>(dout, "dout");
        nb::gil_scoped_release release;
        if (c.ring) attn::dist::ring_attention_backward(c.comm, c.args, d, saved, g, c.opt);
        else attn::dist::ulysses_attention_backward(c.comm, c.args, d, saved, g, c.opt);
      },
      "call"_a, "dout"_a.noconvert(), "dq"_a.noconvert(), "dk"_a.noconvert(), "dv"_a.noconvert(), nb::kw_only(),
      "out"_a.noconvert().none() = nb::none(), "lse"_a.noconvert().none() = nb::none(),
      "dsinks"_a.noconvert().none() = nb::none(),
      "The backward: overwrites this rank's dq, dk, dv (and dsinks, the whole (H) gradient); out and\n"
      "lse are the forward's (recomputed when not given).");
}
