// Trainer::parallel_text: the words keel train's start-up line gives each parallel scheme of
// the run (the schemes' own choices, such as TSP's tables and k/v mode, included).
#include <fmt/format.h>

#include <cstdint>
#include <string>

#include "model/config.h"
#include "parallel/context_mode.h"
#include "parallel/tsp_tables.h"
#include "train/trainer.h"

namespace keel::train {

// The start-up line's layout: " x 2 data-parallel ranks x context parallel 2 (zigzag) (ZeRO-1)
// x tensor parallel 2", the axes above 1 only (with linear-attention layers the context axis names
// LASP-2).
std::string Trainer::parallel_text() const {
  const mesh::Shape& sh = mesh_.shape();
  std::string out;
  if (sh.dp > 1) out += fmt::format(" x {} data-parallel ranks", sh.dp);
  if (sh.cp > 1) {
    const model::ModelConfig& m = cfg_.model;
    const int linear = model::attention_layer_count(m, model::AttentionKind::kLinear);
    const parallel::ContextMode mode = cfg_.model_options.context_mode;
    const bool ring = mode == parallel::ContextMode::kRing;  // LASP-1 for the linear layers then
    const bool heads = mode == parallel::ContextMode::kAllToAll;
    const char* lasp = linear == 0 ? ""
                       : heads     ? "; linear layers by heads"
                       : ring      ? (linear == m.layers ? "; LASP-1 ring" : "; LASP-1 for the linear layers")
                                   : (linear == m.layers ? "; LASP-2" : "; LASP-2H: LASP-2 for the linear layers");
    const char* softmax = linear == m.layers ? "" : ring ? ", k/v ring" : heads ? ", heads by all-to-all" : "";
    out += fmt::format(" x context parallel {} (zigzag{}{}{})", sh.cp, softmax, lasp,
                       cfg_.context_mode_auto ? "; context_mode auto" : "");
  }
  if (mesh_.data().size > 1)
    out += fmt::format(" (ZeRO-1{}){}",
                       cfg_.data_parallel.grad_reduce == parallel::GradReduceDtype::kBf16 ? ", gradients reduced in bf16" : "",
                       mesh_.expert().size > 1 ? fmt::format(", expert parallel {}", mesh_.expert().size) : "");
  if (sh.tp > 1)
    out += fmt::format(" x tensor parallel {}{}", sh.tp, cfg_.model_options.sequence_parallel ? " (sequence parallel)" : "");
  if (sh.tsp > 1) {
    const int linear = model::attention_layer_count(cfg_.model, model::AttentionKind::kLinear);
    // both backends ring the MLP's shards (parallel/tsp.h, tsp_cuda.h)
    const parallel::TspTables tables = cfg_.model_options.tsp_tables;
    const bool ring = cfg_.model_options.context_mode == parallel::ContextMode::kRing;
    out += fmt::format(" x TSP {} (attention shards broadcast, MLP shards ringed, {}, tokens zigzag{})", sh.tsp,
                       parallel::tsp_gathers_tables(tables, std::int64_t(cfg_.micro_batch) * cfg_.model_options.seq_length,
                                                    cfg_.model.vocab_size)
                           ? "tokens gathered for the vocabulary tables" : "vocabulary tables swept",
                       linear > 0 ? (ring ? ", LASP-1 for the linear layers" : ", LASP-2 for the linear layers") : "");
    if (ring && linear < cfg_.model.layers) out.insert(out.size() - 1, "; k/v ring");
    if (tables == parallel::TspTables::kAuto) out.insert(out.size() - 1, "; tsp_tables auto");
  }
  return out;
}

}  // namespace keel::train
