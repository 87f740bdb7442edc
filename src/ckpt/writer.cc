#include "ckpt/writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>

#include <fmt/format.h>

#include "ckpt/checksum.h"
#include "ckpt/geometry.h"
#include "ckpt/metadata.h"
#include "ckpt/store.h"
#include "common/error.h"
#include "common/process.h"
#include "device/host_memory.h"

namespace fs = std::filesystem;

namespace keel::ckpt {
namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Write-behind for one file written front to back: when a window of `window` bytes is full its
// writeback starts (SYNC_FILE_RANGE_WRITE); the window before it is waited for. At most two
// windows are dirty at a time. The written pages stay in the page cache, clean: a restart on
// this host reads the newest checkpoint from memory instead of the disk (keel run checks every
// shard's checksum before it resumes, then keel train loads it), and the kernel reclaims clean
// pages whenever memory is wanted. Durability still comes from the final fsync; where the file
// system refuses sync_file_range (EINVAL, ENOSYS, EOPNOTSUPP, ESPIPE) the writer goes on without
// it, and a real I/O error reaches the fsync too.
class FlushBehind {
 public:
  FlushBehind(int fd, std::uint64_t window) : fd_(fd), window_(window) {}
  // The file now holds [0, end).
  void wrote(std::uint64_t end) {
    if (window_ == 0 || end - started_ < window_) return;
    if (!range(started_, end - started_, SYNC_FILE_RANGE_WRITE)) return;
    if (started_ > waited_) {  // the window before this one: on disk
      if (!range(waited_, started_ - waited_,
                 SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER))
        return;
      waited_ = started_;
    }
    started_ = end;
  }
  std::uint64_t flushed() const { return waited_; }

 private:
  bool range(std::uint64_t offset, std::uint64_t n, unsigned flags) {
    if (::sync_file_range(fd_, static_cast<off_t>(offset), static_cast<off_t>(n), flags) == 0) return true;
    window_ = 0;  // unsupported here (or failing): the final fsync does it all
    return false;
  }
  int fd_;
  std::uint64_t window_;
  std::uint64_t started_ = 0;  // writeback started for [waited_, started_)
  std::uint64_t waited_ = 0;   // on disk: [0, waited_)
};
}  // namespace

// A staging buffer reused across saves and the shards laid out in it (= in its file).
namespace {

std::uint64_t shard_bytes(const SaveShard& s) { return static_cast<std::uint64_t>(s.box.volume()) * elem_size(s.type); }

// Which staging bucket (data file) each writable shard goes to: largest first, each to the
// least-loaded of up to `threads` buckets. The same for save() and reserve().
struct BucketPlan {
  std::vector<std::size_t> order;     // writable shards, largest first
  std::vector<int> bucket_of;         // per shard (-1: not written by this rank)
  std::vector<std::uint64_t> used;    // bytes per bucket
  std::vector<char> device;           // per bucket: holds a shard in GPU memory
};

BucketPlan plan_buckets(const std::vector<SaveShard>& shards, int threads) {
  BucketPlan p;
  for (std::size_t i = 0; i < shards.size(); ++i)
    if (shards[i].write && !shards[i].box.empty()) p.order.push_back(i);
  std::stable_sort(p.order.begin(), p.order.end(),
                   [&](std::size_t a, std::size_t b) { return shard_bytes(shards[a]) > shard_bytes(shards[b]); });
  const int nb = std::max(1, std::min<int>(threads, static_cast<int>(p.order.size())));
  p.used.assign(static_cast<std::size_t>(nb), 0);
  p.device.assign(static_cast<std::size_t>(nb), 0);
  p.bucket_of.assign(shards.size(), -1);
  for (std::size_t i : p.order) {
    int best = 0;
    for (int b = 1; b < nb; ++b)
      if (p.used[b] < p.used[best]) best = b;
    p.used[best] += shard_bytes(shards[i]);
    p.device[best] = p.device[best] || shards[i].on_device;
    p.bucket_of[i] = best;
  }
  return p;
}

}  // namespace

