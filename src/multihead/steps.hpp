// The steps the multi-head layer's forward, backward (layer.cpp) and
// decode (decode.cpp) share: dense copies of strided inputs, the
// three input projections (one GEMM when packed) split into dense heads, and
// the output projection. Private to the library; the data flow they serve is
// drawn at the top of layer.cpp.
#pragma once

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attn/multihead.hpp"
#include "kernels/gemm/gemm.hpp"
#include "multihead/names.hpp"
#include "validate.hpp"

namespace attn::detail::mha_steps {

using detail::add_column_sums;
using detail::gemm;
using detail::gemm_as;
using detail::GemmShape;

// The parameters' PyTorch state_dict names: multihead/names.hpp.

using detail::Checker;
using namespace detail::mha_names;

// Copies a rank-3 view (any strides) into dense row-major storage.
template <class T>
void gather(View3<const T> src, T* dst) {
  const int64_t n1 = src.dim(1), F = src.dim(2), rows = src.dim(0) * n1;
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = &src(r / n1, r % n1, 0);
    T* d = dst + r * F;
    if (src.strides[2] == 1)
      std::copy_n(x, F, d);
    else
      for (int64_t c = 0; c < F; ++c) d[c] = x[c * src.strides[2]];
  }
}
template <class T>
void scatter(const T* src, View3<T> dst) {
  for (int64_t a = 0; a < dst.dim(0); ++a)
    for (int64_t b = 0; b < dst.dim(1); ++b)
      for (int64_t c = 0; c < dst.dim(2); ++c) dst(a, b, c) = *src++;
}

// `t` with this shape: kept as it is when it has the shape already,
// allocated without zeroing otherwise (the caller overwrites every element).
template <class T>
void sized(Tensor<T>& t, std::vector<int64_t> shape) {
  if (t.shape() != shape) t = Tensor<T>::uninitialized(std::move(shape));
}

// f(r) for every r in [0, rows), each row `width` elements of work: on
// `threads` OpenMP threads (the pool the GEMMs and the attention use) when
// there are at least 2^16 elements, else on the calling thread. The rows are
// independent copies, so the result is the same for any thread count. (On
// a quiet 2-core Zen 4 the layer's copies in parallel cut the small shape's
// forward by 3-5%, docs/multihead.md; on a Zen 3 whose other core was busy
// they had cost more than they saved: 55 against 38 ms on that forward.)
template <class F>
void parallel_rows(int threads, int64_t rows, int64_t width, const F& f) {
  const bool par = threads > 1 && rows > 1 && rows * width >= (int64_t(1) << 16);
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
  for (int64_t r = 0; r < rows; ++r) f(r);
}

// A dense (rows, width) copy of `src` in `storage`, or src's own data when it
// is already dense and no copy is wanted.
template <class T>
const T* dense(View3<const T> src, Tensor<T>& storage, bool force_copy, int threads) {
  if (src.is_contiguous() && !force_copy) return src.data;
  sized(storage, {src.dim(0), src.dim(1), src.dim(2)});
  if (src.is_contiguous())
    parallel_rows(threads, src.dim(0) * src.dim(1), src.dim(2), [&](int64_t r) {
      std::copy_n(src.data + r * src.dim(2), src.dim(2), storage.data() + r * src.dim(2));
    });
  else
    gather(src, storage.data());
  return storage.data();
}

// True when p points into t's storage.
template <class T>
bool inside(const Tensor<T>& t, const void* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(t.data());
  const auto* x = static_cast<const unsigned char*>(p);
  return b && x && std::less_equal<>()(b, x) && std::less<>()(x, b + t.size() * sizeof(T));
}

// One of the three input projections: p = x·Wᵀ + b for x (rows, cols) dense,
// W [width, cols], b [width] (nullptr without bias), p written with leading
// dimension `ld` (the parts of a self-attention share one matrix).
template <class T>
struct Part {
  const T* x;
  int64_t rows, cols;
  const T* w;
  const T* b;
  T* gw;  // gradients of w and b
  T* gb;
  int64_t width;
  T* p;   // the GEMM output (forward: before the head split), then its gradient
  int64_t ld;
};

