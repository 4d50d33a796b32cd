// Five claims about attention, measured. Each experiment returns its
// figures as JSON: {"experiment", "title", "columns", "rows", "conclusion",
// ...}; the same object is printed as a table, emitted by --json, and drawn
// by --plot.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace attn::cli {

const std::vector<std::string>& experiment_names();
// Throws UsageError for an unknown name.
nlohmann::json run_experiment(const std::string& name, uint64_t seed);
void print_experiment(const nlohmann::json& result);
bool experiment_has_plot(const std::string& name);
void plot_experiment(const nlohmann::json& result, const std::string& path);

}  // namespace attn::cli
