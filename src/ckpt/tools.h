// Offline tools over a checkpoint: inspect, verify (checksums and exact-once coverage), and
// reshard to another layout.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "ckpt/metadata.h"

namespace keel::ckpt {

// Prints the root's steps (committed or incomplete, which one `latest` names) when `path` is a
// root, then the checkpoint: step, layout, state, files and a tensor tree with shapes, types,
// shard counts and sizes.
void inspect(const std::string& path, std::FILE* out, bool list_shards);

struct VerifyResult {
  std::vector<std::string> problems;  // empty: the checkpoint verified
  std::uint64_t shards = 0, bytes = 0;
  std::string note;  // of a keel train checkpoint: "a complete train state", or what could not be checked
};
// Verifies one checkpoint directory: metadata, every data file's size, every shard's CRC32C
// (reading each file once, sequentially; the files in parallel) and coverage (every element
// exactly once); of a keel train checkpoint (state format keel.train/N) also that it is a whole
// train state: step counters, sampler position, each parameter's optimizer moments (m; v unless
// Muon trained it).
VerifyResult verify_checkpoint(const std::string& dir);
// Verifies `path` (a root: lists every step, verifies `latest` or all committed steps with
// `all`); prints what it finds and returns the number of problems.
int verify(const std::string& path, bool all, std::FILE* out);

struct ReshardStats {
  std::uint64_t bytes = 0;
  double amplification = 1, seconds = 0;
  std::string dir;
};
// Rewrites the checkpoint at `src` into the new root `dst` (require_new_root) in layout `to`
// (each tensor re-split by its recorded placement over the new mesh, one writer per distinct
// shard; every tensor kept, empty ones included), in this process.
ReshardStats reshard(const std::string& src, const std::string& dst, const std::string& to, int threads);

}  // namespace keel::ckpt
