// Ring attention over MPI, forward and backward (attn::dist::ring_attention).
//
// P ranks each hold a shard of the queries and of the keys/values. In P steps
// every key/value shard visits every rank: at step s rank r holds the shard
// of owner o = (r − s) mod P, attends its own queries to it, and meanwhile
// sends that shard to rank r + 1 and receives the next one from rank r − 1
// (non-blocking MPI_Isend / MPI_Irecv into a second buffer, progressed
// between the block calls and completed after them). Each block is one call
// of the single-process fused kernel on strided views of the shard, with its
// log-sum-exp; the partials of a query row are merged by attn::merge_attention
// in step order, so the result does not depend on timing.
//
// Positions on shards. A shard is a list of chunks of the global sequence
// (attn/dist.hpp), stored in increasing order. The dense call's one position
// rule (kernels/score_rules.hpp: query row i sits at key position
// i + offset) carries over block by block: a block of query chunk qc
// (global rows from qb) against key chunk kc (global keys from kb) is a
// call with position_offset = offset + qb − kb whose keys start at global
// position kb (detail::block_attention: chunk boundaries are global
// positions), so causal of either alignment, windows, chunks, per-head
// slopes and L ≠ S need nothing else. For each pair the
// global band classifies the block (Band::classify, in O(rows)): empty
// blocks (entirely outside the causal/window band, or past every key
// length) are skipped, their shard still forwarded; consecutive key chunks
// of a shard join one call when they are adjacent in the global sequence
// (one offset fits both) or when both are fully visible and no per-head
// slope reads their positions (a plain call). When no rule reads positions
// at all (no causal, window, chunks or slopes) every step is one call for
// all local rows. The per-score rules apply inside every block. A query chunk
// that no block reaches sees no key: output 0, lse −inf. The sinks join
// each row's denominator once, after the last step: a merge with a part of
// output 0 and lse = sink_h. Key padding restricted to consecutive chunks of
// a shard stays a suffix of their rows (Σ clamp(key_len − chunk start, 0,
// chunk length)). The zig-zag layout (rank r holds chunks r and 2P − 1 − r)
// gives every rank the same causal work.
//
// Backward. The saved global out and lse of the local queries are what the
// fused backward needs per block: it recomputes P = exp(S − lse), which with
// the global lse is the global softmax restricted to the block, and uses
// D = rowsum(dY ∘ Y) of the global output. So each block's dQ (added locally
// in step order) and dK/dV are exact pieces of the global gradients. The
// dK/dV of a shard travel with it: at each step the holder adds its block's
// contribution to the accumulator that came with the shard and sends it on;
// after P steps it arrives back at its owner, summed in the fixed order
// o, o + 1, …, o + P − 1. The blocks do not see the sinks (the global lse
// already holds them); their gradient is summed from each rank's rows and
// gathered (detail::sink_gradient). Results are bitwise reproducible for a fixed P,
// layout and thread count.
//
// Traffic per step: one shard of K and V, B·Hkv·(S/P)·(E + Ev) floats, in the
// forward; that and the same again for dK/dV in the backward. Memory per
// rank: two K/V buffers (and three dK/dV accumulators in the backward) of
// one shard each, plus one block's output.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "attn/merge.hpp"
#include "dist/internal.hpp"
#include "validate.hpp"
#include "kernels/score_rules.hpp"

