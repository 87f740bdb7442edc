#include "common/units.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/error.h"

namespace keel {

TEST(ParseSize, AcceptsBinarySuffixes) {
  EXPECT_EQ(parse_size("8"), 8u);
  EXPECT_EQ(parse_size("1K"), 1024u);
  EXPECT_EQ(parse_size("64M"), 64ull << 20);
  EXPECT_EQ(parse_size("8G"), 8ull << 30);
  EXPECT_EQ(parse_size("2GiB"), 2ull << 30);
  EXPECT_EQ(parse_size("16B"), 16u);
  EXPECT_EQ(parse_size("1t"), 1ull << 40);
}

TEST(ParseSize, RejectsGarbageZeroAndOverflow) {
  EXPECT_THROW(parse_size(""), Error);
  EXPECT_THROW(parse_size("abc"), Error);
  EXPECT_THROW(parse_size("12X"), Error);
  EXPECT_THROW(parse_size("0"), Error);
  EXPECT_THROW(parse_size("-4"), Error);
  EXPECT_THROW(parse_size("99999999999999T"), Error);
  try {
    parse_size("5Q", "--min");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--min"), std::string::npos);
  }
}

TEST(FormatSize, ExactAndFractional) {
  EXPECT_EQ(format_size(8), "8 B");
  EXPECT_EQ(format_size(1024), "1 KiB");
  EXPECT_EQ(format_size(64ull << 20), "64 MiB");
  EXPECT_EQ(format_size(8ull << 30), "8 GiB");
  EXPECT_EQ(format_size(1536), "1536 B");
}

TEST(GeometricSizes, SweepsInclusive) {
  auto s = geometric_sizes(8, 64, 2);
  EXPECT_EQ(s, (std::vector<std::uint64_t>{8, 16, 32, 64}));
  EXPECT_EQ(geometric_sizes(1024, 1024, 2), (std::vector<std::uint64_t>{1024}));
  EXPECT_EQ(geometric_sizes(8, 100, 4), (std::vector<std::uint64_t>{8, 32}));
  EXPECT_THROW(geometric_sizes(64, 8, 2), Error);
  EXPECT_THROW(geometric_sizes(8, 64, 1.0), Error);
}

TEST(GeometricSizes, NonIntegerFactorsRoundToWholeBytes) {
  EXPECT_EQ(geometric_sizes(8, 64, 1.5), (std::vector<std::uint64_t>{8, 12, 18, 27, 41, 61}));
}

// -e 16000000T once rounded past 2^63 (which stayed <= max) and looped forever.
TEST(GeometricSizes, HugeMaxIsAnErrorNotAHang) {
  EXPECT_THROW(geometric_sizes(8, 16000000ull << 40, 2), Error);
  EXPECT_THROW(geometric_sizes(8, UINT64_MAX, 2), Error);
  EXPECT_THROW(geometric_sizes(8, kMaxSweepBytes + 1, 2), Error);
  const auto s = geometric_sizes(8, kMaxSweepBytes, 2);
  EXPECT_EQ(s.size(), 48u);
  EXPECT_EQ(s.back(), kMaxSweepBytes);
}

// -f inf once measured --min alone and exited 0.
TEST(GeometricSizes, FactorMustBeFiniteAndGrowTheSize) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_THROW(geometric_sizes(8, 64, inf), Error);
  EXPECT_THROW(geometric_sizes(8, 8, inf), Error);
  EXPECT_THROW(geometric_sizes(8, 64, std::nan("")), Error);
  // A factor this close to 1 would ask for ~2e8 sizes (and none grows once s is large).
  EXPECT_THROW(geometric_sizes(8, 1ull << 40, 1.0000001), Error);
  EXPECT_THROW(geometric_sizes(1ull << 40, 1ull << 41, std::nextafter(1.0, 2.0)), Error);
}

TEST(IntList, ParsesAndRejects) {
  EXPECT_EQ(parse_int_list("2,4,8", "--ranks"), (std::vector<int>{2, 4, 8}));
  EXPECT_EQ(parse_int_list(" 2 , 4 ", "--ranks"), (std::vector<int>{2, 4}));
  EXPECT_THROW(parse_int_list("2,x", "--ranks"), Error);
  EXPECT_THROW(parse_int_list("0", "--ranks"), Error);
  EXPECT_THROW(parse_int_list("", "--ranks"), Error);
}

}  // namespace keel
