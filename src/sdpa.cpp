// The public scaled dot-product attention entry points: argument validation
// (once, here, at the boundary) and the single dispatch point between
// backends. Kernels behind this file assume valid arguments.
#include "attn/sdpa.hpp"

#include <omp.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "kernels/decode/decode.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/problem.hpp"
#include "kernels/reference/sdpa_reference.hpp"

namespace attn {

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::automatic: return "auto";
    case Backend::reference: return "reference";
    case Backend::fused: return "fused";
  }
  return "?";
}

Backend parse_backend(std::string_view name) {
  if (name == "auto") return Backend::automatic;
  if (name == "reference") return Backend::reference;
  if (name == "fused") return Backend::fused;
  throw Error("attn::parse_backend: unknown backend '" + std::string(name) +
              "', expected one of auto, reference, fused");
}

namespace {

using detail::Problem;

// Collects the context for error messages: "attn::<fn>: argument '<name>' ...".
struct Checker {
  const char* fn;

  [[noreturn]] void fail(const std::string& msg) const {
    throw Error(std::string("attn::") + fn + ": " + msg);
  }

  template <class T, int R>
  void present(const View<T, R>& v, const char* name) const {
    if (v.data == nullptr && v.numel() != 0) fail(std::string("argument '") + name + "' has no data (null pointer)");
    if (v.data == nullptr) fail(std::string("argument '") + name + "' is required but was not given");
  }

  // Exact shape check; `expected_text` explains symbolic entries.
  template <class T, int R>
  void shape(const View<T, R>& v, const char* name, const std::type_identity_t<std::array<int64_t, R>>& want,
             const std::string& expected_text = "") const {
    if (v.shape != want)
      fail(std::string("argument '") + name + "' has shape " + shape_str(v.shape) + ", expected " +
           (expected_text.empty() ? shape_str(want) : expected_text));
  }

  template <class T, int R>
  void positive_dims(const View<T, R>& v, const char* name, const char* axes) const {
    for (int i = 0; i < R; ++i)
      if (v.shape[size_t(i)] < 1)
        fail(std::string("argument '") + name + "' has shape " + shape_str(v.shape) +
             "; every dimension " + axes + " must be >= 1");
  }

  // Output views must not broadcast (two elements sharing one address).
  template <class T, int R>
  void writable(const View<T, R>& v, const char* name) const {
    for (int i = 0; i < R; ++i)
      if (v.shape[size_t(i)] > 1 && v.strides[size_t(i)] == 0)
        fail(std::string("output '") + name + "' has stride 0 on axis " + std::to_string(i) +
             " (a broadcast view cannot be written)");
  }

  // A broadcastable (B, H, L, S) operand: each axis is 1 or the full size.
  template <class T>
  void broadcastable(const View4<T>& v, const char* name, const Problem& p) const {
    const std::array<int64_t, 4> full{p.B, p.H, p.L, p.S};
    for (int i = 0; i < 4; ++i)
      if (v.shape[size_t(i)] != 1 && v.shape[size_t(i)] != full[size_t(i)])
        fail(std::string("argument '") + name + "' has shape " + shape_str(v.shape) +
             ", expected each axis of (B, H, L, S) = " + shape_str(full) + " or 1 (broadcast)");
  }
};

template <class T, int R, class F>
void for_each(const View<T, R>& v, F&& f) {
  std::array<int64_t, R> idx{};
  const int64_t n = v.numel();
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t off = 0;
    for (int i = 0; i < R; ++i) off += idx[size_t(i)] * v.strides[size_t(i)];
    f(v.data[off]);
    for (int i = R - 1; i >= 0; --i) {
      if (++idx[size_t(i)] < v.shape[size_t(i)]) break;
      idx[size_t(i)] = 0;
    }
  }
}

