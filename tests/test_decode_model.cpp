// Incremental decoding of the nn transformer: the logits of every step
// (a chunked prompt, then one token at a time, then a few at once) equal
// those of a full forward over the whole prefix, for every kind of
// positions, with a float32 cache to a tight bound and with float16 and
// bfloat16 caches to the bound their rounding implies.
#include <gtest/gtest.h>

#include <cmath>

#include "attn/nn.hpp"
#include "testing.hpp"

namespace {

using attn::Dtype;
using attn::Tensor;
namespace nn = attn::nn;

struct Case {
  nn::Positions positions;
  Dtype dtype;
  int64_t page;
  int64_t window = -1;  // sliding window (left side), −1: none
  bool sinks = false;
  int64_t chunk = 0;  // chunked attention, 0: none
};

// Largest |a − b| over the last n positions of each sequence of `full`
// ((B·N, V), N = prefix length) against `step` ((B·n, V)); also max |full|.
double step_error(const Tensor<float>& full, const Tensor<float>& step, int64_t B, int64_t N, int64_t n,
                  int64_t V, double* mag) {
  double worst = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t v = 0; v < V; ++v) {
        const double want = full[size_t((b * N + N - n + i) * V + v)];
        const double got = step[size_t((b * n + i) * V + v)];
        *mag = std::max(*mag, std::abs(want));
        worst = std::max(worst, std::isnan(got) ? INFINITY : std::abs(got - want));
      }
  return worst;
}

class DecodeModel : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeModel, EveryStepMatchesAFullRecomputation) {
  const Case c = GetParam();
  nn::ModelConfig mc;
  mc.vocab = 11;
  mc.max_len = 40;
  mc.dim = 32;
  mc.heads = 4;
  mc.layers = 2;
  mc.positions = c.positions;
  mc.causal = true;
  mc.window.left = c.window;
  mc.chunk_size = c.chunk;
  mc.sinks = c.sinks;
  nn::Transformer<float> model(mc, 3);
  for (auto& p : model.parameters())  // sinks away from their initial value, one per head
    if (p.name.find("sinks") != std::string::npos)
      for (size_t h = 0; h < p.value->size(); ++h) (*p.value)[h] = 0.5f * float(h) - 0.7f;
  const int64_t B = 2, V = mc.vocab;
  nn::Rng r(17);
  std::vector<int32_t> seq(size_t(B * mc.max_len));
  for (auto& t : seq) t = int32_t(r.below(V));
  // The storage's unit roundoff: the stored K and V are off by that much
  // relatively; through softmax-weighted averages and two residual blocks
  // the logits move by a small multiple of it times their magnitude.
  const double u = c.dtype == Dtype::float32 ? 0.0 : c.dtype == Dtype::float16 ? 0x1p-11 : 0x1p-8;
  nn::DecodeState st = model.start_decoding(B, c.dtype, c.page);
  int64_t N = 0;
  for (const int64_t n : {5, 1, 1, 1, 3, 1, 7, 1, 1}) {
    std::vector<int32_t> step(size_t(B * n)), prefix(size_t(B * (N + n)));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < n; ++i) step[size_t(b * n + i)] = seq[size_t(b * mc.max_len + N + i)];
      for (int64_t i = 0; i < N + n; ++i) prefix[size_t(b * (N + n) + i)] = seq[size_t(b * mc.max_len + i)];
    }
    Tensor<float> logits, full;
    model.decode_step(st, step.data(), n, logits);
    N += n;
    model.forward(prefix.data(), B, N, full);
    double mag = 0;
    const double err = step_error(full, logits, B, N, n, V, &mag);
    const double tol = attn::testing::tolerance<float>(N + mc.dim, mag, 40) + 40 * u * std::max(1.0, mag);
    EXPECT_LE(err, tol) << "after " << N << " tokens (" << nn::positions_name(c.positions) << ", "
                        << attn::dtype_name(c.dtype) << ", window " << c.window << (c.sinks ? ", sinks" : "") << ", chunk " << c.chunk << ")";
  }
  EXPECT_EQ(st.length, N);
  Tensor<float> too_far;
  EXPECT_TRUE(attn::testing::throws_with([&] { model.decode_step(st, seq.data(), mc.max_len - N + 1, too_far); },
                                         {"decode_step", "max_len = 40"}));
}

