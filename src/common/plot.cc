#include "common/plot.h"

#include <fcntl.h>
#include <png.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string_view>

#include "common/error.h"

namespace keel::plot {
namespace {

// ---------------------------------------------------------------------------------------------
// Colors

struct Rgb {
  std::uint8_t r, g, b;
};

constexpr Rgb kBackground{255, 255, 255};
constexpr Rgb kInk{40, 40, 40};           // text
constexpr Rgb kFrame{110, 110, 110};      // plot border and tick marks
constexpr Rgb kGrid{220, 220, 220};       // gridlines at labelled ticks
constexpr Rgb kMinorGrid{242, 242, 242};  // gridlines between them (log axes)
constexpr Rgb kLegendBorder{200, 200, 200};

// Okabe & Ito's colorblind-safe palette, ordered so the first curves get the most distinct hues.
// Their yellow (240,228,66) is nearly invisible on white, so a darker gold stands in for it; two
// neutral extras follow before the palette repeats.
constexpr Rgb kPalette[] = {
    {0, 114, 178},    // blue
    {213, 94, 0},     // vermillion
    {0, 158, 115},    // bluish green
    {230, 159, 0},    // orange
    {204, 121, 167},  // reddish purple
    {86, 180, 233},   // sky blue
    {0, 0, 0},        // black
    {190, 170, 0},    // gold (darkened yellow)
    {120, 120, 120},  // gray
    {140, 80, 40},    // brown
};
constexpr int kPaletteSize = sizeof(kPalette) / sizeof(kPalette[0]);

// ---------------------------------------------------------------------------------------------
// Raster

class Canvas {
 public:
  Canvas(int width, int height)
      : width_(width), height_(height), rgb_(static_cast<size_t>(width) * height * 3) {
    fill_rect(0, 0, width, height, kBackground);
  }

  int width() const { return width_; }
  int height() const { return height_; }
  const std::uint8_t* data() const { return rgb_.data(); }

  // Mixes `c` into pixel (x, y) with opacity `alpha`; pixels off the canvas are ignored, so
  // callers can draw without clipping.
  void blend(int x, int y, Rgb c, float alpha = 1.0f) {
    if (x < 0 || y < 0 || x >= width_ || y >= height_ || !(alpha > 0.0f)) return;
    std::uint8_t* p = &rgb_[(static_cast<size_t>(y) * width_ + x) * 3];
    if (alpha >= 1.0f) {
      p[0] = c.r, p[1] = c.g, p[2] = c.b;
      return;
    }
    auto mix = [alpha](std::uint8_t from, std::uint8_t to) {
      return static_cast<std::uint8_t>(std::lround(from + (to - from) * alpha));
    };
    p[0] = mix(p[0], c.r), p[1] = mix(p[1], c.g), p[2] = mix(p[2], c.b);
  }

  // Fills the half-open rectangle [x0, x1) x [y0, y1).
  void fill_rect(int x0, int y0, int x1, int y1, Rgb c, float alpha = 1.0f) {
    x0 = std::max(x0, 0), y0 = std::max(y0, 0);
    x1 = std::min(x1, width_), y1 = std::min(y1, height_);
    for (int y = y0; y < y1; ++y)
      for (int x = x0; x < x1; ++x) blend(x, y, c, alpha);
  }

  // One-pixel outline of the half-open rectangle.
  void outline_rect(int x0, int y0, int x1, int y1, Rgb c) {
    fill_rect(x0, y0, x1, y0 + 1, c);
    fill_rect(x0, y1 - 1, x1, y1, c);
    fill_rect(x0, y0, x0 + 1, y1, c);
    fill_rect(x1 - 1, y0, x1, y1, c);
  }

 private:
  int width_, height_;
  std::vector<std::uint8_t> rgb_;
};

// Anti-aliased shapes of one color, gathered as per-pixel coverage and painted in one go. Each
// pixel keeps the largest coverage any shape gave it, so where a polyline's segments overlap at
// the joints the edge does not get darker than elsewhere, as it would blending each segment.
class Coverage {
 public:
  // Shapes are clipped to the half-open rectangle [x0, x1) x [y0, y1).
  Coverage(int x0, int y0, int x1, int y1)
      : x0_(x0),
        y0_(y0),
        w_(std::max(x1 - x0, 0)),
        h_(std::max(y1 - y0, 0)),
        cov_(static_cast<size_t>(w_) * h_, 0.0f) {}

