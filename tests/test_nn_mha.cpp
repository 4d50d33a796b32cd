// The transformer's attention layer (nn::SelfAttention, which calls SDPA on
// strided views of its packed projection so RoPE can sit between projection
// and attention) against the library's attn::MultiheadAttention loaded with
// the same weights: outputs and every gradient agree.
#include <gtest/gtest.h>

#include <random>

#include "attn/multihead.hpp"
#include "attn/nn.hpp"
#include "testing.hpp"

namespace {

using attn::Tensor;
namespace nn = attn::nn;

template <class T>
void compare(bool causal) {
  std::mt19937_64 rng(21);
  const int64_t B = 2, N = 7, D = 12, H = 3;
  nn::AttentionOptions ao;
  ao.causal = causal;
  nn::SelfAttention<T> mine(D, H, ao);
  nn::Rng init(4);
  mine.reset_parameters(init);
  for (size_t i = 0; i < mine.in_proj_bias.size(); ++i) mine.in_proj_bias[i] = T(0.1 * init.normal());
  for (size_t i = 0; i < mine.out_proj_bias.size(); ++i) mine.out_proj_bias[i] = T(0.1 * init.normal());
  attn::MultiheadConfig mc;
  mc.embed_dim = D;
  mc.num_heads = H;
  attn::MultiheadAttention<T> ref(mc, 99);
  ref.load_parameter("in_proj_weight", attn::View2<const T>(mine.in_proj_weight.template view<2>()));
  ref.load_parameter("in_proj_bias", attn::View1<const T>(mine.in_proj_bias.template view<1>()));
  ref.load_parameter("out_proj.weight", attn::View2<const T>(mine.out_proj_weight.template view<2>()));
  ref.load_parameter("out_proj.bias", attn::View1<const T>(mine.out_proj_bias.template view<1>()));

  auto x = attn::testing::random_tensor<T>({B * N, D}, rng);
  auto dy = attn::testing::random_tensor<T>({B * N, D}, rng);
  Tensor<T> y, dx;
  mine.forward(x, B, N, y);
  mine.zero_grad();
  mine.backward(x, dy, &dx);

  Tensor<T> y_ref({B, N, D}), dx_ref({B, N, D});
  attn::MhaOptions mo;
  mo.causal = causal;
  attn::MhaCache<T> cache;
  Tensor<T> x3({B, N, D});  // the same rows viewed as (B, N, D)
  for (size_t i = 0; i < x.size(); ++i) x3[i] = x[i];
  Tensor<T> dy3({B, N, D});
  for (size_t i = 0; i < dy.size(); ++i) dy3[i] = dy[i];
  ref.forward_self(attn::View3<const T>(x3.template view<3>()), y_ref.template view<3>(), {}, mo, &cache);
  ref.zero_grad();
  ref.backward(cache, attn::View3<const T>(dy3.template view<3>()), dx_ref.template view<3>());

  const double tol = attn::testing::tolerance<T>(D * N, 4.0, 200.0);
  auto flat = [](const Tensor<T>& t) { return attn::View1<const T>(t.data(), {int64_t(t.size())}); };
  EXPECT_TRUE(attn::testing::all_close(flat(y), flat(y_ref), tol, "y"));
  EXPECT_TRUE(attn::testing::all_close(flat(dx), flat(dx_ref), tol, "dx"));
  EXPECT_TRUE(attn::testing::all_close(flat(mine.d_in_proj_weight), flat(ref.grad("in_proj_weight")), tol, "dW_in"));
  EXPECT_TRUE(attn::testing::all_close(flat(mine.d_in_proj_bias), flat(ref.grad("in_proj_bias")), tol, "db_in"));
  EXPECT_TRUE(attn::testing::all_close(flat(mine.d_out_proj_weight), flat(ref.grad("out_proj.weight")), tol, "dW_out"));
  EXPECT_TRUE(attn::testing::all_close(flat(mine.d_out_proj_bias), flat(ref.grad("out_proj.bias")), tol, "db_out"));
}

TEST(NnSelfAttentionVsMultihead, DoubleAgrees) { compare<double>(false); }
TEST(NnSelfAttentionVsMultihead, DoubleCausalAgrees) { compare<double>(true); }
TEST(NnSelfAttentionVsMultihead, FloatAgrees) { compare<float>(false); }

}  // namespace
