// The model description shared by `keel size`, `keel bench gemm` and (later) `keel train`:
// one YAML file describes a dense or MoE decoder (see configs/*.yaml).
// The YAML keys are the field names below (flat, snake_case); docs/size.md lists them.
// Loader and validation: config.cc; layer GEMMs: gemms.cc.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace YAML {
class Node;
}

namespace keel::model {

enum class AttentionKind { kMha, kGqa, kCca, kLinear };

struct ModelConfig {
  std::string name;
  std::int64_t vocab_size = 0;
  int hidden = 0;
  int layers = 0;

  // Attention. MHA/GQA: q = heads*head_dim, k = v = kv_heads*head_dim.
  AttentionKind attention = AttentionKind::kGqa;
  int heads = 0, kv_heads = 0, head_dim = 0;
  // Per-layer attention kind for hybrids (e.g. linear attention for LASP-2 layers); empty:
  // every layer uses `attention`.
  std::vector<AttentionKind> layer_attention;
  // CCA (ZAYA1): latent q/k/v widths and the two causal convolution widths.
  int cca_q_dim = 0, cca_k_dim = 0, cca_v_dim = 0;
  int cca_conv_width = 0, cca_group_conv_width = 0;
  // Linear attention (LASP-2 layers): chunk length of the chunked causal form (intra-chunk
  // quadratic term, inter-chunk d x d state per head).
  int linear_chunk = 256;
  // Its feature map on q and k ("identity" or "elu1": elu(x) + 1) and decay ("none", or
  // "retnet": a fixed scalar per kv head, gamma_g = 1 - 2^(-5-g)); ops/linear_attention.h.
  std::string linear_feature = "identity", linear_decay = "none";
  bool qk_norm = false;  // RMSNorm on q and k (OLMoE): 2 vectors of heads*head_dim / kv dims

  // MLP. Dense layers: SwiGLU of width ffn_hidden. MoE layers: `experts` SwiGLU experts of
  // width expert_hidden, top_k routed per token, plus shared_experts always-on experts.
  int ffn_hidden = 0;
  int experts = 0, top_k = 0, expert_hidden = 0, shared_experts = 0;
  int moe_layer_interval = 1;   // every n-th layer is MoE (1 = all) when experts > 0
  int first_dense_layers = 0;   // leading dense layers before MoE starts
  // Router: 0 = a linear hidden -> experts router; > 0 = ZAYA1's MLP router of this width.
  int router_hidden = 0, router_mlp_layers = 0;
  bool router_skip_expert = false;

  bool tied_embeddings = false;
  // ZAYA1's two-stream residual scaling: per-channel (s_h, b_h, s_r, b_r) in every stage (a
  // ZAYA1 layer is two stages: CCA and MoE) and once more before the final norm.
  bool residual_scaling = false;
  double rope_fraction = 1.0, rope_base = 10000.0, norm_eps = 1e-5;
  int max_seq_len = 0;
  // Sliding-window layers (the ZAYA1 release's "hybrid_sliding" layer type): layer l slides
  // when layer_sliding is non-empty and layer_sliding[l % size] is set (one entry per layer or
  // a pattern repeated, as layer_attention). In a sliding layer token t attends to tokens
  // max(0, t - sliding_window + 1) .. t of its sequence (itself included, as Hugging Face's
  // sliding-window mask), and RoPE uses sliding_rope_base / sliding_rope_fraction; 0 and a
  // negative fraction mean "as rope_base / rope_fraction".
  std::vector<bool> layer_sliding;
  int sliding_window = 0;
  double sliding_rope_base = 0, sliding_rope_fraction = -1;

