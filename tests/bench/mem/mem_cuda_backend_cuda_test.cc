// GPU path of `keel bench mem`: every kernel and copy on device memory, checked element by
// element. Skips cleanly where no GPU is visible (CI builds this with CUDA but has no GPU).
#include <gtest/gtest.h>

#include "device/cuda_devices.h"

#include "bench/mem/stream_kernels.h"
#include "bench/mem/backend.h"
#include "bench/mem/runner.h"
#include "common/error.h"

namespace keel::bench {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no CUDA device visible"

MemPlan quick_plan(std::uint64_t seed) {
  MemPlan p;
  p.warmup = 2;
  p.iters = 4;
  p.min_sample_us = 30;  // batches the small sizes through a CUDA graph
  p.seed = seed;
  return p;
}

}  // namespace

TEST(MemCudaBackend, KernelsAndCopiesVerifyAtOddAndLargeSizes) {
  SKIP_WITHOUT_GPU();
  auto backend = make_cuda_mem_backend(0);
  for (MemType t : {MemType::kF32, MemType::kF64})
    for (MemOp op : parse_mem_ops("stream,transfers"))
      for (std::uint64_t n : {1ull, 4099ull, (1ull << 24) + 3}) {
        SCOPED_TRACE(fmt::format("{} {} n={}", mem_op_name(op), mem_type_name(t), n));
        MemResult r = backend->run({op, t, n, 0, 0}, quick_plan(n + 17));
        ASSERT_EQ(r.seconds.size(), 4u);
        for (double s : r.seconds) EXPECT_GT(s, 0);
        if (op == MemOp::kDot) {
          const double want = expected_dot(t, n + 17, n);
          EXPECT_NEAR(r.dot, want, 1e-4 * want);
        } else {
          EXPECT_TRUE(r.checked);
          EXPECT_EQ(r.wrong, 0u) << r.first_wrong;
        }
      }
}

TEST(MemCudaBackend, SmallArraysAreBatchedAndNstreamCountsEveryRun) {
  SKIP_WITHOUT_GPU();
  auto backend = make_cuda_mem_backend(0);
  MemResult r = backend->run({MemOp::kNstream, MemType::kF32, 1 << 12, 0, 0}, quick_plan(5));
  EXPECT_GT(r.batch, 1);  // a 16 KiB array takes far less than 30 us per run
  EXPECT_EQ(r.wrong, 0u) << r.first_wrong;
  // Choosing the launch shape: one warm-up and 3 timed runs of each of the grid-stride loop
  // and the one-shot variants; then 2 warm-up, 4 to size the batch, 1 batch warming the graph
  // (only when batched), 4 batches timed.
  const std::uint64_t choose = 4u * (1u + kStreamOneshotVariants), batch = static_cast<std::uint64_t>(r.batch);
  EXPECT_EQ(r.runs, choose + 2u + 4u + (batch > 1 ? batch : 0u) + 4u * batch);
  EXPECT_TRUE(r.launch == "grid-stride" || r.launch.rfind("one-shot", 0) == 0) << r.launch;
}

TEST(MemCudaBackend, CorruptionIsCaughtOnDeviceAndHost) {
  SKIP_WITHOUT_GPU();
  auto backend = make_cuda_mem_backend(0);
  MemPlan p = quick_plan(9);
  p.corrupt = true;
  for (MemOp op : {MemOp::kCopy, MemOp::kMemcpy, MemOp::kD2HPinned}) {
    MemResult r = backend->run({op, MemType::kF32, 1 << 16, 0, 0}, p);
    EXPECT_EQ(r.wrong, 1u) << mem_op_name(op);
    EXPECT_NE(r.first_wrong.find("element 32768"), std::string::npos) << r.first_wrong;
  }
}

TEST(MemCudaBackend, PeerOpsRunBetweenEveryPair) {
  SKIP_WITHOUT_GPU();
  if (visible_cuda_devices() < 2) GTEST_SKIP() << "needs 2 GPUs";
  auto backend = make_cuda_mem_backend(0);
  for (MemOp op : parse_mem_ops("peer")) {
    MemResult r = backend->run({op, MemType::kF32, (1 << 20) + 1, 0, 1}, quick_plan(3));
    EXPECT_EQ(r.wrong, 0u) << mem_op_name(op) << ": " << r.first_wrong;
  }
}

TEST(MemCudaBackend, TooLargeIsAClearError) {
  SKIP_WITHOUT_GPU();
  auto backend = make_cuda_mem_backend(0);
  try {
    backend->check_fits({MemOp::kTriad, MemType::kF32, 1ull << 42, 0, 0});
    FAIL() << "16 TiB arrays fit?";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
}

}  // namespace keel::bench
