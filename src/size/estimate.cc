#include "size/estimate.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "common/error.h"
#include "common/units.h"
#include "model/param_layout.h"
#include "optim/muon.h"
#include "parallel/tsp.h"
#include "size/keel_train_shards.h"

namespace keel::size {
namespace {

using model::AttentionKind;
using model::ModelConfig;
using model::Recompute;

constexpr double kBf16 = 2, kFp32 = 4;
// Decode reads HBM at about this fraction of the spec when no measurement is given
// (BabelStream copy/triad reach 84-89% on H100/H200; benchmarks.md 5.2).
constexpr double kDecodeHbmFraction = 0.85;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Bytes one routed row (one token's slot at one expert) leaves behind for backward: the
// dispatched input, gate and up, SiLU(gate) * up (recomputed under selective recompute) and the
// expert output the combine-weight gradient needs (bf16).
double routed_row_bytes(const ModelConfig& m, bool selective) {
  const double h = m.hidden, eh = m.expert_hidden;
  return kBf16 * (h + 2 * eh + (selective ? 0 : eh) + h);
}

// Backward scratch per routed row at the experts' GPU: the output gradient (bf16) and input
// gradient (fp32) rows, and the expert MLP's fp32 dact with bf16 dgate, dup.
double routed_row_backward_scratch_bytes(const ModelConfig& m) {
  return (kBf16 + kFp32) * m.hidden + (kFp32 + 2 * kBf16) * m.expert_hidden;
}

// Bytes one token leaves behind in one layer for backward, before any sharding (bf16
// activations, fp32 softmax statistics and router logits). docs/size.md itemises them. Two
// parts: `whole`, the hidden-wide items (norm inputs and outputs, residual-scaling streams,
// routers, the routed rows' input and output), which tensor parallelism keeps for every token
// unless sequence parallelism splits the tokens; `split`, the items over heads and FFN / expert
// widths, which tensor parallelism divides either way.
struct LayerBytes {
  double whole = 0, split = 0;
  double total() const { return whole + split; }
};

// tensor: the ranks that divide the heads (tp x tsp). Past the kv heads a rank keeps one kv
// head's k and v (mha / gqa / linear), and CCA its whole pre-attention (ops/cca.h:
// Config::attend_q): counted here as `split` items times the degree.
LayerBytes layer_activation_parts(const ModelConfig& m, int layer, Recompute r, int tensor = 1) {
  const double h = m.hidden, hd = m.head_dim, q = m.heads * hd, kv = m.kv_heads * hd;
  LayerBytes b;
  if (r == Recompute::kFull) return {kBf16 * h, 0};  // the layer input only
  const bool sel = r == Recompute::kSelective;
  // Attention half.
  b.whole += kBf16 * h;                // norm input (the residual)
  if (!sel) b.whole += kBf16 * h;      // norm output = projection input (selective: recomputed)
  switch (model::layer_attention_kind(m, layer)) {
    case AttentionKind::kMha:
    case AttentionKind::kGqa:
    case AttentionKind::kLinear: {
      // past the kv heads each rank's query heads read one kv head: its k and v per rank
      const double kvr = tensor > m.kv_heads ? hd * tensor : kv;
      b.split += kBf16 * (q + 2 * kvr);            // q, k, v
      if (m.qk_norm && !sel) b.split += kBf16 * (q + kvr);  // pre-norm q, k
      if (model::layer_attention_kind(m, layer) == AttentionKind::kLinear)
        b.split += kFp32 * m.heads * hd * hd / m.linear_chunk;  // per-chunk d x d prefix states
      break;
    }
    case AttentionKind::kCca: {
      const double ch = static_cast<double>(m.cca_q_dim) + m.cca_k_dim;
      const double whole = tensor > m.kv_heads ? tensor : 1;  // replicated: every rank, every head
      b.split += whole * kBf16 * ch;               // pre-conv q~|k~ (kept either way)
      if (!sel) b.split += whole * kBf16 * 3 * ch; // conv1 out, conv2 out, normalised q|k
      b.split += whole * kBf16 * m.cca_v_dim;      // v (current | previous token)
      if (tensor > m.kv_heads) b.split += kBf16 * (q + 2 * hd * tensor);  // the attended heads' copies
      break;
    }
  }
  b.split += kBf16 * q + kFp32 * m.heads;  // attention output (o-proj input) and log-sum-exp
  if (m.residual_scaling) b.whole += kBf16 * 2 * h;  // (x + b) of both streams
  // MLP half.
  b.whole += kBf16 * h;
  if (!sel) b.whole += kBf16 * h;
  if (model::is_moe_layer(m, layer)) {
    const double k = m.top_k, eh = m.expert_hidden, classes = m.experts + (m.router_skip_expert ? 1.0 : 0.0);
    if (m.router_hidden > 0)
      b.whole += kBf16 * m.router_hidden * (2.0 * m.router_mlp_layers);  // down out, normed, MLP pre/post GELU
    b.whole += kFp32 * 2 * classes;                      // logits, probabilities
    const double row = routed_row_bytes(m, sel), row_hidden = kBf16 * 2 * h;  // input and output rows
    b.whole += k * row_hidden;
    b.split += k * (row - row_hidden);
    const double se = static_cast<double>(m.shared_experts) * eh;
    b.split += kBf16 * (sel ? 2 : 3) * se;
  } else {
    b.split += kBf16 * (sel ? 2 : 3) * m.ffn_hidden;
  }
  if (m.residual_scaling) b.whole += kBf16 * 2 * h;
  return b;
}

// a * b, or a one-line error naming the quantity when it overflows int64.
std::int64_t checked_mul(std::int64_t a, std::int64_t b, const char* what) {
  std::int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) throw UsageError(fmt::format("{} overflows int64 ({} x {})", what, a, b));
  return r;
}

// layer_gemms() works in the config's int sizes: a sum past INT_MAX (experts + the skip class
// at experts = 2^31 - 1) comes back as a negative dimension, which the GEMM model would turn
// into negative waves and times. Refuse it, naming the GEMM.
void require_positive_shape(const model::Gemm& g, const ModelConfig& m) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.batch <= 0)
    throw UsageError(fmt::format("model '{}': GEMM '{}' has a dimension that is not positive ({}x{}x{} x{}): a size "
                                 "in the config is too large",
                                 m.name, g.name, g.m, g.n, g.k, g.batch));
}

