// common/host.h on the machine running the tests (Linux: /proc and sysconf are there).
#include "common/host.h"

#include <gtest/gtest.h>

#include <string>

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

TEST(Host, HostIsNamed) {
  const std::string name = host_name();
  EXPECT_FALSE(name.empty());
  EXPECT_EQ(name, host_name()) << "the same name on every call";
}

}  // namespace
}  // namespace keel
