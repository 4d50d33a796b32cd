// One multi-head layer shared by threads (the contract of forward in
// attn/multihead.hpp): forward is const, and calls without a saved state
// borrow the layer's spare buffers one call at a time. Threads run such
// calls on the same layer, each on inputs of its own and with shapes that
// change from call to call (so a borrowed state is resized), and every
// output must be the serial call's, bit for bit; a state lent to two calls
// at once, or a buffer of another call's shape, shows as other values. Run
// under ThreadSanitizer by `make test-tsan`.
#include <gtest/gtest.h>

#include <random>
#include <thread>
#include <vector>

#include "attn/multihead.hpp"

namespace {

using namespace attn;

constexpr int64_t kD = 16, kH = 2;

// Inputs of thread t, call c: (B, L, D) with B, L depending on c.
Tensor<float> input(int t, int c) {
  const int64_t B = 1 + c % 2, L = 3 + (c % 3) * 4;
  Tensor<float> x({B, L, kD});
  std::mt19937 rng(uint32_t(100 * t + c));
  std::normal_distribution<float> nd;
  for (size_t i = 0; i < x.size(); ++i) x[i] = nd(rng);
  return x;
}

Tensor<float> forward(const MultiheadAttention<float>& m, const Tensor<float>& x, Dtype compute,
                      MhaSaved<float>* saved = nullptr) {
  Tensor<float> y(x.shape());
  MhaArgs<float> a;
  a.query = x.view<3>();
  MhaOptions opt;
  opt.sdpa.num_threads = 1;  // the threads here are the callers'
  opt.sdpa.causal = true;
  opt.sdpa.compute_dtype = compute;
  m.forward(a, {y.view<3>()}, opt, saved);
  return y;
}

void run_threads(Dtype compute) {
  MultiheadConfig cfg;
  cfg.embed_dim = kD;
  cfg.num_heads = kH;
  const MultiheadAttention<float> layer(cfg, 7);
  constexpr int kThreads = 4, kCalls = 12;
  // The serial results, each through a saved state of its own.
  std::vector<std::vector<Tensor<float>>> want(kThreads);
  for (int t = 0; t < kThreads; ++t)
    for (int c = 0; c < kCalls; ++c) {
      MhaSaved<float> saved;
      want[size_t(t)].push_back(forward(layer, input(t, c), compute, &saved));
    }
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t)
    pool.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round)
        for (int c = 0; c < kCalls; ++c) {
          const Tensor<float> y = forward(layer, input(t, c), compute);
          const Tensor<float>& w = want[size_t(t)][size_t(c)];
          for (size_t i = 0; i < y.size(); ++i) mismatches[size_t(t)] += y[i] != w[i];
        }
    });
  for (auto& th : pool) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[size_t(t)], 0) << "thread " << t;
}

TEST(MultiheadThreads, ConcurrentForwardsWithoutStateGiveTheSerialBits) { run_threads(Dtype::float32); }

TEST(MultiheadThreads, ConcurrentBfloat16ForwardsWithoutStateGiveTheSerialBits) { run_threads(Dtype::bfloat16); }

// A copy of a layer has its own spare state: both run side by side, each
// giving its serial bits.
TEST(MultiheadThreads, ACopiedLayerBorrowsItsOwnState) {
  MultiheadConfig cfg;
  cfg.embed_dim = kD;
  cfg.num_heads = kH;
  const MultiheadAttention<float> a(cfg, 3);
  const Tensor<float> x = input(0, 4);
  const Tensor<float> first = forward(a, x, Dtype::float32);  // a's spare state now holds buffers
  const MultiheadAttention<float> b = a;
  std::vector<Tensor<float>> want_b;  // b's outputs on other inputs and shapes, serially
  for (int i = 0; i < 20; ++i) {
    MhaSaved<float> saved;
    want_b.push_back(forward(b, input(1, i), Dtype::float32, &saved));
  }
  int mismatches_b = 0;
  std::thread other([&] {
    for (int i = 0; i < 20; ++i) {
      const Tensor<float> y = forward(b, input(1, i), Dtype::float32);
      for (size_t j = 0; j < y.size(); ++j) mismatches_b += y[j] != want_b[size_t(i)][j];
    }
  });
  for (int i = 0; i < 20; ++i) {
    const Tensor<float> y = forward(a, x, Dtype::float32);
    for (size_t j = 0; j < y.size(); ++j) ASSERT_EQ(y[j], first[j]);
  }
  other.join();
  EXPECT_EQ(mismatches_b, 0);
}

}  // namespace
