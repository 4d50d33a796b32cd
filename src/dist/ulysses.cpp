// All-to-all (DeepSpeed-Ulysses) attention over MPI, forward and backward.
//
// Every rank starts with a shard of the sequence for all heads and ends with
// the output rows of its shard for all heads. In between, one all-to-all
// gives rank d the whole sequence for query heads [d·H/P, (d+1)·H/P) and
// key/value heads [d·Hkv/P, (d+1)·Hkv/P) (the GQA grouping h → h / (H/Hkv)
// maps the one range onto the other), the rank runs the ordinary
// single-process call on whole sequences, and a second all-to-all sends the
// output rows back to their shards. Nothing about the attention changes, so
// every rule of the dense call that does not need the whole L×S matrix on
// one rank works: every option, key lengths, and the per-head operands
// (sliced to the rank's heads; the sinks' gradient is gathered back to all H
// on every rank).
//
// Traffic: each rank sends (P − 1)/P of its shard of q, k, v (and receives
// as much) and the same of the output; the backward sends q, k, v, dY, Y and
// lse and returns dq, dk, dv. Unlike the ring, the volume per rank falls as
// 1/P but every rank talks to every other, and P can be at most Hkv.
//
// Message layout: for each destination, each tensor in order, and within a
// tensor each of the sender's chunks as a contiguous (B, heads, rows, F)
// block; the receiver walks the same order.
#include <algorithm>

#include "dist/internal.hpp"

