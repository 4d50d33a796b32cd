// The reference backend: scaled dot-product attention written for clarity.
//
// For each (batch b, query head h) it materialises the whole L×S score matrix
// through the score rules (kernels/score_rules.hpp: the band, the score
// modifiers, bias, mask), takes a numerically stable row softmax, with the head's sink
// as one more logit in the denominator when given, and multiplies by V.
// Every sum is accumulated in double, so the float instantiation is also a
// good oracle for the fast backends. Memory: O(L·S) per call; time: O(L·S·E).
//
// The backward recomputes the attention matrix A from q and k (it needs no
// saved state) and pushes dY back through each step in reverse:
//   Y  = A·V                  ->  dV = Aᵀ·dY,   dA = dY·Vᵀ
//   A  = softmax_row(Z)       ->  dZ_ij = Σ_l dA_il · ∂a_il/∂z_ij
//                                       = a_ij (dA_ij − Σ_l a_il dA_il)
//        (the Jacobian a_l(δ_lj − a_j) applied row by row, never built; the
//        sink is one more entry of the row with dA = 0, so its gradient is
//        −a_sink·Σ_l a_il dA_il)
//   Z  = capped(U) − slope·|distance| + bias  ->  dU = dZ ∘ capped'(U),  dbias = dZ
//        summed over broadcast axes
//   U  = scale·Q·Kᵀ           ->  dQ = scale·dU·K,  dK = scale·dUᵀ·Q
// Masked entries have a_ij = 0, so they receive no gradient; a fully masked
// row has A = 0 and contributes nothing anywhere.
//
// Dropout (kernels/dropout.hpp) scales A by its keep factors m after the
// softmax: Y = (A∘m)·V, the weights returned are A∘m, and the backward takes
// dV = (A∘m)ᵀ·dY and dA = (dY·Vᵀ)∘m before the softmax's Jacobian.
//
// NaN and ±∞ (docs/fused.md states the rule; the fused backend follows it
// identically): a key a row cannot see (causal, key_lengths, mask, bias −∞)
// never touches the row, whatever its values. A visible pair whose query,
// key or value row holds NaN or ±∞ has score NaN; a row with a NaN or +∞
// visible score is poisoned: lse NaN, a NaN at every visible weight (0 at the
// masked ones), so NaN in its output and in every gradient it reaches. In
// the backward a NaN or ±∞ in dY poisons its row the same way.
#include "kernels/reference/sdpa_reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attn/detail/memory.hpp"
#include "kernels/softmax.hpp"

namespace attn::detail {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Whether row n of a (B, Hx, N, F) view holds NaN or ±∞.
template <class T>
bool bad_row(const View4<const T>& x, int64_t b, int64_t hx, int64_t n) {
  for (int64_t f = 0; f < x.dim(3); ++f)
    if (!std::isfinite(double(x(b, hx, n, f)))) return true;
  return false;
}

// Scores z_ij for one (b, h) through the score rules, masked entries −∞ (a
// bias of −∞ masks too), NaN for a visible pair with a bad q, k or v row;
// dcap (when non-null) receives ∂z/∂u for the backward.
template <class T>
void scores(const ProblemOf<T>& p, const SdpaArgs<T>& a, int64_t b, int64_t h, std::vector<double>& z,
            std::vector<double>* dcap) {
  const int64_t hk = p.kv_head(h);
  const ScoreRules<T>& sr = p.rules;
  const rules::Band band = p.band(b);
  std::vector<char> bad_key(static_cast<size_t>(p.S));
  for (int64_t j = 0; j < p.S; ++j) bad_key[size_t(j)] = bad_row(a.k, b, hk, j) || bad_row(a.v, b, hk, j);
  for (int64_t i = 0; i < p.L; ++i) {
    const rules::Keys keys = band.keys(i);
    const bool bad_q = bad_row(a.q, b, h, i);
    for (int64_t j = 0; j < p.S; ++j) {
      const size_t at = static_cast<size_t>(i * p.S + j);
      double& zij = z[at];
      if (dcap) (*dcap)[at] = 0;
      double bias = 0;
      const bool visible = j >= keys.lo && j < keys.hi && sr.elementwise_visible(b, h, i, j, &bias);
      if (!visible) {
        zij = kNegInf;
        continue;
      }
      if (bad_q || bad_key[size_t(j)]) {
        zij = kNaN;
        continue;
      }
      double dot = 0;
      for (int64_t e = 0; e < p.E; ++e) dot += double(a.q(b, h, i, e)) * double(a.k(b, hk, j, e));
      double ds_du = 1;
      zij = sr.modified(sr.scale * dot, b, h, i, j, &ds_du) + bias;
      if (dcap) (*dcap)[at] = ds_du;
    }
  }
}

// A = softmax_row(scores) for one (b, h), in place (kernels/softmax.hpp, with
// the head's sink); fills lse_row (length L).
template <class T>
void attention_matrix(const ProblemOf<T>& p, const SdpaArgs<T>& a, int64_t b, int64_t h,
                      std::vector<double>& A, std::vector<double>& lse_row) {
  scores(p, a, b, h, A, nullptr);
  const double sink = double(p.rules.sink(h));
  for (int64_t i = 0; i < p.L; ++i) {
    double* row = &A[size_t(i * p.S)];
    lse_row[size_t(i)] = softmax(row, row, p.S, sink);
  }
}

// Row i of A (S entries) times its dropout keep factors, when dropout is on.
template <class T>
void drop(const ProblemOf<T>& p, int64_t b, int64_t h, int64_t i, double* Ai, std::vector<float>& m) {
  if (!p.dropout.on()) return;
  m.resize(size_t(p.S));
  p.dropout.factors(b, p.H, h, i, 0, p.S, m.data());
  for (int64_t j = 0; j < p.S; ++j) Ai[j] *= double(m[size_t(j)]);
}

// The L×S matrices (`count` of them, in double) must fit in memory; checked
// before allocating, so a huge request is an argument error, not bad_alloc.
template <class T>
void check_matrices_fit(const ProblemOf<T>& p, int64_t count, const char* fn) {
  check_fits_in_memory(checked_bytes({count, p.L, p.S}, sizeof(double)),
                       std::string(fn) + ": the reference backend materialises " + std::to_string(count) +
                           " L x S matrix(es) of doubles for q (L = " + std::to_string(p.L) + ") and k (S = " +
                           std::to_string(p.S) + "); that");
}

}  // namespace

