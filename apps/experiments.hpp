// Five claims about attention, measured. Each experiment returns its
// figures as JSON: {"experiment", "title", "columns", "rows", "conclusion",
// ...}; the same object is printed as a table, emitted by --json, and drawn
// by --plot.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lesson.hpp"

namespace attn::cli {

using lesson::experiment_names;
using lesson::run_experiment;
void print_experiment(const nlohmann::json& result);
bool experiment_has_plot(const std::string& name);
void plot_experiment(const nlohmann::json& result, const std::string& path);

}  // namespace attn::cli
