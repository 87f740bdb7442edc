// Incremental decoding (`keel generate`, docs/generate.md). This file: the CPU reference (fp32),
// an inference-only forward of MoeTransformer (src/train/model.{h,cc}) over the same blocks
// (src/blocks), reading the same flat fp32 parameter buffer (model::param_layout names and
// offsets, so a keel train checkpoint loads as it is), plus per-layer caches, so that after a
// prefill over the prompt every new token costs one forward of that token alone.
//
// Two forwards, deliberately on different code paths so that each checks the other:
//   prefill  the whole prompt at once with the training blocks unchanged (blocks::
//            attention_forward: ops::attention::forward, ops::cca::forward, ...;
//            blocks::mlp_forward): the same computation as MoeTransformer::forward. It then
//            fills the caches from what those ops computed (blocks::fill_cache).
//   decode   one token per sequence at position cache.length: per-token ops (norms,
//            projections, routers, experts) are the same ops on B rows; what depends on earlier
//            tokens (attention over the cache, the causal convs, CCA's previous-token values,
//            RoPE at the position) comes from the cache (blocks::attention_decode).
// Decoding from an empty cache is valid (it is a prefill one token at a time).
//
// The caches (per layer and sequence, fp32: k/v rows, CCA's conv and value-shift states) and the
// per-token attention over them are blocks/attention_decode.h; the attention and MLP blocks are
// those of training (blocks/attention.h, blocks/mlp.h), so this file is the driver: caches per
// batch, the layer loop, the head, sampling. MoE layers keep nothing across tokens (ZAYA1's EDA
// state flows from MoE stage to MoE stage within one token, so it lives in the per-call
// workspace only).
//
// Shapes: B sequences decoded together (all at the same position), V = vocab_size. Logits are
// fp32 [B, V] (or [B, T, V] from a prefill asked for every position).
// The GPU twin (bf16 weights and caches, the CUDA ops) is generate/cuda_decoder.h; generate()
// drives either through the Decoder interface below.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "blocks/attention_decode.h"
#include "blocks/rope_tables.h"
#include "blocks/weights.h"
#include "model/config.h"
#include "optim/param_groups.h"
#include "tensor/arena.h"
#include "tensor/tensor.h"

namespace keel::generate {

// What a generator needs of a trained (or freshly initialized) model.
struct ModelWeights {
  model::ModelConfig config;
  bool renormalize_gates = true;  // linear-router MoE: gates renormalized over the top_k (training's choice)
  std::vector<float> params;      // model::param_layout(config).total_floats
  std::vector<std::vector<float>> router_bias;  // one [classes] per MoE layer, in layer order
  std::string source;             // "checkpoint DIR (step N)" or "fresh init (seed S)"
};

// The model of a keel checkpoint (a checkpoint.dir root, its `latest`, or a step directory):
// weights and router biases from model/* and router/bias.* (train::load_model_weights). The
// model config and router.renormalize come from the train config saved in the checkpoint (keel
// train's, and keel ckpt import's: the release's config.json or --model); a checkpoint without
// one (imported before imports recorded it) needs `model` (a model config, renormalize_gates) to
// name it; given with a saved one, it must agree with it (model::model_key_values). Throws keel::Error naming the file or tensor on anything
// missing or mismatched.
ModelWeights load_checkpoint_weights(const std::string& path, const std::optional<ModelWeights>& model = std::nullopt);
// A freshly initialized model (model::init_parameters; router biases 0, -1 for the skip
// class), as MoeTransformer::init_parameters makes it.
ModelWeights fresh_weights(const model::ModelConfig& config, bool renormalize_gates, double init_std,
                           std::uint64_t seed);

using LayerCache = blocks::LayerCache;

struct Cache {
  int batch = 0;
  int capacity = 0;  // positions the k/v caches hold
  int length = 0;    // positions filled (the next token's position)
  std::vector<LayerCache> layers;
  // Bytes one sequence's cache holds at `length` positions (k/v rows in use plus the fixed CCA
  // state), the quantity that bounds batch x context in memory.
  std::int64_t bytes_per_sequence() const;
};

class InferenceModel {
 public:
  // Validates the config like keel train does (train::validate_trainable) and views the
  // parameters by name. Takes the weights by value (move them in).
  explicit InferenceModel(ModelWeights weights);
  ~InferenceModel();
  InferenceModel(const InferenceModel&) = delete;
  InferenceModel& operator=(const InferenceModel&) = delete;

