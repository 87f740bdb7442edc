// SparseDeviceBuffer on a GPU: the backed parts hold data at their global offsets, the
// whole-coverage case is a plain allocation, and asking for more than the GPU has is the
// usual one-line out-of-memory error.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "../ops/cuda/cuda_test_util.h"
#include "common/error.h"
#include "device/sparse_device_buffer.h"

namespace keel {
namespace {

TEST(SparseDeviceBufferCuda, BackedPartsHoldDataAtTheirOffsets) {
  KEEL_REQUIRE_GPU();
  const std::size_t mib = std::size_t(1) << 20, bytes = 64 * mib + 12;  // not a multiple of the granule
  // Three parts: one inside a granule, one across granule boundaries, the tail.
  SparseDeviceBuffer buf(bytes, {{3 * mib + 8, 3 * mib + 16}, {20 * mib - 4, 26 * mib + 4}, {64 * mib, bytes}},
                         "out of GPU memory: the test buffer", "none");
  ASSERT_NE(buf.get(), nullptr);
  EXPECT_FALSE(buf.whole());
  EXPECT_EQ(buf.size(), bytes);
  ASSERT_GE(buf.backed().size(), 3u);
  std::size_t covered = 0;
  for (const ByteRange& r : buf.backed()) covered += r.end - r.begin;
  EXPECT_EQ(buf.backed_bytes(), covered);
  EXPECT_LT(buf.backed_bytes(), bytes / 2) << "only the asked-for granules are backed";
  // Every asked-for byte lies in a backed part.
  for (const ByteRange want : {ByteRange{3 * mib + 8, 3 * mib + 16}, ByteRange{20 * mib - 4, 26 * mib + 4},
                               ByteRange{64 * mib, bytes}}) {
    bool inside = false;
    for (const ByteRange& r : buf.backed()) inside |= r.begin <= want.begin && want.end <= r.end;
    EXPECT_TRUE(inside) << want.begin;
  }
  // Round trip random bytes through every backed part (zeroed at first).
  std::mt19937 rng(7);
  for (const ByteRange& r : buf.backed()) {
    const std::size_t n = r.end - r.begin;
    std::vector<unsigned char> host(n, 1), zeros(n, 0);
    std::byte* at = static_cast<std::byte*>(buf.get()) + r.begin;
    ASSERT_EQ(cudaMemcpy(host.data(), at, n, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(host == zeros) << "backed memory starts zeroed";
    for (auto& b : host) b = static_cast<unsigned char>(rng());
    ASSERT_EQ(cudaMemcpy(at, host.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<unsigned char> back(n);
    ASSERT_EQ(cudaMemcpy(back.data(), at, n, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(back == host);
  }
}

TEST(SparseDeviceBufferCuda, FullCoverageIsOnePlainAllocation) {
  KEEL_REQUIRE_GPU();
  SparseDeviceBuffer buf(1000, {{0, 600}, {500, 1000}}, "out of GPU memory: the test buffer", "none");
  EXPECT_TRUE(buf.whole());
  EXPECT_GE(buf.backed_bytes(), 1000u);
  std::vector<float> host(250, 3.f);
  ASSERT_EQ(cudaMemcpy(buf.get(), host.data(), 1000, cudaMemcpyHostToDevice), cudaSuccess);
}

TEST(SparseDeviceBufferCuda, MoreThanTheGpuHasIsAUsageError) {
  KEEL_REQUIRE_GPU();
  const std::size_t tib = std::size_t(1) << 40;
  try {
    SparseDeviceBuffer buf(4 * tib, {{0, 2 * tib}}, "out of GPU memory: the huge buffer", "ask for less");
    FAIL() << "2 TiB were backed";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("out of GPU memory: the huge buffer need 2048.00 GiB"), std::string::npos) << m;
    EXPECT_NE(m.find("(ask for less)"), std::string::npos) << m;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "no sticky error left behind";
}

}  // namespace
}  // namespace keel
