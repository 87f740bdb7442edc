#include "common/watchdog.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <limits>
#include <thread>

#include "common/error.h"

namespace keel {
namespace {

// Arms a watchdog for `seconds`, waits a moment and exits 0 if it did not fire.
void arm_wait_and_exit(double seconds) {
  Watchdog dog;
  dog.arm("the test operation", seconds);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  dog.disarm();
  std::exit(0);
}

TEST(WatchdogDeathTest, FiresPastItsDeadline) {
  EXPECT_EXIT(arm_wait_and_exit(0.01), testing::ExitedWithCode(kExitTimeout), "did not finish within 0.01 s");
}

// A huge limit once overflowed the clock into a deadline in the past: a false hang at once.
TEST(WatchdogDeathTest, HugeOrInfiniteLimitsMeanNoDeadline) {
  for (double seconds : {1e9, 1e10, 1e300, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(seconds);
    EXPECT_EXIT(arm_wait_and_exit(seconds), testing::ExitedWithCode(0), "");
  }
}

// keel's --timeout 0 is no deadline in every command (keel train's meaning); armed as it is, it
// must not read as a deadline already past.
TEST(WatchdogDeathTest, ZeroMeansNoDeadline) {
  EXPECT_EXIT(arm_wait_and_exit(0), testing::ExitedWithCode(0), "");
}

TEST(TimeoutFlag, ZeroInfAndSecondsPassNegativeAndNaNAreOneLine) {
  for (double ok : {0.0, 0.5, 600.0, 1e300, std::numeric_limits<double>::infinity()})
    EXPECT_NO_THROW(check_timeout_flag(ok)) << ok;
  for (double bad : {-1.0, -std::numeric_limits<double>::infinity(), std::nan("")}) {
    try {
      check_timeout_flag(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("must be seconds >= 0 (0 or inf: no deadline)"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(kDefaultTimeoutSeconds, 600);
}

TEST(WatchdogDeathTest, RearmingWithNoDeadlineCancelsTheOldOne) {
  EXPECT_EXIT(
      {
        Watchdog dog;
        dog.arm("first", 0.1);
        dog.arm("second", std::numeric_limits<double>::infinity());
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        std::exit(0);
      },
      testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace keel
