// attn/sdpa.hpp — scaled dot-product attention, forward and backward.
//
//   Y = softmax_row(Q·Kᵀ·scale + bias + mask) · V
//
// Shapes (logical axes, see attn/tensor.hpp for layouts and strides):
//   q    (B, H,   L, E)      k (B, Hkv, S, E)      v (B, Hkv, S, Ev)
//   out  (B, H,   L, Ev)     weights (B, H, L, S)  lse (B, H, L)
// Hkv must divide H; query head h reads key/value head h / (H / Hkv)
// (grouped-query attention; Hkv = 1 is multi-query), without copying K or V.
//
// The score rules (all optional, all combined; formulas and examples in
// docs/variants.md). Operands, in ScoreArgs (shared by every attention call:
// sdpa, varlen, decode over a cache, the multi-head layer, dist):
//   mask         bool (Bm, Hm, Lm, Sm), each axis 1 (broadcast) or full size.
//                true = the query MAY attend to the key (PyTorch SDPA polarity).
//   bias         additive float (Bb, Hb, Lb, Sb), same broadcasting; -inf
//                entries mask. Its gradient dbias has the bias's own shape
//                (summed over the broadcast axes).
//   alibi_slopes (H): adds -slope_h·|p - j| (FlashAttention 2's ALiBi).
//   sinks        (H): one logit per head that joins every row's softmax
//                denominator and contributes no value (gpt-oss).
// Options, in SdpaOptions (the same struct for every attention call):
//   causal       query i sees key j iff j <= i (top_left, PyTorch is_causal) or
//                j <= i + (S - L) (bottom_right, the alignment used when new
//                queries are appended after a cache of S - L keys).
//   window       (left, right): query at position p sees keys
//                p - left <= j <= p + right; -1 = unbounded on that side.
//   chunk_size   C > 0: query at position p sees only the keys of its own
//                chunk, p / C == j / C rounding down (Llama 4's local layers).
//   softcap      c > 0: scores become c·tanh(s / c) after scaling, before
//                ALiBi, biases and masks (Gemma 2).
//   position_offset query row i sits at key position p = i + offset. When not
//                given, offset is 0 (top_left) or S - L (bottom_right); it
//                is the one rule causal, window, chunks and ALiBi use.
// And, per call, key_lengths int64 (B): in batch b only keys j < key_lengths[b]
// are seen.

// A query row that can see no key at all ("fully masked") gets output 0,
// weights 0, lse = -inf, and contributes zero gradient. Never NaN. With
// sinks, such a row puts all its weight on the sink: output 0, lse = sink_h.
//
// The softmax subtracts the row maximum, so finite scores of any magnitude
// are safe.
//
// Forward -> backward contract. The forward's saved state is SdpaSaved
// {out, lse}: the forward's own output and log-sum-exp, unchanged since the
// forward, for the same args and options. The backward never needs it to be
// correct, only to be fast:
//   reference  ignores it and recomputes the attention matrix from q and k;
//   fused      uses out (for D_i = dout_i·out_i) and lse (to rebuild each
//              probability as exp(score - lse) without a second softmax pass)
//              when given, and recomputes whichever is absent.
// Results are the same with or without the saved state (bitwise for fused).
//
// Precision. T is float or double (computed in T), or one of the half
// storage types attn::float16_t, attn::bfloat16_t (attn/half.hpp). With a
// half T only q, k and v are half; everything else (bias, alibi_slopes,
// sinks, every output, dout, the saved state and every gradient) is float32,
// and with compute_dtype float32 the arithmetic is float32 on the exactly
// widened values: the result is the float32 call's on the rounded inputs,
// bitwise. (bfloat16 q, k, v compute with bfloat16 products unless
// compute_dtype says float32: see SdpaOptions::compute_dtype.) compute_t<T> names that
// type (T itself for float and double). How: a call with few query rows that
// takes the decode route (the grouped split-KV kernel) reads the half K and V
// directly, widening them in registers, and converts only q (L rows); every
// other call widens q, k and v to float32 once at the boundary (O(N·E) work
// and float32 memory for a copy of them, next to the O(L·S·E) attention),
// then runs the float32 kernels.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "attn/error.hpp"
#include "attn/half.hpp"
#include "attn/tensor.hpp"

