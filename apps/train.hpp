// `attn train` and `attn heatmap --checkpoint`: the command line of the
// training library (attn::nn::train). The flag set is shared with the
// example program examples/train.cpp, which is a thin wrapper around it.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "attn/nn.hpp"

namespace attn::cli {

// What the training flags fill in: the library's configuration plus the
// names that are mapped onto enums after parsing, and the plot path.
struct TrainOpts {
  nn::TrainConfig config;
  std::string task = "reverse", positions = "rope", scale = "default", precision = "fp32", png;
  std::vector<int64_t> window;  // LEFT, RIGHT when given
  int64_t chunk_size = 0;       // 0 = off
  // The flags whose default depends on the task (nn::default_config): set
  // when given on the command line.
  bool queries_given = false, steps_given = false, curriculum_given = false;
};

// Registers the training flags on `app` (a subcommand or a whole program).
// --task, --positions, --scale, --precision and --optimizer are checked by CLI11, so a bad
// value is a usage error.
void add_train_flags(CLI::App& app, TrainOpts& o);

// Maps the names onto the configuration, trains with progress on stdout and
// writes the optional CSV, PNG and checkpoint. Throws attn::InvalidArgument
// (bad configuration) or attn::FileError (a missing --resume checkpoint).
void run_train(const TrainOpts& o);

struct CheckpointHeatmapOpts {
  std::string checkpoint, task, out, title;
  int64_t example = 0;
  uint64_t seed = 0;
};
// Runs the checkpoint's model on example `example` of a seeded stream of its
// task and draws the attention of every head of every layer.
void run_checkpoint_heatmap(const CheckpointHeatmapOpts& o);

void add_train(CLI::App& app);

// A checkpoint the user names must exist: a missing one is a file error
// (exit 3), not a configuration error.
void require_file(const std::string& path, const char* flag);

}  // namespace attn::cli
