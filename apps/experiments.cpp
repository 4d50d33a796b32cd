// `attn experiment` and the tour: the experiments (apps/lesson) printed as
// tables and drawn as charts.
#include "experiments.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "common.hpp"
#include "plot.hpp"

namespace attn::cli {

using json = nlohmann::json;

void print_experiment(const json& r) {
  fmt::print("{}\n", r["title"].get<std::string>());
  const auto& cols = r["columns"];
  std::vector<std::vector<std::string>> cells;
  std::vector<size_t> width(cols.size());
  for (size_t c = 0; c < cols.size(); ++c) width[c] = cols[c].get<std::string>().size();
  for (const auto& row : r["rows"]) {
    std::vector<std::string> line;
    for (size_t c = 0; c < row.size(); ++c) {
      const auto& v = row[c];
      std::string s;
      if (v.is_string()) s = v.get<std::string>();
      else if (v.is_number_integer()) s = std::to_string(v.get<int64_t>());
      else {
        const double d = v.get<double>();
        s = (d == 0 || (std::abs(d) >= 1e-3 && std::abs(d) < 1e5)) ? fmt::format("{:.4g}", d) : fmt::format("{:.3e}", d);
      }
      width[c] = std::max(width[c], s.size());
      line.push_back(s);
    }
    cells.push_back(line);
  }
  auto rule = [&] {
    std::string s = "  ";
    for (size_t c = 0; c < cols.size(); ++c) s += std::string(width[c] + (c ? 2 : 0), '-');
    fmt::print("{}\n", s);
  };
  std::string head = "  ";
  for (size_t c = 0; c < cols.size(); ++c) head += fmt::format("{}{:>{}}", c ? "  " : "", cols[c].get<std::string>(), width[c]);
  fmt::print("{}\n", head);
  rule();
  for (const auto& line : cells) {
    std::string s = "  ";
    for (size_t c = 0; c < line.size(); ++c) s += fmt::format("{}{:>{}}", c ? "  " : "", line[c], width[c]);
    fmt::print("{}\n", s);
  }
  fmt::print("  => {}\n", r["conclusion"].get<std::string>());
}

bool experiment_has_plot(const std::string& name) {
  return name == "variance" || name == "saturation" || name == "lookup";
}

void plot_experiment(const json& r, const std::string& path) {
  const std::string name = r["experiment"];
  auto col = [&](size_t c) {
    std::vector<double> v;
    for (const auto& row : r["rows"]) v.push_back(row[c].get<double>());
    return v;
  };
  const Rgb blue{31, 119, 180}, orange{255, 127, 14}, grey{120, 120, 120}, green{44, 160, 44};
  Chart ch;
  if (name == "variance") {
    ch.title = "Score spread vs head size (5000 random pairs)";
    ch.xlabel = "d_k";
    ch.ylabel = "standard deviation of the score";
    ch.logx = ch.logy = true;
    ch.xticks = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
    ch.yticks = {0.5, 1, 2, 4, 8, 16, 32};
    ch.series = {{"sqrt(d_k)", col(0), col(1), grey, true, false},
                 {"std(q.k) unscaled", col(0), col(2), blue},
                 {"std(q.k / sqrt(d_k)) scaled", col(0), col(4), orange}};
  } else if (name == "saturation") {
    ch.title = "Weight on the top key (median, 4 random keys)";
    ch.xlabel = "d_k";
    ch.ylabel = "top attention weight";
    ch.logx = true;
    ch.xticks = {1, 4, 16, 64, 256};
    ch.yticks = {0.25, 0.5, 0.75, 1.0};
    ch.legend_bottom = true;
    ch.series = {{"unscaled", col(0), col(3), blue}, {"scaled by 1/sqrt(d_k)", col(0), col(6), orange}};
  } else if (name == "lookup") {
    ch.title = "Attention as a dictionary lookup: error vs query scale c";
    ch.xlabel = "query scale c";
    ch.ylabel = "error (log scale)";
    ch.logx = ch.logy = true;
    ch.legend_bottom = true;
    ch.xticks = {1, 2, 4, 8, 16, 32, 64, 128};
    std::vector<double> miss = col(2);
    for (auto& x : miss) x = 1 - x;
    std::vector<double> err = col(3);
    for (auto& x : err) x = std::max(x, 1e-17);  // an exact zero sits on the floor of the plot
    ch.series = {{"max |Y - table|", col(0), err, blue}, {"1 - weight on the match", col(0), miss, green}};
  } else {
    throw UsageError("experiment '" + name + "' has no plot (plots: variance, saturation, lookup)");
  }
  draw_chart(ch, path);
}

}  // namespace attn::cli