template <class T, int R>
void check_finite(const Checker& c, const View<const T, R>& v, const char* name, bool allow_neg_inf) {
  bool bad = false;
  for_each(v, [&](T x) {
    if (std::isnan(x) || (std::isinf(x) && !(allow_neg_inf && x < 0))) bad = true;
  });
  if (bad)
    c.fail(std::string("argument '") + name + "' contains " +
           (allow_neg_inf ? "NaN or +Inf (only -Inf is allowed, as a mask)" : "NaN or Inf"));
}

// Positions and window sides beyond this are refused (offset) or clamped
// (window: a side this long is unbounded), so position arithmetic never
// overflows.
constexpr int64_t kMaxPosition = int64_t(1) << 52;

// The variants' options and per-head arguments (shared with the varlen entry
// points); fills their part of the problem.
template <class T>
void validate_variants(const Checker& c, const View1<const T>& alibi, const View1<const T>& sinks,
                       const SdpaOptions& opt, Problem& p) {
  for (const auto& [side, name] : {std::pair{opt.window.left, "window.left"}, {opt.window.right, "window.right"}})
    if (side < -1)
      c.fail(std::string("option '") + name + "' is " + std::to_string(side) +
             ", expected >= 0 or -1 (unbounded)");
  p.window_left = std::min(opt.window.left, kMaxPosition);
  p.window_right = std::min(opt.window.right, kMaxPosition);
  if (!std::isfinite(opt.softcap) || opt.softcap < 0) {
    std::ostringstream os;
    os << "option 'softcap' is " << opt.softcap << ", expected a finite value > 0 (or 0 = off)";
    c.fail(os.str());
  }
  p.softcap = opt.softcap;
  if (opt.position_offset) {
    if (*opt.position_offset > kMaxPosition || *opt.position_offset < -kMaxPosition)
      c.fail("option 'position_offset' is " + std::to_string(*opt.position_offset) + ", expected |offset| <= 2^52");
    p.position_offset = opt.position_offset;
  }
  if (!alibi.empty()) {
    c.shape(alibi, "alibi_slopes", {p.H}, "(H) = (" + std::to_string(p.H) + "), one slope per query head");
    check_finite(c, alibi, "alibi_slopes", false);
  }
  if (!sinks.empty()) {
    c.shape(sinks, "sinks", {p.H}, "(H) = (" + std::to_string(p.H) + "), one logit per query head");
    check_finite(c, sinks, "sinks", /*allow_neg_inf=*/true);
  }
}

// Validates the inputs shared by forward and backward; returns the problem.
template <class T>
Problem validate_inputs(const Checker& c, const SdpaArgs<T>& a, const SdpaOptions& opt) {
  c.present(a.q, "q");
  c.present(a.k, "k");
  c.present(a.v, "v");
  c.positive_dims(a.q, "q", "of (B, H, L, E)");
  c.positive_dims(a.k, "k", "of (B, Hkv, S, E)");
  c.positive_dims(a.v, "v", "of (B, Hkv, S, Ev)");
  Problem p;
  p.B = a.q.dim(0);
  p.H = a.q.dim(1);
  p.L = a.q.dim(2);
  p.E = a.q.dim(3);
  p.Hkv = a.k.dim(1);
  p.S = a.k.dim(2);
  p.Ev = a.v.dim(3);
  if (a.k.dim(0) != p.B || a.k.dim(3) != p.E || p.H % p.Hkv != 0)
    c.fail("argument 'k' has shape " + shape_str(a.k.shape) + ", expected (" + std::to_string(p.B) +
           ", Hkv, S, " + std::to_string(p.E) + ") with Hkv dividing H = " + std::to_string(p.H) +
           " (q has shape " + shape_str(a.q.shape) + ")");
  c.shape(a.v, "v", {p.B, p.Hkv, p.S, a.v.dim(3)},
          "(" + std::to_string(p.B) + ", " + std::to_string(p.Hkv) + ", " + std::to_string(p.S) +
              ", Ev), matching k " + shape_str(a.k.shape) + " in B, Hkv and S");
  if (!a.mask.empty()) c.broadcastable(a.mask, "mask", p);
  if (!a.bias.empty()) {
    c.broadcastable(a.bias, "bias", p);
    check_finite(c, a.bias, "bias", /*allow_neg_inf=*/true);
  }
  if (!a.key_lengths.empty()) {
    c.shape(a.key_lengths, "key_lengths", {p.B});
    for (int64_t b = 0; b < p.B; ++b) {
      const int64_t n = a.key_lengths(b);
      if (n < 0 || n > p.S)
        c.fail("argument 'key_lengths' has value " + std::to_string(n) + " at batch " + std::to_string(b) +
               ", expected 0 <= key_lengths[b] <= S = " + std::to_string(p.S));
    }
  }
  if (opt.scale) {
    if (!std::isfinite(*opt.scale) || *opt.scale <= 0) {
      std::ostringstream os;
      os << "option 'scale' is " << *opt.scale << ", expected a finite value > 0";
      c.fail(os.str());
    }
    p.scale = *opt.scale;
  } else {
    p.scale = 1.0 / std::sqrt(double(p.E));
  }
  if (opt.num_threads < 0)
    c.fail("option 'num_threads' is " + std::to_string(opt.num_threads) + ", expected >= 0 (0 = default)");
  p.threads = opt.num_threads > 0 ? opt.num_threads : omp_get_max_threads();
  p.causal = opt.causal;
  p.align = opt.causal_align;
  validate_variants(c, a.alibi_slopes, a.sinks, opt, p);
  if (opt.check_finite) {
    check_finite(c, a.q, "q", false);
    check_finite(c, a.k, "k", false);
    check_finite(c, a.v, "v", false);
  }
  return p;
}

