#include "optim/muon_workspace.h"

#include <algorithm>

#include "common/error.h"

namespace keel::optim {

namespace {

constexpr std::int64_t kReductionThreads = 256;  // the device kernels' block size
constexpr std::int64_t kElementsPerThread = 16;

std::size_t round_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

std::int64_t muon_reduction_chunks(std::int64_t elements) {
  const std::int64_t per_block = kReductionThreads * kElementsPerThread;
  return std::clamp<std::int64_t>((elements + per_block - 1) / per_block, 1, 256);
}

MuonWorkspaceLayout muon_workspace_layout(std::int64_t matrices, std::int64_t rows, std::int64_t cols) {
  if (matrices < 1 || rows < 1 || cols < 1) fail("muon: bad matrix batch {} x [{}, {}]", matrices, rows, cols);
  const auto m = static_cast<std::size_t>(matrices), mn = static_cast<std::size_t>(rows * cols);
  const auto s = static_cast<std::size_t>(std::min(rows, cols));
  MuonWorkspaceLayout w;
  auto take = [&w](std::size_t bytes) {
    const std::size_t at = w.bytes;
    w.bytes += round_up(bytes);
    return at;
  };
  w.x = take(2 * m * mn);  // bf16
  w.y = take(2 * m * mn);
  w.a = take(2 * m * s * s);
  w.b = take(2 * m * s * s);
  w.partials = take(sizeof(double) * m * static_cast<std::size_t>(muon_reduction_chunks(rows * cols)));
  w.factor = take(sizeof(double) * m);
  return w;
}

std::size_t muon_workspace_bytes(const ParamLayout& layout) {
  std::size_t n = 0;
  for (const auto& p : layout.params)
    if (p.optimizer == OptimizerKind::kMuon)
      n = std::max(n, muon_workspace_layout(p.matrices(), p.rows(), p.cols()).bytes);
  return n;
}

}  // namespace keel::optim
