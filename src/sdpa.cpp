// The public scaled dot-product attention entry points: argument validation
// (once, here, at the boundary) and the single dispatch point between
// backends. Kernels behind this file assume valid arguments.
#include "attn/sdpa.hpp"

#include <cmath>
#include <limits>
#include <sstream>

#include "kernels/decode/decode.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/problem.hpp"
#include "kernels/reference/sdpa_reference.hpp"
#include "kernels/softmax.hpp"
#include "validate.hpp"

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
  throw InvalidArgument("attn::parse_backend: unknown backend '" + std::string(name) +
              "', expected one of auto, reference, fused");
}

namespace detail {

template <class T>
Problem make_problem(const SdpaArgs<T>& a, const SdpaOptions& opt) {
  Problem p;
  p.B = a.q.dim(0);
  p.H = a.q.dim(1);
  p.L = a.q.dim(2);
  p.E = a.q.dim(3);
  p.Hkv = a.k.dim(1);
  p.S = a.k.dim(2);
  p.Ev = a.v.dim(3);
  p.scale = opt.scale ? *opt.scale : 1.0 / std::sqrt(double(p.E));
  p.causal = opt.causal;
  p.align = opt.causal_align;
  p.window_left = std::min(opt.window.left, kMaxPosition);
  p.window_right = std::min(opt.window.right, kMaxPosition);
  p.softcap = opt.softcap;
  p.position_offset = opt.position_offset;
  p.threads = Checker{"make_problem"}.threads(opt.num_threads);
  return p;
}

}  // namespace detail

namespace {

using detail::Checker;
using detail::Problem;

}  // namespace

template <class F>
void detail::check_variants(const Checker& c, const Window& window, double softcap, const View1<const F>& alibi,
                            const View1<const F>& sinks, int64_t H) {
  for (const auto& [side, name] : {std::pair{window.left, "window.left"}, {window.right, "window.right"}})
    if (side < -1)
      c.fail(std::string("option '") + name + "' is " + std::to_string(side) +
             ", expected >= 0 or -1 (unbounded)");
  if (!std::isfinite(softcap) || softcap < 0) {
    std::ostringstream os;
    os << "option 'softcap' is " << softcap << ", expected a finite value > 0 (or 0 = off)";
    c.fail(os.str());
  }
  if (c.given(alibi, "alibi_slopes")) {
    c.shape(alibi, "alibi_slopes", {H}, "(H,) = " + shape_str({H}) + ", one slope per query head");
    c.finite(alibi, "alibi_slopes");
  }
  if (c.given(sinks, "sinks")) {
    c.shape(sinks, "sinks", {H}, "(H,) = " + shape_str({H}) + ", one logit per query head");
    c.finite(sinks, "sinks", /*allow_neg_inf=*/true);
  }
}
template void detail::check_variants<float>(const Checker&, const Window&, double, const View1<const float>&,
                                            const View1<const float>&, int64_t);
template void detail::check_variants<double>(const Checker&, const Window&, double, const View1<const double>&,
                                             const View1<const double>&, int64_t);

