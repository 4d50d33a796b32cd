// Registration of the subcommands of `attn` (one function per command).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace attn::cli {

void add_sdpa(CLI::App& app);
void add_mha(CLI::App& app);
void add_explain(CLI::App& app);
void add_experiment(CLI::App& app);
void add_heatmap(CLI::App& app);
void add_bench(CLI::App& app);
void add_tour(CLI::App& app);
void add_generate(CLI::App& app);  // generate.cpp

// Pieces the tour reuses.
void explain_example(const std::string& name);  // "cat", "two-tokens" or "random"

}  // namespace attn::cli