bool column_parallel(const std::string& n) {
  return n == "qkv" || n == "q" || n == "k" || n == "v" || n == "linear_qkv" || n == "mlp_up_gate" ||
         n == "shared_up_gate" || n == "expert_up_gate" || n == "lm_head";
}
bool row_parallel(const std::string& n) {
  return n == "attn_out" || n == "linear_out" || n == "mlp_down" || n == "shared_down" || n == "expert_down";
}

// Whether the layout text gives `key` (mesh::parse has checked its form).
bool gives(const std::string& text, const std::string& key) {
  for (const std::string& part : split_list(text))
    if (part.substr(0, part.find('=')) == key) return true;
  return false;
}

}  // namespace

mesh::Shape parse_layout(const std::string& text, int gpus) {
  bool dp_given = false;
  mesh::Shape l = mesh::parse(text, &dp_given);
  if (!gives(text, "zero")) l.zero = 1;  // keel size's default, keel train's ZeRO-1
  if (gpus > 0) mesh::fill_data(l, dp_given, gpus, text);
  mesh::validate(l, fmt::format("layout '{}'", text));
  return l;
}

void check_layout(const mesh::Shape& l, const ModelConfig& m) {
  if (m.heads % (l.tp * l.tsp) != 0)
    throw UsageError(fmt::format("--layout: tp*tsp = {} does not divide heads ({})", l.tp * l.tsp, m.heads));
  if (l.pp > m.layers) throw UsageError(fmt::format("--layout: pp={} is more than the {} layers", l.pp, m.layers));
  if (l.ep > 1 && m.experts == 0) throw UsageError(fmt::format("--layout: ep={} needs an MoE model", l.ep));
  if (m.experts > 0 && m.experts % l.ep != 0)
    throw UsageError(fmt::format("--layout: ep={} does not divide experts ({})", l.ep, m.experts));
}

std::int64_t tokens_per_local_expert(std::int64_t tokens_local, int ep, int top_k, int experts) {
  const std::int64_t rows = checked_mul(checked_mul(tokens_local, ep, "routed rows per micro-batch (tokens x ep)"),
                                        top_k, "routed rows per micro-batch (tokens x ep x top_k)");
  // rows + experts must fit too: layer_gemms() rounds tokens x top_k up as (... + experts - 1).
  std::int64_t sum = 0;
  if (__builtin_add_overflow(rows, experts, &sum))
    throw UsageError(fmt::format("routed rows per micro-batch (tokens x ep x top_k + experts) overflows int64 ({} + {})",
                                 rows, experts));
  return rows / experts + (rows % experts != 0 ? 1 : 0);
}

double MemoryEstimate::total() const {
  double t = 0;
  for (const auto& i : items) t += i.bytes;
  return t;
}

namespace {

// keel's fused LM head + cross-entropy (ops/cuda/cross_entropy.h, train/cuda_backend): the
// bf16 [N, V] logits are kept from forward to backward when they take at most an eighth of the
// GPU; otherwise the vocabulary is walked in ce_chunk columns with an fp32 and a bf16 block.
// Either way backward accumulates dhidden in fp32 [N, D].
MemoryItem logits_item(const ModelConfig& m, const Setup& s, double tokens_local) {
  const mesh::Shape& l = s.layout;
  const double vocab_local = static_cast<double>(m.vocab_size) / (l.tp * l.tsp);
  const double kept = tokens_local * vocab_local * kBf16;
  const double accumulator = tokens_local * m.hidden * kFp32;
  const double gpu_bytes = s.hardware.profile.hbm_gib * 1024.0 * 1024 * 1024;
  // TSP's head visits its pieces one after another: it keeps no logits (tsp_cuda.h)
  if (l.tsp == 1 && (gpu_bytes <= 0 || kept <= gpu_bytes / 8))
    return {"logits (bf16, kept for backward)", kept + accumulator};
  const double chunk = std::min(static_cast<double>(s.ce_chunk), vocab_local);
  return {fmt::format("logits (chunks of {} columns)", static_cast<std::int64_t>(chunk)),
          tokens_local * chunk * (kFp32 + kBf16) + accumulator};
}

}  // namespace

