// Every validation path of the public SDPA entry points: the message names
// the function, the argument, the shape it got and the shape it expected.
#include "sdpa_case.hpp"

namespace {

using namespace attn::testing;
using attn::Tensor;
using attn::View3;
using attn::View4;

struct Fixture : ::testing::Test {
  std::mt19937_64 rng{42};
  SdpaCase<float> c{{2, 4, 2, 3, 5, 8, 6}, rng};  // B=2 H=4 Hkv=2 L=3 S=5 E=8 Ev=6
  Tensor<float> y{2, 4, 3, 6};
  void run() { attn::scaled_dot_product_attention<float>(c.args, {y.view4()}, c.opt); }
};

TEST_F(Fixture, MismatchedFeatureDimension) {
  Tensor<float> k({2, 2, 5, 7});
  c.args.k = k.view4();
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"attn::scaled_dot_product_attention", "'k'", "(2, 2, 5, 7)",
                                           "expected (2, Hkv, S, 8)"}));
}

TEST_F(Fixture, KeyHeadsMustDivideQueryHeads) {
  Tensor<float> k({2, 3, 5, 8});
  c.args.k = k.view4();
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'k'", "(2, 3, 5, 8)", "Hkv dividing H = 4"}));
}

TEST_F(Fixture, ValueMustMatchKey) {
  Tensor<float> v({2, 2, 4, 6});
  c.args.v = v.view4();
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'v'", "(2, 2, 4, 6)", "(2, 2, 5, Ev)"}));
}

TEST_F(Fixture, OutputShape) {
  Tensor<float> bad({2, 4, 3, 8});
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { attn::scaled_dot_product_attention<float>(c.args, {bad.view4()}, c.opt); },
                          {"'out'", "(2, 4, 3, 8)", "expected (2, 4, 3, 6)"}));
}

TEST_F(Fixture, WeightsAndLseShapes) {
  Tensor<float> w({2, 4, 3, 4}), lse({2, 4, 4});
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { attn::scaled_dot_product_attention<float>(c.args, {y.view4(), w.view4()}, c.opt); },
                          {"'weights'", "(2, 4, 3, 4)", "expected (2, 4, 3, 5)"}));
  EXPECT_TRUE(throws_with<attn::InvalidArgument>(
      [&] { attn::scaled_dot_product_attention<float>(c.args, {y.view4(), {}, lse.view<3>()}, c.opt); },
      {"'lse'", "(2, 4, 4)", "expected (2, 4, 3)"}));
}

TEST_F(Fixture, MaskOfTheWrongShape) {
  Tensor<bool> m({2, 3, 3, 5});
  c.args.mask = m.view4();
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'mask'", "(2, 3, 3, 5)", "(B, H, L, S) = (2, 4, 3, 5) or 1"}));
  c.args.mask = {};
  Tensor<float> bias({1, 1, 3, 4});
  c.args.bias = bias.view4();
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'bias'", "(1, 1, 3, 4)"}));
}

TEST_F(Fixture, BiasMustNotContainNaNOrPositiveInfinity) {
  Tensor<float> bias({1, 1, 3, 5});
  bias[3] = std::numeric_limits<float>::quiet_NaN();
  c.args.bias = bias.view4();
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'bias'", "NaN or +Inf"}));
  bias[3] = -std::numeric_limits<float>::infinity();  // -inf is a mask: fine
  EXPECT_NO_THROW(run());
}

TEST_F(Fixture, ZeroSizedDimensions) {
  c.args.q = View4<const float>(c.qbuf.data(), {2, 4, 0, 8});
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'q'", "(2, 4, 0, 8)", ">= 1"}));
}

TEST_F(Fixture, MissingInputs) {
  c.args.v = {};
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'v'", "required"}));
}

TEST_F(Fixture, NonPositiveOrNonFiniteScale) {
  for (double s : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    c.opt.scale = s;
    EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'scale'", "expected a finite value > 0"}));
  }
  c.opt.scale = 1.0;  // unscaled is allowed
  EXPECT_NO_THROW(run());
}

