// The CPU TrainBackend: MoeTransformer (fp32 reference ops) and the host AdamW over the flat
// parameter buffer, plus Muon (optim/muon.h) on the weight matrices when optimizer.muon is on.
// The reference every GPU result is checked against. Under data parallelism (MPI ranks) the
// optimizer is ZeRO-1 (parallel/zero1.h): optimizer state for this rank's shard only.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "device/cuda_devices.h"
#include "hw/hardware.h"
#include "model/param_layout.h"
#include "optim/clip.h"
#include "parallel/data_parallel_comm.h"
#include "parallel/tensor_parallel.h"
#include "parallel/tensor_parallel_muon.h"
#include "parallel/zero1.h"
#include "tensor/arena.h"
#include "train/backend.h"
#include "train/param_rules.h"

namespace keel::train {
namespace {

class CpuBackend final : public TrainBackend {
 public:
  CpuBackend(const model::ModelConfig& cfg, const ModelOptions& options, const OptimizerConfig& optimizer,
             const parallel::Mesh& mesh, const parallel::DataParallelOptions& dp)
      : model_(cfg, options, mesh),
        adam_(optimizer.adamw),
        muon_(optimizer.muon.config),
        // TSP's gradients reduce as tensor parallelism's with sequence parallelism do: its weight
        // blocks are a tensor rank's, its tokens split over the same group (parallel/tsp.h)
        tp_(mesh.group(mesh.group(parallel::GroupKind::kTsp).size > 1 ? parallel::GroupKind::kTsp
                                                                      : parallel::GroupKind::kTensor).comm),
        sequence_(options.sequence_parallel || mesh.group(parallel::GroupKind::kTsp).size > 1) {
    validate(optimizer.muon);
    // The model's layout names every parameter for AdamW; with Muon on, the same offsets with
    // the matrices regrouped (the model itself only reads offsets).
    layout_ = optimizer.muon.enabled ? regroup_layout(model_.layout(), train_group_rules(optimizer.muon))
                                     : model_.layout();
    scale_router_lr(layout_, options.router_lr_scale);
    // ZeRO-1 shards (plan_state_shards: with expert parallelism the expert region is sharded
    // over the expert-data group, whose gradients it sums)
    const StateShards shards = plan_state_shards(layout_, mesh);
    plan_ = shards.replicated;
    expert_plan_ = shards.experts;
    slice_ = shards.slice;
    shard_ = {slice_.shard_begin, slice_.shard_end};
    if (mesh.data().size > 1) dp_ = parallel::make_mpi_data_parallel_comm(mesh.data().comm, dp.grad_reduce);
    if (shards.replicated_end < layout_.total_floats && mesh.expert_data().size > 1)
      expert_dp_ = parallel::make_mpi_data_parallel_comm(mesh.expert_data().comm, dp.grad_reduce);
    const std::size_t n = static_cast<std::size_t>(slice_.moments());  // optimizer state: the shard (+ experts)
    const std::size_t scratch = static_cast<std::size_t>(muon_scratch_floats(layout_));
    const std::size_t n1 = std::max<std::size_t>(n, 1);
    opt_arena_ = std::make_unique<Arena>("optimizer", 2 * Arena::footprint(n1 * sizeof(float)) +
                                                          Arena::footprint(std::max<std::size_t>(scratch, 1) * sizeof(float)));
    adam_m_ = opt_arena_->allocate<float>("adamw.m", n1);  // Muon's momentum at Muon parameters
    adam_v_ = opt_arena_->allocate<float>("adamw.v", n1);
    muon_scratch_ = opt_arena_->allocate<float>("muon.scratch", std::max<std::size_t>(scratch, 1));
  }