template <class T>
void reference_forward(const ProblemOf<T>& p, const SdpaArgs<T>& a, View4<T> out, View4<T> weights,
                       View3<T> lse) {
  check_matrices_fit(p, 1, "attn::scaled_dot_product_attention");
  std::vector<double> A(static_cast<size_t>(p.L * p.S));
  std::vector<double> lse_row(static_cast<size_t>(p.L));
  std::vector<float> m;
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t hk = p.kv_head(h);
      attention_matrix(p, a, b, h, A, lse_row);
      // Y = (A∘m)·V
      for (int64_t i = 0; i < p.L; ++i) {
        double* Ai = &A[size_t(i * p.S)];
        drop(p, b, h, i, Ai, m);
        for (int64_t e = 0; e < p.Ev; ++e) {
          double y = 0;
          for (int64_t j = 0; j < p.S; ++j)
            if (Ai[j] != 0) y += Ai[j] * double(a.v(b, hk, j, e));  // masked keys never touch y
          out(b, h, i, e) = T(y);
        }
        if (!weights.empty())
          for (int64_t j = 0; j < p.S; ++j) weights(b, h, i, j) = T(Ai[j]);
        if (!lse.empty()) lse(b, h, i) = T(lse_row[size_t(i)]);
      }
    }
  }
}

