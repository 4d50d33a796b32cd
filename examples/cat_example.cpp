// The seeds' "the cat was hungry" example, run through attn's multi-head
// attention layer (one head, d_k = 4, d_v = 2).
//
// The four tokens are one-hot embeddings (D = 4), so row i of X·Wᵀ is simply
// column i of W: loading the seed's query, keys and values as the columns of
// the projection weights makes the layer reproduce the hand calculation. The
// seed gives only the query of "hungry"; the other queries are zero, so those
// tokens spread their attention evenly. out_proj copies the two value
// features into the first two of the four output features.
#include <attn/attn.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

const char* const kTokens[] = {"the", "cat", "was", "hungry"};

// Prints a (rows × cols) row-major matrix with token labels on the rows, and
// an optional note after the last row.
void print_matrix(const char* title, attn::View2<const float> m, const char* note = nullptr) {
  std::printf("%s\n", title);
  for (int64_t r = 0; r < m.dim(0); ++r) {
    std::printf("  %-7s", kTokens[r]);
    for (int64_t c = 0; c < m.dim(1); ++c) std::printf(" %7.3f", m(r, c));
    if (note && r == m.dim(0) - 1) std::printf("    <- %s", note);
    std::printf("\n");
  }
  std::printf("\n");
}
void print_matrix(const char* title, const float* m, int rows, int cols, const char* note = nullptr) {
  print_matrix(title, attn::View2<const float>(m, {rows, cols}), note);
}
// Head 0 of batch 0 of a (B, H, N, F) view, as an (N, F) matrix.
attn::View2<const float> head0(attn::View4<const float> v) {
  return attn::View2<const float>(v.data, {v.dim(2), v.dim(3)}, {v.strides[2], v.strides[3]});
}

}  // namespace

int main() {
  constexpr int N = 4, D = 4, E = 4, Ev = 2;

  attn::MultiheadConfig cfg;
  cfg.embed_dim = D;
  cfg.num_heads = 1;
  cfg.head_dim = E;
  cfg.v_head_dim = Ev;
  cfg.bias = false;
  attn::MultiheadAttention<float> layer(cfg);

  // Weights are [out, in]; column i holds token i's vector.
  //                        the  cat  was  hungry
  const float w_q[E * D] = {0,   0,   0,   2,   //
                            0,   0,   0,   0,   //
                            0,   0,   0,   0,   //
                            0,   0,   0,   0};
  const float w_k[E * D] = {-1,  2,   0,   0,   //
                            0,   0,   1,   0,   //
                            0,   0,   0,   1,   //
                            0,   0,   0,   0};
  const float w_v[Ev * D] = {0,  1,   0,   0,   //
                             0,  0,   1,   1};
  const float w_o[D * Ev] = {1, 0,  //
                             0, 1,  //
                             0, 0,  //
                             0, 0};
  layer.load_parameter("q_proj_weight", attn::View2<const float>(w_q, {E, D}));
  layer.load_parameter("k_proj_weight", attn::View2<const float>(w_k, {E, D}));
  layer.load_parameter("v_proj_weight", attn::View2<const float>(w_v, {Ev, D}));
  layer.load_parameter("out_proj.weight", attn::View2<const float>(w_o, {D, Ev}));

  // X: one-hot token embeddings, batch of one sequence (1, N, D).
  std::vector<float> x(N * D, 0.0f), y(N * D), a(N * N);
  for (int i = 0; i < N; ++i) x[size_t(i * D + i)] = 1.0f;

  attn::MhaSaved<float> cache;  // keeps Q, K, V for display (and for backward)
  attn::MhaArgs<float> args;  // query only: self-attention
  args.query = attn::View3<const float>(x.data(), {1, N, D});
  layer.forward(args, {attn::View3<float>(y.data(), {1, N, D}), attn::View4<float>(a.data(), {1, 1, N, N}), {}}, {},
                &cache);

  // The scaled scores, recomputed from the layer's Q and K for display.
  const auto q = head0(cache.q()), k = head0(cache.k()), v = head0(cache.v());
  std::vector<float> s(N * N);
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j) {
      float dot = 0;
      for (int e = 0; e < E; ++e) dot += q(i, e) * k(j, e);
      s[size_t(i * N + j)] = dot / std::sqrt(float(E));
    }

  std::printf("attn: the seeds' \"the cat was hungry\" example through MultiheadAttention\n");
  std::printf("(one head, D = 4, d_k = 4, d_v = 2; X = one-hot embeddings; sqrt(d_k) = 2)\n\n");
  print_matrix("Q = X.W_q^T", q, "seed: q_hungry = [2, 0, 0, 0]");
  print_matrix("K = X.W_k^T", k);
  print_matrix("V = X.W_v^T", v);
  print_matrix("S = Q.K^T / sqrt(d_k)   (columns: the cat was hungry)", s.data(), N, N,
               "seed: -1 2 0 0");
  print_matrix("A = softmax_row(S)", a.data(), N, N, "seed: 0.038 0.757 0.102 0.102");
  print_matrix("Y = (A.V).W_o^T", y.data(), N, D, "seed: 0.76 0.20");
  std::printf("\"hungry\" puts %.0f%% of its attention on \"cat\".\n", 100.0 * a[size_t(3 * N + 1)]);
  return 0;
}
