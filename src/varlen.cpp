// The packed variable-length entry points: validation of the packed layout
// and cu_seqlens, then each sequence as an ordinary (1, H, L_b, E) problem on
// views into the packed tensors (no padding), so every option applies to it
// unchanged. Two ways to run them:
//   - the fused backend (float32, backend auto or fused): the sequences'
//     units in one parallel region (kernels/fused/fused.hpp,
//     fused_forward_packed / fused_backward_packed; the forward in groups
//     of sequences), sums of the sinks' gradient over all sequences
//     included; the views are into head-major copies of the packed tensors
//     (see "head-major copies" below);
//   - otherwise (the reference backend, float64): one dense call per
//     sequence, the plain formulation the tests hold the fused path to; the
//     sinks' gradient is gathered here in a fixed order, in double.
// Sequences with no queries or no keys are handled here in both.
#include "attn/varlen.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "attn/tensor.hpp"
#include "kernels/fused/fused.hpp"
#include "validate.hpp"
#include "varlen_internal.hpp"

namespace attn {

int64_t detail::varlen_group_bytes = int64_t(16) << 20;

namespace {

// The boundary's one Checker, with the shape check phrased for packed
// arguments ("expected (total_q, H, E) = (…)").
struct VarlenChecker : detail::Checker {
  template <class T, int R>
  void shape(const View<T, R>& v, const char* name, const std::array<int64_t, R>& want, const char* text) const {
    require(v, name);
    Checker::shape(v, name, want, std::string(text) + " = " + shape_str(want));
  }
};

// The sizes of a packed batch, checked once.
struct Packed {
  int64_t B = 0, total_q = 0, total_k = 0, H = 0, Hkv = 0, E = 0, Ev = 0;
  std::vector<int64_t> cq, ck;  // cu_seqlens, B + 1 each
  int64_t L(int64_t b) const { return cq[size_t(b + 1)] - cq[size_t(b)]; }
  int64_t S(int64_t b) const { return ck[size_t(b + 1)] - ck[size_t(b)]; }
};

void check_cu(const VarlenChecker& c, const View1<const int64_t>& cu, const char* name, int64_t total,
              int64_t max_seqlen, const char* max_name, std::vector<int64_t>& out) {
  if (cu.data == nullptr) c.fail(std::string("argument '") + name + "' is required but was not given");
  if (cu.dim(0) < 2)
    c.fail(std::string("argument '") + name + "' has shape " + shape_str(cu.shape) +
           ", expected (B + 1) with B >= 1 sequences");
  out.resize(size_t(cu.dim(0)));
  int64_t longest = 0;
  for (int64_t b = 0; b < cu.dim(0); ++b) {
    out[size_t(b)] = cu(b);
    if (b == 0 && cu(b) != 0) c.fail(std::string("argument '") + name + "' starts at " + std::to_string(cu(b)) + ", expected 0");
    if (b > 0) {
      const int64_t n = cu(b) - cu(b - 1);
      if (n < 0)
        c.fail(std::string("argument '") + name + "' decreases at index " + std::to_string(b) + " (" +
               std::to_string(cu(b - 1)) + " -> " + std::to_string(cu(b)) + "), expected non-decreasing offsets");
      longest = std::max(longest, n);
    }
  }
  if (out.back() != total)
    c.fail(std::string("argument '") + name + "' ends at " + std::to_string(out.back()) +
           ", expected the packed token count " + std::to_string(total));
  if (max_seqlen < longest)
    c.fail(std::string("argument '") + max_name + "' is " + std::to_string(max_seqlen) +
           ", expected at least the longest sequence in '" + name + "', " + std::to_string(longest));
}

// Checks the batch; `read` receives the memory every input reads (for
// Checker::disjoint).
template <class T>
Packed validate(const VarlenChecker& c, const VarlenArgs<T>& a, const SdpaOptions& opt,
                std::vector<detail::Extent>& read) {
  c.present(a.q, "q", "of (total_q, H, E)");
  c.present(a.k, "k", "of (total_k, Hkv, E)");
  c.present(a.v, "v", "of (total_k, Hkv, Ev)");
  Packed p;
  p.total_q = a.q.dim(0);
  p.H = a.q.dim(1);
  p.E = a.q.dim(2);
  p.total_k = a.k.dim(0);
  p.Hkv = a.k.dim(1);
  p.Ev = a.v.dim(2);
  if (a.k.dim(2) != p.E || p.H % p.Hkv != 0)
    c.fail("argument 'k' has shape " + shape_str(a.k.shape) + ", expected (total_k, Hkv, " + std::to_string(p.E) +
           ") with Hkv dividing H = " + std::to_string(p.H));
  if (a.v.dim(0) != p.total_k || a.v.dim(1) != p.Hkv)
    c.fail("argument 'v' has shape " + shape_str(a.v.shape) + ", expected (" + std::to_string(p.total_k) + ", " +
           std::to_string(p.Hkv) + ", Ev), matching k in total_k and Hkv");
  check_cu(c, a.cu_seqlens_q, "cu_seqlens_q", p.total_q, a.max_seqlen_q, "max_seqlen_q", p.cq);
  check_cu(c, a.cu_seqlens_k, "cu_seqlens_k", p.total_k, a.max_seqlen_k, "max_seqlen_k", p.ck);
  if (p.cq.size() != p.ck.size())
    c.fail("arguments 'cu_seqlens_q' and 'cu_seqlens_k' have " + std::to_string(p.cq.size()) + " and " +
           std::to_string(p.ck.size()) + " entries, expected the same B + 1");
  p.B = int64_t(p.cq.size()) - 1;
  if (c.given(a.mask, "mask")) c.fail("argument 'mask' is not taken by a packed batch (it has no packed layout)");
  if (c.given(a.bias, "bias")) c.fail("argument 'bias' is not taken by a packed batch (it has no packed layout)");
  read = {c.extent(a.q, "q"), c.extent(a.k, "k"), c.extent(a.v, "v"), c.extent(a.cu_seqlens_q, "cu_seqlens_q"),
          c.extent(a.cu_seqlens_k, "cu_seqlens_k")};
  // The rule operands and options, once for the whole batch (the dense call
  // of each sequence checks them again with its lengths: check_sequences).
  (void)detail::check_rules<T>(c, a, opt, {p.B, p.H, 1, 1}, read);
  return p;
}

// Sequence b of a packed (total, Hx, F) view as a dense (1, Hx, n, F) view.
template <class T>
View4<T> sequence(const View3<T>& x, int64_t start, int64_t n) {
  return View4<T>(x.data + start * x.strides[0], {1, x.dim(1), n, x.dim(2)}, {0, x.strides[1], x.strides[0], x.strides[2]});
}
// Columns [start, start + n) of a (H, total) view as a dense (1, H, n) view.
template <class T>
View3<T> lse_columns(const View2<T>& x, int64_t start, int64_t n) {
  return View3<T>(x.data + start * x.strides[1], {1, x.dim(0), n}, {0, x.strides[0], x.strides[1]});
}

template <class T>
SdpaArgs<T> sequence_args(const VarlenArgs<T>& a, const Packed& p, int64_t b) {
  SdpaArgs<T> s;
  s.q = sequence(a.q, p.cq[size_t(b)], p.L(b));
  s.k = sequence(a.k, p.ck[size_t(b)], p.S(b));
  s.v = sequence(a.v, p.ck[size_t(b)], p.S(b));
  static_cast<ScoreArgs<T>&>(s) = a;  // the per-head rules (mask and bias were refused)
  return s;
}

// Checks every sequence's arguments and the options as its dense call would,
// failing under the varlen function's name; returns whether the batch runs
// on the fused backend's packed path (float32 with backend auto or fused,
// exact products, scores within float32's range; otherwise each sequence is
// a dense call).
template <class T>
bool check_sequences(const VarlenChecker& c, const VarlenArgs<T>& a, const Packed& p, const SdpaOptions& opt) {
  for (int64_t b = 0; b < p.B; ++b)
    if (p.L(b) > 0 && p.S(b) > 0) (void)detail::check_attention<T>(c, sequence_args(a, p, b), opt);
  // Scores that may leave float32's range: dense calls, which compute such
  // sequences in double.
  return std::is_same_v<T, float> && opt.backend != Backend::reference && opt.compute_dtype != Dtype::bfloat16 &&
         !detail::scores_may_overflow(a.q, a.k, p.E, opt.scale.value_or(1.0 / std::sqrt(double(p.E))),
                                      c.threads(opt.num_threads));
}

// ---- head-major copies for the fused path ------------------------------------
//
// In the packed layout (total, Hx, F) the rows of one head are Hx·F floats
// apart (2 KiB for 8 heads of 64), so a head's rows fall into a few cache
// sets and the rows a unit reads again and again evict each other: measured
// 20-45% slower than the same sequence in a dense (1, H, L, E) tensor. The
// forward copies Q, K and V head-major a group of sequences at a time into
// one reused buffer (see "the forward in groups" below); the backward gets
// head-major copies, (Hx, total, F) in memory but viewed in the packed index
// order, of all but dK and dV (every key block's tiles read the query rows
// and add into dQ, and without plan.own_heads every query block reads K and
// V); the rest are read or written once per row or block and stay in place.
// One pass per copy, a few percent of the attention's time. A view whose
// rows are already adjacent is used as is.

// Whether the rows of one head are adjacent in x (no copy needed).
template <class T>
bool rows_adjacent(const View3<T>& x) {
  return x.strides[0] == x.dim(2) && x.strides[2] == 1;
}

// x viewed in the packed index order (total, Hx, F) over head-major memory.
View3<float> head_major_view(float* data, int64_t total, int64_t Hx, int64_t F) {
  return View3<float>(data, {total, Hx, F}, {F, total * F, 1});
}

// dst = src element by element, rows of the packed index space in parallel.
template <class T>
void copy_packed(const View3<const T>& src, const View3<T>& dst, int threads) {
  const int64_t total = src.dim(0), Hx = src.dim(1), F = src.dim(2);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < total; ++n)
    for (int64_t h = 0; h < Hx; ++h) {
      const T* s = &src(n, h, 0);
      T* d = &dst(n, h, 0);
      if (src.strides[2] == 1 && dst.strides[2] == 1)
        std::copy(s, s + F, d);
      else
        for (int64_t e = 0; e < F; ++e) d[e * dst.strides[2]] = s[e * src.strides[2]];
    }
}

// A read-only packed view, head-major (a copy unless its rows are adjacent;
// every element is copied, so the memory starts uninitialised).
struct HeadMajorIn {
  std::unique_ptr<float[]> copy;
  View3<const float> view;
  HeadMajorIn(const View3<const float>& x, int threads) : view(x) {
    if (rows_adjacent(x) || x.numel() == 0) return;
    copy = std::make_unique_for_overwrite<float[]>(size_t(x.numel()));
    const View3<float> hm = head_major_view(copy.get(), x.dim(0), x.dim(1), x.dim(2));
    copy_packed(x, hm, threads);
    view = hm;
  }
};

// A written packed view, head-major: the kernels write `view`, and
// write_back() copies all of it into the caller's view (the copy starts
// zeroed, so rows no kernel writes, those of sequences without keys, come
// back 0, as the caller wrote them).
struct HeadMajorOut {
  Tensor<float> copy;
  View3<float> target, view;
  int threads;
  HeadMajorOut(const View3<float>& x, int t) : target(x), view(x), threads(t) {
    if (rows_adjacent(x) || x.numel() == 0) return;
    copy = Tensor<float>({x.dim(1), x.dim(0), x.dim(2)});
    view = head_major_view(copy.data(), x.dim(0), x.dim(1), x.dim(2));
  }
  void write_back() const {
    if (view.data != target.data) copy_packed(View3<const float>(view), target, threads);
  }
};

// The sequences with queries and keys, as the fused backend's dense calls.
std::vector<detail::FusedSequence> fused_sequences(const VarlenArgs<float>& a, const Packed& p,
                                                   const SdpaOptions& opt) {
  std::vector<detail::FusedSequence> seqs;
  for (int64_t b = 0; b < p.B; ++b) {
    if (p.L(b) == 0 || p.S(b) == 0) continue;
    detail::FusedSequence s;
    s.a = sequence_args(a, p, b);
    s.p = detail::make_problem(s.a, opt, {0, b});
    seqs.push_back(s);
  }
  return seqs;
}

// The threads of the fused path (as every sequence's problem resolves them).
int packed_threads(const VarlenChecker& c, const SdpaOptions& opt) { return c.threads(opt.num_threads); }

// ---- the forward in groups of sequences -------------------------------------
//
// The forward's kernel reads the packed views in place (a K or V tile is
// copied into scratch when its rows are not adjacent, scores-inl.h), but on
// a packed layout every first read of a row comes from memory after a jump
// of H·F floats, and the marking of bad keys, one pass over all of K and V
// before the units start, leaves little of a large batch in the cache: on
// 16 sequences of 32..2048 tokens (H = 8, E = 64, Zen 3) that ran at about
// 0.89 of the dense kernel's GFLOP/s, against 1.03 for the same call on
// head-major views. So when the rows are not adjacent the sequences run in
// groups of about detail::varlen_group_bytes (16 MiB) of Q, K and V, the
// costliest first: a group's rows are copied head-major into one buffer
// (reused by every group, so it is allocated and faulted in once), and its
// units then find them in the cache, marking included. Every group runs on
// the plan of the whole batch, so the results are bitwise those of one call
// over all sequences.
//
// Above this the buffer of the largest group (one long sequence) is not
// worth its memory and the batch runs in place.
constexpr int64_t kMaxGroupBuffer = int64_t(256) << 20;

// Floats of sequence s's Q, K and V.
int64_t sequence_floats(const detail::FusedSequence& s) {
  const detail::Problem& p = s.p;
  return p.L * p.H * p.E + p.S * p.Hkv * (p.E + p.Ev);
}

// `rows`, a (1, Hx, n, F) view into the packed layout, copied head-major to
// `at` (which then advances past it); returns the view of the copy.
View4<const float> copy_head_major(const View4<const float>& rows, float*& at, int threads) {
  const int64_t Hx = rows.dim(1), n = rows.dim(2), F = rows.dim(3);
  const View3<const float> src(rows.data, {n, Hx, F}, {rows.strides[2], rows.strides[1], rows.strides[3]});
  const View3<float> dst = head_major_view(at, n, Hx, F);
  copy_packed(src, dst, threads);
  at += n * Hx * F;
  return View4<const float>(dst.data, {1, Hx, n, F}, {0, dst.strides[1], dst.strides[0], dst.strides[2]});
}

// Runs seqs (their outputs set) in groups as described above; returns false
// (having run nothing) when the largest group's buffer would be too large.
bool forward_in_groups(const std::vector<detail::FusedSequence>& seqs) {
  std::vector<size_t> order(seqs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto cost = [&](size_t i) { return double(seqs[i].p.L) * double(seqs[i].p.S); };
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cost(x) > cost(y); });
  std::vector<std::vector<size_t>> groups;
  int64_t group_floats = 0, buffer_floats = 0;
  for (size_t i : order) {
    const int64_t f = sequence_floats(seqs[i]);
    if (groups.empty() || (group_floats + f) * int64_t(sizeof(float)) > detail::varlen_group_bytes)
      groups.emplace_back(), group_floats = 0;
    groups.back().push_back(i);
    group_floats += f;
    buffer_floats = std::max(buffer_floats, group_floats);
  }
  if (buffer_floats * int64_t(sizeof(float)) > kMaxGroupBuffer) return false;
  const detail::Problem plan = detail::fused_packed_plan_problem(seqs);
  const auto buffer = std::make_unique_for_overwrite<float[]>(size_t(buffer_floats));
  for (const auto& g : groups) {
    std::vector<detail::FusedSequence> part;
    float* at = buffer.get();
    for (size_t i : g) {
      detail::FusedSequence s = seqs[i];
      s.a.q = copy_head_major(s.a.q, at, s.p.threads);
      s.a.k = copy_head_major(s.a.k, at, s.p.threads);
      s.a.v = copy_head_major(s.a.v, at, s.p.threads);
      part.push_back(s);
    }
    detail::fused_forward_packed(part, plan);
  }
  return true;
}

