#include "common/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/error.h"

namespace keel {

TEST(DType, ParseAndNames) {
  EXPECT_EQ(parse_dtype("bf16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("half"), DType::kFP16);
  EXPECT_EQ(parse_dtype("float32"), DType::kFP32);
  EXPECT_THROW(parse_dtype("int8"), Error);
  EXPECT_EQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_EQ(dtype_size(DType::kFP16), 2u);
}

TEST(DType, SmallIntegersRoundTripExactly) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const auto limit = dtype_exact_int_limit(t);
    for (std::int64_t v : {-limit, -limit + 1, -3l, -1l, 0l, 1l, 7l, limit - 1, limit}) {
      std::uint32_t buf = 0;
      store_from_float(&buf, 0, t, static_cast<float>(v));
      EXPECT_EQ(load_as_float(&buf, 0, t), static_cast<float>(v)) << dtype_name(t) << " " << v;
    }
  }
  // One past the exact range is not representable in the 16-bit types.
  std::uint16_t h = float_to_bf16_bits(257.f);
  EXPECT_NE(bf16_bits_to_float(h), 257.f);
  h = float_to_fp16_bits(2049.f);
  EXPECT_NE(fp16_bits_to_float(h), 2049.f);
}

TEST(DType, RoundingMatchesNearestEven) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1000.f, 1000.f);
  for (int i = 0; i < 10000; ++i) {
    const float x = dist(rng);
    const float b = bf16_bits_to_float(float_to_bf16_bits(x));
    EXPECT_LE(std::fabs(b - x), std::fabs(x) * (1.f / 256.f) + 1e-30f);
    const float h = fp16_bits_to_float(float_to_fp16_bits(x));
    EXPECT_LE(std::fabs(h - x), std::fabs(x) * (1.f / 2048.f) + 1e-7f);
  }
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(1e6f)), INFINITY);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(0xffff)));
  EXPECT_TRUE(std::isnan(fp16_bits_to_float(0xffff)));
}

}  // namespace keel
