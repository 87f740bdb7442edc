// The checkpoint root on disk and the commit protocol's file steps:
//   ROOT/step_00000042/{data_r<rank>_b<bucket>.bin..., metadata.json}
//   ROOT/latest            text "step_00000042\n", replaced atomically
// A step directory is committed exactly when it has metadata.json; metadata is written
// (temp, fsync, rename, fsync directory) only after every rank's data is durable, and
// `latest` only after that, so a crash leaves the previous checkpoint or the new one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel::ckpt {

std::string step_dir_name(std::int64_t step);  // "step_00000042"
// True when `name` is exactly step_dir_name(n) for some step n >= 0 (sets *step). Anything
// else (another spelling, a number beyond int64) is not a step directory: keel never made it,
// so listings skip it and retention never removes it.
bool parse_step_dir_name(const std::string& name, std::int64_t* step);

// Writes `text` to `path` via temp + fsync + rename, then fsyncs the directory.
void commit_file(const std::string& path, const std::string& text);
void fsync_dir(const std::string& dir);

struct StepEntry {
  std::int64_t step = 0;
  std::string dir;      // full path
  bool committed = false;  // has metadata.json
};
// Step directories under root, sorted by step.
std::vector<StepEntry> list_steps(const std::string& root);

// The directory `latest` names, or "" when there is none.
std::string latest_dir(const std::string& root);

// A path is a checkpoint directory (has metadata.json, or looks like step_N) or a root (has
// `latest`): returns the checkpoint directory to read. Throws keel::Error naming the path.
std::string resolve_checkpoint(const std::string& path);

// Offline tools (reshard, import) write a new root. Throws keel::Error naming `dst` when it
// already is a checkpoint directory, has a `latest` pointer or any step_* entry: saving there
// would move `latest` (maybe backwards) and let retention remove directories the tool did not
// make. A missing or empty directory, or one holding other files only, is fine.
void require_new_root(const std::string& dst);

// Retention after a commit: keeps the newest `keep_last` committed steps (0 keeps all), every
// step divisible by `keep_every` (0: none) and always `latest`; removes the others and any
// uncommitted directory older than the newest commit. Returns the removed directories.
std::vector<std::string> apply_retention(const std::string& root, int keep_last, int keep_every);

}  // namespace keel::ckpt
