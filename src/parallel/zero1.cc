#include "parallel/zero1.h"

#include <algorithm>

#include "common/error.h"

namespace keel::parallel {

std::int64_t Zero1Plan::largest() const {
  std::int64_t m = 0;
  for (int r = 0; r < ranks(); ++r) m = std::max(m, count(r));
  return m;
}

std::vector<MuonMatrixRef> muon_matrices_in(const optim::ParamLayout& layout, std::int64_t begin, std::int64_t end) {
  std::vector<MuonMatrixRef> out;
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const auto& p = layout.params[i];
    if (p.optimizer != optim::OptimizerKind::kMuon) continue;
    const std::int64_t size = p.rows() * p.cols();
    for (std::int64_t m = 0; m < p.matrices(); ++m) {
      const std::int64_t o = p.offset + m * size;
      if (o >= begin && o + size <= end) out.push_back({static_cast<int>(i), o, p.rows(), p.cols()});
    }
  }
  return out;
}

Zero1Plan plan_zero1(const optim::ParamLayout& layout, int ranks) {
  if (ranks < 1) fail("zero-1: the data-parallel group needs at least one rank, got {}", ranks);
  const std::int64_t total = layout.total_floats;
  // Muon matrices as [start, end) intervals in offset order: the places a cut may not fall.
  std::vector<std::pair<std::int64_t, std::int64_t>> whole;
  for (const auto& m : muon_matrices_in(layout, 0, total)) whole.emplace_back(m.offset, m.offset + m.rows * m.cols);
  std::sort(whole.begin(), whole.end());
  Zero1Plan plan;
  plan.bounds.assign(static_cast<std::size_t>(ranks) + 1, 0);
  plan.bounds.back() = total;
  for (int k = 1; k < ranks; ++k) {
    // the ideal cut, rounded to the alignment
    std::int64_t cut = (k * total / ranks + kZero1AlignFloats / 2) / kZero1AlignFloats * kZero1AlignFloats;
    cut = std::min(cut, total);
    // inside a Muon matrix (strictly): move to its nearer end
    auto it = std::upper_bound(whole.begin(), whole.end(), std::make_pair(cut, total + 1));
    if (it != whole.begin()) {
      const auto& [s, e] = *std::prev(it);
      if (cut > s && cut < e) cut = (cut - s <= e - cut) ? s : e;
    }
    plan.bounds[static_cast<std::size_t>(k)] = std::max(cut, plan.bounds[static_cast<std::size_t>(k) - 1]);
  }
  return plan;
}

optim::ParamLayout region_layout(const optim::ParamLayout& layout, std::int64_t begin, std::int64_t end) {
  optim::ParamLayout region;
  for (auto p : layout.params)
    if (p.offset >= begin && p.offset < end) p.offset -= begin, region.params.push_back(std::move(p));
  region.total_floats = end - begin;
  return region;
}

Zero1Plan plan_zero1_region(const optim::ParamLayout& layout, std::int64_t begin, std::int64_t end, int ranks) {
  Zero1Plan plan = plan_zero1(region_layout(layout, begin, end), ranks);
  for (auto& b : plan.bounds) b += begin;
  return plan;
}

}  // namespace keel::parallel
