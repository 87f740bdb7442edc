#include "ckpt/tools.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "ckpt/checksum.h"
#include "ckpt/comm.h"
#include "ckpt/geometry.h"
#include "ckpt/layout.h"
#include "ckpt/reader.h"
#include "ckpt/store.h"
#include "ckpt/writer.h"
#include "common/error.h"
#include "common/units.h"

namespace fs = std::filesystem;

namespace keel::ckpt {

void inspect(const std::string& path, std::FILE* out, bool list_shards) {
  if (fs::is_directory(path) && !fs::exists(fs::path(path) / kMetadataFile) && fs::exists(fs::path(path) / kLatestFile)) {
    const std::string latest = latest_dir(path);
    fmt::print(out, "root {}  (latest -> {})\n", path, fs::path(latest).filename().string());
    for (const auto& s : list_steps(path))
      fmt::print(out, "  {}  {}{}\n", fs::path(s.dir).filename().string(),
                 s.committed ? "committed" : "INCOMPLETE (no metadata.json: never committed, ignored by load)",
                 s.dir == latest ? "  <- latest" : "");
  }
  const std::string dir = resolve_checkpoint(path);
  const Metadata m = read_metadata(dir);
  std::uint64_t total = 0, shards = 0;
  for (const auto& t : m.tensors) total += t.nbytes(), shards += t.shards.size();
  fmt::print(out, "checkpoint {}\n", dir);
  fmt::print(out, "  format {} v{}  step {}  saved by {} ranks in layout {}\n", kFormatName, m.version, m.step, m.world,
             m.layout.empty() ? "(none)" : m.layout);
  fmt::print(out, "  {} tensors, {} shards, {} in {} data files\n", m.tensors.size(), shards, format_size(total),
             m.files.size());
  fmt::print(out, "  state: {}\n", m.state.dump());
  if (!m.rank_states.empty()) fmt::print(out, "  rank states: {} (rank 0: {})\n", m.rank_states.size(), m.rank_states[0].dump());
  // Tree: group by the name's first component.
  std::map<std::string, std::pair<std::uint64_t, int>> groups;
  for (const auto& t : m.tensors) {
    const std::string g = t.name.substr(0, t.name.find('.'));
    groups[g].first += t.nbytes();
    groups[g].second += 1;
  }
  std::string current;
  for (const auto& t : m.tensors) {
    const std::string g = t.name.substr(0, t.name.find('.'));
    if (g != current) {
      current = g;
      fmt::print(out, "  {}/  ({} tensors, {})\n", g, groups[g].second, format_size(groups[g].first));
    }
    fmt::print(out, "    {:<44} {:<5} {:<16} {:>3} shards  {:>10}\n", t.name, elem_name(t.type), shape_str(t.shape),
               t.shards.size(), format_size(t.nbytes()));
    if (list_shards)
      for (const auto& s : t.shards)
        fmt::print(out, "      {:<28} {} @ {} +{}  crc32c {:08x}\n", box_str(s.box), s.file, s.offset, s.nbytes, s.crc);
  }
  fmt::print(out, "  files:\n");
  for (const auto& [f, n] : m.files) fmt::print(out, "    {:<28} {:>10}\n", f, format_size(n));
}

namespace {

// A keel train checkpoint (state format keel.train/2 or /3, src/train/train_checkpoint.h) must be
// a whole train state, not only intact bytes: its step counters and sampler position, and for
// every model/<p> the optimizer's optim/exp_avg/<p>, plus optim/exp_avg_sq/<p> unless the state's
// muon_params lists p (Muon keeps no v; keel.train/2 stored v for all). A keel.train/3 state
// without muon_params (saved before keel recorded it) cannot tell a Muon parameter from a lost v:
// its v are not checked (*unchecked says so). Other checkpoints: nothing to check.
std::vector<std::string> train_state_problems(const Metadata& m, std::string* unchecked) {
  std::vector<std::string> out;
  const nlohmann::json& s = m.state;
  if (!s.is_object() || !s.contains("format") || !s["format"].is_string()) return out;
  const std::string format = s["format"].get<std::string>();
  if (format != "keel.train/2" && format != "keel.train/3") return out;
  for (const char* key : {"step", "optimizer_step"})
    if (!s.contains(key) || !s[key].is_number_integer() || s[key].get<std::int64_t>() < 0)
      out.push_back(fmt::format("train state '{}' is {} (expected a non-negative integer)", key,
                                s.contains(key) ? s[key].dump() : "missing"));
  if (!s.contains("sampler") || !s["sampler"].is_object())
    out.push_back(s.contains("sampler")
                      ? fmt::format("train state 'sampler' (the data sampler's position) is {}, not an object",
                                    s["sampler"].dump())
                      : std::string("train state 'sampler' (the data sampler's position) is missing"));
  std::set<std::string> names, muon;
  for (const auto& t : m.tensors) names.insert(t.name);
  const bool listed = s.contains("muon_params") && s["muon_params"].is_array();
  if (listed)
    for (const auto& n : s["muon_params"])
      if (n.is_string()) muon.insert(n.get<std::string>());
  if (format == "keel.train/3" && !listed)
    *unchecked = "its AdamW second moments are not checked: the state has no muon_params (saved by an older keel)";
  const std::string model = "model/", m1 = "optim/exp_avg/", m2 = "optim/exp_avg_sq/";
  for (const auto& n : names) {
    if (n.starts_with(model)) {
      const std::string p = n.substr(model.size());
      if (!names.contains(m1 + p))
        out.push_back(fmt::format("incomplete train state: tensor '{}{}' (the optimizer's first moment of '{}') is missing",
                                  m1, p, p));
      const bool needs_v = format == "keel.train/2" || (listed && !muon.contains(p));
      if (needs_v && !names.contains(m2 + p))
        out.push_back(fmt::format("incomplete train state: tensor '{}{}' (AdamW's second moment of '{}') is missing{}", m2,
                                  p, p, listed ? ", and the state's muon_params does not list the parameter" : ""));
    } else {
      for (const std::string& prefix : {m1, m2})
        if (n.starts_with(prefix) && !names.contains(model + n.substr(prefix.size())))
          out.push_back(fmt::format("incomplete train state: tensor '{}' has no parameter '{}{}'", n, model,
                                    n.substr(prefix.size())));
    }
  }
  if (out.empty() && unchecked->empty()) *unchecked = "a complete train state";
  return out;
}

}  // namespace

VerifyResult verify_checkpoint(const std::string& dir) {
  VerifyResult r;
  Metadata m;
  try {
    m = read_metadata(dir);
  } catch (const std::exception& e) {  // any damage is a problem to report, never the end of the listing
    r.problems.push_back(e.what());
    return r;
  }
  // Shards by file, in offset order, so each file is read once, sequentially; the files on
  // threads of their own (a checkpoint's files are its ranks' writers': a restart waits on this).
  std::map<std::string, std::vector<std::pair<const StoredShard*, const TensorMeta*>>> by_file;
  for (const auto& t : m.tensors)
    for (const auto& s : t.shards) by_file[s.file].push_back({&s, &t});
  for (auto& [file, list] : by_file)
    std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.first->offset < b.first->offset; });
  const std::vector<std::pair<std::string, std::uint64_t>> files(m.files.begin(), m.files.end());
  std::vector<VerifyResult> per_file(files.size());
  const auto check_file = [&](std::size_t i) {
    const auto& [file, size] = files[i];
    VerifyResult& out = per_file[i];
    const std::string path = (fs::path(dir) / file).string();
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) {
      out.problems.push_back(fmt::format("data file {}: {}", path, std::strerror(errno)));
      return;
    }
    const off_t actual = ::lseek(fd, 0, SEEK_END);
    if (static_cast<std::uint64_t>(actual) != size) {
      out.problems.push_back(fmt::format("data file {} has {} bytes, the metadata says {}: truncated or damaged", path,
                                         static_cast<long long>(actual), size));
      ::close(fd);
      return;
    }
    const auto it = by_file.find(file);  // read only: the map is shared between the threads
    if (it == by_file.end()) {
      ::close(fd);
      return;
    }
    std::vector<char> buf;
    for (const auto& [s, t] : it->second) {
      buf.resize(s->nbytes);
      std::uint64_t got = 0;
      while (got < s->nbytes) {
        const ssize_t n = ::pread(fd, buf.data() + got, s->nbytes - got, static_cast<off_t>(s->offset + got));
        if (n <= 0) break;
        got += static_cast<std::uint64_t>(n);
      }
      ++out.shards;
      out.bytes += got;
      if (got != s->nbytes || crc32c(0, buf.data(), s->nbytes) != s->crc)
        out.problems.push_back(fmt::format("tensor '{}' shard {} in {} (bytes {}..{}): checksum mismatch, data corrupted",
                                           t->name, box_str(s->box), file, s->offset, s->offset + s->nbytes));
    }
    ::close(fd);
  };
  {
    const std::size_t workers = std::min<std::size_t>(files.size(), std::max(1u, std::thread::hardware_concurrency()));
    std::atomic<std::size_t> next{0};
    const auto work = [&] {
      for (std::size_t i = next++; i < files.size(); i = next++) try {
          check_file(i);
        } catch (const std::exception& e) {  // a shard too large to read into memory, say: a problem, not an abort
          per_file[i].problems.push_back(fmt::format("data file {}: {}", files[i].first, e.what()));
        }
    };
    std::vector<std::jthread> threads;
    for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(work);
    work();
  }
  for (auto& f : per_file) {  // in file order, whichever thread finished first
    r.shards += f.shards;
    r.bytes += f.bytes;
    for (auto& p : f.problems) r.problems.push_back(std::move(p));
  }
  for (const auto& t : m.tensors) {
    std::vector<Box> boxes;
    for (const auto& s : t.shards) boxes.push_back(s.box);
    const std::string p = coverage_problem(t.shape, boxes);
    if (!p.empty()) r.problems.push_back(fmt::format("tensor '{}' {}: {}", t.name, shape_str(t.shape), p));
  }
  for (auto& p : train_state_problems(m, &r.note)) r.problems.push_back(std::move(p));
  return r;
}

