#include "common/fileio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "common/error.h"
#include "common/units.h"

namespace keel {

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail("cannot write {}: {}", path, std::strerror(errno));
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail("cannot write {}: {}", path, std::strerror(err));
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("cannot write {}: {}", path, std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail("cannot write {}: {}", path, std::strerror(err));
  }
}

std::string why_no_new_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return std::strerror(errno);
  ::close(fd);
  ::unlink(path.c_str());
  return "";
}

namespace {

// The rest of an open file (closed here), failing past max_bytes through too_large (which
// closes nothing: the fd is closed first).
template <typename TooLarge>
std::string read_all(int fd, const std::string& path, std::uint64_t max_bytes, TooLarge&& too_large) {
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      fail("cannot read {}: {}", path, std::strerror(err));
    }
    if (text.size() + static_cast<std::size_t>(n) > max_bytes) {
      ::close(fd);
      too_large();
    }
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return text;
}

}  // namespace

std::string read_file(const std::string& path) {
  // POSIX reads, not std::ifstream: an ifstream opens a directory without complaint and then
  // reads nothing, so a directory passed as a file became empty text. read() reports EISDIR.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot read {}: {}", path, std::strerror(errno));
  return read_all(fd, path, std::numeric_limits<std::uint64_t>::max(), [] {});
}

namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a pipe";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

std::string read_config_file(const std::string& path, std::uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail("cannot read {}: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("cannot read {}: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("cannot read {}: it is {}, not a config file", path, file_kind(st.st_mode));
  }
  auto too_large = [&](const std::string& size) {
    fail("cannot read {}: {} is too large for a config file (at most {}): is it the right file?", path, size,
         format_size(max_bytes));
  };
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    too_large(fmt::format("{} bytes", st.st_size));
  }
  // the file may have grown since fstat
  return read_all(fd, path, max_bytes, [&] { too_large("more than " + format_size(max_bytes)); });
}

}  // namespace keel
