// Internal: the score rules, the one place that says which keys a query sees
// and what its score is. The boundary resolves a call's arguments and
// options into one ScoreRules (src/rules.cpp, after validation); every
// backend (reference, fused forward and backward, decode, chunked prefill,
// varlen, ring) reads that struct and asks these functions; none re-derives
// a rule of its own. The SIMD twin of the per-score part is
// kernels/fused/pipeline-inl.h.
//
// Positions. Key j sits at position key_origin + j. Query row i of sequence
// b sits at position key_origin + i + offset[b], where offset[b] is the
// call's `position_offset` when given, else 0 (top-left alignment) or
// S − L (bottom-right); over a KV cache it is length(b) − L (the new rows
// are the last L tokens). key_origin is 0 for a whole call; a piece of a
// call that starts at key j0 (a chunk of chunked prefill, a block of the
// ring) has key_origin j0, so every rule still sees whole-call positions.
// Every rule that uses positions (causal, window, chunks, ALiBi) reads them
// from here; a packed variable-length batch applies them per sequence with
// that sequence's L and S (see src/varlen.cpp).
//
// A score goes through the rules in this order:
//
//   u = scale · q_i · k_j                               (the backends' product)
//   s = c · tanh(u / c)            soft-cap, when c > 0 (Gemma 2)
//     − slope_h · |pos_i − pos_j|  ALiBi, when slopes are given (FlashAttention 2)
//     + bias_bhij                  additive bias, when given
//   s = −∞ where the key is not visible (band or boolean mask)
//
// and the row's softmax may include one more logit, the head's sink (gpt-oss):
//   lse_i = log(exp(sink_h) + Σ_j exp(s_ij)),  p_ij = exp(s_ij − lse_i),
//   out_i = Σ_j p_ij v_j   (the sink takes weight exp(sink_h − lse_i) and
//   contributes no value). A row with no visible key then has out = 0 and
//   lse = sink_h (finite); without a sink it has out = 0, lse = −∞.
//
// Visibility has two kinds of rule:
//  * the band, structured and per row: causal (pos_j <= pos_i), the window
//    (pos_i − left <= pos_j <= pos_i + right, −1 = unbounded on that side;
//    causal is right = 0), chunks (pos_i / C == pos_j / C, rounding down:
//    Llama 4's local attention) and key lengths (j < key_end[b]). Row i sees
//    exactly the keys [lo(i), hi(i)); lo and hi never decrease with i, so a
//    whole tile of rows × keys is classified as empty, full or partial in
//    O(rows), and the rows that see a range of keys are an interval found by
//    bisection. This is what lets the kernels skip tiles: their cost grows
//    with the visible band, not with L·S.
//  * elementwise: the boolean mask and −∞ entries of the bias. They never
//    make a tile empty by themselves (the kernels compute partial tiles).
//
// Derivatives for the backward (dS = ∂loss/∂s, known from the softmax):
//   ∂s/∂u    = 1 − tanh²(u/c) = 1 − (capped/c)²  (1 without a soft-cap)
//   ∂s/∂bias = 1, so dbias = dS
//   ∂loss/∂sink_h = −Σ_{b,i} exp(sink_h − lse_i) · D_i,  D_i = Σ_e dout_ie·out_ie
//   (the sink's probability times (0 − D_i): its "value" is zero).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"

namespace attn::detail {

namespace rules {

// The keys [lo, hi) one query row sees (lo == hi: none).
struct Keys {
  int64_t lo = 0, hi = 0;
  bool empty() const { return lo >= hi; }
};

enum class Tile { empty, partial, full };

// ⌊a / b⌋ for b > 0 (positions may be negative).
inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// The band rule of one (batch, head) slice: causal, window, chunks and key
// length folded into one interval per row.
struct Band {
  int64_t offset = 0;      // position of query row 0 minus that of key 0
  int64_t left = -1;       // keys at most `left` positions before the query (−1: any)
  int64_t right = -1;      // keys at most `right` positions after it (−1: any; causal: 0)
  int64_t chunk = 0;       // chunk length in positions (0: no chunks)
  int64_t key_origin = 0;  // position of key 0 (where the chunks start)
  int64_t key_end = 0;     // keys at or past this are not visible (S or the key length)

  Keys keys(int64_t i) const {
    const int64_t pos = i + offset;  // relative to key 0
    int64_t lo = 0, hi = key_end;
    if (left >= 0) lo = std::max(lo, pos - left);
    if (right >= 0) hi = std::min(hi, pos + right + 1);
    if (chunk > 0) {  // the keys of the query's own chunk
      const int64_t first = floor_div(pos + key_origin, chunk) * chunk - key_origin;
      lo = std::max(lo, first);
      hi = std::min(hi, first + chunk);
    }
    lo = std::clamp<int64_t>(lo, 0, key_end);
    return {lo, std::clamp<int64_t>(hi, lo, key_end)};
  }
  bool visible(int64_t i, int64_t j) const {
    const Keys k = keys(i);
    return j >= k.lo && j < k.hi;
  }

