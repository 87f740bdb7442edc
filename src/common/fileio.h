// Small file helpers with the guarantees keel's outputs need.
#pragma once

#include <cstdint>
#include <string>

namespace keel {

// Writes `text` to `path` through a temporary file in the same directory, fsync and rename,
// so a failure never leaves a truncated file where a good one was. Throws keel::Error
// naming the path on failure.
void write_file_atomically(const std::string& path, const std::string& text);

// Creates `path` (a name nothing else uses) and removes it again: whether a new file can be
// made in its directory, found before hours of work rather than at the first write. Returns ""
// when it can, else the reason (strerror). An existing file at `path` is not touched.
std::string why_no_new_file(const std::string& path);

// Reads a whole file; throws keel::Error naming the path when it cannot.
std::string read_file(const std::string& path);

// The largest config file keel reads (train, model and data YAMLs, hardware-profile JSON):
// the largest shipped one is a few KiB, so a file past this is the wrong file.
inline constexpr std::uint64_t kMaxConfigBytes = std::uint64_t{16} << 20;

// Reads a config file whole, refusing before reading anything what cannot be one: a directory,
// a device, FIFO or socket (`keel train /dev/zero` read until the OOM killer), a file over
// `max_bytes`. Throws keel::Error naming the path and what was expected.
std::string read_config_file(const std::string& path, std::uint64_t max_bytes = kMaxConfigBytes);

}  // namespace keel
