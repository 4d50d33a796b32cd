// Shared test helpers: random tensors, the one tolerance rule, a comparison
// that reports the worst element with its index and both values, and the one
// finite-difference gradient check every C++ test uses.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
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

// The finite-difference gradient check. `loss` is a scalar function of the
// elements of `x` (it reads them through the view); `analytic` is the
// gradient dloss/dx claimed by a backward, with x's shape. Each checked
// element is moved by ±h and
//   numeric = (loss(x + h) − loss(x − h)) / 2h
// (central differences: error about h²·|loss'''| plus the rounding
// eps·|loss|/h, about 1e-10·|loss| in double at h = 1e-6). It must match
// within rtol · max(1, max |numeric|): a wrong derivative is off by the size
// of the gradient, far above that. Entries that are ±inf (a masked bias) are
// skipped: their gradient must be 0. With max_points > 0 only that many
// elements, spread evenly, are moved (for large parameters). With `nonzero`,
// an all-zero numeric gradient fails: a check of zeros against zeros proves
// little.
struct GradCheck {
  double h = 1e-6;
  double rtol = 1e-6;
  int64_t max_points = 0;  // 0 = every element
  bool nonzero = true;
};

template <int R>
::testing::AssertionResult gradient_check(View<double, R> x, View<const double, R> analytic,
                                          const std::function<double()>& loss, const std::string& what,
                                          const GradCheck& opt = {}) {
  if (x.shape != analytic.shape)
    return ::testing::AssertionFailure() << what << ": gradient shape " << shape_str(analytic.shape)
                                         << " != input shape " << shape_str(x.shape);
  const int64_t n = x.numel();
  const int64_t step = opt.max_points > 0 ? std::max<int64_t>(1, n / opt.max_points) : 1;
  std::vector<int64_t> ox, oa, flat;  // offsets in x and in analytic, row-major index
  std::array<int64_t, R> idx{};
  for (int64_t f = 0; f < n; ++f) {
    if (f % step == 0) {
      int64_t a = 0, b = 0;
      for (int i = 0; i < R; ++i) {
        a += idx[size_t(i)] * x.strides[size_t(i)];
        b += idx[size_t(i)] * analytic.strides[size_t(i)];
      }
      ox.push_back(a);
      oa.push_back(b);
      flat.push_back(f);
    }
    for (int i = R - 1; i >= 0; --i) {
      if (++idx[size_t(i)] < x.shape[size_t(i)]) break;
      idx[size_t(i)] = 0;
    }
  }
  std::vector<double> numeric(ox.size(), 0.0);
  double scale = 0;
  for (size_t p = 0; p < ox.size(); ++p) {
    double& xi = x.data[ox[p]];
    const double keep = xi;
    if (std::isinf(keep)) continue;
    xi = keep + opt.h;
    const double up = loss();
    xi = keep - opt.h;
    const double down = loss();
    xi = keep;
    numeric[p] = (up - down) / (2 * opt.h);
    scale = std::max(scale, std::abs(numeric[p]));
  }
  const double tol = opt.rtol * std::max(1.0, scale);
  double worst = -1;
  size_t wp = 0;
  for (size_t p = 0; p < ox.size(); ++p) {
    const double a = analytic.data[oa[p]];
    const double err = std::isnan(a) ? std::numeric_limits<double>::infinity() : std::abs(a - numeric[p]);
    if (err > worst) worst = err, wp = p;
  }
  if (opt.nonzero && scale < 1e-3)
    return ::testing::AssertionFailure() << what << ": the numeric gradient is ~0 (max " << scale
                                         << "); a check of zeros proves little";
  if (worst <= tol) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(12);
  os << what << ": worst element " << flat[wp] << " analytic " << analytic.data[oa[wp]] << " numeric "
     << numeric[wp] << " (|diff| = " << worst << ", tolerance " << tol << ")";
  return ::testing::AssertionFailure() << os.str();
}

// The same for a whole tensor and a same-sized gradient tensor.
inline ::testing::AssertionResult gradient_check(Tensor<double>& x, const Tensor<double>& analytic,
                                                 const std::function<double()>& loss, const std::string& what,
                                                 const GradCheck& opt = {}) {
  if (x.size() != analytic.size())
    return ::testing::AssertionFailure() << what << ": gradient has " << analytic.size() << " elements, input "
                                         << x.size();
  return gradient_check<1>(View<double, 1>(x.data(), {int64_t(x.size())}),
                           View<const double, 1>(analytic.data(), {int64_t(analytic.size())}), loss, what, opt);
}

// Σ_i r_i·y_i: a scalar whose gradient with respect to y is r.
inline double dot(const Tensor<double>& r, const Tensor<double>& y) {
  double s = 0;
  for (size_t i = 0; i < r.size(); ++i) s += r[i] * y[i];
  return s;
}

// Runs `fn` and checks that it throws attn::Error whose message contains
// every one of `parts`.
template <class F>
::testing::AssertionResult throws_with(F&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
  } catch (const attn::Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts)
      if (msg.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << p << "\"";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-attn exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace attn::testing