MemoryEstimate estimate_memory(const Setup& s) {
  const ModelConfig& m = s.model;
  const mesh::Shape& l = s.layout;
  const model::ParamCounts pc = model::count_params(m);
  const double L = m.layers, per_stage = static_cast<double>(ceil_div(m.layers, l.pp));
  const double frac = per_stage / L;
  const double shard_dense = l.dp * l.cp, shard_expert = static_cast<double>(l.dp) * l.cp / l.ep;

  // Parameters on one GPU of the body (layers of one stage), split by how ZeRO shards them
  // and by which optimizer Muon gives them.
  double body_dense = 0, body_expert = 0, body_matrix = 0, emb = 0, head = 0;
  for (const auto& c : pc.components) {
    if (c.name == "embedding") {
      emb = static_cast<double>(c.total) / (l.tp * l.tsp);  // vocab-parallel
      continue;
    }
    if (c.name == "lm_head") {
      head = static_cast<double>(c.total) / (l.tp * l.tsp);
      continue;
    }
    // router and norm vectors replicate over tp; CCA's convolutions and temperatures split by heads
    // up to its kv heads (model/param_layout.cc), whole past them
    const bool sharded =
        (c.matrix && c.name != "router") || (c.name == "cca_conv" && l.tp * l.tsp <= m.kv_heads);
    double p = static_cast<double>(c.total) * frac / (sharded ? l.tp * l.tsp : 1);
    if ((c.name == "attention" || c.name == "linear_attention") && l.tp * l.tsp > m.kv_heads) {
      // mha / gqa past the kv heads: the k and v projections whole on every rank (param_layout)
      const double kv = 2.0 * m.hidden * m.kv_heads * m.head_dim / static_cast<double>(c.per_layer);
      p = static_cast<double>(c.total) * frac * ((1 - kv) / (l.tp * l.tsp) + kv);
    }
    if (c.name == "cca_attention" && l.tp * l.tsp > m.kv_heads) {
      // More ranks than kv heads: CCA's q|k and value projections replicate (model/param_layout),
      // only W_o divides (the convolutions, never sharded here, replicate too).
      const double wo = static_cast<double>(m.cca_q_dim) * m.hidden / static_cast<double>(c.per_layer);
      p = static_cast<double>(c.total) * frac * (wo / (l.tp * l.tsp) + (1 - wo));
    }
    if (c.expert) {
      p /= l.ep;
      body_expert += p;
    } else {
      body_dense += p;
    }
    if (c.matrix) body_matrix += p;
  }
  if (m.tied_embeddings && l.pp > 1) head = emb;  // the last stage keeps its own copy of the tied matrix

  const double tokens_local = static_cast<double>(s.micro_batch) * s.seq / (l.cp * l.tsp);
  // Rows of the hidden-wide items (the residual stream, norms, routers): tensor parallelism keeps
  // every token's unless sequence parallelism splits them over tp; the items over heads and
  // widths divide by tp either way (LayerBytes).
  const double act_tokens = l.tp > 1 && !s.sequence_parallel ? tokens_local : tokens_local / l.tp;
  const double split_tokens = tokens_local / l.tp;
  const int inflight = l.pp > 1 ? std::min(l.pp, s.micro_batches) : 1;

  MemoryEstimate best;
  double per_token[3] = {0, 0, 0};
  LayerBytes mean_parts[3], worst_layer_none;
  for (int i = 0; i < 3; ++i)
    for (int layer = 0; layer < m.layers; ++layer) {
      const LayerBytes b = layer_activation_parts(m, layer, static_cast<Recompute>(i), l.tp * l.tsp);
      per_token[i] += b.total() / L;
      mean_parts[i].whole += b.whole / L;
      mean_parts[i].split += b.split / L;
      if (i == 0 && b.total() > worst_layer_none.total()) worst_layer_none = b;
    }
  for (int i = 0; i < 3; ++i) best.activation_bytes_per_token_layer[i] = per_token[i];
  int moe_layers = 0;
  for (int layer = 0; layer < m.layers; ++layer) moe_layers += model::is_moe_layer(m, layer) ? 1 : 0;

  struct Stage {
    const char* name;
    bool first, last;
  };
  std::vector<Stage> stages;
  if (l.pp == 1) stages.push_back({"single stage", true, true});
  else stages = {{"first", true, false}, {"last", false, true}};

  const std::optional<KeelTrainShards> kt = keel_train_shards(s);
  double best_total = -1;
  for (const Stage& st : stages) {
    MemoryEstimate e;
    e.stage = st.name;
    double dense = body_dense, expert = body_expert, matrix = body_matrix;
    if (st.first) dense += emb;
    if (st.last) dense += head;  // embeddings and head stay on AdamW (ZAYA1's split), not in `matrix`
    e.params_on_gpu = dense + expert;
    const double params_sharded = dense / shard_dense + expert / shard_expert;
    const double w = l.zero >= 3 ? params_sharded : e.params_on_gpu;
    const double g = l.zero >= 2 ? params_sharded : e.params_on_gpu;
    const double o = l.zero >= 1 ? params_sharded : e.params_on_gpu;
    e.items.push_back({"weights (bf16)", kBf16 * w});
    e.items.push_back({"gradients (fp32)", kFp32 * g});
    // fp32 master and m (Muon's momentum) for every parameter, v for AdamW's; keel train's own
    // ZeRO-1 cuts where it runs the layout.
    if (kt) {
      e.items.push_back({s.optimizer == Optimizer::kMuon ? "optimizer (Muon 8 B, AdamW 12 B; busiest shard)"
                                                         : "optimizer (master, m, v: 12 B; busiest shard)",
                         kt->busiest_optimizer_bytes()});
      e.keel_train_optimizer_floats = kt->busiest_optimizer_floats();
      e.keel_train_optimizer_floats_mean = kt->mean_optimizer_floats();
      if (kt->bf16_reduce_scratch > 0)
        e.items.push_back({"gradient reduce scratch (bf16)", kBf16 * kt->bf16_reduce_scratch});
      if (kt->muon_workspace_bytes > 0) e.items.push_back({"Muon workspace (largest matrix batch)", kt->muon_workspace_bytes});
    } else if (s.optimizer == Optimizer::kMuon) {
      const double matrix_share = e.params_on_gpu > 0 ? matrix / e.params_on_gpu : 0;
      e.items.push_back({"optimizer (Muon 8 B matrices, AdamW 12 B rest)", o * (matrix_share * 8 + (1 - matrix_share) * 12)});
    } else {
      e.items.push_back({"optimizer (master, m, v: 12 B)", 12 * o});
    }
    const double layers = per_stage * (st.first ? inflight : 1);
    const auto on_rank = [&](const LayerBytes& b) { return b.whole * act_tokens + b.split * split_tokens; };
    auto acts = [&](Recompute r) {
      double a = on_rank(mean_parts[static_cast<int>(r)]) * layers;
      if (r == Recompute::kFull) a += on_rank(worst_layer_none);  // one layer rebuilt at a time
      return a;
    };
    e.activations_none = acts(Recompute::kNone);
    e.activations_selective = acts(Recompute::kSelective);
    e.activations_full = acts(Recompute::kFull);
    e.items.push_back({fmt::format("activations ({} recompute)", model::recompute_name(s.recompute)), acts(s.recompute)});
    {
      // keel train's CUDA model (train/cuda_model_cuda.cc) keeps the residual stream in fp32:
      // every layer's input (the activations count it in bf16; under full recompute as the
      // layer input) and the last layer's output.
      const double h = m.hidden;
      const double per_layer = s.recompute == Recompute::kFull ? (kFp32 - kBf16) * h : kFp32 * h;
      e.items.push_back({"fp32 residual stream (keel train)", act_tokens * (per_layer * per_stage + kFp32 * h)});
      // The attention block's bf16 output, kept per layer where it does not add into the stream
      // inside its GEMM: CCA, residual scaling, tensor parallelism (train/cuda_model_cuda.cc).
      const int cca_layers = model::attention_layer_count(m, AttentionKind::kCca);
      if (cca_layers > 0 || m.residual_scaling || l.tp > 1)
        e.items.push_back({"attention outputs (keel train)",
                           kBf16 * h * act_tokens * (s.recompute == Recompute::kFull ? 1 : per_stage)});
      // Under sequence parallelism keel train's MoE block routes every token of its gathered
      // input on each tensor rank: the router's state and the routed rows' input and output are
      // kept for all of them, where the activations count this rank's 1/tp.
      if (l.tp > 1 && s.sequence_parallel && moe_layers > 0) {
        const double classes = m.experts + (m.router_skip_expert ? 1.0 : 0.0);
        double per_token = kFp32 * 2 * classes + m.top_k * kBf16 * 2 * h;
        if (m.router_hidden > 0) per_token += kBf16 * m.router_hidden * (2.0 * m.router_mlp_layers);
        const double kept = s.recompute == Recompute::kFull ? 1 : moe_layers * frac;
        e.items.push_back({"routing state of the gathered tokens (keel train)",
                           (tokens_local - act_tokens) * kept * per_token});
      }
      // Its backward scratch, shared by the layers (one at a time): the residual stream's
      // gradients (fp32 and bf16) and the final norm's output over this rank's rows; the bf16
      // input gradient, the attention's (the output, q, k and v gradients in bf16; the local
      // core's fp32 q, k and v accumulators and D_i, where no context-parallel core holds k and v
      // of the whole sequence) and the MLP's (dense: the bf16 gate, up and activation gradients;
      // routed: routed_row_backward_scratch_bytes per row; the fp32 block output that routed
      // layers and tensor parallelism's split dense outputs add into) over the rows a block
      // reads (every token of this rank's sequences under TP).
      const double shard = static_cast<double>(l.tp) * l.tsp;
      const double q = static_cast<double>(m.heads) * m.head_dim / shard;
      const double kv = std::max<double>(1.0, static_cast<double>(m.kv_heads) / shard) * m.head_dim;
      const bool softmax = model::attention_layer_count(m, AttentionKind::kLinear) < m.layers;
      const double core = softmax && l.cp == 1 && l.tsp == 1 ? kFp32 * (2 * kv) + kFp32 * m.heads / shard : 0;
      double mlp = 0;
      if (moe_layers < m.layers) mlp += 3 * kBf16 * m.ffn_hidden / shard;
      if (moe_layers > 0) {
        const double eh = static_cast<double>(m.expert_hidden) / shard;
        mlp += m.top_k * ((kBf16 + kFp32) * h + (kFp32 + 2 * kBf16) * eh);
      }
      const bool residual_out = !m.residual_scaling || l.tsp > 1;
      if (residual_out && (moe_layers > 0 || (moe_layers < m.layers && l.tp > 1))) mlp += kFp32 * h;
      const double scratch = act_tokens * (2 * kFp32 * h + 2 * kBf16 * h) +
                             tokens_local * (kBf16 * h + kBf16 * (2 * q + 2 * kv) + kFp32 * q + core + mlp);
      e.items.push_back({"backward scratch (keel train)", scratch});
      // tensor parallelism's sequence-parallel gathers (tensor_parallel_cuda.h): four bf16 (two for
      // block inputs, one prefetched) and two fp32 [tokens, hidden] buffers (none without sequence
      // parallelism: its all-reduces work in place)
      if (l.tp > 1 && s.sequence_parallel) e.items.push_back({"sequence-parallel gathers (keel train)", 16 * tokens_local * h});
    }
    if (st.last) e.items.push_back(logits_item(m, s, tokens_local));
    if (l.cp > 1 && l.tsp == 1) {
      // keel train's context-parallel core (parallel/context_parallel_cuda.h): one layer's k and v
      // of the whole sequence gathered (bf16: the receive buffer and the reordered copy), their
      // fp32 gradients and the fp32 reduce-scatter buffer, plus this rank's send buffers.
      const double kv = std::max<double>(1.0, static_cast<double>(m.kv_heads) / l.tp) * m.head_dim;
      const double whole = static_cast<double>(s.micro_batch) * s.seq * kv;
      const int linear = model::attention_layer_count(m, AttentionKind::kLinear);
      // the ring and the all-to-all hold no whole-sequence k, v: their own buffers for the widest
      // layer instead (parallel/context_mode.h, the same bytes keel train allocates)
      const parallel::ContextExtents ext{s.micro_batch, s.seq / l.cp, m.heads / l.tp,
                                         static_cast<std::int64_t>(kv / m.head_dim), m.head_dim};
      const std::string name = std::string(parallel::context_buffer_name(s.context_mode)) + " (one layer)";
      if (s.context_mode == parallel::ContextMode::kRing && linear < m.layers)
        e.items.push_back({name, static_cast<double>(parallel::ring_buffer_bytes(ext))});
      else if (s.context_mode == parallel::ContextMode::kAllToAll)
        e.items.push_back({name, static_cast<double>(parallel::alltoall_buffer_bytes(ext, linear < m.layers, linear > 0))});
      else if (s.context_mode == parallel::ContextMode::kAllGather && linear < m.layers)
        e.items.push_back({name, 24 * whole + 12 * whole / l.cp});
      if (linear > 0) {
        // LASP-2 (parallel/lasp2.cc): fp32 d x d states of this rank's 2 runs per sequence and kv
        // head; every rank's gathered (one layer at a time, plus this rank's own and their
        // gradients), and each linear layer's runs' initial states kept for backward.
        const double states = 4.0 * s.micro_batch * 2 * kv * m.head_dim;
        e.items.push_back({"LASP-2 state gathers (one layer)", (l.cp + 2) * states});
        e.items.push_back({"LASP-2 initial states (linear layers)", linear / static_cast<double>(l.pp) * states});
      }
    }
    if (l.tsp > 1) {
      // keel train's GPU TSP (parallel/tsp_cuda.h): two weight shards (bf16, as the GEMMs read
      // them) and two fp32 gradient shards, each the size of the model's largest sub-block or
      // table piece; the partial outputs of the shards after the first (bf16 and fp32, this
      // rank's tokens); and one layer's k and v of one shard's heads over the whole sequence,
      // gathered as context parallelism's are.
      mesh::Shape shape;
      shape.tsp = l.tsp, shape.tp = l.tp, shape.ep = l.ep, shape.dp = l.dp, shape.cp = l.cp;
      try {
        const double largest =
            static_cast<double>(parallel::tsp_sizes(model::param_layout(m, shape), m.layers).largest);
        // two bf16 weight buffers; three fp32 gradient buffers (two computed into, one the MLP
        // ring's receive)
        e.items.push_back({"TSP shards (2 weight, 3 gradient)", (2 * 2 + 3 * 4) * largest});
      } catch (const UsageError&) {  // a width the degree does not divide: no shard to size
      }
      e.items.push_back({"TSP partial outputs", (kBf16 + kFp32) * tokens_local * m.hidden});
      // Each shard's pass through a MoE layer keeps its routed rows' bf16 input and output for
      // backward (train/cuda_model_cuda.cc carves an MLP saved set per shard); only this rank's
      // own shard's pass routes, so the router's state and the dispatch indices are kept once.
      // The activations count one pass; the tsp - 1 others are here (under full recompute, one
      // layer's).
      if (moe_layers > 0) {
        const double kept_layers = s.recompute == Recompute::kFull ? 1 : moe_layers * frac;
        e.items.push_back({"TSP per-shard routed rows",
                           (l.tsp - 1) * kept_layers * tokens_local * m.top_k * 2 * kBf16 * m.hidden});
      }
      const double kv = std::max<double>(1.0, static_cast<double>(m.kv_heads) / (l.tp * l.tsp)) * m.head_dim;
      const double whole = static_cast<double>(s.micro_batch) * s.seq * kv;
      // parallel.context_mode ring: the context core's two k/v blocks and the running output
      // for one shard's heads instead (parallel/context_mode.h, as keel train allocates them)
      const parallel::ContextExtents shard{s.micro_batch, s.seq / l.tsp, m.heads / (l.tp * l.tsp),
                                           static_cast<std::int64_t>(kv / m.head_dim), m.head_dim};
      if (model::attention_layer_count(m, AttentionKind::kLinear) < m.layers) {
        if (s.context_mode == parallel::ContextMode::kRing)
          e.items.push_back({"TSP k/v ring blocks (one layer, one shard's heads)",
                             static_cast<double>(parallel::ring_buffer_bytes(shard))});
        else
          e.items.push_back({"TSP k/v gathers (one layer, one shard's heads)", 24 * whole + 12 * whole / l.tsp});
      }
      // parallel.tsp_tables gather (train/cuda_model_cuda.cc): the micro-batch's token ids and
      // targets, bf16 final hidden states, an fp32 [tokens, D] buffer, every token's lse and the
      // head's statistics of every token against this rank's rows.
      const double batch_tokens = static_cast<double>(s.micro_batch) * s.seq;
      if (parallel::tsp_gathers_tables(s.tsp_tables, s.micro_batch * s.seq, m.vocab_size))
        e.items.push_back({"TSP table gathers", batch_tokens * (4 + 4 + (kBf16 + kFp32) * m.hidden + 3 * kFp32)});
    }
    if (model::attention_layer_count(m, AttentionKind::kLinear) > 0 && l.tsp == 1) {
      // keel train's CUDA linear attention (ops/cuda/linear_attention.h), one layer's workspace
      // shared by the layers: the bf16 d x d state before each 64-token chunk and its gradient,
      // per run (2 per sequence under context parallelism) and kv head, plus the segmented
      // scan's fp32 buffer (about 1/16 of them at its usual 16 chunks per segment).
      const double kv_heads = std::max<double>(1.0, static_cast<double>(m.kv_heads) / l.tp);
      const double runs = static_cast<double>(s.micro_batch) * (l.cp > 1 ? 2 : 1);
      const double chunks = std::ceil(static_cast<double>(s.seq) / l.cp / (l.cp > 1 ? 2 : 1) / 64.0);
      const double states = runs * kv_heads * chunks * m.head_dim * m.head_dim;
      e.items.push_back({"linear-attention chunk states (one layer)", 2 * 2 * states * (1 + 1.0 / 16)});
    }
    for (int i = 0; i < 3; ++i) e.activation_bytes_per_token_layer[i] = per_token[i];
    // Expert parallelism is dropless: a GPU saves every routed row its experts receive. With
    // balanced routing that is its own tokens' share, already in the activations; at worst (the
    // routers of the whole ep group pick this GPU's experts for every token) ep times that, in
    // every MoE layer whose rows are kept, plus the experts' backward scratch for those rows.
    if (l.ep > 1 && moe_layers > 0) {
      const bool full = s.recompute == Recompute::kFull;
      const double kept_layers = full ? 1 : moe_layers * frac;  // full recompute rebuilds one layer at a time
      const double extra_rows = (l.ep - 1) * act_tokens * m.top_k;
      e.ep_worst_case_extra =
          extra_rows * (routed_row_bytes(m, s.recompute == Recompute::kSelective) * kept_layers *
                            (st.first && !full ? inflight : 1) +
                        routed_row_backward_scratch_bytes(m));
    }
    if (e.total() > best_total) best_total = e.total(), best = e;
  }
  return best;
}

