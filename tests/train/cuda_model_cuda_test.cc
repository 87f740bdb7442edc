// CudaModel's contract with a data-parallel schedule (parallel::StageHooks): forward asks for
// every stage's parameters, in increasing order, before it reads them; backward says every
// stage's gradients are final exactly once, the final stage first and the embedding last, with
// the layers done before the embedding. The overlapped ZeRO-1 step relies on both (a stage it is
// not asked for is read before its broadcast lands). Skips without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "device/cuda_check.h"
#include "device/cuda_devices.h"
#include "device/device_arena.h"
#include "model/param_layout.h"
#include "ops/cuda/cast.h"
#include "train/cuda_model_cuda.h"

#include "train_test_util.h"

namespace keel::train {
namespace {

using ops::cuda::bf16;

struct Recorder final : parallel::StageHooks {
  std::vector<std::string> events;
  bool in_forward = false;
  void forward_begin() override { events.push_back("forward_begin"), in_forward = true; }
  void forward_end() override { events.push_back("forward_end"), in_forward = false; }
  void before_stage(int s) override {
    if (in_forward) events.push_back("before " + std::to_string(s));
  }
  void grads_final(int s) override { events.push_back("final " + std::to_string(s)); }
  void layers_done() override { events.push_back("layers_done"); }
  bool take_embedding_grads(const std::uint32_t*, const float*, std::int64_t) override {
    events.push_back("embedding");
    return false;
  }
};

model::ModelConfig config(bool zaya) {
  model::ModelConfig m;
  m.name = "hooks-test";
  m.vocab_size = 301;
  m.hidden = 128;
  m.layers = 3;
  m.attention = zaya ? model::AttentionKind::kCca : model::AttentionKind::kGqa;
  m.heads = 2;
  m.kv_heads = 2;
  m.head_dim = 64;
  m.ffn_hidden = 192;
  m.experts = 4;
  m.top_k = 1;
  m.expert_hidden = 64;
  m.first_dense_layers = 1;
  m.tied_embeddings = !zaya;
  m.max_seq_len = 64;
  if (zaya) {
    m.cca_q_dim = 128, m.cca_k_dim = 128, m.cca_v_dim = 128, m.cca_conv_width = 2, m.cca_group_conv_width = 2;
    m.router_hidden = 32, m.router_mlp_layers = 3, m.router_skip_expert = true, m.residual_scaling = true;
  }
  return m;
}

void check_order(bool zaya, Recompute recompute) {
  const model::ModelConfig cfg = config(zaya);
  ModelOptions opt;
  opt.micro_batch = 2;
  opt.seq_length = 16;
  opt.recompute = recompute;
  const optim::ParamLayout layout = model::param_layout(cfg);
  cudaStream_t stream = nullptr;
  KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    CudaModel m(cfg, opt, layout, std::vector<blocks::cuda::LayerRunners>(static_cast<std::size_t>(cfg.layers)),
                /*tp=*/nullptr, /*cp=*/nullptr, std::size_t(1) << 30, stream);
    DeviceArena acts("activations"), bufs("buffers");
    const std::int64_t n = layout.total_floats;
    float *p = nullptr, *g = nullptr, *bias = nullptr;
    bf16* p16 = nullptr;
    for (int pass = 0; pass < 2; ++pass) {
      m.carve(acts);
      p = bufs.take<float>(n);
      p16 = bufs.take<bf16>(n);
      g = bufs.take<float>(n);
      bias = bufs.take<float>(std::max(1, m.moe_layer_count() * m.classes()));
      if (pass == 0) acts.allocate(), bufs.allocate();
    }
    std::vector<float> host(static_cast<std::size_t>(n));
    model::init_parameters(cfg, layout, 0.02, 7, host.data());
    KEEL_CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
    ops::cuda::f32_to_bf16(p, p16, n, stream);
    m.bind({p, p16, g, bias});
    const fixtures::Batch batch = fixtures::random_batch(2 * 16, cfg.vocab_size, 3);
    std::vector<std::vector<std::int64_t>> load(static_cast<std::size_t>(m.moe_layer_count()),
                                                std::vector<std::int64_t>(static_cast<std::size_t>(m.classes()), 0));
    Recorder hooks;
    m.forward(batch.tokens.data(), batch.targets.data(), hooks, load);
    m.backward(1.0f, /*grads_fresh=*/true, hooks);
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const int stages = model::stage_count(cfg.layers);
    std::vector<std::string> want = {"forward_begin"};
    for (int s = 0; s < stages; ++s) want.push_back("before " + std::to_string(s));
    want.push_back("forward_end");
    want.push_back("final " + std::to_string(stages - 1));
    for (int l = cfg.layers - 1; l >= 0; --l) {
      want.push_back("final " + std::to_string(2 + 2 * l));
      want.push_back("final " + std::to_string(1 + 2 * l));
    }
    want.push_back("layers_done");
    want.push_back("embedding");
    want.push_back("final 0");
    EXPECT_EQ(hooks.events, want) << (zaya ? "zaya" : "gqa") << ", recompute " << to_string(recompute);
    std::int64_t routed = 0;
    for (const auto& l : load)
      for (auto c : l) routed += c;
    EXPECT_EQ(routed, std::int64_t(m.moe_layer_count()) * 2 * 16) << "every token of every MoE layer is counted once";
  }
  KEEL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaModel, TellsTheScheduleEveryStageInOrder) {
  if (visible_cuda_devices() == 0) GTEST_SKIP() << "no GPU";
  for (const bool zaya : {false, true})
    for (const Recompute r : {Recompute::kNone, Recompute::kFull}) check_order(zaya, r);
}

}  // namespace
}  // namespace keel::train