namespace {

// The variants' options and per-head arguments (make_problem copies the
// options into the problem).
template <class T>
void validate_variants(const Checker& c, const View1<const compute_t<T>>& alibi, const View1<const compute_t<T>>& sinks,
                       const SdpaOptions& opt, int64_t H) {
  detail::check_variants(c, opt.window, opt.softcap, alibi, sinks, H);
  if (opt.position_offset &&
      (*opt.position_offset > detail::kMaxPosition || *opt.position_offset < -detail::kMaxPosition))
    c.fail("option 'position_offset' is " + std::to_string(*opt.position_offset) + ", expected |offset| <= 2^52");
}

// Validates the inputs shared by forward and backward; returns the problem.
template <class T>
Problem validate_inputs(const Checker& c, const SdpaArgs<T>& a, const SdpaOptions& opt) {
  c.present(a.q, "q", "of (B, H, L, E)");
  c.present(a.k, "k", "of (B, Hkv, S, E)");
  c.present(a.v, "v", "of (B, Hkv, S, Ev)");
  const int64_t B = a.q.dim(0), H = a.q.dim(1), E = a.q.dim(3), Hkv = a.k.dim(1), S = a.k.dim(2);
  if (a.k.dim(0) != B || a.k.dim(3) != E || H % Hkv != 0)
    c.fail("argument 'k' has shape " + shape_str(a.k.shape) + ", expected (" + std::to_string(B) +
           ", Hkv, S, " + std::to_string(E) + ") with Hkv dividing H = " + std::to_string(H) +
           " (q has shape " + shape_str(a.q.shape) + ")");
  c.shape(a.v, "v", {B, Hkv, S, a.v.dim(3)},
          "(" + std::to_string(B) + ", " + std::to_string(Hkv) + ", " + std::to_string(S) +
              ", Ev), matching k " + shape_str(a.k.shape) + " in B, Hkv and S");
  const std::array<int64_t, 4> full{B, H, a.q.dim(2), S};
  // The (B, H, L, S) score matrix must be countable (the weights output and
  // the reference backend materialise it).
  for (int64_t i = 0, n = 1; i < 4; ++i)
    if (!detail::checked_mul(n, full[size_t(i)], &n))
      c.fail("the score matrix (B, H, L, S) = " + shape_str(full) + " has more elements than int64 can count");
  std::vector<detail::Extent> masks;  // joined to the inputs' extents by input_extents()
  c.mask_and_bias(a.mask, "mask", a.bias, "bias", full, masks);
  if (c.given(a.key_lengths, "key_lengths")) {
    c.shape(a.key_lengths, "key_lengths", {B});
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = a.key_lengths(b);
      if (n < 0 || n > S)
        c.fail("argument 'key_lengths' has value " + std::to_string(n) + " at batch " + std::to_string(b) +
               ", expected 0 <= key_lengths[b] <= S = " + std::to_string(S));
    }
  }
  if (opt.scale && (!std::isfinite(*opt.scale) || *opt.scale <= 0)) {
    std::ostringstream os;
    os << "option 'scale' is " << *opt.scale << ", expected a finite value > 0";
    c.fail(os.str());
  }
  (void)c.threads(opt.num_threads);
  if (opt.check_finite) {
    c.finite(a.q, "q");
    c.finite(a.k, "k");
    c.finite(a.v, "v");
  }
  validate_variants<T>(c, a.alibi_slopes, a.sinks, opt, H);
  return detail::make_problem(a, opt);
}

// The memory extents of the inputs, for the outputs' overlap check.
template <class T>
std::vector<detail::Extent> input_extents(const Checker& c, const SdpaArgs<T>& a) {
  std::vector<detail::Extent> in{c.extent(a.q, "q"), c.extent(a.k, "k"), c.extent(a.v, "v")};
  if (!a.mask.empty()) in.push_back(c.extent(a.mask, "mask"));
  if (!a.bias.empty()) in.push_back(c.extent(a.bias, "bias"));
  if (!a.key_lengths.empty()) in.push_back(c.extent(a.key_lengths, "key_lengths"));
  if (!a.alibi_slopes.empty()) in.push_back(c.extent(a.alibi_slopes, "alibi_slopes"));
  if (!a.sinks.empty()) in.push_back(c.extent(a.sinks, "sinks"));
  return in;
}

