#include "optim/schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/error.h"
#include "optim/batch_schedule.h"
#include "../error_message.h"

namespace keel::optim {
namespace {

LrSchedule cosine() {
  LrSchedule s;
  s.kind = ScheduleKind::kCosine;
  s.peak_lr = 6e-4;
  s.min_lr = 2e-4;  // ZAYA1 phase 1: cosine 6e-4 -> 2e-4
  s.warmup_steps = 10;
  s.total_steps = 101;  // decay over steps 10..100, midpoint 55
  return s;
}

std::string error_of(const LrSchedule& s) {
  return test::error_message([&] { validate(s); });
}

TEST(ScheduleLr, CosineKeySteps) {
  LrSchedule s = cosine();
  EXPECT_DOUBLE_EQ(lr_at(s, 0), 6e-4 / 10);   // start of warmup: not zero
  EXPECT_DOUBLE_EQ(lr_at(s, 4), 6e-4 * 5 / 10);
  EXPECT_DOUBLE_EQ(lr_at(s, 9), 6e-4);        // end of warmup: the peak
  EXPECT_DOUBLE_EQ(lr_at(s, 10), 6e-4);       // decay starts at the peak
  EXPECT_NEAR(lr_at(s, 55), 4e-4, 1e-15);     // midpoint: halfway between peak and floor
  EXPECT_DOUBLE_EQ(lr_at(s, 100), 2e-4);      // last step: exactly the floor
  EXPECT_DOUBLE_EQ(lr_at(s, 5000), 2e-4);     // past the end: the floor
  for (std::int64_t t = 1; t < 10; ++t) EXPECT_GT(lr_at(s, t), lr_at(s, t - 1));
  for (std::int64_t t = 11; t < 120; ++t) EXPECT_LE(lr_at(s, t), lr_at(s, t - 1));
  s.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(lr_at(s, 0), 6e-4);
}

TEST(ScheduleLr, WsdShapes) {
  LrSchedule s;
  s.kind = ScheduleKind::kWsd;
  s.peak_lr = 1e-3;
  s.min_lr = 1e-5;
  s.warmup_steps = 10;
  s.total_steps = 100;
  s.decay_fraction = 0.2;  // 20 decay steps: 80..99
  EXPECT_EQ(wsd_decay_steps(s), 20);
  for (DecayShape shape : {DecayShape::kLinear, DecayShape::kCosine, DecayShape::kOneMinusSqrt}) {
    s.decay_shape = shape;
    EXPECT_DOUBLE_EQ(lr_at(s, 0), 1e-4);
    EXPECT_DOUBLE_EQ(lr_at(s, 9), 1e-3);
    EXPECT_DOUBLE_EQ(lr_at(s, 45), 1e-3);  // stable
    EXPECT_DOUBLE_EQ(lr_at(s, 80), 1e-3);  // decay starts at the peak
    EXPECT_DOUBLE_EQ(lr_at(s, 99), 1e-5);  // ends at the floor
    EXPECT_DOUBLE_EQ(lr_at(s, 1000), 1e-5);
    for (std::int64_t t = 10; t < 110; ++t) EXPECT_LE(lr_at(s, t), lr_at(s, t - 1)) << to_string(shape) << " " << t;
    // One step into the decay, p = 1/19.
    double p = 1.0 / 19.0, f = decay_factor(shape, p);
    EXPECT_NEAR(lr_at(s, 81), 1e-5 + (1e-3 - 1e-5) * f, 1e-18);
  }
  EXPECT_DOUBLE_EQ(decay_factor(DecayShape::kLinear, 0.25), 0.75);
  EXPECT_NEAR(decay_factor(DecayShape::kCosine, 0.5), 0.5, 1e-15);
  EXPECT_DOUBLE_EQ(decay_factor(DecayShape::kOneMinusSqrt, 0.25), 0.5);
  // 1-sqrt drops fastest at the start of the decay, cosine slowest.
  EXPECT_LT(decay_factor(DecayShape::kOneMinusSqrt, 0.1), decay_factor(DecayShape::kLinear, 0.1));
  EXPECT_LT(decay_factor(DecayShape::kLinear, 0.1), decay_factor(DecayShape::kCosine, 0.1));
}

TEST(ScheduleLr, Constant) {
  LrSchedule s;
  s.kind = ScheduleKind::kConstant;
  s.peak_lr = 3e-4;
  s.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(lr_at(s, 0), 0.75e-4);
  EXPECT_DOUBLE_EQ(lr_at(s, 3), 3e-4);
  EXPECT_DOUBLE_EQ(lr_at(s, 1000000), 3e-4);
}

TEST(ScheduleLr, ValidationErrorsNameTheField) {
  LrSchedule s = cosine();
  s.peak_lr = 0;
  EXPECT_NE(error_of(s).find("peak_lr"), std::string::npos);
  s = cosine();
  s.min_lr = 1e-3;
  EXPECT_NE(error_of(s).find("min_lr"), std::string::npos);
  s = cosine();
  s.warmup_steps = 200;
  EXPECT_NE(error_of(s).find("warmup_steps (200) exceed total_steps (101)"), std::string::npos) << error_of(s);
  s = cosine();
  s.kind = ScheduleKind::kWsd;
  s.decay_fraction = 0;
  EXPECT_NE(error_of(s).find("decay_fraction"), std::string::npos);
  s.decay_fraction = 0.95;
  EXPECT_NE(error_of(s).find("decay steps (96)"), std::string::npos) << error_of(s);
  EXPECT_THROW(lr_at(cosine(), -1), Error);
  EXPECT_EQ(error_of(cosine()), "");
  EXPECT_EQ(parse_schedule_kind("wsd"), ScheduleKind::kWsd);
  EXPECT_EQ(parse_decay_shape("1-sqrt"), DecayShape::kOneMinusSqrt);
  EXPECT_THROW(parse_schedule_kind("linear"), Error);
  EXPECT_THROW(parse_decay_shape("exp"), Error);
}

TEST(ScheduleBatchRampup, StepsInIncrements) {
  BatchRampup r;
  r.start_batch = 32;
  r.target_batch = 128;
  r.increment = 32;
  r.ramp = 300;  // 3 increments, one per 100 consumed samples
  r.multiple_of = 16;
  EXPECT_EQ(global_batch_at(r, 0), 32);
  EXPECT_EQ(global_batch_at(r, 99), 32);
  EXPECT_EQ(global_batch_at(r, 100), 64);
  EXPECT_EQ(global_batch_at(r, 250), 96);
  EXPECT_EQ(global_batch_at(r, 299), 96);
  EXPECT_EQ(global_batch_at(r, 300), 128);
  EXPECT_EQ(global_batch_at(r, 1000000000000LL), 128);
  std::int64_t prev = 0;
  for (std::int64_t c = 0; c < 400; c += 7) {
    std::int64_t b = global_batch_at(r, c);
    EXPECT_GE(b, prev);
    EXPECT_EQ(b % 16, 0);
    prev = b;
  }
  // Simulate training: consumed grows by the batch of each step.
  std::int64_t consumed = 0, steps = 0;
  while (consumed < 300) consumed += global_batch_at(r, consumed), ++steps;
  EXPECT_EQ(steps, 4 + 2 + 1 + 0);  // 32 x 4 = 128 -> 64 x 2 = 256 -> 96 x 1 = 352
  // Token units work the same (4096-token sequences).
  BatchRampup t{4096 * 32, 4096 * 128, 4096 * 32, 4096LL * 300, 4096};
  EXPECT_EQ(global_batch_at(t, 4096LL * 150), 4096 * 64);
  // No ramp: the target.
  r.ramp = 0;
  EXPECT_EQ(global_batch_at(r, 0), 128);
}

TEST(ScheduleBatchRampup, ValidationAndAccumulation) {
  BatchRampup r{32, 128, 40, 300, 1};
  EXPECT_THROW(validate(r), Error);  // 40 does not divide 96
  r = {32, 16, 16, 300, 1};
  EXPECT_THROW(validate(r), Error);  // target below start
  r = {24, 120, 32, 300, 16};
  EXPECT_THROW(validate(r), Error);  // start not a multiple of 16
  r = {32, 128, 32, -1, 1};
  EXPECT_THROW(validate(r), Error);
  try {
    validate(BatchRampup{32, 128, 40, 300, 1});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("increment 40"), std::string::npos) << e.what();
  }
  EXPECT_EQ(accumulation_steps(512, 4, 8), 16);
  EXPECT_EQ(accumulation_steps(32, 4, 8), 1);
  EXPECT_THROW(accumulation_steps(100, 4, 8), Error);
  EXPECT_THROW(accumulation_steps(512, 0, 8), Error);
}

}  // namespace
}  // namespace keel::optim
