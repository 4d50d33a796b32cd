// Internal: the one argument-validation toolkit of the public boundary,
// shared by src/sdpa.cpp (attention), src/varlen.cpp, src/decode_call.cpp,
// src/multihead/ (the layer), src/io (array writers), src/nn
// (configurations) and src/dist
// (which collects a verdict per rank instead of throwing: verdict()). Every
// check throws attn::InvalidArgument with a message "attn::<function>:
// argument '<name>' <what was wrong>, expected <what is allowed>". Kernels
// behind the boundary assume valid views and use debug asserts only.
//
// What a view must satisfy:
//   given      an optional view is absent when it is default-constructed (no
//              data, every dimension 0); a shape with elements but no data is
//              an error, never "absent".
//   sizes      dimensions >= 0, strides >= 0, and every element count and
//              address offset fits in int64 (so no later size arithmetic can
//              overflow).
//   writable   an output has no two elements at one address (no stride-0
//              broadcast, no overlapping strides).
//   disjoint   no output shares memory with another output or an input.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "attn/error.hpp"
#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"
#include "kernels/problem.hpp"
#include "kernels/score_rules.hpp"

namespace attn::detail {

// a·b, or nullopt-like false when it does not fit in int64.
inline bool checked_mul(int64_t a, int64_t b, int64_t* r) { return !__builtin_mul_overflow(a, b, r); }
inline bool checked_add(int64_t a, int64_t b, int64_t* r) { return !__builtin_add_overflow(a, b, r); }

// The memory a view touches: bytes [lo, hi] (inclusive), and the view's
// shape, byte strides and element size for the finer overlap test.
struct Extent {
  const char* name = "";
  uintptr_t lo = 0, hi = 0;
  int rank = 0;
  std::array<int64_t, 4> shape{}, stride{};  // stride in bytes
  int64_t itemsize = 0;
};

// Calls f(x) for every element of a strided view, in row-major index order.
template <class T, int R, class F>
void for_each(const View<T, R>& v, F&& f) {
  std::array<int64_t, R> idx{};
  const int64_t n = v.numel();
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t off = 0;
    for (int i = 0; i < R; ++i) off += idx[size_t(i)] * v.strides[size_t(i)];
    f(v.data[off], idx);
    for (int i = R - 1; i >= 0; --i) {
      if (++idx[size_t(i)] < v.shape[size_t(i)]) break;
      idx[size_t(i)] = 0;
    }
  }
}

// An enum's names, listed once (value, name, an optional short alias); the
// enum's name function and its parser both read the list.
template <class E>
struct NamedValue {
  E value;
  std::string_view name, alias = {};
};

template <class E, size_t N>
const char* name_of(const NamedValue<E> (&names)[N], E v) {
  for (const auto& n : names)
    if (n.value == v) return n.name.data();
  return "?";
}

// max |x[i]| over a row of n float32 or bfloat16 (NaN left out;
// kernels/fused/fused.cpp, SIMD on the running target).
float max_abs_row(const float* x, int64_t n);
float max_abs_row(const bfloat16_t* x, int64_t n);

// max |x| over a view, NaN left out: its rows (the last axis) split over
// `threads`, a float32 or bfloat16 row of adjacent elements by max_abs_row. (The maximum
// does not depend on the order.)
template <class T, int R>
float max_abs(const View<T, R>& v, int threads) {
  const int64_t n = v.shape[R - 1], rows = n > 0 ? v.numel() / n : 0, s = v.strides[R - 1];
  float m = 0;
#if defined(_OPENMP)  // (headers of the library's parts built without OpenMP include this one too)
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : m) if (rows * n >= (1 << 16))
#else
  (void)threads;
