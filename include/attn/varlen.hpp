// attn/varlen.hpp — attention over a packed batch of sequences of different
// lengths (FlashAttention's varlen functions).
//
// B sequences are packed one after another along the token axis, with no
// padding:
//   q    (total_q, H,   E)      k (total_k, Hkv, E)      v (total_k, Hkv, Ev)
//   out  (total_q, H,   Ev)     lse (H, total_q)
//   cu_seqlens_q, cu_seqlens_k  int64 (B + 1): 0 = cu[0] <= cu[1] <= ... ,
//                               cu_q[B] = total_q, cu_k[B] = total_k.
// Sequence b owns query tokens [cu_q[b], cu_q[b+1]) and key tokens
// [cu_k[b], cu_k[b+1]), and attends only within itself. Every option of
// SdpaOptions applies per sequence, with that sequence's lengths L_b and S_b:
// causal, the window and chunks are aligned per sequence (causal_align or
// position_offset, as in the dense call), per-head slopes measure distances
// within the sequence, and the sinks join every row's softmax. The result
// is exactly the dense call run once per sequence; no padding is computed.
//
// max_seqlen_q and max_seqlen_k are the largest L_b and S_b (as in
// FlashAttention); they are checked against cu_seqlens.
#pragma once

#include <cstdint>

#include "attn/sdpa.hpp"

namespace attn {

// ScoreArgs: the per-head slopes and sinks (H) apply to every sequence; a
// mask or bias is refused (they have no packed layout; use the rules).
template <class T>
struct VarlenArgs : ScoreArgs<T> {
  View3<const T> q, k, v;
  View1<const int64_t> cu_seqlens_q, cu_seqlens_k;  // (B + 1)
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
};

// What the forward writes: `out` required, `lse` when given.
template <class T>
struct VarlenOutputs {
  View3<T> out;  // (total_q, H, Ev)
  View2<T> lse;  // optional, (H, total_q)
};

// The forward's saved state for the backward (both optional).
template <class T>
struct VarlenSaved {
  View3<const T> out;  // (total_q, H, Ev)
  View2<const T> lse;  // (H, total_q)
};

template <class T>
struct VarlenGrads {
  View3<T> dq;      // (total_q, H, E)
  View3<T> dk;      // (total_k, Hkv, E)
  View3<T> dv;      // (total_k, Hkv, Ev)
  View1<T> dsinks{};  // optional, (H)
};

template <class T>
void varlen_attention(const VarlenArgs<T>& args, const VarlenOutputs<T>& outputs,
                      const SdpaOptions& opt = {});

// Given dout = dL/d(out) (total_q, H, Ev), writes the gradients (overwritten).
template <class T>
void varlen_attention_backward(const VarlenArgs<T>& args, View3<const T> dout,
                               const VarlenSaved<T>& saved, const VarlenGrads<T>& grads,
                               const SdpaOptions& opt = {});

}  // namespace attn
