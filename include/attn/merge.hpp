// attn/merge.hpp — merging partial attention results by log-sum-exp.
//
// Attention over a key set that is split into disjoint parts A and B can be
// computed part by part: each part gives an output O_a (the softmax-weighted
// values over its own keys) and the log-sum-exp lse_a of its scores. The
// result over A ∪ B is
//
//   lse = log(exp(lse_a) + exp(lse_b))
//   O   = exp(lse_a − lse)·O_a + exp(lse_b − lse)·O_b
//
// which is what split-KV decoding (threads own key chunks) and ring
// attention (processes own key shards) do after each part. The merge is
// exact up to rounding and does not depend on how the keys were split.
//
// Shapes: out (B, H, L, Ev), lse (B, H, L), both parts the same shape.
//   * A part that saw no key (lse = −inf) contributes nothing; two such
//     parts give out 0 and lse −inf (the fully-masked-row rule).
//   * NaN in either part's lse or output reaches the merged row.
#pragma once

#include "attn/tensor.hpp"

namespace attn {

// (out_a, lse_a) ← merge of (out_a, lse_a) and (out_b, lse_b), row by row.
// The rows are shared among num_threads OpenMP threads (0 = OpenMP's
// default); each row is merged on its own, so the result is the same for
// any count. Throws attn::InvalidArgument when shapes disagree or an output
// broadcasts.
template <class T>
void merge_attention(View4<T> out_a, View3<T> lse_a, View4<const T> out_b, View3<const T> lse_b,
                     int num_threads = 1);

}  // namespace attn