#endif
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (int64_t i = R - 2, rest = r; i >= 0; --i) {
      off += rest % v.shape[size_t(i)] * v.strides[size_t(i)];
      rest /= v.shape[size_t(i)];
    }
    const T* row = v.data + off;
    if constexpr (std::is_same_v<std::remove_cv_t<T>, float> || std::is_same_v<std::remove_cv_t<T>, bfloat16_t>)
      if (s == 1) {
        m = std::max(m, max_abs_row(row, n));
        continue;
      }
    for (int64_t e = 0; e < n; ++e) {
      const float a = std::fabs(float(row[e * s]));
      m = a > m ? a : m;  // (NaN: not greater)
    }
  }
  return m;
}

// Whether a float32 kernel's scores u = scale·q·k can leave float32's range:
// |u| <= E·max|q|·max|k|·scale, checked against 2^120 (one pass over q and
// k, split over `threads`). Such calls go to the reference, which
// accumulates in double.
template <class Q, class K>
bool scores_may_overflow(const Q& q, const K& k, int64_t E, double scale, int threads) {
  const float big[2] = {max_abs(q, threads), max_abs(k, threads)};
  return double(E) * double(big[0]) * double(big[1]) * std::max(1.0, std::fabs(scale)) > 0x1p120;
}

// Collects the context for error messages: "attn::<fn>: ...".
struct Checker {
  std::string fn;  // without the "attn::" prefix, e.g. "scaled_dot_product_attention"

  [[noreturn]] void fail(const std::string& msg) const;

  // The value named `name` in `names`, or "unknown <what> '<name>', expected
  // one of ...".
  template <class E, size_t N>
  E parse(const NamedValue<E> (&names)[N], std::string_view name, const char* what) const {
    std::string all;
    for (const auto& n : names) {
      if (name == n.name || (!n.alias.empty() && name == n.alias)) return n.value;
      all += (all.empty() ? "" : ", ") + std::string(n.name);
    }
    fail(std::string("unknown ") + what + " '" + std::string(name) + "', expected one of " + all);
  }

