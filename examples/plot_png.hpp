// A small line-plot writer for training curves (PNG through libpng): axes,
// tick labels in a built-in 3×5 pixel font, one coloured polyline per series
// and a legend of colour swatches with their names. Header-only, for the
// example programs.
#pragma once

#include <png.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace plot {

struct Series {
  std::string name;
  std::vector<double> x, y;
};

namespace detail {

// 3×5 glyphs, one row per string, '#' = ink.
inline const char* glyph(char c) {
  switch (c) {
    case '0': return "###"  "# #" "# #" "# #" "###";
    case '1': return " # "  "## " " # " " # " "###";
    case '2': return "###"  "  #" "###" "#  " "###";
    case '3': return "###"  "  #" " ##" "  #" "###";
    case '4': return "# #"  "# #" "###" "  #" "  #";
    case '5': return "###"  "#  " "###" "  #" "###";
    case '6': return "###"  "#  " "###" "# #" "###";
    case '7': return "###"  "  #" "  #" " # " " # ";
    case '8': return "###"  "# #" "###" "# #" "###";
    case '9': return "###"  "# #" "###" "  #" "###";
    case '.': return "   "  "   " "   " "   " " # ";
    case '-': return "   "  "   " "###" "   " "   ";
    case '_': return "   "  "   " "   " "   " "###";
    case '=': return "   "  "###" "   " "###" "   ";
    case ':': return "   "  " # " "   " " # " "   ";
    case ',': return "   "  "   " "   " " # " "#  ";
    case '/': return "  #"  "  #" " # " "#  " "#  ";
    case '(': return " # "  "#  " "#  " "#  " " # ";
    case ')': return " # "  "  #" "  #" "  #" " # ";
    case ' ': return "               ";
    default: {
      // letters (either case) as 3×5 capitals, 15 characters per glyph
      static const char* const kLetters =
      " # # ##### ## #"
      "## # ### # ### "
      " ###  #  #   ##"
      "## # ## ## ### "
      "####  ## #  ###"
      "####  ## #  #  "
      " ###  # ## # ##"
      "# ## ##### ## #"
      "### #  #  # ###"
      "  #  #  ## # # "
      "# ## ### # ## #"
      "#  #  #  #  ###"
      "# ######## ## #"
      "## # ## ## ## #"
      " # # ## ## # # "
      "## # ### #  #  "
      " # # ## ###  ##"
      "## # ### # ## #"
      " ###   #   ### "
      "### #  #  #  # "
      "# ## ## ## ####"
      "# ## ## ## # # "
      "# ## ######## #"
      "# ## # # # ## #"
      "# ## # #  #  # "
      "###  # # #  ###";
      if (c >= 'a' && c <= 'z') c = char(c - 'a' + 'A');
      if (c >= 'A' && c <= 'Z') return kLetters + (c - 'A') * 15;
      return "###" "# #" "# #" "# #" "###";
    }
  }
}

struct Canvas {
  int w, h;
  std::vector<uint8_t> rgb;
  Canvas(int W, int H) : w(W), h(H), rgb(size_t(W) * size_t(H) * 3, 255) {}
  void set(int x, int y, std::array<uint8_t, 3> c) {
    if (x < 0 || y < 0 || x >= w || y >= h) return;
    const size_t o = (size_t(y) * size_t(w) + size_t(x)) * 3;
    rgb[o] = c[0];
    rgb[o + 1] = c[1];
    rgb[o + 2] = c[2];
  }
  void line(double x0, double y0, double x1, double y1, std::array<uint8_t, 3> c, int thick = 1) {
    const int n = int(std::max(std::abs(x1 - x0), std::abs(y1 - y0))) + 1;
    for (int i = 0; i <= n; ++i) {
      const double t = double(i) / n;
      const int x = int(std::lround(x0 + t * (x1 - x0))), y = int(std::lround(y0 + t * (y1 - y0)));
      for (int dx = 0; dx < thick; ++dx)
        for (int dy = 0; dy < thick; ++dy) set(x + dx, y + dy, c);
    }
  }
  void text(int x, int y, const std::string& s, int scale = 2) {
    for (char ch : s) {
      const char* g = glyph(ch);
      for (int r = 0; r < 5; ++r)
        for (int k = 0; k < 3; ++k)
          if (g[r * 3 + k] == '#')
            for (int a = 0; a < scale; ++a)
              for (int b = 0; b < scale; ++b) set(x + k * scale + a, y + r * scale + b, {0, 0, 0});
      x += 4 * scale;
    }
  }
};

inline std::string fmt(double v) {
  char buf[32];
  if (v != 0 && std::abs(v) < 1e-2) std::snprintf(buf, sizeof buf, "%.0e", v);
  else if (std::abs(v) >= 100) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

}  // namespace detail

// Writes the plot to `path`; log_y plots log10(y) (ticks show y). Throws
// std::runtime_error on I/O failure.
inline void write_line_plot(const std::string& path, const std::vector<Series>& series, bool log_y = false,
                            const std::string& title = "", int width = 720, int height = 420) {
  static const std::array<std::array<uint8_t, 3>, 8> colours{{{31, 119, 180}, {214, 39, 40}, {44, 160, 44},
                                                              {255, 127, 14}, {148, 103, 189}, {140, 86, 75},
                                                              {227, 119, 194}, {127, 127, 127}}};
  detail::Canvas cv(width, height);
  const int left = 70, right = 40, top = 28, bottom = 40 + 14 * int((series.size() + 2) / 3);
  const int pw = width - left - right, ph = height - top - bottom;
  auto ty = [&](double y) { return log_y ? std::log10(std::max(y, 1e-12)) : y; };
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : series)
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      x0 = std::min(x0, s.x[i]);
      x1 = std::max(x1, s.x[i]);
      y0 = std::min(y0, ty(s.y[i]));
      y1 = std::max(y1, ty(s.y[i]));
    }
  if (!(x1 > x0)) x1 = x0 + 1;
  if (!(y1 > y0)) y1 = y0 + 1;
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + (1 - (ty(y) - y0) / (y1 - y0)) * ph; };
  // axes and ticks
  cv.line(left, top, left, top + ph, {0, 0, 0});
  cv.line(left, top + ph, left + pw, top + ph, {0, 0, 0});
  for (int i = 0; i <= 4; ++i) {
    const double fx = x0 + (x1 - x0) * i / 4, fy = y0 + (y1 - y0) * i / 4;
    const double X = px(fx), Y = top + (1 - double(i) / 4) * ph;
    cv.line(X, top + ph, X, top + ph + 4, {0, 0, 0});
    cv.text(int(X) - 8, top + ph + 8, detail::fmt(fx));
    cv.line(left - 4, Y, left, Y, {0, 0, 0});
    for (int g = left + 1; g < left + pw; g += 4) cv.set(g, int(Y), {220, 220, 220});
    cv.text(4, int(Y) - 5, detail::fmt(log_y ? std::pow(10.0, fy) : fy));
  }
  cv.text(left + 10, 6, title);
  // series
  for (size_t k = 0; k < series.size(); ++k) {
    const auto& s = series[k];
    const auto c = colours[k % colours.size()];
    bool have = false;
    double lx = 0, ly = 0;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      const double X = px(s.x[i]), Y = py(s.y[i]);
      if (have) cv.line(lx, ly, X, Y, c, 2);
      lx = X;
      ly = Y;
      have = true;
    }
    // legend: swatch + name, three per row
    const int lxp = left + int(k % 3) * (pw / 3), lyp = top + ph + 30 + 14 * int(k / 3);
    for (int a = 0; a < 14; ++a)
      for (int b = 0; b < 8; ++b) cv.set(lxp + a, lyp + b, c);
    cv.text(lxp + 20, lyp - 1, s.name);
  }
  // PNG out, atomically: a temporary file renamed over the target
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write " + path);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    std::fclose(f);
    std::remove(tmp.c_str());
    throw std::runtime_error("libpng failed writing " + path);
  }
  png_init_io(png, f);
  png_set_IHDR(png, info, png_uint_32(width), png_uint_32(height), 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < height; ++y) png_write_row(png, cv.rgb.data() + size_t(y) * size_t(width) * 3);
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot write " + path);
  }
}

}  // namespace plot