int verify(const std::string& path, bool all, std::FILE* out) {
  std::vector<std::string> dirs;
  int problems = 0;
  const bool is_root = fs::is_directory(path) && !fs::exists(fs::path(path) / kMetadataFile) &&
                       (fs::exists(fs::path(path) / kLatestFile) || !list_steps(path).empty());
  if (is_root) {
    std::string latest;
    bool latest_unreadable = false;
    try {
      latest = latest_dir(path);
    } catch (const Error& e) {
      fmt::print(out, "PROBLEM {}\n", e.what());
      ++problems;
      latest_unreadable = true;  // reported above: not also "no pointer"
    }
    fmt::print(out, "root {}  (latest -> {})\n", path, latest.empty() ? "none" : fs::path(latest).filename().string());
    if (latest.empty() && !latest_unreadable) {
      fmt::print(out, "PROBLEM {}: no `latest` pointer: nothing committed\n", path);
      ++problems;
    }
    for (const auto& s : list_steps(path)) {
      fmt::print(out, "  {}  {}{}\n", fs::path(s.dir).filename().string(),
                 s.committed ? "committed" : "INCOMPLETE (no metadata.json: a save that never committed; load ignores it)",
                 s.dir == latest ? "  <- latest" : "");
      if (s.committed && (all || s.dir == latest)) dirs.push_back(s.dir);
    }
    if (!latest.empty() && !fs::exists(fs::path(latest) / kMetadataFile)) {
      fmt::print(out, "PROBLEM latest names {}, which is not committed\n", latest);
      ++problems;
    }
  } else {
    dirs.push_back(path);
  }
  for (const auto& d : dirs) {
    const VerifyResult r = verify_checkpoint(d);
    for (const auto& p : r.problems) fmt::print(out, "PROBLEM {}: {}\n", d, p);
    problems += static_cast<int>(r.problems.size());
    if (r.problems.empty())
      fmt::print(out, "verified {}: {} shards, {} read, checksums match, every element of every tensor stored exactly once{}\n",
                 d, r.shards, format_size(r.bytes), r.note.empty() ? "" : "; " + r.note);
  }
  return problems;
}

