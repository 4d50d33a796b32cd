// Raster drawing for charts and heatmaps (see plot.hpp). The font is a 5x7
// bitmap table for printable ASCII, one byte per row, bit 4 = leftmost pixel.
#include "plot.hpp"

#include <png.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "attn/io.hpp"

namespace attn::cli {
namespace {

constexpr uint8_t kFont[95][7] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, {0x04, 0x04, 0x04, 0x04, 0x00, 0x00, 0x04},  // space !
    {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00}, {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A},  // " #
    {0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04}, {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03},  // $ %
    {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D}, {0x0C, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00},  // & '
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}, {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08},  // ( )
    {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00}, {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00},  // * +
    {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}, {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00},  // , -
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}, {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00},  // . /
    {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}, {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E},  // 0 1
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}, {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E},  // 2 3
    {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}, {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E},  // 4 5
    {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}, {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08},  // 6 7
    {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}, {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C},  // 8 9
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}, {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08},  // : ;
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02}, {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00},  // < =
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08}, {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04},  // > ?
    {0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E}, {0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11},  // @ A
    {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E}, {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E},  // B C
    {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C}, {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F},  // D E
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10}, {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F},  // F G
    {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}, {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // H I
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}, {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11},  // J K
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F}, {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11},  // L M
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}, {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // N O
    {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10}, {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D},  // P Q
    {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11}, {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E},  // R S
    {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}, {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // T U
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04}, {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A},  // V W
    {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11}, {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04},  // X Y
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}, {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E},  // Z [
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00}, {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E},  // \ ]
    {0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00}, {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F},  // ^ _
    {0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00}, {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F},  // ` a
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E}, {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E},  // b c
    {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F}, {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E},  // d e
    {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08}, {0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // f g
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11}, {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E},  // h i
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C}, {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12},  // j k
    {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}, {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11},  // l m
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11}, {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E},  // n o
    {0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10}, {0x00, 0x00, 0x0F, 0x11, 0x0F, 0x01, 0x01},  // p q
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10}, {0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E},  // r s
    {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06}, {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D},  // t u
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04}, {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A},  // v w
    {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11}, {0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // x y
    {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F}, {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02},  // z {
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}, {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08},  // | }
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00},                                              // ~
};

const uint8_t* glyph(char ch) {
  const int c = static_cast<unsigned char>(ch);
  return kFont[(c >= 32 && c <= 126) ? c - 32 : '?' - 32];
}

constexpr Rgb kBlack{0, 0, 0}, kGrey{200, 200, 200}, kDark{90, 90, 90};

std::string tick_label(double v) {
  if (v == 0) return "0";
  const double a = std::abs(v);
  if (a >= 1e5 || a < 1e-3) return fmt::format("{:.0e}", v);
  return fmt::format("{:g}", v);
}

std::vector<double> nice_ticks(double lo, double hi) {
  const double span = hi - lo;
  if (!(span > 0)) return {lo};
  const double raw = span / 5;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9 * span; v += step) t.push_back(std::abs(v) < 1e-12 * step ? 0 : v);
  return t;
}

}  // namespace

Canvas::Canvas(int width, int height, Rgb bg) : w_(width), h_(height), px_(size_t(width) * size_t(height) * 3) {
  for (size_t i = 0; i < px_.size(); i += 3) {
    px_[i] = bg.r;
    px_[i + 1] = bg.g;
    px_[i + 2] = bg.b;
  }
}

void Canvas::pixel(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
  uint8_t* p = &px_[(size_t(y) * size_t(w_) + size_t(x)) * 3];
  p[0] = c.r;
  p[1] = c.g;
  p[2] = c.b;
}

void Canvas::fill_rect(int x0, int y0, int x1, int y1, Rgb c) {
  for (int y = std::min(y0, y1); y <= std::max(y0, y1); ++y)
    for (int x = std::min(x0, x1); x <= std::max(x0, x1); ++x) pixel(x, y, c);
}

void Canvas::rect(int x0, int y0, int x1, int y1, Rgb c) {
  line(x0, y0, x1, y0, c);
  line(x1, y0, x1, y1, c);
  line(x1, y1, x0, y1, c);
  line(x0, y1, x0, y0, c);
}

