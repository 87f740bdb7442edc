// common/host.h on the machine running the tests (Linux: /proc and sysconf are there).
#include "common/host.h"

#include <gtest/gtest.h>

namespace keel {
namespace {

TEST(Host, MemoryFiguresAreConsistent) {
  const std::uint64_t physical = host_physical_bytes();
  ASSERT_GT(physical, 64ull << 20);
  const auto available = host_mem_available_bytes();
  ASSERT_TRUE(available.has_value()) << "no MemAvailable in /proc/meminfo";
  EXPECT_GT(*available, 0u);
  EXPECT_LE(*available, physical);
  EXPECT_GT(host_available_bytes(), 0u);  // MemAvailable again (it moves between reads)
}

TEST(Host, CpuModelIsNamed) { EXPECT_FALSE(host_cpu_model().empty()); }

}  // namespace
}  // namespace keel
