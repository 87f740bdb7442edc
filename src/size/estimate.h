// `keel size` estimates for one parallel layout: memory per GPU, decode state, predicted
// GEMM time per step and time to train. Formulas and conventions: docs/size.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hw/gemm_model.h"
#include "hw/measured.h"
#include "mesh/shape.h"
#include "model/config.h"
#include "model/flops.h"
#include "model/params.h"
#include "parallel/context_mode.h"
#include "parallel/tsp_tables.h"

namespace keel::size {

enum class Optimizer { kAdamW, kMuon };

// The layout of a run is a mesh::Shape (mesh/shape.h): pp, dp, cp, tsp, tp and ep folded into
// dp * cp, and the ZeRO stage (0..3 here; 1 when --layout leaves it out). parse_layout reads
// --layout (mesh::parse), fills dp from --gpus when it is left out and gpus > 0
// (mesh::fill_data) and checks the combination (mesh::validate); UsageError naming the text.
mesh::Shape parse_layout(const std::string& text, int gpus);
// The checks that depend on the model: tp*tsp divides heads, pp <= layers, ep needs an MoE model
// and divides its experts. UsageError with one line per problem.
void check_layout(const mesh::Shape& l, const model::ModelConfig& m);

struct Setup {
  model::ModelConfig model;
  hw::Hardware hardware;
  mesh::Shape layout{.zero = 1};  // keel size's default: ZeRO-1, as keel train runs
  // With tp > 1: Megatron sequence parallelism (keel train's parallel.sequence), the residual
  // stream, norms and routers on 1/tp of the tokens; false keeps them on every token.
  bool sequence_parallel = true;
  // With cp > 1: how the attention sees the rest of the sequence (keel train's
  // parallel.context_mode), which sets the GPU core's buffers.
  parallel::ContextMode context_mode = parallel::ContextMode::kAllGather;
  // With tsp > 1: whether the vocabulary tables' rows travel or the tokens do (keel train's
  // parallel.tsp_tables), which sets the gather buffers.
  parallel::TspTables tsp_tables = parallel::TspTables::kAuto;
  std::int64_t seq = 4096;
  int micro_batch = 1;
  int micro_batches = 1;  // per step per pipeline (gradient accumulation): sets the pipeline bubble
  model::Recompute recompute = model::Recompute::kNone;
  // Vocabulary columns per cross-entropy chunk when the logits do not fit (keel train's
  // model.ce_chunk).
  std::int64_t ce_chunk = 8192;
  Optimizer optimizer = Optimizer::kAdamW;
  // parallel.grad_reduce: bf16 (keel train's layouts count its bf16 reduce scratch).
  bool grad_reduce_bf16 = false;
  double tokens = 0;  // to train; 0: skip the training-time estimate
  double mfu = 0.4;   // assumed
  std::vector<int> decode_batches = {1, 8, 32, 128};
};

// Rows each expert on a GPU receives per micro-batch under even routing: the ep group's
// tokens x top_k over the experts, ceil(tokens_local x ep x top_k / experts). UsageError when the
// product (or the product + experts, which layer_gemms' rounding adds) overflows int64.
std::int64_t tokens_per_local_expert(std::int64_t tokens_local, int ep, int top_k, int experts);

struct MemoryItem {
  std::string name;
  double bytes = 0;
};

struct MemoryEstimate {
  double params_on_gpu = 0;  // parameters this GPU holds before ZeRO-3 (heaviest pipeline stage)
  std::string stage;         // which pipeline stage is heaviest ("single stage", "first", "last")
  std::vector<MemoryItem> items;  // weights, gradients, optimizer, activations, logits
  double total() const;
  // Activations per recompute option (same layout), bytes, for the comparison table.
  double activations_none = 0, activations_selective = 0, activations_full = 0;
  double activation_bytes_per_token_layer[3] = {0, 0, 0};  // none, selective, full (one layer, one token, unsharded)
  // Expert parallelism (ep > 1) routes dropless: what the GPU holding the experts that every
  // token of its ep group picks keeps on top of total() (ep - 1 more shares of routed rows in
  // each MoE layer, and their backward scratch). 0 without expert parallelism.
  double ep_worst_case_extra = 0;
  // A layout keel train runs (keel_train_shards.h): its ZeRO-1 optimizer shard in floats, the
  // busiest rank's and the mean (0 otherwise).
  double keel_train_optimizer_floats = 0, keel_train_optimizer_floats_mean = 0;
};

MemoryEstimate estimate_memory(const Setup& s);

struct DecodeState {
  double kv_bytes_per_token = 0;        // all layers, bf16: grows with context
  double fixed_bytes_per_sequence = 0;  // conv states, previous hidden, linear-attention d x d states
};
DecodeState decode_state(const model::ModelConfig& m);

// Bytes one decode step reads at `batch` sequences of `context` tokens, and its latency at the
// HBM bandwidth (measured if given, else 85% of spec): weights (dense + expected distinct
// experts touched, E*(1-(1-k/E)^B) per MoE layer) + KV/state.
struct DecodePoint {
  int batch = 1;
  double bytes = 0, seconds = 0;
  double ms_per_token() const { return seconds * 1e3; }
  double tokens_per_s() const { return batch / seconds; }
};
DecodePoint decode_step(const model::ModelConfig& m, const hw::Hardware& hw, int batch, std::int64_t context);

struct GemmTiming {
  model::Gemm gemm;       // per-GPU shape (after tp/tsp/ep sharding)
  hw::GemmPrediction prediction;
  double layers = 1;      // layers of this GEMM on one GPU (model layers / pp)
  double repeats = 1;     // times per layer (tsp runs each of its shards in turn)
  double seconds() const { return prediction.seconds * layers * repeats; }
  double flops() const { return 2.0 * gemm.m * gemm.n * gemm.k * gemm.batch * layers * repeats; }
};

// Muon's Newton-Schulz GEMMs in one optimizer step (--optimizer muon; 0 with AdamW, whose
// elementwise step is not modelled): 5 iterations of three GEMMs per weight matrix (X X^T,
// A A, B X; docs/optim.md), 5 (4 s^2 l + 2 s^3) FLOPs for an s x l matrix (s = min side). The
// matrices are the weights of layer_gemms() but the LM head (AdamW), with the fused ones split
// as keel train stores them (SwiGLU up_gate -> gate and up; a fused qkv -> q, k, v). Whole
// matrices: with ZeRO >= 1 each is stepped by one rank, so a GPU's share is 1/G; without
// ZeRO every data-parallel replica steps all of its own. Timed by the GEMM model at each
// matrix's (or expert stack's) full batch, scaled by the share. For a layout keel train runs
// (keel_train_shards.h) the matrices and shares are instead keel train's own: the busiest
// rank's whole matrices under its ZeRO-1 cuts, each run of one stack timed at its own batch.
struct OptimizerStepEstimate {
  double flops_total = 0;    // whole model
  double flops_per_gpu = 0;  // this GPU's share
  double seconds = 0;        // this GPU's share
};
OptimizerStepEstimate estimate_muon_step(const Setup& s);
// Newton-Schulz of `batch` matrices rows x cols stepped together (one batched call per GEMM, as
// an expert stack is): its FLOPs (flops_total = flops_per_gpu) and the GEMM model's seconds for
// optim::MuonConfig's default step count.
OptimizerStepEstimate newton_schulz_estimate(const hw::GemmModel& gm, std::int64_t rows, std::int64_t cols,
                                             std::int64_t batch);

struct StepEstimate {
  std::int64_t tokens_per_gpu_microbatch = 0;  // b*s/(cp*tsp)
  std::vector<GemmTiming> gemms;               // fwd + bwd (+ recomputed fwd)
  double attention_seconds = 0;                // score/value products, modelled as GEMMs
  double gemm_seconds = 0;                     // per micro-batch per GPU, all of the above
  double model_flops_per_gpu = 0;              // per micro-batch: MFU numerator
  double bubble = 0;                           // pipeline bubble fraction (pp-1)/(M+pp-1)
  std::int64_t tokens_per_step = 0;            // one optimizer step, all GPUs: b s x micro-batches x dp
  OptimizerStepEstimate optimizer;             // Muon's GEMMs per optimizer step
  double step_seconds = 0;                     // micro-batches x gemm_seconds / (1 - bubble) + optimizer
  double predicted_mfu = 0;                    // GEMM-bound ceiling (no communication, no elementwise)
};
StepEstimate estimate_step(const Setup& s);

struct TrainTime {
  double flops_per_token = 0;     // model FLOPs (MFU numerator)
  double seconds_at_mfu = 0;      // at Setup::mfu
  double seconds_predicted = 0;   // at StepEstimate::predicted_mfu
  double tokens_per_s_per_gpu_at_mfu = 0, tokens_per_s_per_gpu_predicted = 0;
};
TrainTime estimate_train_time(const Setup& s, const model::TokenFlops& f, const StepEstimate& step);

}  // namespace keel::size
