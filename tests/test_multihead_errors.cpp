// The multi-head attention layer's errors: each names the function, the
// argument and the shapes.
#include "multihead_reference.hpp"

namespace {

using namespace attn;  // the layer and its structs
using namespace attn::testing;

TEST(MultiheadAttentionErrors, Config) {
  auto make = [](MultiheadConfig c) { return [c] { MultiheadAttention<float> m(c); }; };
  EXPECT_TRUE(throws_with(make(config(0, 1)), {"attn::MultiheadAttention", "'embed_dim' is 0", ">= 1"}));
  EXPECT_TRUE(throws_with(make(config(4, 0)), {"attn::MultiheadAttention", "'num_heads' is 0", ">= 1"}));
  EXPECT_TRUE(throws_with(make(config(4, -2)), {"'num_heads' is -2"}));
  EXPECT_TRUE(throws_with(make(config(4, 1, true, -1)), {"'kdim' is -1", ">= 0"}));
  EXPECT_TRUE(throws_with(make(config(4, 1, true, 0, -3)), {"'vdim' is -3", ">= 0"}));
  EXPECT_TRUE(throws_with(make(config(4, 1, true, 0, 0, -1)), {"'head_dim' is -1"}));
  EXPECT_TRUE(throws_with(make(config(4, 1, true, 0, 0, 2, -1)), {"'v_head_dim' is -1"}));
  EXPECT_TRUE(throws_with(make(config(10, 3)),
                          {"'embed_dim' = 10 is not divisible by 'num_heads' = 3", "'head_dim'"}));
  EXPECT_TRUE(throws_with(make(config(int64_t(1) << 40, 1)), {"'embed_dim' is 1099511627776", "expected <="}));
  EXPECT_TRUE(throws_with(make(config(4, 1 << 20, true, 0, 0, 1 << 10)), {"'num_heads' * 'head_dim'", "too large"}));
  EXPECT_NO_THROW(make(config(10, 3, true, 0, 0, 4))());  // explicit head_dim lifts the divisibility rule
}

TEST(MultiheadAttentionErrors, ParameterNames) {
  MultiheadAttention<float> m(config(4, 2));
  EXPECT_TRUE(throws_with([&] { m.parameter("weight"); },
                          {"attn::MultiheadAttention::parameter", "unknown parameter name 'weight'",
                           "in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias"}));
  EXPECT_TRUE(throws_with([&] { m.grad("q_proj_weight"); },
                          {"attn::MultiheadAttention::grad", "'q_proj_weight'", "in_proj_weight"}));
  const MultiheadAttention<float>& cm = m;
  EXPECT_TRUE(throws_with([&] { cm.parameter("x"); }, {"unknown parameter name 'x'"}));
  EXPECT_TRUE(throws_with([&] { cm.grad("x"); }, {"unknown parameter name 'x'"}));
  MultiheadAttention<float> nb(config(4, 2, false, 3));
  EXPECT_TRUE(throws_with([&] { nb.parameter("in_proj_bias"); },
                          {"'in_proj_bias'", "q_proj_weight, k_proj_weight, v_proj_weight, out_proj.weight"}));
}

TEST(MultiheadAttentionErrors, LoadParameter) {
  MultiheadAttention<float> m(config(4, 2));
  std::vector<float> buf(100);
  EXPECT_TRUE(throws_with([&] { m.load_parameter("in_proj_weight", View2<const float>(buf.data(), {4, 4})); },
                          {"attn::MultiheadAttention::load_parameter", "'in_proj_weight' has shape (12, 4)",
                           "got a value of shape (4, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("in_proj_bias", View1<const float>(buf.data(), {4})); },
                          {"'in_proj_bias' has shape (12,)", "got a value of shape (4,)"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("out_proj.bias", View2<const float>(buf.data(), {1, 4})); },
                          {"'out_proj.bias' has shape (4,)", "(1, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("out_proj.weight", View1<const float>(buf.data(), {16})); },
                          {"'out_proj.weight' has shape (4, 4)", "(16,)"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("bias", View1<const float>(buf.data(), {4})); },
                          {"load_parameter", "unknown parameter name 'bias'", "out_proj.bias"}));
  EXPECT_TRUE(throws_with([&] { m.load_parameter("out_proj.weight", View2<const float>(nullptr, {4, 4})); },
                          {"'out_proj.weight'", "null pointer"}));
  // A failed load leaves the parameter unchanged.
  const Tensor<float> before = m.parameter("in_proj_weight");
  EXPECT_ANY_THROW(m.load_parameter("in_proj_weight", View2<const float>(buf.data(), {3, 4})));
  EXPECT_TRUE(all_close(m.parameter("in_proj_weight"), before, 0.0, "unchanged"));
}

struct ErrorFixture : ::testing::Test {
  MultiheadAttention<float> m{config(4, 2, true, 3, 5)};
  MultiheadAttention<float> s{config(4, 2)};
  Tensor<float> q{2, 3, 4}, k{2, 6, 3}, v{2, 6, 5}, y{2, 3, 4};
  View3<const float> cq() const { return q.view<3>(); }
  View3<const float> ck() const { return k.view<3>(); }
  View3<const float> cv() const { return v.view<3>(); }
  MhaArgs<float> args() const { return inputs<float>(cq(), ck(), cv()); }
  // forward of the cross-attention layer m into y with these arguments
  auto fwd(MhaArgs<float> a, MhaOptions opt = {}) {
    return [this, a, opt] { m.forward(a, {y.view<3>()}, opt); };
  }
};

TEST_F(ErrorFixture, ForwardInputShapes) {
  const char* fn = "attn::MultiheadAttention::forward:";
  Tensor<float> bad{2, 3, 5};
  EXPECT_TRUE(throws_with(fwd(inputs<float>(bad.view<3>(), ck(), cv())),
                          {fn, "'query' has shape (2, 3, 5)", "expected (B, L, 4)"}));
  Tensor<float> k1{1, 6, 3};
  EXPECT_TRUE(throws_with(fwd(inputs<float>(cq(), k1.view<3>(), cv())),
                          {fn, "'key' has shape (1, 6, 3)", "expected (2, S, 3)"}));
  Tensor<float> k2{2, 6, 4};
  EXPECT_TRUE(throws_with(fwd(inputs<float>(cq(), k2.view<3>(), cv())),
                          {fn, "'key' has shape (2, 6, 4)", "kdim = 3"}));
  Tensor<float> v1{2, 5, 5};
  EXPECT_TRUE(throws_with(fwd(inputs<float>(cq(), ck(), v1.view<3>())),
                          {fn, "'value' has shape (2, 5, 5)", "expected (2, 6, 5)"}));
  Tensor<float> v2{2, 6, 4};
  EXPECT_TRUE(throws_with(fwd(inputs<float>(cq(), ck(), v2.view<3>())),
                          {fn, "'value' has shape (2, 6, 4)", "vdim = 5"}));
  EXPECT_TRUE(throws_with(fwd(inputs<float>({}, ck(), cv())), {fn, "'query' is required"}));
  EXPECT_TRUE(throws_with(fwd(inputs<float>(cq(), {}, cv())),
                          {fn, "'key' is required when 'value' is given", "both empty for self-attention"}));
  EXPECT_TRUE(throws_with(fwd(inputs<float>(cq(), ck(), {})), {fn, "'value' is required when 'key' is given"}));
  std::vector<float> buf(64);
  EXPECT_TRUE(throws_with(fwd(inputs<float>(View3<const float>(buf.data(), {2, 0, 4}), ck(), cv())),
                          {fn, "'query' has shape (2, 0, 4)", "B, L >= 1"}));
  EXPECT_TRUE(throws_with(fwd(inputs<float>(cq(), View3<const float>(buf.data(), {2, 0, 3}), cv())),
                          {fn, "'key' has shape (2, 0, 3)", "S >= 1"}));
}

TEST_F(ErrorFixture, ForwardOutputs) {
  const char* fn = "attn::MultiheadAttention::forward:";
  EXPECT_TRUE(throws_with([&] { m.forward(args(), {}); }, {fn, "'out' is required"}));
  Tensor<float> y2{2, 4, 4};
  EXPECT_TRUE(throws_with([&] { m.forward(args(), {y2.view<3>()}); },
                          {fn, "'out' has shape (2, 4, 4)", "expected (2, 3, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.forward(args(), {View3<float>(y.data(), {2, 3, 4}, {0, 4, 1})}); },
                          {fn, "'out' has stride 0 on axis 0"}));
  Tensor<float> hw{2, 2, 3, 5};
  EXPECT_TRUE(throws_with([&] { m.forward(args(), {y.view<3>(), hw.view4()}); },
                          {fn, "'head_weights' has shape (2, 2, 3, 5)", "expected (2, 2, 3, 6)"}));
  Tensor<float> aw{2, 3, 3};
  EXPECT_TRUE(throws_with([&] { m.forward(args(), {y.view<3>(), {}, aw.view<3>()}); },
                          {fn, "'avg_weights' has shape (2, 3, 3)", "expected (2, 3, 6)"}));
}

TEST_F(ErrorFixture, ForwardMasksAndOptions) {
  const char* fn = "attn::MultiheadAttention::forward:";
  Tensor<bool> am{2, 2, 3, 4};
  MhaArgs<float> mk = args();
  mk.mask = am.view4();
  EXPECT_TRUE(throws_with(fwd(mk), {fn, "'mask' has shape (2, 2, 3, 4)", "(B, H, L, S) = (2, 2, 3, 6) or 1"}));
  Tensor<float> ab{3, 1, 1, 6};
  mk = args();
  mk.bias = ab.view4();
  EXPECT_TRUE(throws_with(fwd(mk), {fn, "'bias' has shape (3, 1, 1, 6)", "(2, 2, 3, 6) or 1"}));
  Tensor<float> ab2{1, 1, 3, 6};
  ab2[4] = std::numeric_limits<float>::quiet_NaN();
  mk.bias = ab2.view4();
  EXPECT_TRUE(throws_with(fwd(mk), {fn, "'bias' contains NaN or +Inf at (0, 0, 0, 4)"}));
  ab2[4] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_with(fwd(mk), {fn, "'bias'", "+Inf"}));
  ab2[4] = -std::numeric_limits<float>::infinity();  // -inf masks the key
  EXPECT_NO_THROW(fwd(mk)());
  Tensor<bool> kpm{2, 3};
  mk = args();
  mk.key_padding_mask = kpm.view<2>();
  EXPECT_TRUE(throws_with(fwd(mk), {fn, "'key_padding_mask' has shape (2, 3)", "expected (B, S) = (2, 6)"}));
  Tensor<int64_t> lens{3};
  mk = args();
  mk.key_lengths = lens.view<1>();
  EXPECT_TRUE(throws_with(fwd(mk), {fn, "'key_lengths' has shape (3,)", "expected (B,) = (2,)"}));
  Tensor<int64_t> lens2{2};
  lens2[1] = 7;
  mk.key_lengths = lens2.view<1>();
  EXPECT_TRUE(throws_with(fwd(mk), {fn, "'key_lengths' has value 7 at batch 1", "<= S = 6"}));
  MhaOptions opt;
  opt.sdpa.num_threads = -1;
  EXPECT_TRUE(throws_with(fwd(args(), opt), {fn, "'num_threads' is -1"}));
  opt = {};
  opt.sdpa.check_finite = true;
  Tensor<float> kn = k;
  kn[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(throws_with(fwd(inputs<float>(cq(), kn.view<3>(), cv()), opt), {fn, "'key' contains NaN or Inf at (0, 1, 2)"}));
  // Every attention option passes through to scaled_dot_product_attention
  // unchanged: its own errors (fused is float-only, the scale must be > 0).
  MultiheadAttention<double> md(config(4, 2));
  Tensor<double> xd{1, 2, 4}, yd{1, 2, 4};
  MhaOptions od;
  od.sdpa.backend = attn::Backend::fused;
  EXPECT_TRUE(throws_with([&] { md.forward(inputs<double>(xd.view<3>()), {yd.view<3>()}, od); },
                          {"scaled_dot_product_attention", "'backend' is fused", "float32 only"}));
  od = {};
  od.sdpa.scale = -1.0;  // the layer checks the rules itself, before any work
  EXPECT_TRUE(throws_with([&] { md.forward(inputs<double>(xd.view<3>()), {yd.view<3>()}, od); },
                          {"MultiheadAttention::forward", "scale"}));
}

TEST_F(ErrorFixture, ForwardSelf) {
  const char* fn = "attn::MultiheadAttention::forward:";
  EXPECT_TRUE(throws_with(fwd(inputs<float>(cq())),
                          {fn, "self-attention", "kdim = vdim = embed_dim = 4", "kdim = 3, vdim = 5",
                           "pass 'key' and 'value'"}));
  Tensor<float> bad{2, 3, 6};
  EXPECT_TRUE(throws_with([&] { s.forward(inputs<float>(bad.view<3>()), {y.view<3>()}); },
                          {fn, "'query' has shape (2, 3, 6)", "expected (B, L, 4)"}));
  Tensor<float> y2{2, 3, 3};
  EXPECT_TRUE(throws_with([&] { s.forward(inputs<float>(cq()), {y2.view<3>()}); }, {fn, "'out' has shape (2, 3, 3)"}));
  MhaOptions opt;
  opt.sdpa.check_finite = true;
  Tensor<float> qi = q;
  qi[0] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(throws_with([&] { s.forward(inputs<float>(qi.view<3>()), {y.view<3>()}, opt); },
                          {fn, "'query' contains NaN or Inf at (0, 0, 0)"}));
}

TEST_F(ErrorFixture, Backward) {
  const char* fn = "attn::MultiheadAttention::backward:";
  MhaSaved<float> empty;
  EXPECT_TRUE(throws_with([&] { m.backward(empty, y.view<3>()); }, {fn, "'cache' is empty"}));
  MhaSaved<float> cache;
  m.forward(args(), {y.view<3>()}, {}, &cache);
  MultiheadAttention<float> other(config(4, 1, true, 3, 5));
  EXPECT_TRUE(throws_with([&] { other.backward(cache, y.view<3>()); },
                          {fn, "'cache'", "num_heads = 1", "different layer"}));
  Tensor<float> dy{2, 4, 4};
  EXPECT_TRUE(throws_with([&] { m.backward(cache, dy.view<3>()); },
                          {fn, "'dout' has shape (2, 4, 4)", "expected (2, 3, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.backward(cache, {}); }, {fn, "'dout' is required"}));
  Tensor<float> dq{2, 3, 3}, dk{2, 6, 4}, dv{2, 5, 5};
  EXPECT_TRUE(throws_with([&] { m.backward(cache, y.view<3>(), {dq.view<3>()}); },
                          {fn, "'dquery' has shape (2, 3, 3)", "expected (2, 3, 4)"}));
  EXPECT_TRUE(throws_with([&] { m.backward(cache, y.view<3>(), {{}, dk.view<3>()}); },
                          {fn, "'dkey' has shape (2, 6, 4)", "expected (2, 6, 3)"}));
  EXPECT_TRUE(throws_with([&] { m.backward(cache, y.view<3>(), {{}, {}, dv.view<3>()}); },
                          {fn, "'dvalue' has shape (2, 5, 5)", "expected (2, 6, 5)"}));
  Tensor<float> dq2{2, 3, 4};
  EXPECT_TRUE(throws_with([&] { m.backward(cache, y.view<3>(), {View3<float>(dq2.data(), {2, 3, 4}, {12, 0, 1})}); },
                          {fn, "'dquery' has stride 0 on axis 1"}));

  MhaSaved<float> scache;
  s.forward(inputs<float>(cq()), {y.view<3>()}, {}, &scache);
  Tensor<float> dx{2, 3, 4}, dk2{2, 3, 4};
  EXPECT_TRUE(throws_with([&] { s.backward(scache, y.view<3>(), {dx.view<3>(), dk2.view<3>()}); },
                          {fn, "'dkey' and 'dvalue' must be empty after a self-attention forward", "'dquery'"}));
  // The cache of a self-attention (S = L) used by a layer whose widths differ.
  MultiheadAttention<float> s3(config(4, 4));
  EXPECT_TRUE(throws_with([&] { s3.backward(scache, y.view<3>()); }, {fn, "different layer"}));

  MhaOptions opt;
  opt.sdpa.check_finite = true;
  s.forward(inputs<float>(cq()), {y.view<3>()}, opt, &scache);
  Tensor<float> dyn{2, 3, 4};
  dyn[13] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(throws_with([&] { s.backward(scache, dyn.view<3>(), {dx.view<3>()}); },
                          {fn, "'dout' contains NaN or Inf at (1, 0, 1)"}));
}

}  // namespace