INSTANTIATE_TEST_SUITE_P(
    Positions, DecodeModel,
    ::testing::Values(Case{nn::Positions::sinusoidal, Dtype::float32, 0}, Case{nn::Positions::learned, Dtype::float32, 8},
                      Case{nn::Positions::rope, Dtype::float32, 0}, Case{nn::Positions::none, Dtype::float32, 5},
                      Case{nn::Positions::rope, Dtype::float16, 0}, Case{nn::Positions::sinusoidal, Dtype::bfloat16, 16},
                      // The score-rule variants: ALiBi, a sliding window, sinks (gpt-oss: window and sinks).
                      Case{nn::Positions::alibi, Dtype::float32, 0}, Case{nn::Positions::rope, Dtype::float32, 0, 6, true},
                      Case{nn::Positions::alibi, Dtype::bfloat16, 8, 4, true}, Case{nn::Positions::none, Dtype::float16, 0, -1, true},
                      Case{nn::Positions::learned, Dtype::float32, 5, 0},
                      // Chunked attention (Llama 4's local layers), with and without pages.
                      Case{nn::Positions::rope, Dtype::float32, 0, -1, false, 7},
                      Case{nn::Positions::none, Dtype::float16, 5, -1, true, 12}));

// decode_step checks every block's cache before it appends to any: a cache
// that cannot take the tokens (block 1's, a pool of 2 pages of 4 tokens for
// 2 sequences) or one whose length disagrees with the state leaves every
// cache as it was.
TEST(DecodeModel, AStepOneBlockCannotTakeChangesNoCache) {
  nn::ModelConfig mc;
  mc.vocab = 5, mc.max_len = 16, mc.dim = 8, mc.heads = 2, mc.layers = 2, mc.causal = true;
  nn::Transformer<float> model(mc, 1);
  nn::DecodeState st = model.start_decoding(2, Dtype::float32, 4);
  attn::KVCacheConfig small = st.caches[1].config();
  small.num_pages = 2;
  st.caches[1] = attn::KVCache(small);
  const std::vector<int32_t> tokens(10, 1);
  Tensor<float> logits;
  EXPECT_TRUE(attn::testing::throws_with([&] { model.decode_step(st, tokens.data(), 5, logits); },
                                         {"decode_step", "block 1", "page pool is exhausted"}));
  for (int b = 0; b < 2; ++b) EXPECT_EQ(st.caches[0].length(b), 0);
  EXPECT_EQ(st.caches[0].free_pages(), st.caches[0].num_pages());
  EXPECT_EQ(st.length, 0);
  model.decode_step(st, tokens.data(), 1, logits);  // a page per sequence: fits
  EXPECT_EQ(st.caches[0].length(1), 1);
  EXPECT_EQ(st.caches[1].length(1), 1);
  st.caches[1].reset(0);
  EXPECT_TRUE(attn::testing::throws_with([&] { model.decode_step(st, tokens.data(), 1, logits); },
                                         {"block 1", "holds 0 tokens of sequence 0"}));
  EXPECT_EQ(st.caches[0].length(0), 1);
  EXPECT_EQ(st.length, 1);
}

// A step that fails inside a later block (block 1 checks finiteness and its
// key projection holds a NaN) takes the step's tokens out of the earlier
// blocks' caches again: every cache keeps the length of the state.
TEST(DecodeModel, AStepThatFailsInALaterBlockLeavesEveryCacheAsItWas) {
  nn::ModelConfig mc;
  mc.vocab = 5, mc.max_len = 16, mc.dim = 8, mc.heads = 2, mc.layers = 2, mc.causal = true;
  nn::Transformer<float> model(mc, 1);
  nn::DecodeState st = model.start_decoding(2, Dtype::float32, 4);
  const std::vector<int32_t> tokens(10, 2);
  Tensor<float> logits;
  model.decode_step(st, tokens.data(), 3, logits);
  model.blocks()[1].attn.options.sdpa.check_finite = true;
  model.blocks()[1].attn.layer.parameter("in_proj_weight")[size_t(mc.dim * mc.dim)] = NAN;  // first key row
  EXPECT_TRUE(attn::testing::throws_with([&] { model.decode_step(st, tokens.data(), 2, logits); },
                                         {"k (the projected keys)"}));
  for (const auto& c : st.caches) {
    EXPECT_EQ(c.length(0), 3);
    EXPECT_EQ(c.length(1), 3);
    EXPECT_EQ(c.free_pages(), c.num_pages() - 2);
  }
  EXPECT_EQ(st.length, 3);
}

TEST(DecodeModel, RefusesModelsThatAreNotCausal) {
  nn::ModelConfig mc;
  mc.vocab = 5, mc.max_len = 8, mc.dim = 8, mc.heads = 2, mc.layers = 1;
  nn::Transformer<float> model(mc, 1);
  EXPECT_TRUE(attn::testing::throws_with([&] { model.start_decoding(1); }, {"start_decoding", "not causal"}));
}

}  // namespace
