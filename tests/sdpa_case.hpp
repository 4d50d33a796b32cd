// The one random attention case of the C++ tests: q, k, v (and dY) in one
// of three physical layouts, masks, biases, key lengths and the variants'
// per-head tensors, run forward/backward through the public API. Two ways
// to build one:
//   SdpaCase(shape, rng)   a shape and a mask kind picked by the test
//                          (add_mask), values from the caller's generator;
//   SdpaCase(spec)         a RandomSpec, everything drawn from spec.seed:
//                          random broadcast shapes for the mask and the bias,
//                          fully masked rows, the variants (the fused sweep,
//                          random_spec samples specs over awkward shapes).
#pragma once

#include <array>
#include <optional>
#include <sstream>
#include <string>

#include "testing.hpp"

namespace attn::testing {

// A (B, H, N, F) tensor's physical layout. strided: rows of R = 2F + 3
// elements holding every other one (strides (H·N·R, N·R, R, 2)); bhnd and
// bnhd rows of F elements followed by `pad` unused ones.
enum class Layout { bhnd, bnhd, strided };
inline const char* layout_name(Layout l) {
  return l == Layout::bhnd ? "bhnd" : l == Layout::bnhd ? "bnhd" : "strided";
}

inline int64_t layout_row(int64_t F, Layout l, int64_t pad) { return l == Layout::strided ? 2 * F + 3 : F + pad; }

template <class T>
View4<T> layout_view(T* data, int64_t B, int64_t H, int64_t N, int64_t F, Layout l, int64_t pad = 0) {
  const int64_t R = layout_row(F, l, pad);
  if (l == Layout::strided) return View4<T>(data, {B, H, N, F}, {H * N * R, N * R, R, 2});
  if (l == Layout::bnhd) return View4<T>(data, {B, H, N, F}, {N * H * R, R, H * R, 1});
  return View4<T>(data, {B, H, N, F}, {H * N * R, N * R, R, 1});
}

// Owned storage with its (B, H, N, F) view. The gaps of the strided layout
// hold NaN, so that a kernel reading one poisons its result; the elements
// of the view start at 0.
template <class T>
struct Strided {
  std::vector<T> buf;
  View4<T> view;

  Strided() = default;
  Strided(int64_t B, int64_t H, int64_t N, int64_t F, Layout l, int64_t pad = 0) {
    buf.assign(size_t(B * H * N * layout_row(F, l, pad)), l == Layout::strided ? std::numeric_limits<T>::quiet_NaN() : T(0));
    view = layout_view(buf.data(), B, H, N, F, l, pad);
    if (l == Layout::strided)
      for_each_index([&](int64_t b, int64_t h, int64_t n, int64_t f) { view(b, h, n, f) = T(0); });
  }
  // A copy views its own storage (same layout).
  Strided(const Strided& o) : buf(o.buf), view(rebased(o)) {}
  Strided& operator=(const Strided& o) {
    if (this != &o) buf = o.buf, view = rebased(o);
    return *this;
  }
  Strided(Strided&&) noexcept = default;
  Strided& operator=(Strided&&) noexcept = default;

  // Normal values in view order.
  void randomize(std::mt19937_64& rng, double stddev = 1.0) {
    std::normal_distribution<double> nd(0, stddev);
    for_each_index([&](int64_t b, int64_t h, int64_t n, int64_t f) { view(b, h, n, f) = T(nd(rng)); });
  }
  // The values of `from` (same shape) at the same indices: the same tensor in this layout.
  void assign_values(const View4<const T>& from) {
    for_each_index([&](int64_t b, int64_t h, int64_t n, int64_t f) { view(b, h, n, f) = from(b, h, n, f); });
  }
  template <class F>
  void for_each_index(F&& fn) const {
    for (int64_t b = 0; b < view.dim(0); ++b)
      for (int64_t h = 0; h < view.dim(1); ++h)
        for (int64_t n = 0; n < view.dim(2); ++n)
          for (int64_t f = 0; f < view.dim(3); ++f) fn(b, h, n, f);
  }
  T* data() { return buf.data(); }
  const T* data() const { return buf.data(); }
  size_t size() const { return buf.size(); }
  bool empty() const { return buf.empty(); }
  T& operator[](size_t i) { return buf[i]; }
  std::vector<int64_t> shape() const {  // {} when unallocated, as Tensor's
    if (buf.empty()) return {};
    return {view.dim(0), view.dim(1), view.dim(2), view.dim(3)};
  }
  View4<T> view4() const { return view; }

