// The parts of generate/cuda_decoder.h every build has: the availability check, the model
// limits of the GPU path, and (without CUDA) the factory that says why there is none.
#include "generate/cuda_decoder.h"

#include <fmt/format.h>

#include "common/error.h"
#include "device/cuda_devices.h"

namespace keel::generate {

bool cuda_decoder_available() {
#ifdef KEEL_HAVE_CUDA
  return visible_cuda_devices() > 0;
#else
  return false;
#endif
}

std::string cuda_decoder_unsupported(const model::ModelConfig& cfg) {
  // The limits of ops/cuda: attention and CCA kernels (head_dim), causal_conv::kMaxWidth (8),
  // CCA's per-token shared memory (12288 q/k channels), router::kMaxTopK (16).
  if (cfg.head_dim != 64 && cfg.head_dim != 128)
    return fmt::format("head_dim {}: the CUDA attention kernels take 64 or 128", cfg.head_dim);
  bool any_cca = false;
  for (int l = 0; l < cfg.layers; ++l) any_cca |= model::layer_attention_kind(cfg, l) == model::AttentionKind::kCca;
  if (any_cca) {
    if (cfg.cca_conv_width > 8 || cfg.cca_group_conv_width > 8)
      return fmt::format("CCA conv widths {} and {}: the CUDA convs take at most 8", cfg.cca_conv_width,
                         cfg.cca_group_conv_width);
    if (std::int64_t(cfg.heads + cfg.kv_heads) * cfg.head_dim > 12288)
      return "CCA with (heads + kv_heads) * head_dim > 12288 channels";
  }
  if (cfg.experts > 0 && cfg.top_k > 16) return fmt::format("top_k {}: the CUDA router takes at most 16", cfg.top_k);
  return {};
}

#ifndef KEEL_HAVE_CUDA
std::unique_ptr<Decoder> make_cuda_decoder(ModelWeights) {
  throw UsageError("generate: --device cuda: this keel was built without CUDA (use --device cpu)");
}
#endif

}  // namespace keel::generate
