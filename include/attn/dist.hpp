// attn/dist.hpp — context-parallel attention over MPI (component attn::dist).
//
// The sequence is split over the P processes of an MPI communicator; every
// rank holds a shard of the queries and a shard of the keys/values and gets
// the output rows of its own queries. Two strategies:
//
//   ring     The K/V shards travel around the ring of ranks (P − 1 steps,
//            each overlapping the transfer of the next shard with the
//            attention on the current one); each rank merges the partial
//            results of its queries by log-sum-exp. The backward sends the
//            K/V shards around again with their dK/dV accumulators, which
//            arrive back at their owner after P steps; dQ stays local.
//   ulysses  An all-to-all turns the sequence split into a head split: each
//            rank attends the whole sequence for H / P query heads (and
//            Hkv / P key/value heads) with the ordinary single-process call,
//            then a second all-to-all returns the output rows. Needs H and
//            Hkv divisible by P.
//
// Shards. A sequence of length N is cut into C chunks of near-equal length
// (the first N mod C chunks one longer); chunk_layout() says which chunks a
// rank holds, in increasing order, stored one after the other along the
// sequence axis of its local views:
//   contiguous  C = P, rank r holds chunk r.
//   zigzag      C = 2P, rank r holds chunks r and 2P − 1 − r. Under the
//               causal mask every rank then has the same amount of work
//               (a contiguous split gives the last rank P times the first's).
// Queries and keys are split by the same layout, each by its own length.
// shard() and unshard() copy between a full tensor and a rank's shard.
//
// Arguments are the local shards, shaped like the single-process call's
// (attn/sdpa.hpp) with L and S replaced by the local lengths:
//   q (B, H, L_r, E)  k (B, Hkv, S_r, E)  v (B, Hkv, S_r, Ev)
//   outputs / saved: out (B, H, L_r, Ev), lse (B, H, L_r)
// key_lengths (B) holds GLOBAL lengths (every rank passes the same values),
// and so do the per-head operands (H) of ScoreArgs; dsinks (H) receives the
// whole gradient on every rank.
// Supported: every option of SdpaOptions (causal of either alignment with
// L ≠ S; window, chunk_size and position_offset in global positions: query
// row i of the whole sequence sits at key position i + offset; num_threads
// per rank), the per-head operands (and dsinks), key_lengths, GQA, E ≠ Ev.
// The ring skips the blocks outside the band. Not supported (a clear
// attn::Error): mask, bias, dbias, attention weights, and float64 (the
// backward needs the fused float32 kernel).
//
// Every rank must make the same call (strategy, forward or backward) with
// the same global shapes, outputs and options. Before the first message the
// ranks validate their arguments, share the verdict and then exchange
// everything a message's size depends on (the call, B, H, Hkv, E, Ev, the
// layout, which optional arguments and outputs were given, every option,
// per-head values, key lengths): a rank with bad arguments, or ranks that
// disagree, make every rank throw attn::InvalidArgument naming the
// difference, instead of leaving the others waiting.
//
// Bounded wait. A rank that dies or stops calling cannot be told apart from
// a slow one, so every wait for another rank (each collective of the
// validation, each step's transfers) is bounded: past DistOptions::timeout_s
// seconds (default: the environment variable ATTN_DIST_TIMEOUT, else 600)
// the waiting rank prints a message naming the call, the wait and the bound
// to stderr and aborts the job with MPI_Abort(comm, kTimeoutExitCode), since
// a collective that never completes can neither be cancelled nor left
// behind. Results differ from the single-process call only by float32
// rounding, and are bitwise reproducible for a fixed P, layout and thread
// count.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"

namespace attn::dist {

enum class Layout { contiguous, zigzag };
const char* layout_name(Layout l);  // "contiguous", "zigzag"

// One chunk of a rank's shard: global rows [begin, begin + length).
struct Chunk {
  int64_t index = 0, begin = 0, length = 0;
};
// The chunks rank r of P holds of a length-n sequence, in increasing order.
std::vector<Chunk> chunk_layout(int64_t n, int P, int r, Layout layout);
// The local length of rank r's shard (the sum of its chunks' lengths).
int64_t shard_length(int64_t n, int P, int r, Layout layout);

// Copies rank r's rows of `full` (B, H, n, F) into `local` (B, H, shard, F),
// and back. Throws attn::Error on shape mismatches.
void shard(View4<const float> full, View4<float> local, int P, int r, Layout layout);
void unshard(View4<const float> local, View4<float> full, int P, int r, Layout layout);
// The same for per-row statistics (B, H, n), e.g. the log-sum-exp.
void shard(View3<const float> full, View3<float> local, int P, int r, Layout layout);
void unshard(View3<const float> local, View3<float> full, int P, int r, Layout layout);

struct DistOptions {
  SdpaOptions sdpa;  // scale, causal, num_threads (per rank); backend must be auto or fused
  Layout layout = Layout::zigzag;
  // The bounded wait in seconds (> 0; infinity: none). Not set: the
  // environment variable ATTN_DIST_TIMEOUT, else kDefaultTimeout. Each rank
  // applies its own; it need not agree.
  std::optional<double> timeout_s;
};
inline constexpr double kDefaultTimeout = 600;
// The status MPI_Abort gives the job when a wait runs out (mpirun exits with it).
inline constexpr int kTimeoutExitCode = 8;

// For front ends with checks of their own before a call (a binding's dtypes,
// the files a command reads): every rank of comm calls it, saying whether it
// failed; returns the lowest failing rank, or -1 when none failed, on every
// rank, within the bounded wait of `opt` (whose message names `caller`).
int first_failed_rank(MPI_Comm comm, bool failed, const DistOptions& opt = {},
                      const std::string& caller = "attn::dist::first_failed_rank");

// Where a ring call spent its time on this rank (optional output).
struct RingStats {
  double compute_s = 0;  // attention on the blocks (and the merges / sums)
  double wait_s = 0;     // waiting for transfers not hidden behind the compute
  double total_s = 0;    // the whole call
  int64_t bytes_sent = 0;
  int steps = 0;
  int64_t blocks = 0;    // kernel calls on blocks (those outside the causal/window band are skipped)
};

// Ring attention, forward: writes outputs.out (and outputs.lse when given)
// for the local queries; outputs.weights must be empty (L×S never exists).
void ring_attention(MPI_Comm comm, const SdpaArgs<float>& args, const SdpaOutputs<float>& outputs,
                    const DistOptions& opt = {}, RingStats* stats = nullptr);
// Ring attention, backward: `saved` is the forward's out and lse for the
// local queries (recomputed by a forward ring when not given; every rank must
// give it or none); writes the local dq, dk, dv (overwritten, not
// accumulated). dbias is not supported.
void ring_attention_backward(MPI_Comm comm, const SdpaArgs<float>& args, View4<const float> dout,
                             const SdpaSaved<float>& saved, const SdpaGrads<float>& grads,
                             const DistOptions& opt = {}, RingStats* stats = nullptr);

// All-to-all (Ulysses) attention, forward and backward, same arguments.
void ulysses_attention(MPI_Comm comm, const SdpaArgs<float>& args, const SdpaOutputs<float>& outputs,
                       const DistOptions& opt = {});
void ulysses_attention_backward(MPI_Comm comm, const SdpaArgs<float>& args, View4<const float> dout,
                                const SdpaSaved<float>& saved, const SdpaGrads<float>& grads,
                                const DistOptions& opt = {});

}  // namespace attn::dist
