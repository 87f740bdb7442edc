#include "ckpt/layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "common/error.h"
#include "common/units.h"

namespace keel::ckpt {

int Mesh::degree(const std::string& axis) const {
  if (axis == "pp") return pp;
  if (axis == "dp") return dp;
  if (axis == "ep") return ep;
  if (axis == "tp") return tp;
  fail("unknown mesh axis '{}' (pp, dp, ep, tp)", axis);
}

int Mesh::coord(int rank, const std::string& axis) const {
  const int t = rank % tp, e = (rank / tp) % ep, d = (rank / (tp * ep)) % dp, p = rank / (tp * ep * dp);
  if (axis == "pp") return p;
  if (axis == "dp") return d;
  if (axis == "ep") return e;
  if (axis == "tp") return t;
  fail("unknown mesh axis '{}' (pp, dp, ep, tp)", axis);
}

std::string Mesh::str() const { return fmt::format("pp={},dp={},ep={},tp={},zero={}", pp, dp, ep, tp, zero ? 1 : 0); }

namespace {

int parse_degree(const std::string& text, const std::string& val) {
  try {
    std::size_t used = 0;
    const int v = std::stoi(val, &used);
    if (used == val.size()) return v;
  } catch (const std::exception&) {
  }
  fail("layout '{}': '{}' is not an integer", text, val);
}

// Refuses a mesh whose rank count exceeds kMaxWorld: the product of four int degrees
// overflows int, and an overflowed world spans no ranks at all. Multiplied in double, which
// cannot overflow here and is exact up to 2^53, far past the bound.
void check_world_bound(const std::string& text, const Mesh& m) {
  const double world = static_cast<double>(m.pp) * m.dp * m.ep * m.tp;
  if (world > kMaxWorld) fail("layout '{}' spans {:.0f} ranks, more than the {} keel supports", text, world, kMaxWorld);
}

}  // namespace

Mesh parse_mesh(const std::string& text, int world) {
  Mesh m;
  bool dp_given = false;
  std::vector<std::string> seen;
  for (const std::string& part : split_list(text)) {
    const auto eq = part.find('=');
    if (eq == std::string::npos) fail("layout '{}': '{}' is not axis=degree", text, part);
    const std::string key = part.substr(0, eq), val = part.substr(eq + 1);
    // A repeated axis is a typo, not an override: taking either value would be a guess.
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) fail("layout '{}': {} is given twice", text, key);
    seen.push_back(key);
    const int v = parse_degree(text, val);
    if (key == "zero") {
      if (v != 0 && v != 1) fail("layout '{}': zero must be 0 or 1", text);
      m.zero = v == 1;
      continue;
    }
    if (v < 1) fail("layout '{}': {} must be at least 1", text, key);
    if (v > kMaxWorld) fail("layout '{}': {}={} is more than the {} ranks keel supports", text, key, v, kMaxWorld);
    if (key == "pp") m.pp = v;
    else if (key == "dp") m.dp = v, dp_given = true;
    else if (key == "ep") m.ep = v;
    else if (key == "tp") m.tp = v;
    else fail("layout '{}': unknown axis '{}' (pp, dp, ep, tp, zero)", text, key);
  }
  check_world_bound(text, m);
  if (world > 0) {
    if (!dp_given && world % (m.pp * m.ep * m.tp) == 0) m.dp = world / (m.pp * m.ep * m.tp);
    if (m.world() != world)
      fail("layout '{}' spans {} ranks, but {} ranks are running", text, m.world(), world);
  }
  return m;
}

nlohmann::json Placement::to_json() const {
  nlohmann::json j;
  j["dims"] = dims;
  if (zero) j["zero"] = true;
  if (pp_unit >= 0) {
    j["pp_unit"] = pp_unit;
    j["pp_units"] = pp_units;
  }
  return j;
}

