// Small raster drawing for the CLI and the example programs (target
// attn_plot): an RGB canvas with lines, rectangles and text from an embedded
// 5x7 bitmap font, written as PNG with libpng. Enough for line charts (the
// experiments, training curves) and attention heatmaps, nothing more.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace attn::cli {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};

class Canvas {
 public:
  Canvas(int width, int height, Rgb background = {255, 255, 255});
  int width() const { return w_; }
  int height() const { return h_; }
  void pixel(int x, int y, Rgb c);
  void fill_rect(int x0, int y0, int x1, int y1, Rgb c);  // inclusive corners
  void rect(int x0, int y0, int x1, int y1, Rgb c);
  void line(double x0, double y0, double x1, double y1, Rgb c, int thickness = 1, bool dashed = false);
  // Text in the 5x7 font, each font pixel drawn as scale x scale; (x, y) is
  // the top-left corner. Returns the width in pixels.
  int text(int x, int y, const std::string& s, Rgb c, int scale = 2);
  // Text rotated 90 degrees counter-clockwise (reads bottom to top); (x, y) is
  // the bottom-left corner of the rotated text.
  void text_up(int x, int y, const std::string& s, Rgb c, int scale = 2);
  static int text_width(const std::string& s, int scale = 2) { return int(s.size()) * 6 * scale; }
  static int text_height(int scale = 2) { return 7 * scale; }
  // Encodes as 8-bit RGB PNG and writes it atomically.
  void write_png(const std::string& path) const;

 private:
  int w_, h_;
  std::vector<uint8_t> px_;
};

// A perceptually ordered colour map (viridis-like) for t in [0, 1].
Rgb colormap(double t);
// Distinct colours for the series of a chart (matplotlib's tab10), cycling.
Rgb palette(size_t k);

struct Series {
  std::string name;
  std::vector<double> x, y;
  Rgb color;
  bool dashed = false;
  bool markers = true;
};

struct Chart {
  std::string title, xlabel, ylabel;
  bool logx = false, logy = false;
  bool legend_bottom = false;
  std::vector<double> xticks, yticks;  // empty: chosen automatically
  std::vector<Series> series;
  int width = 900, height = 600;
};

void draw_chart(const Chart& chart, const std::string& path);

// One panel per head of weights (H, L, S) (row-major), rows labelled with the
// query tokens and columns with the key tokens, and a colour bar. Panels are
// titled "head h" unless panel_titles names them; per_row panels (default 4)
// go side by side. The subtitle under the title defaults to "rows: queries,
// columns: keys; each row sums to 1".
void draw_heatmap(const std::vector<double>& weights, int64_t H, int64_t L, int64_t S,
                  const std::vector<std::string>& row_labels, const std::vector<std::string>& col_labels,
                  const std::string& title, const std::string& path,
                  const std::vector<std::string>& panel_titles = {}, int per_row = 0,
                  const std::string& subtitle = "");

}  // namespace attn::cli
