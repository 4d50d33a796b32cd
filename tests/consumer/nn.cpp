// The umbrella attn::attn: the training library's configuration and a task
// through an installed libattn_nn.
#include <attn/nn.hpp>

#include <cstdio>

int main() {
  attn::nn::TrainConfig c = attn::nn::default_config(attn::nn::TaskKind::reverse);
  c.validate();
  const attn::nn::Task task(c.task);
  attn::nn::Rng rng(1);
  const attn::nn::Batch b = task.sample(2, rng);
  std::printf("reverse: %lld tokens per example over %lld symbols\n", static_cast<long long>(b.N),
              static_cast<long long>(task.vocab_size()));
  return b.N == task.seq_len() && int64_t(b.tokens.size()) == 2 * b.N ? 0 : 1;
}
