// Finite-difference gradient checks for the nn layer (double precision).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <sstream>
#include <string>

#include "attn/nn.hpp"
#include "testing.hpp"

namespace attn::testing {

// Compares `analytic` = dF/dx with central differences (F(x + h) − F(x − h))/2h
// at up to `max_points` elements of x spread over the tensor (all of them
// when x is small). Central differences in double are accurate to about
// h²·|F'''| + eps·|F|/h ≈ 1e-10 here, so the tolerance 1e-7·max(1, |g|)
// leaves room without hiding a wrong derivative (those are off by O(|g|)).
inline ::testing::AssertionResult grad_check(Tensor<double>& x, const Tensor<double>& analytic,
                                             const std::function<double()>& F, const std::string& what,
                                             int64_t max_points = 200, double h = 1e-5) {
  if (x.shape() != analytic.shape()) return ::testing::AssertionFailure() << what << ": grad shape differs";
  const int64_t n = int64_t(x.size());
  const int64_t stride = std::max<int64_t>(1, n / max_points);
  double worst = 0;
  int64_t worst_i = -1;
  double worst_num = 0, worst_ana = 0;
  for (int64_t i = 0; i < n; i += stride) {
    const double keep = x[size_t(i)];
    x[size_t(i)] = keep + h;
    const double fp = F();
    x[size_t(i)] = keep - h;
    const double fm = F();
    x[size_t(i)] = keep;
    const double num = (fp - fm) / (2 * h);
    const double ana = analytic[size_t(i)];
    const double err = std::abs(num - ana) / std::max({1.0, std::abs(num), std::abs(ana)});
    if (!(err <= worst) || std::isnan(err)) {
      worst = std::isnan(err) ? INFINITY : err;
      worst_i = i;
      worst_num = num;
      worst_ana = ana;
    }
  }
  if (worst <= 1e-7) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(12);
  os << what << ": worst element " << worst_i << " analytic " << worst_ana << " numeric " << worst_num
     << " (relative error " << worst << ")";
  return ::testing::AssertionFailure() << os.str();
}

// sum_i r_i·y_i: a scalar whose gradient with respect to y is r.
inline double dot(const Tensor<double>& r, const Tensor<double>& y) {
  double s = 0;
  for (size_t i = 0; i < r.size(); ++i) s += r[i] * y[i];
  return s;
}

}  // namespace attn::testing
