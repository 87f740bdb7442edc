// Hugging Face safetensors export and import. The file: 8 bytes little-endian u64 N, N bytes
// of JSON header ({name: {"dtype", "shape", "data_offsets": [begin, end)}, optional
// "__metadata__": {string: string}}, padded with spaces), then the raw little-endian,
// row-major data buffer, covered exactly by the tensors' ranges.
#pragma once

#include <cstdint>
#include <string>

namespace keel::ckpt {

struct SafetensorsStats {
  std::uint64_t tensors = 0, bytes = 0;
  std::int64_t step = 0;
  std::string path;
};

// Writes every tensor of the checkpoint at `src` whole into one .safetensors file (atomically).
SafetensorsStats export_safetensors(const std::string& src, const std::string& out, int threads);

// Reads a .safetensors file into a new checkpoint under root `dst` at `step` (each tensor one
// replicated shard; loads reshard it to any layout). Validates the header strictly.
SafetensorsStats import_safetensors(const std::string& in, const std::string& dst, std::int64_t step, int threads);

}  // namespace keel::ckpt
