// DataParallelComm's gradient reduce-scatter (parallel/data_parallel_comm.h) at 2, 3 and 4
// ranks (and 8 GPUs in scripts/gpu.sh), over MPI on host memory and (one GPU per rank, skipped otherwise) over NCCL on device
// memory, in fp32 and in bf16, against the exact sums on fresh random inputs and uneven shard
// bounds (an empty shard at 3+ ranks).
//
// The inputs are chosen so every sum the comms form is exact in fp32 in any order: values
// +-(1 + f) 2^k with f on a grid of 2^-14 and k in [-3, 3]: multiples of 2^-17 below 16, so the
// sums of up to 8 ranks are multiples of 2^-17 below 2^7, 24 bits, which fp32 holds. So fp32 results must equal the exact sum, and bf16 results the
// bf16 rounding of the exact sum of the bf16-rounded inputs, except that NCCL at 3+ ranks also
// rounds partial sums along its ring (bounded below).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "../mpi_test_util.h"
#include "common/dtype.h"
#include "parallel/data_parallel_comm.h"

#if defined(KEEL_HAVE_CUDA)
#include <cuda_runtime.h>

#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#endif

namespace keel::parallel {
namespace {

using keel::test::world_rank;
using keel::test::world_size;

using keel::bf16_round;

// One rank's gradients: total floats from the seed and the rank.
std::vector<float> rank_values(std::uint64_t seed, int rank, std::int64_t total) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(rank));
  std::uniform_int_distribution<int> frac(1, (1 << 14) - 1), exp(-3, 3), sign(0, 1);
  std::vector<float> v(static_cast<std::size_t>(total));
  for (float& x : v) x = std::ldexp((sign(rng) ? -1.f : 1.f) * (1.f + frac(rng) / 16384.f), exp(rng));
  return v;
}

// A seed drawn on rank 0 and shared: fresh inputs each run, the same on every rank.
std::uint64_t shared_seed() {
  std::uint64_t seed = std::random_device{}();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

// Uneven shards of total floats (rank r weighs r + 1); rank 1 gets none when there are 3+ ranks.
std::vector<std::int64_t> uneven_bounds(std::int64_t total, int ranks) {
  std::vector<std::int64_t> weight;
  for (int r = 0; r < ranks; ++r) weight.push_back(r == 1 && ranks >= 3 ? 0 : r + 1);
  const std::int64_t all = std::accumulate(weight.begin(), weight.end(), std::int64_t{0});
  std::vector<std::int64_t> bounds{0};
  std::int64_t acc = 0;
  for (std::int64_t w : weight) bounds.push_back(total * (acc += w) / all);
  return bounds;
}

struct Expected {
  std::vector<float> sum;        // what an fp32 reduction gives (exact)
  std::vector<float> bf16_sum;   // bf16(sum of bf16(x_r)), one rounding of the exact sum
  std::vector<float> abs_bf16;   // sum of |bf16(x_r)|: bounds the partial sums
};
Expected expected(std::uint64_t seed, std::int64_t total) {
  Expected e;
  e.sum.assign(static_cast<std::size_t>(total), 0.f);
  e.bf16_sum = e.abs_bf16 = e.sum;
  for (int r = 0; r < world_size(); ++r) {
    const auto v = rank_values(seed, r, total);
    for (std::size_t i = 0; i < v.size(); ++i) {
      e.sum[i] += v[i];
      e.bf16_sum[i] += bf16_round(v[i]);
      e.abs_bf16[i] += std::fabs(bf16_round(v[i]));
    }
  }
  for (float& x : e.bf16_sum) x = bf16_round(x);
  return e;
}

constexpr std::int64_t kTotal = 100003;

// Checks this rank's shard of `got` (the whole buffer after reduce_scatter_sum). exact_bf16:
// the bf16 result must be the single rounding bit for bit; otherwise within the ring's roundings:
// each of the (ranks - 1) partial sums is rounded by up to half a bf16 ulp, 2^-8 of its size, and
// no partial sum exceeds the sum of |inputs|; the reference's own rounding adds one more, so at
// 4 ranks 4 x 2^-8 of the sum of |inputs|. (Measured on 4 H200s: up to 2 ulps from the
// reference where the inputs cancel.)
void check_shard(const std::vector<float>& got, const std::vector<std::int64_t>& bounds, const Expected& e, bool bf16,
                 bool exact_bf16, std::uint64_t seed, const char* what) {
  const std::int64_t lo = bounds[world_rank()], hi = bounds[world_rank() + 1];
  std::int64_t wrong = 0, rounded = 0, first_wrong = -1;
  for (std::int64_t i = lo; i < hi; ++i) {
    const float g = got[static_cast<std::size_t>(i)];
    bool ok;
    if (!bf16) ok = g == e.sum[i];
    else if (exact_bf16) ok = g == e.bf16_sum[i];
    else ok = bf16_round(g) == g && std::fabs(g - e.bf16_sum[i]) <= world_size() * std::ldexp(e.abs_bf16[i], -8);
    if (!ok && wrong++ == 0) first_wrong = i;
    if (g != e.sum[i]) ++rounded;
  }
  EXPECT_EQ(wrong, 0) << what << " (seed " << seed << ", " << world_size() << " ranks): first wrong at " << first_wrong
                      << ": got " << (first_wrong >= 0 ? got[static_cast<std::size_t>(first_wrong)] : 0.f) << ", sum "
                      << (first_wrong >= 0 ? e.sum[static_cast<std::size_t>(first_wrong)] : 0.f);
  // the inputs have 15 significant bits: in bf16 nearly every sum must come out rounded
  if (bf16 && hi > lo) EXPECT_GT(rounded, (hi - lo) / 2) << what << ": the bf16 reduction did not round";
}

TEST(DataParallelComm, MpiReduceScatterIsExactInFp32AndRoundsInBf16) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2+ ranks";
  const std::uint64_t seed = shared_seed();
  const auto bounds = uneven_bounds(kTotal, world_size());
  const Expected e = expected(seed, kTotal);
  for (const bool bf16 : {false, true}) {
    auto comm = make_mpi_data_parallel_comm(MPI_COMM_WORLD, bf16 ? GradReduceDtype::kBf16 : GradReduceDtype::kFp32);
    std::vector<float> buf = rank_values(seed, world_rank(), kTotal);
    comm->reduce_scatter_sum(buf.data(), bounds);
    check_shard(buf, bounds, e, bf16, /*exact_bf16=*/true, seed, bf16 ? "MPI bf16" : "MPI fp32");
  }
}

