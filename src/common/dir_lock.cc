#include "common/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "common/error.h"

namespace keel {
namespace {

using Key = std::pair<unsigned long long, unsigned long long>;  // (st_dev, st_ino) of the lock file

std::mutex g_mutex;
std::map<Key, std::weak_ptr<DirLock>>& held() {
  static std::map<Key, std::weak_ptr<DirLock>> m;
  return m;
}

// The lock file's first line (the holder's description), trimmed; at most 1 KiB.
std::string first_line(int fd) {
  char buf[1024];
  const ssize_t n = ::pread(fd, buf, sizeof buf, 0);
  if (n <= 0) return "";
  std::string s(buf, static_cast<std::size_t>(n));
  s = s.substr(0, s.find('\n'));
  while (!s.empty() && (s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

}  // namespace

std::string lock_holder_line(const std::string& what) {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return fmt::format("pid {} on host {} since {} ({})", static_cast<long>(::getpid()), host, when, what);
}

DirLock::Result DirLock::acquire(const std::string& dir, const std::string& who) {
  const std::string path = (std::filesystem::path(dir) / kFileName).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot open the lock file {}: {}", path, std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("cannot stat the lock file {}: {}", path, std::strerror(err));
  }
  const Key key{static_cast<unsigned long long>(st.st_dev), static_cast<unsigned long long>(st.st_ino)};
  std::lock_guard<std::mutex> guard(g_mutex);
  Result r;
  if (auto it = held().find(key); it != held().end())
    if (auto mine = it->second.lock()) {  // this process holds it already: one run, one lock
      ::close(fd);
      r.lock = std::move(mine);
      return r;
    }
  // A holder writes its line just after it locks, and empties the file just before it lets go:
  // an empty file behind a held lock is read again for up to a second (or the lock taken).
  for (int attempt = 0;; ++attempt) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) break;
    const int err = errno;
    if (err == EWOULDBLOCK) r.holder = first_line(fd);
    if (err == EWOULDBLOCK && r.holder.empty() && attempt < 50) {
      ::usleep(20000);
      continue;
    }
    if (err != EWOULDBLOCK) r.unsupported = fmt::format("flock: {}", std::strerror(err));
    ::close(fd);
    return r;
  }
  // Ours. A clean release empties the file, so a line still in it was left by a holder that died.
  r.stale = first_line(fd);
  const std::string line = who + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size())) {
    const int err = errno;
    ::close(fd);
    fail("cannot write the lock file {}: {}", path, std::strerror(err));
  }
  r.lock = std::shared_ptr<DirLock>(new DirLock(fd, path, key.first, key.second));
  held()[key] = r.lock;
  return r;
}

DirLock::~DirLock() {
  std::lock_guard<std::mutex> guard(g_mutex);
  const Key key{dev_, ino_};
  if (auto it = held().find(key); it != held().end() && it->second.expired()) held().erase(it);
  // Emptied while still held (so nobody reads a half-cleared file), then released by the close.
  if (::ftruncate(fd_, 0) != 0) {
  }
  ::close(fd_);
}

}  // namespace keel
