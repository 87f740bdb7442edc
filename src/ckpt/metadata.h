// The checkpoint's metadata file (metadata.json): per tensor its type, global shape and
// placement, per stored shard its box, file, byte range and CRC32C; the data files and their
// sizes; and the non-tensor state. Versioned: a reader rejects any other format version.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckpt/layout.h"
#include "ckpt/types.h"

namespace keel::ckpt {

inline constexpr const char* kFormatName = "keel.ckpt";
inline constexpr int kFormatVersion = 1;
inline constexpr const char* kMetadataFile = "metadata.json";
inline constexpr const char* kLatestFile = "latest";

struct StoredShard {
  Box box;
  std::string file;          // relative to the checkpoint directory
  std::uint64_t offset = 0;  // byte offset in the file
  std::uint64_t nbytes = 0;  // = box.volume() * elem_size
  std::uint32_t crc = 0;     // CRC32C of those bytes
};

struct TensorMeta {
  std::string name;
  ElemType type = ElemType::kF32;
  Shape shape;
  mesh::Placement placement;  // how it was laid out (offline resharding re-applies it to a new mesh)
  std::vector<StoredShard> shards;
  std::uint64_t nbytes() const { return byte_size(shape, type); }
};

struct Metadata {
  int version = kFormatVersion;
  std::int64_t step = 0;
  std::string layout;  // the mesh it was saved under (mesh::Shape::str; keel train: "dp=4,ep=2,zero=1")
  int world = 1;
  nlohmann::json state = nlohmann::json::object();        // step, data position, config, ...
  nlohmann::json rank_states = nlohmann::json::array();  // per saving rank (RNG states, ...)
  std::vector<TensorMeta> tensors;                        // sorted by name
  std::map<std::string, std::uint64_t> files;             // data file -> size in bytes

  const TensorMeta* find(const std::string& name) const;
};

std::string metadata_to_json(const Metadata& m);
// Parses and validates a metadata file's text; `path` names it in errors.
Metadata parse_metadata(const std::string& text, const std::string& path);
// Reads <dir>/metadata.json; a directory without one is an incomplete (uncommitted) save.
Metadata read_metadata(const std::string& dir);

}  // namespace keel::ckpt
