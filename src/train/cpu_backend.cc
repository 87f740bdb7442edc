// The CPU TrainBackend: MoeTransformer (fp32 reference ops) and the host AdamW over the flat
// parameter buffer. The reference every GPU result is checked against.
#include <fmt/format.h>

#include <cstring>

#include "common/error.h"
#include "device/cuda_devices.h"
#include "hw/hardware.h"
#include "optim/clip.h"
#include "tensor/arena.h"
#include "train/backend.h"

namespace keel::train {
namespace {

class CpuBackend final : public TrainBackend {
 public:
  CpuBackend(const model::ModelConfig& cfg, const ModelOptions& options, const optim::AdamWConfig& adamw,
             const ParallelContext& ctx)
      : model_(cfg, options, ctx), adam_(adamw) {
    const std::size_t n = static_cast<std::size_t>(model_.param_floats());
    opt_arena_ = std::make_unique<Arena>("optimizer", 2 * Arena::footprint(n * sizeof(float)));
    adam_m_ = opt_arena_->allocate<float>("adamw.m", n);
    adam_v_ = opt_arena_->allocate<float>("adamw.v", n);
  }

  std::string device() const override { return "cpu"; }
  const optim::ParamLayout& layout() const override { return model_.layout(); }
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
    const optim::ClipResult clip =
        optim::clip_grad_norm_deferred(optim::grad_views(model_.layout(), model_.grads()), max_norm);
    optim::FlatRange r{0, model_.param_floats(), model_.params(), model_.grads(), adam_m_, adam_v_};
    adam_.step(model_.layout(), r, lr, static_cast<float>(clip.coefficient));
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
  optim::AdamW adam_;
  std::unique_ptr<Arena> opt_arena_;
  float* adam_m_ = nullptr;
  float* adam_v_ = nullptr;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cpu_backend(const model::ModelConfig& cfg, const ModelOptions& options,
                                               const optim::AdamWConfig& adamw, const ParallelContext& ctx) {
  return std::make_unique<CpuBackend>(cfg, options, adamw, ctx);
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
std::unique_ptr<TrainBackend> make_cuda_backend(const model::ModelConfig&, const ModelOptions&, const optim::AdamWConfig&,
                                                const ParallelContext&) {
  throw UsageError("device: cuda: this keel was built without CUDA (use device: cpu)");
}
#endif

}  // namespace keel::train
