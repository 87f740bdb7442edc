// `keel generate [CHECKPOINT] [--model M.yaml | --config TRAIN.yaml] --prompt TEXT ...`:
// prefill a prompt and decode token by token with caches, on the GPU (--device cuda: bf16) or the
// CPU (--device cpu: fp32), printing the text and the per-token latency at the batch sizes asked
// for (docs/generate.md).
#pragma once

#include <CLI/CLI.hpp>

namespace keel::generate {

void add_command(CLI::App& app);

}  // namespace keel::generate