  // The keys any of rows [i0, i1) sees: [lo(i0), hi(i1 − 1)) (monotone).
  Keys keys_of_rows(int64_t i0, int64_t i1) const {
    if (i0 >= i1) return {};
    const Keys a = keys(i0), b = keys(i1 - 1);
    return {a.lo, std::max(a.lo, b.hi)};
  }

  // Rows [first, end) of [i_begin, i_end) that see at least one key of
  // [j0, j1): hi(i) > j0 holds for a suffix of rows and lo(i) < j1 for a
  // prefix, so both ends are found by bisection.
  std::pair<int64_t, int64_t> rows_seeing(int64_t j0, int64_t j1, int64_t i_begin, int64_t i_end) const {
    auto first_true = [&](auto pred) {  // smallest i in [i_begin, i_end] with pred(i), pred monotone
      int64_t lo = i_begin, hi = i_end;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (pred(mid)) hi = mid;
        else lo = mid + 1;
      }
      return lo;
    };
    const int64_t first = first_true([&](int64_t i) { return keys(i).hi > j0; });
    const int64_t end = first_true([&](int64_t i) { return keys(i).lo >= j1; });
    return {first, std::max(first, end)};
  }

  // Whether the tile rows [i0, i0 + nr) × keys [j0, j0 + nk) has no visible
  // score, only visible scores (as far as the band goes), or some of each.
  Tile classify(int64_t i0, int64_t nr, int64_t j0, int64_t nk) const {
    bool any = false, all = true;
    for (int64_t i = i0; i < i0 + nr; ++i) {
      const Keys k = keys(i);
      const int64_t lo = std::max(k.lo, j0), hi = std::min(k.hi, j0 + nk);
      if (lo < hi) any = true;
      if (lo != j0 || hi != j0 + nk) all = false;
    }
    return !any ? Tile::empty : all ? Tile::full : Tile::partial;
  }
};

// One line of a broadcastable (Bx, Hx, Lx, Sx) operand (mask or bias) for
// (b, h): along the keys of query row i (key_row) or along the queries of
// key j (query_column); size-1 axes broadcast. at(n) = X(b, h, i, n) or
// X(b, h, n, j).
template <class T>
struct Line {
  const T* base = nullptr;
  int64_t stride = 0;
  const T& at(int64_t n) const { return base[n * stride]; }
};
template <class T>
Line<T> broadcast_line(const View4<const T>& x, int64_t b, int64_t h, int64_t fixed, int fixed_axis) {
  auto bc = [&](int64_t idx, int axis) { return x.dim(axis) == 1 ? int64_t(0) : idx * x.strides[size_t(axis)]; };
  const int along = fixed_axis == 2 ? 3 : 2;
  return {x.data + bc(b, 0) + bc(h, 1) + bc(fixed, fixed_axis), x.dim(along) == 1 ? int64_t(0) : x.strides[size_t(along)]};
}
template <class T>
Line<T> key_row(const View4<const T>& x, int64_t b, int64_t h, int64_t i) {
  return broadcast_line(x, b, h, i, 2);
}
template <class T>
Line<T> query_column(const View4<const T>& x, int64_t b, int64_t h, int64_t j) {
  return broadcast_line(x, b, h, j, 3);
}

// A (B|1, H|1, L|1, K|1) operand (mask or bias) of sequence b over keys
// [j0, j0 + n): a (1, H|1, L|1, n|1) view.
template <class T>
View4<const T> sequence_keys(const View4<const T>& x, int64_t b, int64_t j0, int64_t n) {
  if (x.empty()) return {};
  const bool along = x.dim(3) != 1;
  return View4<const T>(x.data + (x.dim(0) == 1 ? 0 : b * x.strides[0]) + (along ? j0 * x.strides[3] : 0),
                        {1, x.dim(1), x.dim(2), along ? n : 1}, x.strides);
}

}  // namespace rules

// The resolved rule set of one call: everything that decides a score. Built
// once by resolve_rules (src/rules.cpp) from the public arguments and
// options after validation; F is the call's compute type (float, or double
// for the reference backend in double). Per-sequence entries have B
// elements.
template <class F>
struct ScoreRules {
  double scale = 1.0;
  // The band (see Band): causal, the window, chunks, positions, key lengths.
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // −1: unbounded
  int64_t chunk = 0;                            // 0: no chunks
  int64_t key_origin = 0;                       // position of key 0
  std::vector<int64_t> offset;   // per sequence: position of query row 0 − that of key 0
  std::vector<int64_t> key_end;  // per sequence: keys at or past this are not visible
  // The score modifiers, in the order of the essay above.
  double softcap = 0;             // c; 0 = off
  View1<const F> alibi_slopes{};  // (H) or empty
  View4<const F> bias{};          // (B|1, H|1, L|1, S|1) or empty; −∞ hides
  View4<const bool> mask{};       // the same shape or empty; true = visible
  View1<const F> sinks{};         // (H) or empty