#if defined(KEEL_HAVE_CUDA)
TEST(DataParallelComm, NcclReduceScatterIsExactInFp32AndRoundsInBf16) {
  const int gpus = visible_cuda_devices();
  if (world_size() < 2 || gpus < world_size()) GTEST_SKIP() << "needs 2+ ranks and a GPU per rank (" << gpus << " visible)";
  set_cuda_device(world_rank());
  const std::uint64_t seed = shared_seed();
  const auto bounds = uneven_bounds(kTotal, world_size());
  const Expected e = expected(seed, kTotal);
  cudaStream_t stream = nullptr;
  KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const bool bf16 : {false, true}) {
    auto comm = make_nccl_data_parallel_comm(make_nccl_group(MPI_COMM_WORLD), stream,
                                             bf16 ? GradReduceDtype::kBf16 : GradReduceDtype::kFp32);
    const std::int64_t n = comm->buffer_floats(kTotal);  // NCCL's equal chunks pad the tail
    std::vector<float> host = rank_values(seed, world_rank(), kTotal);
    host.resize(static_cast<std::size_t>(n), 0.f);
    float* dev = nullptr;
    KEEL_CUDA_CHECK(cudaMalloc(&dev, static_cast<std::size_t>(n) * sizeof(float)));
    KEEL_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
    comm->reduce_scatter_sum(dev, bounds);
    KEEL_CUDA_CHECK(cudaMemcpyAsync(host.data(), dev, host.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream));
    KEEL_CUDA_CHECK(cudaFree(dev));
    // at 2 ranks NCCL adds two bf16 values once: the same single rounding as the reference
    check_shard(host, bounds, e, bf16, /*exact_bf16=*/world_size() == 2, seed, bf16 ? "NCCL bf16" : "NCCL fp32");
  }
  KEEL_CUDA_CHECK(cudaStreamDestroy(stream));
}
#endif

}  // namespace
}  // namespace keel::parallel
