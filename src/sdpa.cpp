// The public scaled dot-product attention entry points: argument validation
// (once, here, at the boundary) and the single dispatch point between
// backends. Kernels behind this file assume valid arguments.
#include "attn/sdpa.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "kernels/decode/decode.hpp"
#include "kernels/fused/bf16.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/problem.hpp"
#include "kernels/reference/sdpa_reference.hpp"
#include "kernels/softmax.hpp"
#include "widen.hpp"
#include "validate.hpp"

namespace attn {

namespace {
constexpr detail::NamedValue<Backend> kBackends[] = {
    {Backend::automatic, "auto"}, {Backend::reference, "reference"}, {Backend::fused, "fused"}};
}  // namespace

const char* backend_name(Backend b) { return detail::name_of(kBackends, b); }

Backend parse_backend(std::string_view name) { return detail::Checker{"parse_backend"}.parse(kBackends, name, "backend"); }

namespace detail {

template <class T>
ProblemOf<compute_t<T>> make_problem(const SdpaArgs<T>& a, const SdpaOptions& opt, Origin origin) {
  ProblemOf<compute_t<T>> p;
  p.B = a.q.dim(0), p.H = a.q.dim(1), p.L = a.q.dim(2), p.E = a.q.dim(3);
  p.Hkv = a.k.dim(1), p.S = a.k.dim(2), p.Ev = a.v.dim(3);
  std::vector<int64_t> key_end(size_t(p.B), p.S);
  for (int64_t b = 0; b < a.key_lengths.dim(0); ++b) key_end[size_t(b)] = a.key_lengths(b);
  p.rules = resolve_rules<compute_t<T>>(a, opt, p.E, std::vector<int64_t>(size_t(p.B), dense_offset(opt, p.L, p.S)),
                                        std::move(key_end));
  p.rules.key_origin = origin.key;
  p.dropout = Dropout::of(opt.dropout_p, opt.dropout_seed, opt.dropout_offset, origin.batch);
  // bfloat16 products: asked for, or by default for bfloat16 inputs (the
  // reference backend is always exact).
  const Dtype compute = opt.compute_dtype.value_or(std::is_same_v<T, bfloat16_t> ? Dtype::bfloat16 : Dtype::float32);
  p.bf16_products = compute == Dtype::bfloat16 && opt.backend != Backend::reference;
  p.threads = Checker{"make_problem"}.threads(opt.num_threads);
  return p;
}

}  // namespace detail

namespace {

using detail::Checker;
template <class T>
using ProblemFor = detail::ProblemOf<compute_t<T>>;

// Validates the inputs shared by forward and backward; returns the problem
// and adds the inputs' extents to `read` (for the outputs' overlap check).
template <class T>
ProblemFor<T> validate_inputs(const Checker& c, const SdpaArgs<T>& a, const SdpaOptions& opt,
                              std::vector<detail::Extent>& read, detail::Origin origin = {}) {
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
  read.push_back(c.extent(a.q, "q"));
  read.push_back(c.extent(a.k, "k"));
  read.push_back(c.extent(a.v, "v"));
  if (c.given(a.key_lengths, "key_lengths")) {
    c.shape(a.key_lengths, "key_lengths", {B});
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = a.key_lengths(b);
      if (n < 0 || n > S)
        c.fail("argument 'key_lengths' has value " + std::to_string(n) + " at batch " + std::to_string(b) +
               ", expected 0 <= key_lengths[b] <= S = " + std::to_string(S));
    }
    read.push_back(c.extent(a.key_lengths, "key_lengths"));
  }
  (void)detail::check_rules<compute_t<T>>(c, a, opt, full, read);
  if (opt.check_finite) {
    c.finite(a.q, "q");
    c.finite(a.k, "k");
    c.finite(a.v, "v");
  }
  return detail::make_problem(a, opt, origin);
}

// The one dispatch point between backends (the decode kernel is the fused
// backend's route for calls with few query rows: detail::decode_suits_dense).
template <class T>
Backend choose(const Checker& c, const SdpaOptions& opt) {
  // The fused backend takes every float32 request (half inputs compute in float32).
  constexpr bool fused_ok = std::is_same_v<compute_t<T>, float>;
  if (opt.compute_dtype == Dtype::bfloat16) {  // the fused forward's bfloat16 products
    if (!fused_ok) c.fail("option 'compute_dtype' is bfloat16, which takes float32, float16 or bfloat16 inputs, not double");
    if (opt.backend == Backend::reference)
      c.fail("option 'compute_dtype' is bfloat16, which the reference backend does not compute (it is exact); "
             "use compute_dtype float32, or backend auto or fused");
  }
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

// Scores beyond float32's range. The float32 kernels form u = scale·q·k in
// float32, so finite q and k large enough (entries near 1e19 at E = 64)
// overflow it, and the row's lse comes out NaN or +inf. The reference
// accumulates in double: such a forward is computed again there, and such a
// backward goes there from the start. The forward's check reads lse (B·H·L
// compares) and reads q and k again only when it finds such a row; the
// backward's bound is detail::scores_may_overflow.
template <class T>
bool overflowed(const SdpaArgs<T>& a, View3<const float> lse) {
  bool found = false;
  detail::for_each(lse, [&](float x, const auto&) { found |= std::isnan(x) || x == std::numeric_limits<float>::infinity(); });
  if (!found) return false;
  bool finite = true;  // NaN or ±inf inputs are not overflow: they reach the outputs as they should
  for (const View4<const T>& x : {a.q, a.k}) detail::for_each(x, [&](T y, const auto&) { finite &= std::isfinite(float(y)); });
  return finite;
}

// A float32 kernel's forward into `outputs`, with lse (the caller's, or
// scratch) checked for overflow afterwards.
template <class T, class Kernel>
void checked_forward(const ProblemFor<T>& p, const SdpaArgs<T>& args, const SdpaOutputs<float>& outputs,
                     Kernel&& kernel) {
  SdpaOutputs<float> o = outputs;
  Tensor<float> scratch;
  if (o.lse.empty()) scratch = Tensor<float>::uninitialized({p.B, p.H, p.L}), o.lse = scratch.template view<3>();
  kernel(o);
  if (!overflowed(args, View3<const float>(o.lse))) return;
  if constexpr (is_half_v<T>) {
    const detail::Widened<T> w(args, p.threads);
    detail::reference_forward(p, w.args, outputs.out, outputs.weights, outputs.lse);
  } else {
    detail::reference_forward(p, args, outputs.out, outputs.weights, outputs.lse);
  }
}

template <class T>
void forward(const Checker& c, const ProblemFor<T>& p, const SdpaArgs<T>& args,
             const SdpaOutputs<compute_t<T>>& outputs, const SdpaOptions& opt) {
  const auto& [out, weights, lse] = outputs;
  const Backend backend = choose<T>(c, opt);
  if constexpr (std::is_same_v<compute_t<T>, float>) {
    // Few query rows (decoding shapes): the grouped split-KV decode kernel,
    // which reads half K and V in their storage type.
    if (backend == Backend::fused && weights.empty() && !p.dropout.on() && detail::decode_suits_dense(p))
      return checked_forward(p, args, outputs, [&](const SdpaOutputs<float>& o) {
        detail::decode_forward_dense(p, args, o.out, o.lse);
      });
    // bfloat16 products, on the best instruction path this CPU has (q, k
    // and v of any input type are rounded once, kernels/fused/bf16.cpp).
    if (p.bf16_products)
      return checked_forward(p, args, outputs, [&](const SdpaOutputs<float>& o) {
        detail::fused_forward_bf16(p, args, o.out, o.weights, o.lse, detail::bf16_best_path());
      });
  }
  if constexpr (is_half_v<T>) {  // every other route: the float32 call on widened copies
    const detail::Widened<T> w(args, p.threads);
    forward<float>(c, p, w.args, outputs, opt);
  } else if (backend == Backend::fused) {
    if constexpr (std::is_same_v<T, float>)
      checked_forward(p, args, outputs, [&](const SdpaOutputs<float>& o) {
        detail::fused_forward(p, args, o.out, o.weights, o.lse);
      });
  } else {
    detail::reference_forward(p, args, out, weights, lse);
  }
}

// Whether a backward takes the bfloat16 products, as the forward's (which
// recomputes the saved state when it is missing, so the bits are the same
// either way): the fused backend, scores within float32's range.
template <class T>
bool bf16_backward(const Checker& c, const ProblemFor<T>& p, const SdpaArgs<T>& args, const SdpaOptions& opt) {
  return p.bf16_products && (p.dropout.on() || !detail::decode_suits_dense(p)) &&
         choose<T>(c, opt) == Backend::fused &&
         !detail::scores_may_overflow(args.q, args.k, p.E, p.rules.scale, p.threads);
}

template <class T>
void backward(const Checker& c, const ProblemFor<T>& p, const SdpaArgs<T>& args, View4<const T> dout,
              const SdpaSaved<T>& saved, const SdpaGrads<T>& g, const SdpaOptions& opt) {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_backward(c, p, args, opt))
      return detail::fused_backward_bf16(p, args, dout, g, saved.out, saved.lse, detail::bf16_best_path());
    if (choose<T>(c, opt) == Backend::fused &&
        !detail::scores_may_overflow(args.q, args.k, p.E, p.rules.scale, p.threads)) {
      // The fused backward uses the forward's out and lse. Without them it
      // would recompute them with its own forward; a call with few query
      // rows runs the decode kernel forward instead, whose last bits differ.
      // So the missing ones come from the forward this call's forward runs,
      // and the gradients are the same bits with the saved state or without.
      // (A call with few query rows and bfloat16 compute gets here too: the
      // float32 backward on its forward's state, with the float32 kernel's
      // problem, whose scratch is laid out for float32 products.)
      ProblemFor<T> pf = p;
      pf.bf16_products = false;
      if ((saved.out.empty() || saved.lse.empty()) && detail::decode_suits_dense(p)) {
        auto o = Tensor<float>::uninitialized({p.B, p.H, p.L, p.Ev});
        auto l = Tensor<float>::uninitialized({p.B, p.H, p.L});
        detail::decode_forward_dense(p, args, o.view4(), l.template view<3>());
        return detail::fused_backward(pf, args, dout, g, saved.out.empty() ? View4<const float>(o.view4()) : saved.out,
                                      saved.lse.empty() ? View3<const float>(l.template view<3>()) : saved.lse);
      }
      return detail::fused_backward(pf, args, dout, g, saved.out, saved.lse);
    }
  } else {
    (void)choose<T>(c, opt);
  }
  detail::reference_backward(p, args, dout, g);
}

}  // namespace

