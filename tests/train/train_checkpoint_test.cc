// keel train state through the keel ckpt library: an asynchronous save that commits, a load
// that restores every tensor bit for bit, and clear errors for the wrong model or file.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/error.h"
#include "train/backend.h"
#include "train/train_checkpoint.h"

namespace keel::train {
namespace {

namespace fs = std::filesystem;

model::ModelConfig tiny(int experts = 4) {
  model::ModelConfig m;
  m.name = "ckpt-tiny";
  m.vocab_size = 31;
  m.hidden = 16;
  m.layers = 2;
  m.attention = model::AttentionKind::kGqa;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 4;
  m.ffn_hidden = 24;
  m.experts = experts;
  m.top_k = 2;
  m.expert_hidden = 12;
  m.first_dense_layers = 1;
  m.tied_embeddings = true;
  m.rope_fraction = 1.0;
  m.max_seq_len = 32;
  return m;
}

ModelOptions options() {
  ModelOptions o;
  o.micro_batch = 2;
  o.seq_length = 8;
  o.bias_update_rate = 0.01;
  return o;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("keel_train_ckpt_" + name);
  fs::remove_all(d);
  return d;
}

// Two steps of training so every buffer (params, m, v, router bias) holds non-trivial values.
std::unique_ptr<TrainBackend> trained(const model::ModelConfig& cfg) {
  auto b = make_cpu_backend(cfg, options(), {}, parallel::Mesh());
  std::vector<std::uint32_t> tok(16);
  std::vector<std::int32_t> tgt(16);
  for (int i = 0; i < 16; ++i) tok[i] = (i * 7) % cfg.vocab_size, tgt[i] = (i * 5 + 3) % cfg.vocab_size;
  for (int s = 0; s < 2; ++s) {
    b->zero_grads();
    b->forward(tok.data(), tgt.data());
    b->backward(1.0f);
    b->clip_and_step(1.0, 1e-2);
    b->update_router_bias();
  }
  return b;
}

TEST(TrainCheckpoint, SaveCommitsAndLoadRestoresEveryTensorBitForBit) {
  const fs::path root = fresh_dir("roundtrip");
  auto a = trained(tiny());
  const TrainState st = a->state();
  {
    TrainCheckpointer ck(root.string(), {});
    const double stall = ck.save(2, st, a->layout(), {{"sampler", {{"next", 32}}}, {"model", "ckpt-tiny"}});
    EXPECT_GE(stall, 0.0);
    const auto stats = ck.finish();
    ASSERT_TRUE(stats.has_value());
    EXPECT_GT(stats->bytes, 3u * st.params.size());  // params, m, v (padding is not stored)
  }
  EXPECT_TRUE(is_ckpt_directory(root.string()));
  EXPECT_TRUE(fs::exists(root / "latest"));

  auto b = make_cpu_backend(tiny(), options(), {}, parallel::Mesh());
  const LoadedTrainState got = load_train_checkpoint(root.string(), tiny());
  EXPECT_EQ(got.extra.at("step").get<std::int64_t>(), 2);
  EXPECT_EQ(got.extra.at("sampler").at("next").get<int>(), 32);
  EXPECT_EQ(got.state.adamw_step, st.adamw_step);
  EXPECT_DOUBLE_EQ(got.read_amplification, 1.0);
  // Every parameter element (padding between parameters is not checkpointed: zeros both ways).
  for (const auto& p : a->layout().params)
    for (std::int64_t i = 0; i < p.numel; ++i) {
      const std::size_t k = static_cast<std::size_t>(p.offset + i);
      ASSERT_EQ(got.state.params[k], st.params[k]) << p.name << "[" << i << "]";
      ASSERT_EQ(got.state.adam_m[k], st.adam_m[k]) << p.name;
      ASSERT_EQ(got.state.adam_v[k], st.adam_v[k]) << p.name;
    }
  EXPECT_EQ(got.state.router_bias, st.router_bias);
  // The restored state trains on exactly as the original.
  b->set_state(got.state);
  std::vector<std::uint32_t> tok(16, 3);
  std::vector<std::int32_t> tgt(16, 5);
  b->zero_grads();
  a->zero_grads();
  EXPECT_EQ(b->forward(tok.data(), tgt.data()).total, a->forward(tok.data(), tgt.data()).total);
}

TEST(TrainCheckpoint, WrongModelOrFileIsAClearError) {
  const fs::path root = fresh_dir("wrong");
  auto a = trained(tiny());
  {
    TrainCheckpointer ck(root.string(), {});
    ck.save(2, a->state(), a->layout(), nlohmann::json::object());
    ck.finish();
  }
  // Another model (8 experts): the expert tensors' shapes differ; the error names one.
  try {
    load_train_checkpoint(root.string(), tiny(8));
    FAIL() << "loaded a checkpoint of another model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.1.moe."), std::string::npos) << e.what();
  }
  // A smaller model of the same shapes (1 of the 2 layers): every tensor it asks for is there,
  // but layer 1 would be silently dropped; the weights-only load names the first unused tensor.
  model::ModelConfig fewer_layers = tiny();
  fewer_layers.layers = 1;
  try {
    load_model_weights(root.string(), fewer_layers);
    FAIL() << "loaded a 2-layer checkpoint into a 1-layer model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor model/layers.1."), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("has no place in model 'ckpt-tiny' (1 layers)"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(load_model_weights(root.string(), tiny()));
  // Not a checkpoint at all.
  EXPECT_FALSE(is_ckpt_directory((root / "nope").string()));
  EXPECT_THROW(load_train_checkpoint((root / "nope").string(), tiny()), Error);
}

}  // namespace
}  // namespace keel::train