template <class T>
Backend choose(const Checker& c, const Problem&, const SdpaArgs<T>&, const SdpaOptions& opt, bool) {
  // The fused backend takes every float32 request (half inputs compute in float32).
  constexpr bool fused_ok = std::is_same_v<compute_t<T>, float>;
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

// The backends behind the validation, for float and double arguments.
template <class T>
void dispatch_forward(const Checker& c, const Problem& p, const SdpaArgs<T>& args, const SdpaOutputs<T>& outputs,
                      const SdpaOptions& opt) {
  const auto& [out, weights, lse] = outputs;
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
void dispatch_backward(const Checker& c, const Problem& p, const SdpaArgs<T>& args, View4<const T> dout,
                       const SdpaSaved<T>& saved, const SdpaGrads<T>& g, const SdpaOptions& opt) {
  if constexpr (std::is_same_v<T, float>) {
    if (choose(c, p, args, opt, false) == Backend::fused) {
      // The fused backward uses the forward's out and lse. Without them it
      // would recompute them with its own forward; a call with few query
      // rows runs the decode kernel forward instead, whose last bits differ.
      // So the missing ones come from the forward this call's forward runs,
      // and the gradients are the same bits with the saved state or without.
      if ((saved.out.empty() || saved.lse.empty()) && detail::decode_suits_dense(p, args, false)) {
        auto o = Tensor<float>::uninitialized({p.B, p.H, p.L, p.Ev});
        auto l = Tensor<float>::uninitialized({p.B, p.H, p.L});
        detail::decode_forward_dense(p, args, o.view4(), l.view<3>());
        return detail::fused_backward(p, args, dout, g, saved.out.empty() ? View4<const float>(o.view4()) : saved.out,
                                      saved.lse.empty() ? View3<const float>(l.view<3>()) : saved.lse);
      }
      return detail::fused_backward(p, args, dout, g, saved.out, saved.lse);
    }
  } else {
    (void)choose(c, p, args, opt, false);
  }
  detail::reference_backward(p, args, dout, g);
}

// ---- half inputs (see "Precision" in attn/sdpa.hpp) -------------------------

template <class T>
constexpr detail::KVStorage storage_of() {
  return std::is_same_v<T, float16_t> ? detail::KVStorage::f16 : detail::KVStorage::bf16;
}

// A contiguous float32 copy of a half view (exact), rows in parallel.
template <class T>
Tensor<float> widen(const View4<const T>& v, int threads) {
  auto t = Tensor<float>::uninitialized({v.dim(0), v.dim(1), v.dim(2), v.dim(3)});
  const int64_t n1 = v.dim(1), n2 = v.dim(2), F = v.dim(3), rows = v.dim(0) * n1 * n2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * F >= (int64_t(1) << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = &v(r / (n1 * n2), r / n2 % n1, r % n2, 0);
    float* dst = t.data() + r * F;
    if (v.strides[3] == 1)
      detail::convert_from_storage(storage_of<T>(), src, F, dst);
    else
      for (int64_t e = 0; e < F; ++e) dst[e] = float(src[e * v.strides[3]]);
  }
  return t;
}

// The float32 call on the widened q, k, v; the other arguments are float32
// already and pass through.
template <class T>
struct Widened {
  Tensor<float> q, k, v;
  SdpaArgs<float> args;
  Widened(const SdpaArgs<T>& a, int threads)
      : q(widen(a.q, threads)), k(widen(a.k, threads)), v(widen(a.v, threads)) {
    args = {q.view4(), k.view4(), v.view4(), a.mask, a.bias, a.key_lengths, a.alibi_slopes, a.sinks};
  }
};

// The arguments' shapes, strides and presence as a float32 request, for the
// dispatch rules and the decode problem, which look at nothing else of q, k
// and v (decode_suits_dense, DecodeProblem::of); q, k and v are never read
// through it.
template <class T>
SdpaArgs<float> shape_only(const SdpaArgs<T>& a) {
  const auto as = [](const View4<const T>& x) {
    return View4<const float>(reinterpret_cast<const float*>(x.data), x.shape, x.strides);
  };
  return {as(a.q), as(a.k), as(a.v), a.mask, a.bias, a.key_lengths, a.alibi_slopes, a.sinks};
}

// The decode route on half K/V: only q is widened (L rows per head); the
// kernel reads K and V in their storage type, as it reads a half KV cache.
template <class T>
void decode_forward_half(const Problem& p, const SdpaArgs<T>& a, View4<float> out, View3<float> lse) {
  const Tensor<float> q = widen(a.q, p.threads);
  const detail::DecodeProblem d = detail::DecodeProblem::of(p, shape_only(a));
  const auto kv = detail::KVLayout::dense(storage_of<T>(), a.k, a.v);
  detail::decode_forward(d, kv, q.view4(), out, lse);
}

}  // namespace

template <class T>
Backend detail::check_attention(const Checker& c, const SdpaArgs<T>& args, const SdpaOptions& opt, bool want_weights) {
  return choose(c, validate_inputs(c, args, opt), args, opt, want_weights);
}

template <class T>
Backend resolve_backend(const SdpaArgs<T>& args, const SdpaOptions& opt, bool want_weights) {
  return detail::check_attention(Checker{"resolve_backend"}, args, opt, want_weights);
}

template <class T>
void scaled_dot_product_attention(const SdpaArgs<T>& args, const SdpaOutputs<compute_t<T>>& outputs,
                                  const SdpaOptions& opt) {
  const Checker c{"scaled_dot_product_attention"};
  const auto& [out, weights, lse] = outputs;
  const Problem p = validate_inputs(c, args, opt);
  c.present(out, "out", "of (B, H, L, Ev)");
  c.shape(out, "out", {p.B, p.H, p.L, p.Ev});
  std::vector<detail::Extent> written{c.extent(out, "out")};
  c.optional(weights, "weights", {p.B, p.H, p.L, p.S}, written);
  c.optional(lse, "lse", {p.B, p.H, p.L}, written);
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, input_extents(c, args));
  if constexpr (is_half_v<T>) {
    if (choose(c, p, args, opt, !weights.empty()) == Backend::fused &&
        detail::decode_suits_dense(p, shape_only(args), !weights.empty()))
      return decode_forward_half(p, args, out, lse);
    const Widened<T> w(args, p.threads);
    dispatch_forward<float>(c, p, w.args, outputs, opt);
  } else {
    dispatch_forward<T>(c, p, args, outputs, opt);
  }
}