  const model::ModelConfig& config() const { return w_.config; }
  const ModelWeights& weights() const { return w_; }

  // Empty caches for `batch` sequences of up to `capacity` positions (throws keel::UsageError
  // beyond the model's max_seq_len when it has one).
  Cache make_cache(int batch, int capacity) const;

  // tokens [B, T] row-major (B = cache.batch), cache empty (length 0). Full-sequence forward
  // with the training ops; leaves the cache at length T. logits: [B, T, V] with all_positions,
  // else [B, V] of the last position (resized).
  void prefill(const std::uint32_t* tokens, int T, Cache& cache, std::vector<float>& logits, bool all_positions);
  // One token per sequence (tokens [B]) at position cache.length; logits [B, V] (resized).
  void decode(const std::uint32_t* tokens, Cache& cache, std::vector<float>& logits);

 private:
  using LayerParams = blocks::LayerWeights;
  struct Work;
  // The workspace of a call over B x T tokens (head rows: the rows the LM head runs on), the
  // rotary tables for `capacity` positions, and each token's position from first_position.
  Work& prepare(std::int64_t B, std::int64_t T, std::int64_t head_rows, int capacity, int first_position);
  void plan(ArenaPlanner& p, std::int64_t B, std::int64_t T, std::int64_t head_rows);
  void embed(const std::uint32_t* ids, std::int64_t n, const Tensor& out);
  void attn_input(int l, Work& w);  // x_mid and h1 = n1(x_mid) from the streams
  void mlp_stage(int l, Work& w);   // after the attention: the streams leaving layer l
  void mlp(int l, Work& w, const Tensor& y);  // y = mlp(h2): dense, linear-router or ZAYA1 MoE
  void head(std::int64_t n, const Tensor& r, const Tensor& h, float* logits);  // final merge, norm, LM head

  ModelWeights w_;
  optim::ParamLayout layout_;
  std::vector<LayerParams> lp_;
  Tensor embed_, final_norm_, lm_head_;
  blocks::ResScale final_scale_;
  std::vector<int> moe_index_;  // per layer: MoE stage index or -1
  std::vector<model::AttentionKind> kind_;  // per layer
  blocks::RopeTables ropes_;  // each layer's rotary table (sliding layers may have their own)
  std::unique_ptr<Work> work_;
};

// What generate() drives: a model and the caches of one batch, on some device. Two exist: the
// CPU reference above (CpuDecoder, fp32) and the GPU one (make_cuda_decoder: bf16 weights and
// caches on the device, the CUDA ops of src/ops/cuda; generate/cuda_decoder.h). Logits always
// come back to the host as fp32 [B, V] (or [B, T, V]), so sampling is shared.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual const model::ModelConfig& config() const = 0;
  // One line for the user: "cpu (fp32)" or "cuda: <GPU name> (bf16 weights and caches)".
  virtual std::string device() const = 0;
  // Empties the caches for `batch` sequences of up to `capacity` positions (throws
  // keel::UsageError beyond the model's max_seq_len when it has one).
  virtual void start(int batch, int capacity) = 0;
  virtual int batch() const = 0;
  virtual int length() const = 0;  // positions filled
  // As InferenceModel::prefill / decode, on the caches of the last start().
  virtual void prefill(const std::uint32_t* tokens, int T, std::vector<float>& logits, bool all_positions) = 0;
  virtual void decode(const std::uint32_t* tokens, std::vector<float>& logits) = 0;
  // Greedy variants: the same call, then each sequence's argmax over ids < allowed of its last
  // logits (ties to the lower id, as Sampler's greedy choice) into next[B]. The GPU decoder
  // picks on the device and moves B ids instead of B x V logits; the default picks on the host.
  // next may alias tokens.
  // A row whose logits are not all finite gives kNonFiniteLogits.
  virtual void prefill_greedy(const std::uint32_t* tokens, int T, std::int64_t allowed, std::uint32_t* next);
  virtual void decode_greedy(const std::uint32_t* tokens, std::int64_t allowed, std::uint32_t* next);
  // Bytes one sequence's cache holds now (k/v rows in use plus fixed state).
  virtual std::int64_t cache_bytes_per_sequence() const = 0;

