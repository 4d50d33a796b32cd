// The reference backward against central finite differences in double, over
// masks, causal alignments, GQA, L != S, E != Ev and strided layouts.
#include "sdpa_case.hpp"

namespace {

using namespace attn::testing;
using attn::Tensor;
using attn::View4;

struct GradCase {
  CaseShape shape;
  MaskKind mask;
  bool causal;
  attn::CausalAlign align;
  const char* name;
};

// L(inputs) = Σ dout ∘ Y, so dL/dY = dout.
double loss(SdpaCase<double>& c, const Tensor<double>& dout) {
  const Tensor<double> y = c.forward();
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * dout[i];
  return s;
}

// The gradient `g` of L with respect to view `x` (whose data lives in
// `buf`) against central differences; masked (-inf) bias entries are skipped.
void check_input(SdpaCase<double>& c, const Tensor<double>& dout, Strided<double>& buf,
                 const View4<const double>& x, const Tensor<double>& g, const char* what) {
  const attn::View<double, 4> xm(buf.data() + (x.data - buf.data()), x.shape, x.strides);
  EXPECT_TRUE(gradient_check<4>(xm, g.view4(), [&] { return loss(c, dout); }, what));
}

class SdpaGradient : public ::testing::TestWithParam<GradCase> {};

TEST_P(SdpaGradient, MatchesFiniteDifferences) {
  const GradCase& gc = GetParam();
  std::mt19937_64 rng(1234);
  SdpaCase<double> c(gc.shape, rng);
  c.add_mask(gc.mask, rng);
  c.opt.causal = gc.causal;
  c.opt.causal_align = gc.align;
  c.opt.backend = attn::Backend::reference;
  const auto& s = c.s;
  const Tensor<double> dout = random_tensor<double>({s.B, s.H, s.L, s.Ev}, rng);
  const bool bias = !c.bias.shape().empty();
  auto g = c.backward(dout, bias);
  EXPECT_TRUE(all_finite(g.dq) && all_finite(g.dk) && all_finite(g.dv));
  check_input(c, dout, c.qbuf, c.args.q, g.dq, "dq");
  check_input(c, dout, c.kbuf, c.args.k, g.dk, "dk");
  check_input(c, dout, c.vbuf, c.args.v, g.dv, "dv");
  if (bias) check_input(c, dout, c.bias, c.args.bias, g.dbias, "dbias");
}

constexpr auto TL = attn::CausalAlign::top_left;
constexpr auto BR = attn::CausalAlign::bottom_right;

INSTANTIATE_TEST_SUITE_P(
    Reference, SdpaGradient,
    ::testing::Values(
        GradCase{{1, 1, 1, 3, 3, 4, 4}, MaskKind::none, false, TL, "plain"},
        GradCase{{2, 2, 2, 3, 5, 4, 3}, MaskKind::none, false, TL, "cross_LneS_EneEv"},
        GradCase{{1, 4, 2, 3, 4, 3, 2}, MaskKind::none, false, TL, "gqa"},
        GradCase{{1, 3, 1, 2, 4, 3, 2}, MaskKind::none, false, TL, "mqa"},
        GradCase{{1, 2, 2, 4, 4, 3, 3}, MaskKind::none, true, TL, "causal_top_left"},
        GradCase{{1, 2, 1, 3, 5, 3, 2}, MaskKind::none, true, BR, "causal_bottom_right"},
        GradCase{{2, 2, 2, 3, 4, 3, 2}, MaskKind::bool_full, false, TL, "bool_mask"},
        GradCase{{2, 2, 1, 3, 4, 3, 2}, MaskKind::bool_broadcast, true, TL, "bool_mask_broadcast"},
        GradCase{{2, 2, 2, 3, 4, 3, 2}, MaskKind::bias_full, false, TL, "bias"},
        GradCase{{2, 2, 2, 3, 4, 3, 2}, MaskKind::bias_broadcast, false, TL, "bias_broadcast"},
        GradCase{{2, 4, 2, 3, 4, 3, 2}, MaskKind::bias_broadcast, true, BR, "bias_broadcast_gqa_causal"},
        GradCase{{3, 1, 1, 3, 4, 3, 2}, MaskKind::key_lengths, false, TL, "key_lengths"},
        GradCase{{2, 2, 1, 3, 4, 3, 2, Layout::bnhd, 2}, MaskKind::bool_full, false, TL, "bnhd_strided"},
        GradCase{{2, 2, 1, 3, 4, 3, 2, Layout::strided}, MaskKind::bias_full, true, BR, "every_other_element"}),
    [](const ::testing::TestParamInfo<GradCase>& p) { return std::string(p.param.name); });

// dbias of a bias broadcast over batch and heads is the sum over those axes of
// the full-shape dbias.
TEST(SdpaGradient, BroadcastBiasGradientIsTheSumOverBroadcastAxes) {
  std::mt19937_64 rng(7);
  const CaseShape shape{3, 2, 2, 4, 5, 3, 2};
  SdpaCase<double> small(shape, rng);
  small.bias = Strided<double>(1, 1, 4, 5, Layout::bhnd);
  small.bias.randomize(rng);
  small.args.bias = small.bias.view4();
  SdpaCase<double> full = small;  // same q, k, v
  full.args.q = layout_view(full.qbuf.data(), 3, 2, 4, 3, Layout::bhnd);
  full.args.k = layout_view(full.kbuf.data(), 3, 2, 5, 3, Layout::bhnd);
  full.args.v = layout_view(full.vbuf.data(), 3, 2, 5, 2, Layout::bhnd);
  full.bias = Strided<double>(3, 2, 4, 5, Layout::bhnd);
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 4; ++i)
        for (int64_t j = 0; j < 5; ++j) full.bias.view4()(b, h, i, j) = small.bias.view4()(0, 0, i, j);
  full.args.bias = full.bias.view4();
  const Tensor<double> dout = random_tensor<double>({3, 2, 4, 2}, rng);
  const auto gs = small.backward(dout, true);
  const auto gf = full.backward(dout, true);
  Tensor<double> summed({1, 1, 4, 5});
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 4; ++i)
        for (int64_t j = 0; j < 5; ++j) summed.view4()(0, 0, i, j) += gf.dbias.view4()(b, h, i, j);
  EXPECT_TRUE(all_close(gs.dbias, summed, 1e-12, "dbias"));
  EXPECT_TRUE(all_close(gs.dq, gf.dq, 1e-12, "dq"));
}

}  // namespace