// The forward's outputs of the sequences with queries and keys.
void forward_packed(const VarlenArgs<float>& packed, const Packed& p, const SdpaOptions& opt,
                    const View3<float>& packed_out, const View2<float>& lse) {
  std::vector<detail::FusedSequence> seqs = fused_sequences(packed, p, opt);
  for (int64_t b = 0, s = 0; b < p.B; ++b) {
    if (p.L(b) == 0 || p.S(b) == 0) continue;
    seqs[size_t(s)].out = sequence(packed_out, p.cq[size_t(b)], p.L(b));
    if (!lse.empty()) seqs[size_t(s)].lse = lse_columns(lse, p.cq[size_t(b)], p.L(b));
    ++s;
  }
  const bool in_place = rows_adjacent(packed.q) && rows_adjacent(packed.k) && rows_adjacent(packed.v);
  if (seqs.empty() || in_place || !forward_in_groups(seqs)) detail::fused_forward_packed(seqs);
}

// The gradients of the sequences with queries and keys, recomputing the
// forward's saved state when it is not given.
void backward_packed(const VarlenChecker& c, const VarlenArgs<float>& packed, const Packed& p, const SdpaOptions& opt,
                     const View3<const float>& packed_dout, VarlenSaved<float> saved, const VarlenGrads<float>& g) {
  Tensor<float> out_tmp, lse_tmp;
  if (saved.out.empty() || saved.lse.empty()) {
    out_tmp = Tensor<float>({p.total_q, p.H, p.Ev});
    lse_tmp = Tensor<float>({p.H, p.total_q});
    forward_packed(packed, p, opt, out_tmp.view<3>(), lse_tmp.view<2>());
    saved = {out_tmp.view<3>(), lse_tmp.view<2>()};
  }
  const int threads = packed_threads(c, opt);
  const HeadMajorIn q(packed.q, threads), k(packed.k, threads), v(packed.v, threads);
  const HeadMajorIn dout(packed_dout, threads), saved_out(saved.out, threads);
  const HeadMajorOut dq(g.dq, threads);
  VarlenArgs<float> a = packed;
  a.q = q.view, a.k = k.view, a.v = v.view;
  std::vector<detail::FusedSequence> seqs = fused_sequences(a, p, opt);
  for (int64_t b = 0, s = 0; b < p.B; ++b) {
    if (p.L(b) == 0 || p.S(b) == 0) continue;
    const int64_t q0 = p.cq[size_t(b)], k0 = p.ck[size_t(b)];
    detail::FusedSequence& x = seqs[size_t(s++)];
    x.dout = sequence(dout.view, q0, p.L(b));
    x.saved_out = sequence(saved_out.view, q0, p.L(b));
    x.saved_lse = lse_columns(saved.lse, q0, p.L(b));
    x.dq = sequence(dq.view, q0, p.L(b));
    x.dk = sequence(g.dk, k0, p.S(b));
    x.dv = sequence(g.dv, k0, p.S(b));
  }
  detail::fused_backward_packed(seqs, g.dsinks);
  dq.write_back();
}

}  // namespace

