// kernels.profile on the GPU (train/step_profile_cuda.h): a phase lasts from its mark to the
// next one on the stream, phases of one name add up within a step, the warm-up steps are left
// out, and a stall of the stream (here a host callback that sleeps) is charged to the phase it
// happens in. Skips without a GPU.
#include "train/step_profile_cuda.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "../ops/cuda/cuda_test_util.h"

namespace keel::train {
namespace {

void CUDART_CB sleep_ms(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms)));
}

TEST(StepProfileCuda, PhasesFollowTheMarksAndWarmupIsLeftOut) {
  KEEL_REQUIRE_GPU();
  cudaStream_t s;
  KEEL_CUDA_CHECK(cudaStreamCreate(&s));
  {
    CudaStepProfile p(/*warmup_steps=*/1);
    static int twenty = 20, ten = 10, fifty = 50;
    for (int step = 0; step < 4; ++step) {
      p.step("a", s);
      if (step == 0) KEEL_CUDA_CHECK(cudaLaunchHostFunc(s, sleep_ms, &fifty));  // warm-up: not counted
      p.mark("slow", s);
      KEEL_CUDA_CHECK(cudaLaunchHostFunc(s, sleep_ms, &twenty));
      p.mark("b", s);
      p.mark("slow", s);
      KEEL_CUDA_CHECK(cudaLaunchHostFunc(s, sleep_ms, &ten));
      p.mark("c", s);
    }
    const ProfileReport r = p.report(s);
    EXPECT_EQ(r.steps, 3);
    EXPECT_EQ(r.skipped, 1);
    ASSERT_EQ(r.rows.size(), 4u);
    EXPECT_EQ(r.rows[0].phase, "a");
    EXPECT_EQ(r.rows[1].phase, "slow");
    EXPECT_EQ(r.rows[2].phase, "b");
    EXPECT_EQ(r.rows[3].phase, "c");
    EXPECT_DOUBLE_EQ(r.rows[1].per_step, 2.0);
    EXPECT_DOUBLE_EQ(r.rows[0].per_step, 1.0);
    EXPECT_GE(r.rows[1].ms_per_step, 29.0);
    EXPECT_LT(r.rows[1].ms_per_step, 45.0);
    EXPECT_LT(r.rows[0].ms_per_step, 10.0) << "the warm-up step's 50 ms stall was counted";
    EXPECT_LT(r.rows[2].ms_per_step, 10.0);
  }
  KEEL_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST(StepProfileCuda, ReportBeforeAnyStepIsEmpty) {
  KEEL_REQUIRE_GPU();
  CudaStepProfile p(2);
  const ProfileReport r = p.report(nullptr);
  EXPECT_EQ(r.steps, 0);
  EXPECT_TRUE(r.rows.empty());
}

}  // namespace
}  // namespace keel::train
