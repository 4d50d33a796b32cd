// Internal: the online (streaming) softmax of one row, as a small unit.
//
// A row of scores arrives in pieces (key tiles). Instead of storing the row,
// we keep two numbers per row: the largest score seen so far (`max`) and the
// sum of exp(score − max) over the keys seen so far (`sum`). Every value the
// row has accumulated so far (the weighted sum of value vectors) is scaled
// relative to the same `max`, so when a new piece raises the maximum, the old
// sum and the old accumulator are multiplied by exp(old max − new max).
// At the end, out = acc / sum and lse = max + log(sum).
//
// Two partial results over disjoint key sets merge the same way, so the
// answer does not depend on how the keys were split (up to rounding).
//
// Scores may be measured in either base: natural (exp/log) or base 2
// (exp2/log2), when the caller has multiplied them by log2(e) so that its
// exponentials skip a range-reduction multiply; every function takes the base
// as a template argument and the lse then comes out in that base.
//
// The −∞ guards live here and only here: a row that has seen no visible key
// has max = −∞ and sum = 0; its rescale factor is 0 (not NaN), the shift
// used for exponentials is 0 (so exp(−∞ − 0) = 0), and it finalises to
// lse = −∞ with a zero output.
//
// NaN is the opposite case and is not guarded against: a NaN score, or a +∞
// one (exp(+∞ − +∞) is NaN), makes the tile's sum NaN, every later step keeps
// it, and the row finalises to a NaN lse and factor, so the whole output row
// is NaN. (The running max alone would lose a NaN: max ignores it.)
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

namespace attn::detail::online_softmax {

template <class T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

struct Natural {
  template <class T>
  static T exp(T x) { return std::exp(x); }
  template <class T>
  static T log(T x) { return std::log(x); }
};
struct Base2 {
  template <class T>
  static T exp(T x) { return std::exp2(x); }
  template <class T>
  static T log(T x) { return std::log2(x); }
};

template <class T>
struct State {
  T max = neg_inf<T>();  // largest visible score so far
  T sum = T(0);          // Σ exp(score − max) over the visible keys so far
};

// What a caller needs to fold a new tile into a row: multiply the old
// accumulator by `alpha`, and exponentiate the tile's scores as exp(s − shift).
template <class T>
struct Step {
  T alpha;
  T shift;
};

// exp(from − to) for to >= from, with exp(−∞ − anything) = 0. A finite
// max the tile did not raise gives exp(0) = 1 without the call (most tiles
// of a long row: the exponential was about 3% of a decoding call).
template <class Base = Natural, class T>
T rescale_factor(T from, T to) {
  if (from == to && std::isfinite(from)) return T(1);
  return from == neg_inf<T>() ? T(0) : Base::exp(from - to);
}

// First half of an update: the tile's largest score is `tile_max`. Raises
// st.max, rescales st.sum, and returns how to rescale the accumulator and
// which shift to use for the tile's exponentials.
template <class Base = Natural, class T>
Step<T> begin_tile(State<T>& st, T tile_max) {
  const T new_max = std::max(st.max, tile_max);
  const T alpha = rescale_factor<Base>(st.max, new_max);
  st.max = new_max;
  st.sum *= alpha;  // sum <- sum · exp(old max − new max)
  return {alpha, new_max == neg_inf<T>() ? T(0) : new_max};
}

// Second half: `tile_sum` = Σ exp(s − shift) over the tile's scores.
template <class T>
void end_tile(State<T>& st, T tile_sum) {
  st.sum += tile_sum;
}

// Folds n scores into the state and writes p_j = exp(s_j − shift) (the
// unnormalised probabilities relative to the new max). Returns the factor the
// caller's accumulator must be multiplied by before adding p·V.
template <class Base = Natural, class T>
T update(State<T>& st, const T* s, int n, T* p) {
  T tile_max = neg_inf<T>();
  for (int j = 0; j < n; ++j) tile_max = std::max(tile_max, s[j]);
  const Step<T> step = begin_tile<Base>(st, tile_max);
  T tile_sum = 0;
  for (int j = 0; j < n; ++j) {
    p[j] = Base::exp(s[j] - step.shift);  // exp(−∞) = 0 for masked keys
    tile_sum += p[j];
  }
  end_tile(st, tile_sum);
  return step.alpha;
}

// The weights of two partial results over disjoint key sets in their merge:
// merged.acc = wa·a.acc + wb·b.acc.
template <class T>
struct MergeWeights {
  T wa, wb;
};

template <class Base = Natural, class T>
MergeWeights<T> merge(State<T>& a, const State<T>& b) {
  const T m = std::max(a.max, b.max);
  const T wa = rescale_factor<Base>(a.max, m), wb = rescale_factor<Base>(b.max, m);
  a.sum = a.sum * wa + b.sum * wb;  // both sums relative to the common max
  a.max = m;
  return {wa, wb};
}

// The final factor for the accumulator (1/sum, or 0 for a row that saw no
// visible key, NaN for a poisoned row) and the row's log-sum-exp (−∞, NaN).
template <class T>
struct Final {
  T inv_sum;
  T lse;
};

template <class Base = Natural, class T>
Final<T> finalize(const State<T>& st) {
  if (st.sum != st.sum) return {st.sum, st.sum};  // poisoned by a NaN or +∞ score
  if (st.sum == T(0)) return {T(0), neg_inf<T>()};
  return {T(1) / st.sum, st.max + Base::log(st.sum)};
}

// The probability of a score given the row's log-sum-exp, as the backward
// recomputes it: exp(s − lse), and 0 for a row with lse = −∞.
template <class T>
T lse_shift(T lse) {
  return lse == neg_inf<T>() ? std::numeric_limits<T>::infinity() : lse;
}

}  // namespace attn::detail::online_softmax
