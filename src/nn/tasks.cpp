// Synthetic tasks (see attn/nn/tasks.hpp for the sequence formats).
#include "attn/nn/tasks.hpp"

#include <algorithm>

#include "validate.hpp"

namespace attn::nn {

namespace {
constexpr int32_t kSep = 0, kSlot = 1, kFirstSymbol = 2;
}

namespace {
constexpr detail::NamedValue<TaskKind> kTasks[] = {
    {TaskKind::copy, "copy"}, {TaskKind::reverse, "reverse"}, {TaskKind::sort, "sort"}, {TaskKind::recall, "recall"}};
}  // namespace

const char* task_name(TaskKind t) { return detail::name_of(kTasks, t); }

TaskKind parse_task(const std::string& name) { return detail::Checker{"nn::parse_task"}.parse(kTasks, name, "task"); }

void TaskConfig::validate() const {
  if (length < 1) throw InvalidArgument("attn::nn::TaskConfig: length is " + std::to_string(length) + ", expected >= 1");
  if (symbols < 2 || symbols > 1000)
    throw InvalidArgument("attn::nn::TaskConfig: symbols is " + std::to_string(symbols) + ", expected 2 to 1000");
  if (kind == TaskKind::recall && length > symbols)
    throw InvalidArgument("attn::nn::TaskConfig: recall needs distinct keys, so length (" + std::to_string(length) +
                ") must be <= symbols (" + std::to_string(symbols) + ")");
  if (queries < 0 || (kind == TaskKind::recall && queries > length))
    throw InvalidArgument("attn::nn::TaskConfig: queries is " + std::to_string(queries) + ", expected 1 to length (" +
                std::to_string(length) + "), or 0 for length");
}

Task::Task(TaskConfig config) : cfg_(config) { cfg_.validate(); }

int64_t Task::seq_len() const {
  return cfg_.kind == TaskKind::recall ? 2 * cfg_.length + 1 + cfg_.num_queries() : 2 * cfg_.length + 1;
}

Batch Task::sample(int64_t B, Rng& rng) const {
  if (B < 1) throw InvalidArgument("attn::nn::Task::sample: batch size " + std::to_string(B) + ", expected >= 1");
  const int64_t n = cfg_.length, N = seq_len();
  Batch out;
  out.B = B;
  out.N = N;
  out.tokens.assign(size_t(B * N), kSlot);
  out.targets.assign(size_t(B * N), -1);
  std::vector<int32_t> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
  std::vector<int32_t> keys(static_cast<size_t>(cfg_.symbols));
  for (int64_t b = 0; b < B; ++b) {
    int32_t* tok = out.tokens.data() + b * N;
    int32_t* tgt = out.targets.data() + b * N;
    if (cfg_.kind == TaskKind::recall) {
      // distinct keys: the first n of a Fisher–Yates shuffle
      for (int64_t s = 0; s < cfg_.symbols; ++s) keys[size_t(s)] = int32_t(s);
      for (int64_t i = 0; i < n; ++i) std::swap(keys[size_t(i)], keys[size_t(i + rng.below(cfg_.symbols - i))]);
      for (int64_t i = 0; i < n; ++i) {
        tok[2 * i] = kFirstSymbol + keys[size_t(i)];
        tok[2 * i + 1] = kFirstSymbol + int32_t(rng.below(cfg_.symbols));
      }
      tok[2 * n] = kSep;
      // queries: distinct pair indices, a partial Fisher–Yates shuffle of 0..n-1
      std::vector<int64_t> order(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) order[size_t(i)] = i;
      for (int64_t j = 0; j < cfg_.num_queries(); ++j) {
        std::swap(order[size_t(j)], order[size_t(j + rng.below(n - j))]);
        const int64_t q = order[size_t(j)];
        tok[2 * n + 1 + j] = tok[2 * q];
        tgt[2 * n + 1 + j] = tok[2 * q + 1];
      }
      continue;
    }
    for (int64_t i = 0; i < n; ++i) x[size_t(i)] = kFirstSymbol + int32_t(rng.below(cfg_.symbols));
    y = x;
    if (cfg_.kind == TaskKind::reverse) std::reverse(y.begin(), y.end());
    if (cfg_.kind == TaskKind::sort) std::sort(y.begin(), y.end());
    for (int64_t i = 0; i < n; ++i) {
      tok[i] = x[size_t(i)];
      tgt[n + 1 + i] = y[size_t(i)];  // the answer slots stay kSlot in the input
    }
    tok[n] = kSep;
  }
  return out;
}

std::string Task::token_label(int32_t token) const {
  if (token == kSep) return ":";
  if (token == kSlot) return "_";
  const int32_t s = token - kFirstSymbol;
  if (s < 0 || s >= cfg_.symbols) return "?";
  if (s < 26) return std::string(1, char('a' + s));
  return "s" + std::to_string(s);
}

}  // namespace attn::nn