 private:
  View4<T> rebased(const Strided& o) const {
    if (o.buf.empty()) return o.view;
    return View4<T>(const_cast<T*>(buf.data()) + (o.view.data - o.buf.data()), o.view.shape, o.view.strides);
  }
};

struct CaseShape {
  int64_t B = 1, H = 1, Hkv = 1, L = 4, S = 4, E = 8, Ev = 8;
  Layout layout = Layout::bhnd;  // of q, k, v, dY and the outputs
  int64_t pad = 0;               // bhnd/bnhd: unused elements after each row
};

// Everything SdpaCase(spec) draws from spec.seed.
struct RandomSpec {
  int64_t B = 1, H = 1, Hkv = 1, L = 1, S = 1, E = 1, Ev = 1;
  Layout layout = Layout::bhnd;
  bool causal = false;
  CausalAlign align = CausalAlign::top_left;
  int mask = 0;  // 0 none, 1 bool mask, 2 additive bias (with −∞ entries), 3 both; random broadcast shapes
  bool key_lengths = false;  // batch 0 (when B > 1) sees no key
  int threads = 1;
  double scale = 0;  // 0: default
  attn::Window window{};
  std::optional<int64_t> offset;
  double softcap = 0;
  bool alibi = false, sinks = false;  // per-head slopes / sink logits (head 1's sink −∞)
  uint64_t seed = 0;

  CaseShape shape() const { return {B, H, Hkv, L, S, E, Ev, layout, 0}; }
  std::string str() const {
    std::ostringstream os;
    os << "B=" << B << " H=" << H << " Hkv=" << Hkv << " L=" << L << " S=" << S << " E=" << E << " Ev=" << Ev
       << " " << layout_name(layout)
       << (causal ? (align == CausalAlign::top_left ? " causal-tl" : " causal-br") : "") << " mask=" << mask
       << (key_lengths ? " key_lengths" : "") << " threads=" << threads << " seed=" << seed;
    if (scale > 0) os << " scale=" << scale;
    if (window.left >= 0 || window.right >= 0) os << " window=(" << window.left << "," << window.right << ")";
    if (offset) os << " offset=" << *offset;
    if (softcap > 0) os << " softcap=" << softcap;
    if (alibi) os << " alibi";
    if (sinks) os << " sinks";
    return os.str();
  }
};

// A spec over awkward shapes: lengths that are no multiple of any tile
// (1, 17, 267, 1030), odd head sizes, GQA/MQA, every layout, causal both
// ways, masks, key lengths, thread counts. `work_budget` bounds
// L·S·max(E, Ev)·B·H. The scale and the variants come after, from
// random_scale_and_variants.
inline RandomSpec random_spec(std::mt19937_64& rng, uint64_t seed, double work_budget) {
  static const int64_t lengths[] = {1, 2, 3, 17, 63, 64, 65, 127, 267, 1030};
  static const int64_t dims[] = {1, 3, 8, 16, 40, 64, 80, 128, 256};
  static const int threads[] = {1, 2, 3, 8};
  auto pick = [&](const auto& arr) {
    return arr[std::uniform_int_distribution<size_t>(0, std::size(arr) - 1)(rng)];
  };
  RandomSpec c;
  for (;;) {
    c.seed = seed;
    c.L = pick(lengths);
    c.S = std::bernoulli_distribution(0.6)(rng) ? c.L : pick(lengths);
    c.E = pick(dims);
    c.Ev = std::bernoulli_distribution(0.5)(rng) ? c.E : pick(dims);
    c.B = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    c.Hkv = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    c.H = c.Hkv * std::uniform_int_distribution<int64_t>(1, 3)(rng);  // GQA / MQA when > Hkv
    const double work = double(c.L) * double(c.S) * double(std::max(c.E, c.Ev)) * double(c.B * c.H);
    if (work <= work_budget) break;
  }
  c.layout = static_cast<Layout>(std::uniform_int_distribution<int>(0, 2)(rng));
  c.causal = std::bernoulli_distribution(0.4)(rng);
  c.align = std::bernoulli_distribution(0.5)(rng) ? CausalAlign::top_left : CausalAlign::bottom_right;
  c.mask = std::uniform_int_distribution<int>(0, 3)(rng);
  c.key_lengths = std::bernoulli_distribution(0.25)(rng);
  c.threads = pick(threads);
  return c;
}

// The second half of a random spec, drawn after any kernel-specific draws of
// the caller: a custom scale now and then; with `variants`, windows,
// offsets, soft-caps, ALiBi and sinks (each on about half the time).
inline void random_scale_and_variants(RandomSpec& c, std::mt19937_64& rng, bool variants) {
  auto pick = [&](const auto& arr) {
    return arr[std::uniform_int_distribution<size_t>(0, std::size(arr) - 1)(rng)];
  };
  if (std::bernoulli_distribution(0.2)(rng)) c.scale = 0.37;
  if (!variants) return;
  static const int64_t sides[] = {-1, -1, 0, 1, 5, 17, 100};
  std::bernoulli_distribution half(0.5);
  if (half(rng)) c.window = {pick(sides), pick(sides)};
  if (std::bernoulli_distribution(0.3)(rng)) c.offset = std::uniform_int_distribution<int64_t>(-c.L, c.S + 3)(rng);
  if (half(rng)) c.softcap = std::uniform_real_distribution<double>(0.5, 20.0)(rng);
  c.alibi = half(rng);
  c.sinks = half(rng);
}

enum class MaskKind { none, bool_full, bool_broadcast, bias_full, bias_broadcast, key_lengths };

template <class T>
struct SdpaCase {
  CaseShape s;
  Strided<T> qbuf, kbuf, vbuf, obuf, doutbuf;
  Tensor<bool> mask;
  Strided<T> bias;  // bhnd, the mask's shape
  Tensor<int64_t> key_lengths;
  Tensor<T> slopes, sinks;  // (H,) each
  SdpaArgs<T> args;
  SdpaOptions opt;

