#include "common/plot.h"

#include <gtest/gtest.h>
#include <png.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "common/error.h"

namespace keel::plot {
namespace {

namespace fs = std::filesystem;

struct Rgb {
  std::uint8_t r, g, b;
};

// The palette's first three entries (Okabe-Ito blue, vermillion, bluish green): series 0, 1, 2.
constexpr Rgb kSeriesColors[] = {{0, 114, 178}, {213, 94, 0}, {0, 158, 115}};

struct Image {
  int width = 0, height = 0;
  std::vector<std::uint8_t> rgb;

  bool is(int x, int y, Rgb c) const {
    const std::uint8_t* p = &rgb[(static_cast<size_t>(y) * width + x) * 3];
    return p[0] == c.r && p[1] == c.g && p[2] == c.b;
  }
  // Columns holding at least one pixel of exactly `c`. A curve drawn across the plot fills most
  // columns; markers alone or a legend swatch fill only a few, so this tells lines were drawn.
  int columns_with(Rgb c) const {
    int n = 0;
    for (int x = 0; x < width; ++x)
      for (int y = 0; y < height; ++y)
        if (is(x, y, c)) {
          ++n;
          break;
        }
    return n;
  }
  double fraction_of(Rgb c) const {
    size_t n = 0;
    for (int y = 0; y < height; ++y)
      for (int x = 0; x < width; ++x) n += is(x, y, c);
    return static_cast<double>(n) / (static_cast<double>(width) * height);
  }
};

// Decodes with libpng independently of the writer, as any viewer would.
Image decode(const std::string& path) {
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  Image out;
  if (!png_image_begin_read_from_file(&image, path.c_str())) {
    ADD_FAILURE() << "libpng cannot read " << path << ": " << image.message;
    return out;
  }
  image.format = PNG_FORMAT_RGB;
  out.width = static_cast<int>(image.width);
  out.height = static_cast<int>(image.height);
  out.rgb.resize(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, out.rgb.data(), 0, nullptr)) {
    ADD_FAILURE() << "libpng cannot decode " << path << ": " << image.message;
    png_image_free(&image);
    return Image{};
  }
  return out;
}

class PlotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "keel_plot_test.XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    return names;
  }

  fs::path dir_;
};

// Three busbw-like curves over 8B..1G, kept apart vertically so none hides another.
Chart busbw_chart() {
  Chart c;
  c.title = "all_reduce busbw";
  c.x_label = "message size";
  c.y_label = "busbw (GB/s)";
  c.log_x = true;
  c.x_format = AxisFormat::kBytes;
  for (int k = 0; k < 3; ++k) {
    Series s;
    s.label = std::to_string(2 << k) + " GPUs";
    for (double bytes = 8; bytes <= (1 << 30); bytes *= 2) {
      s.x.push_back(bytes);
      s.y.push_back(30.0 * (k + 1) + 100.0 * (k + 1) * bytes / (bytes + 65536));
    }
    c.series.push_back(s);
  }
  return c;
}

TEST_F(PlotTest, WritesPngWithEveryCurveDrawn) {
  const std::string file = path("busbw.png");
  write_png(busbw_chart(), file, 900, 600);

  std::ifstream in(file, std::ios::binary);
  char signature[8] = {};
  in.read(signature, 8);
  ASSERT_TRUE(in.good());
  EXPECT_EQ(std::memcmp(signature, "\x89PNG\r\n\x1a\n", 8), 0);

  const Image image = decode(file);
  ASSERT_EQ(image.width, 900);
  ASSERT_EQ(image.height, 600);
  EXPECT_GT(image.fraction_of({255, 255, 255}), 0.6) << "background should be mostly white";
  for (int k = 0; k < 3; ++k) {
    const Rgb c = kSeriesColors[k];
    EXPECT_GT(image.columns_with(c), image.width / 2) << "series " << k << " line is missing";
  }
}

TEST_F(PlotTest, DefaultSizeAndEdgeCasesRender) {
  // A single point, a constant series, and points a log axis cannot place: all must render.
  Chart c;
  c.log_y = true;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  c.series.push_back({"one point", {5}, {7}});
  c.series.push_back({"", {1, 2, 3, 4, 5, 6, 7, 8}, {3, 3, 3, -1, 3, 3, nan, 3}});
  const std::string file = path("edge.png");
  write_png(c, file);
  const Image image = decode(file);
  EXPECT_EQ(image.width, 1100);
  EXPECT_EQ(image.height, 680);
  EXPECT_GT(image.columns_with(kSeriesColors[0]), 0) << "the lone point needs a marker";
  EXPECT_GT(image.columns_with(kSeriesColors[1]), image.width / 4) << "the constant series needs a line";

  // Everything at one x and one y, on bytes axes, with no labels at all.
  Chart flat;
  flat.log_x = true;
  flat.x_format = AxisFormat::kBytes;
  flat.series.push_back({"", {4096, 4096}, {0, 0}});
  EXPECT_NO_THROW(write_png(flat, path("flat.png"), 320, 240));
}

TEST_F(PlotTest, NoFinitePointsThrows) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Chart nonfinite;
  nonfinite.series.push_back({"a", {1, nan, inf}, {nan, 2, 3}});
  Chart empty;
  Chart nonpositive;  // finite, but nothing a log axis can place
  nonpositive.log_x = true;
  nonpositive.series.push_back({"a", {0, -1}, {1, 2}});
  for (const Chart* c : {&nonfinite, &empty, &nonpositive}) {
    const std::string file = path("none.png");
    try {
      write_png(*c, file);
      ADD_FAILURE() << "expected keel::Error";
    } catch (const keel::Error& e) {
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(entries().empty()) << "nothing should be written";
}

TEST_F(PlotTest, MismatchedSeriesThrows) {
  Chart c;
  c.series.push_back({"a", {1, 2, 3}, {1, 2}});
  EXPECT_THROW(write_png(c, path("bad.png")), keel::Error);
}

TEST_F(PlotTest, UnwritablePathThrowsNamingIt) {
  const std::string file = "/nonexistent-dir/x.png";
  try {
    write_png(busbw_chart(), file);
    FAIL() << "expected keel::Error";
  } catch (const keel::Error& e) {
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
  }
}

TEST_F(PlotTest, FailedWriteLeavesNoTemporaryFile) {
  // Renaming a file onto a directory fails after the PNG has been encoded.
  const std::string target = path("a-directory");
  fs::create_directory(target);
  EXPECT_THROW(write_png(busbw_chart(), target), keel::Error);
  EXPECT_EQ(entries(), std::vector<std::string>{"a-directory"});
}

TEST_F(PlotTest, OverwritesAnExistingFile) {
  const std::string file = path("again.png");
  { std::ofstream(file) << "not a png"; }
  write_png(busbw_chart(), file, 400, 300);
  const Image image = decode(file);
  EXPECT_EQ(image.width, 400);
  EXPECT_EQ(entries(), std::vector<std::string>{"again.png"});
}

}  // namespace
}  // namespace keel::plot