// Scale and soft-cap beyond 2^-64 .. 2^64 cannot be carried by the float32
// kernels (scores that overflow to NaN, a cap that vanishes or flattens the
// scores): refused with the bound. At the bounds every backend agrees with
// the reference and stays finite.
TEST_F(Fixture, ExtremeScaleAndSoftcap) {
  const double big = 0x1p64, small = 0x1p-64;
  for (double s : {1e38, 3e38, std::nextafter(big, 1e300), std::nextafter(small, 0.0), 1e-30}) {
    c.opt.scale = s;
    EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'scale'", "[2^-64, 2^64]"})) << s;
  }
  c.opt.scale.reset();
  for (double s : {1e37, 2.4e38, 1e-38, std::nextafter(big, 1e300), std::nextafter(small, 0.0)}) {
    c.opt.softcap = s;
    EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'softcap'", "[2^-64, 2^64]", "0 (off)"})) << s;
  }
  struct Case {
    std::optional<double> scale;
    double softcap;
  };
  for (const Case& k : {Case{big, 0.0}, Case{small, 0.0}, Case{std::nullopt, big}, Case{std::nullopt, small},
                        Case{big, big}, Case{big, small}, Case{small, 3.0}}) {
    c.opt.scale = k.scale;
    c.opt.softcap = k.softcap;
    Tensor<float> want({2, 4, 3, 6}), lw({2, 4, 3}), lg({2, 4, 3});
    c.opt.backend = attn::Backend::reference;
    attn::scaled_dot_product_attention<float>(c.args, {want.view4(), {}, lw.view<3>()}, c.opt);
    for (attn::Backend b : {attn::Backend::fused, attn::Backend::automatic}) {
      c.opt.backend = b;
      attn::scaled_dot_product_attention<float>(c.args, {y.view4(), {}, lg.view<3>()}, c.opt);
      EXPECT_TRUE(all_finite(y)) << k.scale.value_or(0) << " " << k.softcap;
      EXPECT_TRUE(all_close(y, want, 1e-5)) << k.scale.value_or(0) << " " << k.softcap;
      // lse carries the scores' magnitude (up to 2^64 · |q·k|): relative.
      EXPECT_TRUE(all_close(lg, lw, 1e-5 * std::max(1.0, max_abs(lw.view<3>()))));
    }
  }
}

TEST_F(Fixture, KeyLengthsOutOfRange) {
  Tensor<int64_t> kl({2});
  kl[0] = 2;
  kl[1] = 6;
  c.args.key_lengths = attn::View1<const int64_t>(kl.data(), {2});
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'key_lengths'", "value 6 at batch 1", "<= S = 5"}));
  Tensor<int64_t> kl3({3});
  c.args.key_lengths = attn::View1<const int64_t>(kl3.data(), {3});
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'key_lengths'", "(3,)", "expected (2,)"}));
}

TEST_F(Fixture, NonFiniteInputsWhenAsked) {
  c.qbuf[5] = std::numeric_limits<float>::infinity();
  EXPECT_NO_THROW(run());  // not checked unless asked
  c.opt.check_finite = true;
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'q'", "NaN or Inf"}));
}

TEST_F(Fixture, BroadcastOutputIsRefused) {
  Tensor<float> small({1, 1, 1, 6});
  View4<float> bad(small.data(), {2, 4, 3, 6}, {0, 0, 0, 1});
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { attn::scaled_dot_product_attention<float>(c.args, {bad}, c.opt); },
                          {"'out'", "stride 0"}));
}

TEST_F(Fixture, NegativeThreadCount) {
  c.opt.num_threads = -2;
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { run(); }, {"'num_threads'", "-2"}));
}