template <class T>
void varlen_attention(const VarlenArgs<T>& args, const VarlenOutputs<T>& o, const SdpaOptions& opt) {
  const VarlenChecker c{{"varlen_attention"}};
  std::vector<detail::Extent> read;
  const Packed p = validate(c, args, opt, read);
  c.shape(o.out, "out", {p.total_q, p.H, p.Ev}, "(total_q, H, Ev)");
  std::vector<detail::Extent> written{c.extent(o.out, "out")};
  if (!o.lse.empty()) {
    c.shape(o.lse, "lse", {p.H, p.total_q}, "(H, total_q)");
    written.push_back(c.extent(o.lse, "lse"));
  }
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, read);
  const bool fused = check_sequences(c, args, p, opt);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t L = p.L(b), S = p.S(b);
    if (L == 0 || (fused && S > 0)) continue;
    View4<T> out = sequence(o.out, p.cq[size_t(b)], L);
    View3<T> lse = o.lse.empty() ? View3<T>{} : lse_columns(o.lse, p.cq[size_t(b)], L);
    if (S == 0) {
      // No keys: every row is fully masked (all its weight on the sink, if any).
      for (int64_t h = 0; h < p.H; ++h)
        for (int64_t i = 0; i < L; ++i) {
          for (int64_t e = 0; e < p.Ev; ++e) out(0, h, i, e) = T(0);
          if (!lse.empty())
            lse(0, h, i) = args.sinks.empty() ? -std::numeric_limits<T>::infinity() : args.sinks(h);
        }
      continue;
    }
    detail::block_attention<T>(sequence_args(args, p, b), {out, {}, lse}, opt, {0, b});  // b: the dropout's
  }
  if constexpr (std::is_same_v<T, float>)
    if (fused) forward_packed(args, p, opt, o.out, o.lse);
}

