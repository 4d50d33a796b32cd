// Plots one column of several training-curve CSVs (written by `attn train
// --csv` or attn::nn::write_curve_csv) into one PNG, with the charts of the
// attn tool (attn_plot):
//   plot_curves --out loss.png --column loss [--log] name=run1.csv name=run2.csv ...
#include <CLI/CLI.hpp>
#include <algorithm>
#include <exception>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "plot.hpp"

namespace {

// The column's (step + 1, value) pairs of one CSV, as a chart series.
attn::cli::Series read_series(const std::string& name, const std::string& path, const std::string& column,
                              int every, double max_step) {
  attn::cli::Series s{name, {}, {}, {}, false, false};
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open '" + path + "'");
  std::string line;
  std::getline(in, line);
  std::vector<std::string> head;
  std::stringstream hs(line);
  for (std::string h; std::getline(hs, h, ',');) head.push_back(h);
  const auto col = size_t(std::find(head.begin(), head.end(), column) - head.begin());
  if (col == head.size()) throw std::runtime_error("no column '" + column + "' in '" + path + "'");
  const bool eval = column.rfind("eval_", 0) == 0;  // -1 where no evaluation ran
  for (int row = 0; std::getline(in, line); ++row) {
    std::stringstream ls(line);
    std::vector<double> v;
    for (std::string c; std::getline(ls, c, ',');) v.push_back(std::stod(c));
    if (v.size() != head.size()) throw std::runtime_error("'" + path + "': row " + std::to_string(row + 1) +
                                                          " has " + std::to_string(v.size()) + " columns");
    if (eval ? v[col] < 0 : row % every != 0) continue;
    if (max_step > 0 && v[0] + 1 > max_step) break;
    s.x.push_back(v[0] + 1);
    s.y.push_back(v[col]);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out, column = "loss";
  bool log_y = false;
  int every = 1;
  double max_step = 0;
  std::string title;
  std::vector<std::string> runs;
  CLI::App app{"Plot a column of training-curve CSVs into a PNG."};
  app.add_option("--out", out, "PNG to write")->required();
  app.add_option("--column", column, "CSV column (loss, token_acc, grad_norm_q, eval_token_acc, ...)")
      ->capture_default_str();
  app.add_flag("--log", log_y, "logarithmic y axis");
  app.add_option("--every", every, "plot every n-th row")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--max-step", max_step, "plot steps up to this one (0 = all)");
  app.add_option("--title", title, "text above the plot");
  app.add_option("runs", runs, "NAME=FILE.csv, one per series")->required();
  CLI11_PARSE(app, argc, argv);
  attn::cli::Chart chart;
  chart.title = title;
  chart.xlabel = "step";
  chart.ylabel = column;
  chart.logy = log_y;
  try {
    for (const auto& r : runs) {
      const auto eq = r.find('=');
      if (eq == std::string::npos) {
        std::cerr << "plot_curves: expected NAME=FILE.csv, got '" << r << "'\n";
        return 2;
      }
      chart.series.push_back(read_series(r.substr(0, eq), r.substr(eq + 1), column, every, max_step));
      chart.series.back().color = attn::cli::palette(chart.series.size() - 1);
    }
    attn::cli::draw_chart(chart, out);
  } catch (const std::exception& e) {
    std::cerr << "plot_curves: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