template <class T>
void reference_backward(const ProblemOf<T>& p, const SdpaArgs<T>& a, View4<const T> dout,
                        const SdpaGrads<T>& g) {
  check_matrices_fit(p, 2, "attn::scaled_dot_product_attention_backward");
  const size_t LS = static_cast<size_t>(p.L * p.S);
  std::vector<double> A(LS), dZ(LS), Z(LS), dcap(LS), lse_row(static_cast<size_t>(p.L));
  std::vector<double> dsinks(static_cast<size_t>(p.H), 0.0);
  std::vector<double> dk(static_cast<size_t>(p.S * p.E)), dv(static_cast<size_t>(p.S * p.Ev));
  std::vector<float> m(static_cast<size_t>(p.S), 1.0f);
  // dbias accumulates over every (b, h, i, j) that maps onto one bias element.
  std::vector<double> dbias;
  if (!g.dbias.empty()) dbias.assign(static_cast<size_t>(g.dbias.numel()), 0.0);
  const auto& bs = p.rules.bias.shape;

  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      for (int64_t h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
        scores(p, a, b, h, Z, &dcap);
        A = Z;
        const double sink = double(p.rules.sink(h));
        for (int64_t i = 0; i < p.L; ++i)
          lse_row[size_t(i)] = softmax(&A[size_t(i * p.S)], &A[size_t(i * p.S)], p.S, sink);
        for (int64_t i = 0; i < p.L; ++i) {
          double* Ai = &A[size_t(i * p.S)];
          double* dZi = &dZ[size_t(i * p.S)];
          // A bad dY row poisons its row as a bad input does in the forward.
          if (bad_row(dout, b, h, i)) {
            std::copy(&Z[size_t(i * p.S)], &Z[size_t((i + 1) * p.S)], Ai);  // the scores say which keys it sees
            poison_row(Ai, Ai, p.S);
          }
          // dA_ij = (dY_i · V_j)·m_ij, then the softmax Jacobian-vector product.
          if (p.dropout.on()) p.dropout.factors(b, p.H, h, i, 0, p.S, m.data());
          double row_dot = 0;  // Σ_l a_il dA_il
          for (int64_t j = 0; j < p.S; ++j) {
            double dA = 0;
            if (Ai[j] != 0)
              for (int64_t e = 0; e < p.Ev; ++e) dA += double(dout(b, h, i, e)) * double(a.v(b, hk, j, e));
            dZi[j] = dA * double(m[size_t(j)]);
            row_dot += Ai[j] * dZi[j];
          }
          for (int64_t j = 0; j < p.S; ++j) dZi[j] = Ai[j] == 0 ? 0.0 : Ai[j] * (dZi[j] - row_dot);
          // d(sink) = a_sink · (0 − Σ_l a_il dA_il), a_sink = exp(sink − lse_i)
          if (sink != kNegInf) dsinks[size_t(h)] -= std::exp(sink - lse_row[size_t(i)]) * row_dot;
          // dV_j += a_ij · m_ij · dY_i
          for (int64_t j = 0; j < p.S; ++j) {
            if (Ai[j] == 0) continue;
            const double am = Ai[j] * double(m[size_t(j)]);
            for (int64_t e = 0; e < p.Ev; ++e) dv[size_t(j * p.Ev + e)] += am * double(dout(b, h, i, e));
          }
          // dU_ij = dZ_ij · ∂z/∂u (the soft-cap's derivative; 1 without)
          const double* dci = &dcap[size_t(i * p.S)];
          // dQ_i = scale · Σ_j dU_ij K_j ;  dK_j += scale · dU_ij Q_i
          for (int64_t e = 0; e < p.E; ++e) {
            double dq = 0;
            for (int64_t j = 0; j < p.S; ++j)
              if (dZi[j] != 0) dq += dZi[j] * dci[j] * double(a.k(b, hk, j, e));
            g.dq(b, h, i, e) = T(p.rules.scale * dq);
          }
          for (int64_t j = 0; j < p.S; ++j) {
            if (dZi[j] == 0) continue;
            for (int64_t e = 0; e < p.E; ++e)
              dk[size_t(j * p.E + e)] += p.rules.scale * dZi[j] * dci[j] * double(a.q(b, h, i, e));
          }
          if (!dbias.empty()) {
            // dbias has the bias's shape; flat index in row-major order.
            const int64_t bb = bcast(b, bs[0]), bh = bcast(h, bs[1]), bi = bcast(i, bs[2]);
            for (int64_t j = 0; j < p.S; ++j) {
              const int64_t bj = bcast(j, bs[3]);
              dbias[size_t(((bb * bs[1] + bh) * bs[2] + bi) * bs[3] + bj)] += dZi[j];
            }
          }
        }
      }
      for (int64_t j = 0; j < p.S; ++j) {
        for (int64_t e = 0; e < p.E; ++e) g.dk(b, hk, j, e) = T(dk[size_t(j * p.E + e)]);
        for (int64_t e = 0; e < p.Ev; ++e) g.dv(b, hk, j, e) = T(dv[size_t(j * p.Ev + e)]);
      }
    }
  }
  if (!dbias.empty()) {
    size_t n = 0;
    for (int64_t i0 = 0; i0 < bs[0]; ++i0)
      for (int64_t i1 = 0; i1 < bs[1]; ++i1)
        for (int64_t i2 = 0; i2 < bs[2]; ++i2)
          for (int64_t i3 = 0; i3 < bs[3]; ++i3) g.dbias(i0, i1, i2, i3) = T(dbias[n++]);
  }
  if (!g.dsinks.empty())
    for (int64_t h = 0; h < p.H; ++h) g.dsinks(h) = T(dsinks[size_t(h)]);
}

template void reference_forward<float>(const Problem&, const SdpaArgs<float>&, View4<float>,
                                       View4<float>, View3<float>);
template void reference_forward<double>(const ProblemOf<double>&, const SdpaArgs<double>&, View4<double>,
                                        View4<double>, View3<double>);
template void reference_backward<float>(const Problem&, const SdpaArgs<float>&,
                                        View4<const float>, const SdpaGrads<float>&);
template void reference_backward<double>(const ProblemOf<double>&, const SdpaArgs<double>&,
                                         View4<const double>, const SdpaGrads<double>&);

}  // namespace attn::detail
