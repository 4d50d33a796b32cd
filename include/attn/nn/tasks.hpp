// attn/nn/tasks.hpp — synthetic sequence tasks that need attention, generated
// on the fly.
//
// Vocabulary: 0 = ':' (separator), 1 = '_' (answer slot), 2 + s = symbol s
// (s < symbols; shown as a, b, c, ...).
//
// copy / reverse / sort  (n = length)
//   input   x_1 … x_n  :  _ … _          (N = 2n + 1)
//   target  the n answer slots hold y = x, reversed x, or x sorted ascending;
//           every other position is ignored.
// recall  (n = length key–value pairs, keys distinct; m = queries, 0 = n)
//   input   k_1 v_1 … k_n v_n  :  q_1 … q_m     (N = 2n + 1 + m)
//   target  each query position holds the value paired with its key. The
//           queries are distinct keys in random order; m = 1 is the classic
//           single-query task, m > 1 the multi-query form (each query is an
//           independent instance, so a batch carries m times the signal).
//
// The answer slots make the tasks one-shot: the model fills every slot at
// once, so the same format works with and without causal masking, and with
// bidirectional attention the answer is never visible in the input.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attn/nn/layers.hpp"

namespace attn::nn {

enum class TaskKind { copy, reverse, sort, recall };
const char* task_name(TaskKind t);
TaskKind parse_task(const std::string& name);  // throws attn::InvalidArgument

struct TaskConfig {
  TaskKind kind = TaskKind::reverse;
  int64_t length = 8;    // n (items, or key-value pairs for recall)
  int64_t symbols = 16;  // alphabet size
  int64_t queries = 0;   // recall only: queries per example, 1..length; 0 = length
  int64_t num_queries() const { return queries == 0 ? length : queries; }
  void validate() const;
};

struct Batch {
  int64_t B = 0, N = 0;
  std::vector<int32_t> tokens;   // (B, N)
  std::vector<int32_t> targets;  // (B, N); -1 = not scored
};

class Task {
 public:
  explicit Task(TaskConfig config);
  const TaskConfig& config() const { return cfg_; }
  int64_t vocab_size() const { return cfg_.symbols + 2; }
  int64_t seq_len() const;
  Batch sample(int64_t B, Rng& rng) const;
  std::string token_label(int32_t token) const;

 private:
  TaskConfig cfg_;
};

}  // namespace attn::nn