struct Saver::Bucket {
  HostBuffer buf;  // staging, grown (never shrunk); pinned once a device shard was staged
  std::uint64_t used = 0;
  std::string file, path;
  struct Item {
    std::size_t shard;  // index into report_["shards"]
    std::uint64_t offset, nbytes;
    std::uint32_t crc = 0;
  };
  std::vector<Item> items;
  std::string error;
  double seconds = 0;
  std::uint64_t flushed = 0;  // bytes written back while writing (SaveOptions::flush_behind_bytes)
};

Saver::Saver(Comm& comm, std::string root, SaveOptions options)
    : comm_(comm), root_(std::move(root)), opt_(options) {
  if (opt_.threads < 1) opt_.threads = 1;
  if (opt_.chunk_bytes < 4096) opt_.chunk_bytes = 4096;
}

Saver::~Saver() {
  if (!in_flight_) return;
  // Do not leave threads running; a destructor cannot run the collective commit.
  for (auto& t : threads_) t.join();
}

double Saver::save(std::int64_t step, const std::vector<SaveShard>& shards, const nlohmann::json& state,
                   const nlohmann::json& rank_state, const std::string& layout) {
  const double t0 = now_s();
  if (in_flight_) wait();  // one save in flight: complete the previous one first
  // step_-0000005 would commit a directory no listing recognizes and a `latest` no load can follow.
  if (step < 0) fail("checkpoint: cannot save step {}: steps are non-negative", step);
  // No communication here, so the stall is the staging copy alone. Every rank sees the same
  // answer to "is this step committed?" (nothing writes metadata while no save is in flight).
  // Files a torn earlier attempt left are overwritten (O_TRUNC) or removed at commit.
  const std::string dir = (fs::path(root_) / step_dir_name(step)).string();
  if (fs::exists(fs::path(dir) / kMetadataFile)) throw Error(fmt::format("{}: step {} is already committed", dir, step));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create {}: {}", dir, ec.message());
  step_ = step;
  enospc_ = opt_.fail_with_enospc || (opt_.fail_with_enospc_at && opt_.fail_with_enospc_at(step));
  delay_ms_ = opt_.write_delay_ms_at ? std::max<std::int64_t>(0, opt_.write_delay_ms_at(step)) : 0;
  dir_ = dir;
  layout_ = layout;
  report_ = nlohmann::json::object();
  report_["rank_state"] = rank_state;
  if (comm_.rank() == 0) report_["state"] = state;
  nlohmann::json tensors = nlohmann::json::array(), recs = nlohmann::json::array();

  for (const SaveShard& s : shards) {
    if (!box_within(s.box, s.shape))
      fail("tensor '{}': shard {} lies outside its shape {}", s.name, box_str(s.box), shape_str(s.shape));
    tensors.push_back({{"name", s.name}, {"dtype", elem_name(s.type)}, {"shape", s.shape},
                       {"placement", placement_to_json(s.placement)}});
    if (s.write && !s.box.empty() && !s.data) fail("tensor '{}': shard {} to write has no data", s.name, box_str(s.box));
  }
  const BucketPlan bp = plan_buckets(shards, opt_.threads);
  const int nb = static_cast<int>(bp.used.size());
  while (static_cast<int>(buckets_.size()) < nb) buckets_.push_back(std::make_unique<Bucket>());
  for (int b = 0; b < nb; ++b) {
    Bucket& k = *buckets_[b];
    k.used = 0;
    k.items.clear();
    k.error.clear();
    k.seconds = 0;
    k.file = fmt::format("data_r{:05d}_b{}.bin", comm_.rank(), b);
    k.path = (fs::path(dir_) / k.file).string();
  }
  const std::vector<int>& bucket_of = bp.bucket_of;
  for (std::size_t i : bp.order) {
    Bucket& k = *buckets_[bucket_of[i]];
    const std::uint64_t n = shard_bytes(shards[i]);
    k.items.push_back({i, k.used, n, 0});
    k.used += n;
  }
  // The stall proper: copy into the staging buffers (grown, never shrunk).
  for (int b = 0; b < nb; ++b) {
    Bucket& k = *buckets_[b];
    bool device = false;
    for (auto& it : k.items) device = device || shards[it.shard].on_device;
    if (k.buf.size() < k.used || (device && !k.buf.pinned() && pinned_host_memory_available()))
      k.buf = HostBuffer(std::max<std::uint64_t>(k.used, k.buf.size()), device);
    for (auto& it : k.items)
      copy_to_host(k.buf.data() + it.offset, shards[it.shard].data, it.nbytes, shards[it.shard].on_device);
  }
  for (std::size_t i = 0; i < shards.size(); ++i) {
    if (bucket_of[i] < 0) continue;
    const SaveShard& s = shards[i];
    recs.push_back({{"name", s.name}, {"offsets", s.box.offsets}, {"lengths", s.box.lengths},
                    {"file", buckets_[bucket_of[i]]->file}});
  }
  // Items point into recs by shard index; rewrite to record positions.
  std::map<std::size_t, std::size_t> rec_of;
  for (std::size_t i = 0, r = 0; i < shards.size(); ++i)
    if (bucket_of[i] >= 0) rec_of[i] = r++;
  for (int b = 0; b < nb; ++b)
    for (auto& it : buckets_[b]->items) it.shard = rec_of[it.shard];
  report_["tensors"] = std::move(tensors);
  report_["shards"] = std::move(recs);

  written_ = 0;
  pending_ = nb;
  in_flight_ = true;
  threads_.clear();
  for (int b = 0; b < nb; ++b) threads_.emplace_back([this, b] { write_bucket(*buckets_[b]); });
  stall_s_ = now_s() - t0;
  return stall_s_;
}

