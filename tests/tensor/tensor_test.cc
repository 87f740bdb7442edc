#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "common/error.h"
#include "tensor/arena.h"
#include "tensor/tensor.h"

namespace keel {
namespace {

TEST(TensorView, ShapeRowsAndReshape) {
  std::vector<float> buf(24);
  for (int i = 0; i < 24; ++i) buf[i] = float(i);
  Tensor t(buf.data(), {2, 3, 4});
  EXPECT_EQ(t.ndim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.dim(-1), 4);
  EXPECT_EQ(t.rows(), 6);
  EXPECT_EQ(t.row(2)[1], 9.f);
  EXPECT_EQ(t.shape_string(), "[2, 3, 4]");
  Tensor m = t.reshaped({6, 4});
  EXPECT_EQ(m.at(5, 3), 23.f);
  EXPECT_THROW(t.reshaped({5, 5}), Error);
  Tensor s = t.slice0(1, 1);
  EXPECT_TRUE(s.has_shape({1, 3, 4}));
  EXPECT_EQ(s[0], 12.f);
  EXPECT_THROW(t.slice0(1, 2), Error);
  EXPECT_THROW(Tensor(buf.data(), {1, 1, 1, 1, 1}), Error);
  EXPECT_THROW(require_shape(t, {2, 12}, "t"), Error);
  EXPECT_NO_THROW(require_shape(t, {2, 3, 4}, "t"));
  s.fill(1.f);
  EXPECT_EQ(buf[12], 1.f);
  EXPECT_EQ(buf[11], 11.f);
}

TEST(Arena, RegionsAreAlignedNamedAndReset) {
  Arena a("acts", 1000);
  EXPECT_EQ(a.capacity() % Arena::kAlignment, 0u);
  float* p = a.allocate<float>("x", 3);
  Tensor t = a.tensor("y", {5, 7});
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
  EXPECT_EQ(t[0], 0.f);  // fresh arenas are zero-filled
  EXPECT_EQ(a.used(), 64u + Arena::footprint(35 * 4));
  ASSERT_EQ(a.regions().size(), 2u);
  EXPECT_EQ(a.regions()[1].name, "y");
  EXPECT_EQ(a.find(t.data() + 3)->name, "y");
  EXPECT_EQ(a.find(p)->name, "x");
  t.fill(2.f);
  a.zero_used();
  EXPECT_EQ(t[34], 0.f);
  a.reset();
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.allocate<float>("z", 1), p);  // memory is reused from the start
}

TEST(Arena, CapacityErrorNamesArenaAndRegion) {
  Arena a("params", 256);
  a.allocate<float>("embed", 32);
  try {
    a.allocate<float>("layer0.w_up", 100);
    FAIL() << "expected keel::Error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("params"), std::string::npos) << m;
    EXPECT_NE(m.find("layer0.w_up"), std::string::npos) << m;
    EXPECT_NE(m.find("400 B"), std::string::npos) << m;
  }
  EXPECT_EQ(a.used(), 128u);  // a failed allocation leaves the arena as it was
}

}  // namespace
}  // namespace keel
