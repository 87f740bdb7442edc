// Shared pieces of the training tests: a tiny model config, reproducible batches, a small
// structured dataset, temporary directories, the base train config text, a one-batch AdamW
// overfit and the check of a config error.
#pragma once

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <utility>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/error.h"
#include "data/indexed_dataset.h"
#include "model/config.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "train/model.h"
#include "train/train_config.h"

namespace keel::train::fixtures {

// Two layers (layer 0 dense, layer 1 MoE: 4 experts, top-2), GQA 4/2 heads of 4, vocab 23.
inline model::ModelConfig tiny_config(bool tied, int layers = 2) {
  model::ModelConfig m;
  m.name = "test-tiny";
  m.vocab_size = 23;
  m.hidden = 16;
  m.layers = layers;
  m.attention = model::AttentionKind::kGqa;
  m.heads = 4;
  m.kv_heads = 2;
  m.head_dim = 4;
  m.ffn_hidden = 24;
  m.experts = 4;
  m.top_k = 2;
  m.expert_hidden = 12;
  m.first_dense_layers = 1;
  m.tied_embeddings = tied;
  m.rope_fraction = 1.0;
  m.max_seq_len = 64;
  return m;
}

struct Batch {
  std::vector<std::uint32_t> tokens;
  std::vector<std::int32_t> targets;
};

// n tokens and targets in [0, vocab) from a 64-bit LCG seeded with `seed`, the same on every
// platform. With ignore_every > 0, target i is -1 (ignored) when i % ignore_every == 5.
inline Batch random_batch(int n, int vocab, std::uint64_t seed, int ignore_every = 0) {
  Batch b;
  std::uint64_t s = seed;
  for (int i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    b.tokens.push_back(static_cast<std::uint32_t>((s >> 33) % vocab));
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const bool ignored = ignore_every > 0 && i % ignore_every == 5;
    b.targets.push_back(ignored ? -1 : static_cast<std::int32_t>((s >> 33) % vocab));
  }
  return b;
}

// An empty directory <tmp>/keel_<tag>_<name>_<pid>.
inline std::filesystem::path temp_dir(const std::string& tag, const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / ("keel_" + tag + "_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// A small dataset of "documents" with structure (repeating ramps) so the loss can fall.
inline std::string make_dataset(const std::filesystem::path& dir, const std::string& name, int docs = 40) {
  const std::string prefix = (dir / name).string();
  data::IndexedDatasetWriter w(prefix, data::TokenDtype::kUint16);
  for (int d = 0; d < docs; ++d) {
    std::vector<std::uint32_t> t;
    for (int i = 0; i < 30 + d % 7; ++i) t.push_back(static_cast<std::uint32_t>((d + i) % 20));
    w.add_document(t);
  }
  w.finish();
  return prefix;
}

// |a - b| / |b - base| (L2): how far a is from b, relative to how far b moved from base (an
// update compared with a reference update).
inline double norm_rel_diff(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& base) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += (double(b[i]) - base[i]) * (double(b[i]) - base[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The tests' train config on the CPU (device: cpu pins the reference: bit-exact resume, exact
// grad-accum equality); `optimizer_extra` is YAML indented under `optimizer:`.
inline std::string train_config_text(const std::string& prefix, const std::filesystem::path& out,
                                     const std::string& optimizer_extra = "") {
  return R"(
device: cpu
model:
  vocab_size: 24
  hidden: 16
  layers: 2
  attention: gqa
  heads: 4
  kv_heads: 2
  ffn_hidden: 32
  experts: 4
  top_k: 2
  expert_hidden: 16
  first_dense_layers: 1
  max_seq_len: 64
router:
  aux_loss_weight: 0.01
  z_loss_weight: 0.001
  bias_update_rate: 0.01
data:
  datasets: {train: )" + prefix + R"(}
  seq_length: 16
  seed: 7
optimizer:
  lr: 0.01
  weight_decay: 0.01
  clip: 1.0
)" + optimizer_extra + R"(schedule:
  kind: cosine
  warmup_steps: 2
batch:
  micro_batch: 2
  grad_accum: 2
steps: 12
log_interval: 4
output_dir: )" + out.string() + "\n";
}

// Trains `m` on one batch for `steps` AdamW steps (no weight decay, global-norm clip 1.0, the
// router-bias update after each): the first and the last cross-entropy.
inline std::pair<double, double> overfit_with_adamw(MoeTransformer& m, const std::uint32_t* tokens,
                                                    const std::int32_t* targets, int steps, double lr) {
  optim::AdamWConfig ac;
  ac.weight_decay = 0.0;
  optim::AdamW adam(ac);
  std::vector<float> mom(m.param_floats()), var(m.param_floats());
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    m.zero_grads();
    const double loss = m.forward(tokens, targets).ce;
    m.backward();
    if (step == 0) first = loss;
    last = loss;
    const auto clip = optim::clip_grad_norm_deferred(optim::grad_views(m.layout(), m.grads()), 1.0);
    optim::FlatRange r{0, m.param_floats(), m.params(), m.grads(), mom.data(), var.data()};
    adam.step(m.layout(), r, lr, static_cast<float>(clip.coefficient));
    m.update_router_bias();
  }
  return {first, last};
}

// The config (with `sets` applied) is refused with one line containing `needle`.
inline void expect_usage_error(const std::string& text, const std::vector<std::string>& sets, const std::string& needle) {
  try {
    parse_train_config(text, "bad.yaml", sets);
    FAIL() << "accepted; expected an error containing: " << needle;
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "multi-line error: " << e.what();
  }
}

}  // namespace keel::train::fixtures