  rules::Band band(int64_t b) const {
    rules::Band r;
    r.offset = offset[size_t(b)];
    r.left = window_left;
    r.right = causal ? 0 : window_right;  // causal intersects a wider right side
    r.chunk = chunk;
    r.key_origin = key_origin;
    r.key_end = key_end[size_t(b)];
    return r;
  }
  bool capped() const { return softcap > 0; }
  bool alibi() const { return !alibi_slopes.empty(); }
  bool elementwise() const { return !mask.empty() || !bias.empty(); }
  F slope(int64_t h) const { return alibi_slopes.empty() ? F(0) : alibi_slopes(h); }
  // Head h's sink logit (−∞: none).
  F sink(int64_t h) const { return sinks.empty() ? -std::numeric_limits<F>::infinity() : sinks(h); }

  // The rules of sequence b's keys [j0, j0 + n) as a call of batch 1 over
  // those keys (a chunk of chunked prefill, a sequence of the reference's
  // cache read-back): the same positions, mask and bias sliced.
  ScoreRules keys_of(int64_t b, int64_t j0, int64_t n) const {
    ScoreRules r = *this;
    r.key_origin = key_origin + j0;
    r.offset = {offset[size_t(b)] - j0};
    r.key_end = {std::clamp<int64_t>(key_end[size_t(b)] - j0, 0, n)};
    r.mask = rules::sequence_keys(mask, b, j0, n);
    r.bias = rules::sequence_keys(bias, b, j0, n);
    return r;
  }

  // ---- the scalar pipeline (the reference backend) ----
  // s from u = scale·q·k for a visible pair (b, h, i, j) without its bias:
  // soft-cap then ALiBi; *ds_du receives ∂s/∂u.
  double modified(double u, int64_t b, int64_t h, int64_t i, int64_t j, double* ds_du) const {
    double s = u, d = 1;
    if (capped()) {
      s = softcap * std::tanh(u / softcap);
      const double t = s / softcap;
      d = 1 - t * t;
    }
    if (alibi()) s -= double(slope(h)) * double(std::abs(i + offset[size_t(b)] - j));
    if (ds_du) *ds_du = d;
    return s;
  }
  // The elementwise part for a pair inside the band: whether the mask and
  // the bias leave it visible, and the bias to add.
  bool elementwise_visible(int64_t b, int64_t h, int64_t i, int64_t j, double* add) const {
    *add = 0;
    if (!mask.empty() && !rules::key_row(mask, b, h, i).at(j)) return false;
    if (!bias.empty()) {
      *add = double(rules::key_row(bias, b, h, i).at(j));
      if (*add == -std::numeric_limits<double>::infinity()) return false;
    }
    return true;
  }
};

// The per-head operands of ScoreArgs by name, for code that treats them
// alike: the distributed calls agree on their values across ranks, the
// multi-head layer keeps copies for its backward, a call over some of the
// heads slices them.
template <class F>
struct PerHeadOperand {
  const char* name;
  View1<const F> ScoreArgs<F>::*member;
};
template <class F>
inline constexpr std::array<PerHeadOperand<F>, 2> kPerHeadOperands{
    {{"alibi_slopes", &ScoreArgs<F>::alibi_slopes}, {"sinks", &ScoreArgs<F>::sinks}}};

// Whether the operands make a score depend on the positions of its query
// and key (the per-head slopes), beyond the band.
template <class F>
bool operands_read_positions(const ScoreArgs<F>& a) {
  return !a.alibi_slopes.empty();
}

// The operands of query heads [h0, h0 + n): per-head views and the head
// axis of the mask and bias sliced (a size-1 head axis broadcasts as is).
template <class F>
ScoreArgs<F> heads_of(const ScoreArgs<F>& a, int64_t h0, int64_t n) {
  ScoreArgs<F> r = a;
  for (const auto& op : kPerHeadOperands<F>) {
    const View1<const F>& v = a.*op.member;
    if (!v.empty()) r.*op.member = View1<const F>(v.data + h0 * v.strides[0], {n}, v.strides);
  }
  const auto heads = [&](const auto& x) {
    using V = std::decay_t<decltype(x)>;
    if (x.empty() || x.dim(1) == 1) return x;
    return V(x.data + h0 * x.strides[1], {x.dim(0), n, x.dim(2), x.dim(3)}, x.strides);
  };
  r.mask = heads(a.mask);
  r.bias = heads(a.bias);
  return r;
}

}  // namespace attn::detail
