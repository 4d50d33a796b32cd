// Shared test helpers: random tensors, the one tolerance rule, and a
// comparison that reports the worst element with its index and both values.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attn/attn.hpp"

namespace attn::testing {

template <class T>
Tensor<T> random_tensor(std::vector<int64_t> shape, std::mt19937_64& rng, double stddev = 1.0) {
  Tensor<T> t(std::move(shape));
  std::normal_distribution<double> nd(0.0, stddev);
  for (size_t i = 0; i < t.size(); ++i) t[i] = T(nd(rng));
  return t;
}

template <class T, int R>
double max_abs(const View<T, R>& v) {
  double m = 0;
  std::array<int64_t, R> idx{};
  for (int64_t f = 0; f < v.numel(); ++f) {
    int64_t off = 0;
    for (int i = 0; i < R; ++i) off += idx[size_t(i)] * v.strides[size_t(i)];
    m = std::max(m, std::abs(double(v.data[off])));
    for (int i = R - 1; i >= 0; --i) {
      if (++idx[size_t(i)] < v.shape[size_t(i)]) break;
      idx[size_t(i)] = 0;
    }
  }
  return m;
}

// The tolerance for a result of type T computed by a reduction over
// `reduction_len` terms whose magnitudes are about `magnitude`:
//   factor · eps(T) · sqrt(reduction_len) · max(magnitude, 1)
// (rounding errors of independent terms grow like the square root of their
// count; `factor` absorbs the constant of the algorithm).
template <class T>
double tolerance(int64_t reduction_len, double magnitude, double factor = 20.0) {
  return factor * double(std::numeric_limits<T>::epsilon()) *
         std::sqrt(double(std::max<int64_t>(reduction_len, 1))) * std::max(magnitude, 1.0);
}

// Compares two same-shaped views elementwise with an absolute tolerance;
// on failure names the worst element, its index and both values.
template <class A, class B, int R>
::testing::AssertionResult all_close(const View<A, R>& got, const View<B, R>& want, double tol,
                                     const std::string& what = "") {
  if (got.shape != want.shape)
    return ::testing::AssertionFailure() << what << ": shape " << shape_str(got.shape) << " != " << shape_str(want.shape);
  double worst = -1;
  std::array<int64_t, R> worst_idx{}, idx{};
  double wg = 0, ww = 0;
  bool nan = false;
  for (int64_t f = 0; f < got.numel(); ++f) {
    int64_t og = 0, ow = 0;
    for (int i = 0; i < R; ++i) {
      og += idx[size_t(i)] * got.strides[size_t(i)];
      ow += idx[size_t(i)] * want.strides[size_t(i)];
    }
    const double g = double(got.data[og]), w = double(want.data[ow]);
    double err = std::abs(g - w);
    if (std::isnan(g) != std::isnan(w) || (std::isinf(g) || std::isinf(w))) {
      if (!(g == w)) err = std::numeric_limits<double>::infinity();
      else err = 0;
    }
    if (std::isnan(g) || std::isnan(w)) nan = nan || !(std::isnan(g) && std::isnan(w));
    if (err > worst) {
      worst = err;
      worst_idx = idx;
      wg = g;
      ww = w;
    }
    for (int i = R - 1; i >= 0; --i) {
      if (++idx[size_t(i)] < got.shape[size_t(i)]) break;
      idx[size_t(i)] = 0;
    }
  }
  if (worst <= tol && !nan) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(10);
  os << what << ": worst element at " << shape_str(worst_idx) << " got " << wg << " expected " << ww
     << " (|diff| = " << worst << ", tolerance " << tol << ")" << (nan ? " [NaN mismatch]" : "");
  return ::testing::AssertionFailure() << os.str();
}

template <class A, class B>
::testing::AssertionResult all_close(const Tensor<A>& got, const Tensor<B>& want, double tol,
                                     const std::string& what = "") {
  if (got.shape() != want.shape()) return ::testing::AssertionFailure() << what << ": shapes differ";
  View<const A, 1> g(got.data(), {int64_t(got.size())});
  View<const B, 1> w(want.data(), {int64_t(want.size())});
  return all_close(g, w, tol, what);
}

template <class T, int R>
bool all_finite(const View<T, R>& v) {
  bool ok = true;
  std::array<int64_t, R> idx{};
  for (int64_t f = 0; f < v.numel(); ++f) {
    int64_t off = 0;
    for (int i = 0; i < R; ++i) off += idx[size_t(i)] * v.strides[size_t(i)];
    if (!std::isfinite(double(v.data[off]))) ok = false;
    for (int i = R - 1; i >= 0; --i) {
      if (++idx[size_t(i)] < v.shape[size_t(i)]) break;
      idx[size_t(i)] = 0;
    }
  }
  return ok;
}
template <class T>
bool all_finite(const Tensor<T>& t) {
  for (size_t i = 0; i < t.size(); ++i)
    if (!std::isfinite(double(t[i]))) return false;
  return true;
}

// Runs `fn` and checks that it throws an E (an attn::Error by default; ask
// for attn::InvalidArgument or attn::FileError to pin the kind) whose message
// contains every one of `parts`.
template <class E = attn::Error, class F>
::testing::AssertionResult throws_with(F&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const auto& p : parts)
      if (msg.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << p << "\"";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw another kind of exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace attn::testing
