// The CPU TrainBackend: MoeTransformer (fp32 reference ops) and the host AdamW over the flat
// parameter buffer, plus Muon (optim/muon.h) on the weight matrices when optimizer.muon is on.
// The reference every GPU result is checked against.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "device/cuda_devices.h"
#include "hw/hardware.h"
#include "optim/clip.h"
#include "tensor/arena.h"
#include "train/backend.h"
#include "train/param_rules.h"

namespace keel::train {
namespace {

class CpuBackend final : public TrainBackend {
 public:
  CpuBackend(const model::ModelConfig& cfg, const ModelOptions& options, const OptimizerConfig& optimizer,
             const ParallelContext& ctx)
      : model_(cfg, options, ctx), adam_(optimizer.adamw), muon_(optimizer.muon.config) {
    validate(optimizer.muon);
    // The model's layout names every parameter for AdamW; with Muon on, the same offsets with
    // the matrices regrouped (the model itself only reads offsets).
    layout_ = optimizer.muon.enabled ? regroup_layout(model_.layout(), train_group_rules(optimizer.muon))
                                     : model_.layout();
    const std::size_t n = static_cast<std::size_t>(model_.param_floats());
    const std::size_t scratch = static_cast<std::size_t>(muon_scratch_floats(layout_));
    opt_arena_ = std::make_unique<Arena>("optimizer", 2 * Arena::footprint(n * sizeof(float)) +
                                                          Arena::footprint(std::max<std::size_t>(scratch, 1) * sizeof(float)));
    adam_m_ = opt_arena_->allocate<float>("adamw.m", n);  // Muon's momentum at Muon parameters
    adam_v_ = opt_arena_->allocate<float>("adamw.v", n);
    muon_scratch_ = opt_arena_->allocate<float>("muon.scratch", std::max<std::size_t>(scratch, 1));
  }

  std::string device() const override { return "cpu"; }
  const optim::ParamLayout& layout() const override { return layout_; }
  std::int64_t param_count() const override { return model_.param_count(); }
  int moe_layer_count() const override { return static_cast<int>(model_.moe_layers().size()); }
  double flops_per_micro_batch() const override { return model_.flops_per_micro_batch(); }
  std::size_t memory_bytes() const override {
    auto& m = const_cast<MoeTransformer&>(model_);
    return m.param_arena().capacity() + m.grad_arena().capacity() + opt_arena_->capacity() + m.act_arena().capacity();
  }

  void zero_grads() override { model_.zero_grads(); }
  LossParts forward(const std::uint32_t* tokens, const std::int32_t* targets) override {
    return model_.forward(tokens, targets);
  }
  void backward(float loss_scale) override { model_.backward(loss_scale); }

  StepResult clip_and_step(double max_norm, double lr) override {
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
  void update_router_bias() override { model_.update_router_bias(); }
  void reset_load() override { model_.reset_load(); }

  std::vector<float> gradients() const override {
    return std::vector<float>(model_.grads(), model_.grads() + model_.param_floats());
  }

  TrainState state() const override {
    TrainState s;
    const std::size_t n = static_cast<std::size_t>(model_.param_floats());
    s.params.assign(model_.params(), model_.params() + n);
    s.adam_m.assign(adam_m_, adam_m_ + n);
    s.adam_v.assign(adam_v_, adam_v_ + n);
    auto& m = const_cast<MoeTransformer&>(model_);
    for (int i = 0; i < moe_layer_count(); ++i) s.router_bias.push_back(m.router_bias(i));
    s.adamw_step = adam_.step_count();
    return s;
  }

  void set_state(const TrainState& s) override {
    const std::size_t n = static_cast<std::size_t>(model_.param_floats());
    if (s.params.size() != n || s.adam_m.size() != n || s.adam_v.size() != n)
      fail("train state holds {} parameter floats, this model has {}", s.params.size(), n);
    if (s.router_bias.size() != static_cast<std::size_t>(moe_layer_count()))
      fail("train state holds {} router biases, this model has {} MoE layers", s.router_bias.size(), moe_layer_count());
    for (int i = 0; i < moe_layer_count(); ++i)
      if (s.router_bias[i].size() != model_.router_bias(i).size()) fail("router bias {} size differs", i);
    check_state_matches_optimizers(layout_, s.adam_m.data(), s.adam_v.data());
    std::memcpy(model_.params(), s.params.data(), n * sizeof(float));
    std::memcpy(adam_m_, s.adam_m.data(), n * sizeof(float));
    std::memcpy(adam_v_, s.adam_v.data(), n * sizeof(float));
    for (int i = 0; i < moe_layer_count(); ++i) model_.router_bias(i) = s.router_bias[i];
    adam_.set_step_count(s.adamw_step);
    model_.reset_load();
  }

  MoeTransformer& model() { return model_; }

 private:
  MoeTransformer model_;
  optim::ParamLayout layout_;  // model_.layout() with the optimizer groups of this run
  optim::AdamW adam_;
  optim::MuonConfig muon_;
  std::unique_ptr<Arena> opt_arena_;
  float* adam_m_ = nullptr;
  float* adam_v_ = nullptr;
  float* muon_scratch_ = nullptr;  // muon_scratch_floats(layout_): one matrix at a time
};

}  // namespace

std::unique_ptr<TrainBackend> make_cpu_backend(const model::ModelConfig& cfg, const ModelOptions& options,
                                               const OptimizerConfig& optimizer, const ParallelContext& ctx) {
  return std::make_unique<CpuBackend>(cfg, options, optimizer, ctx);
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
                                                const ParallelContext&) {
  throw UsageError("device: cuda: this keel was built without CUDA (use device: cpu)");
}
#endif

}  // namespace keel::train
