// GPU incremental decoding (`keel generate --device cuda`, docs/generate.md): the model of
// generate.h on one GPU, with the CUDA ops of src/ops/cuda. Plain C++ (no CUDA headers), so the
// command and the tests include it in every build; without CUDA the factory throws.
//
// Precision, as the GPU training path (src/train/cuda_model_cuda.cc, src/blocks/cuda/) minus the fp32 master
// weights: every matrix (and the embedding table) is a bf16 copy on the device; norms, biases,
// residual scales, CCA temperatures and conv weights stay fp32; activations feeding GEMMs are
// bf16, the residual stream(s) fp32, GEMMs accumulate in fp32, router logits are fp32. The
// caches are bf16: k (after RoPE) and v [B, capacity, kv_heads, head_dim] per layer, and CCA's
// fixed state (depthwise-conv inputs, grouped-conv inputs, the previous token's value half),
// bf16 like the activations the CUDA CCA feeds its convs.
//
// prefill runs the training blocks unchanged (blocks/cuda/attention.h and mlp.h: linear, rope,
// flash attention, cca::forward, the routers and dropless MoE, ...) on B*T tokens and copies what
// they computed into the caches; decode runs the same per-token ops on B rows, with
// blocks/cuda/attention_decode.h for the attention over the cache (ops/cuda/decode_attention.h)
// and CCA's conv and value-shift states (blocks/cuda/decode_kernels.h). Every MoE layer
// synchronizes the stream once (moe::make_plan reads the per-expert row counts on the host; twice
// with ZAYA1's skip class), so a step is not a single CUDA graph.
#pragma once

#include <memory>
#include <string>

#include "generate/generate.h"

namespace keel::generate {

// True when keel was built with CUDA and a GPU is visible.
bool cuda_decoder_available();

// Empty when the GPU path can run this model; else the reason (head_dim not 64/128, CCA conv
// widths or channels beyond the CUDA CCA's limits, top_k beyond the CUDA router's).
std::string cuda_decoder_unsupported(const model::ModelConfig& cfg);

// Uploads the weights (the host copy is released) and sets up the GPU decoder on the current
// device. Throws keel::UsageError without CUDA, without a GPU, or for an unsupported model.
std::unique_ptr<Decoder> make_cuda_decoder(ModelWeights weights);

}  // namespace keel::generate