ReshardStats reshard(const std::string& src, const std::string& dst, const std::string& to, int threads) {
  const auto t0 = std::chrono::steady_clock::now();
  const mesh::Shape mesh = parse_mesh(to);
  require_new_root(dst);
  const Reader reader(src);
  const Metadata& m = reader.metadata();
  std::vector<SaveShard> shards;
  std::vector<LoadRequest> requests;
  std::vector<std::unique_ptr<char[]>> buffers;
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorMeta& t = m.tensors[i];
    // Declared whether or not a rank writes it: a tensor with no elements has no writer, and
    // only declared tensors reach the new metadata (the commit then checks each one's coverage).
    shards.push_back({t.name, t.type, t.shape, t.placement, Box{Shape(t.shape.size(), 0), Shape(t.shape.size(), 0)},
                      nullptr, false});
    for (int v = 0; v < mesh.world(); ++v) {
      RankShard rs;
      try {
        rs = rank_shard(t.shape, t.placement, mesh, v, i);
      } catch (const Error& e) {
        fail("tensor '{}': {}", t.name, e.what());
      }
      if (!rs.writer) continue;
      const std::size_t n = static_cast<std::size_t>(rs.box.volume()) * elem_size(t.type);
      buffers.emplace_back(new char[n]);
      requests.push_back({t.name, t.type, t.shape, rs.box, buffers.back().get()});
      shards.push_back({t.name, t.type, t.shape, t.placement, rs.box, buffers.back().get(), true});
    }
  }
  LoadOptions lo;
  lo.threads = threads;
  const LoadStats ls = reader.load(requests, lo);
  auto comm = make_self_comm();
  fs::create_directories(dst);
  SaveOptions so;
  so.threads = threads;
  Saver saver(*comm, dst, so);
  saver.save(m.step, shards, m.state, nlohmann::json::object(), mesh.str());
  const SaveStats ss = *saver.wait();
  ReshardStats r;
  r.bytes = ss.bytes;
  r.amplification = ls.amplification();
  r.dir = ss.dir;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace keel::ckpt
