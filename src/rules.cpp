// The score rules at the boundary: every entry point (sdpa, varlen, decode
// over a cache, the multi-head layer, dist) checks a call's rule operands and
// options here and resolves them into the one ScoreRules the kernels read
// (kernels/score_rules.hpp). A new rule is one option of SdpaOptions, one
// check, one line of resolution and one fingerprint entry below, and its
// place in ScoreRules (docs/architecture.md, "Adding a score rule").
#include <cmath>
#include <cstring>
#include <sstream>

#include "validate.hpp"

namespace attn::detail {

template <class F>
int check_rules(const Checker& c, const ScoreArgs<F>& a, const SdpaOptions& opt, const std::array<int64_t, 4>& full,
                std::vector<Extent>& read) {
  const int64_t H = full[1];
  // The float32 kernels fold scale (times log2 e) into the scores and divide
  // by the soft-cap; within 2^-64 .. 2^64 both, their products with log2 e
  // and their reciprocals stay normal float32 with room for the scores, so
  // every backend computes the same thing.
  const auto in_range = [](double x) { return x >= kMinScoreFactor && x <= kMaxScoreFactor; };
  if (opt.scale && !(std::isfinite(*opt.scale) && *opt.scale > 0 && in_range(*opt.scale))) {
    std::ostringstream os;
    os << "option 'scale' is " << *opt.scale << ", expected a finite value > 0 within " << kScoreFactorRange;
    c.fail(os.str());
  }
  for (const auto& [side, name] : {std::pair{opt.window.left, "window.left"}, {opt.window.right, "window.right"}})
    if (side < -1)
      c.fail(std::string("option '") + name + "' is " + std::to_string(side) + ", expected >= 0 or -1 (unbounded)");
  if (opt.chunk_size < 0 || opt.chunk_size > kMaxPosition)
    c.fail("option 'chunk_size' is " + std::to_string(opt.chunk_size) + ", expected 0 (off) or 1 .. 2^52");
  if (!(opt.softcap == 0 || in_range(opt.softcap))) {
    std::ostringstream os;
    os << "option 'softcap' is " << opt.softcap << ", expected 0 (off) or a value within " << kScoreFactorRange;
    c.fail(os.str());
  }
  if (opt.position_offset && (*opt.position_offset > kMaxPosition || *opt.position_offset < -kMaxPosition))
    c.fail("option 'position_offset' is " + std::to_string(*opt.position_offset) + ", expected |offset| <= 2^52");
  if (!(opt.dropout_p >= 0 && opt.dropout_p <= 1)) {
    std::ostringstream os;
    os << "option 'dropout_p' is " << opt.dropout_p << ", expected 0 <= dropout_p <= 1";
    c.fail(os.str());
  }
  if (opt.compute_dtype && *opt.compute_dtype != Dtype::float32 && *opt.compute_dtype != Dtype::bfloat16)
    c.fail(std::string("option 'compute_dtype' is ") + dtype_name(*opt.compute_dtype) +
           ", expected float32 (exact) or bfloat16 (bfloat16 products)");
  c.mask_and_bias(a.mask, "mask", a.bias, "bias", full, read);
  if (c.given(a.alibi_slopes, "alibi_slopes")) {
    c.shape(a.alibi_slopes, "alibi_slopes", {H}, "(H,) = " + shape_str({H}) + ", one slope per query head");
    c.finite(a.alibi_slopes, "alibi_slopes");
    read.push_back(c.extent(a.alibi_slopes, "alibi_slopes"));
  }
  if (c.given(a.sinks, "sinks")) {
    c.shape(a.sinks, "sinks", {H}, "(H,) = " + shape_str({H}) + ", one logit per query head");
    c.finite(a.sinks, "sinks", /*allow_neg_inf=*/true);
    read.push_back(c.extent(a.sinks, "sinks"));
  }
  return c.threads(opt.num_threads);
}

template <class F>
ScoreRules<F> resolve_rules(const ScoreArgs<F>& a, const SdpaOptions& opt, int64_t E, std::vector<int64_t> offset,
                            std::vector<int64_t> key_end) {
  ScoreRules<F> r;
  r.scale = opt.scale ? *opt.scale : 1.0 / std::sqrt(double(E));
  r.causal = opt.causal;
  r.window_left = std::min(opt.window.left, kMaxPosition);  // a side this long is unbounded anyway
  r.window_right = std::min(opt.window.right, kMaxPosition);
  r.chunk = opt.chunk_size;
  r.offset = std::move(offset);
  r.key_end = std::move(key_end);
  r.softcap = opt.softcap;
  r.alibi_slopes = a.alibi_slopes;
  r.bias = a.bias;
  r.mask = a.mask;
  r.sinks = a.sinks;
  return r;
}

int64_t dense_offset(const SdpaOptions& opt, int64_t L, int64_t S) {
  if (opt.position_offset) return *opt.position_offset;
  return opt.causal_align == CausalAlign::bottom_right ? S - L : 0;
}

std::vector<std::pair<const char*, int64_t>> option_fingerprint(const SdpaOptions& opt) {
  const auto bits = [](double x) {
    int64_t b = 0;
    std::memcpy(&b, &x, sizeof b);
    return b;
  };
  return {{"scale", opt.scale ? bits(*opt.scale) : int64_t(-1)},
          {"causal", int64_t(opt.causal)},
          {"causal_align", int64_t(opt.causal_align)},
          {"window.left", opt.window.left},
          {"window.right", opt.window.right},
          {"chunk_size", opt.chunk_size},
          {"softcap", bits(opt.softcap)},
          {"whether position_offset was given", int64_t(opt.position_offset.has_value())},
          {"position_offset", opt.position_offset.value_or(0)},
          {"backend", int64_t(opt.backend)},
          {"check_finite", int64_t(opt.check_finite)},
          {"dropout_p", bits(opt.dropout_p)},
          {"dropout_seed", int64_t(opt.dropout_seed)},
          {"dropout_offset", int64_t(opt.dropout_offset)},
          {"compute_dtype", opt.compute_dtype ? int64_t(*opt.compute_dtype) : int64_t(-1)}};
}

}  // namespace attn::detail

