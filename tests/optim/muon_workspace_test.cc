#include "optim/muon_workspace.h"

#include <gtest/gtest.h>

#include "common/error.h"

namespace keel::optim {
namespace {

TEST(MuonWorkspace, RegionsFollowEachOtherAligned) {
  // ZAYA1's expert stack: 16 matrices 2048 x 2048, Gram buffers as large as the iterates.
  const MuonWorkspaceLayout w = muon_workspace_layout(16, 2048, 2048);
  const std::size_t iterate = 2ull * 16 * 2048 * 2048;  // bf16
  EXPECT_EQ(w.x, 0u);
  EXPECT_EQ(w.y, iterate);
  EXPECT_EQ(w.a, 2 * iterate);
  EXPECT_EQ(w.b, 3 * iterate);
  EXPECT_EQ(w.partials, 4 * iterate);
  EXPECT_EQ(muon_reduction_chunks(2048 * 2048), 256);
  EXPECT_EQ(w.factor, w.partials + 8 * 16 * 256);
  EXPECT_EQ(w.bytes, w.factor + 256);  // 16 doubles, rounded up to 256 bytes
  // A tall matrix's Gram buffers are cols x cols; every region starts 256-byte aligned.
  const MuonWorkspaceLayout t = muon_workspace_layout(3, 1000, 7);
  EXPECT_EQ(t.b - t.a, (2u * 3 * 7 * 7 + 255) / 256 * 256);
  for (std::size_t at : {t.y, t.a, t.b, t.partials, t.factor, t.bytes}) EXPECT_EQ(at % 256, 0u);
  EXPECT_EQ(muon_reduction_chunks(1), 1);
  EXPECT_THROW(muon_workspace_layout(0, 4, 4), Error);
  EXPECT_THROW(muon_workspace_layout(1, 4, -1), Error);
}

TEST(MuonWorkspace, LargestOverTheLayoutsMuonParameters) {
  auto info = [](const char* name, std::vector<std::int64_t> shape, OptimizerKind k) {
    ParamInfo p;
    p.name = name;
    p.shape = shape;
    p.optimizer = k;
    p.numel = 1;
    for (auto d : shape) p.numel *= d;
    return p;
  };
  ParamLayout l;
  l.params = {info("embed", {1000, 64}, OptimizerKind::kAdamW), info("w", {64, 64}, OptimizerKind::kMuon),
              info("experts", {4, 128, 64}, OptimizerKind::kMuon)};
  EXPECT_EQ(muon_workspace_bytes(l), muon_workspace_layout(4, 128, 64).bytes);
  l.params.pop_back();
  l.params.pop_back();
  EXPECT_EQ(muon_workspace_bytes(l), 0u);  // AdamW only
}

}  // namespace
}  // namespace keel::optim
