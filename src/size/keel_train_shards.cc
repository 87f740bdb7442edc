#include "size/keel_train_shards.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <tuple>

#include "common/error.h"
#include "hw/gemm_model.h"
#include "optim/muon.h"
#include "optim/muon_workspace.h"
#include "parallel/plan.h"
#include "parallel/zero1.h"
#include "parallel/zero1_buckets.h"
#include "train/backend.h"
#include "train/model.h"
#include "train/param_rules.h"

namespace keel::size {

double KeelTrainShards::busiest_optimizer_floats() const {
  return rank_optimizer_floats.empty() ? 0 : *std::max_element(rank_optimizer_floats.begin(), rank_optimizer_floats.end());
}

double KeelTrainShards::busiest_optimizer_bytes() const {
  double most = 0;
  for (std::size_t r = 0; r < rank_optimizer_floats.size() && r < rank_adamw_floats.size(); ++r)
    most = std::max(most, 4 * (2 * rank_optimizer_floats[r] + rank_adamw_floats[r]));
  return most;
}

double KeelTrainShards::mean_optimizer_floats() const {
  if (rank_optimizer_floats.empty()) return 0;
  return std::accumulate(rank_optimizer_floats.begin(), rank_optimizer_floats.end(), 0.0) /
         static_cast<double>(rank_optimizer_floats.size());
}

int KeelTrainShards::busiest_muon_rank() const {
  if (rank_muon_seconds.empty()) return 0;
  return static_cast<int>(std::max_element(rank_muon_seconds.begin(), rank_muon_seconds.end()) - rank_muon_seconds.begin());
}

namespace {

bool keel_train_runs(const Setup& s) {
  const mesh::Shape& l = s.layout;
  if (l.tsp != 1 || l.pp != 1) return false;
  if (l.dp > 1 && l.zero != 1) return false;
  train::ModelOptions o;
  o.micro_batch = s.micro_batch;
  o.seq_length = static_cast<int>(std::min<std::int64_t>(s.seq, std::numeric_limits<int>::max()));
  o.ce_chunk = s.ce_chunk;
  try {
    train::validate_trainable(s.model, o);
    parallel::check_plan(s.model, l);
    parallel::check_context_split(o.seq_length, l.cp, parallel::context_halo(s.model), "keel size");
  } catch (const UsageError&) {
    return false;
  }
  return true;
}

// Newton-Schulz of the Muon matrices in [begin, end), consecutive matrices of one stack stepped
// together as keel train's muon_step_range() does. A matrix split over the tensor axis is
// orthogonalized whole on one rank of its group, the owners rotating: 1/tp of its whole cost per
// rank. The matrices are listed once, in offset
// order, so a range costs a binary search and its own matrices (ranks can number thousands).
struct MuonRange {
  const hw::GemmModel& gm;
  const optim::ParamLayout& layout;
  int tp;
  std::vector<parallel::MuonMatrixRef> all;
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t>, OptimizerStepEstimate> cache;

  MuonRange(const optim::ParamLayout& l, const hw::GemmModel& g, int tensor)
      : gm(g), layout(l), tp(tensor), all(parallel::muon_matrices_in(l, 0, l.total_floats)) {
    std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  }

