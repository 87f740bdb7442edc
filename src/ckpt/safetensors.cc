#include "ckpt/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckpt/comm.h"
#include "ckpt/metadata.h"
#include "ckpt/reader.h"
#include "ckpt/store.h"
#include "ckpt/writer.h"
#include "common/error.h"

namespace fs = std::filesystem;

namespace keel::ckpt {
namespace {

constexpr std::uint64_t kMaxHeader = 100'000'000;

void write_all(int fd, const char* p, std::uint64_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<std::uint64_t>(n, 8ull << 20));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) fail("cannot write {}: {}", path, std::strerror(errno));
    p += w;
    n -= static_cast<std::uint64_t>(w);
  }
}

void read_all(int fd, char* p, std::uint64_t n, std::uint64_t at, const std::string& path) {
  std::uint64_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, p + got, n - got, static_cast<off_t>(at + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) fail("{}: cannot read {} bytes at {}: {}", path, n, at, r < 0 ? std::strerror(errno) : "truncated");
    got += static_cast<std::uint64_t>(r);
  }
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const std::string& in = path_;
  fd_ = ::open(in.c_str(), O_RDONLY);
  if (fd_ < 0) fail("cannot read {}: {}", in, std::strerror(errno));
  try {
    const off_t size = ::lseek(fd_, 0, SEEK_END);
    if (size < 8) fail("{}: not a safetensors file ({} bytes, shorter than the 8-byte header length)", in, size);
    unsigned char len[8];
    read_all(fd_, reinterpret_cast<char*>(len), 8, 0, in);
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
    if (n > kMaxHeader || 8 + n > static_cast<std::uint64_t>(size))
      fail("{}: header length {} is beyond the file ({} bytes) or the 100 MB limit: not a safetensors file", in, n,
           size);
    std::string text(n, '\0');
    read_all(fd_, text.data(), n, 8, in);
    if (text.empty() || text[0] != '{') fail("{}: the header does not start with '{{': not a safetensors file", in);
    nlohmann::json header;
    try {
      header = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
      fail("{}: the header is not valid JSON ({})", in, e.what());
    }
    data_start_ = 8 + n;
    const std::uint64_t data_size = static_cast<std::uint64_t>(size) - data_start_;
    for (const auto& [name, v] : header.items()) {
      if (name == "__metadata__") {
        if (!v.is_object()) fail("{}: __metadata__ is not an object", in);
        metadata_ = v;
        continue;
      }
      try {
        SafetensorsEntry e{name, parse_elem(v.at("dtype").get<std::string>()), v.at("shape").get<Shape>(), 0, 0};
        const auto off = v.at("data_offsets").get<std::vector<std::uint64_t>>();
        if (off.size() != 2 || off[1] < off[0]) fail("bad data_offsets");
        e.begin = off[0];
        e.end = off[1];
        for (auto d : e.shape)
          if (d < 0) fail("negative dimension");
        // Checked: [2^62, 4] would otherwise wrap to 0 bytes and pass as an empty tensor.
        const std::uint64_t need = byte_size(e.shape, e.type);
        if (e.end - e.begin != need)
          fail("data_offsets span {} bytes, {} {} needs {}", e.end - e.begin, elem_name(e.type), shape_str(e.shape), need);
        entries_.push_back(std::move(e));
      } catch (const std::exception& e) {
        fail("{}: tensor '{}': {}", in, name, e.what());
      }
    }
    std::vector<const SafetensorsEntry*> order;
    for (const auto& e : entries_) order.push_back(&e);
    std::sort(order.begin(), order.end(),
              [](const SafetensorsEntry* a, const SafetensorsEntry* b) { return a->begin < b->begin; });
    std::uint64_t pos = 0;
    for (const SafetensorsEntry* e : order) {
      if (e->begin != pos)
        fail("{}: tensor '{}' starts at byte {} of the data buffer, expected {} (a hole or an overlap)", in, e->name,
             e->begin, pos);
      pos = e->end;
    }
    if (pos != data_size)
      fail("{}: the tensors cover {} bytes of a {}-byte data buffer: the file is truncated or has trailing bytes", in,
           pos, data_size);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

void SafetensorsFile::read(const SafetensorsEntry& e, void* out) const {
  read_all(fd_, static_cast<char*>(out), e.nbytes(), data_start_ + e.begin, path_);
}

SafetensorsWriter::SafetensorsWriter(std::string path, const std::vector<Tensor>& tensors,
                                     const nlohmann::json& metadata)
    : path_(std::move(path)) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__" || header.contains(t.name)) fail("{}: tensor name '{}' used twice", path_, t.name);
    const std::uint64_t n = static_cast<std::uint64_t>(numel(t.shape)) * elem_size(t.type);
    header[t.name] = {{"dtype", safetensors_name(t.type)}, {"shape", t.shape}, {"data_offsets", {total_, total_ + n}}};
    total_ += n;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8) text.push_back(' ');  // data starts 8-byte aligned
  tmp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd_ < 0) fail("cannot write {}: {}", path_, std::strerror(errno));
  try {
    const std::uint64_t n = text.size();
    char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    write_all(fd_, len, 8, path_);
    write_all(fd_, text.data(), n, path_);
  } catch (...) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
    fd_ = -1;
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void SafetensorsWriter::append(const void* data, std::uint64_t bytes) {
  if (fd_ < 0) fail("{}: append after commit", path_);
  if (written_ + bytes > total_)
    fail("{}: {} bytes appended beyond the {} bytes the header declares", path_, written_ + bytes, total_);
  write_all(fd_, static_cast<const char*>(data), bytes, path_);
  written_ += bytes;
}