void Canvas::line(double x0, double y0, double x1, double y1, Rgb c, int thickness, bool dashed) {
  const double len = std::hypot(x1 - x0, y1 - y0);
  const int steps = std::max(1, int(std::ceil(len * 2)));
  for (int i = 0; i <= steps; ++i) {
    const double t = double(i) / steps;
    if (dashed && int(t * len / 8) % 2 == 1) continue;
    const int x = int(std::lround(x0 + t * (x1 - x0))), y = int(std::lround(y0 + t * (y1 - y0)));
    for (int dy = 0; dy < thickness; ++dy)
      for (int dx = 0; dx < thickness; ++dx) pixel(x + dx - thickness / 2, y + dy - thickness / 2, c);
  }
}

int Canvas::text(int x, int y, const std::string& s, Rgb c, int scale) {
  for (size_t i = 0; i < s.size(); ++i) {
    const uint8_t* g = glyph(s[i]);
    for (int r = 0; r < 7; ++r)
      for (int col = 0; col < 5; ++col)
        if (g[r] & (0x10 >> col))
          fill_rect(x + int(i) * 6 * scale + col * scale, y + r * scale, x + int(i) * 6 * scale + col * scale + scale - 1,
                    y + r * scale + scale - 1, c);
  }
  return text_width(s, scale);
}

void Canvas::text_up(int x, int y, const std::string& s, Rgb c, int scale) {
  // Font pixel (col, r) of character i lands at (x + r, y - (i*6 + col)).
  for (size_t i = 0; i < s.size(); ++i) {
    const uint8_t* g = glyph(s[i]);
    for (int r = 0; r < 7; ++r)
      for (int col = 0; col < 5; ++col)
        if (g[r] & (0x10 >> col)) {
          const int px = x + r * scale, py = y - (int(i) * 6 + col) * scale;
          fill_rect(px, py - scale + 1, px + scale - 1, py, c);
        }
  }
}

void Canvas::write_png(const std::string& path) const {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  if (!png) throw FileError(path, "cannot initialise libpng");
  png_infop info = png_create_info_struct(png);
  std::vector<unsigned char> out;
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, info ? &info : nullptr);
    throw FileError(path, "PNG encoding failed");
  }
  png_set_write_fn(
      png, &out,
      [](png_structp p, png_bytep data, png_size_t n) {
        auto* v = static_cast<std::vector<unsigned char>*>(png_get_io_ptr(p));
        v->insert(v->end(), data, data + n);
      },
      nullptr);
  png_set_IHDR(png, info, png_uint_32(w_), png_uint_32(h_), 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < h_; ++y) png_write_row(png, const_cast<png_bytep>(&px_[size_t(y) * size_t(w_) * 3]));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  io::write_file_atomic(path, out.data(), out.size());
}

Rgb colormap(double t) {
  // Control points sampled from matplotlib's viridis.
  static const double k[9][3] = {{68, 1, 84},    {71, 44, 122},  {59, 81, 139},   {44, 113, 142}, {33, 144, 141},
                                 {39, 173, 129}, {92, 200, 99},  {170, 220, 50}, {253, 231, 37}};
  t = std::clamp(std::isfinite(t) ? t : 0.0, 0.0, 1.0) * 8;
  const int i = std::min(int(t), 7);
  const double f = t - i;
  auto mix = [&](int ch) { return uint8_t(std::lround(k[i][ch] * (1 - f) + k[i + 1][ch] * f)); };
  return {mix(0), mix(1), mix(2)};
}

Rgb palette(size_t k) {
  static const Rgb kTab10[10] = {{31, 119, 180}, {255, 127, 14}, {44, 160, 44},  {214, 39, 40},  {148, 103, 189},
                                 {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207}};
  return kTab10[k % 10];
}

