// Internal: the score rules, the one place that says which keys a query sees
// and what its score is. Every backend (reference and fused) asks these
// functions; none re-derives a rule of its own.
//
// Positions. Key j sits at position j. Query row i sits at position
// i + offset, where offset is the call's `position_offset` when given, else
// 0 (top-left alignment) or S - L (bottom-right). Every rule that uses
// positions (causal, window, ALiBi) reads them from here; a packed
// variable-length batch applies them per sequence with that sequence's L
// and S (see src/varlen.cpp).
//
// A score goes through the rules in this order:
//
//   u = scale · q_i · k_j                               (the backends' product)
//   s = c · tanh(u / c)            soft-cap, when c > 0 (Gemma 2)
//     − slope_h · |pos_i − j|      ALiBi, when slopes are given (FlashAttention 2)
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
//  * the band, structured and per row: causal (j <= pos_i), the window
//    (pos_i − left <= j <= pos_i + right, −1 = unbounded on that side;
//    causal is right = 0) and key lengths (j < key_lengths[b]). Row i sees
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
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "attn/tensor.hpp"

namespace attn::detail::rules {

// The keys [lo, hi) one query row sees (lo == hi: none).
struct Keys {
  int64_t lo = 0, hi = 0;
  bool empty() const { return lo >= hi; }
};

enum class Tile { empty, partial, full };

// The band rule of one (batch, head) slice: causal, window and key length
// folded into one interval per row.
struct Band {
  int64_t offset = 0;    // position of query row 0
  int64_t left = -1;     // keys at most `left` positions before the query (−1: any)
  int64_t right = -1;    // keys at most `right` positions after it (−1: any; causal: 0)
  int64_t key_end = 0;   // keys at or past this are not visible (S or the key length)

  // Causal folds into the window as right = 0 (it intersects a wider right side).
  static Band make(int64_t offset, int64_t left, int64_t right, bool causal, int64_t key_end) {
    Band b;
    b.offset = offset;
    b.left = left;
    b.right = causal ? 0 : right;
    b.key_end = key_end;
    return b;
  }
  bool unbounded() const { return left < 0 && right < 0; }

  Keys keys(int64_t i) const {
    const int64_t pos = i + offset;
    int64_t lo = 0, hi = key_end;
    if (left >= 0) lo = std::max(lo, pos - left);
    if (right >= 0) hi = std::min(hi, pos + right + 1);
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

// The position of query row 0 on the key axis for L queries and S keys.
inline int64_t query_offset(const int64_t* position_offset, bool bottom_right, int64_t L, int64_t S) {
  if (position_offset) return *position_offset;
  return bottom_right ? S - L : 0;
}

// |pos_i − j|, the distance ALiBi penalises.
inline int64_t distance(int64_t i, int64_t j, int64_t offset) { return std::abs(i + offset - j); }

// The score modifiers of one head, in the order of the essay above.
template <class F>
struct Modifiers {
  F softcap = F(0);  // c; 0 = off
  F slope = F(0);    // ALiBi slope of this head; 0 = off
  int64_t offset = 0;

  // s before the bias: soft-cap then ALiBi.
  F capped(F u) const { return softcap > F(0) ? softcap * std::tanh(u / softcap) : u; }
  F alibi(int64_t i, int64_t j) const { return -slope * F(distance(i, j, offset)); }
  F apply(F u, int64_t i, int64_t j) const { return capped(u) + alibi(i, j); }
  // ∂s/∂u from the capped value (1 without a soft-cap).
  F dcapped(F capped_u) const {
    if (!(softcap > F(0))) return F(1);
    const F t = capped_u / softcap;
    return F(1) - t * t;
  }
};

// Reads a per-head value from an optional (H) view: `none` when absent.
template <class T>
double per_head(const View1<const T>& v, int64_t h, double none) {
  return v.empty() ? none : double(v(h));
}

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

}  // namespace attn::detail::rules
