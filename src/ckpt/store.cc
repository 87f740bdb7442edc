#include "ckpt/store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "ckpt/metadata.h"
#include "common/error.h"
#include "common/fileio.h"

namespace fs = std::filesystem;

namespace keel::ckpt {

std::string step_dir_name(std::int64_t step) { return fmt::format("step_{:08d}", step); }

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) fail("cannot open directory {}: {}", dir, std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) fail("cannot fsync directory {}: {}", dir, std::strerror(err));
}

void commit_file(const std::string& path, const std::string& text) {
  write_file_atomically(path, text);
  fsync_dir(fs::path(path).parent_path().string());
}

bool parse_step_dir_name(const std::string& name, std::int64_t* step) {
  if (name.size() < 6 || name.rfind("step_", 0) != 0) return false;
  const char* first = name.data() + 5;
  const char* last = name.data() + name.size();
  if (!std::all_of(first, last, [](char c) { return c >= '0' && c <= '9'; })) return false;
  std::int64_t n = 0;
  const auto [end, ec] = std::from_chars(first, last, n);
  if (ec != std::errc() || end != last) return false;  // out of range for int64
  if (name != step_dir_name(n)) return false;          // "step_42": not a name keel writes
  *step = n;
  return true;
}

std::vector<StepEntry> list_steps(const std::string& root) {
  std::vector<StepEntry> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    std::int64_t step = 0;
    if (!e.is_directory() || !parse_step_dir_name(e.path().filename().string(), &step)) continue;
    out.push_back({step, e.path().string(), fs::exists(e.path() / kMetadataFile)});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.step < b.step; });
  return out;
}

std::string latest_dir(const std::string& root) {
  const fs::path p = fs::path(root) / kLatestFile;
  if (!fs::exists(p)) return "";
  std::string name = read_file(p.string());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  std::int64_t step = 0;
  if (!parse_step_dir_name(name, &step)) fail("{}: does not name a step directory ('{}')", p.string(), name);
  return (fs::path(root) / name).string();
}

std::string resolve_checkpoint(const std::string& path) {
  if (!fs::exists(path)) fail("{}: no such checkpoint or directory", path);
  if (fs::exists(fs::path(path) / kMetadataFile)) return path;
  std::int64_t step = 0;
  if (parse_step_dir_name(fs::path(path).filename().string(), &step)) return path;  // read_metadata says it is incomplete
  const std::string latest = latest_dir(path);
  if (latest.empty()) fail("{}: no committed checkpoint (no '{}' pointer and no {})", path, kLatestFile, kMetadataFile);
  if (!fs::exists(fs::path(latest) / kMetadataFile))
    fail("{}: '{}' points to {}, which has no {}", path, kLatestFile, latest, kMetadataFile);
  return latest;
}

void require_new_root(const std::string& dst) {
  std::error_code ec;
  const fs::file_status st = fs::status(dst, ec);
  if (!fs::exists(st)) return;
  if (!fs::is_directory(st)) fail("{}: exists and is not a directory: the destination must be a new checkpoint root", dst);
  if (fs::exists(fs::path(dst) / kMetadataFile))
    fail("{}: is a checkpoint directory: the destination must be a new checkpoint root", dst);
  if (fs::exists(fs::symlink_status(fs::path(dst) / kLatestFile)))
    fail("{}: already holds checkpoints (it has '{}'): the destination must be a new checkpoint root", dst, kLatestFile);
  for (fs::directory_iterator it(dst, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("step_", 0) == 0)
      fail("{}: already holds {}: the destination must be a new checkpoint root", dst, name);
  }
  if (ec) fail("cannot list {}: {}", dst, ec.message());
}

std::vector<std::string> apply_retention(const std::string& root, int keep_last, int keep_every) {
  const auto steps = list_steps(root);
  const std::string latest = latest_dir(root);
  std::vector<std::int64_t> committed;
  for (const auto& s : steps)
    if (s.committed) committed.push_back(s.step);
  const std::int64_t newest = committed.empty() ? -1 : committed.back();
  std::vector<std::string> removed;
  for (const auto& s : steps) {
    bool keep = true;
    if (s.dir == latest) keep = true;
    else if (!s.committed) keep = s.step > newest;  // a torn save older than the newest commit is garbage
    else {
      const auto pos = std::find(committed.begin(), committed.end(), s.step) - committed.begin();
      const bool recent = keep_last <= 0 || static_cast<long>(committed.size()) - pos <= keep_last;
      const bool milestone = keep_every > 0 && s.step % keep_every == 0;
      keep = recent || milestone;
    }
    if (keep) continue;
    std::error_code ec;
    fs::remove_all(s.dir, ec);
    if (!ec) removed.push_back(s.dir);
  }
  return removed;
}

}  // namespace keel::ckpt