  OptimizerStepEstimate operator()(std::int64_t begin, std::int64_t end) {
    OptimizerStepEstimate sum;
    auto i = std::lower_bound(all.begin(), all.end(), begin, [](const auto& m, std::int64_t o) { return m.offset < o; });
    auto inside = [&](auto it) { return it != all.end() && it->offset + it->rows * it->cols <= end; };
    while (inside(i)) {
      auto j = i + 1;
      while (inside(j) && j->param == i->param) ++j;
      std::int64_t rows = i->rows, cols = i->cols;
      const auto& p = layout.params[static_cast<std::size_t>(i->param)];
      const bool split = tp > 1 && p.placement.splits(mesh::Axis::kTensor);
      if (split) (p.placement.dims.back().empty() ? rows : cols) *= tp;
      const std::tuple key{rows, cols, static_cast<std::int64_t>(j - i)};
      auto it = cache.find(key);
      if (it == cache.end()) it = cache.emplace(key, newton_schulz_estimate(gm, rows, cols, std::get<2>(key))).first;
      sum.flops_total += it->second.flops_total / (split ? tp : 1);
      sum.seconds += it->second.seconds / (split ? tp : 1);
      i = j;
    }
    sum.flops_per_gpu = sum.flops_total;
    return sum;
  }
};

}  // namespace

std::optional<KeelTrainShards> keel_train_shards(const Setup& s) {
  if (!keel_train_runs(s)) return std::nullopt;
  const mesh::Shape& l = s.layout;
  mesh::Shape shape;  // as rank 0 (the plans in the result cover every rank; tensor ranks alike)
  shape.dp = l.dp;
  shape.cp = l.cp;
  const int data = l.dp * l.cp;  // the data group: ZeRO-1 shards over dp x cp
  shape.tp = l.tp;
  shape.ep = l.ep;
  optim::ParamLayout layout = model::param_layout(s.model, shape);
  const bool muon = s.optimizer == Optimizer::kMuon;
  if (muon) {
    train::MuonTrainOptions m;
    m.enabled = true;
    layout = train::regroup_layout(layout, train::train_group_rules(m));
  }
  const train::StateShards sh = train::plan_state_shards(layout, shape, mesh::Coord{});
  const std::int64_t total = layout.total_floats;
  const bool experts = sh.replicated_end < total;

  const hw::GemmModel gm(s.hardware.profile, s.hardware.gemm_profile);
  MuonRange muon_range(layout, gm, l.tp);
  KeelTrainShards k;
  // Rank r of the data group is rank r % ep of its expert group and rank r / ep of its
  // expert-data group (parallel::Mesh: expert groups are ep consecutive ranks).
  for (int r = 0; r < data; ++r) {
    std::int64_t rb = 0, re = sh.replicated_end;
    if (data > 1) rb = sh.replicated.begin(r), re = sh.replicated.end(r);
    std::int64_t xb = 0, xe = 0;
    if (experts) xb = sh.experts.begin(r / l.ep), xe = sh.experts.end(r / l.ep);
    k.rank_optimizer_floats.push_back(static_cast<double>((re - rb) + (xe - xb)));
    const train::StateSlice slice{l.ep, r % l.ep, rb, re, xb, xe, l.tp, 0};
    double adamw = 0;
    for (const train::MomentSpan& sp : train::adamw_moment_spans(layout, slice)) adamw += static_cast<double>(sp.count);
    k.rank_adamw_floats.push_back(adamw);
    if (muon) {
      const OptimizerStepEstimate a = muon_range(rb, re), b = muon_range(xb, xe);
      k.rank_muon_flops.push_back(a.flops_total + b.flops_total);
      k.rank_muon_seconds.push_back(a.seconds + b.seconds);
    }
  }
  if (muon) {
    k.muon_workspace_bytes = static_cast<double>(optim::muon_workspace_bytes(layout));
    // The replicated region once, and every expert group's copy of the expert region (per
    // tensor rank: the split matrices. 1/tp share each; a replicated one on every tensor rank).
    k.muon_flops_total = l.tp * muon_range(0, sh.replicated_end).flops_total;
    if (experts) k.muon_flops_total += l.tp * l.ep * muon_range(sh.replicated_end, total).flops_total;
  }
  if (s.grad_reduce_bf16 && data > 1) {
    // keel train's GPU step: the overlapped one (a stage's scratch), but tensor parallelism (or
    // TSP) with Muon or expert parallelism takes the classic one (train/cuda_backend_cuda.cc)
    const bool classic = parallel::weight_split_classic_reason(l.tp > 1 || l.tsp > 1, muon, experts) != nullptr;
    const auto stages = classic ? std::nullopt : parallel::overlap_stage_bounds(layout, s.model.layers, sh.replicated_end);
    if (stages) {
      k.bf16_reduce_scratch = static_cast<double>(parallel::largest_stage_floats(*stages));
      if (experts && data / l.ep > 1)
        k.bf16_reduce_scratch = std::max(k.bf16_reduce_scratch, static_cast<double>(total - sh.replicated_end));
    } else {
      k.bf16_reduce_scratch = static_cast<double>(total);  // the classic step's bf16 copy of the buffer
    }
  }
  return k;
}

}  // namespace keel::size