  std::string device() const override { return "cpu"; }
  const optim::ParamLayout& layout() const override { return layout_; }
  std::int64_t param_count() const override { return model_.param_count(); }
  int moe_layer_count() const override { return static_cast<int>(model_.moe_layers().size()); }
  double flops_per_micro_batch() const override { return model_.flops_per_micro_batch(); }
  std::vector<MemoryItem> memory_breakdown() const override {
    auto& m = const_cast<MoeTransformer&>(model_);
    std::vector<MemoryItem> items = {{"parameters", m.param_arena().capacity()},
                                     {"gradients", m.grad_arena().capacity()},
                                     {"optimizer state", opt_arena_->capacity()},
                                     {"activations and scratch", m.act_arena().capacity()}};
    if (const parallel::TspShards* t = m.tsp())  // two shards in flight, two gradient shards and their sum
      items.push_back({"tsp shards", static_cast<std::size_t>(5 * t->largest_shard()) * sizeof(float)});
    return items;
  }

  void zero_grads() override { model_.zero_grads(); }
  LossParts forward(const std::uint32_t* tokens, const std::int32_t* targets) override {
    return model_.forward(tokens, targets);
  }
  void backward(float loss_scale) override { model_.backward(loss_scale); }

  StepResult clip_and_step(double max_norm, double lr) override {
    // Tensor parallelism: the replicated parameters' partial gradients summed over the group.
    parallel::reduce_partial_gradients(tp_, layout_, sequence_, model_.grads());
    if (dp_) return zero1_step(max_norm, lr);
    if (tp_.size() > 1) return tensor_parallel_step(max_norm, lr);
    // One norm over every gradient, AdamW's and Muon's alike; both see the coefficient as their
    // gradient scale (the gradients themselves are not rewritten).
    const optim::ClipResult clip =
        optim::clip_grad_norm_deferred(optim::grad_views(layout_, model_.grads()), max_norm);
    const float scale = static_cast<float>(clip.coefficient);
    optim::FlatRange r{0, model_.param_floats(), model_.params(), model_.grads(), adam_m_, adam_v_};
    adam_.step(layout_, r, lr, scale);  // skips Muon parameters
    for (const auto& p : layout_.params) {
      if (p.optimizer != optim::OptimizerKind::kMuon) continue;
      optim::muon_matrix_step(model_.params() + p.offset, model_.grads() + p.offset, adam_m_ + p.offset, p.matrices(),
                              p.rows(), p.cols(), muon_, lr * p.lr_scale, p.weight_decay, scale, muon_scratch_);
    }
    return {clip.norm, clip.coefficient};
  }

  std::vector<std::int64_t> load(int i) const override { return model_.load(i); }
  void set_load(int i, const std::vector<std::int64_t>& counts) override { model_.set_load(i, counts); }
  std::pair<std::int64_t, std::int64_t> optimizer_shard() const override { return shard_; }
  StateSlice state_slice() const override { return slice_; }
  void update_router_bias() override { model_.update_router_bias(); }
  void reset_load() override { model_.reset_load(); }

  std::vector<float> gradients() const override {
    return std::vector<float>(model_.grads(), model_.grads() + model_.param_floats());
  }

  TrainState state() const override {
    TrainState s;
    const std::size_t n = static_cast<std::size_t>(model_.param_floats());
    const std::size_t k = static_cast<std::size_t>(slice_.moments());
    s.params.assign(model_.params(), model_.params() + n);
    s.set_slice(slice_);
    s.adam_m.assign(adam_m_, adam_m_ + k);
    s.adam_v.assign(adam_v_, adam_v_ + k);
    auto& m = const_cast<MoeTransformer&>(model_);
    for (int i = 0; i < moe_layer_count(); ++i) s.router_bias.push_back(m.router_bias(i));
    s.router_balance = m.balance_memory();
    s.adamw_step = adam_.step_count();
    return s;
  }

  CheckpointView checkpoint_view() override {  // the backend's own buffers: the saver's staging is the only copy
    CheckpointView v;
    v.params = model_.params();
    v.adam_m = adam_m_;
    v.adam_v = adam_v_;
    v.slice = slice_;
    for (int i = 0; i < moe_layer_count(); ++i) v.router_bias.push_back(model_.router_bias(i));
    v.router_balance = model_.balance_memory();
    v.adamw_step = adam_.step_count();
    return v;
  }