DecodeState decode_state(const ModelConfig& m) {
  DecodeState d;
  for (int layer = 0; layer < m.layers; ++layer) {
    switch (model::layer_attention_kind(m, layer)) {
      case AttentionKind::kMha:
      case AttentionKind::kGqa:
        d.kv_bytes_per_token += kBf16 * 2.0 * m.kv_heads * m.head_dim;
        break;
      case AttentionKind::kCca:
        d.kv_bytes_per_token += kBf16 * (static_cast<double>(m.cca_k_dim) + m.cca_v_dim);
        // conv_state: q~|k~ of the last (cw-1)+(gw-1) tokens; prev_hs: the previous hidden state.
        d.fixed_bytes_per_sequence +=
            kBf16 * ((static_cast<double>(m.cca_q_dim) + m.cca_k_dim) *
                         ((m.cca_conv_width - 1.0) + (m.cca_group_conv_width - 1.0)) +
                     m.hidden);
        break;
      case AttentionKind::kLinear:
        d.fixed_bytes_per_sequence += kFp32 * m.heads * static_cast<double>(m.head_dim) * m.head_dim;
        break;
    }
  }
  return d;
}

DecodePoint decode_step(const ModelConfig& m, const hw::Hardware& hw, int batch, std::int64_t context) {
  const model::ParamCounts pc = model::count_params(m);
  double experts_total = 0, expert_size = 3.0 * m.hidden * m.expert_hidden;
  for (const auto& c : pc.components)
    if (c.expert) experts_total = static_cast<double>(c.total);
  // Weights: everything but the embedding table (B rows read) and the routed experts; the
  // LM head matrix is read once per step, tied or not.
  double params = static_cast<double>(pc.total_non_embedding) - experts_total + static_cast<double>(pc.lm_head_matmul);
  double bytes = kBf16 * params + kBf16 * batch * static_cast<double>(m.hidden);
  if (m.experts > 0) {
    const double touched = m.experts * (1 - std::pow(1 - static_cast<double>(m.top_k) / m.experts, batch));
    bytes += kBf16 * model::moe_layer_count(m) * touched * expert_size;
  }
  const DecodeState st = decode_state(m);
  bytes += batch * (st.kv_bytes_per_token * static_cast<double>(context) + st.fixed_bytes_per_sequence);
  const double bw = hw.measured_hbm_tbps > 0 ? hw.measured_hbm_tbps * 1e12 : hw.profile.hbm_tbps * 1e12 * kDecodeHbmFraction;
  DecodePoint p;
  p.batch = batch;
  p.bytes = bytes;
  p.seconds = bytes / bw;
  return p;
}

