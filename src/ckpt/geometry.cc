#include "ckpt/geometry.h"

#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "common/error.h"

namespace keel::ckpt {

std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.ndim() != b.ndim()) return std::nullopt;
  Box r;
  r.offsets.resize(a.ndim());
  r.lengths.resize(a.ndim());
  for (std::size_t d = 0; d < a.ndim(); ++d) {
    const std::int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const std::int64_t hi = std::min(a.offsets[d] + a.lengths[d], b.offsets[d] + b.lengths[d]);
    if (hi <= lo) return std::nullopt;
    r.offsets[d] = lo;
    r.lengths[d] = hi - lo;
  }
  if (a.empty() || b.empty()) return std::nullopt;
  return r;
}

void for_each_run(const Box& part, const Box& src_box, const Box& dst_box, const std::function<void(const Run&)>& f) {
  const std::size_t nd = part.ndim();
  if (part.empty()) return;
  if (nd == 0) {
    f(Run{0, 0, 1});
    return;
  }
  // Row-major strides of both boxes.
  std::vector<std::int64_t> ss(nd, 1), ds(nd, 1);
  for (std::size_t d = nd - 1; d > 0; --d) {
    ss[d - 1] = ss[d] * src_box.lengths[d];
    ds[d - 1] = ds[d] * dst_box.lengths[d];
  }
  // Collapse trailing dimensions that part spans fully in both boxes.
  std::size_t j = nd - 1;
  std::int64_t run = part.lengths[j];
  while (j > 0 && part.lengths[j] == src_box.lengths[j] && part.lengths[j] == dst_box.lengths[j]) {
    --j;
    run *= part.lengths[j];
  }
  // Iterate over the outer dimensions [0, j).
  std::vector<std::int64_t> idx(j, 0);
  while (true) {
    std::int64_t so = 0, dof = 0;
    for (std::size_t d = 0; d < nd; ++d) {
      const std::int64_t g = part.offsets[d] + (d < j ? idx[d] : 0);
      so += (g - src_box.offsets[d]) * ss[d];
      dof += (g - dst_box.offsets[d]) * ds[d];
    }
    f(Run{so, dof, run});
    std::size_t d = j;
    while (d > 0) {
      --d;
      if (++idx[d] < part.lengths[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (j == 0) return;
  }
}

namespace {
std::int64_t start0(const Box& b) { return b.ndim() ? b.offsets[0] : 0; }
std::int64_t end0(const Box& b) { return b.ndim() ? b.offsets[0] + b.lengths[0] : 1; }
}  // namespace

ShardIndex::ShardIndex(const std::vector<Box>& boxes) {
  original_.resize(boxes.size());
  std::iota(original_.begin(), original_.end(), 0);
  std::stable_sort(original_.begin(), original_.end(),
                   [&](std::size_t a, std::size_t b) { return start0(boxes[a]) < start0(boxes[b]); });
  boxes_.reserve(boxes.size());
  max_end_.reserve(boxes.size());
  std::int64_t m = 0;
  for (std::size_t i : original_) {
    boxes_.push_back(boxes[i]);
    m = std::max(m, end0(boxes[i]));
    max_end_.push_back(m);
  }
}

std::vector<std::size_t> ShardIndex::query(const Box& q) const {
  std::vector<std::size_t> out;
  if (q.empty()) return out;
  const std::int64_t qs = start0(q), qe = end0(q);
  // Candidates start before the query ends; walk back while some earlier box still reaches qs.
  std::size_t hi = static_cast<std::size_t>(
      std::lower_bound(boxes_.begin(), boxes_.end(), qe, [](const Box& b, std::int64_t v) { return start0(b) < v; }) -
      boxes_.begin());
  for (std::size_t i = hi; i > 0; --i) {
    if (max_end_[i - 1] <= qs) break;
    if (intersect(boxes_[i - 1], q)) out.push_back(original_[i - 1]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// The dimension along which the boxes' starts take the most distinct values: sweeping along it
// keeps the set of boxes whose intervals are open at once small.
std::size_t sweep_dimension(const std::vector<Box>& boxes, const std::vector<std::size_t>& live) {
  const std::size_t nd = boxes[live.front()].ndim();
  std::size_t best = 0, best_count = 0;
  for (std::size_t d = 0; d < nd; ++d) {
    std::vector<std::int64_t> starts;
    starts.reserve(live.size());
    for (std::size_t i : live) starts.push_back(boxes[i].offsets[d]);
    std::sort(starts.begin(), starts.end());
    const auto count = static_cast<std::size_t>(std::unique(starts.begin(), starts.end()) - starts.begin());
    if (count > best_count) best = d, best_count = count;
  }
  return best;
}

}  // namespace

std::optional<std::pair<std::size_t, std::size_t>> find_overlap(const std::vector<Box>& boxes) {
  std::vector<std::size_t> live;  // non-empty boxes: an empty one holds no element to share
  for (std::size_t i = 0; i < boxes.size(); ++i)
    if (!boxes[i].empty()) live.push_back(i);
  if (live.size() < 2) return std::nullopt;
  auto ordered = [](std::size_t a, std::size_t b) { return std::make_pair(std::min(a, b), std::max(a, b)); };
  if (boxes[live[0]].ndim() == 0) return ordered(live[0], live[1]);  // 0-d: every box is the one element
  const std::size_t d = sweep_dimension(boxes, live);
  std::stable_sort(live.begin(), live.end(),
                   [&](std::size_t a, std::size_t b) { return boxes[a].offsets[d] < boxes[b].offsets[d]; });
  std::vector<std::size_t> open;  // boxes whose interval along d may still reach the next start
  for (std::size_t i : live) {
    const std::int64_t start = boxes[i].offsets[d];
    std::erase_if(open, [&](std::size_t k) { return boxes[k].offsets[d] + boxes[k].lengths[d] <= start; });
    for (std::size_t k : open)
      if (intersect(boxes[k], boxes[i])) return ordered(k, i);
    open.push_back(i);
  }
  return std::nullopt;
}

namespace {

// Appends the boxes of [begin, end) of the sub-tensor shape[d:] with the leading indices fixed
// at `prefix` (one per dimension before d).
void flat_boxes(const Shape& shape, std::size_t d, Shape& prefix, std::int64_t begin, std::int64_t end,
                std::vector<Box>& out) {
  if (begin >= end) return;
  auto emit = [&](std::int64_t lo, std::int64_t n) {  // dims >= d: [lo, lo + n) along d, the rest whole
    Box b;
    b.offsets = prefix;
    b.lengths.assign(prefix.size(), 1);
    b.offsets.push_back(lo);
    b.lengths.push_back(n);
    for (std::size_t k = d + 1; k < shape.size(); ++k) b.offsets.push_back(0), b.lengths.push_back(shape[k]);
    out.push_back(std::move(b));
  };
  std::int64_t inner = 1;
  for (std::size_t k = d + 1; k < shape.size(); ++k) inner *= shape[k];
  if (d + 1 == shape.size() || inner == 0) return emit(begin, end - begin);
  std::int64_t first = begin / inner, last = end / inner;  // whole rows [first, last) after the head
  if (begin % inner != 0) {
    prefix.push_back(first);
    flat_boxes(shape, d + 1, prefix, begin % inner, first == last ? end % inner : inner, out);
    prefix.pop_back();
    if (first == last) return;
    ++first;
  }
  if (first < last) emit(first, last - first);
  if (end % inner != 0) {
    prefix.push_back(last);
    flat_boxes(shape, d + 1, prefix, 0, end % inner, out);
    prefix.pop_back();
  }
}

}  // namespace

std::vector<Box> flat_range_boxes(const Shape& shape, std::int64_t begin, std::int64_t end) {
  const std::int64_t n = numel(shape);
  if (begin < 0 || end > n || begin > end) fail("flat range [{}, {}) is outside a tensor of {} elements", begin, end, n);
  std::vector<Box> out;
  if (shape.empty()) {
    if (begin < end) out.push_back(Box{});
    return out;
  }
  Shape prefix;
  flat_boxes(shape, 0, prefix, begin, end, out);
  return out;
}

std::string coverage_problem(const Shape& shape, const std::vector<Box>& boxes) {
  std::vector<Box> nonempty;
  for (const Box& b : boxes) {
    if (!box_within(b, shape)) return fmt::format("shard {} lies outside the tensor {}", box_str(b), shape_str(shape));
    if (!b.empty()) nonempty.push_back(b);
  }
  if (const auto pair = find_overlap(nonempty))
    return fmt::format("shards {} and {} overlap", box_str(nonempty[pair->first]), box_str(nonempty[pair->second]));
  std::int64_t total = 0;  // disjoint boxes inside the tensor: the sum cannot exceed numel
  for (const Box& b : nonempty) total += b.volume();
  if (total != numel(shape))
    return fmt::format("shards hold {} of {} elements: the checkpoint does not cover the whole tensor", total,
                       numel(shape));
  return "";
}

}  // namespace keel::ckpt