// The projections of one call: for each of q, k, v its input, weight rows,
// bias and place in the projection buffer `proj` (laid out as MhaSaved::proj
// documents). `grads` points gw/gb at the gradient tensors.
template <class T, class Layer>
std::array<Part<T>, 3> parts(Layer& layer, const MultiheadConfig& cfg, bool packed, bool self, int64_t B,
                             int64_t L, int64_t S, const T* xq, const T* xk, const T* xv, T* proj,
                             std::map<std::string, Tensor<T>>* grads) {
  const int64_t D = cfg.embed_dim, HE = cfg.num_heads * cfg.head_dim, HEv = cfg.num_heads * cfg.v_head_dim;
  auto param = [&](const char* n) -> const T* { return layer.parameter(n).data(); };
  auto grad = [&](const char* n) -> T* { return grads ? grads->at(n).data() : nullptr; };
  const T* b = cfg.bias ? param(kInProjBias) : nullptr;
  T* gb = cfg.bias ? grad(kInProjBias) : nullptr;
  auto off = [](auto* ptr, int64_t n) { return ptr ? ptr + n : nullptr; };
  const T* w[3];
  T* gw[3];
  if (packed) {
    for (int t = 0; t < 3; ++t) {
      w[t] = param(kInProjWeight) + t * D * D;
      gw[t] = off(grad(kInProjWeight), t * D * D);
    }
  } else {
    w[0] = param(kQProjWeight), w[1] = param(kKProjWeight), w[2] = param(kVProjWeight);
    gw[0] = grad(kQProjWeight), gw[1] = grad(kKProjWeight), gw[2] = grad(kVProjWeight);
  }
  const int64_t ld_self = 2 * HE + HEv;
  T* pk = self ? proj + HE : proj + B * L * HE;
  T* pv = self ? proj + 2 * HE : pk + B * S * HE;
  return {Part<T>{xq, B * L, D, w[0], b, gw[0], gb, HE, proj, self ? ld_self : HE},
          Part<T>{xk, B * S, cfg.kdim, w[1], off(b, HE), gw[1], off(gb, HE), HE, pk, self ? ld_self : HE},
          Part<T>{xv, B * S, cfg.vdim, w[2], off(b, 2 * HE), gw[2], off(gb, 2 * HE), HEv, pv,
                  self ? ld_self : HEv}};
}

// dst (B, H, N, F), dense, = the heads of one part of the GEMM output plus
// its bias: dst(b, h, n, f) = src[(b·N + n)·ld + h·F + f] + bias[h·F + f]
// (src has B·N rows; bias nullptr: none). A row per iteration of
// parallel_rows.
template <class T>
void split_heads(const T* src, int64_t ld, const T* bias, int64_t B, int64_t N, int64_t H, int64_t F, T* dst,
                 int threads) {
  parallel_rows(threads, B * N, H * F, [&](int64_t r) {
    const int64_t b = r / N, n = r % N;
    for (int64_t h = 0; h < H; ++h) {
      const T* x = src + r * ld + h * F;
      T* d = dst + ((b * H + h) * N + n) * F;
      if (bias)
        for (int64_t f = 0; f < F; ++f) d[f] = x[f] + bias[h * F + f];
      else
        std::copy_n(x, F, d);
    }
  });
}

// The inverse, without bias: dst[(b·N + n)·ld + h·F + f] = src(b, h, n, f)
// for src (B, H, N, F) dense, and in the same pass gb[h·F + f] += Σ_rows of
// what it writes (the bias gradient; gb nullptr: none). A head at a time, so
// that its F sums stay in registers, each over the rows in order, in double,
// as add_column_sums does (one pass instead of a copy and a column-sum pass:
// 4.1-4.3 against 5.4-5.6 ms on (1, 2048, 768, 12), load 4; summing whole
// rows into one vector instead was slower than the two passes).
template <class T>
void merge_heads(const T* src, int64_t B, int64_t N, int64_t H, int64_t F, T* dst, int64_t ld, T* gb,
                 int threads) {
  parallel_rows(threads, H, B * N * F, [&](int64_t h) {
    std::vector<double> sums(static_cast<size_t>(F));
    for (int64_t r = 0; r < B * N; ++r) {
      const int64_t b = r / N, n = r % N;
      T* d = dst + r * ld + h * F;
      std::copy_n(src + ((b * H + h) * N + n) * F, F, d);
      if (gb)
        for (int64_t f = 0; f < F; ++f) sums[size_t(f)] += double(d[f]);
    }
    if (gb)
      for (int64_t f = 0; f < F; ++f) gb[h * F + f] += T(sums[size_t(f)]);
  });
}