StepEstimate estimate_step(const Setup& s) {
  const ModelConfig& m = s.model;
  const mesh::Shape& l = s.layout;
  const hw::GemmModel gm(s.hardware.profile, s.hardware.gemm_profile);
  StepEstimate st;
  st.tokens_per_gpu_microbatch = checked_mul(s.micro_batch, s.seq, "tokens per micro-batch (--micro-batch x --seq)") /
                                 (l.cp * l.tsp);
  const std::int64_t t = st.tokens_per_gpu_microbatch;
  const int shard = l.tp * l.tsp;
  if (m.experts > 0) (void)tokens_per_local_expert(t, l.ep, m.top_k, m.experts);  // checked before layer_gemms()

  for (model::Gemm g : model::layer_gemms(m, t, false)) {
    require_positive_shape(g, m);
    // Per-GPU shape: column-parallel layers split their outputs, row-parallel their inputs;
    // TSP runs its tsp shards one after another on local tokens. Experts: each GPU holds
    // experts/ep and receives the tokens routed to them from ep ranks.
    double repeats = 1;
    // CCA over more ranks than its kv heads: its q, k and v projections are whole on every rank
    // (model/param_layout.cc; TSP refuses that case)
    const bool cca_whole = shard > m.kv_heads && (g.name == "q" || g.name == "k" || g.name == "v");
    if (column_parallel(g.name) && !cca_whole) g.n = ceil_div(g.n, shard), repeats = l.tsp;
    // mha / gqa past the kv heads: the query heads split, the k and v projections replicate
    // (each rank's one kv head is what it computes: blocks::AttnShape::kv_head0)
    if ((g.name == "qkv" || g.name == "linear_qkv") && shard > m.kv_heads)
      g.n = ceil_div(static_cast<std::int64_t>(m.heads) * m.head_dim, shard) + 2 * m.head_dim;
    if (row_parallel(g.name)) g.k = ceil_div(g.k, shard), repeats = l.tsp;
    if (g.name == "expert_up_gate" || g.name == "expert_down") {
      g.m = tokens_per_local_expert(t, l.ep, m.top_k, m.experts);
      g.batch = m.experts / l.ep;
    }
    const double layers = static_cast<double>(g.layers) / l.pp;
    const int passes = s.recompute == Recompute::kFull && g.name != "lm_head" ? 2 : 1;
    for (int p = 0; p < passes; ++p) {
      GemmTiming f{g, gm.predict({g.m, g.n, g.k, g.batch}), layers, repeats};
      st.gemms.push_back(f);
    }
    model::Gemm dx{g.name, "bwd_data", g.m, g.k, g.n, g.batch, g.layers};
    model::Gemm dw{g.name, "bwd_weight", g.k, g.n, g.m, g.batch, g.layers};
    st.gemms.push_back({dx, gm.predict({dx.m, dx.n, dx.k, dx.batch}), layers, repeats});
    st.gemms.push_back({dw, gm.predict({dw.m, dw.n, dw.k, dw.batch}), layers, repeats});
  }
  for (const auto& g : st.gemms) st.gemm_seconds += g.seconds();

  // Attention core as GEMMs per layer: QK^T [s_local x s] and PV [s_local x d] per head, the
  // part a layer computes (model::attended_keys / s: half of it under the causal mask, less in a
  // sliding layer's window); backward twice the forward. Linear attention: the chunked products
  // (intra-chunk QK^T/PV, state update, readout).
  const double passes = 3 + (s.recompute == Recompute::kFull ? 1 : 0);
  const std::int64_t heads_local = m.heads / shard * l.tsp;  // tsp: every head, local queries
  const std::int64_t hb = heads_local * s.micro_batch;
  const std::int64_t d = m.head_dim;
  double softmax_share = 0;  // the softmax layers' parts of the products, per pipeline stage
  for (int layer = 0; layer < m.layers; ++layer)
    if (model::layer_attention_kind(m, layer) != AttentionKind::kLinear)
      softmax_share += model::attended_keys(m, layer, s.seq) / static_cast<double>(s.seq);
  softmax_share /= static_cast<double>(l.pp);
  const std::int64_t s_local = s.seq / (l.cp * l.tsp);
  if (softmax_share > 0) {
    const double qk = gm.predict({s_local, s.seq, d, hb}).seconds, pv = gm.predict({s_local, d, s.seq, hb}).seconds;
    st.attention_seconds += softmax_share * passes * (qk + pv);
  }
  const double linear_layers = model::attention_layer_count(m, AttentionKind::kLinear) / static_cast<double>(l.pp);
  if (linear_layers > 0) {
    const std::int64_t c = std::min<std::int64_t>(m.linear_chunk, s_local);
    const std::int64_t chunks = hb * ceil_div(s_local, c);
    const double intra = 0.5 * (gm.predict({c, c, d, chunks}).seconds + gm.predict({c, d, c, chunks}).seconds);
    const double state = gm.predict({d, d, c, chunks}).seconds + gm.predict({c, d, d, chunks}).seconds;
    st.attention_seconds += linear_layers * passes * (intra + state);
  }
  st.gemm_seconds += st.attention_seconds;

  const model::TokenFlops f = model::token_flops(m, s.seq);
  st.model_flops_per_gpu = f.training() * s.micro_batch * s.seq / (static_cast<double>(shard) * l.cp * l.pp);
  st.bubble = l.pp > 1 ? (l.pp - 1.0) / (static_cast<double>(s.micro_batches) + l.pp - 1) : 0;
  st.tokens_per_step = checked_mul(checked_mul(s.micro_batch, s.seq, "tokens per micro-batch (--micro-batch x --seq)"),
                                   static_cast<std::int64_t>(s.micro_batches) * l.dp,
                                   "tokens per step (--micro-batch x --seq x --micro-batches x dp)");
  if (s.optimizer == Optimizer::kMuon) st.optimizer = estimate_muon_step(s);
  st.step_seconds = s.micro_batches * st.gemm_seconds / (1 - st.bubble) + st.optimizer.seconds;
  st.predicted_mfu = s.micro_batches * st.model_flops_per_gpu / (st.step_seconds * gm.peak_tflops() * 1e12);
  return st;
}

