// Two tokens, d_k = 2: the seeds' worked example through an installed libattn.
#include <attn/attn.hpp>

#include <cmath>
#include <cstdio>

int main() {
  const float q[2] = {1, 1}, k[4] = {1, 1, 1, -1}, v[4] = {1, 0, 0, 1};
  float y[2];
  attn::SdpaArgs<float> args;
  args.q = attn::View4<const float>::bhnd(q, 1, 1, 1, 2);
  args.k = attn::View4<const float>::bhnd(k, 1, 1, 2, 2);
  args.v = attn::View4<const float>::bhnd(v, 1, 1, 2, 2);
  attn::scaled_dot_product_attention<float>(args, {attn::View4<float>::bhnd(y, 1, 1, 1, 2)});
  std::printf("y = [%.2f, %.2f]\n", y[0], y[1]);
  return std::abs(y[0] - 0.80f) < 0.005f && std::abs(y[1] - 0.20f) < 0.005f ? 0 : 1;
}
