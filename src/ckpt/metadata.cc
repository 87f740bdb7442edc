#include "ckpt/metadata.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>

#include "common/error.h"
#include "common/fileio.h"

namespace keel::ckpt {

const TensorMeta* Metadata::find(const std::string& name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorMeta& t, const std::string& n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

std::string metadata_to_json(const Metadata& m) {
  nlohmann::json j;
  j["format"] = kFormatName;
  j["version"] = m.version;
  j["step"] = m.step;
  j["layout"] = m.layout;
  j["world"] = m.world;
  j["state"] = m.state;
  j["rank_states"] = m.rank_states;
  j["files"] = m.files;
  nlohmann::json ts = nlohmann::json::array();
  for (const TensorMeta& t : m.tensors) {
    nlohmann::json tj;
    tj["name"] = t.name;
    tj["dtype"] = elem_name(t.type);
    tj["shape"] = t.shape;
    tj["placement"] = placement_to_json(t.placement);
    nlohmann::json ss = nlohmann::json::array();
    for (const StoredShard& s : t.shards)
      ss.push_back({{"offsets", s.box.offsets}, {"lengths", s.box.lengths}, {"file", s.file}, {"byte_offset", s.offset},
                    {"nbytes", s.nbytes}, {"crc32c", s.crc}});
    tj["shards"] = std::move(ss);
    ts.push_back(std::move(tj));
  }
  j["tensors"] = std::move(ts);
  return j.dump(1) + "\n";
}

namespace {

// Reads the members of one JSON object of metadata.json with their types checked. nlohmann's
// own messages name neither the file nor the member, and a plain get<> converts silently
// (1.5 to an int, -1 to an unsigned): every error here names the member by its path
// ("tensors[3].shards[0].crc32c"); parse_metadata adds the file.
class Fields {
 public:
  Fields(const nlohmann::json& j, std::string where) : j_(j), where_(std::move(where)) {
    if (!j_.is_object()) fail("{} is {}, not an object", where_, kind(j_));
  }

  const nlohmann::json& any(const char* key) const {
    if (!j_.contains(key)) fail("{} is missing", path(key));
    return j_[key];
  }
  const nlohmann::json& object(const char* key) const { return typed(key, any(key).is_object(), "an object"); }
  const nlohmann::json& array(const char* key) const { return typed(key, any(key).is_array(), "an array"); }
  std::string string(const char* key) const { return typed(key, any(key).is_string(), "a string").get<std::string>(); }
  std::int64_t integer(const char* key, std::int64_t lo, std::int64_t hi) const {
    const nlohmann::json& v = any(key);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi)) ||
        v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi)
      fail("{} is {}, not an integer in [{}, {}]", path(key), v.dump(), lo, hi);
    return v.get<std::int64_t>();
  }
  std::uint64_t unsigned_integer(const char* key, std::uint64_t hi) const {
    const nlohmann::json& v = any(key);
    if (!v.is_number_unsigned() || v.get<std::uint64_t>() > hi)
      fail("{} is {}, not an integer in [0, {}]", path(key), v.dump(), hi);
    return v.get<std::uint64_t>();
  }
  // An array of non-negative integers (a shape, offsets or lengths).
  Shape shape(const char* key) const {
    Shape out;
    for (const auto& d : array(key)) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
        fail("{} is {}, not a list of non-negative integers", path(key), kind(j_[key]));
      out.push_back(d.get<std::int64_t>());
    }
    return out;
  }
  std::string path(const char* key) const { return where_.empty() ? fmt::format("\"{}\"", key) : where_ + "." + key; }

 private:
  const nlohmann::json& typed(const char* key, bool ok, const char* want) const {
    if (!ok) fail("{} is {}, not {}", path(key), kind(j_[key]), want);
    return j_[key];
  }
  static std::string kind(const nlohmann::json& v) {
    std::string text = v.dump();
    return text.size() > 40 ? text.substr(0, 37) + "..." : text;
  }

  const nlohmann::json& j_;
  std::string where_;
};

// A data file's name: a plain name inside the checkpoint directory, never a path out of it.
bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

void check_header(const nlohmann::json& j, const std::string& path) {
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormatName)
    fail("{}: not a keel checkpoint metadata file (no \"format\": \"{}\")", path, kFormatName);
  if (!j.contains("version") || !j["version"].is_number_integer())
    fail("{}: \"version\" is {}, not an integer: not a keel checkpoint metadata file", path,
         j.contains("version") ? j["version"].dump() : "missing");
  if (j["version"] != kFormatVersion)
    fail("{}: metadata format version {}, but this keel reads version {} only", path, j["version"].dump(),
         kFormatVersion);
}