template <class T>
void varlen_attention_backward(const VarlenArgs<T>& args, View3<const T> dout, const VarlenSaved<T>& saved,
                               const VarlenGrads<T>& g, const SdpaOptions& opt) {
  const VarlenChecker c{{"varlen_attention_backward"}};
  std::vector<detail::Extent> read;
  const Packed p = validate(c, args, opt, read);
  c.shape(dout, "dout", {p.total_q, p.H, p.Ev}, "(total_q, H, Ev)");
  c.shape(g.dq, "dq", {p.total_q, p.H, p.E}, "(total_q, H, E)");
  c.shape(g.dk, "dk", {p.total_k, p.Hkv, p.E}, "(total_k, Hkv, E)");
  c.shape(g.dv, "dv", {p.total_k, p.Hkv, p.Ev}, "(total_k, Hkv, Ev)");
  std::vector<detail::Extent> written{c.extent(g.dq, "dq"), c.extent(g.dk, "dk"), c.extent(g.dv, "dv")};
  if (!g.dsinks.empty()) {
    if (args.sinks.empty()) c.fail("output 'dsinks' was requested but no 'sinks' were given");
    c.shape(g.dsinks, "dsinks", {p.H}, "(H)");
    written.push_back(c.extent(g.dsinks, "dsinks"));
  }
  for (const auto& e : written) c.writable(e);
  read.push_back(c.extent(dout, "dout"));
  if (!saved.out.empty()) {
    c.shape(saved.out, "out", {p.total_q, p.H, p.Ev}, "(total_q, H, Ev)");
    read.push_back(c.extent(saved.out, "out"));
  }
  if (!saved.lse.empty()) {
    c.shape(saved.lse, "lse", {p.H, p.total_q}, "(H, total_q)");
    read.push_back(c.extent(saved.lse, "lse"));
  }
  c.disjoint(written, read);
  const bool fused = check_sequences(c, args, p, opt);
  std::vector<double> dsinks(size_t(p.H), 0.0);
  std::vector<T> dsinks_b(size_t(p.H));
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t L = p.L(b), S = p.S(b), q0 = p.cq[size_t(b)], k0 = p.ck[size_t(b)];
    if (L == 0 || S == 0) {
      // Keys no query sees get zero gradient; queries that see no key too
      // (and a sink's gradient is −p_sink·(dY·Y) = 0 for them: Y = 0).
      auto zero = [](View4<T> x) {
        for (int64_t h = 0; h < x.dim(1); ++h)
          for (int64_t n = 0; n < x.dim(2); ++n)
            for (int64_t e = 0; e < x.dim(3); ++e) x(0, h, n, e) = T(0);
      };
      zero(sequence(g.dq, q0, L));
      zero(sequence(g.dk, k0, S));
      zero(sequence(g.dv, k0, S));
      continue;
    }
    if (fused) continue;
    SdpaGrads<T> gb{sequence(g.dq, q0, L), sequence(g.dk, k0, S), sequence(g.dv, k0, S), {}, {}};
    if (!g.dsinks.empty()) gb.dsinks = View1<T>(dsinks_b.data(), {p.H});
    const View4<const T> out = saved.out.empty() ? View4<const T>{} : sequence(saved.out, q0, L);
    const View3<const T> lse = saved.lse.empty() ? View3<const T>{} : lse_columns(saved.lse, q0, L);
    detail::block_attention_backward<T>(sequence_args(args, p, b), sequence(dout, q0, L), {out, lse}, gb, opt, {0, b});
    if (!g.dsinks.empty())
      for (int64_t h = 0; h < p.H; ++h) dsinks[size_t(h)] += double(dsinks_b[size_t(h)]);
  }
  if constexpr (std::is_same_v<T, float>) {
    if (fused) return backward_packed(c, args, p, opt, dout, saved, g);
  }
  if (!g.dsinks.empty())
    for (int64_t h = 0; h < p.H; ++h) g.dsinks(h) = T(dsinks[size_t(h)]);
}

#define ATTN_INSTANTIATE(T)                                                                                  \
  template void varlen_attention<T>(const VarlenArgs<T>&, const VarlenOutputs<T>&, const SdpaOptions&);     \
  template void varlen_attention_backward<T>(const VarlenArgs<T>&, View3<const T>, const VarlenSaved<T>&,   \
                                             const VarlenGrads<T>&, const SdpaOptions&);

ATTN_INSTANTIATE(float)
ATTN_INSTANTIATE(double)
#undef ATTN_INSTANTIATE

}  // namespace attn
