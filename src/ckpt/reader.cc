#include "ckpt/reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "ckpt/checksum.h"
#include "ckpt/geometry.h"
#include "ckpt/store.h"
#include "common/error.h"

namespace fs = std::filesystem;

namespace keel::ckpt {
namespace {

struct ReadOp {
  int file = 0;
  std::uint64_t offset = 0, nbytes = 0;
  char* dst = nullptr;
  const TensorMeta* tensor = nullptr;
  const StoredShard* shard = nullptr;  // set when the op reads the whole shard: check its CRC
  std::unique_ptr<char[]> scratch;     // verify_checksums: whole shard read here, runs copied out
  std::vector<std::pair<std::uint64_t, std::pair<char*, std::uint64_t>>> scatter;  // (src byte, (dst, n))
  std::vector<iovec> iov;              // coalesced: consecutive file bytes into several destinations
};

// preadv of exactly the iovecs' total at `offset`, resuming after short reads.
bool preadv_all(int fd, std::vector<iovec> iov, std::uint64_t offset) {
  std::size_t first = 0;
  while (first < iov.size()) {
    const int cnt = static_cast<int>(std::min<std::size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = ::preadv(fd, iov.data() + first, cnt, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) errno = 0;
    if (n <= 0) return false;
    offset += static_cast<std::uint64_t>(n);
    std::size_t left = static_cast<std::size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return true;
}

class Fds {
 public:
  ~Fds() {
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }
  int add(int fd) {
    fds_.push_back(fd);
    return static_cast<int>(fds_.size()) - 1;
  }
  int fd(int i) const { return fds_[i]; }

 private:
  std::vector<int> fds_;
};

// A stored shard a request reads, and the part of it the request needs.
struct Part {
  const StoredShard* shard = nullptr;
  Box box;
};

// The parts of the stored shards that the request's box needs, checked to cover it exactly
// once. Counting elements is not enough: two overlapping shards and a hole elsewhere add up to
// the box's count, and the hole would load as whatever the buffer held.
std::vector<Part> parts_covering(const TensorMeta& t, const ShardIndex& index, const LoadRequest& q) {
  std::vector<Part> parts;
  std::vector<Box> boxes;
  for (std::size_t si : index.query(q.box)) {
    parts.push_back({&t.shards[si], *intersect(t.shards[si].box, q.box)});
    boxes.push_back(parts.back().box);
  }
  if (const auto pair = find_overlap(boxes)) {
    const StoredShard& a = *parts[pair->first].shard;
    const StoredShard& b = *parts[pair->second].shard;
    fail("tensor '{}': stored shards {} (in {}) and {} (in {}) overlap in {}: the checkpoint's metadata is damaged",
         t.name, box_str(a.box), a.file, box_str(b.box), b.file, box_str(*intersect(a.box, b.box)));
  }
  std::int64_t covered = 0;  // disjoint parts inside the box: the sum cannot exceed its volume
  for (const Part& p : parts) covered += p.box.volume();
  if (covered != q.box.volume())
    fail("tensor '{}': the checkpoint covers {} of the {} elements of {} the target asks for", q.name, covered,
         q.box.volume(), box_str(q.box));
  return parts;
}

}  // namespace

Reader::Reader(const std::string& path) : dir_(resolve_checkpoint(path)), meta_(read_metadata(dir_)) {}

LoadStats Reader::load(const std::vector<LoadRequest>& requests, const LoadOptions& options) const {
  const auto t0 = std::chrono::steady_clock::now();
  LoadStats st;
  Fds fds;
  std::map<std::string, int> file_index;
  std::vector<std::string> file_names;
  auto open_file = [&](const std::string& name, const TensorMeta& t) {
    auto it = file_index.find(name);
    if (it != file_index.end()) return it->second;
    const std::string path = (fs::path(dir_) / name).string();
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) fail("tensor '{}': cannot open data file {}: {}", t.name, path, std::strerror(errno));
    const int i = fds.add(fd);
    struct stat sb {};
    ::fstat(fd, &sb);
    const std::uint64_t want = meta_.files.at(name);
    if (static_cast<std::uint64_t>(sb.st_size) != want)
      fail("tensor '{}': data file {} has {} bytes, the metadata says {}: the file is truncated or damaged", t.name,
           path, static_cast<std::uint64_t>(sb.st_size), want);
    file_index[name] = i;
    file_names.push_back(path);
    return i;
  };

  std::vector<ReadOp> ops;
  std::map<const TensorMeta*, ShardIndex> indexes;
  for (const LoadRequest& q : requests) {
    const TensorMeta* t = meta_.find(q.name);
    if (!t) fail("tensor '{}' is not in the checkpoint {}", q.name, dir_);
    if (t->type != q.type)
      fail("tensor '{}': the checkpoint stores {}, the target asks for {}", q.name, elem_name(t->type),
           elem_name(q.type));
    if (t->shape != q.shape)
      fail("tensor '{}': the checkpoint's shape is {}, the target's {}", q.name, shape_str(t->shape),
           shape_str(q.shape));
    if (!box_within(q.box, q.shape))
      fail("tensor '{}': requested box {} lies outside {}", q.name, box_str(q.box), shape_str(q.shape));
    if (q.box.empty()) continue;
    if (!q.data) fail("tensor '{}': the request for {} has no destination buffer", q.name, box_str(q.box));
    const std::size_t es = elem_size(t->type);
    st.bytes_needed += static_cast<std::uint64_t>(q.box.volume()) * es;
    auto ix = indexes.find(t);
    if (ix == indexes.end()) {
      std::vector<Box> boxes;
      for (const auto& s : t->shards) boxes.push_back(s.box);
      ix = indexes.emplace(t, ShardIndex(boxes)).first;
    }
    for (const Part& p : parts_covering(*t, ix->second, q)) {
      const StoredShard& s = *p.shard;
      const Box& part = p.box;
      const int fi = open_file(s.file, *t);
      char* dst = static_cast<char*>(q.data);
      if (options.verify_checksums) {
        ReadOp op;
        op.file = fi;
        op.offset = s.offset;
        op.nbytes = s.nbytes;
        op.tensor = t;
        op.shard = &s;
        for_each_run(part, s.box, q.box, [&](const Run& r) {
          op.scatter.push_back({r.src * es, {dst + r.dst * es, r.count * es}});
        });
        ops.push_back(std::move(op));
        continue;
      }
      const bool whole = part == s.box;
      for_each_run(part, s.box, q.box, [&](const Run& r) {
        ReadOp op;
        op.file = fi;
        op.offset = s.offset + static_cast<std::uint64_t>(r.src) * es;
        op.nbytes = static_cast<std::uint64_t>(r.count) * es;
        op.dst = dst + r.dst * es;
        op.tensor = t;
        if (whole && op.nbytes == s.nbytes) op.shard = &s;
        ops.push_back(std::move(op));
      });
    }
  }

  // Sequential per file: sort by (file, offset), then split among threads in contiguous runs.
  std::sort(ops.begin(), ops.end(),
            [](const ReadOp& a, const ReadOp& b) { return std::tie(a.file, a.offset) < std::tie(b.file, b.offset); });
  // Coalesce runs that are consecutive in one file into one preadv (destinations may differ).
  {
    std::vector<ReadOp> merged;
    for (auto& op : ops) {
      const bool plain = !op.shard && op.scatter.empty();
      if (plain && !merged.empty()) {
        ReadOp& m = merged.back();
        if (!m.iov.empty() && m.file == op.file && m.offset + m.nbytes == op.offset && m.iov.size() < 4096 &&
            m.nbytes < (64ull << 20)) {
          m.iov.push_back({op.dst, op.nbytes});
          m.nbytes += op.nbytes;
          continue;
        }
      }
      if (plain) op.iov.push_back({op.dst, op.nbytes});
      merged.push_back(std::move(op));
    }
    ops = std::move(merged);
  }
  std::uint64_t total = 0;
  for (const auto& op : ops) total += op.nbytes;
  const int nt = std::max(1, std::min<int>(options.threads, static_cast<int>(ops.size())));
  std::vector<std::size_t> starts{0};
  for (std::uint64_t acc = 0, i = 0; i < ops.size(); ++i) {
    acc += ops[i].nbytes;
    if (static_cast<int>(starts.size()) < nt && acc * nt >= total * starts.size() && i + 1 < ops.size())
      starts.push_back(i + 1);
  }
  starts.push_back(ops.size());
  std::mutex mu;
  std::string error;
  std::atomic<std::uint64_t> verified{0};
  auto work = [&](std::size_t lo, std::size_t hi) {
    try {
      for (std::size_t i = lo; i < hi; ++i) {
        ReadOp& op = ops[i];
        if (!op.iov.empty()) {
          if (!preadv_all(fds.fd(op.file), op.iov, op.offset))
            fail("tensor '{}': cannot read {} bytes at {} of {}: {}", op.tensor->name, op.nbytes, op.offset,
                 file_names[op.file], errno ? std::strerror(errno) : "unexpected end of file");
          continue;
        }
        char* into = op.dst;
        if (!op.scatter.empty() || (op.dst == nullptr)) {
          op.scratch.reset(new char[op.nbytes]);
          into = op.scratch.get();
        }
        std::uint64_t got = 0;
        while (got < op.nbytes) {
          const ssize_t n = ::pread(fds.fd(op.file), into + got, op.nbytes - got, static_cast<off_t>(op.offset + got));
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0)
            fail("tensor '{}': cannot read {} bytes at {} of {}: {}", op.tensor->name, op.nbytes, op.offset,
                 file_names[op.file], n < 0 ? std::strerror(errno) : "unexpected end of file");
          got += static_cast<std::uint64_t>(n);
        }
        if (op.shard) {
          if (crc32c(0, into, op.nbytes) != op.shard->crc)
            fail("tensor '{}': checksum mismatch in shard {} ({} bytes at {} of {}): the data is corrupted",
                 op.tensor->name, box_str(op.shard->box), op.shard->nbytes, op.shard->offset, file_names[op.file]);
          ++verified;
        }
        for (const auto& [src, d] : op.scatter) std::memcpy(d.first, into + src, d.second);
        op.scratch.reset();
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mu);
      if (error.empty()) error = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (std::size_t k = 0; k + 1 < starts.size(); ++k) threads.emplace_back(work, starts[k], starts[k + 1]);
  for (auto& t : threads) t.join();
  if (!error.empty()) throw Error(error);
  st.bytes_read = total;
  st.reads = ops.size();
  st.shards_verified = verified;
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace keel::ckpt
