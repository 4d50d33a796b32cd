// The reference backend against the seeds' worked examples.
#include "testing.hpp"

namespace {

using attn::View3;
using attn::View4;

TEST(SeedExamples, SoftmaxOfOneTwoThree) {
  const double x[3] = {1, 2, 3};
  double y[3];
  attn::softmax(x, y, 3);
  EXPECT_NEAR(y[0], 0.09, 0.005);
  EXPECT_NEAR(y[1], 0.24, 0.005);
  EXPECT_NEAR(y[2], 0.67, 0.005);
}

TEST(SeedExamples, SoftmaxOfTenTwentyThirtyIsNearlyOneHot) {
  const float x[3] = {10, 20, 30};
  float y[3];
  attn::softmax(x, y, 3);
  EXPECT_NEAR(y[0], 0.0, 0.005);
  EXPECT_NEAR(y[1], 0.0, 0.005);
  EXPECT_NEAR(y[2], 1.0, 0.005);
}

TEST(SeedExamples, TwoTokens) {
  // q1 = [1, 1]; k1 = [1, 1], k2 = [1, -1]; v1 = [1, 0], v2 = [0, 1]; d_k = 2.
  const double q[2] = {1, 1}, k[4] = {1, 1, 1, -1}, v[4] = {1, 0, 0, 1};
  double y[2], a[2];
  attn::SdpaArgs<double> args;
  args.q = View4<const double>::bhnd(q, 1, 1, 1, 2);
  args.k = View4<const double>::bhnd(k, 1, 1, 2, 2);
  args.v = View4<const double>::bhnd(v, 1, 1, 2, 2);
  attn::scaled_dot_product_attention<double>(args, {View4<double>::bhnd(y, 1, 1, 1, 2), View4<double>::bhnd(a, 1, 1, 1, 2)});
  EXPECT_NEAR(a[0], 0.80, 0.005);
  EXPECT_NEAR(a[1], 0.20, 0.005);
  EXPECT_NEAR(y[0], 0.80, 0.005);
  EXPECT_NEAR(y[1], 0.20, 0.005);
}

TEST(SeedExamples, TheCatWasHungry) {
  const float q[4] = {2, 0, 0, 0};
  const float k[16] = {-1, 0, 0, 0, 2, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0};
  const float v[8] = {0, 0, 1, 0, 0, 1, 0, 1};
  float y[2], a[4];
  attn::SdpaArgs<float> args;
  args.q = View4<const float>::bhnd(q, 1, 1, 1, 4);
  args.k = View4<const float>::bhnd(k, 1, 1, 4, 4);
  args.v = View4<const float>::bhnd(v, 1, 1, 4, 2);
  attn::scaled_dot_product_attention<float>(args, {View4<float>::bhnd(y, 1, 1, 1, 2), View4<float>::bhnd(a, 1, 1, 1, 4)});
  EXPECT_NEAR(a[0], 0.038, 0.0005);
  EXPECT_NEAR(a[1], 0.757, 0.0005);
  EXPECT_NEAR(a[2], 0.102, 0.0005);
  EXPECT_NEAR(a[3], 0.102, 0.0005);
  EXPECT_NEAR(y[0], 0.76, 0.005);
  EXPECT_NEAR(y[1], 0.20, 0.005);
}

}  // namespace
