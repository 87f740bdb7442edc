#include "common/units.h"

#include <gtest/gtest.h>

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

TEST(IntList, ParsesAndRejects) {
  EXPECT_EQ(parse_int_list("2,4,8", "--ranks"), (std::vector<int>{2, 4, 8}));
  EXPECT_EQ(parse_int_list(" 2 , 4 ", "--ranks"), (std::vector<int>{2, 4}));
  EXPECT_THROW(parse_int_list("2,x", "--ranks"), Error);
  EXPECT_THROW(parse_int_list("0", "--ranks"), Error);
  EXPECT_THROW(parse_int_list("", "--ranks"), Error);
}

}  // namespace keel
