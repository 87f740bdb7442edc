#include "ckpt/metadata.h"

#include <algorithm>
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
    tj["placement"] = t.placement.to_json();
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

Metadata parse_metadata(const std::string& text, const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail("{}: not valid JSON ({}): the metadata file is damaged", path, e.what());
  }
  if (!j.is_object() || j.value("format", std::string()) != kFormatName)
    fail("{}: not a keel checkpoint metadata file (no \"format\": \"{}\")", path, kFormatName);
  const int version = j.value("version", -1);
  if (version != kFormatVersion)
    fail("{}: metadata format version {}, but this keel reads version {} only", path, version, kFormatVersion);
  Metadata m;
  try {
    m.version = version;
    m.step = j.at("step").get<std::int64_t>();
    m.layout = j.at("layout").get<std::string>();
    m.world = j.at("world").get<int>();
    m.state = j.at("state");
    m.rank_states = j.at("rank_states");
    m.files = j.at("files").get<std::map<std::string, std::uint64_t>>();
    for (const auto& tj : j.at("tensors")) {
      TensorMeta t;
      t.name = tj.at("name").get<std::string>();
      t.type = parse_elem(tj.at("dtype").get<std::string>());
      t.shape = tj.at("shape").get<Shape>();
      t.placement = Placement::from_json(tj.at("placement"));
      for (const auto& sj : tj.at("shards")) {
        StoredShard s;
        s.box.offsets = sj.at("offsets").get<Shape>();
        s.box.lengths = sj.at("lengths").get<Shape>();
        s.file = sj.at("file").get<std::string>();
        s.offset = sj.at("byte_offset").get<std::uint64_t>();
        s.nbytes = sj.at("nbytes").get<std::uint64_t>();
        s.crc = sj.at("crc32c").get<std::uint32_t>();
        if (!box_within(s.box, t.shape))
          fail("shard {} of tensor '{}' lies outside its shape {}", box_str(s.box), t.name, shape_str(t.shape));
        if (s.nbytes != static_cast<std::uint64_t>(s.box.volume()) * elem_size(t.type))
          fail("shard {} of tensor '{}' has {} bytes, its box needs {}", box_str(s.box), t.name, s.nbytes,
               s.box.volume() * static_cast<std::int64_t>(elem_size(t.type)));
        auto f = m.files.find(s.file);
        if (s.file.find('/') != std::string::npos || f == m.files.end())
          fail("shard of tensor '{}' names an unknown data file '{}'", t.name, s.file);
        if (s.offset + s.nbytes > f->second)
          fail("shard of tensor '{}' ends at byte {} of {}, which holds {} bytes", t.name, s.offset + s.nbytes,
               s.file, f->second);
        t.shards.push_back(std::move(s));
      }
      m.tensors.push_back(std::move(t));
    }
  } catch (const Error& e) {
    fail("{}: {}", path, e.what());
  } catch (const std::exception& e) {
    fail("{}: malformed metadata ({})", path, e.what());
  }
  std::sort(m.tensors.begin(), m.tensors.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
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
