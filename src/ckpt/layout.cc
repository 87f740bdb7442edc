#include "ckpt/layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "common/error.h"

namespace keel::ckpt {

using mesh::Axis;

mesh::Shape parse_mesh(const std::string& text, int world) {
  bool dp_given = false;
  mesh::Shape m = mesh::parse(text, &dp_given);
  if (m.zero > 1)
    fail("layout '{}': zero={} has no checkpoint layout (checkpoints know zero 0 and 1: ZeRO-1 shards the optimizer "
         "states)",
         text, m.zero);
  if (world > 0) mesh::fill_data(m, dp_given, world, text);
  mesh::validate(m, fmt::format("layout '{}'", text));
  return m;
}

nlohmann::json placement_to_json(const mesh::Placement& p) {
  nlohmann::json dims = nlohmann::json::array();
  for (const auto& axes : p.dims) {
    nlohmann::json names = nlohmann::json::array();
    for (Axis a : axes) names.push_back(mesh::axis_name(a));
    dims.push_back(std::move(names));
  }
  nlohmann::json j;
  j["dims"] = std::move(dims);
  if (p.zero) j["zero"] = true;
  if (p.pp_unit >= 0) {
    j["pp_unit"] = p.pp_unit;
    j["pp_units"] = p.pp_units;
  }
  return j;
}

void check_placement(const mesh::Placement& p) {
  std::vector<Axis> used;
  for (const auto& axes : p.dims)
    for (Axis a : axes) {
      if (std::find(used.begin(), used.end(), a) != used.end())
        fail("placement uses axis \"{}\" twice", mesh::axis_name(a));
      used.push_back(a);
    }
  if (p.splits(Axis::kExpert))
    for (Axis a : {Axis::kData, Axis::kContext})
      if (p.splits(a))
        fail("placement splits over ep and {}: expert parallelism is folded into dp*cp (the expert coordinate is "
             "derived from dp and cp), so a tensor split over ep cannot also be split over dp or cp",
             mesh::axis_name(a));
  // One stage holds it: its ranks share one pp coordinate, so a split over pp would keep all
  // but one part of the tensor on no rank.
  if (p.pp_unit >= 0 && p.splits(Axis::kPipeline))
    fail("placement splits over pp but lives on one pipeline stage (pp_unit {})", p.pp_unit);
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

std::vector<std::vector<Axis>> placement_dims(const nlohmann::json& j) {
  if (!j.contains("dims") || !j["dims"].is_array()) fail("placement has no \"dims\" array");
  std::vector<std::vector<Axis>> dims;
  for (const auto& axes : j["dims"]) {
    if (!axes.is_array()) fail("placement \"dims\" entry {} is not a list of axes", axes.dump());
    dims.emplace_back();
    for (const auto& a : axes) {
      const std::optional<Axis> axis = a.is_string() ? mesh::parse_axis(a.get<std::string>()) : std::nullopt;
      if (!axis) fail("placement axis {} is not one of {}", a.dump(), mesh::axis_names());
      for (const auto& d : dims)
        if (std::find(d.begin(), d.end(), *axis) != d.end()) fail("placement uses axis {} twice", a.dump());
      dims.back().push_back(*axis);
    }
  }
  return dims;
}

// One coordinate a rank has: the independent axes of the mesh, and the two derived from (dp, cp).
enum class Coordinate { kPipeline, kData, kContext, kExpert, kExpertData, kTsp, kTensor };

Coordinate coordinate_of(Axis a) {
  switch (a) {
    case Axis::kPipeline: return Coordinate::kPipeline;
    case Axis::kData: return Coordinate::kData;
    case Axis::kContext: return Coordinate::kContext;
    case Axis::kTsp: return Coordinate::kTsp;
    case Axis::kTensor: return Coordinate::kTensor;
    case Axis::kExpert: return Coordinate::kExpert;
  }
  return Coordinate::kPipeline;
}

int degree(const mesh::Shape& m, Coordinate c) {
  switch (c) {
    case Coordinate::kPipeline: return m.pp;
    case Coordinate::kData: return m.dp;
    case Coordinate::kContext: return m.cp;
    case Coordinate::kExpert: return m.ep;
    case Coordinate::kExpertData: return m.expert_data();
    case Coordinate::kTsp: return m.tsp;
    case Coordinate::kTensor: return m.tp;
  }
  return 1;
}

int at(const mesh::Coord& r, Coordinate c) {
  switch (c) {
    case Coordinate::kPipeline: return r.pp;
    case Coordinate::kData: return r.dp;
    case Coordinate::kContext: return r.cp;
    case Coordinate::kExpert: return r.ep;
    case Coordinate::kExpertData: return r.edp;
    case Coordinate::kTsp: return r.tsp;
    case Coordinate::kTensor: return r.tp;
  }
  return 0;
}

}  // namespace

mesh::Placement placement_from_json(const nlohmann::json& j) {
  if (!j.is_object()) fail("placement {} is not an object", j.dump());
  mesh::Placement p;
  p.dims = placement_dims(j);
  if (j.contains("zero") && !j["zero"].is_boolean()) fail("placement \"zero\" is {}, not true or false", j["zero"].dump());
  p.zero = j.value("zero", false);
  // A stage computed from a unit outside [0, units) names no rank of the mesh: every rank would
  // skip the tensor, and an offline reshard would drop it without a word.
  p.pp_units = placement_int(j, "pp_units", 1, 1, std::numeric_limits<int>::max());
  p.pp_unit = placement_int(j, "pp_unit", -1, -1, p.pp_units - 1);
  return p;
}

RankShard rank_shard(const Shape& shape, const mesh::Placement& p, const mesh::Shape& mesh, int rank, std::size_t salt) {
  RankShard s;
  if (p.dims.size() != shape.size())
    fail("placement has {} dimensions, the tensor {}", p.dims.size(), shape_str(shape));
  check_placement(p);
  if (mesh.zero != 0 && mesh.zero != 1)
    fail("layout {}: checkpoints know zero 0 and 1, not zero={}", mesh.str(), mesh.zero);
  if (mesh.ep < 1 || (static_cast<long>(mesh.dp) * mesh.cp) % mesh.ep != 0)
    fail("layout {}: ep={} does not divide dp*cp = {}", mesh.str(), mesh.ep, static_cast<long>(mesh.dp) * mesh.cp);
  if (rank < 0 || rank >= mesh.world()) fail("rank {} is outside layout {} ({} ranks)", rank, mesh.str(), mesh.world());
  const mesh::Coord c = mesh.coord(rank);
  if (p.pp_unit >= 0 && static_cast<long>(p.pp_unit) * mesh.pp / std::max(1, p.pp_units) != c.pp) return s;
  s.held = true;

  // The coordinates splitting each dimension, outermost first.
  const bool expert = p.splits(Axis::kExpert);
  std::vector<std::vector<Coordinate>> dims(p.dims.size());
  std::vector<Coordinate> used;
  for (std::size_t d = 0; d < p.dims.size(); ++d)
    for (Axis a : p.dims[d]) {
      dims[d].push_back(coordinate_of(a));
      used.push_back(coordinate_of(a));
    }
  // ZeRO: an optimizer state is cut further over the data ranks holding the same block.
  if (p.zero && mesh.zero == 1 && !dims.empty()) {
    const std::vector<Coordinate> data =
        expert ? std::vector<Coordinate>{Coordinate::kExpertData} : std::vector<Coordinate>{Coordinate::kData, Coordinate::kContext};
    for (Coordinate k : data)
      if (std::find(used.begin(), used.end(), k) == used.end()) {
        dims[0].push_back(k);
        used.push_back(k);
      }
  }

  s.box.offsets.assign(shape.size(), 0);
  s.box.lengths = shape;
  std::int64_t shard_id = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    std::int64_t idx = 0, count = 1;
    for (Coordinate k : dims[d]) {
      idx = idx * degree(mesh, k) + at(c, k);
      count *= degree(mesh, k);
    }
    const std::int64_t n = shape[d], chunk = (n + count - 1) / count;
    const std::int64_t start = std::min(n, idx * chunk), end = std::min(n, start + chunk);
    s.box.offsets[d] = start;
    s.box.lengths[d] = end - start;
    shard_id = shard_id * count + idx;
  }
  // Replicas: the rank's other coordinates. A rank is (pp, dp, cp, tsp, tp), or equally (pp, ep,
  // edp, tsp, tp) since (dp, cp) <-> (ep, edp); a tensor split over ep is cut in the second system,
  // any other in the first, so the coordinates it is not cut over enumerate its copies of each
  // shard (pp left out when the tensor lives on one stage). One of them writes, chosen by the salt
  // and the shard.
  const std::vector<Coordinate> system =
      expert ? std::vector<Coordinate>{Coordinate::kPipeline, Coordinate::kExpertData, Coordinate::kTsp, Coordinate::kTensor}
             : std::vector<Coordinate>{Coordinate::kPipeline, Coordinate::kData, Coordinate::kContext, Coordinate::kTsp,
                                       Coordinate::kTensor};
  std::int64_t replica = 0, replicas = 1;
  for (Coordinate k : system) {
    if (std::find(used.begin(), used.end(), k) != used.end()) continue;
    if (k == Coordinate::kPipeline && p.pp_unit >= 0) continue;
    replica = replica * degree(mesh, k) + at(c, k);
    replicas *= degree(mesh, k);
  }
  s.writer = !s.box.empty() && replica == static_cast<std::int64_t>((salt + static_cast<std::size_t>(shard_id)) %
                                                                     static_cast<std::size_t>(replicas));
  return s;
}

}  // namespace keel::ckpt