  // A line of the given width with round ends, from (ax, ay) to (bx, by) in pixel units.
  // Coverage falls off linearly over one pixel at the edge: cheap, and smooth enough to read.
  void segment(double ax, double ay, double bx, double by, double width) {
    const double half = width / 2;
    const double dx = bx - ax, dy = by - ay, len2 = dx * dx + dy * dy;
    const int xa = std::max(x0_, static_cast<int>(std::floor(std::min(ax, bx) - half - 1)));
    const int xb = std::min(x0_ + w_ - 1, static_cast<int>(std::ceil(std::max(ax, bx) + half + 1)));
    const int ya = std::max(y0_, static_cast<int>(std::floor(std::min(ay, by) - half - 1)));
    const int yb = std::min(y0_ + h_ - 1, static_cast<int>(std::ceil(std::max(ay, by) + half + 1)));
    for (int y = ya; y <= yb; ++y) {
      for (int x = xa; x <= xb; ++x) {
        const double px = x + 0.5 - ax, py = y + 0.5 - ay;
        const double t = len2 > 0 ? std::clamp((px * dx + py * dy) / len2, 0.0, 1.0) : 0.0;
        const double d = std::hypot(px - t * dx, py - t * dy);
        add(x, y, half + 0.5 - d);
      }
    }
  }

  void disc(double cx, double cy, double radius) { segment(cx, cy, cx, cy, 2 * radius); }

  void paint(Canvas& canvas, Rgb c) const {
    for (int y = 0; y < h_; ++y)
      for (int x = 0; x < w_; ++x) canvas.blend(x0_ + x, y0_ + y, c, cov_[static_cast<size_t>(y) * w_ + x]);
  }

 private:
  void add(int x, int y, double c) {
    if (c <= 0) return;
    float& cell = cov_[static_cast<size_t>(y - y0_) * w_ + (x - x0_)];
    cell = std::max(cell, static_cast<float>(std::min(c, 1.0)));
  }

