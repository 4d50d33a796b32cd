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
// Causal masking on shards. A shard is a list of chunks of the global
// sequence (attn/dist.hpp), stored in increasing order. A query chunk sees a
// key chunk fully when the key chunk is earlier, not at all when it is later,
// and causally (a square, since L = S) when it is the same chunk. The keys a
// query chunk sees in a shard are therefore a prefix of that shard's rows:
// the earlier chunks, then possibly its own chunk last; that prefix is one
// call with bottom-right causal alignment (query i of the chunk sees the
// S' − L' earlier keys and the first i + 1 of its own), or a plain call when
// the own chunk is not in it. Blocks that are entirely later are skipped. The
// zig-zag layout (rank r holds chunks r and 2P − 1 − r) gives every rank the
// same work; key padding restricted to a shard stays a prefix too.
//
// Backward. The saved global out and lse of the local queries are what the
// fused backward needs per block: it recomputes P = exp(S − lse), which with
// the global lse is the global softmax restricted to the block, and uses
// D = rowsum(dY ∘ Y) of the global output. So each block's dQ (added locally
// in step order) and dK/dV are exact pieces of the global gradients. The
// dK/dV of a shard travel with it: at each step the holder adds its block's
// contribution to the accumulator that came with the shard and sends it on;
// after P steps it arrives back at its owner, summed in the fixed order
// o, o + 1, …, o + P − 1. Results are bitwise reproducible for a fixed P,
// layout and thread count.
//
// Traffic per step: one shard of K and V, B·Hkv·(S/P)·(E + Ev) floats, in the
// forward; that and the same again for dK/dV in the backward. Memory per
// rank: two K/V buffers (and three dK/dV accumulators in the backward) of
// one shard each, plus one block's output.
#include <algorithm>

#include "attn/merge.hpp"
#include "dist/internal.hpp"

