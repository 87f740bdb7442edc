// Loading with resharding. A rank states the boxes it needs in its own layout; for each,
// the interval index finds the stored shards that overlap, and each overlap decomposes into
// contiguous runs read with pread straight into the destination, in parallel, so exactly
// the needed bytes are read (read amplification 1.0). A stored shard read whole is checked
// against its CRC32C; `verify_checksums` reads every touched shard whole to check them all.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/metadata.h"
#include "ckpt/types.h"

namespace keel::ckpt {

struct LoadRequest {
  std::string name;
  ElemType type = ElemType::kF32;
  Shape shape;
  Box box;
  void* data = nullptr;  // box.volume() elements, row-major
};

struct LoadOptions {
  int threads = 4;
  bool verify_checksums = false;
};

struct LoadStats {
  std::uint64_t bytes_needed = 0, bytes_read = 0;
  std::uint64_t reads = 0;
  std::uint64_t shards_verified = 0;  // stored shards whose CRC was checked
  double seconds = 0;
  double amplification() const { return bytes_needed ? static_cast<double>(bytes_read) / bytes_needed : 1.0; }
  double gbps() const { return seconds > 0 ? bytes_read / seconds / 1e9 : 0; }
};

class Reader {
 public:
  // `path`: a checkpoint directory, or a root whose `latest` names one.
  explicit Reader(const std::string& path);
  const Metadata& metadata() const { return meta_; }
  const std::string& dir() const { return dir_; }
  // Fills every request; throws keel::Error naming the tensor or file on any mismatch,
  // missing coverage, missing/truncated file or checksum failure.
  LoadStats load(const std::vector<LoadRequest>& requests, const LoadOptions& options = {}) const;

 private:
  std::string dir_;
  Metadata meta_;
};

}  // namespace keel::ckpt