  int x0_, y0_, w_, h_;
  std::vector<float> cov_;
};

// ---------------------------------------------------------------------------------------------
// Text: a 5x7 bitmap font designed for this file, ASCII 32..126. Each glyph is 9 rows of 5
// columns: rows 0-6 hold capitals and digits (row 6 sits on the baseline), rows 7-8 descenders;
// missing rows are blank. Glyphs are drawn scaled up with square pixels.

constexpr int kGlyphCols = 5;
constexpr int kGlyphRows = 9;
constexpr int kCapRows = 7;
constexpr int kAdvance = kGlyphCols + 1;  // one blank column between characters

// clang-format off
constexpr const char* kFont[95][kGlyphRows] = {
    {},                                                                  // space
    {"..#..", "..#..", "..#..", "..#..", "..#..", ".....", "..#.."},     // !
    {".#.#.", ".#.#.", ".#.#."},                                         // "
    {".#.#.", ".#.#.", "#####", ".#.#.", "#####", ".#.#.", ".#.#."},     // #
    {"..#..", ".####", "#.#..", ".###.", "..#.#", "####.", "..#.."},     // $
    {"##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"},     // %
    {".##..", "#..#.", "#.#..", ".#...", "#.#.#", "#..#.", ".##.#"},     // &
    {"..#..", "..#..", "..#.."},                                         // '
    {"...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."},     // (
    {".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."},     // )
    {".....", "..#..", "#.#.#", ".###.", "#.#.#", "..#..", "....."},     // *
    {".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."},     // +
    {".....", ".....", ".....", ".....", ".....", ".##..", ".##..", "..#..", ".#..."},  // ,
    {".....", ".....", ".....", "#####", ".....", ".....", "....."},     // -
    {".....", ".....", ".....", ".....", ".....", ".##..", ".##.."},     // .
    {".....", "....#", "...#.", "..#..", ".#...", "#....", "....."},     // /
    {".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."},     // 0
    {"..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."},     // 1
    {".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"},     // 2
    {"#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."},     // 3
    {"...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."},     // 4
    {"#####", "#....", "####.", "....#", "....#", "#...#", ".###."},     // 5
    {"..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."},     // 6
    {"#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."},     // 7
    {".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."},     // 8
    {".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."},     // 9
    {".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."},     // :
    {".....", ".##..", ".##..", ".....", ".##..", ".##..", "..#..", ".#..."},  // ;
    {"...#.", "..#..", ".#...", "#....", ".#...", "..#..", "...#."},     // <
    {".....", ".....", "#####", ".....", "#####", ".....", "....."},     // =
    {".#...", "..#..", "...#.", "....#", "...#.", "..#..", ".#..."},     // >
    {".###.", "#...#", "....#", "...#.", "..#..", ".....", "..#.."},     // ?
    {".###.", "#...#", "#.###", "#.#.#", "#.##.", "#....", ".####"},     // @
    {".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"},     // A
    {"####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."},     // B
    {".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."},     // C
    {"####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."},     // D
    {"#####", "#....", "#....", "####.", "#....", "#....", "#####"},     // E
    {"#####", "#....", "#....", "####.", "#....", "#....", "#...."},     // F
    {".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"},     // G
    {"#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"},     // H
    {".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."},     // I
    {"..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."},     // J
    {"#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"},     // K
    {"#....", "#....", "#....", "#....", "#....", "#....", "#####"},     // L
    {"#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"},     // M
    {"#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"},     // N
    {".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."},     // O
    {"####.", "#...#", "#...#", "####.", "#....", "#....", "#...."},     // P
    {".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"},     // Q
    {"####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"},     // R
    {".####", "#....", "#....", ".###.", "....#", "....#", "####."},     // S
    {"#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."},     // T
    {"#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."},     // U
    {"#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."},     // V
    {"#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."},     // W
    {"#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"},     // X
    {"#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."},     // Y
    {"#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"},     // Z
    {".###.", ".#...", ".#...", ".#...", ".#...", ".#...", ".###."},     // [
    {".....", "#....", ".#...", "..#..", "...#.", "....#", "....."},     // backslash
    {".###.", "...#.", "...#.", "...#.", "...#.", "...#.", ".###."},     // ]
    {"..#..", ".#.#.", "#...#"},                                         // ^
    {".....", ".....", ".....", ".....", ".....", ".....", ".....", "#####"},  // _
    {".#...", "..#.."},                                                  // `
    {".....", ".....", ".###.", "....#", ".####", "#...#", ".####"},     // a
    {"#....", "#....", "####.", "#...#", "#...#", "#...#", "####."},     // b
    {".....", ".....", ".###.", "#....", "#....", "#...#", ".###."},     // c
    {"....#", "....#", ".####", "#...#", "#...#", "#...#", ".####"},     // d
    {".....", ".....", ".###.", "#...#", "#####", "#....", ".###."},     // e
    {"..##.", ".#..#", ".#...", "###..", ".#...", ".#...", ".#..."},     // f
    {".....", ".....", ".####", "#...#", "#...#", "#...#", ".####", "....#", ".###."},  // g
    {"#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#"},     // h
    {"..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###."},     // i
    {"...#.", ".....", "..##.", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."},  // j
    {"#....", "#....", "#..#.", "#.#..", "##...", "#.#..", "#..#."},     // k
    {".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."},     // l
    {".....", ".....", "##.#.", "#.#.#", "#.#.#", "#.#.#", "#.#.#"},     // m
    {".....", ".....", "#.##.", "##..#", "#...#", "#...#", "#...#"},     // n
    {".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."},     // o
    {".....", ".....", "####.", "#...#", "#...#", "#...#", "####.", "#....", "#...."},  // p
    {".....", ".....", ".####", "#...#", "#...#", "#...#", ".####", "....#", "....#"},  // q
    {".....", ".....", "#.##.", "##..#", "#....", "#....", "#...."},     // r
    {".....", ".....", ".####", "#....", ".###.", "....#", "####."},     // s
    {".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##."},     // t
    {".....", ".....", "#...#", "#...#", "#...#", "#..##", ".##.#"},     // u
    {".....", ".....", "#...#", "#...#", "#...#", ".#.#.", "..#.."},     // v
    {".....", ".....", "#...#", "#...#", "#.#.#", "#.#.#", ".#.#."},     // w
    {".....", ".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#"},     // x
    {".....", ".....", "#...#", "#...#", "#...#", "#...#", ".####", "....#", ".###."},  // y
    {".....", ".....", "#####", "...#.", "..#..", ".#...", "#####"},     // z
    {"...##", "..#..", "..#..", ".#...", "..#..", "..#..", "...##"},     // {
    {"..#..", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."},     // |
    {"##...", "..#..", "..#..", "...#.", "..#..", "..#..", "##..."},     // }
    {".....", ".....", ".#...", "#.#.#", "...#.", ".....", "....."},     // ~
};
// clang-format on

bool glyph_pixel(char ch, int col, int row) {
  const unsigned u = static_cast<unsigned char>(ch);
  const char* const* glyph = kFont[(u >= 32 && u <= 126 ? u : '?') - 32];
  return glyph[row] != nullptr && glyph[row][col] == '#';
}

int text_width(std::string_view text, int scale) {
  return text.empty() ? 0 : (static_cast<int>(text.size()) * kAdvance - 1) * scale;
}
int cap_height(int scale) { return kCapRows * scale; }

// Draws `text` with the top of its capitals at y, starting at x. With `upward`, the text is
// turned a quarter counter-clockwise to run bottom to top from (x, y), tops of letters to the left,
// which is how a y-axis label reads. `bold` widens every stroke by a pixel, eating into the gap
// between letters, to give a title more weight than a one-pixel design has at any scale.
void draw_text(Canvas& canvas, int x, int y, std::string_view text, int scale, Rgb color, bool upward = false,
               bool bold = false) {
  const int block_w = scale + (bold ? 1 : 0);
  for (size_t i = 0; i < text.size(); ++i) {
    for (int row = 0; row < kGlyphRows; ++row) {
      for (int col = 0; col < kGlyphCols; ++col) {
        if (!glyph_pixel(text[i], col, row)) continue;
        const int along = (static_cast<int>(i) * kAdvance + col) * scale, across = row * scale;
        for (int dy = 0; dy < scale; ++dy)
          for (int dx = 0; dx < block_w; ++dx) {
            if (upward)
              canvas.blend(x + across + dy, y - along - dx - 1, color);
            else
              canvas.blend(x + along + dx, y + across + dy, color);
          }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Axes

// How data values on one axis map to the plot. Ranges are kept in "units": the value itself on a
// linear axis, its log2 or log10 on a log axis, so that positions are linear in units.
struct Scale {
  bool log = false;
  AxisFormat format = AxisFormat::kNumber;
  double lo = 0, hi = 1;  // visible range, in units

  bool base2() const { return log && format == AxisFormat::kBytes; }
  bool accepts(double v) const { return std::isfinite(v) && (!log || v > 0); }
  double to_units(double v) const { return !log ? v : base2() ? std::log2(v) : std::log10(v); }
  double from_units(double u) const { return !log ? u : base2() ? std::exp2(u) : std::pow(10.0, u); }
  double fraction(double v) const { return (to_units(v) - lo) / (hi - lo); }
};

struct Ticks {
  std::vector<double> major;  // labelled, with a gridline
  std::vector<double> minor;  // faint gridline only
  std::vector<std::string> labels;
};

std::string trim_zeros(std::string s) {
  if (s.find('.') == std::string::npos) return s;
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

// "8B", "1K", "64M", "1.5G": binary units, as message sizes are swept.
std::string format_bytes(double v) {
  static constexpr char kUnits[] = "BKMGTPE";
  if (v == 0) return "0";
  int unit = 0;
  while (std::fabs(v) >= 1024 && unit < 6) v /= 1024, ++unit;
  return trim_zeros(fmt::format("{:.3f}", v)) + kUnits[unit];
}

// Enough decimals to tell ticks `step` apart; exponent form once plain digits get unwieldy.
std::string format_number(double v, double step) {
  const double a = std::fabs(v);
  if (a >= 1e9 || (a < 1e-4 && v != 0)) {
    const int e = static_cast<int>(std::floor(std::log10(a)));
    return fmt::format("{}e{}", trim_zeros(fmt::format("{:.2f}", v / std::pow(10.0, e))), e);
  }
  const int decimals = std::clamp(static_cast<int>(-std::floor(std::log10(step) + 1e-9)), 0, 9);
  return fmt::format("{:.{}f}", v, decimals);
}

// Evenly spaced round values in [lo, hi], at most max_count of them: steps of 1, 2 or 5 times a
// power of ten, or a power of two for byte counts so that the labels stay short (256M, 512M, ...).
std::vector<double> linear_ticks(double lo, double hi, int max_count, bool bytes, double* step_out) {
  // Start a notch below the step that surely fits and walk up the 1-2-5 (or power of two)
  // ladder until the actual count fits: guessing from span / count alone can leave a chart with
  // only three ticks where five fit.
  const double raw = (hi - lo) / max_count;
  const bool binary = bytes && raw >= 1;
  int exponent = static_cast<int>(std::floor(binary ? std::log2(raw) : std::log10(raw))), mantissa = 1;
  double step = 1;
  for (;;) {
    step = binary ? std::exp2(exponent) : mantissa * std::pow(10.0, exponent);
    const double count = std::floor(hi / step + 1e-9) - std::ceil(lo / step - 1e-9) + 1;
    if (count <= max_count) break;
    if (binary || mantissa == 5)
      ++exponent, mantissa = 1;
    else
      mantissa = mantissa == 1 ? 2 : 5;
  }
  std::vector<double> ticks;
  const double first = std::ceil(lo / step - 1e-9), last = std::floor(hi / step + 1e-9);
  for (double i = first; i <= last; ++i) ticks.push_back(i == 0 ? 0.0 : i * step);
  if (step_out) *step_out = step;
  return ticks;
}

bool in_range(double u, double lo, double hi) { return u >= lo - 1e-9 && u <= hi + 1e-9; }

Ticks make_ticks(const Scale& s, int max_count) {
  max_count = std::max(max_count, 2);
  Ticks t;
  const bool bytes = s.format == AxisFormat::kBytes;
  // Whole powers of the log base in view; on a log axis units are exponents, so these fit an int.
  const int first = s.log ? static_cast<int>(std::ceil(s.lo - 1e-9)) : 0;
  const int last = s.log ? static_cast<int>(std::floor(s.hi + 1e-9)) : -1;
  const int powers = last - first + 1;
  if (s.log && s.base2() && powers >= 2) {
    // Every k-th power of two, k chosen so labels fit; aligned to multiples of k so the
    // labels fall on familiar sizes (8B, 64B, 512B, 4K, ... for k = 3).
    int stride = 1;
    for (int k : {1, 2, 3, 4, 5, 10, 20}) {
      stride = k;
      int count = 0;
      for (int e = first; e <= last; ++e) count += (e % k == 0);
      if (count <= max_count) break;
    }
    for (int e = first; e <= last; ++e) (e % stride == 0 ? t.major : t.minor).push_back(std::exp2(e));
  } else if (s.log && !s.base2() && powers >= 2) {
    int stride = 1;
    while ((powers + stride - 1) / stride > max_count) ++stride;
    // Across one or two decades, 1-2-5 ticks say more than two lone powers of ten.
    const bool fine = powers <= 2 && 3 * powers + 1 <= max_count;
    for (int e = first - 1; e <= last; ++e) {
      for (int m = 1; m <= 9; ++m) {
        const double v = m * std::pow(10.0, e);
        if (!in_range(std::log10(v), s.lo, s.hi)) continue;
        const bool is_major = m == 1 ? ((e % stride) + stride) % stride == 0 : fine && (m == 2 || m == 5);
        if (is_major)
          t.major.push_back(v);
        else if (stride == 1)
          t.minor.push_back(v);
      }
    }
  } else {
    // A linear axis, or a log axis spanning less than two powers of its base: plain round
    // values read best, placed logarithmically on a log axis.
    double step = 1;
    const double lo = s.from_units(s.lo), hi = s.from_units(s.hi);
    for (double v : linear_ticks(lo, hi, max_count, bytes, &step))
      if (s.accepts(v) && in_range(s.to_units(v), s.lo, s.hi)) t.major.push_back(v);
    for (double v : t.major) t.labels.push_back(bytes ? format_bytes(v) : format_number(v, step));
    return t;
  }
  for (double v : t.major) {
    const double own_step = std::pow(10.0, std::floor(std::log10(v) + 1e-9));
    t.labels.push_back(bytes ? format_bytes(v) : format_number(v, own_step));
  }
  return t;
}

// Pads the data range [lo, hi] (in units) so markers at the extremes sit inside the frame, and
// gives a single value or a constant series a range to sit in the middle of.
void set_range(Scale& s, double lo, double hi, bool from_zero) {
  if (hi - lo <= 1e-12 * std::max(std::fabs(lo), std::fabs(hi))) {
    const double pad = s.log ? 0.5 : lo != 0 ? std::fabs(lo) * 0.1 : 1.0;
    lo -= pad, hi += pad;
  } else {
    const double pad = (hi - lo) * 0.05;
    lo -= pad, hi += pad;
  }
  if (!s.log && from_zero) lo = std::min(lo, 0.0), hi = std::max(hi, 0.0);
  s.lo = lo, s.hi = hi;
}

// ---------------------------------------------------------------------------------------------
// Layout and drawing

constexpr int kTextScale = 2;   // tick labels, axis labels, legend: 10x14 px capitals
constexpr int kTitleScale = 3;  // title: 15x21 px capitals
constexpr int kMargin = 18;     // blank border around everything
constexpr int kTickLength = 5;
constexpr double kLineWidthPx = 2.5;

struct Point {
  double x, y;
};

struct Layout {
  int left, top, right, bottom;  // plot frame, half-open
  Ticks x_ticks, y_ticks;
  double px(const Scale& s, double v) const { return left + s.fraction(v) * (right - left); }
  double py(const Scale& s, double v) const { return bottom - s.fraction(v) * (bottom - top); }
};

int max_label_width(const Ticks& t) {
  int w = 0;
  for (const std::string& l : t.labels) w = std::max(w, text_width(l, kTextScale));
  return w;
}

// Whether neighbouring tick labels keep clear of each other. Checked on actual positions, since
// on a log axis showing plain values (200, 300, ... 800) the labels crowd at one end.
bool labels_fit(const Ticks& t, const Scale& s, double px0, double px1, bool horizontal) {
  for (size_t i = 1; i < t.major.size(); ++i) {
    const double gap = std::fabs(s.fraction(t.major[i]) - s.fraction(t.major[i - 1])) * std::fabs(px1 - px0);
    const double need =
        horizontal
            ? (text_width(t.labels[i], kTextScale) + text_width(t.labels[i - 1], kTextScale)) / 2.0 + 24
            : cap_height(kTextScale) + 16;
    if (gap < need) return false;
  }
  return true;
}

// The most ticks, up to one per `spacing` pixels, whose labels fit along `length` pixels.
Ticks fitted_ticks(const Scale& s, int length, int spacing, bool horizontal) {
  for (int count = std::max(length / spacing, 2);; --count) {
    Ticks t = make_ticks(s, count);
    if (count <= 2 || labels_fit(t, s, 0, length, horizontal)) return t;
  }
}

// Places the plot frame inside the image, leaving room for the title, axis labels, tick labels
// and (when `reserve_right` > 0) a legend to the right of the plot.
Layout make_layout(const Chart& chart, const Scale& xs, const Scale& ys, int width, int height,
                   int reserve_right) {
  Layout l;
  const int text_h = cap_height(kTextScale), descent = 2 * kTextScale;
  l.top = kMargin + (chart.title.empty() ? text_h / 2 : cap_height(kTitleScale) + 2 * kTitleScale + 14);
  l.bottom = height - kMargin - (chart.x_label.empty() ? 0 : text_h + descent + 10) - text_h - descent -
             kTickLength - 6;
  l.y_ticks = fitted_ticks(ys, l.bottom - l.top, 70, /*horizontal=*/false);
  l.left = kMargin + (chart.y_label.empty() ? 0 : text_h + descent + 12) + max_label_width(l.y_ticks) + 8 +
           kTickLength;
  // The right edge depends on how far the last x label overhangs the frame, which depends on
  // the ticks, which depend on the width: two rounds settle it.
  int overhang = 0;
  for (int round = 0; round < 2; ++round) {
    l.right = width - kMargin - std::max(reserve_right, overhang + 4);
    l.x_ticks = fitted_ticks(xs, l.right - l.left, 60, /*horizontal=*/true);
    overhang = 0;
    for (size_t i = 0; i < l.x_ticks.major.size(); ++i) {
      const double x = l.px(xs, l.x_ticks.major[i]) + text_width(l.x_ticks.labels[i], kTextScale) / 2.0;
      overhang = std::max(overhang, static_cast<int>(std::ceil(x)) - l.right);
    }
  }
  return l;
}

// The runs of consecutive drawable points of a series, in pixels. A point that cannot be drawn
// ends a run: bridging it would show data that was never measured.
std::vector<std::vector<Point>> series_runs(const Series& s, const Scale& xs, const Scale& ys,
                                            const Layout& l) {
  std::vector<std::vector<Point>> runs(1);
  for (size_t i = 0; i < s.x.size(); ++i) {
    if (xs.accepts(s.x[i]) && ys.accepts(s.y[i])) {
      runs.back().push_back({l.px(xs, s.x[i]), l.py(ys, s.y[i])});
    } else if (!runs.back().empty()) {
      runs.emplace_back();
    }
  }
  if (runs.back().empty()) runs.pop_back();
  return runs;
}

// Marker radius for the chart: full size when points are well apart horizontally, smaller as
// they crowd, none when they would merge into a thick line anyway. Decided once for all series
// so that every curve of a sweep is drawn alike.
double marker_radius(const std::vector<std::vector<std::vector<Point>>>& all_runs) {
  std::vector<double> gaps;  // between horizontal neighbours, leaving out repeated x
  for (const auto& runs : all_runs)
    for (const auto& run : runs)
      for (size_t i = 1; i < run.size(); ++i) {
        const double gap = std::fabs(run[i].x - run[i - 1].x);
        if (gap >= 0.5) gaps.push_back(gap);
      }
  if (gaps.empty()) return 4.0;
  std::nth_element(gaps.begin(), gaps.begin() + gaps.size() / 2, gaps.end());
  const double median = gaps[gaps.size() / 2];
  return median >= 14 ? 4.0 : median >= 7 ? 3.0 : 0.0;
}

struct Box {
  int x0, y0, x1, y1;
  bool contains(Point p, int slack) const {
    return p.x >= x0 - slack && p.x < x1 + slack && p.y >= y0 - slack && p.y < y1 + slack;
  }
};

struct Legend {
  std::vector<int> entries;  // series indices with a label
  int width = 0, height = 0;
  static constexpr int kPad = 10, kRow = 24, kSwatch = 30;
};

Legend make_legend(const Chart& chart) {
  Legend g;
  int label_w = 0;
  for (size_t i = 0; i < chart.series.size(); ++i) {
    if (chart.series[i].label.empty()) continue;
    g.entries.push_back(static_cast<int>(i));
    label_w = std::max(label_w, text_width(chart.series[i].label, kTextScale));
  }
  if (g.entries.empty()) return g;
  g.width = 2 * Legend::kPad + Legend::kSwatch + 10 + label_w;
  g.height = 2 * Legend::kPad + static_cast<int>(g.entries.size()) * Legend::kRow -
             (Legend::kRow - cap_height(kTextScale));
  return g;
}

// Points every few pixels along all curves, for finding where a legend hides the least.
std::vector<Point> curve_samples(const std::vector<std::vector<std::vector<Point>>>& all_runs) {
  std::vector<Point> out;
  for (const auto& runs : all_runs)
    for (const auto& run : runs) {
      for (size_t i = 0; i < run.size(); ++i) {
        out.push_back(run[i]);
        if (i == 0) continue;
        const double dx = run[i].x - run[i - 1].x, dy = run[i].y - run[i - 1].y;
        const int steps = static_cast<int>(std::hypot(dx, dy) / 3);
        for (int k = 1; k < steps; ++k)
          out.push_back({run[i - 1].x + dx * k / steps, run[i - 1].y + dy * k / steps});
      }
    }
  return out;
}

// The inside spot for the legend covering the fewest curve samples, preferring the corners in
// matplotlib's order when several are free. Returns the count it covers through `hidden`.
Box place_legend_inside(const Legend& g, const Layout& l, const std::vector<Point>& samples, int* hidden) {
  const int inset = 12;
  const int xl = l.left + inset, xr = l.right - inset - g.width, xc = (l.left + l.right - g.width) / 2;
  const int yt = l.top + inset, yb = l.bottom - inset - g.height, yc = (l.top + l.bottom - g.height) / 2;
  const int spots[][2] = {{xl, yt}, {xr, yt}, {xl, yb}, {xr, yb}, {xc, yt}, {xc, yb}, {xl, yc}, {xr, yc}};
  Box best{};
  *hidden = -1;
  for (const auto& [x, y] : spots) {
    const Box b{x, y, x + g.width, y + g.height};
    int n = 0;
    for (const Point& p : samples) n += b.contains(p, 6);
    if (*hidden < 0 || n < *hidden) best = b, *hidden = n;
  }
  return best;
}

// Each entry repeats its curve's look (line, and marker when the curves have them) and label.
void draw_legend(Canvas& canvas, const Chart& chart, const Legend& g, const Box& b, double marker_radius) {
  canvas.fill_rect(b.x0, b.y0, b.x1, b.y1, kBackground, 0.92f);
  canvas.outline_rect(b.x0, b.y0, b.x1, b.y1, kLegendBorder);
  for (size_t k = 0; k < g.entries.size(); ++k) {
    const int i = g.entries[k];
    const Rgb color = kPalette[i % kPaletteSize];
    const int top = b.y0 + Legend::kPad + static_cast<int>(k) * Legend::kRow;
    const double mid = top + cap_height(kTextScale) / 2.0;
    const int x = b.x0 + Legend::kPad;
    Coverage swatch(x - 2, top - 6, x + Legend::kSwatch + 2, top + cap_height(kTextScale) + 6);
    swatch.segment(x + 1, mid, x + Legend::kSwatch - 1, mid, kLineWidthPx);
    if (marker_radius > 0) swatch.disc(x + Legend::kSwatch / 2.0, mid, marker_radius);
    swatch.paint(canvas, color);
    draw_text(canvas, x + Legend::kSwatch + 10, top, chart.series[i].label, kTextScale, kInk);
  }
}

Canvas render(const Chart& chart, const std::string& path, int width, int height) {
  Scale xs{chart.log_x, chart.x_format}, ys{chart.log_y, chart.y_format};
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = -INFINITY;
  for (const Series& s : chart.series) {
    if (s.x.size() != s.y.size())
      fail("plot '{}': series '{}' has {} x values but {} y values", path, s.label, s.x.size(), s.y.size());
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!xs.accepts(s.x[i]) || !ys.accepts(s.y[i])) continue;
      const double xu = xs.to_units(s.x[i]), yu = ys.to_units(s.y[i]);
      x_lo = std::min(x_lo, xu), x_hi = std::max(x_hi, xu);
      y_lo = std::min(y_lo, yu), y_hi = std::max(y_hi, yu);
    }
  }
  if (!(x_lo <= x_hi))
    fail("plot '{}': no finite{} points to draw", path, chart.log_x || chart.log_y ? ", positive" : "");
  set_range(xs, x_lo, x_hi, false);
  set_range(ys, y_lo, y_hi, chart.y_from_zero);
  if (!std::isfinite(xs.hi - xs.lo) || !std::isfinite(ys.hi - ys.lo))
    fail("plot '{}': values too large to draw", path);

  // Lay out with the legend inside the plot; if every inside spot would hide part of a curve,
  // give the legend its own column to the right instead.
  const Legend legend = make_legend(chart);
  Layout l = make_layout(chart, xs, ys, width, height, 0);
  std::vector<std::vector<std::vector<Point>>> runs;
  for (const Series& s : chart.series) runs.push_back(series_runs(s, xs, ys, l));
  Box legend_box{};
  if (!legend.entries.empty()) {
    int hidden = 0;
    legend_box = place_legend_inside(legend, l, curve_samples(runs), &hidden);
    if (hidden > 0) {
      l = make_layout(chart, xs, ys, width, height, legend.width + 14);
      runs.clear();
      for (const Series& s : chart.series) runs.push_back(series_runs(s, xs, ys, l));
      legend_box = {l.right + 14, l.top, l.right + 14 + legend.width, l.top + legend.height};
    }
  }

  Canvas canvas(width, height);
  const int text_h = cap_height(kTextScale);

  // Gridlines, minor under major.
  auto vline = [&](double v, Rgb c) {
    const int x = static_cast<int>(std::lround(l.px(xs, v)));
    canvas.fill_rect(x, l.top, x + 1, l.bottom, c);
  };
  auto hline = [&](double v, Rgb c) {
    const int y = static_cast<int>(std::lround(l.py(ys, v)));
    canvas.fill_rect(l.left, y, l.right, y + 1, c);
  };
  for (double v : l.x_ticks.minor) vline(v, kMinorGrid);
  for (double v : l.y_ticks.minor) hline(v, kMinorGrid);
  for (double v : l.x_ticks.major) vline(v, kGrid);
  for (double v : l.y_ticks.major) hline(v, kGrid);

  // Curves, each clipped a little outside the frame so markers at the very edge stay round.
  const double radius = marker_radius(runs);
  for (size_t i = 0; i < chart.series.size(); ++i) {
    Coverage cov(l.left - 5, l.top - 5, l.right + 6, l.bottom + 6);
    for (const auto& run : runs[i]) {
      for (size_t k = 1; k < run.size(); ++k)
        cov.segment(run[k - 1].x, run[k - 1].y, run[k].x, run[k].y, kLineWidthPx);
      // A lone point has no line to show it, so it always gets a marker.
      for (const Point& p : run)
        if (radius > 0 || run.size() == 1) cov.disc(p.x, p.y, std::max(radius, 3.0));
    }
    cov.paint(canvas, kPalette[i % kPaletteSize]);
  }

  // Frame, tick marks and tick labels.
  canvas.outline_rect(l.left - 1, l.top - 1, l.right + 1, l.bottom + 1, kFrame);
  for (size_t k = 0; k < l.x_ticks.major.size(); ++k) {
    const int x = static_cast<int>(std::lround(l.px(xs, l.x_ticks.major[k])));
    canvas.fill_rect(x, l.bottom + 1, x + 1, l.bottom + 1 + kTickLength, kFrame);
    const std::string& label = l.x_ticks.labels[k];
    draw_text(canvas, x - text_width(label, kTextScale) / 2, l.bottom + kTickLength + 7, label, kTextScale,
              kInk);
  }
  for (size_t k = 0; k < l.y_ticks.major.size(); ++k) {
    const int y = static_cast<int>(std::lround(l.py(ys, l.y_ticks.major[k])));
    canvas.fill_rect(l.left - 1 - kTickLength, y, l.left - 1, y + 1, kFrame);
    const std::string& label = l.y_ticks.labels[k];
    draw_text(canvas, l.left - kTickLength - 8 - text_width(label, kTextScale), y - text_h / 2, label,
              kTextScale, kInk);
  }

  // Axis labels and title, centered on the plot frame.
  const int mid_x = (l.left + l.right) / 2, mid_y = (l.top + l.bottom) / 2;
  if (!chart.x_label.empty())
    draw_text(canvas, mid_x - text_width(chart.x_label, kTextScale) / 2,
              height - kMargin - text_h - 2 * kTextScale, chart.x_label, kTextScale, kInk);
  if (!chart.y_label.empty())
    draw_text(canvas, kMargin, mid_y + text_width(chart.y_label, kTextScale) / 2, chart.y_label, kTextScale,
              kInk, /*upward=*/true);
  if (!chart.title.empty()) {
    // Shrink a title too long for the image rather than cut it off.
    const int scale = text_width(chart.title, kTitleScale) <= width - 2 * kMargin ? kTitleScale : kTextScale;
    const int tx = std::clamp(mid_x - text_width(chart.title, scale) / 2, kMargin,
                              std::max(kMargin, width - kMargin - text_width(chart.title, scale)));
    draw_text(canvas, tx, kMargin, chart.title, scale, kInk, /*upward=*/false, /*bold=*/true);
  }

  if (!legend.entries.empty()) draw_legend(canvas, chart, legend, legend_box, radius);
  return canvas;
}

// Encodes to a temporary file beside `path` and renames it into place: readers never see a
// half-written PNG, and a failure leaves whatever was at `path` before untouched.
void write_atomically(const Canvas& canvas, const std::string& path) {
  static std::atomic<unsigned> counter{0};
  const std::string tmp = fmt::format("{}.tmp.{}.{}", path, ::getpid(), counter++);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) fail("cannot write plot '{}': {}", path, std::strerror(errno));
  FILE* file = ::fdopen(fd, "wb");
  if (file == nullptr) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    fail("cannot write plot '{}': {}", path, std::strerror(err));
  }

  std::string error;
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(canvas.width());
  image.height = static_cast<png_uint_32>(canvas.height());
  image.format = PNG_FORMAT_RGB;
  if (!png_image_write_to_stdio(&image, file, 0, canvas.data(), 0, nullptr))
    error = fmt::format("libpng: {}", image.message);
  png_image_free(&image);
  if (error.empty() && std::fflush(file) != 0) error = std::strerror(errno);
  if (std::fclose(file) != 0 && error.empty()) error = std::strerror(errno);
  if (error.empty() && std::rename(tmp.c_str(), path.c_str()) != 0) error = std::strerror(errno);
  if (!error.empty()) {
    ::unlink(tmp.c_str());
    fail("cannot write plot '{}': {}", path, error);
  }
}

}  // namespace

void write_png(const Chart& chart, const std::string& path, int width, int height) {
  // Below this the labels no longer fit; above it the buffer gets silly.
  if (width < 320 || height < 240 || width > 16384 || height > 16384)
    fail("plot '{}': size {}x{} is outside 320x240 .. 16384x16384", path, width, height);
  write_atomically(render(chart, path, width, height), path);
}

}  // namespace keel::plot