namespace attn::dist {
namespace {

using detail::Geometry;
using detail::rows;
using detail::isend;
using detail::irecv;
using detail::progress;
using detail::wait;

constexpr int kTagKV = 100, kTagGrad = 200;
// What a wait at step s (0-based) of the ring waits for (the bounded wait's
// message): rank `peer` and `what` of it.
std::string step(int s, int peer, const char* what) {
  return "rank " + std::to_string(peer) + what + " at step " + std::to_string(s + 1) + " of the ring";
}
// A shard of K and V (or dK and dV) in one contiguous buffer: K (B, Hkv, S_o, E) then V.
int64_t shard_floats(const Geometry& g, int o) { return g.B * g.Hkv * g.Sr[size_t(o)] * (g.E + g.Ev); }
View4<float> shard_k(const Geometry& g, int o, float* buf) {
  return View4<float>(buf, {g.B, g.Hkv, g.Sr[size_t(o)], g.E});
}
View4<float> shard_v(const Geometry& g, int o, float* buf) {
  return View4<float>(buf + g.B * g.Hkv * g.Sr[size_t(o)] * g.E, {g.B, g.Hkv, g.Sr[size_t(o)], g.Ev});
}
int64_t max_shard_floats(const Geometry& g) {
  int64_t m = 0;
  for (int o = 0; o < g.P; ++o) m = std::max(m, shard_floats(g, o));
  return m;
}

// One block call: local query rows [i0, i0 + n) against keys [s0, s0 + s)
// of owner o's shard, which are its chunks [first, first + count).
// `positional`: the call applies the position rules with query row 0 of the
// block at key position `offset` of the block; otherwise every key of the
// block is visible to every row as far as positions go (a plain call).
struct Task {
  int64_t i0 = 0, n = 0, s0 = 0, s = 0, first = 0, count = 0;
  bool positional = false, contiguous = true;  // contiguous: the chunks are adjacent in the global sequence
  int64_t offset = 0;
  int64_t key_origin = 0;  // global position of the block's first key (chunk boundaries are global)
};

// The block calls of this rank against owner o's shard, in a fixed order
// (the shape decides them, never the timing or the threads).
std::vector<Task> tasks(const Geometry& g, int o) {
  std::vector<Task> t;
  const auto& kcs = g.kc[size_t(o)];
  if (!g.positional) {  // no rule reads positions: one call for all local rows
    if (g.Lr[size_t(g.r)] > 0 && g.Sr[size_t(o)] > 0)
      t.push_back({0, g.Lr[size_t(g.r)], 0, g.Sr[size_t(o)], 0, int64_t(kcs.size()), false, false, 0});
    return t;
  }
  int64_t key_end = g.S;  // keys at or past the longest key length are masked everywhere
  if (!g.key_lengths.empty()) key_end = *std::max_element(g.key_lengths.begin(), g.key_lengths.end());
  const bool reads_positions = attn::detail::operands_read_positions(g.operands());
  // The global band: rows and keys in global positions.
  namespace rules = attn::detail::rules;
  rules::Band band;
  band.offset = g.offset, band.left = g.window_left, band.right = g.window_right, band.key_end = g.S;
  band.chunk = g.chunk;
  int64_t i0 = 0;
  for (const Chunk& qc : g.qc[size_t(g.r)]) {
    int64_t s0 = 0;
    bool open = false;  // whether t.back() may take the next chunk
    for (size_t ci = 0; ci < kcs.size(); ++ci) {
      const Chunk& kc = kcs[ci];
      using rules::Tile;
      const Tile tile = qc.length == 0 || kc.length == 0 || kc.begin >= key_end
                            ? Tile::empty
                            : band.classify(qc.begin, qc.length, kc.begin, kc.length);
      if (tile == Tile::empty) {
        open = false;
      } else {
        const bool plain = tile == Tile::full && !reads_positions;
        Task* last = open ? &t.back() : nullptr;
        const Chunk* prev = last ? &kcs[ci - 1] : nullptr;
        const bool adjacent = prev && prev->begin + prev->length == kc.begin;
        if (last && ((last->contiguous && adjacent) || (!last->positional && plain))) {
          // Joins the previous call: globally adjacent keys keep one offset;
          // fully visible keys need none.
          last->s += kc.length;
          ++last->count;
          last->contiguous = last->contiguous && adjacent;
          last->positional = last->positional || !plain;
        } else {
          t.push_back({i0, qc.length, s0, kc.length, int64_t(ci), 1, !plain, true, g.offset + qc.begin - kc.begin,
                       kc.begin});
        }
        open = true;
      }
      s0 += kc.length;
    }
    i0 += qc.length;
  }
  return t;
}

// The row groups the tasks write whole: every local row (a plain ring), or
// each query chunk; (first row, rows).
std::vector<std::pair<int64_t, int64_t>> row_groups(const Geometry& g) {
  if (!g.positional) return {{0, g.Lr[size_t(g.r)]}};
  std::vector<std::pair<int64_t, int64_t>> v;
  int64_t i0 = 0;
  for (const Chunk& qc : g.qc[size_t(g.r)]) v.emplace_back(i0, qc.length), i0 += qc.length;
  return v;
}

// The arguments of one block call (views into the local queries and owner o's shard).
struct BlockCall {
  SdpaArgs<float> args;
  SdpaOptions opt;
  int64_t key_origin = 0;
  std::vector<int64_t> key_lengths;
};

void make_call(BlockCall& bc, const Geometry& g, const SdpaArgs<float>& local, const SdpaOptions& base, int o,
               float* kv, const Task& t) {
  bc.args = SdpaArgs<float>{};
  bc.args.q = rows(local.q, t.i0, t.n);
  bc.args.k = rows(View4<const float>(shard_k(g, o, kv)), t.s0, t.s);
  bc.args.v = rows(View4<const float>(shard_v(g, o, kv)), t.s0, t.s);
  bc.opt = base;
  bc.opt.causal = false;  // folded into the window (right side 0)
  bc.opt.window = {-1, -1};
  bc.opt.chunk_size = 0;
  bc.opt.position_offset.reset();
  bc.key_origin = 0;
  if (t.positional) {
    bc.opt.window = {g.window_left, g.window_right};
    bc.opt.chunk_size = g.chunk;
    bc.opt.position_offset = t.offset;
    bc.key_origin = t.key_origin;
    static_cast<ScoreArgs<float>&>(bc.args) = g.operands();
    bc.args.sinks = {};  // the sinks join once, after the ring (see the end of ring_attention)
  }
  bc.key_lengths.clear();
  if (!g.key_lengths.empty()) {
    for (int64_t b = 0; b < g.B; ++b)
      bc.key_lengths.push_back(detail::local_key_length(g.kc[size_t(o)], t.first, t.count, g.key_lengths[size_t(b)]));
    bc.args.key_lengths = View1<const int64_t>(bc.key_lengths.data(), {g.B});
  }
}

void pack_shard(const Geometry& g, const SdpaArgs<float>& a, float* buf) {
  detail::pack(a.k, 0, g.Hkv, 0, g.Sr[size_t(g.r)], buf);
  detail::pack(a.v, 0, g.Hkv, 0, g.Sr[size_t(g.r)], buf + g.B * g.Hkv * g.Sr[size_t(g.r)] * g.E);
}

// dst[b, h, j, e] += src[b, h, j, e] (or = with add false) over the views' shape.
void add_into(View4<float> dst, View4<const float> src, bool add = true) {
  for (int64_t b = 0; b < dst.shape[0]; ++b)
    for (int64_t h = 0; h < dst.shape[1]; ++h)
      for (int64_t j = 0; j < dst.shape[2]; ++j) {
        float* d = &dst(b, h, j, 0);
        const float* s = &src(b, h, j, 0);
        for (int64_t e = 0; e < dst.shape[3]; ++e) {
          float& x = d[e * dst.strides[3]];
          x = add ? x + s[e * src.strides[3]] : s[e * src.strides[3]];
        }
      }
}

}  // namespace

void ring_attention(MPI_Comm comm, const SdpaArgs<float>& args, const SdpaOutputs<float>& outputs,
                    const DistOptions& opt, RingStats* stats) {
  const double t_start = MPI_Wtime();
  View4<float> out = outputs.out;
  View3<float> lse = outputs.lse;
  detail::Request req{detail::Op::ring_forward, &args, &opt, out, lse, !outputs.weights.empty()};
  const Geometry g = detail::validate(comm, "ring_attention", req);
  const detail::CommDup dup(comm, g.bound);
  const MPI_Comm c = dup.get();
  const int r = g.r, next = (r + 1) % g.P, prev = (r + g.P - 1) % g.P;
  const int64_t Lr = g.Lr[size_t(r)];
  Tensor<float> lse_own;
  if (lse.empty()) {
    lse_own = Tensor<float>({g.B, g.H, std::max<int64_t>(Lr, 1)});
    lse = View3<float>(lse_own.data(), {g.B, g.H, Lr}, {g.H * std::max<int64_t>(Lr, 1), std::max<int64_t>(Lr, 1), 1});
  }
  const SdpaOptions base = detail::block_options(g, opt);
  const int64_t cap = std::max<int64_t>(max_shard_floats(g), 1);
  std::vector<float> cur(static_cast<size_t>(cap)), nxt(static_cast<size_t>(cap));
  pack_shard(g, args, cur.data());
  const int64_t mr = std::max<int64_t>(Lr, 1);
  Tensor<float> tmp_out({g.B, g.H, mr, g.Ev}), tmp_lse({g.B, g.H, mr});
  std::vector<char> filled(size_t(std::max<int64_t>(Lr, 1)), 0);
  RingStats st;
  std::vector<MPI_Request> reqs;
  BlockCall bc;
  for (int s = 0; s < g.P; ++s) {
    const int o = (r - s + g.P) % g.P;
    if (s < g.P - 1) {
      irecv(nxt.data(), shard_floats(g, (o + g.P - 1) % g.P), prev, kTagKV, c, reqs);
      isend(cur.data(), shard_floats(g, o), next, kTagKV, c, reqs);
      st.bytes_sent += 4 * shard_floats(g, o);
    }
    const double t0 = MPI_Wtime();
    for (const Task& t : tasks(g, o)) {
      make_call(bc, g, args, base, o, cur.data(), t);
      ++st.blocks;
      View4<float> o_rows = rows(out, t.i0, t.n);
      View3<float> l_rows = rows(lse, t.i0, t.n);
      if (!filled[size_t(t.i0)]) {  // the first block these rows see writes them directly
        attn::detail::block_attention(bc.args, SdpaOutputs<float>{o_rows, {}, l_rows}, bc.opt, bc.key_origin);
        filled[size_t(t.i0)] = 1;
      } else {
        View4<float> po(tmp_out.data(), {g.B, g.H, t.n, g.Ev}, {g.H * mr * g.Ev, mr * g.Ev, g.Ev, 1});
        View3<float> pl(tmp_lse.data(), {g.B, g.H, t.n}, {g.H * mr, mr, 1});
        attn::detail::block_attention(bc.args, SdpaOutputs<float>{po, {}, pl}, bc.opt, bc.key_origin);
        merge_attention(o_rows, l_rows, View4<const float>(po), View3<const float>(pl));
      }
      progress(reqs);
    }
    st.compute_s += MPI_Wtime() - t0;
    st.wait_s += wait(reqs, g.bound, step(s, prev, "'s K/V shard"));
    std::swap(cur, nxt);
  }
  const double t1 = MPI_Wtime();
  // Rows no block reached (every key outside their band) see no key: out 0, lse −inf.
  for (const auto& [i0, n] : row_groups(g))
    if (n > 0 && !filled[size_t(i0)]) {
      View4<float> ov = rows(out, i0, n);
      View3<float> lv = rows(lse, i0, n);
      for (int64_t b = 0; b < g.B; ++b)
        for (int64_t h = 0; h < g.H; ++h)
          for (int64_t i = 0; i < n; ++i) {
            lv(b, h, i) = -INFINITY;
            for (int64_t e = 0; e < g.Ev; ++e) ov(b, h, i, e) = 0.0f;
          }
    }
  // The sinks join each row's denominator once: a merge with a part of
  // output 0 and lse = sink_h (a broadcast view of the (H) values).
  if (const View1<const float> sinks = g.operands().sinks; !sinks.empty() && Lr > 0) {
    const float zero = 0.0f;
    merge_attention(out, lse, View4<const float>(&zero, {g.B, g.H, Lr, g.Ev}, {0, 0, 0, 0}),
                    View3<const float>(sinks.data, {g.B, g.H, Lr}, {0, 1, 0}));
  }
  st.compute_s += MPI_Wtime() - t1;
  st.steps = g.P;
  st.total_s = MPI_Wtime() - t_start;
  if (stats) *stats = st;
}

void ring_attention_backward(MPI_Comm comm, const SdpaArgs<float>& args, View4<const float> dout,
                             const SdpaSaved<float>& saved, const SdpaGrads<float>& grads, const DistOptions& opt,
                             RingStats* stats) {
  const double t_start = MPI_Wtime();
  View4<const float> out = saved.out;
  View3<const float> lse = saved.lse;
  detail::Request req{detail::Op::ring_backward, &args, &opt, out, lse, false, dout, &grads};
  const Geometry g = detail::validate(comm, "ring_attention_backward", req);
  const int r = g.r, next = (r + 1) % g.P, prev = (r + g.P - 1) % g.P;
  const int64_t Lr = g.Lr[size_t(r)];
  // The saved state; recomputed by a forward ring when not given.
  Tensor<float> out_own, lse_own;
  if (!g.saved) {
    const int64_t l1 = std::max<int64_t>(Lr, 1);
    out_own = Tensor<float>({g.B, g.H, l1, g.Ev});
    lse_own = Tensor<float>({g.B, g.H, l1});
    View4<float> ov(out_own.data(), {g.B, g.H, Lr, g.Ev}, {g.H * l1 * g.Ev, l1 * g.Ev, g.Ev, 1});
    View3<float> lv(lse_own.data(), {g.B, g.H, Lr}, {g.H * l1, l1, 1});
    ring_attention(comm, args, SdpaOutputs<float>{ov, {}, lv}, opt);
    out = ov;
    lse = lv;
  }
  const detail::CommDup dup(comm, g.bound);
  const MPI_Comm c = dup.get();
  const SdpaOptions base = detail::block_options(g, opt);
  const int64_t cap = std::max<int64_t>(max_shard_floats(g), 1);
  std::vector<float> cur(static_cast<size_t>(cap)), nxt(static_cast<size_t>(cap)), blk(static_cast<size_t>(cap)), tmp(static_cast<size_t>(cap));
  std::vector<float> acc[3] = {std::vector<float>(static_cast<size_t>(cap)), std::vector<float>(static_cast<size_t>(cap)),
                               std::vector<float>(static_cast<size_t>(cap))};
  pack_shard(g, args, cur.data());
  const int64_t mr = std::max<int64_t>(Lr, 1);
  Tensor<float> dq_acc({g.B, g.H, std::max<int64_t>(Lr, 1), g.E}), dq_tmp({g.B, g.H, mr, g.E});
  const int64_t l1 = std::max<int64_t>(Lr, 1);
  const View4<float> dq_all(dq_acc.data(), {g.B, g.H, Lr, g.E}, {g.H * l1 * g.E, l1 * g.E, g.E, 1});
  RingStats st;
  std::vector<MPI_Request> kv_reqs, grad_recv, grad_send[3];
  BlockCall bc;
  for (int s = 0; s < g.P; ++s) {
    const int o = (r - s + g.P) % g.P;
    std::vector<float>& A = acc[s % 3];
    std::vector<float>& in = acc[(s + 1) % 3];
    st.wait_s += wait(grad_send[(s + 1) % 3], g.bound, step(s, next, " to take a dK/dV accumulator"));  // `in` was sent two steps ago
    if (s < g.P - 1) {
      irecv(nxt.data(), shard_floats(g, (o + g.P - 1) % g.P), prev, kTagKV, c, kv_reqs);
      isend(cur.data(), shard_floats(g, o), next, kTagKV, c, kv_reqs);
      st.bytes_sent += 4 * shard_floats(g, o);
    }
    std::vector<MPI_Request> recv_now;
    recv_now.swap(grad_recv);  // the accumulator of this step's shard (posted last step)
    // The accumulator of the next step's shard (at the last step: our own, home again).
    irecv(in.data(), shard_floats(g, (o + g.P - 1) % g.P), prev, kTagGrad, c, grad_recv);
    const double t0 = MPI_Wtime();
    const int64_t nf = shard_floats(g, o);
    std::fill(blk.begin(), blk.begin() + nf, 0.0f);
    for (const Task& t : tasks(g, o)) {
      make_call(bc, g, args, base, o, cur.data(), t);
      ++st.blocks;
      SdpaGrads<float> bg;
      bg.dq = View4<float>(dq_tmp.data(), {g.B, g.H, t.n, g.E}, {g.H * mr * g.E, mr * g.E, g.E, 1});
      bg.dk = rows(shard_k(g, o, tmp.data()), t.s0, t.s);
      bg.dv = rows(shard_v(g, o, tmp.data()), t.s0, t.s);
      const SdpaSaved<float> sv{View4<const float>(rows(out, t.i0, t.n)), rows(lse, t.i0, t.n)};
      attn::detail::block_attention_backward(bc.args, View4<const float>(rows(dout, t.i0, t.n)), sv, bg, bc.opt,
                                             bc.key_origin);
      add_into(rows(dq_all, t.i0, t.n), View4<const float>(bg.dq));  // dQ: summed over steps in order
      add_into(rows(shard_k(g, o, blk.data()), t.s0, t.s), View4<const float>(bg.dk));
      add_into(rows(shard_v(g, o, blk.data()), t.s0, t.s), View4<const float>(bg.dv));
      progress(kv_reqs);
      progress(grad_recv);
    }
    st.compute_s += MPI_Wtime() - t0;
    if (s == 0) std::fill(A.begin(), A.begin() + nf, 0.0f);
    else st.wait_s += wait(recv_now, g.bound, step(s, prev, "'s dK/dV accumulator"));
    const double t1 = MPI_Wtime();
    for (int64_t i = 0; i < nf; ++i) A[size_t(i)] += blk[size_t(i)];  // owner's order: o, o + 1, ...
    st.compute_s += MPI_Wtime() - t1;
    isend(A.data(), nf, next, kTagGrad, c, grad_send[s % 3]);
    st.bytes_sent += 4 * nf;
    st.wait_s += wait(kv_reqs, g.bound, step(s, prev, "'s K/V shard"));
    std::swap(cur, nxt);
  }
  st.wait_s += wait(grad_recv, g.bound, step(g.P - 1, prev, "'s dK/dV accumulator"));
  for (auto& q : grad_send) st.wait_s += wait(q, g.bound, step(g.P - 1, next, " to take a dK/dV accumulator"));
  // Our shard's dK/dV, summed by every rank, arrived in acc[P mod 3].
  const float* home = acc[g.P % 3].data();
  const int64_t Sr = g.Sr[size_t(r)];
  detail::unpack(home, grads.dk, 0, g.Hkv, 0, Sr);
  detail::unpack(home + g.B * g.Hkv * Sr * g.E, grads.dv, 0, g.Hkv, 0, Sr);
  add_into(grads.dq, View4<const float>(dq_all), false);
  if (g.dsinks) detail::sink_gradient(c, g, dout, out, lse, grads.dsinks);
  st.steps = g.P;
  st.total_s = MPI_Wtime() - t_start;
  if (stats) *stats = st;
}

}  // namespace attn::dist