template <class T>
Backend detail::check_attention(const Checker& c, const SdpaArgs<T>& args, const SdpaOptions& opt) {
  std::vector<Extent> read;
  (void)validate_inputs(c, args, opt, read);
  return choose<T>(c, opt);
}

template <class T>
Backend resolve_backend(const SdpaArgs<T>& args, const SdpaOptions& opt) {
  return detail::check_attention(Checker{"resolve_backend"}, args, opt);
}

namespace {

// The public calls, for a call at `origin` in a larger one (detail::Origin;
// {0, 0} for a whole call).
template <class T>
void forward_call(const SdpaArgs<T>& args, const SdpaOutputs<compute_t<T>>& outputs, const SdpaOptions& opt,
                  detail::Origin origin) {
  const Checker c{"scaled_dot_product_attention"};
  const auto& [out, weights, lse] = outputs;
  std::vector<detail::Extent> read;
  const auto p = validate_inputs(c, args, opt, read, origin);
  c.present(out, "out", "of (B, H, L, Ev)");
  c.shape(out, "out", {p.B, p.H, p.L, p.Ev});
  std::vector<detail::Extent> written{c.extent(out, "out")};
  c.optional(weights, "weights", {p.B, p.H, p.L, p.S}, written);
  c.optional(lse, "lse", {p.B, p.H, p.L}, written);
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, read);
  forward<T>(c, p, args, outputs, opt);
}

