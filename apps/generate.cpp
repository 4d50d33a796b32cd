// `attn generate`: greedy decoding with a trained causal checkpoint, one
// position at a time over a KV cache (attn::nn::Transformer::decode_step),
// with the time per token.
//
// Two modes. Task mode (the default): examples of the checkpoint's task; the
// prompt is everything before the first scored position, and each later step
// feeds the example's own input at that position (the answer slot, or the
// recall query), as in training, and reads the greedy prediction there.
// Free mode (--prompt ids): the prompt, then --tokens steps that feed the
// previous step's greedy prediction back in (a language model's loop).
#include <algorithm>
#include <chrono>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "attn/nn.hpp"
#include "commands.hpp"
#include "common.hpp"
#include "train.hpp"

namespace attn::cli {
namespace {

struct GenerateOpts {
  std::string checkpoint, prompt, cache_dtype = "float32";
  int64_t tokens = 0, batch = 1, page = 0, examples = 1;
  uint64_t seed = 1;
};

int32_t argmax(const float* row, int64_t V) { return int32_t(std::max_element(row, row + V) - row); }

std::vector<int32_t> parse_ids(const std::string& text, int64_t vocab) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      const long v = std::stol(item);
      if (v < 0 || v >= vocab) throw UsageError("");
      ids.push_back(int32_t(v));
    } catch (const std::exception&) {
      throw UsageError(fmt::format("attn generate: --prompt entry '{}' is not a token id in [0, {})", item, vocab));
    }
  }
  if (ids.empty()) throw UsageError("attn generate: --prompt is empty; give comma-separated token ids");
  return ids;
}