TEST_F(Fixture, FusedBackendRejectsDouble) {
  std::mt19937_64 r(1);
  SdpaCase<double> d({1, 1, 1, 2, 2, 2, 2}, r);
  d.opt.backend = attn::Backend::fused;
  Tensor<double> out({1, 1, 2, 2});
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { attn::scaled_dot_product_attention<double>(d.args, {out.view4()}, d.opt); },
                          {"'backend'", "float32 only"}));
}

TEST_F(Fixture, UnknownBackendName) {
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([] { attn::parse_backend("cuda"); }, {"unknown backend 'cuda'", "auto, reference, fused"}));
  EXPECT_EQ(attn::parse_backend("reference"), attn::Backend::reference);
}

TEST_F(Fixture, BackwardShapes) {
  Tensor<float> dout({2, 4, 3, 6}), dq({2, 4, 3, 8}), dk({2, 2, 5, 8}), dv({2, 2, 5, 6});
  attn::SdpaGrads<float> g{dq.view4(), dk.view4(), dv.view4(), {}};
  EXPECT_NO_THROW(attn::scaled_dot_product_attention_backward<float>(c.args, dout.view4(), {}, g, c.opt));
  Tensor<float> bad_dk({2, 4, 5, 8});
  g.dk = bad_dk.view4();
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { attn::scaled_dot_product_attention_backward<float>(c.args, dout.view4(), {}, g, c.opt); },
                          {"attn::scaled_dot_product_attention_backward", "'dk'", "(2, 4, 5, 8)", "expected (2, 2, 5, 8)"}));
  g.dk = dk.view4();
  Tensor<float> dbias({1, 1, 3, 5});
  g.dbias = dbias.view4();
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { attn::scaled_dot_product_attention_backward<float>(c.args, dout.view4(), {}, g, c.opt); },
                          {"'dbias'", "no 'bias'"}));
  Tensor<float> bias({2, 1, 3, 5});
  c.args.bias = bias.view4();
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { attn::scaled_dot_product_attention_backward<float>(c.args, dout.view4(), {}, g, c.opt); },
                          {"'dbias'", "(1, 1, 3, 5)", "(2, 1, 3, 5)"}));
  Tensor<float> bad_dout({2, 4, 3, 5});
  g.dbias = {};
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { attn::scaled_dot_product_attention_backward<float>(c.args, bad_dout.view4(), {}, g, c.opt); },
                          {"'dout'", "(2, 4, 3, 5)", "expected (2, 4, 3, 6)"}));
}

TEST(TensorErrors, RankMismatchAndBadShape) {
  Tensor<float> t({2, 3});
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([&] { (void)t.view4(); }, {"attn::Tensor::view", "rank 2", "rank-4"}));
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([] { Tensor<float> bad({2, -1}); }, {"attn::Tensor", "negative"}));
  // The uninitialized factory checks its shape the same way.
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([] { (void)Tensor<float>::uninitialized({2, -1}); },
                                                 {"attn::Tensor", "negative"}));
  EXPECT_TRUE(throws_with<attn::InvalidArgument>([] { (void)Tensor<float>::uninitialized({int64_t(1) << 40, int64_t(1) << 40}); },
                                                 {"attn::Tensor", "too large"}));
}

// Tensor::uninitialized has the shape asked for and holds what is written;
// the ordinary constructor and copies start from zeros and the source.
TEST(Tensor, UninitializedHasTheShapeAndCopiesKeepTheValues) {
  Tensor<float> u = Tensor<float>::uninitialized({3, 4, 5});
  EXPECT_EQ(u.shape(), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(u.size(), size_t(60));
  for (size_t i = 0; i < u.size(); ++i) u[i] = float(i) * 0.5f;
  const Tensor<float> c = u;
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i], float(i) * 0.5f) << i;
  const Tensor<float> z({3, 4, 5});
  for (size_t i = 0; i < z.size(); ++i) EXPECT_EQ(z[i], 0.0f) << i;
  EXPECT_EQ(Tensor<float>::uninitialized({2, 0, 7}).size(), size_t(0));
}

}  // namespace
