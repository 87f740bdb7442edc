// keel run's straggler watch (run/straggler.h) on synthetic heartbeats: a rank whose busy time
// (step - wait) stays above the bar is named once, at the step that confirms it; equal ranks
// with jitter, a short slow spell, a world of one and factor 0 name nobody.
#include "run/straggler.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

namespace keel::run {
namespace {

// Four ranks, 40 steps: every step takes 1.0 s; rank `slow` works `busy_slow` of it from step
// `from` to `to` (the others wait for it), the others 0.4 s (+-0.02 jitter). Returns the first
// report.
std::optional<Straggler> feed(StragglerWatch& w, int slow, double busy_slow, int from, int to, int world = 4) {
  std::optional<Straggler> first;
  for (std::int64_t s = 1; s <= 40; ++s)
    for (int r = 0; r < world; ++r) {
      const double jitter = 0.02 * ((s * 7 + r * 3) % 5 - 2) / 2.0;
      const double busy = (r == slow && s >= from && s <= to) ? busy_slow : 0.4 + jitter;
      if (auto x = w.add(r, s, 1.0, 1.0 - busy, world); x && !first) first = x;
    }
  return first;
}

TEST(StragglerWatch, NamesTheRankThatWaitsLeastOnce) {
  StragglerWatch w({1.5, 5, 5, 0.05});
  const auto x = feed(w, 2, 0.95, 1, 40);
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(x->rank, 2);
  // every window is full once rank 3 reports step 5 (after rank 2 does): five steps above the
  // bar from step 6, confirmed at step 10
  EXPECT_EQ(x->step, 10);
  EXPECT_NEAR(x->busy, 0.95, 1e-9);
  EXPECT_NEAR(x->others, 0.4, 0.02);
  ASSERT_EQ(x->window.size(), 5u) << "the window the verdict read, in the report";
  for (double b : x->window) EXPECT_NEAR(b, 0.95, 1e-9);
  EXPECT_FALSE(w.add(2, 41, 1.0, 0.05, 4).has_value()) << "reported twice";
}

TEST(StragglerWatch, EqualRanksAndShortSpellsNameNobody) {
  StragglerWatch equal({1.5, 5, 5, 0.05});
  EXPECT_FALSE(feed(equal, -1, 0, 0, 0).has_value());
  // three slow steps: the median of five never crosses the bar
  StragglerWatch spell({1.5, 5, 5, 0.05});
  EXPECT_FALSE(feed(spell, 1, 0.95, 10, 12).has_value());
  // above the factor but within min_gap
  StragglerWatch gap({1.5, 5, 5, 0.7});
  EXPECT_FALSE(feed(gap, 1, 0.95, 1, 40).has_value());
}

TEST(StragglerWatch, OffAndOneRankAndRepeatedSteps) {
  StragglerWatch off({0, 5, 5, 0.05});
  EXPECT_FALSE(feed(off, 1, 0.95, 1, 40).has_value());
  StragglerWatch one({1.5, 5, 5, 0.05});
  EXPECT_FALSE(feed(one, 0, 0.95, 1, 40, 1).has_value());
  // a heartbeat read twice counts once: rank 1's single slow step repeated stays one sample
  StragglerWatch w({1.5, 1, 1, 0.05});
  for (int r = 0; r < 2; ++r) w.add(r, 1, 1.0, 0.6, 2);
  EXPECT_FALSE(w.add(1, 1, 1.0, 0.0, 2).has_value());
  const auto x = w.add(0, 2, 1.0, 0.0, 2);  // now rank 0 works 1.0 s against rank 1's 0.4 s
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(x->rank, 0);
}

// The device canary's watch (fastest): a rank whose samples are slow only some of the time
// (another stream's kernels sharing its SMs) is not named, though the median of its window
// would be; one slow at every sample is, as with the median.
TEST(StragglerWatch, FastestOfTheWindowIgnoresSpikes) {
  const auto run = [](bool fastest, bool every_sample) {
    StragglerWatch w({1.5, 5, 5, 0.0, fastest});
    std::optional<Straggler> first;
    for (std::int64_t s = 1; s <= 40; ++s)
      for (int r = 0; r < 2; ++r) {
        // rank 1: 3x slower at 3 of every 5 steps (or at every step), as the canary measured
        // beside a concurrent collective
        const bool slow = r == 1 && (every_sample || s % 5 < 3);
        if (auto x = w.add(r, s, 1.0, 1.0 - (slow ? 0.00075 : 0.00025), 2); x && !first) first = x;
      }
    return first;
  };
  EXPECT_TRUE(run(false, false).has_value()) << "the median is fooled by 3 spikes in 5";
  EXPECT_FALSE(run(true, false).has_value());
  const auto x = run(true, true);
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(x->rank, 1);
  EXPECT_NEAR(x->busy, 0.00075, 1e-9);
}

}  // namespace
}  // namespace keel::run