void run_generate(const GenerateOpts& o) {
  require_file(o.checkpoint, "--checkpoint");
  const nn::TrainConfig c = nn::checkpoint_config(o.checkpoint);
  const nn::ModelConfig mc = nn::model_config(c);
  if (!mc.causal)
    throw UsageError("attn generate: the checkpoint's model is not causal (every position sees later ones), so it "
                     "cannot decode one token at a time; train with --causal");
  if (o.batch < 1 || o.batch > 4096) throw UsageError(fmt::format("attn generate: --batch {} is outside 1..4096", o.batch));
  const Dtype dtype = parse_dtype(o.cache_dtype);
  nn::Transformer<float> model(mc);
  const int64_t step = nn::load_training_checkpoint<float>(o.checkpoint, model, nullptr);
  const nn::Task task(c.task);
  const int64_t V = mc.vocab, B = o.batch;

  // Inputs (B, N) of every position and which positions are generated.
  int64_t N = 0, first = 0;
  std::vector<int32_t> inputs, targets;
  const bool free_mode = !o.prompt.empty();
  if (free_mode) {
    const std::vector<int32_t> p = parse_ids(o.prompt, V);
    first = int64_t(p.size());
    const int64_t steps = o.tokens > 0 ? o.tokens : mc.max_len - first;
    N = first + steps;
    if (steps < 1 || N > mc.max_len)
      throw UsageError(o.tokens > 0 ? fmt::format("attn generate: a prompt of {} tokens plus --tokens {} exceeds the "
                                                  "model's max_len {}", first, o.tokens, mc.max_len)
                                    : fmt::format("attn generate: a prompt of {} tokens leaves no room to generate "
                                                  "within the model's max_len {}", first, mc.max_len));
    for (int64_t b = 0; b < B; ++b) inputs.insert(inputs.end(), p.begin(), p.end()), inputs.resize(size_t((b + 1) * N), 0);
  } else {
    nn::Rng rng(o.seed);
    const nn::Batch batch = task.sample(B, rng);
    N = batch.N;
    inputs = batch.tokens;
    targets = batch.targets;
    first = N;
    for (int64_t i = 0; i < N; ++i)
      if (targets[size_t(i)] >= 0) {
        first = i;
        break;
      }
    if (first == 0 || first == N) throw InvalidArgument("attn generate: the task's examples have no prompt or no answer");
  }

  nn::DecodeState st = model.start_decoding(B, dtype, o.page);
  std::vector<int32_t> out(size_t(B * N), -1), feed(size_t(B * first));
  Tensor<float> logits;
  // Prefill: the prompt in one step; its last row predicts position `first`.
  for (int64_t b = 0; b < B; ++b)
    std::copy(inputs.begin() + b * N, inputs.begin() + b * N + first, feed.begin() + b * first);
  const auto t0 = std::chrono::steady_clock::now();
  model.decode_step(st, feed.data(), first, logits);
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<int32_t> next(static_cast<size_t>(B));
  // Free mode: the prediction at the last position becomes the next input.
  for (int64_t b = 0; b < B; ++b) next[size_t(b)] = argmax(logits.data() + (b * first + first - 1) * V, V);
  for (int64_t i = first; i < N; ++i) {
    for (int64_t b = 0; b < B; ++b) {
      if (free_mode) out[size_t(b * N + i)] = next[size_t(b)];
      feed[size_t(b)] = free_mode ? next[size_t(b)] : inputs[size_t(b * N + i)];
    }
    model.decode_step(st, feed.data(), 1, logits);
    for (int64_t b = 0; b < B; ++b) {
      next[size_t(b)] = argmax(logits.data() + b * V, V);
      if (!free_mode) out[size_t(b * N + i)] = next[size_t(b)];
    }
  }
  const auto t2 = std::chrono::steady_clock::now();
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  const int64_t steps = N - first;

  fmt::print("{} (step {}): {} layers, D = {}, {} heads, {} positions; cache {}{}\n", o.checkpoint, step, mc.layers,
             mc.dim, mc.heads, nn::positions_name(mc.positions), dtype_name(dtype),
             o.page ? fmt::format(", paged ({} tokens/page)", o.page) : std::string());
  int64_t right = 0, scored = 0;
  for (int64_t b = 0; b < std::min<int64_t>(B, std::max<int64_t>(o.examples, 1)); ++b) {
    std::string prompt, got, want;
    for (int64_t i = 0; i < first; ++i) prompt += (i ? " " : "") + task.token_label(inputs[size_t(b * N + i)]);
    for (int64_t i = first; i < N; ++i) {
      if (!free_mode && targets[size_t(b * N + i)] < 0) continue;
      got += (got.empty() ? "" : " ") + task.token_label(out[size_t(b * N + i)]);
      if (!free_mode) want += (want.empty() ? "" : " ") + task.token_label(targets[size_t(b * N + i)]);
    }
    fmt::print("  prompt     {}\n  generated  {}\n", prompt, got);
    if (!free_mode) fmt::print("  target     {}\n", want);
  }
  if (!free_mode) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = first; i < N; ++i)
        if (targets[size_t(b * N + i)] >= 0) ++scored, right += out[size_t(b * N + i)] == targets[size_t(b * N + i)];
    fmt::print("token accuracy {}/{} over {} sequence(s)\n", right, scored, B);
  }
  fmt::print("prefill {} tokens x {}: {:.2f} ms; decode {} steps x {}: {:.2f} ms, {:.3f} ms/step, {:.0f} tokens/s\n",
             first, B, prefill_s * 1e3, steps, B, decode_s * 1e3, decode_s * 1e3 / double(std::max<int64_t>(steps, 1)),
             double(steps * B) / std::max(decode_s, 1e-9));
}

}  // namespace

void add_generate(CLI::App& app) {
  auto o = std::make_shared<GenerateOpts>();
  auto* c = app.add_subcommand("generate", "Greedy decoding with a trained causal checkpoint over a KV cache");
  c->add_option("--checkpoint", o->checkpoint, "a checkpoint written by `attn train --causal --save`")->required();
  c->add_option("--prompt", o->prompt, "comma-separated token ids: free generation feeding each prediction back");
  c->add_option("--tokens", o->tokens, "free mode: tokens to generate (0 = up to max_len)")
      ->capture_default_str()
      ->check(integer_value(0));
  c->add_option("--batch", o->batch, "sequences decoded together")->capture_default_str();
  c->add_option("--examples", o->examples, "task mode: examples to print")->capture_default_str();
  c->add_option("--seed", o->seed, "task mode: seeds the examples")->capture_default_str();
  c->add_option("--cache-dtype", o->cache_dtype, "float32 | float16 | bfloat16")->capture_default_str();
  c->add_option("--page", o->page, "paged KV cache with pages of this many tokens (0 = contiguous)")->capture_default_str();
  c->footer(std::string("Task mode feeds each example's own inputs (answer slots, queries) as in training and prints "
                        "the greedy predictions with the token accuracy; both modes print tokens per second.\n") +
            kExitCodesHelp);
  c->callback([o] { run_generate(*o); });
}

}  // namespace attn::cli