void draw_chart(const Chart& ch, const std::string& path) {
  Canvas cv(ch.width, ch.height);
  const int left = 110, right = ch.width - 30, top = 60, bottom = ch.height - 80;
  double xlo = 1e300, xhi = -1e300, ylo = 1e300, yhi = -1e300;
  auto tx = [&](double v, bool lg) { return lg ? std::log10(std::max(v, 1e-300)) : v; };
  for (const auto& s : ch.series)
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i]) || (ch.logy && s.y[i] <= 0)) continue;
      xlo = std::min(xlo, tx(s.x[i], ch.logx));
      xhi = std::max(xhi, tx(s.x[i], ch.logx));
      ylo = std::min(ylo, tx(s.y[i], ch.logy));
      yhi = std::max(yhi, tx(s.y[i], ch.logy));
    }
  for (double t : ch.xticks) xlo = std::min(xlo, tx(t, ch.logx)), xhi = std::max(xhi, tx(t, ch.logx));
  for (double t : ch.yticks) ylo = std::min(ylo, tx(t, ch.logy)), yhi = std::max(yhi, tx(t, ch.logy));
  if (!(xhi > xlo)) xhi = xlo + 1;
  if (!(yhi > ylo)) yhi = ylo + 1;
  const double ypad = (yhi - ylo) * 0.05, xpad = (xhi - xlo) * 0.03;
  ylo -= ypad, yhi += ypad, xlo -= xpad, xhi += xpad;
  auto px = [&](double v) { return left + (tx(v, ch.logx) - xlo) / (xhi - xlo) * (right - left); };
  auto py = [&](double v) { return bottom - (tx(v, ch.logy) - ylo) / (yhi - ylo) * (bottom - top); };

  std::vector<double> xt = ch.xticks, yt = ch.yticks;
  if (xt.empty()) {
    if (ch.logx) for (int e = int(std::ceil(xlo)); e <= int(std::floor(xhi)); ++e) xt.push_back(std::pow(10.0, e));
    else xt = nice_ticks(xlo, xhi);
  }
  if (yt.empty()) {
    if (ch.logy) {
      const int e0 = int(std::ceil(ylo)), e1 = int(std::floor(yhi));
      const int step = std::max(1, (e1 - e0 + 7) / 8);  // at most about 8 labelled decades
      for (int e = e1; e >= e0; e -= step) yt.push_back(std::pow(10.0, e));
    }
    else yt = nice_ticks(ylo, yhi);
  }
  for (double t : xt) {
    const double x = px(t);
    cv.line(x, top, x, bottom, kGrey);
    const std::string l = tick_label(t);
    cv.text(int(x) - Canvas::text_width(l) / 2, bottom + 10, l, kBlack);
  }
  for (double t : yt) {
    const double y = py(t);
    cv.line(left, y, right, y, kGrey);
    const std::string l = tick_label(t);
    cv.text(left - 10 - Canvas::text_width(l), int(y) - 7, l, kBlack);
  }
  cv.rect(left, top, right, bottom, kBlack);
  cv.text((ch.width - Canvas::text_width(ch.title)) / 2, 20, ch.title, kBlack);
  cv.text((left + right - Canvas::text_width(ch.xlabel)) / 2, ch.height - 40, ch.xlabel, kBlack);
  cv.text_up(20, (top + bottom + Canvas::text_width(ch.ylabel)) / 2, ch.ylabel, kBlack);

  for (const auto& s : ch.series) {
    bool have = false;
    double lx = 0, ly = 0;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i]) || (ch.logy && s.y[i] <= 0)) {
        have = false;
        continue;
      }
      const double x = px(s.x[i]), y = py(s.y[i]);
      if (have) cv.line(lx, ly, x, y, s.color, 3, s.dashed);
      if (s.markers) cv.fill_rect(int(x) - 4, int(y) - 4, int(x) + 4, int(y) + 4, s.color);
      lx = x, ly = y, have = true;
    }
  }
  // Legend, top-left (or bottom-left) inside the plot.
  const int ltop = ch.legend_bottom ? bottom - 16 - 22 * int(ch.series.size()) : top + 4;
  int ly = ltop + 8;
  int lw = 0;
  for (const auto& s : ch.series) lw = std::max(lw, Canvas::text_width(s.name));
  cv.fill_rect(left + 8, ltop, left + 60 + lw, ltop + 8 + 22 * int(ch.series.size()), {255, 255, 255});
  cv.rect(left + 8, ltop, left + 60 + lw, ltop + 8 + 22 * int(ch.series.size()), kDark);
  for (const auto& s : ch.series) {
    cv.line(left + 16, ly + 7, left + 46, ly + 7, s.color, 3, s.dashed);
    cv.text(left + 54, ly, s.name, kBlack);
    ly += 22;
  }
  cv.write_png(path);
}