void Saver::reserve(const std::vector<SaveShard>& shards) {
  if (in_flight_) fail("checkpoint: reserve() while a save is in flight");
  const BucketPlan bp = plan_buckets(shards, opt_.threads);
  while (buckets_.size() < bp.used.size()) buckets_.push_back(std::make_unique<Bucket>());
  for (std::size_t b = 0; b < bp.used.size(); ++b) {
    Bucket& k = *buckets_[b];
    const bool pinned = bp.device[b] && pinned_host_memory_available();
    if (k.buf.size() < bp.used[b] || (pinned && !k.buf.pinned())) {
      k.buf = HostBuffer(std::max<std::uint64_t>(bp.used[b], k.buf.size()), pinned);
      // touch every page now, so the first save does not pay the page faults either
      if (k.buf.size() > 0) std::memset(k.buf.data(), 0, k.buf.size());
    }
  }
}

void Saver::write_bucket(Bucket& k) {
  const double t0 = now_s();
  try {
    const int fd = ::open(k.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) fail("cannot create {}: {}", k.path, std::strerror(errno));
    try {
      for (auto& it : k.items) it.crc = crc32c(0, k.buf.data() + it.offset, it.nbytes);
      std::uint64_t pos = 0;
      FlushBehind behind(fd, opt_.flush_behind_bytes);
      k.flushed = 0;
      // a delayed save (fault injection) writes in 64 paced pieces, so its progress shows
      const std::uint64_t chunk = delay_ms_ > 0 ? std::max<std::uint64_t>(4096, k.used / 64) : opt_.chunk_bytes;
      while (pos < k.used) {
        const std::uint64_t n = std::min(chunk, k.used - pos);
        if (enospc_) {
          errno = ENOSPC;
          fail("cannot write {}: {}", k.path, std::strerror(errno));
        }
        const ssize_t w = ::pwrite(fd, k.buf.data() + pos, n, static_cast<off_t>(pos));
        if (w < 0) {
          if (errno == EINTR) continue;
          fail("cannot write {}: {}", k.path, std::strerror(errno));
        }
        pos += static_cast<std::uint64_t>(w);
        behind.wrote(pos);
        if (delay_ms_ > 0) {
          const double due = 1e-3 * static_cast<double>(delay_ms_) * static_cast<double>(pos) / static_cast<double>(k.used);
          const double ahead = due - (now_s() - t0);
          if (ahead > 0) std::this_thread::sleep_for(std::chrono::duration<double>(ahead));
        }
        const std::int64_t total = written_ += w;
        if (opt_.die_after_bytes >= 0 && total >= opt_.die_after_bytes) {
          std::fprintf(stderr, "keel: fault injection: rank exits after writing %lld bytes of %s\n",
                       static_cast<long long>(total), k.path.c_str());
          std::fflush(stderr);
          std::_Exit(137);
        }
      }
      k.flushed = behind.flushed();
      if (::fsync(fd) != 0) fail("cannot fsync {}: {}", k.path, std::strerror(errno));
    } catch (...) {
      ::close(fd);
      throw;
    }
    if (::close(fd) != 0) fail("cannot close {}: {}", k.path, std::strerror(errno));
  } catch (const std::exception& e) {
    k.error = e.what();
  }
  k.seconds = now_s() - t0;
  --pending_;
}

