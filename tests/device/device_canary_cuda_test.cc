// The GPU straggler probe (device/device_canary_cuda.h): its time scales with its repeats (the
// slowgpu fault), and work that other streams run on the GPU at the same time is not in it,
// while a probe timed by CUDA events around it (keel's earlier canary) counts that work.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "../ops/cuda/cuda_test_util.h"
#include "device/device_canary_cuda.h"
#include "ops/cuda/gemm.h"

namespace keel {
namespace {

using test::DeviceArray;
using test::random_vector;
using test::to_device;

// The fastest of `n` probes on an otherwise idle GPU.
double quiet(DeviceCanary& canary, cudaStream_t stream, int n, int repeats = 1) {
  double best = 1e9;
  for (int i = 0; i < n; ++i) {
    canary.sample(repeats, stream);
    best = std::min(best, canary.wait());
  }
  return best;
}

TEST(DeviceCanaryCuda, ItsTimeScalesWithItsRepeats) {
  KEEL_REQUIRE_GPU();
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  {
    DeviceCanary canary;
    EXPECT_EQ(canary.wait(), 0.0) << "nothing pending";
    EXPECT_EQ(canary.sample(1, s), 0.0) << "no probe before the first";
    const double previous = canary.sample(1, s);
    EXPECT_GT(previous, 0.0) << "sample returns the previous probe's time";
    canary.wait();
    const double one = quiet(canary, s, 5), four = quiet(canary, s, 3, 4);
    std::printf("  canary: %.4f ms, with 4 repeats %.4f ms (%.2fx)\n", one * 1e3, four * 1e3, four / one);
    EXPECT_GT(one, 20e-6);
    EXPECT_LT(one, 5e-3);
    EXPECT_NEAR(four / one, 4.0, 0.4) << one << " s once, " << four << " s with 4 repeats";
  }
  cudaStreamDestroy(s);
}

TEST(DeviceCanaryCuda, WorkOnOtherStreamsIsNotInItsTime) {
  KEEL_REQUIRE_GPU();
  cudaStream_t probe, other;
  ASSERT_EQ(cudaStreamCreateWithFlags(&probe, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  {
    DeviceCanary canary;
    const double alone = quiet(canary, probe, 5);
    // bf16 GEMMs of 8192^3 (1.1 TFLOP each: milliseconds) on the other stream hold every SM
    // while the probe is enqueued behind nothing on its own.
    constexpr std::int64_t n = 8192;
    const auto a = to_device<ops::cuda::bf16>(random_vector(n * n, 1, -0.02f, 0.02f));
    const auto b = to_device<ops::cuda::bf16>(random_vector(n * n, 2, -0.02f, 0.02f));
    DeviceArray<ops::cuda::bf16> c(static_cast<std::size_t>(n * n));
    ops::cuda::GemmRunner gemm;
    ops::cuda::GemmDesc d;
    d.m = d.n = d.k = n;
    gemm.run(d, a.get(), b.get(), c.get(), other);  // plans and warms cuBLASLt first
    ASSERT_EQ(cudaStreamSynchronize(other), cudaSuccess);
    cudaEvent_t begin, end;
    ASSERT_EQ(cudaEventCreate(&begin), cudaSuccess);
    ASSERT_EQ(cudaEventCreate(&end), cudaSuccess);
    for (int i = 0; i < 3; ++i) gemm.run(d, a.get(), b.get(), c.get(), other);
    ASSERT_EQ(cudaEventRecord(begin, probe), cudaSuccess);
    canary.sample(1, probe);
    ASSERT_EQ(cudaEventRecord(end, probe), cudaSuccess);
    const double busy = canary.wait();
    float ms = 0;
    ASSERT_EQ(cudaEventElapsedTime(&ms, begin, end), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(other), cudaSuccess);
    std::printf("  canary alone %.4f ms; beside the GEMMs %.4f ms, CUDA events around it %.3f ms\n", alone * 1e3,
                busy * 1e3, ms);
    // the GEMMs did hold the SMs: timed by events, the probe takes several times longer
    EXPECT_GT(ms * 1e-3, 3 * alone) << "events " << ms << " ms, alone " << alone * 1e3 << " ms";
    // the probe's own time does not
    EXPECT_LT(busy, 1.3 * alone) << "beside the GEMMs " << busy * 1e3 << " ms, alone " << alone * 1e3 << " ms";
    cudaEventDestroy(begin);
    cudaEventDestroy(end);
  }
  cudaStreamDestroy(probe);
  cudaStreamDestroy(other);
}

}  // namespace
}  // namespace keel