void draw_heatmap(const std::vector<double>& w, int64_t H, int64_t L, int64_t S, const std::vector<std::string>& rows,
                  const std::vector<std::string>& cols, const std::string& title, const std::string& path,
                  const std::vector<std::string>& panel_titles, int per_row_wanted, const std::string& subtitle) {
  size_t row_w = 0, col_w = 0;
  for (const auto& r : rows) row_w = std::max(row_w, r.size());
  for (const auto& c : cols) col_w = std::max(col_w, c.size());
  const int cell = int(std::clamp<int64_t>(480 / std::max<int64_t>({L, S, 1}), 6, 48));
  const int ts = cell >= 16 ? 2 : 1;                              // label text scale
  const int stride = std::max(1, (Canvas::text_height(ts) + 2 + cell - 1) / cell);  // label every stride-th cell
  const int label_w = Canvas::text_width(std::string(row_w, 'x'), ts) + 12;
  const int label_h = Canvas::text_width(std::string(col_w, 'x'), ts) + 12;
  const int panel_w = label_w + int(S) * cell + 30, panel_h = 40 + label_h + int(L) * cell + 20;
  const int per_row = int(std::min<int64_t>(H, per_row_wanted > 0 ? per_row_wanted : 4));
  const int grid_rows = int((H + per_row - 1) / per_row);
  const int bar_w = 120;
  const int width = std::max(20 + per_row * panel_w + bar_w, 560), height = std::max(50 + grid_rows * panel_h, 300);
  if (int64_t(width) * height > 40'000'000) throw InvalidArgument("attn heatmap: the image would be too large; use fewer heads or tokens");
  Canvas cv(width, height);
  cv.text(20, 8, title, kBlack);
  cv.text(20, 28, subtitle.empty() ? "rows: queries, columns: keys; each row sums to 1" : subtitle, kDark);
  double vmax = 0;
  for (double v : w) vmax = std::max(vmax, std::isfinite(v) ? v : 0.0);
  if (vmax <= 0) vmax = 1;
  for (int64_t h = 0; h < H; ++h) {
    const int ox = 20 + int(h % per_row) * panel_w, oy = 50 + int(h / per_row) * panel_h;
    if (h < int64_t(panel_titles.size())) cv.text(ox + label_w, oy, panel_titles[size_t(h)], kBlack);
    else if (H > 1) cv.text(ox + label_w, oy, fmt::format("head {}", h), kBlack);
    const int gx = ox + label_w, gy = oy + 30 + label_h;
    const int th = Canvas::text_height(ts);
    for (int64_t j = 0; j < S; j += stride)
      cv.text_up(gx + int(j) * cell + (cell - th) / 2, gy - 8, j < int64_t(cols.size()) ? cols[size_t(j)] : std::to_string(j),
                 kBlack, ts);
    for (int64_t i = 0; i < L; ++i) {
      const std::string l = i < int64_t(rows.size()) ? rows[size_t(i)] : std::to_string(i);
      if (i % stride == 0) cv.text(gx - 8 - Canvas::text_width(l, ts), gy + int(i) * cell + (cell - th) / 2, l, kBlack, ts);
      for (int64_t j = 0; j < S; ++j) {
        const double v = w[size_t((h * L + i) * S + j)];
        cv.fill_rect(gx + int(j) * cell, gy + int(i) * cell, gx + int(j + 1) * cell - 1, gy + int(i + 1) * cell - 1,
                     colormap(v / vmax));
      }
    }
    cv.rect(gx - 1, gy - 1, gx + int(S) * cell, gy + int(L) * cell, kDark);
  }
  // Colour bar with five ticks from 0 to the largest weight.
  const int bx = width - bar_w + 10, by0 = 50 + 30, by1 = std::min(height - 20, by0 + 300);
  for (int y = by0; y <= by1; ++y) cv.fill_rect(bx, y, bx + 20, y, colormap(double(by1 - y) / (by1 - by0)));
  cv.rect(bx, by0, bx + 20, by1, kDark);
  for (int t = 0; t <= 4; ++t) {
    const int y = by1 - (by1 - by0) * t / 4;
    cv.line(bx + 20, y, bx + 25, y, kBlack);
    cv.text(bx + 28, y - 7, fmt::format("{:.2f}", vmax * t / 4), kBlack);
  }
  cv.write_png(path);
}

}  // namespace attn::cli