 protected:
  void host_argmax(std::int64_t allowed, std::uint32_t* next) const;
  std::vector<float> greedy_logits_;
};

// The CPU InferenceModel with its Cache.
class CpuDecoder final : public Decoder {
 public:
  explicit CpuDecoder(InferenceModel& model) : m_(model) {}
  const model::ModelConfig& config() const override { return m_.config(); }
  std::string device() const override { return "cpu (fp32 weights and caches)"; }
  void start(int batch, int capacity) override { cache_ = m_.make_cache(batch, capacity); }
  int batch() const override { return cache_.batch; }
  int length() const override { return cache_.length; }
  void prefill(const std::uint32_t* tokens, int T, std::vector<float>& logits, bool all_positions) override {
    m_.prefill(tokens, T, cache_, logits, all_positions);
  }
  void decode(const std::uint32_t* tokens, std::vector<float>& logits) override { m_.decode(tokens, cache_, logits); }
  std::int64_t cache_bytes_per_sequence() const override { return cache_.bytes_per_sequence(); }

 private:
  InferenceModel& m_;
  Cache cache_;
};

// Next-token choice: greedy (temperature 0) or sampling from softmax(logits / temperature)
// restricted to the top_k largest (0: all), from a seeded generator of its own per sequence
// (seed, sequence index), the same on every platform. Only ids < allowed_vocab are eligible
// (the model's padded vocabulary beyond the tokenizer's is never produced).
struct SamplingOptions {
  double temperature = 0.0;
  int top_k = 0;
  std::uint64_t seed = 1;
};

// What a greedy pick (host or device) or Sampler::next gives for a row whose logits are not all
// finite (NaN or inf: damaged or diverged weights): an id no vocabulary has, which generate()
// turns into an error instead of emitting a meaningless token.
inline constexpr std::uint32_t kNonFiniteLogits = 0xFFFFFFFFu;

class Sampler {
 public:
  // Throws keel::UsageError for a temperature that is negative or not finite, or top_k < 0.
  Sampler(const SamplingOptions& options, std::uint64_t sequence);
  // kNonFiniteLogits when any eligible logit is NaN or infinite.
  std::uint32_t next(const float* logits, std::int64_t allowed_vocab);

 private:
  double uniform();
  SamplingOptions o_;
  std::uint64_t state_;
  std::vector<std::pair<float, std::uint32_t>> cand_;
};

struct GenerateOptions {
  int batch = 1;                // sequences decoded together (each starts from the prompt)
  int max_new_tokens = 32;
  SamplingOptions sampling;
  std::int64_t allowed_vocab = 0;  // 0: the model's vocab_size
  std::optional<std::uint32_t> eos;  // stop a sequence there (all stopped: stop decoding)
};

struct GenerateResult {
  std::vector<std::vector<std::uint32_t>> generated;  // per sequence, new tokens (EOS included)
  double prefill_seconds = 0;
  std::vector<double> step_seconds;  // one per decode step (B tokens each)
  std::int64_t cache_bytes_per_sequence = 0;  // at the end
};

// Prefill the prompt (the same for every sequence) then decode up to max_new_tokens. Times are
// host wall clock around each call (the GPU decoder returns only once its logits are on the
// host, so they include the device work). Throws keel::UsageError when prompt + new tokens do
// not fit a cache (more positions than an int holds, or the model's max_seq_len), keel::Error
// when a step's logits are not finite.
GenerateResult generate(Decoder& decoder, const std::vector<std::uint32_t>& prompt, const GenerateOptions& o);
// The same on the CPU model.
GenerateResult generate(InferenceModel& model, const std::vector<std::uint32_t>& prompt, const GenerateOptions& o);

}  // namespace keel::generate
