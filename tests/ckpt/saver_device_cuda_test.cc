// The checkpoint saver staging shards straight from GPU memory (SaveShard::on_device): pinned
// staging, one device-to-host copy, and the committed tensors equal the device data bit for bit,
// beside a host shard of the same save.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "../ops/cuda/cuda_test_util.h"
#include "ckpt/comm.h"
#include "ckpt/geometry.h"
#include "ckpt/reader.h"
#include "ckpt/writer.h"

namespace keel::ckpt {
namespace {

TEST(CkptSaverCuda, StagesDeviceShardsAndLoadsThemBitExact) {
  KEEL_REQUIRE_GPU();
  const std::string root = (std::filesystem::temp_directory_path() / ("keel_saver_cuda_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(root);
  const std::int64_t rows = 300, cols = 1000;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> host(rows * cols), side(4096);
  for (auto& v : host) v = nd(rng);
  for (auto& v : side) v = nd(rng);
  test::DeviceArray<float> dev(host.size());
  KEEL_CUDA_CHECK(cudaMemcpy(dev.get(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));

  // rows [100, 300) of the tensor from the device, rows [0, 100) from the host, and a host tensor beside it
  const Shape shape{rows, cols};
  std::vector<SaveShard> shards;
  auto add = [&](std::int64_t begin, std::int64_t end, const float* base, bool on_device) {
    for (auto& box : flat_range_boxes(shape, begin, end)) {
      SaveShard s;
      s.name = "dev";
      s.shape = shape;
      s.placement.dims.assign(2, {});
      s.data = base + box.offsets[0] * cols + box.offsets[1];
      s.box = box;
      s.write = true;
      s.on_device = on_device;
      shards.push_back(s);
    }
  };
  add(100 * cols, rows * cols, dev.get(), true);  // rows [100, 300) from the device
  add(0, 100 * cols, host.data(), false);         // the rest from the host copy
  SaveShard h;
  h.name = "side";
  h.shape = {4096};
  h.placement.dims.assign(1, {});
  h.box = full_box(h.shape);
  h.data = side.data();
  h.write = true;
  shards.push_back(h);

  auto comm = make_self_comm();
  Saver saver(*comm, root);
  saver.save(3, shards, {{"step", 3}}, {}, "");
  KEEL_CUDA_CHECK(cudaMemset(dev.get(), 0, host.size() * sizeof(float)));  // staged: the device may change at once
  ASSERT_TRUE(saver.wait());

  std::vector<float> got(host.size()), got_side(side.size());
  LoadRequest a;
  a.name = "dev";
  a.shape = shape;
  a.box = full_box(shape);
  a.data = got.data();
  LoadRequest b;
  b.name = "side";
  b.shape = {4096};
  b.box = full_box(b.shape);
  b.data = got_side.data();
  Reader(root).load({a, b});
  EXPECT_EQ(std::memcmp(got.data(), host.data(), host.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(got_side.data(), side.data(), side.size() * sizeof(float)), 0);
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace keel::ckpt
