// Hugging Face safetensors export and import. The file: 8 bytes little-endian u64 N, N bytes
// of JSON header ({name: {"dtype", "shape", "data_offsets": [begin, end)}, optional
// "__metadata__": {string: string}}, padded with spaces), then the raw little-endian,
// row-major data buffer, covered exactly by the tensors' ranges.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/types.h"

namespace keel::ckpt {

// One tensor of a safetensors file: its byte range [begin, end) within the data buffer.
struct SafetensorsEntry {
  std::string name;
  ElemType type = ElemType::kF32;
  Shape shape;
  std::uint64_t begin = 0, end = 0;
  std::uint64_t nbytes() const { return end - begin; }
};

// A safetensors file opened for reading. The constructor validates the header strictly (JSON,
// dtypes, shapes against byte ranges, ranges tiling the data buffer exactly) and throws
// keel::Error naming the file (and tensor) otherwise. Tensor data is read on demand.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // header order
  const nlohmann::json& metadata() const { return metadata_; }  // "__metadata__" (object, maybe empty)
  const SafetensorsEntry* find(const std::string& name) const;  // nullptr when absent
  // Reads the raw bytes of `e` (an entry of this file) into out[0 .. e.nbytes()).
  void read(const SafetensorsEntry& e, void* out) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
  nlohmann::json metadata_ = nlohmann::json::object();
};

// Writes a safetensors file whose header (every tensor's name, dtype, shape, in this order) is
// fixed up front; the data is then streamed tensor by tensor with append(), so no more than
// one tensor need be in memory. Written to a temporary name and renamed by commit(); a writer
// destroyed before commit() removes the temporary file.
class SafetensorsWriter {
 public:
  struct Tensor {
    std::string name;
    ElemType type = ElemType::kF32;
    Shape shape;
  };
  SafetensorsWriter(std::string path, const std::vector<Tensor>& tensors, const nlohmann::json& metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // Bytes of the next tensor, whole or in consecutive pieces.
  void append(const void* data, std::uint64_t bytes);
  void commit();
  std::uint64_t data_bytes() const { return total_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  std::uint64_t total_ = 0, written_ = 0;
};

struct SafetensorsStats {
  std::uint64_t tensors = 0, bytes = 0;
  std::int64_t step = 0;
  std::string path;
};

// Refuses an export output `out` that would replace a file the export reads or a checkpoint
// beside it (anything inside `checkpoint_dir`; when that is a step directory, its root's
// `latest` and step directories), anything that is not a regular file, and an existing file
// unless `overwrite` (`--force`). Paths are compared canonically, so symlinks and `..` do not
// get around it. Throws keel::Error naming `out`.
void check_export_target(const std::string& checkpoint_dir, const std::string& out, bool overwrite);

// Writes every tensor of the checkpoint at `src` whole into one .safetensors file (atomically);
// `out` is checked with check_export_target first.
SafetensorsStats export_safetensors(const std::string& src, const std::string& out, int threads,
                                    bool overwrite = false);

// The step a keel export recorded in the file's __metadata__ ("keel.step"), or nullopt when it
// has none. Throws keel::Error naming the file when the entry is not a non-negative integer.
std::optional<std::int64_t> recorded_step(const SafetensorsFile& file);

// Reads a .safetensors file into a new checkpoint under root `dst` (require_new_root) at
// `step`, or when nullopt the step the file records, else 0 (each tensor one replicated shard;
// loads reshard it to any layout). Validates the header strictly.
SafetensorsStats import_safetensors(const std::string& in, const std::string& dst, std::optional<std::int64_t> step,
                                    int threads);

}  // namespace keel::ckpt
