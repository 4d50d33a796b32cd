// Plots one column of several training-curve CSVs (written by examples/train
// or attn::nn::write_curve_csv) into one PNG:
//   plot_curves --out loss.png --column loss [--log] name=run1.csv name=run2.csv ...
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>

#include "plot_png.hpp"

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
  app.add_option("--every", every, "plot every n-th row")->capture_default_str();
  app.add_option("--max-step", max_step, "plot steps up to this one (0 = all)");
  app.add_option("--title", title, "text above the plot");
  app.add_option("runs", runs, "NAME=FILE.csv, one per series")->required();
  CLI11_PARSE(app, argc, argv);
  std::vector<plot::Series> series;
  for (const auto& r : runs) {
    const auto eq = r.find('=');
    if (eq == std::string::npos) {
      std::cerr << "plot_curves: expected NAME=FILE.csv, got '" << r << "'\n";
      return 2;
    }
    plot::Series s;
    s.name = r.substr(0, eq);
    std::ifstream in(r.substr(eq + 1));
    if (!in) {
      std::cerr << "plot_curves: cannot open '" << r.substr(eq + 1) << "'\n";
      return 2;
    }
    std::string line;
    std::getline(in, line);
    std::vector<std::string> head;
    std::stringstream hs(line);
    for (std::string h; std::getline(hs, h, ',');) head.push_back(h);
    const auto col = std::find(head.begin(), head.end(), column) - head.begin();
    if (col == std::ptrdiff_t(head.size())) {
      std::cerr << "plot_curves: no column '" << column << "' in '" << r.substr(eq + 1) << "'\n";
      return 2;
    }
    for (int row = 0; std::getline(in, line); ++row) {
      std::stringstream ls(line);
      std::vector<double> v;
      for (std::string c; std::getline(ls, c, ',');) v.push_back(std::stod(c));
      if (column.rfind("eval_", 0) == 0 ? v[size_t(col)] < 0  // not evaluated at this step
                                         : row % every != 0)
        continue;
      if (max_step > 0 && v[0] + 1 > max_step) break;
      s.x.push_back(v[0] + 1);
      s.y.push_back(v[size_t(col)]);
    }
    series.push_back(std::move(s));
  }
  try {
    plot::write_line_plot(out, series, log_y, title);
  } catch (const std::exception& e) {
    std::cerr << "plot_curves: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
