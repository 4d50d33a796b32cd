// Internal: the one row softmax of the library (the reference backend, the
// public attn::softmax and the training loss all call it).
//
//   y_j = exp(x_j - m) / Σ_k exp(x_k - m),  m = max_k x_k,  returns m + log Σ
//
// Accumulates in double whatever the element types. Rows with no finite
// entry (all -inf, or n = 0) become 0 and return -inf: a fully masked row.
// A NaN or +inf entry poisons the row: NaN at every visible (not -inf) entry,
// 0 at the masked ones, and the result NaN, so a poisoned input is never
// mistaken for a masked one. y may alias x.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace attn::detail {

// The poisoned row: NaN where x is visible (not -inf), 0 where it is masked;
// returns NaN. y may alias x.
template <class In, class Out>
double poison_row(const In* x, Out* y, int64_t n) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  for (int64_t j = 0; j < n; ++j) y[j] = double(x[j]) == -std::numeric_limits<double>::infinity() ? Out(0) : Out(kNaN);
  return kNaN;
}

// `sink` (an attention sink's logit; -inf = none) joins the maximum and the
// denominator without a value of its own: a row whose entries are all -inf
// then puts all its weight on the sink (y = 0) and returns the sink.
template <class In, class Out>
double softmax(const In* x, Out* y, int64_t n, double sink = -std::numeric_limits<double>::infinity()) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  double m = sink;
  for (int64_t j = 0; j < n; ++j) {
    const double v = double(x[j]);
    if (std::isnan(v) || v == -kNegInf) return poison_row(x, y, n);
    if (v > m) m = v;
  }
  if (m == kNegInf) {
    for (int64_t j = 0; j < n; ++j) y[j] = Out(0);
    return kNegInf;
  }
  double sum = sink == kNegInf ? 0.0 : std::exp(sink - m);
  for (int64_t j = 0; j < n; ++j) {
    y[j] = Out(std::exp(double(x[j]) - m));  // every exponent <= 0; exp(-inf) = 0 for masked keys
    sum += double(y[j]);
  }
  for (int64_t j = 0; j < n; ++j) y[j] = Out(double(y[j]) / sum);
  return m + std::log(sum);
}

}  // namespace attn::detail
