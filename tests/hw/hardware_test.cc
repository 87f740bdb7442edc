#include "hw/hardware.h"

#include <gtest/gtest.h>

namespace keel::hw {

TEST(Hardware, FindsProfilesByKeyAndDeviceName) {
  ASSERT_NE(find_profile("H200"), nullptr);
  EXPECT_EQ(find_profile("h100-sxm")->sm_count, 132);
  EXPECT_EQ(find_profile("mi300x")->sm_count, 304);
  EXPECT_EQ(find_profile("tpu"), nullptr);
  EXPECT_EQ(match_device_name("NVIDIA H200")->name, "h200");
  EXPECT_EQ(match_device_name("NVIDIA H100 80GB HBM3")->name, "h100");
  EXPECT_EQ(match_device_name("AMD Instinct MI325X")->name, "mi325x");
  EXPECT_EQ(match_device_name("NVIDIA GeForce RTX 4090"), nullptr);
}

TEST(Hardware, ProfilesAreComplete) {
  for (const auto& p : builtin_profiles()) {
    SCOPED_TRACE(p.name);
    EXPECT_GT(p.bf16_tflops, 0);
    EXPECT_GT(p.hbm_tbps, 0);
    EXPECT_GT(p.hbm_gib, 0);
    EXPECT_GT(p.sm_count, 0);
    EXPECT_GT(p.link_gbps, 0);
    EXPECT_GE(p.fp16_tflops, p.bf16_tflops);
  }
}

}  // namespace keel::hw