  bool operator==(const ModelConfig&) const = default;  // every field, the name included
};

// Loads and validates a model YAML. Throws keel::UsageError with a one-line message naming
// the file and the offending key (unknown keys, heads not dividing hidden, top_k > experts...).
ModelConfig load_model_config(const std::string& path);
// The same from a parsed YAML mapping (a train config's inline `model:`); `name` is the
// model's name unless the mapping sets one, `what` prefixes the errors.
ModelConfig parse_model_config(const YAML::Node& root, const std::string& name, const std::string& what);
// A keel train config's `model:` node: a model YAML path (relative to the working directory) or
// the model keys inline. `what` prefixes the errors ("train.yaml: model").
ModelConfig model_of_train_config(const YAML::Node& node, const std::string& what);
// The model a YAML describes: a model config, or a keel train config (its `model:`), so the
// config a checkpoint was trained with can stand for its model (`keel ckpt export --model`).
ModelConfig load_model_or_train_config(const std::string& path);
// Validates a config built in code (same checks as the loader).
void validate(const ModelConfig& m);

// The model YAML of `m`: a mapping of every key parse_model_config reads (but empty per-layer
// lists and the "unset" negative sliding_rope_fraction), which parse_model_config turns back into
// `m`, field for field. model_yaml is that mapping emitted as text.
YAML::Node model_node(const ModelConfig& m);
std::string model_yaml(const ModelConfig& m);

// Every key that shapes the computation with its value as text, in the form that makes equal
// text mean the same network: doubles in their shortest exact form, per-layer lists as what each
// layer runs ("attention" one kind or the list per layer, "layer_sliding" the sliding layers,
// the sliding_* keys as the sliding layers use them, "0" without any). The name is left out: a
// renamed copy of a model is the same model. Used to refuse a --model that is not a
// checkpoint's or a release's model, naming the first key that differs.
std::vector<std::pair<std::string, std::string>> model_key_values(const ModelConfig& m);

// Per-layer structure, from the fields above.
AttentionKind layer_attention_kind(const ModelConfig& m, int layer);
// MoE layers: experts > 0, layer >= first_dense_layers and (layer - first_dense_layers) is a
// multiple of moe_layer_interval (Megatron's moe_layer_freq: the first eligible layer is MoE).
bool is_moe_layer(const ModelConfig& m, int layer);
int moe_layer_count(const ModelConfig& m);
// Sliding-window layers: whether layer `layer` slides, its window (0: full causal attention)
// and its RoPE parameters (the sliding ones on sliding layers).
bool is_sliding_layer(const ModelConfig& m, int layer);
int attention_window(const ModelConfig& m, int layer);
double layer_rope_base(const ModelConfig& m, int layer);
double layer_rope_fraction(const ModelConfig& m, int layer);
bool any_sliding_layer(const ModelConfig& m);
int attention_layer_count(const ModelConfig& m, AttentionKind kind);
const char* attention_kind_name(AttentionKind k);  // "mha", "gqa", "cca", "linear"
// Tokens each expert sees when `tokens` are routed top_k ways evenly: ceil(tokens*top_k/experts).
std::int64_t tokens_per_expert(const ModelConfig& m, std::int64_t tokens);

// One GEMM C[m x n] = A[m x k] * B[k x n], repeated `batch` times (e.g. once per expert).
// FLOPs = 2 * m * n * k * batch.
struct Gemm {
  std::string name;   // e.g. "qkv", "attn_out", "expert_up_gate", "expert_down", "router", "lm_head"
  std::string pass;   // "fwd", "bwd_data" (dX = dY * W^T), "bwd_weight" (dW = X^T * dY)
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t batch = 1;
  // Layers of the model that run this GEMM (1 for the LM head): a hybrid model's distinct
  // layer types each appear once in layer_gemms() with their count here.
  std::int64_t layers = 1;
};

// The GEMMs of one transformer/MoE layer at `tokens` tokens per step, and the LM head.
// Forward: m = tokens (per expert for experts: ceil(tokens * top_k / experts)), k = input
// features, n = output features. With `backward`, each forward GEMM also yields its
// bwd_data (m = tokens, n = in, k = out) and bwd_weight (m = in, n = out, k = tokens) GEMMs.
// The list (see gemms.cc for the exact set): per attention kind present, its projections
// (GQA/MHA: "qkv" fused, "attn_out"; linear: "linear_qkv", "linear_out"; CCA: "q", "k", "v" (batch 2: current- and
// previous-token halves), "attn_out"); per MLP kind present, dense "mlp_up_gate" (fused) and
// "mlp_down", MoE "router" (linear) or "router_down" + "router_mlp<i>" (MLP router),
// "shared_up_gate"/"shared_down" when shared_experts > 0, "expert_up_gate"/"expert_down"
// (batch = experts); then "lm_head". Attention's score/value products are not listed (they
// are not weight GEMMs; flash attention fuses them).
std::vector<Gemm> layer_gemms(const ModelConfig& m, std::int64_t tokens, bool backward);

}  // namespace keel::model
