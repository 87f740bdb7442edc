// What the tensor-parallel and TSP training tests share: walking a rank's parameter blocks
// against the whole model's buffer (model::block_pieces), and the comparison of a GPU group's
// first step and training with one GPU's at bf16 tolerance.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../mpi_test_util.h"
#include "model/param_layout.h"
#include "train/trainer.h"

namespace keel::train::fixtures {

// For every element of every parameter block this rank holds: f(name, local value, the same
// element of the whole model's `whole` buffer[, its flat offset in `values`]) — the blocks
// mapped through model::block_pieces.
template <typename F>
void for_each_element(const optim::ParamLayout& local, const std::vector<float>& values, const parallel::Mesh& mesh,
                      const optim::ParamLayout& whole_layout, const std::vector<float>& whole, F&& f) {
  std::map<std::string, const optim::ParamInfo*> by_name;
  for (const auto& p : whole_layout.params) by_name[p.name] = &p;
  for (const auto& p : local.params) {
    const optim::ParamInfo& w = *by_name.at(p.name);
    const std::size_t nd = p.shape.size();
    // TSP's blocks are a tensor rank's (model::weight_shape folds the axis into the tensor one)
    for (const model::BlockPiece& piece : model::block_pieces(p, model::weight_shape(mesh.shape()),
                                                              model::weight_coord(mesh.shape(), mesh.coord()))) {
      std::vector<std::int64_t> idx(nd, 0);  // index inside the piece
      std::int64_t count = 1;
      for (auto e : piece.extent) count *= e;
      for (std::int64_t k = 0; k < count; ++k) {
        std::int64_t rem = k, local_flat = 0, global_flat = 0, lstride = 1, gstride = 1;
        for (std::size_t d = nd; d-- > 0;) {
          idx[d] = rem % piece.extent[d];
          rem /= piece.extent[d];
        }
        for (std::size_t d = nd; d-- > 0;) {
          const std::int64_t li = d == 0 ? piece.local_row + idx[0] : idx[d];
          local_flat += li * lstride;
          global_flat += (piece.offset[d] + idx[d]) * gstride;
          lstride *= p.shape[d];
          gstride *= p.global_shape[d];
        }
        const std::int64_t at = p.offset + local_flat;
        const float a = values[static_cast<std::size_t>(at)], b = whole[static_cast<std::size_t>(w.offset + global_flat)];
        if constexpr (std::is_invocable_v<F&, const std::string&, float, float, std::int64_t>)
          f(p.name, a, b, at);
        else
          f(p.name, a, b);
      }
    }
  }
}

// The largest difference relative to the largest value over this rank's blocks.
inline double max_rel_diff(const optim::ParamLayout& local, const std::vector<float>& values,
                           const parallel::Mesh& mesh, const optim::ParamLayout& whole_layout,
                           const std::vector<float>& whole) {
  double num = 0, den = 0;
  for_each_element(local, values, mesh, whole_layout, whole, [&](const std::string&, float a, float b) {
    num = std::max(num, std::fabs(double(a) - b));
    den = std::max(den, std::fabs(double(b)));
  });
  return den > 0 ? num / den : num;
}

// Step 1's routing of a GPU group against one GPU's: the same counts per MoE layer and class but
// for at most `moved` of the routing slots (near-ties that rounding tips the other way; 0:
// exactly the same).
inline void expect_routing_close(const StepStats& a, const StepStats& b, double moved, const std::string& tag) {
  if (moved == 0) {
    EXPECT_EQ(a.routing_counts, b.routing_counts) << tag << ": step 1 routed differently (a near-tie; see above)";
    return;
  }
  ASSERT_EQ(a.routing_counts.size(), b.routing_counts.size()) << tag;
  for (std::size_t m = 0; m < a.routing_counts.size(); ++m) {
    double diff = 0, total = 0;
    ASSERT_EQ(a.routing_counts[m].size(), b.routing_counts[m].size()) << tag;
    for (std::size_t e = 0; e < a.routing_counts[m].size(); ++e)
      diff += std::fabs(double(a.routing_counts[m][e]) - b.routing_counts[m][e]), total += b.routing_counts[m][e];
    EXPECT_LE(diff / 2, moved * total) << tag << ": step 1, MoE layer " << m << " routed too differently";
  }
}

// A GPU group (a GPU per rank, `group` run over `mesh`) against one GPU (`one`, the same run on
// each rank alone). They agree only to bf16 rounding (the group sums partial outputs of GEMMs of
// other shapes, in bf16 for the attention outputs), so the comparison is of the first step, as
// for data parallelism (data_parallel_mpi_test.cc): loss, gradient norm and every gradient
// block (norm-relative per parameter); then the remaining steps (8 or more) must learn, end near
// the one-GPU loss, and every parameter not split over the group must hold the same bits on
// every rank. The gradient comparison needs the same routing on both sides: a rounding
// difference that moves one token of a 32-token batch to another expert changes that expert's
// gradient by several percent, so the step's routing counts must be equal (the caller's seed
// picks a batch without such a near-tie; should a change of rounding create one, that
// assertion, not a gradient, fails). With thousands of tokens near-ties are certain and one
// token weighs little: `moved` is the share of routing slots allowed to differ there.
// `learns`: the last loss must be below this fraction of the first. CCA's temperature gradient is a sum of large terms that
// cancel (it can be near 0): its error is measured against the whole gradient's norm instead.
// With data parallelism (ZeRO-1 reduce-scatters the gradients in place) the gradient blocks are
// compared inside this rank's optimizer shards (with expert parallelism also its expert shard),
// where they are whole.
// Muon's updates are not compared: Newton-Schulz lifts the small singular values of a low-rank
// gradient (32 tokens) to order 1, rounding noise included (the split Muon step is compared
// with the whole-matrix step in tests/parallel/tensor_parallel_muon_cuda_mpi_test.cc).
inline void expect_gpu_group_matches_one_gpu(const TrainConfig& group, const parallel::Mesh& mesh,
                                             const TrainConfig& one, const std::string& tag, double moved = 0,
                                             double learns = 0.7) {
  Trainer t(group, mesh, true);
  Trainer single(one, parallel::Mesh(), true);
  ASSERT_LT(max_rel_diff(t.backend().layout(), t.backend().state().params, mesh, single.backend().layout(),
                         single.backend().state().params),
            1e-7)
      << tag << ": the same initialization";
  const StepStats a = t.run(1).at(0), b = single.run(1).at(0);
  EXPECT_NEAR(a.loss, b.loss, 2e-3 * std::fabs(b.loss)) << tag;
  EXPECT_NEAR(a.grad_norm, b.grad_norm, 2e-2 * b.grad_norm) << tag;
  expect_routing_close(a, b, moved, tag);
  std::map<std::string, std::pair<double, double>> err;  // per parameter: sum of squared differences, of squares
  const std::vector<MomentRange> shards = moment_ranges(t.backend().state_slice());  // + the expert shard
  const auto in_shards = [&](std::int64_t at) {
    for (const MomentRange& r : shards)
      if (at >= r.begin && at < r.end) return true;
    return false;
  };
  std::int64_t compared = 0, shard_floats = 0;
  for (const MomentRange& r : shards) shard_floats += r.end - r.begin;
  for_each_element(t.backend().layout(), t.backend().gradients(), mesh, single.backend().layout(),
                   single.backend().gradients(), [&](const std::string& name, float g, float w, std::int64_t at) {
                     if (mesh.data().size > 1 && !in_shards(at)) return;
                     ++compared;
                     auto& e = err[name];
                     e.first += (double(g) - w) * (double(g) - w);
                     e.second += double(w) * w;
                   });
  if (shard_floats > 0) EXPECT_GT(compared, 0) << tag << ": no gradient compared";
  for (const auto& [name, e] : err) {
    if (name.ends_with("cca.temp")) {
      EXPECT_LT(std::sqrt(e.first), 1e-2 * b.grad_norm) << tag << ": gradient of " << name;
      continue;
    }
    const double rel = e.second > 0 ? std::sqrt(e.first / e.second) : std::sqrt(e.first);
    EXPECT_LT(rel, 5e-2) << tag << ": gradient of " << name;
  }
  const auto rest = t.run(), single_rest = single.run();
  ASSERT_GE(rest.size(), 8u);
  EXPECT_LT(rest.back().loss, learns * a.loss) << tag << ": learns";
  if (test::world_rank() == 0)
    std::printf("  %s: last step's loss %.4f over %d GPUs, %.4f on one GPU\n", tag.c_str(), rest.back().loss,
                test::world_size(), single_rest.back().loss);
  EXPECT_NEAR(rest.back().loss, single_rest.back().loss, 0.1 * single_rest.back().loss) << tag;
  const auto params = t.backend().state().params;
  for (const auto& p : t.backend().layout().params) {
    if (p.placement.splits(mesh::Axis::kTensor)) continue;
    std::vector<float> mine(params.begin() + p.offset, params.begin() + p.offset + p.numel), root = mine;
    MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
    EXPECT_EQ(mine, root) << tag << ": replicated " << p.name << " differs between the group's ranks";
  }
}

}  // namespace keel::train::fixtures