  void set_state(const TrainState& s) override {
    const std::size_t n = static_cast<std::size_t>(model_.param_floats());
    const std::size_t k = static_cast<std::size_t>(slice_.moments());
    std::vector<std::size_t> bias_sizes;
    for (int i = 0; i < moe_layer_count(); ++i) bias_sizes.push_back(model_.router_bias(i).size());
    check_train_state(s, layout_, slice_, bias_sizes);
    std::memcpy(model_.params(), s.params.data(), n * sizeof(float));
    if (k > 0) std::memcpy(adam_m_, s.adam_m.data(), k * sizeof(float));
    std::fill(adam_v_, adam_v_ + k, 0.f);  // none at Muon parameters, whatever the state held there
    for (const MomentSpan& sp : adamw_moment_spans(layout_, slice_))
      std::memcpy(adam_v_ + sp.at, s.adam_v.data() + sp.at, static_cast<std::size_t>(sp.count) * sizeof(float));
    for (int i = 0; i < moe_layer_count(); ++i) model_.router_bias(i) = s.router_bias[i];
    model_.balance_memory() = s.router_balance;
    adam_.set_step_count(s.adamw_step);
    model_.reset_load();
  }

  MoeTransformer& model() { return model_; }
  const MoeTransformer* cpu_model() const override { return &model_; }

 private:
  // One Muon matrix (or stack) of parameter p at `offset`, momentum at `m`. A matrix split over
  // the tensor axis joins `batch`, stepped by muon_batch(): orthogonalized whole on one rank of
  // the group, the owners balanced over the batch.
  void muon_matrix(const optim::ParamInfo& p, std::int64_t offset, float* m, std::int64_t matrices, std::int64_t rows,
                   std::int64_t cols, double lr, float scale, std::vector<parallel::TpMuonTensor>& batch) {
    float* params = model_.params();
    float* grads = model_.grads();
    const parallel::TpMuonSplit sp = tp_.size() > 1 ? parallel::tp_muon_split(p, tp_.size()) : parallel::TpMuonSplit{};
    if (!sp.split)
      return optim::muon_matrix_step(params + offset, grads + offset, m, matrices, rows, cols, muon_, lr * p.lr_scale,
                                     p.weight_decay, scale, muon_scratch_);
    parallel::TpMuonTensor t;
    t.param = params + offset, t.grad = grads + offset, t.momentum = m;
    t.matrices = matrices, t.local_rows = rows, t.local_cols = cols;
    t.split_dim = sp.split_dim, t.row_parts = sp.row_parts;
    t.lr = lr * p.lr_scale, t.decay = p.weight_decay;
    batch.push_back(std::move(t));
  }
  // The tensor-parallel matrices of a step, in two exchanges over the group (collective: every
  // tensor rank of a data rank steps the same matrices).
  void muon_batch(const std::vector<parallel::TpMuonTensor>& batch, float scale) {
    if (tp_.size() > 1) parallel::tp_muon_step_batch(batch, muon_, scale, tp_.comm(), tp_muon_workspace_);
  }

  // The sum of squares of the gradients in [lo_r, hi_r): of the parameters split over the tensor
  // axis (their other blocks are on the other tensor ranks) and of the others.
  std::pair<double, double> sum_squares_in(std::int64_t lo_r, std::int64_t hi_r) const {
    double split = 0, whole = 0;
    for (const auto& p : layout_.params) {
      const std::int64_t lo = std::max(p.offset, lo_r), hi = std::min(p.offset + p.numel, hi_r);
      if (lo >= hi) continue;
      (p.placement.splits(mesh::Axis::kTensor) ? split : whole) += optim::sum_squares(model_.grads() + lo, hi - lo);
    }
    return {split, whole};
  }

