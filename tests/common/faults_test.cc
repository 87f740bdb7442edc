// common/faults.h: the spec grammar of keel train --inject, its errors, and which steps and
// ranks each fault covers (the faults themselves are exercised by tests/train/cli_tests.cmake).
#include "common/faults.h"

#include <gtest/gtest.h>

#include <csignal>
#include <chrono>
#include <string>

#include "common/error.h"

namespace keel {
namespace {

std::string error_of(const std::string& spec) {
  try {
    parse_faults(spec);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Faults, ParsesEveryKindWithItsDefaults) {
  const FaultPlan p = parse_faults("kill@3,exit@4,hang@5,slow@6,nan@7");
  ASSERT_EQ(p.faults.size(), 5u);
  EXPECT_EQ(p.faults[0].kind, Fault::Kind::kKill);
  EXPECT_EQ(p.faults[1].kind, Fault::Kind::kExit);
  EXPECT_EQ(p.faults[2].kind, Fault::Kind::kHang);
  EXPECT_EQ(p.faults[3].kind, Fault::Kind::kSlow);
  EXPECT_EQ(p.faults[4].kind, Fault::Kind::kNan);
  for (const Fault& f : p.faults) {
    EXPECT_EQ(f.rank, 0) << f.spec;
    EXPECT_EQ(f.first_step, f.last_step) << f.spec;
  }
  EXPECT_EQ(p.faults[0].first_step, 3);
  EXPECT_EQ(p.faults[0].spec, "kill@3");
  EXPECT_EQ(p.faults[1].exit_code, 3);
  EXPECT_EQ(p.faults[3].sleep_ms, 500);
  EXPECT_EQ(p.faults[4].first_step, 7);
}

// keel run's pre-flight fault: the attempt in the step field, ignored by keel train's hooks.
TEST(Faults, HealthIsKeelRunsAndNoStepHookFires) {
  const FaultPlan p = parse_faults("health@2:r1");
  ASSERT_EQ(p.faults.size(), 1u);
  EXPECT_EQ(p.faults[0].kind, Fault::Kind::kHealth);
  EXPECT_EQ(p.faults[0].first_step, 2);
  EXPECT_EQ(p.faults[0].rank, 1);
  p.before_step(2, 1);  // returns: nothing fires in keel train
  EXPECT_FALSE(p.nan_at(2, 1));
  EXPECT_FALSE(p.disk_full_at(2, 1));
  EXPECT_DOUBLE_EQ(p.loss_factor_at(2, 1), 1.0);
}

TEST(Faults, ParsesRanksArgumentsAndRanges) {
  const FaultPlan p = parse_faults("exit@2:r1:42, slow@3-9:r2:150,kill@10:r3,slow@4:25,exit@8:0,hang@1:r0");
  ASSERT_EQ(p.faults.size(), 6u);
  EXPECT_EQ(p.faults[0].rank, 1);
  EXPECT_EQ(p.faults[0].exit_code, 42);
  EXPECT_EQ(p.faults[1].spec, "slow@3-9:r2:150");  // spaces around a word are dropped
  EXPECT_EQ(p.faults[1].first_step, 3);
  EXPECT_EQ(p.faults[1].last_step, 9);
  EXPECT_EQ(p.faults[1].rank, 2);
  EXPECT_EQ(p.faults[1].sleep_ms, 150);
  EXPECT_EQ(p.faults[2].rank, 3);
  EXPECT_EQ(p.faults[3].rank, 0);
  EXPECT_EQ(p.faults[3].sleep_ms, 25);
  EXPECT_EQ(p.faults[4].exit_code, 0);
  EXPECT_EQ(p.faults[5].first_step, 1);
  // the argument may come before the rank
  const FaultPlan q = parse_faults("exit@2:7:r1");
  EXPECT_EQ(q.faults[0].rank, 1);
  EXPECT_EQ(q.faults[0].exit_code, 7);
}

TEST(Faults, NanAtMatchesItsStepAndRankOnly) {
  const FaultPlan p = parse_faults("nan@2:r1,kill@2:r0");
  EXPECT_TRUE(p.nan_at(2, 1));
  EXPECT_FALSE(p.nan_at(2, 0));  // kill@2:r0 is no NaN
  EXPECT_FALSE(p.nan_at(1, 1));
  EXPECT_FALSE(p.nan_at(3, 1));
  EXPECT_FALSE(FaultPlan().nan_at(2, 1));
  EXPECT_TRUE(FaultPlan().empty());
}

TEST(Faults, SpikeAndDiskFullMatchTheirStepAndRankOnly) {
  const FaultPlan p = parse_faults("spike@4:r1,spike@6:2.5,diskfull@8:r1,nan@4:r0,diskfull@9");
  ASSERT_EQ(p.faults.size(), 5u);
  EXPECT_EQ(p.faults[0].kind, Fault::Kind::kSpike);
  EXPECT_EQ(p.faults[0].factor, 100);  // the default
  EXPECT_EQ(p.faults[1].factor, 2.5);
  EXPECT_EQ(p.faults[1].rank, 0);
  EXPECT_EQ(p.faults[2].kind, Fault::Kind::kDiskFull);
  EXPECT_EQ(p.loss_factor_at(4, 1), 100);
  EXPECT_EQ(p.loss_factor_at(4, 0), 1);  // nan@4:r0 is no spike
  EXPECT_EQ(p.loss_factor_at(5, 1), 1);
  EXPECT_EQ(p.loss_factor_at(6, 0), 2.5);
  EXPECT_TRUE(p.disk_full_at(8, 1));
  EXPECT_FALSE(p.disk_full_at(8, 0));
  EXPECT_FALSE(p.disk_full_at(7, 1));
  EXPECT_TRUE(p.disk_full_at(9, 0));
  EXPECT_FALSE(p.nan_at(8, 1));  // a disk full is no NaN
  EXPECT_FALSE(p.disk_full_at(4, 1));  // nor a spike a disk full
  EXPECT_EQ(FaultPlan().loss_factor_at(4, 1), 1);
  // firing is the trainer's: before_step does nothing for them
  p.before_step(4, 1);
  p.before_step(8, 1);
}

// slowsave: the delay of one save's writes (default 5000 ms), at its step and rank only; no
// step hook fires for it, and a range is refused.
TEST(Faults, SlowSaveDelaysItsSavesWritesOnItsRankOnly) {
  const FaultPlan p = parse_faults("slowsave@8:r1,slowsave@12:250");
  ASSERT_EQ(p.faults.size(), 2u);
  EXPECT_EQ(p.faults[0].kind, Fault::Kind::kSlowSave);
  EXPECT_EQ(p.save_delay_ms_at(8, 1), 5000);
  EXPECT_EQ(p.save_delay_ms_at(8, 0), 0);
  EXPECT_EQ(p.save_delay_ms_at(9, 1), 0);
  EXPECT_EQ(p.save_delay_ms_at(12, 0), 250);
  EXPECT_FALSE(p.disk_full_at(8, 1));
  const auto t0 = std::chrono::steady_clock::now();
  p.before_step(8, 1);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.2);
  EXPECT_THROW(parse_faults("slowsave@8-9"), UsageError);
  EXPECT_THROW(parse_faults("slowsave@8:fast"), UsageError);
}

// slowgpu: the device canary's repeats over the range, on its rank only (the GPU straggler drill).
TEST(Faults, SlowGpuRepeatsTheCanaryOverItsRangeOnItsRankOnly) {
  const FaultPlan p = parse_faults("slowgpu@3-5:r1,slowgpu@7:r0:10");
  EXPECT_EQ(p.canary_repeats_at(2, 1), 1);
  EXPECT_EQ(p.canary_repeats_at(3, 1), 4);
  EXPECT_EQ(p.canary_repeats_at(5, 1), 4);
  EXPECT_EQ(p.canary_repeats_at(6, 1), 1);
  EXPECT_EQ(p.canary_repeats_at(4, 0), 1);
  EXPECT_EQ(p.canary_repeats_at(7, 0), 10);
  p.before_step(4, 1);  // no step hook fires for it
}

TEST(Faults, UnionKeepsEveryFault) {
  FaultPlan p = parse_faults("nan@2");
  p.add(parse_faults("nan@5:r1,slow@1"));
  EXPECT_EQ(p.faults.size(), 3u);
  EXPECT_TRUE(p.nan_at(2, 0));
  EXPECT_TRUE(p.nan_at(5, 1));
}

TEST(Faults, SlowSleepsOverItsRangeOnItsRankOnly) {
  const FaultPlan p = parse_faults("slow@2-3:r1:40");
  auto ms = [&](std::int64_t step, int rank) {
    const auto t0 = std::chrono::steady_clock::now();
    p.before_step(step, rank);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  EXPECT_GE(ms(2, 1), 40);
  EXPECT_GE(ms(3, 1), 40);
  EXPECT_LT(ms(1, 1), 30);
  EXPECT_LT(ms(4, 1), 30);
  EXPECT_LT(ms(2, 0), 30);
}

TEST(Faults, KillAndExitEndTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // re-executes the binary: safe beside threads
  EXPECT_EXIT(parse_faults("exit@3:r1:7").before_step(3, 1), testing::ExitedWithCode(7),
              "keel: fault injection: rank 1 exits with code 7 at step 3");
  EXPECT_EXIT(parse_faults("kill@2").before_step(2, 0), testing::KilledBySignal(SIGKILL),
              "keel: fault injection: rank 0 killed at step 2");
  // not their step or rank: nothing
  parse_faults("exit@3:r1,kill@2").before_step(1, 0);
  parse_faults("exit@3:r1,kill@2").before_step(3, 0);
}

TEST(Faults, MalformedSpecsAreOneLineNamingTheWord) {
  EXPECT_EQ(error_of("kil@3"), "--inject kil@3: unknown fault 'kil' (kill, exit, hang, slow, nan, spike, diskfull, slowsave, health, slowgpu)");
  EXPECT_EQ(error_of("kill@3,kil@4"), "--inject kil@4: unknown fault 'kil' (kill, exit, hang, slow, nan, spike, diskfull, slowsave, health, slowgpu)");
  EXPECT_EQ(error_of("kill"), "--inject kill: expected KIND@STEP[:rRANK][:ARG], e.g. kill@3:r1");
  EXPECT_EQ(error_of(""), "--inject '': an empty fault (expected KIND@STEP[:rRANK][:ARG], e.g. kill@3:r1)");
  EXPECT_EQ(error_of("kill@3,"), "--inject '': an empty fault (expected KIND@STEP[:rRANK][:ARG], e.g. kill@3:r1)");
  EXPECT_EQ(error_of("kill@0"), "--inject kill@0: step 0: steps count from 1");
  EXPECT_EQ(error_of("kill@-1"), "--inject kill@-1: '-1' is not a step (a number >= 1)");
  EXPECT_EQ(error_of("kill@x"), "--inject kill@x: 'x' is not a step (a number >= 1)");
  EXPECT_EQ(error_of("kill@"), "--inject kill@: '' is not a step (a number >= 1)");
  EXPECT_EQ(error_of("kill@3.5"), "--inject kill@3.5: '3.5' is not a step (a number >= 1)");
  EXPECT_EQ(error_of("kill@99999999999999999999"),
            "--inject kill@99999999999999999999: '99999999999999999999' is not a step (a number >= 1)");
  EXPECT_EQ(error_of("kill@3:r-1"), "--inject kill@3:r-1: 'r-1' is not a rank (rN: a world rank N >= 0)");
  EXPECT_EQ(error_of("kill@3:r"), "--inject kill@3:r: 'r' is not a rank (rN: a world rank N >= 0)");
  EXPECT_EQ(error_of("kill@3:rx"), "--inject kill@3:rx: 'rx' is not a rank (rN: a world rank N >= 0)");
  EXPECT_EQ(error_of("kill@3:r1:r2"), "--inject kill@3:r1:r2: more than one rank");
  EXPECT_EQ(error_of("kill@3:1"), "--inject kill@3:1: kill takes no argument ('1'; a rank is written r1)");
  EXPECT_EQ(error_of("nan@3:"), "--inject nan@3:: an empty field after ':'");
  EXPECT_EQ(error_of("exit@3:256"), "--inject exit@3:256: '256' is not an exit code (0-255)");
  EXPECT_EQ(error_of("exit@3:-1"), "--inject exit@3:-1: '-1' is not an exit code (0-255)");
  EXPECT_EQ(error_of("exit@3:1:2"), "--inject exit@3:1:2: more than one argument");
  EXPECT_EQ(error_of("slow@3:fast"), "--inject slow@3:fast: 'fast' is not milliseconds (0-86400000)");
  EXPECT_EQ(error_of("slowgpu@3:1"), "--inject slowgpu@3:1: '1' is not a slowdown factor (2-1000)");
  EXPECT_EQ(error_of("slowgpu@3:x"), "--inject slowgpu@3:x: 'x' is not a slowdown factor (2-1000)");
  EXPECT_EQ(error_of("spike@3:0"), "--inject spike@3:0: '0' is not a loss factor (a number > 0)");
  EXPECT_EQ(error_of("spike@3:x"), "--inject spike@3:x: 'x' is not a loss factor (a number > 0)");
  EXPECT_EQ(error_of("spike@3:-2"), "--inject spike@3:-2: '-2' is not a loss factor (a number > 0)");
  EXPECT_EQ(error_of("spike@3:1e999"), "--inject spike@3:1e999: '1e999' is not a loss factor (a number > 0)");
  EXPECT_EQ(error_of("spike@3:5x"), "--inject spike@3:5x: '5x' is not a loss factor (a number > 0)");
  EXPECT_EQ(error_of("diskfull@3:2"), "--inject diskfull@3:2: diskfull takes no argument ('2'; a rank is written r2)");
  EXPECT_EQ(error_of("spike@3-5"), "--inject spike@3-5: a step range is for slow and slowgpu only (spike fires at one step)");
  EXPECT_EQ(error_of("kill@3-5"), "--inject kill@3-5: a step range is for slow and slowgpu only (kill fires at one step)");
  EXPECT_EQ(error_of("slow@5-3"), "--inject slow@5-3: the range 5-3 ends before it starts");
  EXPECT_EQ(error_of("slow@0-3"), "--inject slow@0-3: step 0: steps count from 1");
  EXPECT_EQ(error_of("slow@3-"), "--inject slow@3-: '' is not a step (a number >= 1)");
  EXPECT_EQ(error_of("slow@-3"), "--inject slow@-3: '-3' is not a step (a number >= 1)");
  // another flag named in the message
  try {
    parse_faults("oops@1", "keel run --inject");
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), "keel run --inject oops@1: unknown fault 'oops' (kill, exit, hang, slow, nan, spike, diskfull, slowsave, health, slowgpu)");
  }
}

}  // namespace
}  // namespace keel
