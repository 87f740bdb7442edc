// kernels.profile's report (train/step_profile.h): the table's shares and total, the JSON.
#include "train/step_profile.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace keel::train {
namespace {

TEST(StepProfile, TableSharesAddUpToTheStep) {
  ProfileReport r;
  r.steps = 5, r.skipped = 2;
  r.rows = {{"embedding fwd", 1.0, 1}, {"moe block fwd", 3.0, 8}, {"grad norm + optimizer", 6.0, 1}};
  const std::string t = format_profile(r);
  EXPECT_NE(t.find("mean over 5 steps after 2 warm-up"), std::string::npos) << t;
  EXPECT_NE(t.find("moe block fwd                            3.00   30.0%         8"), std::string::npos) << t;
  EXPECT_NE(t.find("grad norm + optimizer                    6.00   60.0%"), std::string::npos) << t;
  EXPECT_NE(t.find("step                                    10.00  100.0%"), std::string::npos) << t;
}

TEST(StepProfile, NoCountedStepSaysSo) {
  ProfileReport r;
  r.skipped = 2;
  EXPECT_EQ(format_profile(r), "step profile: no step counted (the first 2 are warm-up; train for more steps)\n");
}

TEST(StepProfile, JsonHasEveryPhase) {
  ProfileReport r;
  r.steps = 3, r.skipped = 2;
  r.rows = {{"a", 1.5, 1}, {"b", 2.5, 4}};
  const auto j = nlohmann::json::parse(profile_json(r));
  EXPECT_EQ(j["schema"], "keel.train.profile/1");
  EXPECT_EQ(j["steps"], 3);
  ASSERT_EQ(j["phases"].size(), 2u);
  EXPECT_EQ(j["phases"][1]["phase"], "b");
  EXPECT_DOUBLE_EQ(j["phases"][1]["ms_per_step"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(j["phases"][1]["per_step"].get<double>(), 4);
}

}  // namespace
}  // namespace keel::train