namespace attn {

enum class Backend {
  automatic,  // the fastest backend that supports the request
  reference,  // plain, materialises the L×S matrices; float and double
  fused,      // tiled online-softmax CPU kernel (float32); docs/fused.md
};
enum class CausalAlign { top_left, bottom_right };

const char* backend_name(Backend b);                // "auto", "reference", "fused"
Backend parse_backend(std::string_view name);       // throws attn::InvalidArgument on unknown

// The largest num_threads accepted; larger values are an argument error.
inline constexpr int kMaxThreads = 1024;

// A sliding window, FlashAttention's window_size: keys at most `left`
// positions before and `right` after the query's position; -1 = unbounded.
struct Window {
  int64_t left = -1;
  int64_t right = -1;
};

struct SdpaOptions {
  std::optional<double> scale;  // default 1/sqrt(E); else within 2^-64 .. 2^64
  bool causal = false;          // same as window.right = 0 (both may be given)
  CausalAlign causal_align = CausalAlign::top_left;
  Window window;                // default: unbounded
  int64_t chunk_size = 0;       // 0 = off; else > 0 (keys of the query's own chunk)
  double softcap = 0;           // 0 = off; else within 2^-64 .. 2^64
  std::optional<int64_t> position_offset;  // replaces causal_align when given
  Backend backend = Backend::automatic;
  bool check_finite = false;    // reject NaN/Inf in the inputs (costs one pass)
  // Attention dropout (training): each probability is dropped with
  // probability dropout_p (0 <= dropout_p <= 1) and the kept ones scaled by
  // 1 / (1 - dropout_p). The dropped entries are a function of (seed,
  // offset, b, h, i, j) only (a counter-based generator, Philox4x32-10), so
  // they are the same for any thread count and the backward, given the same
  // options, regenerates them; change the seed or the offset for fresh ones.
  // Dense and packed (varlen) calls and the layers built on them; refused
  // over a KV cache and by attn::dist. kernels/dropout.hpp says which entries.
  double dropout_p = 0;
  uint64_t dropout_seed = 0;
  uint64_t dropout_offset = 0;
  // The arithmetic of the products: the forward's Q·Kᵀ and P·V, the
  // backward's (docs/fused.md, "bfloat16 compute"). float32: exact (float32
  // operands; float16 and bfloat16 inputs widened exactly). bfloat16: q, k,
  // v and the probabilities rounded to bfloat16 for the products, sums in
  // float32, the softmax, lse and every output float32; the backward rounds
  // dout, P and dS (= P∘(dP − D), computed in float32) for its products and
  // keeps every gradient sum in float32 (PyTorch's and FlashAttention's
  // bfloat16 arithmetic; several times faster where the CPU has bfloat16
  // dot products: AVX512_BF16, AMX). Unset: bfloat16 for bfloat16 q, k, v,
  // float32 otherwise. It shapes the fused kernels' products, forward and
  // backward; calls with few query rows (the decode kernel) and
  // decode_attention apply the same roundings where that is faster
  // (AVX512_BF16 on AMD CPUs) and not to float16 k and v, else stay exact
  // (docs/decode.md). Only float32
  // and bfloat16; bfloat16 is refused with double inputs and with the
  // reference backend.
  std::optional<Dtype> compute_dtype;
  // 0 = the OpenMP default (omp_get_max_threads()). 1 to kMaxThreads are
  // accepted and clamped to 4 x omp_get_num_procs() (more threads than that
  // only oversubscribe; results are the same for any count). Negative or
  // above kMaxThreads: attn::InvalidArgument.
  int num_threads = 0;
};

// The type of a call's non-q/k/v arguments, outputs and gradients (see
// "Precision" above): T for float and double, float for the half types.
template <class T>
using compute_t = std::conditional_t<is_half_v<T>, float, T>;

// The operands of the score rules, optional, shared by every attention
// call (see "The score rules" above). F is the call's compute type.
template <class F>
struct ScoreArgs {
  View4<const bool> mask{};        // (B|1, H|1, L|1, S|1)
  View4<const F> bias{};           // (B|1, H|1, L|1, S|1)
  View1<const F> alibi_slopes{};   // (H); finite
  View1<const F> sinks{};          // (H); no NaN or +Inf
};

template <class T>
struct SdpaArgs : ScoreArgs<compute_t<T>> {
  View4<const T> q, k, v;
  View1<const int64_t> key_lengths{};  // optional, (B)
};

// What the forward writes. `out` is required; `weights` (B, H, L, S) and
// `lse` (B, H, L), the log-sum-exp of each row's scores, are written when
// given (non-empty).
template <class T>
struct SdpaOutputs {
  View4<T> out;        // (B, H, L, Ev)
  View4<T> weights{};  // optional
  View3<T> lse{};      // optional
};

// What the forward saves for the backward: its own `out` and `lse`, both
// optional. SdpaSaved<T>{outputs.out, outputs.lse} passes them on.
template <class T>
struct SdpaSaved {
  View4<const T> out{};  // (B, H, L, Ev)
  View3<const T> lse{};  // (B, H, L)
};

// What the backward writes: dq, dk, dv required, dbias optional.
template <class T>
struct SdpaGrads {
  View4<T> dq;     // (B, H, L, E)
  View4<T> dk;     // (B, Hkv, S, E), summed over the query heads of each group
  View4<T> dv;     // (B, Hkv, S, Ev)
  View4<T> dbias{};  // optional; same shape as args.bias
  View1<T> dsinks{};  // optional, (H): the sinks' gradient summed over B and L
};

// Forward: Y = softmax(Q·Kᵀ·scale + bias + mask)·V into outputs.out, and the
// weights and lse when requested. T: float, double, float16_t, bfloat16_t.
template <class T>
void scaled_dot_product_attention(const SdpaArgs<T>& args, const SdpaOutputs<compute_t<T>>& outputs,
                                  const SdpaOptions& opt = {});

// Backward: given dout = dL/dY, writes dq, dk, dv (and dbias when requested).
// `saved` is the forward's saved state for these same args and options (see
// "Forward -> backward contract" above); an empty SdpaSaved is always
// allowed. Outputs are overwritten, not accumulated into.
template <class T>
void scaled_dot_product_attention_backward(const SdpaArgs<T>& args, View4<const compute_t<T>> dout,
                                           const SdpaSaved<compute_t<T>>& saved,
                                           const SdpaGrads<compute_t<T>>& grads, const SdpaOptions& opt = {});

// The backend `opt.backend` resolves to for this request (after validation).
template <class T>
Backend resolve_backend(const SdpaArgs<T>& args, const SdpaOptions& opt);

// The standard per-head slopes (ScoreArgs::alibi_slopes): the ALiBi paper's slopes for H heads: 2^(-8(h+1)/H) for h = 0..H-1 when H
// is a power of two; otherwise, with n the largest power of two below H, the
// n slopes for n heads followed by every other slope for 2n heads (the first
// H - n of 2^(-8(2i+1)/(2n))), as in the paper's code and BLOOM.
std::vector<double> alibi_slopes(int64_t num_heads);

// The softmax every attn backend and layer uses, public on purpose (tools
// and tests compare against it): y = exp(x - max) / sum, numerically stable
// for finite x of any magnitude; y may alias x; returns the log-sum-exp.
// All -inf (or n = 0) gives y = 0 and returns -inf; a NaN or +inf entry makes
// y NaN at every entry that is not -inf (0 at those) and the result NaN. Throws attn::InvalidArgument for n < 0 or a
// null pointer with n > 0.
template <class T>
T softmax(const T* x, T* y, int64_t n);

}  // namespace attn