namespace attn::dist {
namespace {

using detail::Geometry;

constexpr int kTagA2A = 300;

// A tensor to redistribute: `local` (B, Hx, n_r, F) on the sequence split,
// `full` (B, Hx / P, N, F) on the head split; `keys` picks the key chunks.
struct Piece {
  View4<float> local, full;
  bool keys = false;
};

// An lse view (B, H, N) as (B, H, N, 1), so it travels like the rest.
View4<float> as4(View3<float> v) {
  return View4<float>(v.data, {v.shape[0], v.shape[1], v.shape[2], 1}, {v.strides[0], v.strides[1], v.strides[2], 1});
}
View4<float> as4(View3<const float> v) {
  return as4(View3<float>(const_cast<float*>(v.data), v.shape, v.strides));
}
View4<float> mut(View4<const float> v) { return View4<float>(const_cast<float*>(v.data), v.shape, v.strides); }

const std::vector<Chunk>& chunks_of(const Geometry& g, int d, bool keys) {
  return keys ? g.kc[size_t(d)] : g.qc[size_t(d)];
}

// Floats one rank sends to another: heads per rank × rows of `rows_rank`.
int64_t block_floats(const Geometry& g, const Piece& p, int rows_rank) {
  const int64_t hx = p.local.shape[1] / g.P;
  int64_t n = 0;
  for (const Chunk& c : chunks_of(g, rows_rank, p.keys)) n += c.length;
  return g.B * hx * n * p.local.shape[3];
}

// Posts every send and receive of one all-to-all and waits for them.
void exchange(const Geometry& g, MPI_Comm comm, std::vector<std::vector<float>>& send,
              std::vector<std::vector<float>>& recv) {
  std::vector<MPI_Request> reqs;
  for (int d = 0; d < g.P; ++d) detail::irecv(recv[size_t(d)].data(), int64_t(recv[size_t(d)].size()), d, kTagA2A, comm, reqs);
  for (int k = 0; k < g.P; ++k) {
    const int d = (g.r + k) % g.P;  // start with ourselves, then the next ranks in turn
    detail::isend(send[size_t(d)].data(), int64_t(send[size_t(d)].size()), d, kTagA2A, comm, reqs);
  }
  detail::wait(reqs, g.bound, "the all-to-all with every rank");
}

// Sequence split -> head split: fills every piece's `full`.
void to_heads(const Geometry& g, MPI_Comm comm, const std::vector<Piece>& pieces) {
  std::vector<std::vector<float>> send(size_t(g.P)), recv(size_t(g.P));
  for (int d = 0; d < g.P; ++d) {
    int64_t ns = 0, nr = 0;
    for (const Piece& p : pieces) ns += block_floats(g, p, g.r), nr += block_floats(g, p, d);
    send[size_t(d)].resize(size_t(ns));
    recv[size_t(d)].resize(size_t(nr));
    float* w = send[size_t(d)].data();
    for (const Piece& p : pieces) {
      const int64_t hx = p.local.shape[1] / g.P;
      int64_t li = 0;
      for (const Chunk& c : chunks_of(g, g.r, p.keys)) {
        detail::pack(p.local, d * hx, hx, li, c.length, w);
        w += g.B * hx * c.length * p.local.shape[3];
        li += c.length;
      }
    }
  }
  exchange(g, comm, send, recv);
  for (int d = 0; d < g.P; ++d) {
    const float* rd = recv[size_t(d)].data();
    for (const Piece& p : pieces) {
      const int64_t hx = p.full.shape[1];
      for (const Chunk& c : chunks_of(g, d, p.keys)) {
        detail::unpack(rd, p.full, 0, hx, c.begin, c.length);
        rd += g.B * hx * c.length * p.full.shape[3];
      }
    }
  }
}

// Head split -> sequence split: fills every piece's `local`.
void from_heads(const Geometry& g, MPI_Comm comm, const std::vector<Piece>& pieces) {
  std::vector<std::vector<float>> send(size_t(g.P)), recv(size_t(g.P));
  for (int d = 0; d < g.P; ++d) {
    int64_t ns = 0, nr = 0;
    for (const Piece& p : pieces) ns += block_floats(g, p, d), nr += block_floats(g, p, g.r);
    send[size_t(d)].resize(size_t(ns));
    recv[size_t(d)].resize(size_t(nr));
    float* w = send[size_t(d)].data();
    for (const Piece& p : pieces) {
      const int64_t hx = p.full.shape[1];
      for (const Chunk& c : chunks_of(g, d, p.keys)) {
        detail::pack(p.full, 0, hx, c.begin, c.length, w);
        w += g.B * hx * c.length * p.full.shape[3];
      }
    }
  }
  exchange(g, comm, send, recv);
  for (int d = 0; d < g.P; ++d) {
    const float* rd = recv[size_t(d)].data();
    for (const Piece& p : pieces) {
      const int64_t hx = p.full.shape[1];
      int64_t li = 0;
      for (const Chunk& c : chunks_of(g, g.r, p.keys)) {
        detail::unpack(rd, p.local, d * hx, hx, li, c.length);
        rd += g.B * hx * c.length * p.local.shape[3];
        li += c.length;
      }
    }
  }
}

// A (B, heads, N, F) tensor of the head split.
Tensor<float> full_tensor(const Geometry& g, int64_t heads, int64_t n, int64_t F) {
  return Tensor<float>({g.B, heads, n, F});
}
View4<float> v4(Tensor<float>& t) { return t.view4(); }
View4<float> v4_3(Tensor<float>& t) {  // a rank-3 lse tensor as (B, H, N, 1)
  return View4<float>(t.data(), {t.dim(0), t.dim(1), t.dim(2), 1});
}

SdpaArgs<float> head_args(const Geometry& g, Tensor<float>& q, Tensor<float>& k, Tensor<float>& v) {
  SdpaArgs<float> a;
  a.q = q.view4();
  a.k = k.view4();
  a.v = v.view4();
  if (!g.key_lengths.empty()) a.key_lengths = View1<const int64_t>(g.key_lengths.data(), {g.B});
  // Per-head arguments: this rank's heads [r·H/P, (r+1)·H/P) only.
  const int64_t hp = g.H / g.P;
  static_cast<ScoreArgs<float>&>(a) = attn::detail::heads_of(g.operands(), g.r * hp, hp);
  return a;
}

SdpaOptions head_options(const Geometry& g, const DistOptions& opt) {
  SdpaOptions o = detail::block_options(g, opt);
  o.causal = opt.sdpa.causal;
  o.causal_align = opt.sdpa.causal_align;
  return o;
}

}  // namespace

void ulysses_attention(MPI_Comm comm, const SdpaArgs<float>& args, const SdpaOutputs<float>& outputs,
                       const DistOptions& opt) {
  const View4<float> out = outputs.out;
  const View3<float> lse = outputs.lse;
  detail::Request req{detail::Op::ulysses_forward, &args, &opt, out, lse, !outputs.weights.empty()};
  const Geometry g = detail::validate(comm, "ulysses_attention", req);
  const detail::CommDup dup(comm, g.bound);
  const int64_t hp = g.H / g.P, hkp = g.Hkv / g.P;
  Tensor<float> q = full_tensor(g, hp, g.L, g.E), k = full_tensor(g, hkp, g.S, g.E), v = full_tensor(g, hkp, g.S, g.Ev);
  to_heads(g, dup.get(), {{mut(args.q), v4(q), false}, {mut(args.k), v4(k), true}, {mut(args.v), v4(v), true}});
  Tensor<float> o = full_tensor(g, hp, g.L, g.Ev), l({g.B, hp, g.L});
  scaled_dot_product_attention(head_args(g, q, k, v),
                               SdpaOutputs<float>{o.view4(), {}, View3<float>(l.data(), {g.B, hp, g.L})},
                               head_options(g, opt));
  std::vector<Piece> back = {{out, v4(o), false}};
  if (g.lse_given) back.push_back({as4(lse), v4_3(l), false});
  from_heads(g, dup.get(), back);
}

void ulysses_attention_backward(MPI_Comm comm, const SdpaArgs<float>& args, View4<const float> dout,
                                const SdpaSaved<float>& saved_state, const SdpaGrads<float>& grads,
                                const DistOptions& opt) {
  const View4<const float> out = saved_state.out;
  const View3<const float> lse = saved_state.lse;
  detail::Request req{detail::Op::ulysses_backward, &args, &opt, out, lse, false, dout, &grads};
  const Geometry g = detail::validate(comm, "ulysses_attention_backward", req);
  const detail::CommDup dup(comm, g.bound);
  const int64_t hp = g.H / g.P, hkp = g.Hkv / g.P;
  Tensor<float> q = full_tensor(g, hp, g.L, g.E), k = full_tensor(g, hkp, g.S, g.E), v = full_tensor(g, hkp, g.S, g.Ev);
  Tensor<float> dy = full_tensor(g, hp, g.L, g.Ev), y, l;
  std::vector<Piece> there = {{mut(args.q), v4(q), false},
                              {mut(args.k), v4(k), true},
                              {mut(args.v), v4(v), true},
                              {mut(dout), v4(dy), false}};
  const bool saved = g.saved;  // else the backward recomputes them
  if (saved) {
    y = full_tensor(g, hp, g.L, g.Ev);
    l = Tensor<float>({g.B, hp, g.L});
    there.push_back({mut(out), v4(y), false});
    there.push_back({as4(lse), v4_3(l), false});
  }
  to_heads(g, dup.get(), there);
  Tensor<float> dq = full_tensor(g, hp, g.L, g.E), dk = full_tensor(g, hkp, g.S, g.E),
                dv = full_tensor(g, hkp, g.S, g.Ev);
  SdpaGrads<float> hg;
  hg.dq = dq.view4();
  hg.dk = dk.view4();
  hg.dv = dv.view4();
  SdpaSaved<float> hs;
  if (saved) hs = {View4<const float>(y.view4()), View3<const float>(l.data(), {g.B, hp, g.L})};
  std::vector<float> ds_mine(static_cast<size_t>(hp)), ds_all(static_cast<size_t>(g.H));
  if (g.dsinks) hg.dsinks = View1<float>(ds_mine.data(), {hp});
  scaled_dot_product_attention_backward(head_args(g, q, k, v), View4<const float>(dy.view4()), hs, hg,
                                        head_options(g, opt));
  if (g.dsinks) {  // each rank has its heads' whole gradient: gathered in head order
    detail::allgather(ds_mine.data(), int(hp), MPI_FLOAT, ds_all.data(), dup.get(), g.bound,
                      "the other ranks' sinks gradients");
    for (int64_t h = 0; h < g.H; ++h) grads.dsinks(h) = ds_all[size_t(h)];
  }
  from_heads(g, dup.get(), {{grads.dq, v4(dq), false}, {grads.dk, v4(dk), true}, {grads.dv, v4(dv), true}});
}

}  // namespace attn::dist