namespace attn {

std::vector<double> alibi_slopes(int64_t num_heads) {
  if (num_heads < 1 || num_heads > (int64_t(1) << 24))
    throw InvalidArgument("attn::alibi_slopes: num_heads is " + std::to_string(num_heads) + ", expected 1 to 2^24");
  int64_t n = 1;  // the largest power of two <= num_heads
  while (2 * n <= num_heads) n *= 2;
  std::vector<double> s;
  s.reserve(size_t(num_heads));
  for (int64_t h = 0; h < n; ++h) s.push_back(std::exp2(-8.0 * double(h + 1) / double(n)));
  // the rest: the odd-numbered slopes of 2n heads, 2^(-8(2i+1)/(2n))
  for (int64_t i = 0; int64_t(s.size()) < num_heads; ++i) s.push_back(std::exp2(-8.0 * double(2 * i + 1) / double(2 * n)));
  return s;
}

}  // namespace attn

namespace attn::detail {

#define ATTN_INSTANTIATE_RULES(F)                                                                               \
  template int check_rules<F>(const Checker&, const ScoreArgs<F>&, const SdpaOptions&, const std::array<int64_t, 4>&, \
                              std::vector<Extent>&);                                                            \
  template ScoreRules<F> resolve_rules<F>(const ScoreArgs<F>&, const SdpaOptions&, int64_t, std::vector<int64_t>, \
                                          std::vector<int64_t>);
ATTN_INSTANTIATE_RULES(float)
ATTN_INSTANTIATE_RULES(double)
#undef ATTN_INSTANTIATE_RULES

}  // namespace attn::detail