void SafetensorsWriter::commit() {
  if (written_ != total_) fail("{}: {} of the {} data bytes written", path_, written_, total_);
  if (::fsync(fd_) != 0) fail("cannot fsync {}: {}", path_, std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    ::unlink(tmp_.c_str());
    fail("cannot rename {} to {}: {}", tmp_, path_, std::strerror(errno));
  }
}

namespace {

// `p` is `dir` or lies below it (both absolute and normalized).
bool is_within(const fs::path& p, const fs::path& dir) {
  const fs::path rel = p.lexically_relative(dir);
  return !rel.empty() && *rel.begin() != "..";
}

fs::path canonical_or_fail(const std::string& path, bool must_exist) {
  std::error_code ec;
  const fs::path p = must_exist ? fs::canonical(path, ec) : fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) fail("{}: {}", path, ec.message());
  return p;
}

}  // namespace

void check_export_target(const std::string& checkpoint_dir, const std::string& out, bool overwrite) {
  const fs::path target = canonical_or_fail(out, false);
  const fs::path dir = canonical_or_fail(checkpoint_dir, true);
  if (is_within(target, dir))
    fail("{}: lies inside the checkpoint {} being exported: writing it would destroy that checkpoint", out,
         checkpoint_dir);
  // A step directory's root holds `latest` and the other checkpoints: none of them is an output.
  std::int64_t step = 0;
  const fs::path root = dir.parent_path();
  if (parse_step_dir_name(dir.filename().string(), &step) && is_within(target, root) && target != root) {
    const std::string first = target.lexically_relative(root).begin()->string();
    if (first == kLatestFile || first.rfind("step_", 0) == 0)
      fail("{}: is part of the checkpoint root {} ('{}'): writing it could damage a checkpoint", out, root.string(),
           first);
  }
  std::error_code ec;
  const fs::file_status link = fs::symlink_status(out, ec);
  if (!fs::exists(link)) return;
  const fs::file_status st = fs::status(out, ec);
  if (fs::is_directory(st)) fail("{}: is a directory, not an output file", out);
  if (fs::exists(st) && !fs::is_regular_file(st)) fail("{}: exists and is not a regular file", out);
  if (!overwrite) fail("{}: exists; pass --force to replace it", out);
}

SafetensorsStats export_safetensors(const std::string& src, const std::string& out, int threads, bool overwrite) {
  const Reader reader(src);
  check_export_target(reader.dir(), out, overwrite);
  const Metadata& m = reader.metadata();
  const nlohmann::json meta = {{"format", "pt"}, {"keel.step", std::to_string(m.step)}, {"keel.layout", m.layout},
                               {"keel.state", m.state.dump()}};
  std::vector<SafetensorsWriter::Tensor> list;
  for (const auto& t : m.tensors) list.push_back({t.name, t.type, t.shape});
  SafetensorsWriter w(out, list, meta);
  LoadOptions lo;
  lo.threads = threads;
  for (const auto& t : m.tensors) {
    std::unique_ptr<char[]> buf(new char[std::max<std::uint64_t>(1, t.nbytes())]);
    reader.load({{t.name, t.type, t.shape, full_box(t.shape), buf.get()}}, lo);
    w.append(buf.get(), t.nbytes());
  }
  w.commit();
  return {m.tensors.size(), w.data_bytes(), m.step, out};
}

std::optional<std::int64_t> recorded_step(const SafetensorsFile& file) {
  const nlohmann::json& meta = file.metadata();
  if (!meta.contains("keel.step")) return std::nullopt;
  const nlohmann::json& v = meta["keel.step"];
  const std::string text = v.is_string() ? v.get<std::string>() : v.dump();
  std::int64_t step = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), step);
  if (!v.is_string() || ec != std::errc() || end != text.data() + text.size() || step < 0)
    fail("{}: __metadata__ \"keel.step\" is {}, not a step (a non-negative integer in a string)", file.path(), v.dump());
  return step;
}

SafetensorsStats import_safetensors(const std::string& in, const std::string& dst, std::optional<std::int64_t> step,
                                    int threads) {
  if (step && *step < 0) fail("import: step {} is negative: steps are non-negative", *step);
  require_new_root(dst);
  const SafetensorsFile file(in);
  nlohmann::json state = {{"imported_from", in}};
  const nlohmann::json& v = file.metadata();
  const std::int64_t at = step ? *step : recorded_step(file).value_or(0);
  try {
    if (v.contains("keel.state")) state.update(nlohmann::json::parse(v["keel.state"].get<std::string>()));
  } catch (const std::exception& e) {
    fail("{}: bad keel.state in __metadata__ ({})", in, e.what());
  }
  std::vector<std::unique_ptr<char[]>> buffers;
  std::vector<SaveShard> shards;
  for (const auto& e : file.entries()) {
    buffers.emplace_back(new char[std::max<std::uint64_t>(1, e.nbytes())]);
    file.read(e, buffers.back().get());
    mesh::Placement p;
    p.dims.assign(e.shape.size(), {});
    shards.push_back({e.name, e.type, e.shape, p, full_box(e.shape), buffers.back().get(), true});
  }
  auto comm = make_self_comm();
  fs::create_directories(dst);
  SaveOptions so;
  so.threads = threads;
  Saver saver(*comm, dst, so);
  state["step"] = at;
  saver.save(at, shards, state, nlohmann::json::object(), "");
  const SaveStats st = *saver.wait();
  return {file.entries().size(), st.bytes, at, st.dir};
}

}  // namespace keel::ckpt
