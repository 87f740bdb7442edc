#include "parallel/zero1.h"

#include <algorithm>

#include "common/error.h"
#include "optim/muon.h"
#include "optim/newton_schulz.h"

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

namespace {

// One piece of the flat buffer with a uniform optimizer cost per float: a Muon matrix (cut only
// at its ends) or a run of AdamW parameters and padding (cut at any multiple of
// kZero1AlignFloats or at its ends).
struct Piece {
  std::int64_t begin = 0, end = 0;
  double cost_per_float = 1;
  bool whole = false;  // a Muon matrix
};

// The pieces of [0, total) in offset order, and the running cost at each piece's begin.
struct CostLine {
  std::vector<Piece> pieces;
  std::vector<double> cost_before;  // pieces.size() + 1 entries
  std::int64_t total = 0;

  explicit CostLine(const optim::ParamLayout& layout) : total(layout.total_floats) {
    std::vector<Piece> whole;
    for (const auto& m : muon_matrices_in(layout, 0, total))
      whole.push_back({m.offset, m.offset + m.rows * m.cols, zero1_muon_cost_per_float(m.rows, m.cols), true});
    std::sort(whole.begin(), whole.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
    std::int64_t at = 0;
    for (const Piece& w : whole) {
      if (w.begin > at) pieces.push_back({at, w.begin, 1.0, false});
      pieces.push_back(w);
      at = w.end;
    }
    if (at < total) pieces.push_back({at, total, 1.0, false});
    cost_before.assign(pieces.size() + 1, 0.0);
    for (std::size_t i = 0; i < pieces.size(); ++i)
      cost_before[i + 1] = cost_before[i] + pieces[i].cost_per_float * double(pieces[i].end - pieces[i].begin);
  }

  double total_cost() const { return cost_before.back(); }
  // the piece holding offset x (x < total)
  std::size_t piece_at(std::int64_t x) const {
    const auto it =
        std::upper_bound(pieces.begin(), pieces.end(), x, [](std::int64_t v, const Piece& p) { return v < p.begin; });
    return static_cast<std::size_t>(it - pieces.begin()) - 1;
  }
  double cost_to(std::int64_t x) const {
    if (x >= total) return total_cost();
    const std::size_t i = piece_at(x);
    return cost_before[i] + pieces[i].cost_per_float * double(x - pieces[i].begin);
  }
  // the largest offset whose running cost is at most c
  std::int64_t offset_at_cost(double c) const {
    if (c >= total_cost()) return total;
    const auto i = static_cast<std::size_t>(std::upper_bound(cost_before.begin(), cost_before.end(), c) -
                                            cost_before.begin()) - 1;
    const Piece& p = pieces[i];
    return std::min(p.end, p.begin + static_cast<std::int64_t>((c - cost_before[i]) / p.cost_per_float));
  }
  // the largest legal cut <= x
  std::int64_t cut_at_or_before(std::int64_t x) const {
    if (x >= total) return total;
    const Piece& p = pieces[piece_at(x)];
    if (p.whole) return p.begin;
    return std::max(p.begin, x / kZero1AlignFloats * kZero1AlignFloats);
  }
};

// Each rank in turn takes the longest shard within `bound` times the mean floats and the mean
// cost; false when the ranks run out before the buffer does. Taking the longest shard first
// never hurts the ranks after it, so this decides whether any contiguous plan meets the bound.
bool fill_within(const CostLine& line, int ranks, double bound, std::vector<std::int64_t>& bounds) {
  const double floats_cap = bound * double(line.total) / ranks, cost_cap = bound * line.total_cost() / ranks;
  bounds.assign(static_cast<std::size_t>(ranks) + 1, 0);
  std::int64_t at = 0;
  for (int r = 0; r < ranks; ++r) {
    const std::int64_t by_floats = at + static_cast<std::int64_t>(floats_cap);
    const std::int64_t by_cost = line.offset_at_cost(line.cost_to(at) + cost_cap);
    at = std::max(at, line.cut_at_or_before(std::min(by_floats, by_cost)));
    bounds[static_cast<std::size_t>(r) + 1] = at;
  }
  return at == line.total;
}

// Cuts at the ideal k * total / ranks (rounded to the alignment), moved to the nearer end of a
// Muon matrix they fall inside.
std::vector<std::int64_t> cut_by_floats(const CostLine& line, int ranks) {
  const std::int64_t total = line.total;
  std::vector<std::int64_t> bounds(static_cast<std::size_t>(ranks) + 1, 0);
  bounds.back() = total;
  for (int k = 1; k < ranks; ++k) {
    std::int64_t cut = (k * total / ranks + kZero1AlignFloats / 2) / kZero1AlignFloats * kZero1AlignFloats;
    cut = std::min(cut, total);
    if (cut < total) {
      const Piece& p = line.pieces[line.piece_at(cut)];
      if (p.whole && cut > p.begin) cut = (cut - p.begin <= p.end - cut) ? p.begin : p.end;
    }
    bounds[static_cast<std::size_t>(k)] = std::max(cut, bounds[static_cast<std::size_t>(k) - 1]);
  }
  return bounds;
}

Zero1Balance balance_of(const CostLine& line, const std::vector<std::int64_t>& bounds) {
  const int ranks = static_cast<int>(bounds.size()) - 1;
  const double mean_floats = double(line.total) / ranks, mean_cost = line.total_cost() / ranks;
  Zero1Balance b;
  for (std::size_t r = 0; r + 1 < bounds.size(); ++r) {
    if (mean_floats > 0) b.floats = std::max(b.floats, double(bounds[r + 1] - bounds[r]) / mean_floats);
    if (mean_cost > 0) b.cost = std::max(b.cost, (line.cost_to(bounds[r + 1]) - line.cost_to(bounds[r])) / mean_cost);
  }
  return b;
}

}  // namespace

double zero1_muon_cost_per_float(std::int64_t rows, std::int64_t cols) {
  const double floats = double(rows) * double(cols);
  return 1.0 + optim::newton_schulz_flops(rows, cols, optim::MuonConfig{}.ns_steps) / floats / kZero1FlopsPerAdamWFloat;
}

Zero1Balance zero1_balance(const optim::ParamLayout& layout, const Zero1Plan& plan) {
  return balance_of(CostLine(layout), plan.bounds);
}

Zero1Plan plan_zero1(const optim::ParamLayout& layout, int ranks) {
  if (ranks < 1) fail("zero-1: the data-parallel group needs at least one rank, got {}", ranks);
  const CostLine line(layout);
  Zero1Plan plan;
  plan.bounds = cut_by_floats(line, ranks);
  if (line.total == 0 || ranks == 1) return plan;
  // The least bound any contiguous plan meets, by bisection (`ranks` always works: one rank
  // can hold everything).
  std::vector<std::int64_t> bounds;
  double lo = 1.0, hi = ranks;
  for (int i = 0; i < 50 && hi - lo > 1e-6 * lo; ++i) {
    const double mid = 0.5 * (lo + hi);
    (fill_within(line, ranks, mid, bounds) ? hi : lo) = mid;
  }
  fill_within(line, ranks, hi, bounds);
  // Keep the cut by floats unless the busiest rank gains more than 0.1% (for AdamW alone, or
  // a layout whose costs follow its floats, the cuts stay where they were).
  if (balance_of(line, bounds).worst() < balance_of(line, plan.bounds).worst() / 1.001) plan.bounds = std::move(bounds);
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