  // q and k with `stddev`, v with 1, every element of each buffer (pad
  // included) drawn in storage order; dY is not drawn (doutbuf stays 0).
  SdpaCase(const CaseShape& shape, std::mt19937_64& rng, double stddev = 1.0) : s(shape) {
    allocate();
    fill(qbuf, rng, stddev);
    fill(kbuf, rng, stddev);
    fill(vbuf, rng, 1.0);
    bind();
  }

  explicit SdpaCase(const RandomSpec& c) : s(c.shape()) {
    std::mt19937_64 rng(c.seed);
    allocate();
    for (auto* x : {&qbuf, &kbuf, &vbuf, &doutbuf}) x->randomize(rng);
    bind();
    std::bernoulli_distribution coin(0.5);
    auto bshape = [&] {
      return std::array<int64_t, 4>{coin(rng) ? c.B : 1, coin(rng) ? c.H : 1, coin(rng) ? c.L : 1,
                                    coin(rng) ? c.S : 1};
    };
    if (c.mask & 1) {
      const auto m = bshape();
      mask = Tensor<bool>({m[0], m[1], m[2], m[3]});
      std::bernoulli_distribution keep(0.8);
      for (size_t i = 0; i < mask.size(); ++i) mask[i] = keep(rng);
      // A fully masked query row (row 0 of every (b, h) the mask has).
      if (m[2] == c.L && c.L > 1)
        for (size_t i = 0; i < mask.size(); i += size_t(m[2] * m[3]))
          for (int64_t j = 0; j < m[3]; ++j) mask[i + size_t(j)] = false;
      args.mask = mask.view4();
    }
    if (c.mask & 2) {
      const auto m = bshape();
      bias = Strided<T>(m[0], m[1], m[2], m[3], Layout::bhnd);
      bias.randomize(rng);
      std::bernoulli_distribution ninf(0.05);
      for (auto& x : bias.buf)
        if (ninf(rng)) x = -std::numeric_limits<T>::infinity();
      args.bias = bias.view;
    }
    if (c.key_lengths) {
      key_lengths = Tensor<int64_t>({c.B});
      std::uniform_int_distribution<int64_t> len(0, c.S);
      for (int64_t b = 0; b < c.B; ++b) key_lengths[size_t(b)] = b == 0 && c.B > 1 ? 0 : len(rng);
      args.key_lengths = key_lengths.template view<1>();
    }
    opt.causal = c.causal;
    opt.causal_align = c.align;
    opt.num_threads = c.threads;
    if (c.scale > 0) opt.scale = c.scale;
    opt.window = c.window;
    opt.position_offset = c.offset;
    opt.softcap = c.softcap;
    std::uniform_real_distribution<T> slope(T(0), T(0.5)), sink(T(-2), T(3));
    if (c.alibi) {
      slopes = Tensor<T>({c.H});
      for (int64_t h = 0; h < c.H; ++h) slopes[size_t(h)] = slope(rng);
      args.alibi_slopes = slopes.template view<1>();
    }
    if (c.sinks) {
      sinks = Tensor<T>({c.H});
      for (int64_t h = 0; h < c.H; ++h) sinks[size_t(h)] = h == 1 ? -std::numeric_limits<T>::infinity() : sink(rng);
      args.sinks = sinks.template view<1>();
    }
  }

  View4<T> out() { return obuf.view; }
  View4<const T> dout() const { return doutbuf.view; }

