// A synthetic, deterministic MoE training state for exercising checkpoints at any layout:
// embedding and LM head split over tp (vocab), attention weights split over tp, router and
// norms replicated, experts split over ep (experts) and tp (ffn), layers assigned to pipeline
// stages, and AdamW-like exp_avg / exp_avg_sq states (fp32) that follow their parameters and
// add a ZeRO-1 split over the data ranks (dp and cp; the expert-data ranks for the experts, as ep
// is folded into dp * cp). Every element's bits are a hash of (tensor, index, step), so a
// loaded tensor is checked bit for bit against the generator in any layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/layout.h"
#include "ckpt/reader.h"
#include "ckpt/writer.h"
#include "ckpt/types.h"

namespace keel::ckpt {

struct DemoConfig {
  int layers = 2, hidden = 64, vocab = 1003, experts = 6, ffn = 80;
  nlohmann::json to_json() const;
  static DemoConfig from_json(const nlohmann::json& j);
};

// Parses "layers=2,hidden=64,vocab=1003,experts=6,ffn=80" (any subset). Throws keel::Error.
DemoConfig parse_demo_config(const std::string& text);

struct DemoTensor {
  std::string name;
  ElemType type;
  Shape shape;
  mesh::Placement placement;
};

std::vector<DemoTensor> demo_tensors(const DemoConfig& c);

// Fills `box` of tensor `name` (row-major) with the generator's bits for `step`.
void demo_fill(const std::string& name, ElemType type, const Shape& shape, const Box& box, std::int64_t step,
               void* out);
// Counts elements of `box` whose bits differ from the generator; the first difference is
// described in *first (when not null).
std::int64_t demo_check(const std::string& name, ElemType type, const Shape& shape, const Box& box,
                        std::int64_t step, const void* data, std::string* first);

// The per-rank non-tensor state the demo saves: a data-loader position and an RNG state.
nlohmann::json demo_rank_state(int rank, std::int64_t step);

// One rank's demo state for a mesh: the shards it holds, filled for `step` (buffers owned here).
struct DemoShards {
  std::vector<SaveShard> shards;
  std::vector<std::vector<char>> buffers;
};
DemoShards demo_state(const DemoConfig& c, const mesh::Shape& mesh, int rank, std::int64_t step);

// Load requests for everything `rank` of `mesh` holds (zeroed buffers owned here).
struct DemoTarget {
  std::vector<LoadRequest> requests;
  std::vector<std::vector<char>> buffers;
};
DemoTarget demo_target(const DemoConfig& c, const mesh::Shape& mesh, int rank);
// Elements that differ from the generator at `step`; the first is described in *first.
std::int64_t demo_verify(const DemoTarget& t, std::int64_t step, std::string* first);

}  // namespace keel::ckpt
