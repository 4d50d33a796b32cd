// attn::dist: the shard layouts, the helpers that copy shards in and out, and
// the validation every strategy runs before its first message.
//
// Validation happens in two rounds, each ending in a collective, so that all
// ranks reach the same verdict: first each rank checks its own views (shapes,
// strides, options) and the ranks agree on whether any failed (one
// MPI_Allreduce); then the ranks exchange what must be the same everywhere
// (shapes, options, key lengths) and their local lengths (MPI_Allgather),
// and every rank checks the gathered values identically. A bad argument on
// one rank thus makes every rank throw, none waits for a message that never
// comes.
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>

#include "dist/internal.hpp"
#include "kernels/score_rules.hpp"
#include "validate.hpp"

namespace attn::dist {

const char* layout_name(Layout l) { return l == Layout::zigzag ? "zigzag" : "contiguous"; }

std::vector<Chunk> chunk_layout(int64_t n, int P, int r, Layout layout) {
  if (P < 1 || r < 0 || r >= P)
    throw InvalidArgument("attn::dist::chunk_layout: rank " + std::to_string(r) + " of " + std::to_string(P) +
                " processes, expected 0 <= rank < P");
  if (n < 0) throw InvalidArgument("attn::dist::chunk_layout: length " + std::to_string(n) + ", expected >= 0");
  const int64_t C = layout == Layout::zigzag ? 2 * int64_t(P) : int64_t(P);
  auto chunk = [&](int64_t c) {
    // the first n mod C chunks are one row longer
    const int64_t base = n / C, extra = n % C;
    return Chunk{c, c * base + std::min(c, extra), base + (c < extra ? 1 : 0)};
  };
  if (layout == Layout::contiguous) return {chunk(r)};
  return {chunk(r), chunk(C - 1 - r)};
}

int64_t shard_length(int64_t n, int P, int r, Layout layout) {
  int64_t s = 0;
  for (const Chunk& c : chunk_layout(n, P, r, layout)) s += c.length;
  return s;
}

namespace {

template <class V>
void check_shard_shapes(const char* fn, const V& full, const V& local, int P, int r, Layout layout) {
  const int64_t want = shard_length(full.shape[2], P, r, layout);
  auto s = full.shape;
  s[2] = want;
  if (local.shape != s)
    throw InvalidArgument(std::string("attn::dist::") + fn + ": the shard has shape " + shape_str(local.shape) + ", expected " +
                shape_str(s) + " (rank " + std::to_string(r) + " of " + std::to_string(P) + ", " +
                layout_name(layout) + " layout of " + std::to_string(full.shape[2]) + " rows)");
  if ((full.data == nullptr && full.numel() > 0) || (local.data == nullptr && local.numel() > 0))
    throw InvalidArgument(std::string("attn::dist::") + fn + ": a view has no data (null pointer)");
}

// Copies between global rows of `full` and local rows of `local`, chunk by chunk.
template <class F, int R>
void copy_rows(const View<F, R>& full, const View<F, R>& local, int P, int r, Layout layout, bool to_local) {
  const int64_t A = full.shape[0], Bx = full.shape[1];
  const int64_t W = R == 4 ? full.shape[size_t(R - 1)] : 1;
  int64_t li = 0;
  for (const Chunk& c : chunk_layout(full.shape[2], P, r, layout)) {
    for (int64_t a = 0; a < A; ++a)
      for (int64_t b = 0; b < Bx; ++b)
        for (int64_t i = 0; i < c.length; ++i)
          for (int64_t e = 0; e < W; ++e) {
            F* g = full.data + a * full.strides[0] + b * full.strides[1] + (c.begin + i) * full.strides[2];
            F* l = local.data + a * local.strides[0] + b * local.strides[1] + (li + i) * local.strides[2];
            if constexpr (R == 4) {
              g += e * full.strides[3];
              l += e * local.strides[3];
            }
            if (to_local) *l = *g;
            else *g = *l;
          }
    li += c.length;
  }
}

// From `from` to `to`: full -> shard when to_local, else shard -> full.
template <int R>
void transfer(const char* fn, const View<const float, R>& from, const View<float, R>& to, bool to_local, int P, int r,
              Layout layout) {
  const View<float, R> src(const_cast<float*>(from.data), from.shape, from.strides);  // only read
  const View<float, R>& full = to_local ? src : to;
  const View<float, R>& local = to_local ? to : src;
  check_shard_shapes(fn, full, local, P, r, layout);
  copy_rows<float, R>(full, local, P, r, layout, to_local);
}

}  // namespace

void shard(View4<const float> full, View4<float> local, int P, int r, Layout layout) {
  transfer<4>("shard", full, local, true, P, r, layout);
}
void unshard(View4<const float> local, View4<float> full, int P, int r, Layout layout) {
  transfer<4>("unshard", local, full, false, P, r, layout);
}
void shard(View3<const float> full, View3<float> local, int P, int r, Layout layout) {
  transfer<3>("shard", full, local, true, P, r, layout);
}
void unshard(View3<const float> local, View3<float> full, int P, int r, Layout layout) {
  transfer<3>("unshard", local, full, false, P, r, layout);
}

namespace detail {

int64_t local_key_length(const std::vector<Chunk>& chunks, int64_t first, int64_t count, int64_t n) {
  int64_t s = 0;
  for (int64_t c = first; c < first + count; ++c)
    s += std::clamp<int64_t>(n - chunks[size_t(c)].begin, 0, chunks[size_t(c)].length);
  return s;
}

void sink_gradient(MPI_Comm comm, const Geometry& g, View4<const float> dout, View4<const float> out,
                   View3<const float> lse, View1<float> dsinks) {
  std::vector<double> mine(size_t(g.H), 0.0), all(size_t(g.H) * size_t(g.P));
  for (int64_t h = 0; h < g.H; ++h) {
    const double sink = g.operands().sinks(h);
    for (int64_t b = 0; sink != -INFINITY && b < g.B; ++b)
      for (int64_t i = 0; i < out.shape[2]; ++i) {
        double D = 0;  // D_i = dY_i · Y_i
        for (int64_t e = 0; e < g.Ev; ++e) D += double(dout(b, h, i, e)) * double(out(b, h, i, e));
        mine[size_t(h)] -= std::exp(sink - double(lse(b, h, i))) * D;  // the sink's weight times (0 − D_i)
      }
  }
  allgather(mine.data(), int(g.H), MPI_DOUBLE, all.data(), comm, g.bound, "the other ranks' sinks gradients");
  for (int64_t h = 0; h < g.H; ++h) {
    double acc = 0;
    for (int p = 0; p < g.P; ++p) acc += all[size_t(p) * size_t(g.H) + size_t(h)];
    dsinks(h) = float(acc);
  }
}

void pack(View4<const float> v, int64_t h0, int64_t nh, int64_t i0, int64_t n, float* dst) {
  const int64_t F = v.shape[3];
  for (int64_t b = 0; b < v.shape[0]; ++b)
    for (int64_t h = h0; h < h0 + nh; ++h)
      for (int64_t i = i0; i < i0 + n; ++i) {
        const float* s = &v(b, h, i, 0);
        if (v.strides[3] == 1) std::memcpy(dst, s, size_t(F) * sizeof(float));
        else
          for (int64_t e = 0; e < F; ++e) dst[e] = s[e * v.strides[3]];
        dst += F;
      }
}
void unpack(const float* src, View4<float> v, int64_t h0, int64_t nh, int64_t i0, int64_t n) {
  const int64_t F = v.shape[3];
  for (int64_t b = 0; b < v.shape[0]; ++b)
    for (int64_t h = h0; h < h0 + nh; ++h)
      for (int64_t i = i0; i < i0 + n; ++i) {
        float* d = &v(b, h, i, 0);
        for (int64_t e = 0; e < F; ++e) d[e * v.strides[3]] = src[e];
        src += F;
      }
}
void pack(View3<const float> v, int64_t h0, int64_t nh, int64_t i0, int64_t n, float* dst) {
  for (int64_t b = 0; b < v.shape[0]; ++b)
    for (int64_t h = h0; h < h0 + nh; ++h)
      for (int64_t i = i0; i < i0 + n; ++i) *dst++ = v(b, h, i);
}
void unpack(const float* src, View3<float> v, int64_t h0, int64_t nh, int64_t i0, int64_t n) {
  for (int64_t b = 0; b < v.shape[0]; ++b)
    for (int64_t h = h0; h < h0 + nh; ++h)
      for (int64_t i = i0; i < i0 + n; ++i) v(b, h, i) = *src++;
}

constexpr int64_t kMaxMessage = int64_t(1) << 30;

void isend(const float* buf, int64_t n, int dest, int tag, MPI_Comm comm, std::vector<MPI_Request>& reqs) {
  for (int64_t off = 0, piece = 0; off < n || (n == 0 && piece == 0); off += kMaxMessage, ++piece) {
    reqs.emplace_back();
    MPI_Isend(buf + off, int(std::min(kMaxMessage, n - off)), MPI_FLOAT, dest, tag + int(piece), comm, &reqs.back());
  }
}
void irecv(float* buf, int64_t n, int src, int tag, MPI_Comm comm, std::vector<MPI_Request>& reqs) {
  for (int64_t off = 0, piece = 0; off < n || (n == 0 && piece == 0); off += kMaxMessage, ++piece) {
    reqs.emplace_back();
    MPI_Irecv(buf + off, int(std::min(kMaxMessage, n - off)), MPI_FLOAT, src, tag + int(piece), comm, &reqs.back());
  }
}
void progress(std::vector<MPI_Request>& reqs) {
  int done = 0;
  if (!reqs.empty()) MPI_Testall(int(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
}

Bound bound_of(MPI_Comm comm, const std::string& fn, const DistOptions& opt, std::string* error) {
  Bound b{comm, fn, kDefaultTimeout};
  std::string bad;
  if (opt.timeout_s) {
    if (*opt.timeout_s > 0) b.seconds = *opt.timeout_s;  // NaN and <= 0 fail
    else bad = (std::ostringstream() << "option 'timeout_s' is " << *opt.timeout_s).str() +
               ", expected seconds > 0 (inf: no bound)";
  } else if (const char* env = std::getenv("ATTN_DIST_TIMEOUT"); env && *env) {
    char* end = nullptr;
    const double x = std::strtod(env, &end);
    if (*end == '\0' && x > 0) b.seconds = x;
    else bad = std::string("the environment variable ATTN_DIST_TIMEOUT is '") + env +
               "', expected seconds > 0 (inf: no bound)";
  }
  if (error) *error = bad;
  return b;
}

double wait(std::vector<MPI_Request>& reqs, const Bound& b, const std::string& what) {
  const double t0 = MPI_Wtime();
  int done = reqs.empty();
  // Test (MPI progresses the transfers inside its calls): spinning for the
  // first 10 ms, as MPI_Waitall would, then yielding the core, and after a
  // second sleeping, so a stuck peer costs no CPU.
  while (!done) {
    MPI_Testall(int(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (done) break;
    const double waited = MPI_Wtime() - t0;
    if (waited > b.seconds) {
      int rank = 0;
      MPI_Comm_rank(b.comm, &rank);
      std::fprintf(stderr,
                   "error: %s: rank %d waited %.0f s for %s; another rank died or stopped calling. "
                   "Aborting the job (exit %d). The bound is DistOptions::timeout_s, or ATTN_DIST_TIMEOUT "
                   "seconds; it is %g s.\n",
                   b.fn.c_str(), rank, waited, what.c_str(), kTimeoutExitCode, b.seconds);
      std::fflush(stderr);
      MPI_Abort(b.comm, kTimeoutExitCode);
      std::abort();  // MPI_Abort does not return
    }
    if (waited > 1.0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    else if (waited > 0.01) std::this_thread::yield();
  }
  reqs.clear();
  return MPI_Wtime() - t0;
}

void allgather(const void* mine, int count, MPI_Datatype type, void* all, MPI_Comm comm, const Bound& b,
               const std::string& what) {
  std::vector<MPI_Request> req(1);
  MPI_Iallgather(mine, count, type, all, count, type, comm, &req[0]);
  wait(req, b, what);
}

int first_failed(MPI_Comm comm, bool failed, const Bound& b, const std::string& what) {
  int rank = 0, P = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &P);
  const int mine = failed ? rank : P;
  int first = P;
  std::vector<MPI_Request> req(1);
  MPI_Iallreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm, &req[0]);
  wait(req, b, what);
  return first == P ? -1 : first;
}

SdpaOptions block_options(const Geometry& g, const DistOptions& opt) {
  SdpaOptions o = opt.sdpa;
  o.scale = g.scale;
  o.backend = Backend::fused;
  o.check_finite = false;  // checked once, before the first message
  o.num_threads = g.threads;
  return o;
}

namespace {

// Position offsets beyond this are refused, as by the single-process call.
constexpr int64_t kMaxOffset = int64_t(1) << 52;

// The local checks of one rank run on the boundary's Checker; its verdict()
// keeps the first problem found instead of throwing, so that the ranks can
// agree on it first. Views of a shard differ from the single-process call's
// in one way: a rank that holds no rows passes a shape with a zero axis and
// may pass no data.
using attn::detail::Checker;

// A required view of this rank's shard.
template <class T, int R>
void require_shard(const Checker& c, const View<T, R>& v, const char* name) {
  if (v.data == nullptr && v.numel() > 0) c.fail(std::string("argument '") + name + "' has no data (null pointer)");
  if (v.data == nullptr && v.shape == std::array<int64_t, R>{})
    c.fail(std::string("argument '") + name + "' is required but was not given");
}

// An output of this rank: strides >= 0, distinct elements at distinct addresses.
template <class T, int R>
void output_shard(const Checker& c, const View<T, R>& v, const char* name) {
  c.sizes(v, name);
  c.writable(v, name);
}

// An exact shape, `text` naming its axes.
template <class T, int R>
void shard_shape(const Checker& c, const View<T, R>& v, const char* name, const std::array<int64_t, R>& want,
                 const char* text) {
  c.shape(v, name, want, shape_str(want) + " " + text);
}

// No NaN or Inf.
template <class T, int R>
void all_finite(const Checker& c, const View<T, R>& v, const char* name, const char* why = " (option check_finite)") {
  bool bad = false;
  attn::detail::for_each(v, [&](T x, const std::array<int64_t, R>&) { bad = bad || !std::isfinite(x); });
  if (bad) c.fail(std::string("argument '") + name + "' contains NaN or Inf" + why);
}

// Throws on every rank when any rank's string is non-empty.
void agree(const Geometry& g, const Checker& c, const std::string& err) {
  const int first_bad = first_failed(g.bound.comm, !err.empty(), g.bound, "the other ranks to check their arguments");
  if (first_bad < 0) return;
  if (!err.empty()) throw InvalidArgument(err + (g.P > 1 ? " (on rank " + std::to_string(g.r) + ")" : ""));
  c.fail("rank " + std::to_string(first_bad) + " rejected its arguments (its message names the problem)");
}

// The calls, by Op.
constexpr const char* kCallNames[] = {"ring_attention", "ring_attention_backward", "ulysses_attention",
                                      "ulysses_attention_backward"};

// MPI initialised and a communicator given (checked alone: without them no
// rank can be told).
void check_communicator(const Checker& c, MPI_Comm comm) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) c.fail("MPI is not initialised (call MPI_Init first) or already finalised");
  if (comm == MPI_COMM_NULL) c.fail("argument 'comm' is MPI_COMM_NULL");
}

// Round 1 of validate(): this rank's own views and options; fills the
// sizes of g that the views give.
void check_local(const Checker& c, const Request& req, Geometry& g, bool ring, bool backward,
                 const std::string& bound_error) {
  const SdpaArgs<float>& a = *req.args;
  const DistOptions& opt = *req.opt;
  if (!bound_error.empty()) c.fail(bound_error);
  require_shard(c, a.q, "q");
  require_shard(c, a.k, "k");
  require_shard(c, a.v, "v");
  g.B = a.q.shape[0], g.H = a.q.shape[1], g.E = a.q.shape[3];
  g.Hkv = a.k.shape[1], g.Ev = a.v.shape[3];
  const int64_t Lr = a.q.shape[2], Sr = a.k.shape[2];
  if (g.B < 1 || g.H < 1 || g.E < 1 || Lr < 0)
    c.fail("argument 'q' has shape " + shape_str(a.q.shape) + "; B, H and E must be >= 1 (the local L may be 0)");
  if (a.k.shape[0] != g.B || a.k.shape[3] != g.E || g.Hkv < 1 || g.H % g.Hkv != 0 || Sr < 0)
    c.fail("argument 'k' has shape " + shape_str(a.k.shape) + ", expected (" + std::to_string(g.B) + ", Hkv, S_local, " +
           std::to_string(g.E) + ") with Hkv dividing H = " + std::to_string(g.H));
  if (g.Ev < 1 || a.v.shape != std::array<int64_t, 4>{g.B, g.Hkv, Sr, g.Ev})
    c.fail("argument 'v' has shape " + shape_str(a.v.shape) + ", expected (" + std::to_string(g.B) + ", " +
           std::to_string(g.Hkv) + ", " + std::to_string(Sr) + ", Ev) matching k in B, Hkv and S_local");
  if (!a.mask.empty()) c.fail("argument 'mask' is not supported across processes (use key_lengths or causal)");
  if (!a.bias.empty()) c.fail("argument 'bias' is not supported across processes");
  if (!a.key_lengths.empty() && a.key_lengths.shape[0] != g.B)
    c.fail("argument 'key_lengths' has shape " + shape_str(a.key_lengths.shape) + ", expected (" +
           std::to_string(g.B) + ") (B)");
  if (opt.sdpa.backend == Backend::reference)
    c.fail("option 'backend' is reference; context-parallel attention runs the fused float32 kernel (its backward "
           "takes the global log-sum-exp), use auto or fused");
  // The score rules' operands and options, as the single-process call checks them.
  std::vector<attn::detail::Extent> read;
  (void)attn::detail::check_rules<float>(c, a, opt.sdpa, {g.B, g.H, Lr, Sr}, read);
  if (!ring && (g.H % g.P != 0 || g.Hkv % g.P != 0))
    c.fail("ulysses needs H and Hkv divisible by the number of processes P = " + std::to_string(g.P) + ", got H = " +
           std::to_string(g.H) + ", Hkv = " + std::to_string(g.Hkv) + " (use the ring)");
  if (!backward) {
    if (req.weights) c.fail("output 'weights' is not supported across processes (the L x S matrix never exists)");
    require_shard(c, req.out, "out");
    shard_shape(c, req.out, "out", {g.B, g.H, Lr, g.Ev}, "(B, H, L_local, Ev)");
    output_shard(c, req.out, "out");
    if (given(req.lse)) {
      shard_shape(c, req.lse, "lse", {g.B, g.H, Lr}, "(B, H, L_local)");
      output_shard(c, req.lse, "lse");
    }
  } else {
    const SdpaGrads<float>& gr = *req.grads;
    require_shard(c, req.dout, "dout");
    shard_shape(c, req.dout, "dout", {g.B, g.H, Lr, g.Ev}, "(B, H, L_local, Ev)");
    if (given(req.out)) shard_shape(c, req.out, "out", {g.B, g.H, Lr, g.Ev}, "(B, H, L_local, Ev)");
    if (given(req.lse)) shard_shape(c, req.lse, "lse", {g.B, g.H, Lr}, "(B, H, L_local)");
    require_shard(c, gr.dq, "dq");
    require_shard(c, gr.dk, "dk");
    require_shard(c, gr.dv, "dv");
    shard_shape(c, gr.dq, "dq", {g.B, g.H, Lr, g.E}, "(B, H, L_local, E)");
    shard_shape(c, gr.dk, "dk", {g.B, g.Hkv, Sr, g.E}, "(B, Hkv, S_local, E)");
    shard_shape(c, gr.dv, "dv", {g.B, g.Hkv, Sr, g.Ev}, "(B, Hkv, S_local, Ev)");
    output_shard(c, gr.dq, "dq");
    output_shard(c, gr.dk, "dk");
    output_shard(c, gr.dv, "dv");
    if (!gr.dbias.empty()) c.fail("output 'dbias' is not supported across processes");
    if (given(gr.dsinks)) {
      if (!given(a.sinks)) c.fail("output 'dsinks' was requested but no 'sinks' were given");
      shard_shape(c, gr.dsinks, "dsinks", {g.H}, "(H), the shape of 'sinks'");
      output_shard(c, gr.dsinks, "dsinks");
    }
  }
  if (opt.sdpa.check_finite) {
    all_finite(c, a.q, "q");
    all_finite(c, a.k, "k");
    all_finite(c, a.v, "v");
    if (backward) all_finite(c, req.dout, "dout");
  }
}

}  // namespace

Geometry validate(MPI_Comm comm, const char* fn, const Request& req) {
  const Checker c{std::string("dist::") + fn};
  check_communicator(c, comm);
  Geometry g;
  std::string bound_error;
  g.bound = bound_of(comm, std::string("attn::dist::") + fn, *req.opt, &bound_error);
  MPI_Comm_size(comm, &g.P);
  MPI_Comm_rank(comm, &g.r);
  const SdpaArgs<float>& a = *req.args;
  const DistOptions& opt = *req.opt;
  const bool ring = req.op == Op::ring_forward || req.op == Op::ring_backward;
  const bool backward = req.op == Op::ring_backward || req.op == Op::ulysses_backward;

  // Round 1: this rank's own views and options.
  agree(g, c, c.verdict([&] { check_local(c, req, g, ring, backward, bound_error); }));
  const int64_t Lr = a.q.shape[2], Sr = a.k.shape[2];

  // Round 2: what every rank must share, and the local lengths.
  g.scale = opt.sdpa.scale ? *opt.sdpa.scale : 1.0 / std::sqrt(double(g.E));
  g.threads = opt.sdpa.num_threads > 0 ? opt.sdpa.num_threads : omp_get_max_threads();
  g.saved = backward && given(req.out) && given(req.lse);
  g.lse_given = !backward && given(req.lse);
  g.dsinks = backward && given(req.grads->dsinks);
  // The fields every rank must agree on, with their names: the shapes (the
  // local lengths, fields 0 and 1, are gathered, not compared), the layout,
  // which arguments were given, and every option (option_fingerprint).
  std::vector<std::pair<const char*, int64_t>> fields{{"", Lr}, {"", Sr}, {"the call", int64_t(req.op)},
                                                       {"B", g.B}, {"H", g.H}, {"Hkv", g.Hkv},
                                                       {"E", g.E}, {"Ev", g.Ev}, {"layout", int64_t(opt.layout)},
                                                       {"key_lengths given", int64_t(!a.key_lengths.empty())},
                                                       {"whether the saved out and lse were given", int64_t(g.saved)},
                                                       {"whether an lse output was given", int64_t(g.lse_given)},
                                                       {"whether dsinks was asked for", int64_t(g.dsinks)}};
  for (const auto& op : attn::detail::kPerHeadOperands<float>)
    fields.emplace_back(op.name, int64_t(given(a.*op.member)));  // whether it was given
  for (const auto& f : attn::detail::option_fingerprint(opt.sdpa)) fields.push_back(f);
  const int nf = int(fields.size());
  std::vector<int64_t> mine(static_cast<size_t>(nf)), all(static_cast<size_t>(nf) * size_t(g.P));
  for (int f = 0; f < nf; ++f) mine[size_t(f)] = fields[size_t(f)].second;
  allgather(mine.data(), nf, MPI_INT64_T, all.data(), comm, g.bound, "the other ranks' shapes and options");
  for (int p = 0; p < g.P; ++p) {
    const int64_t* o = &all[size_t(p) * size_t(nf)];
    if (o[2] != all[2])
      c.fail("ranks disagree on the call: rank " + std::to_string(p) + " runs attn::dist::" + kCallNames[o[2]] +
             ", rank 0 attn::dist::" + kCallNames[all[2]] + "; every rank must make the same call");
    for (int f = 3; f < nf; ++f)
      if (o[f] != all[size_t(f)])
        c.fail(std::string("ranks disagree on ") + fields[size_t(f)].first + ": rank " + std::to_string(p) + " has " +
               std::to_string(o[f]) + ", rank 0 " + std::to_string(all[size_t(f)]) +
               "; every rank must pass the same shapes, outputs and options");
    g.Lr.push_back(o[0]);
    g.Sr.push_back(o[1]);
  }
  for (int p = 0; p < g.P; ++p) g.L += g.Lr[size_t(p)], g.S += g.Sr[size_t(p)];
  for (int p = 0; p < g.P; ++p) {
    g.qc.push_back(chunk_layout(g.L, g.P, p, opt.layout));
    g.kc.push_back(chunk_layout(g.S, g.P, p, opt.layout));
    const int64_t wl = shard_length(g.L, g.P, p, opt.layout), ws = shard_length(g.S, g.P, p, opt.layout);
    if (g.Lr[size_t(p)] != wl || g.Sr[size_t(p)] != ws)
      c.fail("rank " + std::to_string(p) + " holds " + std::to_string(g.Lr[size_t(p)]) + " queries and " +
             std::to_string(g.Sr[size_t(p)]) + " keys; the " + layout_name(opt.layout) + " layout of L = " +
             std::to_string(g.L) + ", S = " + std::to_string(g.S) + " over " + std::to_string(g.P) +
             " ranks gives it " + std::to_string(wl) + " and " + std::to_string(ws) + " (see attn::dist::shard)");
  }
  if (g.L < 1 || g.S < 1)
    c.fail("the global lengths are L = " + std::to_string(g.L) + ", S = " + std::to_string(g.S) +
           ", expected both >= 1");
  // Block offsets add chunk starts to the global offset; they must stay in the kernel's range.
  if (opt.sdpa.position_offset && std::abs(*opt.sdpa.position_offset) > kMaxOffset - g.L - g.S)
    c.fail("option 'position_offset' is " + std::to_string(*opt.sdpa.position_offset) +
           ", expected |offset| <= 2^52 - L - S = " + std::to_string(kMaxOffset - g.L - g.S) +
           " (the blocks' offsets add chunk starts)");
  // The position rule, resolved once on the global lengths (as the single-process call does).
  g.offset = attn::detail::dense_offset(opt.sdpa, g.L, g.S);
  const int64_t reach = g.L + g.S + std::abs(g.offset);  // a window side this long sees every key
  g.window_left = opt.sdpa.window.left >= reach ? -1 : opt.sdpa.window.left;
  g.window_right = opt.sdpa.window.right >= reach ? -1 : opt.sdpa.window.right;
  if (opt.sdpa.causal) g.window_right = 0;  // causal is the window's right side 0 (the tighter of the two)
  g.chunk = opt.sdpa.chunk_size;
  g.positional = g.window_left >= 0 || g.window_right >= 0 || g.chunk > 0 || attn::detail::operands_read_positions(a);
  // Per-head values must agree bit for bit.
  g.per_head.assign(attn::detail::kPerHeadOperands<float>.size(), {});
  for (size_t i = 0; i < g.per_head.size(); ++i) {
    const auto& op = attn::detail::kPerHeadOperands<float>[i];
    const View1<const float>& view = a.*op.member;
    if (!given(view)) continue;
    std::vector<float> mine_h(size_t(g.H)), all_h(size_t(g.H) * size_t(g.P));
    for (int64_t h = 0; h < g.H; ++h) mine_h[size_t(h)] = view(h);
    allgather(mine_h.data(), int(g.H), MPI_FLOAT, all_h.data(), comm, g.bound, std::string("the other ranks' ") + op.name);
    for (int p = 1; p < g.P; ++p)
      if (std::memcmp(&all_h[size_t(p) * size_t(g.H)], all_h.data(), size_t(g.H) * sizeof(float)) != 0)
        c.fail(std::string("ranks disagree on ") + op.name + " (rank " + std::to_string(p) +
               " differs from rank 0); pass the same values everywhere");
    g.per_head[i] = mine_h;
  }
  if (!a.key_lengths.empty()) {
    std::vector<int64_t> kl(size_t(g.B)), klall(size_t(g.B) * size_t(g.P));
    for (int64_t b = 0; b < g.B; ++b) kl[size_t(b)] = a.key_lengths(b);
    allgather(kl.data(), int(g.B), MPI_INT64_T, klall.data(), comm, g.bound, "the other ranks' key_lengths");
    for (int p = 0; p < g.P; ++p)
      for (int64_t b = 0; b < g.B; ++b)
        if (klall[size_t(p * g.B + b)] != klall[size_t(b)])
          c.fail("ranks disagree on key_lengths[" + std::to_string(b) + "] (rank " + std::to_string(p) +
                 " differs from rank 0); pass the global lengths everywhere");
    for (int64_t b = 0; b < g.B; ++b)
      if (kl[size_t(b)] < 0 || kl[size_t(b)] > g.S)
        c.fail("argument 'key_lengths' has value " + std::to_string(kl[size_t(b)]) + " at batch " +
               std::to_string(b) + ", expected 0 <= key_lengths[b] <= S = " + std::to_string(g.S) + " (global)");
    g.key_lengths = kl;
  }
  return g;
}

}  // namespace detail

int first_failed_rank(MPI_Comm comm, bool failed, const DistOptions& opt, const std::string& caller) {
  const attn::detail::Checker c{"dist::first_failed_rank"};
  detail::check_communicator(c, comm);
  std::string error;
  const detail::Bound b = detail::bound_of(comm, caller, opt, &error);
  if (!error.empty()) c.fail(error);
  return detail::first_failed(comm, failed, b, "the other ranks to check their arguments");
}

}  // namespace attn::dist
