// The seeds' "the cat was hungry" example, step by step, through attn's
// scaled dot-product attention: the query of "hungry" against four keys with
// d_k = 4, then the weighted blend of the four values.
#include <attn/attn.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

void print_matrix(const char* title, const float* m, int rows, int cols, const char* const* labels) {
  std::printf("%s  (%d x %d)\n", title, rows, cols);
  for (int r = 0; r < rows; ++r) {
    std::printf("  %-7s", labels ? labels[r] : "");
    for (int c = 0; c < cols; ++c) std::printf(" %8.3f", m[r * cols + c]);
    std::printf("\n");
  }
}

}  // namespace

int main() {
  const char* tokens[] = {"the", "cat", "was", "hungry"};
  const char* query_label[] = {"hungry"};
  // One query ("hungry"), four keys and values, d_k = 4, d_v = 2.
  std::vector<float> q = {2, 0, 0, 0};
  std::vector<float> k = {-1, 0, 0, 0,  //
                          2,  0, 0, 0,  //
                          0,  1, 0, 0,  //
                          0,  0, 1, 0};
  std::vector<float> v = {0, 0, 1, 0, 0, 1, 0, 1};
  std::vector<float> y(2), a(4), lse(1);

  attn::SdpaArgs<float> args;
  args.q = attn::View4<const float>::bhnd(q.data(), 1, 1, 1, 4);
  args.k = attn::View4<const float>::bhnd(k.data(), 1, 1, 4, 4);
  args.v = attn::View4<const float>::bhnd(v.data(), 1, 1, 4, 2);
  attn::scaled_dot_product_attention<float>(args, attn::View4<float>::bhnd(y.data(), 1, 1, 1, 2), {},
                                            attn::View4<float>::bhnd(a.data(), 1, 1, 1, 4),
                                            attn::View3<float>(lse.data(), {1, 1, 1}));

  std::vector<float> s(4), s_scaled(4);
  for (int j = 0; j < 4; ++j) {
    for (int e = 0; e < 4; ++e) s[j] += q[e] * k[j * 4 + e];
    s_scaled[j] = s[j] / std::sqrt(4.0f);
  }
  std::printf("attn: the seeds' \"the cat was hungry\" example (d_k = 4, sqrt(d_k) = 2)\n\n");
  print_matrix("Q (query of \"hungry\")", q.data(), 1, 4, query_label);
  print_matrix("K", k.data(), 4, 4, tokens);
  print_matrix("V", v.data(), 4, 2, tokens);
  print_matrix("S = q.K^T", s.data(), 1, 4, query_label);
  print_matrix("S / sqrt(d_k)", s_scaled.data(), 1, 4, query_label);
  print_matrix("A = softmax(S / sqrt(d_k))   [seed: 0.038 0.757 0.102 0.102]", a.data(), 1, 4, query_label);
  print_matrix("Y = A.V                      [seed: 0.76 0.20]", y.data(), 1, 2, query_label);
  std::printf("log-sum-exp of the row: %.4f\n", lse[0]);
  return 0;
}
