// Internal pieces shared by the ring and the all-to-all strategies: the
// agreed validation of the arguments across ranks, and row packing between
// strided views and contiguous message buffers.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "attn/dist.hpp"
#include "kernels/score_rules.hpp"

namespace attn::dist::detail {

// The bounded wait of one call (attn/dist.hpp): `fn` names the call in the
// message ("attn::dist::ring_attention"), `comm` is the caller's
// communicator (the one MPI_Abort ends).
struct Bound {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string fn;
  double seconds = kDefaultTimeout;
};
// The bound of a call: opt.timeout_s, else ATTN_DIST_TIMEOUT, else the
// default; an invalid value leaves the default and sets *error (checked with
// the arguments).
Bound bound_of(MPI_Comm comm, const std::string& fn, const DistOptions& opt, std::string* error);
// Waits for all of reqs and clears the list; returns the seconds spent
// waiting. Past b.seconds it prints what it waited for (`what`) and aborts.
double wait(std::vector<MPI_Request>& reqs, const Bound& b, const std::string& what);
// The collectives of the dist calls, each within the bound.
void allgather(const void* mine, int count, MPI_Datatype type, void* all, MPI_Comm comm, const Bound& b,
               const std::string& what);
// The lowest rank of comm with `failed` set, or -1.
int first_failed(MPI_Comm comm, bool failed, const Bound& b, const std::string& what);

// Everything every rank knows after validation: the global problem and the
// chunks each rank holds of the queries and of the keys.
struct Geometry {
  Bound bound;
  int P = 1, r = 0;
  int64_t B = 0, H = 0, Hkv = 0, E = 0, Ev = 0;
  int64_t L = 0, S = 0;                      // global lengths
  std::vector<std::vector<Chunk>> qc, kc;    // [rank] -> chunks
  std::vector<int64_t> Lr, Sr;               // [rank] -> local lengths
  std::vector<int64_t> key_lengths;          // global, empty when not given
  // The position rule (kernels/score_rules.hpp) of the whole problem: query
  // row i of the global sequence sits at key position i + offset. `positional`
  // when a rule reads positions (causal, a window side, chunks, per-head
  // slopes); otherwise every visible key is visible to every query and
  // blocks need no offsets.
  int64_t offset = 0;
  int64_t window_left = -1, window_right = -1;  // clamped: a side >= L + S + |offset| is unbounded
  int64_t chunk = 0;                            // chunk_size (0: none)
  bool positional = false;
  // The per-head operands (kPerHeadOperands' order), agreed by every rank;
  // empty when not given.
  std::vector<std::vector<float>> per_head;
  bool dsinks = false;                       // backward: the sinks' gradient was asked for
  double scale = 1.0;
  int threads = 0;
  bool saved = false;                        // backward: the forward's out and lse were given
  bool lse_given = false;                    // forward: an lse output was given

  int64_t group() const { return H / Hkv; }
  // The per-head operands as ScoreArgs (views of per_head).
  ScoreArgs<float> operands() const {
    ScoreArgs<float> a;
    for (size_t i = 0; i < per_head.size(); ++i)
      if (!per_head[i].empty())
        a.*attn::detail::kPerHeadOperands<float>[i].member = View1<const float>(per_head[i].data(), {H});
    return a;
  }
};

enum class Op { ring_forward, ring_backward, ulysses_forward, ulysses_backward };

// What one call hands to validation (the outputs it will write).
struct Request {
  Op op;
  const SdpaArgs<float>* args;
  const DistOptions* opt;
  View4<const float> out;   // forward: the output; backward: the saved out (optional)
  View3<const float> lse;   // optional
  bool weights = false;     // forward: attention weights were asked for (refused)
  View4<const float> dout{};  // backward only
  const SdpaGrads<float>* grads = nullptr;
};

// Whether an optional view was given: data, or a shape with no elements
// (the shard of a rank that holds no rows may have no data pointer).
template <class T, int R>
bool given(const View<T, R>& v) {
  return v.data != nullptr || (v.numel() == 0 && v.shape != std::array<int64_t, R>{});
}

// Validates on every rank and agrees on the verdict; throws attn::Error on
// every rank when any rank's arguments are bad (so no rank is left waiting).
Geometry validate(MPI_Comm comm, const char* fn, const Request& req);

// Number of keys of chunks [first, first + count) of a chunk list with
// global position < n: key padding restricted to consecutive chunks of a
// shard, which stays a prefix of their rows because chunks are stored in
// increasing order.
int64_t local_key_length(const std::vector<Chunk>& chunks, int64_t first, int64_t count, int64_t n);

// The ring's sinks gradient: d(sink_h) = −Σ_{b,i} exp(sink_h − lse_i)·D_i,
// D_i = Σ_e dY_ie·Y_ie (kernels/score_rules.hpp) over the global rows, from
// the global out and lse of this rank's rows, summed in double over the
// ranks in rank order; the same (H) values are written on every rank.
void sink_gradient(MPI_Comm comm, const Geometry& g, View4<const float> dout, View4<const float> out,
                   View3<const float> lse, View1<float> dsinks);

// Copies heads [h0, h0 + nh) and local rows [i0, i0 + n) of v (B, ·, ·, F)
// into dst as a contiguous (B, nh, n, F) block, and back (overwriting / adding).
void pack(View4<const float> v, int64_t h0, int64_t nh, int64_t i0, int64_t n, float* dst);
void unpack(const float* src, View4<float> v, int64_t h0, int64_t nh, int64_t i0, int64_t n);
void pack(View3<const float> v, int64_t h0, int64_t nh, int64_t i0, int64_t n, float* dst);
void unpack(const float* src, View3<float> v, int64_t h0, int64_t nh, int64_t i0, int64_t n);

// A sub-view of rows [i0, i0 + n) along the sequence axis (axis 2).
template <class T, int R>
View<T, R> rows(const View<T, R>& v, int64_t i0, int64_t n) {
  View<T, R> s = v;
  s.data = v.data + i0 * v.strides[2];
  s.shape[2] = n;
  return s;
}

// Non-blocking transfers of n floats, split into messages of at most 2^30
// floats (MPI counts are int); tags tag, tag + 1, ... for the pieces.
void isend(const float* buf, int64_t n, int dest, int tag, MPI_Comm comm, std::vector<MPI_Request>& reqs);
void irecv(float* buf, int64_t n, int src, int tag, MPI_Comm comm, std::vector<MPI_Request>& reqs);
// Drives pending transfers forward without waiting (MPI progresses inside its calls).
void progress(std::vector<MPI_Request>& reqs);

// The SDPA options of one block call (the agreed scale, no re-check of finiteness).
SdpaOptions block_options(const Geometry& g, const DistOptions& opt);

// A communicator of our own for the call's messages (freed on scope exit).
class CommDup {
 public:
  CommDup(MPI_Comm c, const Bound& b) {
    std::vector<MPI_Request> req(1);
    MPI_Comm_idup(c, &comm_, &req[0]);
    wait(req, b, "the other ranks to start the call's messages (MPI_Comm_idup)");
  }
  ~CommDup() { MPI_Comm_free(&comm_); }
  CommDup(const CommDup&) = delete;
  CommDup& operator=(const CommDup&) = delete;
  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace attn::dist::detail