namespace attn::dist {
namespace {

using detail::Geometry;
using detail::rows;
using detail::isend;
using detail::irecv;
using detail::progress;
using detail::wait;

constexpr int kTagKV = 100, kTagGrad = 200;
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

// One block call: local query rows [i0, i0 + n) against the first s keys of
// owner o's shard (its first `kchunks` chunks); `diag` = the last of those
// chunks is the query chunk itself (bottom-right causal).
struct Task {
  int64_t i0 = 0, n = 0, s = 0, kchunks = 0;
  bool diag = false;
};

std::vector<Task> tasks(const Geometry& g, int o, bool causal) {
  std::vector<Task> t;
  const auto& kcs = g.kc[size_t(o)];
  if (!causal) {
    if (g.Lr[size_t(g.r)] > 0 && g.Sr[size_t(o)] > 0)
      t.push_back({0, g.Lr[size_t(g.r)], g.Sr[size_t(o)], int64_t(kcs.size()), false});
    return t;
  }
  int64_t i0 = 0;
  for (const Chunk& qc : g.qc[size_t(g.r)]) {
    Task k{i0, qc.length, 0, 0, false};
    for (const Chunk& kc : kcs) {
      if (kc.index > qc.index) break;
      k.s += kc.length;
      ++k.kchunks;
      k.diag = kc.index == qc.index;
    }
    if (k.n > 0 && k.s > 0) t.push_back(k);
    i0 += qc.length;
  }
  return t;
}

int64_t max_rows(const Geometry& g) {
  int64_t m = 0;
  for (int o = 0; o < g.P; ++o)
    for (const Task& t : tasks(g, o, true)) m = std::max(m, t.n);
  return std::max(m, g.Lr[size_t(g.r)]);
}

// The arguments of one block call (views into the local queries and owner o's shard).
struct BlockCall {
  SdpaArgs<float> args;
  SdpaOptions opt;
  std::vector<int64_t> key_lengths;
};

void make_call(BlockCall& bc, const Geometry& g, const SdpaArgs<float>& local, const SdpaOptions& base, int o,
               float* kv, const Task& t) {
  bc.args = SdpaArgs<float>{};
  bc.args.q = rows(local.q, t.i0, t.n);
  bc.args.k = rows(View4<const float>(shard_k(g, o, kv)), 0, t.s);
  bc.args.v = rows(View4<const float>(shard_v(g, o, kv)), 0, t.s);
  bc.opt = base;
  bc.opt.causal = t.diag;
  bc.opt.causal_align = CausalAlign::bottom_right;
  bc.key_lengths.clear();
  if (!g.key_lengths.empty()) {
    for (int64_t b = 0; b < g.B; ++b)
      bc.key_lengths.push_back(detail::local_key_length(g.kc[size_t(o)], t.kchunks, g.key_lengths[size_t(b)]));
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
  const detail::CommDup dup(comm);
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
  const int64_t mr = std::max<int64_t>(max_rows(g), 1);
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
    for (const Task& t : tasks(g, o, opt.sdpa.causal)) {
      make_call(bc, g, args, base, o, cur.data(), t);
      View4<float> o_rows = rows(out, t.i0, t.n);
      View3<float> l_rows = rows(lse, t.i0, t.n);
      if (!filled[size_t(t.i0)]) {  // the first block these rows see writes them directly
        scaled_dot_product_attention(bc.args, SdpaOutputs<float>{o_rows, {}, l_rows}, bc.opt);
        filled[size_t(t.i0)] = 1;
      } else {
        View4<float> po(tmp_out.data(), {g.B, g.H, t.n, g.Ev}, {g.H * mr * g.Ev, mr * g.Ev, g.Ev, 1});
        View3<float> pl(tmp_lse.data(), {g.B, g.H, t.n}, {g.H * mr, mr, 1});
        scaled_dot_product_attention(bc.args, SdpaOutputs<float>{po, {}, pl}, bc.opt);
        merge_attention(o_rows, l_rows, View4<const float>(po), View3<const float>(pl));
      }
      progress(reqs);
    }
    st.compute_s += MPI_Wtime() - t0;
    st.wait_s += wait(reqs);
    std::swap(cur, nxt);
  }
  // Every row was written: a causal query chunk sees its own chunk at step
  // 0, and a non-causal row sees every shard, one of which is non-empty.
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
  const detail::CommDup dup(comm);
  const MPI_Comm c = dup.get();
  const SdpaOptions base = detail::block_options(g, opt);
  const int64_t cap = std::max<int64_t>(max_shard_floats(g), 1);
  std::vector<float> cur(static_cast<size_t>(cap)), nxt(static_cast<size_t>(cap)), blk(static_cast<size_t>(cap)), tmp(static_cast<size_t>(cap));
  std::vector<float> acc[3] = {std::vector<float>(static_cast<size_t>(cap)), std::vector<float>(static_cast<size_t>(cap)),
                               std::vector<float>(static_cast<size_t>(cap))};
  pack_shard(g, args, cur.data());
  const int64_t mr = std::max<int64_t>(max_rows(g), 1);
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
    st.wait_s += wait(grad_send[(s + 1) % 3]);  // `in` was sent two steps ago
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
    for (const Task& t : tasks(g, o, opt.sdpa.causal)) {
      make_call(bc, g, args, base, o, cur.data(), t);
      SdpaGrads<float> bg;
      bg.dq = View4<float>(dq_tmp.data(), {g.B, g.H, t.n, g.E}, {g.H * mr * g.E, mr * g.E, g.E, 1});
      bg.dk = rows(shard_k(g, o, tmp.data()), 0, t.s);
      bg.dv = rows(shard_v(g, o, tmp.data()), 0, t.s);
      const SdpaSaved<float> sv{View4<const float>(rows(out, t.i0, t.n)), rows(lse, t.i0, t.n)};
      scaled_dot_product_attention_backward(bc.args, View4<const float>(rows(dout, t.i0, t.n)), sv, bg, bc.opt);
      add_into(rows(dq_all, t.i0, t.n), View4<const float>(bg.dq));  // dQ: summed over steps in order
      add_into(rows(shard_k(g, o, blk.data()), 0, t.s), View4<const float>(bg.dk));
      add_into(rows(shard_v(g, o, blk.data()), 0, t.s), View4<const float>(bg.dv));
      progress(kv_reqs);
      progress(grad_recv);
    }
    st.compute_s += MPI_Wtime() - t0;
    if (s == 0) std::fill(A.begin(), A.begin() + nf, 0.0f);
    else st.wait_s += wait(recv_now);
    const double t1 = MPI_Wtime();
    for (int64_t i = 0; i < nf; ++i) A[size_t(i)] += blk[size_t(i)];  // owner's order: o, o + 1, ...
    st.compute_s += MPI_Wtime() - t1;
    isend(A.data(), nf, next, kTagGrad, c, grad_send[s % 3]);
    st.bytes_sent += 4 * nf;
    st.wait_s += wait(kv_reqs);
    std::swap(cur, nxt);
  }
  st.wait_s += wait(grad_recv);
  for (auto& q : grad_send) st.wait_s += wait(q);
  // Our shard's dK/dV, summed by every rank, arrived in acc[P mod 3].
  const float* home = acc[g.P % 3].data();
  const int64_t Sr = g.Sr[size_t(r)];
  detail::unpack(home, grads.dk, 0, g.Hkv, 0, Sr);
  detail::unpack(home + g.B * g.Hkv * Sr * g.E, grads.dv, 0, g.Hkv, 0, Sr);
  add_into(grads.dq, View4<const float>(dq_all), false);
  st.steps = g.P;
  st.total_s = MPI_Wtime() - t_start;
  if (stats) *stats = st;
}

}  // namespace attn::dist