  [[noreturn]] void non_finite(double norm, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges) const {
    std::string bad;  // the first parameter of this rank's ranges holding one, if any
    for (const auto& p : layout_.params) {
      for (const auto& [rb, re] : ranges) {
        const std::int64_t lo = std::max(p.offset, rb), hi = std::min(p.offset + p.numel, re);
        if (lo < hi && !std::isfinite(optim::sum_squares(model_.grads() + lo, hi - lo))) bad = p.name;
      }
      if (!bad.empty()) break;
    }
    throw optim::NonFiniteGradient(fmt::format("gradient norm is {}", norm), bad, norm);
  }

  // Tensor parallelism without data parallelism: the norm over every rank's blocks, AdamW on
  // this rank's blocks, Muon on whole matrices.
  StepResult tensor_parallel_step(double max_norm, double lr) {
    const auto [split, whole] = sum_squares_in(0, layout_.total_floats);
    const double norm = std::sqrt(tp_.sum(split) + whole);
    if (!std::isfinite(norm)) non_finite(norm, {{0, layout_.total_floats}});
    const double coef = optim::clip_coefficient(norm, max_norm);
    const float scale = static_cast<float>(coef);
    optim::FlatRange r{0, model_.param_floats(), model_.params(), model_.grads(), adam_m_, adam_v_};
    adam_.step(layout_, r, lr, scale);  // skips Muon parameters
    std::vector<parallel::TpMuonTensor> batch;
    for (const auto& p : layout_.params)
      if (p.optimizer == optim::OptimizerKind::kMuon)
        muon_matrix(p, p.offset, adam_m_ + p.offset, p.matrices(), p.rows(), p.cols(), lr, scale, batch);
    muon_batch(batch, scale);
    return {norm, coef};
  }

  // ZeRO-1: reduce-scatter the gradients, the global norm from the shards' sums of squares,
  // AdamW on the shard and Muon on the whole matrices in it, all-gather the parameters. With
  // expert parallelism the expert region does the same over the expert-data group; each
  // element of every expert then lies in exactly one rank's shard, so one sum over all ranks
  // gives the norm.
  StepResult zero1_step(double max_norm, double lr) {
    float* params = model_.params();
    float* grads = model_.grads();
    const auto [b, e] = shard_;
    const std::int64_t xb = slice_.expert_begin, xe = slice_.expert_end;
    dp_->reduce_scatter_sum(grads, plan_.bounds);
    if (expert_dp_) expert_dp_->reduce_scatter_sum(grads, expert_plan_.bounds);
    const auto [s1, w1] = sum_squares_in(b, e);
    const auto [s2, w2] = sum_squares_in(xb, xe);
    double ss[2] = {s1 + s2, w1 + w2};  // split over the tensor axis, and not
    dp_->all_reduce_sum(ss, 2);
    const double norm = std::sqrt(tp_.sum(ss[0]) + ss[1]);
    if (!std::isfinite(norm)) non_finite(norm, {{b, e}, {xb, xe}});
    const double coef = optim::clip_coefficient(norm, max_norm);
    const float scale = static_cast<float>(coef);
    std::vector<optim::FlatRange> ranges;  // the shard's, then the expert shard's (moments in that order)
    for (const MomentRange& r : moment_ranges(slice_))
      ranges.push_back({r.begin, r.end, params + r.begin, grads + r.begin, adam_m_ + r.at, adam_v_ + r.at});
    adam_.step(layout_, ranges, lr, scale);  // skips Muon parameters
    std::vector<parallel::TpMuonTensor> batch;
    for (const auto& r : ranges)
      for (const auto& m : parallel::muon_matrices_in(layout_, r.begin, r.end)) {
        const auto& p = layout_.params[static_cast<std::size_t>(m.param)];
        const std::int64_t at = (r.m - adam_m_) + (m.offset - r.begin);
        muon_matrix(p, m.offset, adam_m_ + at, 1, m.rows, m.cols, lr, scale, batch);
      }
    muon_batch(batch, scale);
    dp_->all_gather(params, plan_.bounds);
    if (expert_dp_) expert_dp_->all_gather(params, expert_plan_.bounds);
    return {norm, coef};
  }