template <class T>
Backend choose(const Checker& c, const Problem&, const SdpaArgs<T>&, const SdpaOptions& opt, bool) {
  constexpr bool fused_ok = std::is_same_v<T, float>;  // the fused backend takes every float32 request
  switch (opt.backend) {
    case Backend::reference: return Backend::reference;
    case Backend::automatic: return fused_ok ? Backend::fused : Backend::reference;
    case Backend::fused:
      if (!fused_ok)
        c.fail("option 'backend' is fused, which supports float32 only; use reference or auto for double");
      return Backend::fused;
  }
  c.fail("option 'backend' has an unknown value");
}

}  // namespace

template <class T>
Backend resolve_backend(const SdpaArgs<T>& args, const SdpaOptions& opt, bool want_weights) {
  const Checker c{"resolve_backend"};
  const Problem p = validate_inputs(c, args, opt);
  return choose(c, p, args, opt, want_weights);
}

template <class T>
void scaled_dot_product_attention(const SdpaArgs<T>& args, const SdpaOutputs<T>& outputs,
                                  const SdpaOptions& opt) {
  const Checker c{"scaled_dot_product_attention"};
  const auto& [out, weights, lse] = outputs;
  const Problem p = validate_inputs(c, args, opt);
  c.present(out, "out");
  c.shape(out, "out", {p.B, p.H, p.L, p.Ev});
  c.writable(out, "out");
  if (!weights.empty()) {
    c.shape(weights, "weights", {p.B, p.H, p.L, p.S});
    c.writable(weights, "weights");
  }
  if (!lse.empty()) {
    c.shape(lse, "lse", {p.B, p.H, p.L});
    c.writable(lse, "lse");
  }
  if constexpr (std::is_same_v<T, float>) {
    if (choose(c, p, args, opt, !weights.empty()) == Backend::fused) {
      // Few query rows (decoding shapes): the grouped split-KV decode kernel.
      if (detail::decode_suits_dense(p, args, !weights.empty()))
        return detail::decode_forward_dense(p, args, out, lse);
      return detail::fused_forward(p, args, out, weights, lse);
    }
  } else {
    (void)choose(c, p, args, opt, !weights.empty());
  }
  detail::reference_forward(p, args, out, weights, lse);
}

