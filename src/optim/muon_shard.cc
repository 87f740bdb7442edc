#include "optim/muon_shard.h"

#include <algorithm>
#include <numeric>

#include "common/error.h"
#include "optim/newton_schulz.h"

namespace keel::optim {

MuonShardPlan plan_muon_shards(const ParamLayout& layout, int world_size, int ns_steps) {
  if (world_size < 1) fail("muon shards: world size must be >= 1, got {}", world_size);
  MuonShardPlan plan;
  plan.rank_flops.assign(static_cast<std::size_t>(world_size), 0.0);
  plan.rank_floats.assign(static_cast<std::size_t>(world_size), 0);
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const auto& p = layout.params[i];
    if (p.optimizer != OptimizerKind::kMuon) continue;
    for (std::int64_t e = 0; e < p.matrices(); ++e) {
      MuonMatrix m;
      m.param = static_cast<int>(i);
      m.matrix = e;
      m.rows = p.rows();
      m.cols = p.cols();
      m.offset = p.offset + e * m.rows * m.cols;
      m.flops = newton_schulz_flops(m.rows, m.cols, ns_steps);
      plan.matrices.push_back(m);
    }
  }
  std::vector<std::size_t> order(plan.matrices.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return plan.matrices[a].flops > plan.matrices[b].flops; });
  for (std::size_t k : order) {
    auto it = std::min_element(plan.rank_flops.begin(), plan.rank_flops.end());
    int r = static_cast<int>(it - plan.rank_flops.begin());
    auto& m = plan.matrices[k];
    m.owner = r;
    plan.rank_flops[static_cast<std::size_t>(r)] += m.flops;
    plan.rank_floats[static_cast<std::size_t>(r)] += m.rows * m.cols;
  }
  return plan;
}

}  // namespace keel::optim