namespace {

// An int member of a placement in [lo, hi]; `fallback` when absent.
int placement_int(const nlohmann::json& j, const char* key, int fallback, int lo, int hi) {
  if (!j.contains(key)) return fallback;
  const nlohmann::json& v = j[key];
  if (!v.is_number_integer() || v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi)
    fail("placement \"{}\" is {}, not an integer in [{}, {}]", key, v.dump(), lo, hi);
  return v.get<int>();
}

std::vector<std::vector<std::string>> placement_dims(const nlohmann::json& j) {
  if (!j.contains("dims") || !j["dims"].is_array()) fail("placement has no \"dims\" array");
  std::vector<std::vector<std::string>> dims;
  std::vector<std::string> used;
  for (const auto& axes : j["dims"]) {
    if (!axes.is_array()) fail("placement \"dims\" entry {} is not a list of axes", axes.dump());
    dims.emplace_back();
    for (const auto& a : axes) {
      const auto& known = mesh_axes();
      if (!a.is_string() || std::find(known.begin(), known.end(), a.get<std::string>()) == known.end())
        fail("placement axis {} is not one of pp, dp, ep, tp", a.dump());
      if (std::find(used.begin(), used.end(), a.get<std::string>()) != used.end())
        fail("placement uses axis {} twice", a.dump());
      used.push_back(a.get<std::string>());
      dims.back().push_back(a.get<std::string>());
    }
  }
  return dims;
}

}  // namespace

Placement Placement::from_json(const nlohmann::json& j) {
  if (!j.is_object()) fail("placement {} is not an object", j.dump());
  Placement p;
  p.dims = placement_dims(j);
  if (j.contains("zero") && !j["zero"].is_boolean()) fail("placement \"zero\" is {}, not true or false", j["zero"].dump());
  p.zero = j.value("zero", false);
  // A stage computed from a unit outside [0, units) names no rank of the mesh: every rank would
  // skip the tensor, and an offline reshard would drop it without a word.
  p.pp_units = placement_int(j, "pp_units", 1, 1, std::numeric_limits<int>::max());
  p.pp_unit = placement_int(j, "pp_unit", -1, -1, p.pp_units - 1);
  return p;
}

RankShard rank_shard(const Shape& shape, const Placement& p, const Mesh& mesh, int rank, std::size_t salt) {
  RankShard s;
  if (p.dims.size() != shape.size())
    fail("placement has {} dimensions, the tensor {}", p.dims.size(), shape_str(shape));
  const int stage = mesh.coord(rank, "pp");
  if (p.pp_unit >= 0 && static_cast<long>(p.pp_unit) * mesh.pp / std::max(1, p.pp_units) != stage) return s;
  s.held = true;
  std::vector<std::vector<std::string>> dims = p.dims;
  if (p.zero && mesh.zero && !dims.empty()) dims[0].push_back("dp");
  std::vector<std::string> used;
  s.box.offsets.assign(shape.size(), 0);
  s.box.lengths = shape;
  std::int64_t shard_id = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    std::int64_t idx = 0, count = 1;
    for (const std::string& a : dims[d]) {
      if (std::find(used.begin(), used.end(), a) != used.end()) fail("placement uses axis '{}' twice", a);
      used.push_back(a);
      idx = idx * mesh.degree(a) + mesh.coord(rank, a);
      count *= mesh.degree(a);
    }
    const std::int64_t n = shape[d], chunk = (n + count - 1) / count;
    const std::int64_t start = std::min(n, idx * chunk), end = std::min(n, start + chunk);
    s.box.offsets[d] = start;
    s.box.lengths[d] = end - start;
    shard_id = shard_id * count + idx;
  }
  // Replicas: ranks that differ only on axes the placement does not use (pp excluded when the
  // tensor lives on one stage). One of them writes, chosen by the salt and the shard.
  std::int64_t replica = 0, replicas = 1;
  for (const std::string& a : mesh_axes()) {
    if (std::find(used.begin(), used.end(), a) != used.end()) continue;
    if (a == "pp" && p.pp_unit >= 0) continue;
    replica = replica * mesh.degree(a) + mesh.coord(rank, a);
    replicas *= mesh.degree(a);
  }
  s.writer = !s.box.empty() && replica == static_cast<std::int64_t>((salt + static_cast<std::size_t>(shard_id)) %
                                                                     static_cast<std::size_t>(replicas));
  return s;
}

}  // namespace keel::ckpt