template <class T>
void scaled_dot_product_attention_backward(const SdpaArgs<T>& args, View4<const T> dout,
                                           const SdpaSaved<T>& saved, const SdpaGrads<T>& g,
                                           const SdpaOptions& opt) {
  const Checker c{"scaled_dot_product_attention_backward"};
  const auto& [out, lse] = saved;
  const Problem p = validate_inputs(c, args, opt);
  c.present(dout, "dout");
  c.shape(dout, "dout", {p.B, p.H, p.L, p.Ev});
  c.present(g.dq, "dq");
  c.present(g.dk, "dk");
  c.present(g.dv, "dv");
  c.shape(g.dq, "dq", {p.B, p.H, p.L, p.E});
  c.shape(g.dk, "dk", {p.B, p.Hkv, p.S, p.E});
  c.shape(g.dv, "dv", {p.B, p.Hkv, p.S, p.Ev});
  c.writable(g.dq, "dq");
  c.writable(g.dk, "dk");
  c.writable(g.dv, "dv");
  if (!g.dbias.empty()) {
    if (args.bias.empty()) c.fail("output 'dbias' was requested but no 'bias' was given");
    c.shape(g.dbias, "dbias", args.bias.shape, shape_str(args.bias.shape) + " (the shape of 'bias')");
    c.writable(g.dbias, "dbias");
  }
  if (!g.dsinks.empty()) {
    if (args.sinks.empty()) c.fail("output 'dsinks' was requested but no 'sinks' were given");
    c.shape(g.dsinks, "dsinks", {p.H}, "(H) = (" + std::to_string(p.H) + "), the shape of 'sinks'");
    c.writable(g.dsinks, "dsinks");
  }
  if (!out.empty()) c.shape(out, "out", {p.B, p.H, p.L, p.Ev});
  if (!lse.empty()) c.shape(lse, "lse", {p.B, p.H, p.L});
  if (opt.check_finite) check_finite(c, dout, "dout", false);
  if constexpr (std::is_same_v<T, float>) {
    if (choose(c, p, args, opt, false) == Backend::fused)
      return detail::fused_backward(p, args, dout, g, out, lse);
  } else {
    (void)choose(c, p, args, opt, false);
  }
  detail::reference_backward(p, args, dout, g);
}

template <class T>
T softmax(const T* x, T* y, int64_t n) {
  if (n < 0) throw Error("attn::softmax: argument 'n' is " + std::to_string(n) + ", expected >= 0");
  if (n > 0 && (x == nullptr || y == nullptr)) throw Error("attn::softmax: null input or output pointer");
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j]) || (std::isinf(x[j]) && x[j] > 0))
      throw Error("attn::softmax: argument 'x' contains NaN or +Inf at index " + std::to_string(j));
    m = std::max(m, x[j]);
  }
  if (m == -std::numeric_limits<T>::infinity()) {
    for (int64_t j = 0; j < n; ++j) y[j] = T(0);
    return m;
  }
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    y[j] = std::exp(x[j] - m);  // subtracting the max keeps every exponent <= 0
    sum += double(y[j]);
  }
  for (int64_t j = 0; j < n; ++j) y[j] = T(double(y[j]) / sum);
  return T(double(m) + std::log(sum));
}

#define ATTN_INSTANTIATE(T)                                                                        \
  template void scaled_dot_product_attention<T>(const SdpaArgs<T>&, const SdpaOutputs<T>&,         \
                                                const SdpaOptions&);                                \
  template void scaled_dot_product_attention_backward<T>(const SdpaArgs<T>&, View4<const T>,        \
                                                         const SdpaSaved<T>&, const SdpaGrads<T>&,  \
                                                         const SdpaOptions&);                       \
  template Backend resolve_backend<T>(const SdpaArgs<T>&, const SdpaOptions&, bool);                \
  template T softmax<T>(const T*, T*, int64_t);

ATTN_INSTANTIATE(float)
ATTN_INSTANTIATE(double)
#undef ATTN_INSTANTIATE

}  // namespace attn
