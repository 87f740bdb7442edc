// Tuned GEMM algorithms on disk, so a training run reuses what `keel bench gemm` found fastest
// instead of taking the library's first guess. A JSON file (schema keel.gemm_tune/1) maps a
// key naming everything the choice depends on (device, library version, type, layout, shape,
// workspace) to the library's opaque algorithm bytes plus a readable description.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace keel::bench {

struct TunedAlgo {
  std::vector<std::uint8_t> algo;  // the library's opaque descriptor (cublasLtMatmulAlgo_t)
  std::string description;
  double us = 0;                   // its median time when tuned
  std::string tuned_at;            // UTC date and time
};

// The key for one GEMM: every field must match for a cached choice to apply.
std::string tune_key(const std::string& device, int sm_count, const std::string& library_version,
                     const std::string& dtype, const std::string& layout, std::int64_t m, std::int64_t n,
                     std::int64_t k, std::int64_t batch, std::uint64_t workspace);

// The default file: $KEEL_GEMM_TUNE_CACHE, else $XDG_CACHE_HOME/keel/gemm_tune.json, else
// ~/.cache/keel/gemm_tune.json; empty when none can be named.
std::string default_tune_cache_path();

class TuneCache {
 public:
  TuneCache() = default;
  // Reads `path` if it exists (a missing file is an empty cache; a corrupt one is an error).
  explicit TuneCache(std::string path);

  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::optional<TunedAlgo> find(const std::string& key) const;
  void put(const std::string& key, TunedAlgo algo);
  // Merges this run's entries into the file as it is now (other runs may have added theirs)
  // and writes it atomically, creating the directory. No-op without changes.
  void save();

 private:
  std::string path_;
  std::map<std::string, TunedAlgo> entries_, added_;
};

}  // namespace keel::bench