std::optional<SaveStats> Saver::wait() {
  if (!in_flight_) return std::nullopt;
  const double tj = now_s();
  for (auto& t : threads_) t.join();
  threads_.clear();
  const double t0 = now_s(), blocked = t0 - tj;
  in_flight_ = false;

  // This rank's report: shard records completed with byte ranges and CRCs.
  std::string error;
  double write_s = 0;
  std::uint64_t bytes = 0, flushed = 0;
  nlohmann::json files = nlohmann::json::object();
  for (auto& kp : buckets_) {
    Bucket& k = *kp;
    if (k.path.empty() || k.path.rfind(dir_, 0) != 0) continue;
    if (!k.error.empty() && error.empty()) error = k.error;
    write_s = std::max(write_s, k.seconds);
    bytes += k.used;
    flushed += k.flushed;
    files[k.file] = k.used;
    for (const auto& it : k.items) {
      auto& r = report_["shards"][it.shard];
      r["byte_offset"] = it.offset;
      r["nbytes"] = it.nbytes;
      r["crc32c"] = it.crc;
    }
    k.path.clear();
  }
  report_["error"] = error;
  report_["files"] = files;
  report_["write_s"] = write_s;
  report_["bytes"] = bytes;
  const auto reports = comm_.gather(report_.dump());
  report_ = nlohmann::json();

  nlohmann::json outcome;
  if (comm_.rank() == 0) {
    try {
      Metadata m;
      m.step = step_;
      m.layout = layout_;
      m.world = comm_.size();
      if (!layout_.empty()) m.world = parse_mesh(layout_).world();  // offline tools write other worlds
      SaveStats st;
      std::vector<nlohmann::json> rs;
      for (const auto& text : reports) rs.push_back(nlohmann::json::parse(text));
      int failed = 0;
      std::string first;
      for (std::size_t r = 0; r < rs.size(); ++r)
        if (!rs[r]["error"].get<std::string>().empty()) {
          if (!failed++) first = fmt::format("rank {}: {}", r, rs[r]["error"].get<std::string>());
        }
      if (failed) {
        std::error_code ec;
        fs::remove_all(dir_, ec);  // every rank has stopped writing: the torn directory goes
        fail("save of step {} failed on {} rank(s), nothing committed, the previous checkpoint stays: {}", step_,
             failed, first);
      }
      std::map<std::string, TensorMeta> tensors;
      std::map<std::string, int> declared_by;
      for (std::size_t r = 0; r < rs.size(); ++r) {
        m.rank_states.push_back(rs[r]["rank_state"]);
        for (const auto& [f, n] : rs[r]["files"].items()) m.files[f] = n.get<std::uint64_t>();
        st.bytes += rs[r]["bytes"].get<std::uint64_t>();
        st.write_s = std::max(st.write_s, rs[r]["write_s"].get<double>());
        for (const auto& tj : rs[r]["tensors"]) {
          const std::string name = tj["name"];
          const ElemType type = parse_elem(tj["dtype"].get<std::string>());
          const Shape shape = tj["shape"].get<Shape>();
          auto [it, fresh] = tensors.try_emplace(name);
          if (fresh) {
            it->second.name = name;
            it->second.type = type;
            it->second.shape = shape;
            try {
              it->second.placement = placement_from_json(tj["placement"]);
              check_placement(it->second.placement);  // what an offline reshard will re-apply
            } catch (const Error& e) {
              fail("tensor '{}' (rank {}): {}", name, r, e.what());
            }
            declared_by[name] = static_cast<int>(r);
          } else if (it->second.type != type || it->second.shape != shape) {
            fail("tensor '{}': rank {} saves {} {}, rank {} saves {} {}", name, r, elem_name(type), shape_str(shape),
                 declared_by[name], elem_name(it->second.type), shape_str(it->second.shape));
          }
        }
        for (const auto& sj : rs[r]["shards"]) {
          StoredShard s;
          s.box.offsets = sj["offsets"].get<Shape>();
          s.box.lengths = sj["lengths"].get<Shape>();
          s.file = sj["file"];
          s.offset = sj["byte_offset"];
          s.nbytes = sj["nbytes"];
          s.crc = sj["crc32c"];
          tensors[sj["name"].get<std::string>()].shards.push_back(std::move(s));
        }
      }
      for (auto& [name, t] : tensors) {
        std::vector<Box> boxes;
        for (const auto& s : t.shards) boxes.push_back(s.box);
        const std::string problem = coverage_problem(t.shape, boxes);
        if (!problem.empty()) fail("tensor '{}' {}: {}: refusing to commit step {}", name, shape_str(t.shape), problem, step_);
        m.tensors.push_back(std::move(t));
      }
      // Leftovers of a torn earlier attempt at this step (e.g. from more ranks) go.
      for (const auto& e : fs::directory_iterator(dir_))
        if (!m.files.count(e.path().filename().string())) fs::remove_all(e.path());
      fsync_dir(dir_);   // the data files' directory entries
      fsync_dir(root_);  // the step directory's entry
      m.state = rs[0]["state"];
      m.state["step"] = step_;
      commit_file((fs::path(dir_) / kMetadataFile).string(), metadata_to_json(m));
      commit_file((fs::path(root_) / kLatestFile).string(), step_dir_name(step_) + "\n");
      st.removed = apply_retention(root_, opt_.keep_last, opt_.keep_every);
      st.files = static_cast<int>(m.files.size());
      outcome = {{"bytes", st.bytes}, {"write_s", st.write_s}, {"files", st.files}, {"removed", st.removed}};
    } catch (const std::exception& e) {
      outcome = {{"error", std::string(e.what())}};
    }
  }
  outcome = nlohmann::json::parse(comm_.bcast(comm_.rank() == 0 ? outcome.dump() : std::string()));
  if (outcome.contains("error")) throw Error(outcome["error"].get<std::string>());
  SaveStats st;
  st.step = step_;
  st.dir = dir_;
  st.stall_s = stall_s_;
  st.blocked_s = blocked;
  st.write_s = outcome["write_s"];
  st.bytes = outcome["bytes"];
  st.files = outcome["files"];
  st.flushed_behind = flushed;
  st.removed = outcome["removed"].get<std::vector<std::string>>();
  st.commit_s = now_s() - t0;
  return st;
}

}  // namespace keel::ckpt
