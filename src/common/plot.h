// Line charts as PNG files, so a benchmark sweep (busbw against message size, TFLOP/s against
// matrix size, ...) can be looked at rather than read as a table. Self-contained apart from
// libpng: own raster, own anti-aliased lines, own bitmap font.
#pragma once

#include <string>
#include <vector>

namespace keel::plot {

// One curve. Points are drawn in the order given and joined by a line; a point that cannot be
// placed (non-finite, or non-positive on a log axis) breaks the line instead of being bridged.
struct Series {
  std::string label;  // shown in the legend; empty leaves the series out of it
  std::vector<double> x, y;
};

enum class AxisFormat { kNumber, kBytes };  // kBytes: tick labels like 8B, 1K, 64M, 8G (binary units)

struct Chart {
  std::string title, x_label, y_label;
  bool log_x = false, log_y = false;  // log2 ticks for kBytes axes, log10 decades otherwise
  AxisFormat x_format = AxisFormat::kNumber;
  std::vector<Series> series;
  // Optional extras.
  AxisFormat y_format = AxisFormat::kNumber;
  bool y_from_zero = false;  // linear y only: start the axis at 0 so heights compare honestly
};

// Renders and writes an RGB PNG (series colored from a colorblind-friendly palette, in order).
// Throws keel::Error with a one-line message naming the path on any I/O or libpng failure, on a
// chart with no finite points, and on a series whose x and y differ in length. The file is
// written next to `path` and renamed into place, so a failure never leaves a truncated PNG.
void write_png(const Chart& chart, const std::string& path, int width = 1100, int height = 680);

}  // namespace keel::plot