// Every row of C (m, n), leading dimension ldc, set to bias (n): a GEMM with
// beta = 1 then adds the product, which saves the pass that adding the bias
// afterwards takes.
template <class T>
void fill_rows(T* C, int64_t m, int64_t n, int64_t ldc, const T* bias, int threads) {
  parallel_rows(threads, m, n, [&](int64_t i) { std::copy_n(bias, n, C + i * ldc); });
}

// The projections' heads: [q | k | v] = x·Wᵀ (into the parts' GEMM
// output: one product when `one_gemm`, a packed self-attention whose three
// weight blocks are consecutive rows of in_proj_weight; else three), then
// + b and the split into q (B, H, L, E), k (B, H, S, E), v (B, H, S, Ev)
// laid out one after the other in `proj` (MhaSaved::proj's layout). With
// `bf16` (float) the products take bfloat16 operands (detail::gemm_bf16),
// which add the bias as they write each tile, and the heads stay where the
// GEMMs wrote them: strided views, `proj` unused (MhaSaved::heads_in_packed).
template <class T>
std::array<View4<T>, 3> project(const std::array<Part<T>, 3>& ps, bool one_gemm, int64_t B, int64_t L, int64_t S,
                                int64_t H, int64_t E, int64_t Ev, T* proj, int threads, bool bf16 = false) {
  if constexpr (std::is_same_v<T, float>)
    if (bf16) {
      for (int i = 0; i < (one_gemm ? 1 : 3); ++i) {
        const Part<T>& p = ps[size_t(i)];
        detail::gemm_bf16({p.rows, one_gemm ? p.ld : p.width, p.cols}, false, p.x, p.cols, true, p.w, p.cols, p.p,
                          p.ld, 1.0f, 0.0f, threads, p.b);
      }
      const auto head = [&](const Part<T>& p, int64_t N, int64_t F) {
        return View4<T>(p.p, {B, H, N, F}, {N * p.ld, F, p.ld, 1});
      };
      return {head(ps[0], L, E), head(ps[1], S, E), head(ps[2], S, Ev)};
    }
  if (one_gemm) {
    const Part<T>& p = ps[0];
    gemm<T>({p.rows, p.ld, p.cols}, false, p.x, p.cols, true, p.w, p.cols, p.p, p.ld, T(1), T(0), threads);
  } else {
    for (const Part<T>& p : ps)
      gemm<T>({p.rows, p.width, p.cols}, false, p.x, p.cols, true, p.w, p.cols, p.p, p.ld, T(1), T(0), threads);
  }
  T* const hq = proj;
  T* const hk = hq + B * L * H * E;
  T* const hv = hk + B * S * H * E;
  split_heads(ps[0].p, ps[0].ld, ps[0].b, B, L, H, E, hq, threads);
  split_heads(ps[1].p, ps[1].ld, ps[1].b, B, S, H, E, hk, threads);
  split_heads(ps[2].p, ps[2].ld, ps[2].b, B, S, H, Ev, hv, threads);
  return {View4<T>::bhnd(hq, B, H, L, E), View4<T>::bhnd(hk, B, H, S, E), View4<T>::bhnd(hv, B, H, S, Ev)};
}

// out = o·W_oᵀ + b_o for the concatenated head outputs o (B·L, HEv) dense,
// W_o [D, HEv], b_o [D] (nullptr: none), out (B, L, D) any strides; `bf16`
// as in project.
template <class T>
void project_out(const T* o, const T* wo, const T* bo, int64_t HEv, View3<T> out, int threads, bool bf16 = false) {
  const int64_t M = out.dim(0) * out.dim(1), D = out.dim(2);
  Tensor<T> scratch;
  T* y = out.is_contiguous() ? out.data : (scratch = Tensor<T>({out.dim(0), out.dim(1), D})).data();
  bool done = false;
  if constexpr (std::is_same_v<T, float>)
    if (bf16) {  // the bias added as each tile is written
      detail::gemm_bf16({M, D, HEv}, false, o, HEv, true, wo, HEv, y, D, 1.0f, 0.0f, threads, bo);
      done = true;
    }
  if (!done) {
    if (bo) fill_rows(y, M, D, D, bo, threads);
    gemm<T>({M, D, HEv}, false, o, HEv, true, wo, HEv, y, D, T(1), bo ? T(1) : T(0), threads);
  }
  if (!out.is_contiguous()) scatter<T>(y, out);
}

}  // namespace attn::detail::mha_steps
