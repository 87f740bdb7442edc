// wait_for_writes (train/write_wait.h): beats while the job's written bytes grow, none while
// they stand still (a wedged disk must still reach keel run's deadline), returns at all_done.
#include "train/write_wait.h"

#include <gtest/gtest.h>

#include <vector>

namespace keel::train {
namespace {

// A poll that replays `bytes` (one per call), reporting all_done after the last.
struct Replay {
  std::vector<std::int64_t> bytes;
  std::size_t at = 0;
  WriteProgress operator()() {
    if (at >= bytes.size()) return {true, bytes.empty() ? 0 : bytes.back()};
    return {false, bytes[at++]};
  }
};

TEST(WaitForWrites, BeatsOncePerPollThatMovedTheBytes) {
  Replay r{{0, 10, 20, 20, 20, 35}};
  int beats = 0;
  EXPECT_EQ(wait_for_writes(std::ref(r), [&] { ++beats; }, 0.0), 3);  // 10, 20, 35
  EXPECT_EQ(beats, 3);
  EXPECT_EQ(r.at, 6u);
}

TEST(WaitForWrites, NoBeatWhileTheWritesStandStill) {
  Replay r{{100, 100, 100, 100}};
  int beats = 0;
  EXPECT_EQ(wait_for_writes(std::ref(r), [&] { ++beats; }, 0.0), 0);
  EXPECT_EQ(beats, 0) << "bytes that do not move are not progress: keel run's deadline must still fire";
}

TEST(WaitForWrites, ReturnsAtOnceWhenAlreadyDone) {
  Replay r{{}};
  int beats = 0;
  EXPECT_EQ(wait_for_writes(std::ref(r), [&] { ++beats; }, 10.0), 0);  // no sleep either
  EXPECT_EQ(beats, 0);
}

}  // namespace
}  // namespace keel::train
