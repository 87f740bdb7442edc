#include "parallel/zero1_buckets.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common/error.h"
#include "model/param_layout.h"

namespace keel::parallel {

std::optional<std::vector<std::int64_t>> overlap_stage_bounds(const optim::ParamLayout& layout, int layers,
                                                              std::int64_t replicated_end) {
  const int stage_count = model::stage_count(layers);
  std::vector<std::pair<std::int64_t, int>> at;  // (offset, stage)
  for (const auto& p : layout.params)
    if (p.offset < replicated_end) at.emplace_back(p.offset, model::param_stage(p.name, layers));
  std::sort(at.begin(), at.end());
  for (std::size_t i = 1; i < at.size(); ++i)
    if (at[i].second < at[i - 1].second) return std::nullopt;
  std::vector<std::int64_t> bounds(static_cast<std::size_t>(stage_count) + 1, replicated_end);
  bounds[0] = 0;
  for (int s = 1; s < stage_count; ++s)
    for (const auto& [offset, stage] : at)
      if (stage >= s) {
        bounds[static_cast<std::size_t>(s)] = offset;
        break;
      }
  return bounds;
}

const char* weight_split_classic_reason(bool weight_split, bool muon, bool expert_region) {
  if (!weight_split) return nullptr;
  if (muon) return "tensor parallelism (or TSP) with Muon on GPUs takes the classic step";
  if (expert_region) return "tensor parallelism (or TSP) with expert parallelism on GPUs takes the classic step";
  return nullptr;
}

std::int64_t largest_stage_floats(const std::vector<std::int64_t>& stage_bounds) {
  std::int64_t widest = 0;
  for (std::size_t s = 0; s + 1 < stage_bounds.size(); ++s) widest = std::max(widest, stage_bounds[s + 1] - stage_bounds[s]);
  return widest;
}

std::vector<Zero1Bucket> plan_zero1_buckets(const optim::ParamLayout& layout, const Zero1Plan& plan,
                                            const std::vector<std::int64_t>& stage_bounds,
                                            std::int64_t target_floats) {
  const std::int64_t total = layout.total_floats;
  if (target_floats < 1) fail("zero-1 buckets: target size {} floats", target_floats);
  if (stage_bounds.size() < 2 || stage_bounds.front() != 0 || stage_bounds.back() != total ||
      !std::is_sorted(stage_bounds.begin(), stage_bounds.end()))
    fail("zero-1 buckets: stage bounds must ascend from 0 to {}", total);
  if (plan.ranks() < 1 || plan.begin(0) != 0 || plan.end(plan.ranks() - 1) != total)
    fail("zero-1 buckets: the shard plan does not cover the {} floats of the buffer", total);

  // Forced cuts: stage and shard bounds. Allowed cuts: parameter ends, Muon matrix ends, and
  // every target inside an AdamW parameter.
  std::vector<std::int64_t> forced(stage_bounds.begin(), stage_bounds.end());
  forced.insert(forced.end(), plan.bounds.begin(), plan.bounds.end());
  std::sort(forced.begin(), forced.end());
  forced.erase(std::unique(forced.begin(), forced.end()), forced.end());
  std::vector<std::int64_t> allowed = forced;
  for (const auto& p : layout.params) {
    allowed.push_back(p.offset);
    allowed.push_back(p.offset + p.numel);
    if (p.optimizer == optim::OptimizerKind::kMuon) {
      const std::int64_t size = p.rows() * p.cols();
      for (std::int64_t m = 1; m < p.matrices(); ++m) allowed.push_back(p.offset + m * size);
    } else {
      for (std::int64_t c = p.offset + target_floats; c < p.offset + p.numel; c += target_floats) {
        const std::int64_t a = c / kZero1AlignFloats * kZero1AlignFloats;
        if (a > p.offset) allowed.push_back(a);
      }
    }
  }
  std::sort(allowed.begin(), allowed.end());
  allowed.erase(std::unique(allowed.begin(), allowed.end()), allowed.end());

  const auto index_of = [](const std::vector<std::int64_t>& bounds, std::int64_t at) {
    // the range [bounds[i], bounds[i + 1]) holding `at`, skipping empty ranges
    const auto it = std::upper_bound(bounds.begin(), bounds.end(), at);
    return static_cast<int>(it - bounds.begin()) - 1;
  };
  std::vector<Zero1Bucket> out;
  for (std::size_t f = 0; f + 1 < forced.size(); ++f) {
    const std::int64_t seg_end = forced[f + 1];
    std::int64_t pos = forced[f];
    while (pos < seg_end) {
      // the farthest allowed cut within the target, else the nearest one past it
      auto first = std::upper_bound(allowed.begin(), allowed.end(), pos);
      auto limit = std::upper_bound(first, allowed.end(), std::min(pos + target_floats, seg_end));
      const std::int64_t cut = limit != first ? *std::prev(limit) : std::min(*first, seg_end);
      Zero1Bucket b;
      b.begin = pos;
      b.end = cut;
      b.owner = index_of(plan.bounds, pos);
      b.stage = index_of(stage_bounds, pos);
      out.push_back(b);
      pos = cut;
    }
  }
  return out;
}

std::int64_t Zero1OverlapOptions::bucket_floats() const {
  const double floats = bucket_mib * 1048576.0 / 4.0;
  const std::int64_t n = static_cast<std::int64_t>(floats) / kZero1AlignFloats * kZero1AlignFloats;
  return std::max<std::int64_t>(n, kZero1AlignFloats);
}

}  // namespace keel::parallel