// A stored shard of tensor `t` (errors are prefixed with the tensor's name by the caller).
StoredShard parse_shard(const nlohmann::json& sj, const std::string& where, const TensorMeta& t,
                        const std::map<std::string, std::uint64_t>& files) {
  const Fields f(sj, where);
  StoredShard s;
  s.box.offsets = f.shape("offsets");
  s.box.lengths = f.shape("lengths");
  s.file = f.string("file");
  s.offset = f.unsigned_integer("byte_offset", UINT64_MAX);
  s.nbytes = f.unsigned_integer("nbytes", UINT64_MAX);
  s.crc = static_cast<std::uint32_t>(f.unsigned_integer("crc32c", UINT32_MAX));
  if (!box_within(s.box, t.shape))
    fail("shard {} lies outside the tensor's shape {}", box_str(s.box), shape_str(t.shape));
  if (s.nbytes != byte_size(s.box.lengths, t.type))
    fail("shard {} has {} bytes, its box needs {}", box_str(s.box), s.nbytes, byte_size(s.box.lengths, t.type));
  auto file = files.find(s.file);
  if (file == files.end()) fail("shard {} names an unknown data file '{}'", box_str(s.box), s.file);
  if (s.nbytes > file->second || s.offset > file->second - s.nbytes)
    fail("shard {} ({} bytes at {}) ends past the end of {}, which holds {} bytes", box_str(s.box), s.nbytes, s.offset,
         s.file, file->second);
  return s;
}

TensorMeta parse_tensor(const nlohmann::json& tj, const std::string& where,
                        const std::map<std::string, std::uint64_t>& files) {
  const Fields f(tj, where);
  TensorMeta t;
  t.name = f.string("name");
  if (t.name.empty()) fail("{} has an empty name", where);
  try {
    t.type = parse_elem(f.string("dtype"));
    t.shape = f.shape("shape");
    byte_size(t.shape, t.type);  // a size beyond 64 bits is an error here, not a wrapped count later
    t.placement = placement_from_json(f.object("placement"));
    if (t.placement.dims.size() != t.shape.size())
      fail("its placement has {} dimensions, its shape {}", t.placement.dims.size(), shape_str(t.shape));
    const nlohmann::json& shards = f.array("shards");
    for (std::size_t i = 0; i < shards.size(); ++i)
      t.shards.push_back(parse_shard(shards[i], fmt::format("{}.shards[{}]", where, i), t, files));
  } catch (const Error& e) {
    fail("tensor '{}': {}", t.name, e.what());
  }
  return t;
}

std::map<std::string, std::uint64_t> parse_files(const Fields& top) {
  std::map<std::string, std::uint64_t> files;
  for (const auto& [name, size] : top.object("files").items()) {
    if (!plain_file_name(name)) fail("\"files\" names '{}', which is not a file name in the checkpoint directory", name);
    if (!size.is_number_unsigned()) fail("\"files\".\"{}\" is {}, not a size in bytes", name, size.dump());
    files[name] = size.get<std::uint64_t>();
  }
  return files;
}

// Sorted by name, each name once: a second entry would be a second, conflicting description of
// the same tensor (find() returns one of them, verify would check each alone).
void sort_unique_tensors(std::vector<TensorMeta>& tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (std::size_t i = 1; i < tensors.size(); ++i)
    if (tensors[i].name == tensors[i - 1].name) fail("tensor '{}' is listed twice", tensors[i].name);
}

}  // namespace

Metadata parse_metadata(const std::string& text, const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail("{}: not valid JSON ({}): the metadata file is damaged", path, e.what());
  }
  check_header(j, path);
  Metadata m;
  try {
    const Fields top(j, "");
    m.version = kFormatVersion;
    m.step = top.integer("step", 0, INT64_MAX);
    m.layout = top.string("layout");
    m.world = static_cast<int>(top.integer("world", 1, mesh::kMaxWorld));
    m.state = top.object("state");
    m.rank_states = top.array("rank_states");
    m.files = parse_files(top);
    const nlohmann::json& tensors = top.array("tensors");
    for (std::size_t i = 0; i < tensors.size(); ++i)
      m.tensors.push_back(parse_tensor(tensors[i], fmt::format("tensors[{}]", i), m.files));
    sort_unique_tensors(m.tensors);
  } catch (const Error& e) {
    fail("{}: {}", path, e.what());
  } catch (const std::exception& e) {
    fail("{}: malformed metadata ({})", path, e.what());
  }
  return m;
}

Metadata read_metadata(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / kMetadataFile).string();
  if (!std::filesystem::exists(path)) {
    if (!std::filesystem::is_directory(dir)) fail("{}: no such checkpoint directory", dir);
    fail("{}: incomplete checkpoint (no {}): a save that never committed", dir, kMetadataFile);
  }
  return parse_metadata(read_file(path), path);
}

}  // namespace keel::ckpt