template <class T>
void backward_call(const SdpaArgs<T>& args, View4<const compute_t<T>> dout, const SdpaSaved<compute_t<T>>& saved,
                   const SdpaGrads<compute_t<T>>& g, const SdpaOptions& opt, detail::Origin origin) {
  const Checker c{"scaled_dot_product_attention_backward"};
  const auto& [out, lse] = saved;
  std::vector<detail::Extent> read;
  const auto p = validate_inputs(c, args, opt, read, origin);
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
  read.push_back(c.extent(dout, "dout"));
  c.optional(out, "out", {p.B, p.H, p.L, p.Ev}, read);
  c.optional(lse, "lse", {p.B, p.H, p.L}, read);
  c.disjoint(written, read);
  if (opt.check_finite) c.finite(dout, "dout");
  if constexpr (std::is_same_v<T, bfloat16_t>)  // bfloat16 products on the inputs as they are
    if (bf16_backward(c, p, args, opt))
      return detail::fused_backward_bf16(p, args, dout, g, saved.out, saved.lse, detail::bf16_best_path());
  if constexpr (is_half_v<T>) {
    const detail::Widened<T> w(args, p.threads);
    backward<float>(c, p, w.args, dout, saved, g, opt);
  } else {
    backward<T>(c, p, args, dout, saved, g, opt);
  }
}

}  // namespace