template <class T>
void scaled_dot_product_attention_backward(const SdpaArgs<T>& args, View4<const compute_t<T>> dout,
                                           const SdpaSaved<compute_t<T>>& saved,
                                           const SdpaGrads<compute_t<T>>& g, const SdpaOptions& opt) {
  const Checker c{"scaled_dot_product_attention_backward"};
  const auto& [out, lse] = saved;
  const Problem p = validate_inputs(c, args, opt);
  c.present(dout, "dout", "of (B, H, L, Ev)");
  c.shape(dout, "dout", {p.B, p.H, p.L, p.Ev});
  c.present(g.dq, "dq", "of (B, H, L, E)");
  c.present(g.dk, "dk", "of (B, Hkv, S, E)");
  c.present(g.dv, "dv", "of (B, Hkv, S, Ev)");
  c.shape(g.dq, "dq", {p.B, p.H, p.L, p.E});
  c.shape(g.dk, "dk", {p.B, p.Hkv, p.S, p.E});
  c.shape(g.dv, "dv", {p.B, p.Hkv, p.S, p.Ev});
  std::vector<detail::Extent> written{c.extent(g.dq, "dq"), c.extent(g.dk, "dk"), c.extent(g.dv, "dv")};
  if (c.given(g.dbias, "dbias")) {
    if (args.bias.empty()) c.fail("output 'dbias' was requested but no 'bias' was given");
    c.shape(g.dbias, "dbias", args.bias.shape, shape_str(args.bias.shape) + " (the shape of 'bias')");
    written.push_back(c.extent(g.dbias, "dbias"));
  }
  if (c.given(g.dsinks, "dsinks")) {
    if (args.sinks.empty()) c.fail("output 'dsinks' was requested but no 'sinks' were given");
    c.shape(g.dsinks, "dsinks", {p.H}, "(H,) = " + shape_str({p.H}) + ", the shape of 'sinks'");
    written.push_back(c.extent(g.dsinks, "dsinks"));
  }
  for (const auto& e : written) c.writable(e);
  std::vector<detail::Extent> read = input_extents(c, args);
  read.push_back(c.extent(dout, "dout"));
  c.optional(out, "out", {p.B, p.H, p.L, p.Ev}, read);
  c.optional(lse, "lse", {p.B, p.H, p.L}, read);
  c.disjoint(written, read);
  if (opt.check_finite) c.finite(dout, "dout");
  if constexpr (is_half_v<T>) {
    const Widened<T> w(args, p.threads);
    dispatch_backward<float>(c, p, w.args, dout, saved, g, opt);
  } else {
    dispatch_backward<T>(c, p, args, dout, saved, g, opt);
  }
}

template <class T>
T softmax(const T* x, T* y, int64_t n) {
  const Checker c{"softmax"};
  if (n < 0) c.fail("argument 'n' is " + std::to_string(n) + ", expected >= 0");
  if (n > 0 && (x == nullptr || y == nullptr)) c.fail("argument 'x' or 'y' is a null pointer with n = " + std::to_string(n));
  return T(detail::softmax(x, y, n));
}

#define ATTN_INSTANTIATE_SDPA(T)                                                                    \
  template void scaled_dot_product_attention<T>(const SdpaArgs<T>&, const SdpaOutputs<compute_t<T>>&,     \
                                                const SdpaOptions&);                                       \
  template void scaled_dot_product_attention_backward<T>(                                                  \
      const SdpaArgs<T>&, View4<const compute_t<T>>, const SdpaSaved<compute_t<T>>&,                       \
      const SdpaGrads<compute_t<T>>&, const SdpaOptions&);                                                 \
  template Backend resolve_backend<T>(const SdpaArgs<T>&, const SdpaOptions&, bool);                       \
  template Backend detail::check_attention<T>(const detail::Checker&, const SdpaArgs<T>&, const SdpaOptions&, bool); \
  template detail::Problem detail::make_problem<T>(const SdpaArgs<T>&, const SdpaOptions&);

ATTN_INSTANTIATE_SDPA(float)
ATTN_INSTANTIATE_SDPA(double)
ATTN_INSTANTIATE_SDPA(float16_t)
ATTN_INSTANTIATE_SDPA(bfloat16_t)
#undef ATTN_INSTANTIATE_SDPA
template float softmax<float>(const float*, float*, int64_t);
template double softmax<double>(const double*, double*, int64_t);

}  // namespace attn