OptimizerStepEstimate newton_schulz_estimate(const hw::GemmModel& gm, std::int64_t rows, std::int64_t cols,
                                             std::int64_t batch) {
  const int ns_steps = optim::MuonConfig{}.ns_steps;  // keel train's default, ZAYA1's
  const std::int64_t a = std::min(rows, cols), b = std::max(rows, cols);  // the Gram matrix is a x a
  OptimizerStepEstimate o;
  o.flops_total = o.flops_per_gpu = optim::newton_schulz_flops(rows, cols, ns_steps) * static_cast<double>(batch);
  o.seconds = ns_steps * (gm.predict({a, a, b, batch}).seconds + gm.predict({a, a, a, batch}).seconds +
                          gm.predict({a, b, a, batch}).seconds);
  return o;
}

OptimizerStepEstimate estimate_muon_step(const Setup& s) {
  if (const auto k = keel_train_shards(s)) {
    const int r = k->busiest_muon_rank();
    OptimizerStepEstimate o;
    o.flops_total = k->muon_flops_total;
    if (!k->rank_muon_seconds.empty()) o.flops_per_gpu = k->rank_muon_flops[r], o.seconds = k->rank_muon_seconds[r];
    return o;
  }
  const ModelConfig& m = s.model;
  const mesh::Shape& l = s.layout;
  const hw::GemmModel gm(s.hardware.profile, s.hardware.gemm_profile);
  const double mp = static_cast<double>(l.tp) * l.tsp * l.pp;
  OptimizerStepEstimate o;
  // One group of `count` x `batch` matrices rows x cols (batch: an expert stack, stepped by
  // batched GEMMs); share: the part of them this GPU steps.
  auto add = [&](std::int64_t rows, std::int64_t cols, std::int64_t batch, double count, double share) {
    if (rows < 1 || cols < 1) return;
    const OptimizerStepEstimate one = newton_schulz_estimate(gm, rows, cols, batch);
    o.flops_total += one.flops_total * count;
    o.flops_per_gpu += one.flops_total * count * share;
    o.seconds += one.seconds * count * share;
  };
  const std::int64_t q = static_cast<std::int64_t>(m.heads) * m.head_dim;
  const std::int64_t kv = static_cast<std::int64_t>(m.kv_heads) * m.head_dim;
  for (const model::Gemm& g : model::layer_gemms(m, 1, false)) {
    if (g.name == "lm_head") continue;  // AdamW, with the embedding
    // ZeRO >= 1: each matrix is stepped once, somewhere among all G GPUs. Without it every
    // replica steps what it holds: the model-parallel shard's matrices, experts split over ep.
    const bool expert = g.name.starts_with("expert_");
    const double share = l.zero >= 1 ? 1.0 / l.world() : 1.0 / (mp * (expert ? l.ep : 1));
    const double count = static_cast<double>(g.layers);
    if (g.name.ends_with("up_gate")) {  // gate and up, each [n / 2, k]
      add(g.n / 2, g.k, g.batch, 2 * count, share);
    } else if ((g.name == "qkv" || g.name == "linear_qkv") && g.n == q + 2 * kv) {
      add(q, g.k, g.batch, count, share);
      add(kv, g.k, g.batch, 2 * count, share);
    } else {
      add(g.n, g.k, g.batch, count, share);
    }
  }
  return o;
}

TrainTime estimate_train_time(const Setup& s, const model::TokenFlops& f, const StepEstimate& step) {
  TrainTime t;
  t.flops_per_token = f.training();
  const double peak = s.hardware.profile.bf16_tflops * 1e12;
  const double G = s.layout.world();
  t.tokens_per_s_per_gpu_at_mfu = peak * s.mfu / t.flops_per_token;
  t.tokens_per_s_per_gpu_predicted = peak * step.predicted_mfu / t.flops_per_token;
  if (s.tokens > 0) {
    t.seconds_at_mfu = s.tokens / (t.tokens_per_s_per_gpu_at_mfu * G);
    t.seconds_predicted = s.tokens / (t.tokens_per_s_per_gpu_predicted * G);
  }
  return t;
}

}  // namespace keel::size