template <class T>
void scaled_dot_product_attention(const SdpaArgs<T>& args, const SdpaOutputs<compute_t<T>>& outputs,
                                  const SdpaOptions& opt) {
  forward_call<T>(args, outputs, opt, {});
}

template <class T>
void scaled_dot_product_attention_backward(const SdpaArgs<T>& args, View4<const compute_t<T>> dout,
                                           const SdpaSaved<compute_t<T>>& saved,
                                           const SdpaGrads<compute_t<T>>& g, const SdpaOptions& opt) {
  backward_call<T>(args, dout, saved, g, opt, {});
}

template <class T>
void detail::block_attention(const SdpaArgs<T>& args, const SdpaOutputs<compute_t<T>>& outputs,
                             const SdpaOptions& opt, Origin origin) {
  forward_call<T>(args, outputs, opt, origin);
}

template <class T>
void detail::block_attention_backward(const SdpaArgs<T>& args, View4<const compute_t<T>> dout,
                                      const SdpaSaved<compute_t<T>>& saved, const SdpaGrads<compute_t<T>>& g,
                                      const SdpaOptions& opt, Origin origin) {
  backward_call<T>(args, dout, saved, g, opt, origin);
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
  template Backend resolve_backend<T>(const SdpaArgs<T>&, const SdpaOptions&);                             \
  template Backend detail::check_attention<T>(const detail::Checker&, const SdpaArgs<T>&, const SdpaOptions&); \
  template detail::ProblemOf<compute_t<T>> detail::make_problem<T>(const SdpaArgs<T>&, const SdpaOptions&,    \
                                                                    detail::Origin);                         \
  template void detail::block_attention<T>(const SdpaArgs<T>&, const SdpaOutputs<compute_t<T>>&,            \
                                           const SdpaOptions&, detail::Origin);                              \
  template void detail::block_attention_backward<T>(const SdpaArgs<T>&, View4<const compute_t<T>>,            \
                                                    const SdpaSaved<compute_t<T>>&,                          \
                                                    const SdpaGrads<compute_t<T>>&, const SdpaOptions&, detail::Origin);

ATTN_INSTANTIATE_SDPA(float)
ATTN_INSTANTIATE_SDPA(double)
ATTN_INSTANTIATE_SDPA(float16_t)
ATTN_INSTANTIATE_SDPA(bfloat16_t)
#undef ATTN_INSTANTIATE_SDPA
template float softmax<float>(const float*, float*, int64_t);
template double softmax<double>(const double*, double*, int64_t);

}  // namespace attn
