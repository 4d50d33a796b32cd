// Shared by the tests of bfloat16 compute (test_bf16_compute.cpp: the fused
// forward; test_decode_bf16.cpp: the decode kernel): the exact attention of
// the bfloat16-rounded q, k, v (the reference backend in double) and the
// error bound of docs/fused.md ("bfloat16 compute") against it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attn/sdpa.hpp"
#include "kernels/fused/bf16.hpp"
#include "kernels/fused/common.hpp"
#include "sdpa_case.hpp"
#include "validate.hpp"

namespace attn::testing {

constexpr double kU = 0x1p-8;    // bfloat16's unit roundoff
constexpr double kF = 0x1p-24;   // float32's
inline const float kNaNf = std::numeric_limits<float>::quiet_NaN();
inline const float kInf = std::numeric_limits<float>::infinity();

// The paths this machine runs: always the portable one and the AMX code on
// emulated tiles, the native ones where the CPU has them.
inline std::vector<detail::Bf16Path> runnable_paths() {
  using detail::Bf16Path;
  std::vector<Bf16Path> paths{Bf16Path::portable, Bf16Path::amx_emulated};
  for (Bf16Path p : {Bf16Path::avx512_bf16, Bf16Path::amx})
    if (detail::bf16_path_available(p)) paths.push_back(p);
  return paths;
}

inline double rounded(float x) { return double(detail::bf16_value(detail::bf16_operand(x))); }
inline bool same_bits(const Tensor<float>& a, const Tensor<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A forward's outputs.
struct Fwd {
  Tensor<float> out, lse;
};

// Outputs of a public call.
template <class T>
Fwd call(const SdpaArgs<T>& a, const SdpaOptions& opt) {
  Fwd r{Tensor<float>({a.q.dim(0), a.q.dim(1), a.q.dim(2), a.v.dim(3)}),
        Tensor<float>({a.q.dim(0), a.q.dim(1), a.q.dim(2)})};
  scaled_dot_product_attention(a, {r.out.view4(), {}, r.lse.view<3>()}, opt);
  return r;
}

// The exact attention of the rounded q, k, v (the reference backend in
// double), its weights, and the rounded values.
struct Ref {
  Tensor<double> out, lse, w, v;
  double m = 0;  // the largest magnitude of a score's terms
};
inline Tensor<double> rounded_copy(const View4<const float>& x, bool round = true) {
  Tensor<double> t({x.dim(0), x.dim(1), x.dim(2), x.dim(3)});
  auto d = t.view4();
  for (int64_t b = 0; b < x.dim(0); ++b)
    for (int64_t h = 0; h < x.dim(1); ++h)
      for (int64_t n = 0; n < x.dim(2); ++n)
        for (int64_t f = 0; f < x.dim(3); ++f) d(b, h, n, f) = round ? rounded(x(b, h, n, f)) : double(x(b, h, n, f));
  return t;
}
// (round_inputs false: of the unrounded ones.)
inline Ref reference(const SdpaArgs<float>& a, SdpaOptions opt, bool round_inputs = true) {
  const Tensor<double> q = rounded_copy(a.q, round_inputs), k = rounded_copy(a.k, round_inputs);
  Ref r;
  r.v = rounded_copy(a.v, round_inputs);
  Tensor<double> bias, slopes, sinks;
  SdpaArgs<double> d;
  d.q = q.view4(), d.k = k.view4(), d.v = r.v.view4(), d.mask = a.mask, d.key_lengths = a.key_lengths;
  const auto widen = [](auto view, Tensor<double>& t) {
    t = Tensor<double>(std::vector<int64_t>(view.shape.begin(), view.shape.end()));
    size_t f = 0;
    detail::for_each(view, [&](float x, const auto&) { t[f++] = double(x); });
  };
  double bias_max = 0, slope_max = 0;
  if (!a.bias.empty()) {
    widen(a.bias, bias), d.bias = bias.view4();
    for (size_t i = 0; i < bias.size(); ++i) bias_max = std::max(bias_max, std::isinf(bias[i]) ? 0.0 : std::abs(bias[i]));
  }
  if (!a.alibi_slopes.empty()) {
    widen(a.alibi_slopes, slopes), d.alibi_slopes = slopes.view<1>();
    for (size_t i = 0; i < slopes.size(); ++i) slope_max = std::max(slope_max, slopes[i]);
  }
  if (!a.sinks.empty()) widen(a.sinks, sinks), d.sinks = sinks.view<1>();
  opt.backend = Backend::reference;
  opt.compute_dtype.reset();
  const int64_t B = q.dim(0), H = q.dim(1), L = q.dim(2), S = k.dim(2), E = q.dim(3);
  r.out = Tensor<double>({B, H, L, r.v.dim(3)}), r.lse = Tensor<double>({B, H, L}), r.w = Tensor<double>({B, H, L, S});
  scaled_dot_product_attention(d, {r.out.view4(), r.w.view4(), r.lse.view<3>()}, opt);
  const double scale = opt.scale.value_or(1.0 / std::sqrt(double(E)));
  double qk = 0;
  const int64_t group = H / k.dim(1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < S; ++j) {
          double s = 0;
          for (int64_t e = 0; e < E; ++e) s += std::abs(q.view4()(b, h, i, e) * k.view4()(b, h / group, j, e));
          qk = std::max(qk, scale * s);
        }
  const double reach = double(L + S) + std::abs(double(opt.position_offset.value_or(0)));
  r.m = qk + bias_max + slope_max * reach;
  return r;
}

// Checks out and lse against the reference within the bound (above); with
// `p_rounded`, against the reference that rounds P too (one key tile),
// where only a few rounding flips may differ; with `inputs_rounded`, against
// attention of the unrounded inputs (r.out, r.lse), whose scores the
// rounding of q and k moves by up to 2^-7·m and whose values that of v by
// 2^-8·|v| (docs/fused.md); `extra_sums` float32 roundings more than the
// fused forward's on the way of each output (the decode kernel's merges of
// its key chunks).
inline ::testing::AssertionResult within_bound(const Fwd& got, const Ref& r, int64_t E, double softcap, bool p_rounded,
                                               const std::string& what, bool inputs_rounded = false,
                                               int64_t extra_sums = 0) {
  const auto y = got.out.view4();
  const auto want = r.out.view4(), w = r.w.view4(), v = r.v.view4();
  const int64_t B = want.dim(0), H = want.dim(1), L = want.dim(2), Ev = want.dim(3), S = w.dim(3);
  const int64_t group = H / v.dim(1);
  const double ds = (double(E) + 16) * kF * r.m + 16 * kF * softcap + (inputs_rounded ? 2 * kU * r.m : 0.0);
  double worst = -1;
  std::string where;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        // The weight of the row's largest score (P = 1 there): the exact
        // weights scaled so, for the reference that rounds P.
        double top = 0;
        for (int64_t j = 0; j < S; ++j) top = std::max(top, w(b, h, i, j));
        const double lse = r.lse.view<3>()(b, h, i);
        for (int64_t e = 0; e < Ev; ++e) {
          double sum_wv = 0, max_wv = 0, vmax = 0, yr = 0;
          for (int64_t j = 0; j < S; ++j) {
            const double vj = v(b, h / group, j, e), wj = w(b, h, i, j);
            sum_wv += wj * std::abs(vj);
            max_wv = std::max(max_wv, wj * std::abs(vj));
            vmax = std::max(vmax, std::abs(vj));
            if (p_rounded && wj > 0) yr += top * rounded(float(wj / top)) * vj;
          }
          const double ref = p_rounded ? yr : want(b, h, i, e);
          const double tol = (p_rounded ? 2 * kU * max_wv : kU * sum_wv) + 2 * ds * vmax + (S + 16 + extra_sums) * kF * vmax +
                             (inputs_rounded ? kU * vmax : 0.0);
          const double err = std::abs(double(y(b, h, i, e)) - ref);
          if (!(err <= tol) && err - tol > worst) {
            worst = err - tol;
            where = "out(" + std::to_string(b) + "," + std::to_string(h) + "," + std::to_string(i) + "," +
                    std::to_string(e) + ") got " + std::to_string(y(b, h, i, e)) + " want " + std::to_string(ref) +
                    " tol " + std::to_string(tol);
          }
        }
        const double lg = got.lse.view<3>()(b, h, i);
        const double lse_tol = ds + (S + 16 + extra_sums) * kF + 2 * kF * std::abs(lse);
        if (lse == -INFINITY ? lg != -INFINITY : !(std::abs(lg - lse) <= lse_tol)) {
          worst = std::max(worst, 0.0);
          where = "lse(" + std::to_string(b) + "," + std::to_string(h) + "," + std::to_string(i) + ") got " +
                  std::to_string(lg) + " want " + std::to_string(lse);
        }
      }
  if (worst < 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << where;
}

// A spec of the given shape, no rules (the tests add theirs).
inline RandomSpec shape_spec(int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t S, int64_t E, int64_t Ev) {
  RandomSpec s;
  s.B = B, s.H = H, s.Hkv = Hkv, s.L = L, s.S = S, s.E = E, s.Ev = Ev;
  return s;
}

}  // namespace attn::testing