  // Adds a mask of the given kind; a few query rows are fully masked on purpose.
  void add_mask(MaskKind kind, std::mt19937_64& rng) {
    std::bernoulli_distribution keep(0.7);
    auto dims = [&](bool broadcast) -> std::array<int64_t, 4> {
      return broadcast ? std::array<int64_t, 4>{1, s.H > 1 ? s.H : 1, s.L, s.S}
                       : std::array<int64_t, 4>{s.B, s.H, s.L, s.S};
    };
    switch (kind) {
      case MaskKind::none: break;
      case MaskKind::bool_full:
      case MaskKind::bool_broadcast: {
        const auto d = dims(kind == MaskKind::bool_broadcast);
        mask = Tensor<bool>({d[0], d[1], d[2], d[3]});
        for (size_t i = 0; i < mask.size(); ++i) mask[i] = keep(rng);
        // Fully mask query row 0 of the first (b, h) slice.
        for (int64_t j = 0; j < s.S; ++j) mask[size_t(j)] = false;
        args.mask = mask.view4();
        break;
      }
      case MaskKind::bias_full:
      case MaskKind::bias_broadcast: {
        const auto d = dims(kind == MaskKind::bias_broadcast);
        bias = Strided<T>(d[0], d[1], d[2], d[3], Layout::bhnd);
        fill(bias, rng, 1.0);
        for (size_t i = 0; i < bias.size(); ++i)
          if (!keep(rng)) bias[i] = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < s.S; ++j) bias[size_t(j)] = -std::numeric_limits<T>::infinity();
        args.bias = bias.view;
        break;
      }
      case MaskKind::key_lengths: {
        key_lengths = Tensor<int64_t>({s.B});
        std::uniform_int_distribution<int64_t> len(0, s.S);
        for (int64_t b = 0; b < s.B; ++b) key_lengths[size_t(b)] = len(rng);
        key_lengths[0] = 0;  // batch 0 sees no key at all
        args.key_lengths = View1<const int64_t>(key_lengths.data(), {s.B});
        break;
      }
    }
  }

  Tensor<T> forward(Tensor<T>* weights = nullptr, Tensor<T>* lse = nullptr) {
    View4<T> w;
    View3<T> l;
    if (weights) {
      *weights = Tensor<T>({s.B, s.H, s.L, s.S});
      w = weights->view4();
    }
    if (lse) {
      *lse = Tensor<T>({s.B, s.H, s.L});
      l = lse->template view<3>();
    }
    scaled_dot_product_attention<T>(args, {out(), w, l}, opt);
    // Return the output as a contiguous (B, H, L, Ev) tensor.
    Tensor<T> y({s.B, s.H, s.L, s.Ev});
    auto o = out();
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t i = 0; i < s.L; ++i)
          for (int64_t e = 0; e < s.Ev; ++e) y.view4()(b, h, i, e) = o(b, h, i, e);
    return y;
  }

  // Every gradient the arguments call for (dbias with a bias, dsinks with sinks).
  struct Grads {
    Tensor<T> dq, dk, dv, dbias, dsinks;
  };
  Grads backward(const Tensor<T>& dy, bool want_dbias = true) {
    Grads g{Tensor<T>({s.B, s.H, s.L, s.E}), Tensor<T>({s.B, s.Hkv, s.S, s.E}),
            Tensor<T>({s.B, s.Hkv, s.S, s.Ev}), {}, {}};
    SdpaGrads<T> sg{g.dq.view4(), g.dk.view4(), g.dv.view4(), {}, {}};
    if (want_dbias && !args.bias.empty()) {
      g.dbias = Tensor<T>(bias.shape());
      sg.dbias = g.dbias.view4();
    }
    if (!args.sinks.empty()) {
      g.dsinks = Tensor<T>({s.H});
      sg.dsinks = g.dsinks.template view<1>();
    }
    scaled_dot_product_attention_backward<T>(args, dy.view4(), {}, sg, opt);
    return g;
  }

 private:
  void allocate() {
    qbuf = Strided<T>(s.B, s.H, s.L, s.E, s.layout, s.pad);
    kbuf = Strided<T>(s.B, s.Hkv, s.S, s.E, s.layout, s.pad);
    vbuf = Strided<T>(s.B, s.Hkv, s.S, s.Ev, s.layout, s.pad);
    obuf = Strided<T>(s.B, s.H, s.L, s.Ev, s.layout, s.pad);
    doutbuf = Strided<T>(s.B, s.H, s.L, s.Ev, s.layout, s.pad);
  }
  void bind() {
    args.q = qbuf.view;
    args.k = kbuf.view;
    args.v = vbuf.view;
  }
  // Normal values in every element of x's storage, in storage order (the
  // strided layout's gaps are set back to NaN).
  static void fill(Strided<T>& x, std::mt19937_64& rng, double stddev) {
    std::normal_distribution<double> nd(0.0, stddev);
    for (auto& e : x.buf) e = T(nd(rng));
    if (x.view.strides[3] == 2) {
      Strided<T> gaps(x.view.dim(0), x.view.dim(1), x.view.dim(2), x.view.dim(3), Layout::strided);
      for (size_t i = 0; i < x.size(); ++i)
        if (std::isnan(gaps.buf[i])) x.buf[i] = std::numeric_limits<T>::quiet_NaN();
    }
  }
};

}  // namespace attn::testing