  // Runs `checks` (calls on this Checker) and returns the message of the
  // first that failed, or "" when all passed: for callers that must share
  // the verdict before anyone throws (attn::dist, whose ranks agree on it).
  template <class F>
  std::string verdict(F&& checks) const {
    try {
      checks();
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "";
  }

  // Sizes of any view, given or not: see the top comment.
  template <class T, int R>
  void sizes(const View<T, R>& v, const char* name) const {
    sizes_impl(v.shape.data(), v.strides.data(), R, int64_t(sizeof(T)), name);
  }

  // The element count of a shape (dimensions >= 0, the count fits in int64).
  int64_t count(const std::vector<int64_t>& shape, const char* name) const {
    return count(shape.data(), int(shape.size()), name);
  }

  // Whether an optional view was given; an error when it has a shape with
  // elements but no data.
  template <class T, int R>
  bool given(const View<T, R>& v, const char* name) const {
    sizes(v, name);
    if (v.data != nullptr) return true;
    for (auto s : v.shape)
      if (s != 0) {
        if (v.numel() != 0) fail(std::string("argument '") + name + "' has shape " + shape_str(v.shape) +
                                 " but no data (null pointer)");
        return true;  // zero elements: the shape checks that follow explain what is wrong
      }
    return false;
  }

  // A required view.
  template <class T, int R>
  void require(const View<T, R>& v, const char* name) const {
    if (!given(v, name)) fail(std::string("argument '") + name + "' is required but was not given");
  }

  // A required view with every dimension >= 1.
  template <class T, int R>
  void present(const View<T, R>& v, const char* name, const char* axes) const {
    require(v, name);
    for (int i = 0; i < R; ++i)
      if (v.shape[size_t(i)] < 1)
        fail(std::string("argument '") + name + "' has shape " + shape_str(v.shape) + "; every dimension " +
             axes + " must be >= 1");
  }

  // Exact shape check; `expected_text` explains symbolic entries.
  template <class T, int R>
  void shape(const View<T, R>& v, const char* name, const std::type_identity_t<std::array<int64_t, R>>& want,
             const std::string& expected_text = "") const {
    if (v.shape != want)
      fail(std::string("argument '") + name + "' has shape " + shape_str(v.shape) + ", expected " +
           (expected_text.empty() ? shape_str(want) : expected_text));
  }

  // An optional view of an exact shape: when given, checks the shape and
  // adds the view's extent to `seen` (for disjoint()).
  template <class T, int R>
  bool optional(const View<T, R>& v, const char* name, const std::type_identity_t<std::array<int64_t, R>>& want,
                std::vector<Extent>& seen, const std::string& expected_text = "") const {
    if (!given(v, name)) return false;
    shape(v, name, want, expected_text);
    seen.push_back(extent(v, name));
    return true;
  }

  // An output: distinct elements at distinct addresses.
  template <class T, int R>
  void writable(const View<T, R>& v, const char* name) const {
    writable(extent(v, name));
  }
  void writable(const Extent& e) const;

  // A broadcastable (B, H, L, S) operand: each axis 1 or the full size.
  template <class T>
  void broadcastable(const View4<T>& v, const char* name, const std::array<int64_t, 4>& full) const {
    for (int i = 0; i < 4; ++i)
      if (v.shape[size_t(i)] != 1 && v.shape[size_t(i)] != full[size_t(i)])
        fail(std::string("argument '") + name + "' has shape " + shape_str(v.shape) +
             ", expected each axis of (B, H, L, S) = " + shape_str(full) + " or 1 (broadcast)");
  }

  // An optional boolean mask (true = may attend) and an optional additive
  // bias, each broadcastable to `full`; the bias may hold -Inf (it masks)
  // but no NaN or +Inf. The extents of those given join `read` (for
  // disjoint()).
  template <class F>
  void mask_and_bias(const View4<const bool>& mask, const char* mask_name, const View4<const F>& bias,
                     const char* bias_name, const std::array<int64_t, 4>& full, std::vector<Extent>& read) const {
    if (given(mask, mask_name)) {
      broadcastable(mask, mask_name, full);
      read.push_back(extent(mask, mask_name));
    }
    if (given(bias, bias_name)) {
      broadcastable(bias, bias_name, full);
      finite(bias, bias_name, /*allow_neg_inf=*/true);
      read.push_back(extent(bias, bias_name));
    }
  }

  // No NaN or Inf (with allow_neg_inf: -Inf is allowed, it masks).
  template <class T, int R>
  void finite(const View<T, R>& v, const char* name, bool allow_neg_inf = false) const {
    bool bad = false;
    std::array<int64_t, R> at{};
    for_each(v, [&](T x, const std::array<int64_t, R>& idx) {
      if (!bad && (std::isnan(x) || (std::isinf(x) && !(allow_neg_inf && x < 0)))) bad = true, at = idx;
    });
    if (bad)
      fail(std::string("argument '") + name + "' contains " + (allow_neg_inf ? "NaN or +Inf" : "NaN or Inf") +
           " at " + shape_str(at) + (allow_neg_inf ? " (only -Inf is allowed, as a mask)" : ""));
  }

  // The memory a (given) view touches, for disjoint().
  template <class T, int R>
  Extent extent(const View<T, R>& v, const char* name) const {
    Extent e;
    e.name = name;
    e.rank = R;
    e.itemsize = int64_t(sizeof(T));
    int64_t last = 0;  // byte offset of the last element; fits, by sizes()
    for (int i = 0; i < R; ++i) {
      e.shape[size_t(i)] = v.shape[size_t(i)];
      e.stride[size_t(i)] = v.strides[size_t(i)] * e.itemsize;
      last += (v.shape[size_t(i)] - 1) * e.stride[size_t(i)];
    }
    e.lo = reinterpret_cast<uintptr_t>(v.data);
    e.hi = e.lo + uintptr_t(last + e.itemsize - 1);
    return e;
  }

  // Every output is disjoint from every other output and from every input.
  // Views with no elements are skipped.
  void disjoint(const std::vector<Extent>& outputs, const std::vector<Extent>& inputs) const;

  // The number of threads to use for a num_threads option: 0 = the OpenMP
  // default; 1..kMaxThreads accepted and clamped to the machine (see
  // SdpaOptions::num_threads); anything else is an argument error.
  int threads(int requested, const char* name = "num_threads") const;

 private:
  int64_t count(const int64_t* shape, int rank, const char* name) const;
  void sizes_impl(const int64_t* shape, const int64_t* strides, int rank, int64_t itemsize,
                  const char* name) const;
};

// Positions, window sides and chunk lengths beyond this are refused
// (offsets, chunks) or clamped (window: a side this long is unbounded), so
// position arithmetic never overflows.
constexpr int64_t kMaxPosition = int64_t(1) << 52;

// The range of the score factors, scale and soft-cap (src/rules.cpp): the
// float32 kernels multiply the scores by scale·log2(e) and divide them by the
// soft-cap, which beyond these bounds overflow, underflow or lose the cap.
constexpr double kMinScoreFactor = 0x1p-64, kMaxScoreFactor = 0x1p64;
constexpr const char* kScoreFactorRange = "[2^-64, 2^64] (about 5.4e-20 to 1.8e+19)";

// The score rules of one attention call (src/rules.cpp), the one place every
// entry point checks and resolves them.
//
// check_rules: the rule operands against full = (B, H, L, S) (S: the key
// positions, a cache's capacity): mask and bias broadcastable, (H) finite
// slopes, (H) sinks without NaN or +inf; and the options: scale and
// soft-cap (0 = off) within kScoreFactorRange, window sides >= -1,
// chunk_size >= 0, position_offset, num_threads. The extents of the operands given join `read`; returns the
// thread count to use. F: float or double.
template <class F>
int check_rules(const Checker& c, const ScoreArgs<F>& a, const SdpaOptions& opt, const std::array<int64_t, 4>& full,
                std::vector<Extent>& read);

// resolve_rules: the rule set of a call that passed check_rules, for head
// size E (the default scale 1/sqrt(E)), with B per-sequence query offsets
// and key ends (see ScoreRules).
template <class F>
ScoreRules<F> resolve_rules(const ScoreArgs<F>& a, const SdpaOptions& opt, int64_t E, std::vector<int64_t> offset,
                            std::vector<int64_t> key_end);

// The position of query row 0 of a dense call with L queries over S keys:
// opt.position_offset when given, else by opt.causal_align.
int64_t dense_offset(const SdpaOptions& opt, int64_t L, int64_t S);

// Every option of a call as numbers, in a fixed order, with their names: for
// the distributed calls, whose ranks must agree on all of them.
std::vector<std::pair<const char*, int64_t>> option_fingerprint(const SdpaOptions& opt);

// The checks of one dense attention call's arguments and options
// (src/sdpa.cpp) under c's function name, and the backend the call resolves
// to: for entry points that run attention calls of their own
// (varlen_attention checks each sequence's call under its own name).
template <class T>
Backend check_attention(const Checker& c, const SdpaArgs<T>& args, const SdpaOptions& opt);

// The dense call (forward and backward, checked as the public ones are) as
// a part of a larger call at `origin` (kernels/problem.hpp): the ring's
// blocks, whose keys start at a global position (chunk boundaries are
// positions of the whole sequence), and a packed batch's per-sequence calls
// (the sequence index is the dropout's b).
template <class T>
void block_attention(const SdpaArgs<T>& args, const SdpaOutputs<compute_t<T>>& outputs, const SdpaOptions& opt,
                     Origin origin);
template <class T>
void block_attention_backward(const SdpaArgs<T>& args, View4<const compute_t<T>> dout,
                              const SdpaSaved<compute_t<T>>& saved, const SdpaGrads<compute_t<T>>& g,
                              const SdpaOptions& opt, Origin origin);

}  // namespace attn::detail