  MoeTransformer model_;
  optim::ParamLayout layout_;  // model_.layout() with the optimizer groups of this run
  optim::AdamW adam_;
  optim::MuonConfig muon_;
  std::unique_ptr<Arena> opt_arena_;
  float* adam_m_ = nullptr;
  float* adam_v_ = nullptr;
  float* muon_scratch_ = nullptr;  // muon_scratch_floats(layout_): one matrix at a time
  std::unique_ptr<parallel::DataParallelComm> dp_;  // null on one rank
  parallel::Zero1Plan plan_;
  std::pair<std::int64_t, std::int64_t> shard_;     // this rank's ZeRO-1 shard
  std::unique_ptr<parallel::DataParallelComm> expert_dp_;  // over expert_data, when it has several ranks
  parallel::Zero1Plan expert_plan_;                 // the expert region's shards over expert_data
  StateSlice slice_;                                // + its experts and their optimizer shard
  parallel::TensorGroup tp_;                        // this rank's tensor group (size 1 without)
  std::vector<float> tp_muon_workspace_;            // tensor-parallel Muon's exchanges
  bool sequence_ = false;                           // sequence parallelism over it
};

}  // namespace

std::unique_ptr<TrainBackend> make_cpu_backend(const model::ModelConfig& cfg, const ModelOptions& options,
                                               const OptimizerConfig& optimizer, const parallel::Mesh& mesh,
                                               const parallel::DataParallelOptions& dp) {
  return std::make_unique<CpuBackend>(cfg, options, optimizer, mesh, dp);
}

StateShards plan_state_shards(const optim::ParamLayout& layout, const mesh::Shape& shape, const mesh::Coord& at) {
  const std::int64_t total = layout.total_floats;
  // The data group (dp x cp), the expert group and the expert-data group, as parallel::Mesh makes them.
  const parallel::Group data{shape.dp * shape.cp, at.dp * shape.cp + at.cp}, expert{shape.ep, at.ep},
      expert_data{shape.expert_data(), at.edp};
  StateShards s;
  s.replicated_end = total;
  for (const auto& p : layout.params)
    if (expert.size > 1 && p.placement.splits(mesh::Axis::kExpert)) s.replicated_end = std::min(s.replicated_end, p.offset);
  s.slice.expert_parallel = expert.size;
  s.slice.expert_rank = expert.rank;
  // the weight blocks' split: tensor parallelism's, or TSP's (model::weight_shape)
  s.slice.tensor_parallel = model::weight_shape(shape).tp;
  s.slice.tensor_rank = model::weight_coord(shape, at).tp;
  s.slice.shard_end = total;
  if (data.size > 1) {
    s.replicated = parallel::plan_zero1_region(layout, 0, s.replicated_end, data.size);
    s.slice.shard_begin = s.replicated.begin(data.rank);
    s.slice.shard_end = s.replicated.end(data.rank);
  }
  if (s.replicated_end < total) {
    s.experts = parallel::plan_zero1_region(layout, s.replicated_end, total, expert_data.size);
    s.slice.expert_begin = s.experts.begin(expert_data.rank);
    s.slice.expert_end = s.experts.end(expert_data.rank);
  }
  return s;
}

std::vector<MomentRange> moment_ranges(const StateSlice& s) {
  std::vector<MomentRange> r{{s.shard_begin, s.shard_end, 0}};
  if (s.expert_end > s.expert_begin) r.push_back({s.expert_begin, s.expert_end, s.shard_end - s.shard_begin});
  return r;
}

std::vector<MomentSpan> adamw_moment_spans(const optim::ParamLayout& layout, const StateSlice& s) {
  std::vector<MomentSpan> out;
  for (const MomentRange& r : moment_ranges(s)) {
    bool open = false;  // the last span may still grow: no Muon parameter since it
    for (const auto& p : layout.params) {
      const std::int64_t lo = std::max(p.offset, r.begin), hi = std::min(p.offset + p.numel, r.end);
      if (lo >= hi) continue;
      if (p.optimizer != optim::OptimizerKind::kAdamW) {
        open = false;
      } else if (open) {
        out.back().count = hi - out.back().begin;
      } else {
        out.push_back({lo, hi - lo, r.at + (lo - r.begin)});
        open = true;
      }
    }
  }
  return out;
}

void check_train_state(const TrainState& s, const optim::ParamLayout& layout, const StateSlice& slice,
                       const std::vector<std::size_t>& router_bias_sizes) {
  const std::size_t n = static_cast<std::size_t>(layout.total_floats);
  const std::size_t k = static_cast<std::size_t>(slice.moments());
  if (s.params.size() != n) fail("train state holds {} parameter floats, this model has {}", s.params.size(), n);
  if (s.shard_begin != slice.shard_begin || s.shard_end != slice.shard_end || s.adam_m.size() != k ||
      s.adam_v.size() != k)
    fail("train state holds the optimizer shard [{}, {}) ({} floats), this rank's is [{}, {})", s.shard_begin,
         s.shard_end, s.adam_m.size(), slice.shard_begin, slice.shard_end);
  if (s.expert_parallel != slice.expert_parallel || s.expert_rank != slice.expert_rank ||
      s.expert_begin != slice.expert_begin || s.expert_end != slice.expert_end)
    fail("train state holds the experts of expert-parallel rank {} of {}, this rank holds those of rank {} of {}",
         s.expert_rank, s.expert_parallel, slice.expert_rank, slice.expert_parallel);
  if (s.tensor_parallel != slice.tensor_parallel || s.tensor_rank != slice.tensor_rank)
    fail("train state holds the blocks of tensor rank {} of {}, this rank holds those of rank {} of {}", s.tensor_rank,
         s.tensor_parallel, slice.tensor_rank, slice.tensor_parallel);
  if (s.router_bias.size() != router_bias_sizes.size())
    fail("train state holds {} router biases, this model has {} MoE layers", s.router_bias.size(),
         router_bias_sizes.size());
  for (std::size_t i = 0; i < router_bias_sizes.size(); ++i)
    if (s.router_bias[i].size() != router_bias_sizes[i]) fail("router bias {} size differs", i);
  for (const MomentRange& r : moment_ranges(slice))
    check_state_matches_optimizers(layout, s.adam_m.data() + r.at, s.adam_v.data() + r.at, r.begin, r.end);
}

std::string memory_report(const TrainBackend& b) {
  auto gib = [](std::size_t bytes) { return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1u << 30)); };
  std::string parts;
  for (const auto& it : b.memory_breakdown())
    if (it.bytes > 0) parts += fmt::format("{}{} {}", parts.empty() ? "" : " + ", it.name, gib(it.bytes));
  return fmt::format("memory on this rank: {} = {}", gib(b.memory_bytes()), parts);
}

bool cuda_training_available() {
#ifdef KEEL_HAVE_CUDA
  return visible_cuda_devices() > 0;
#else
  return false;
#endif
}

double device_peak_bf16_flops(const std::string& device_name) {
  const hw::HardwareProfile* p = hw::match_device_name(device_name);
  if (!p || !(p->bf16_tflops > 0))
    throw UsageError(fmt::format("no hardware profile for '{}': set mfu_peak_flops in the train config", device_name));
  return p->bf16_tflops * 1e12;
}

#ifndef KEEL_HAVE_CUDA
std::unique_ptr<TrainBackend> make_cuda_backend(const model::ModelConfig&, const ModelOptions&, const OptimizerConfig&,
                                                const parallel::Mesh&, const parallel::DataParallelOptions&) {
  throw UsageError("device: cuda: this keel was built without CUDA (use device: cpu)");
}
#endif

}  // namespace keel::train
