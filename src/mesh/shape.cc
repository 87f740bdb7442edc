#include "mesh/shape.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "common/error.h"
#include "common/units.h"

namespace keel::mesh {

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::kPipeline: return "pp";
    case Axis::kData: return "dp";
    case Axis::kContext: return "cp";
    case Axis::kTsp: return "tsp";
    case Axis::kTensor: return "tp";
    case Axis::kExpert: return "ep";
  }
  return "?";
}

const char* axis_title(Axis a) {
  switch (a) {
    case Axis::kPipeline: return "pipeline";
    case Axis::kData: return "data";
    case Axis::kContext: return "context";
    case Axis::kTsp: return "tsp";
    case Axis::kTensor: return "tensor";
    case Axis::kExpert: return "expert";
  }
  return "?";
}

const char* axis_names() { return "pp, dp, cp, tsp, tp, ep"; }

std::optional<Axis> parse_axis(std::string_view name) {
  for (Axis a : kAxes)
    if (name == axis_name(a)) return a;
  return std::nullopt;
}

int Coord::on(Axis a) const {
  switch (a) {
    case Axis::kPipeline: return pp;
    case Axis::kData: return dp;
    case Axis::kContext: return cp;
    case Axis::kTsp: return tsp;
    case Axis::kTensor: return tp;
    case Axis::kExpert: return ep;
  }
  return 0;
}

int Shape::degree(Axis a) const {
  switch (a) {
    case Axis::kPipeline: return pp;
    case Axis::kData: return dp;
    case Axis::kContext: return cp;
    case Axis::kTsp: return tsp;
    case Axis::kTensor: return tp;
    case Axis::kExpert: return ep;
  }
  return 1;
}

void Shape::set(Axis a, int degree) {
  switch (a) {
    case Axis::kPipeline: pp = degree; break;
    case Axis::kData: dp = degree; break;
    case Axis::kContext: cp = degree; break;
    case Axis::kTsp: tsp = degree; break;
    case Axis::kTensor: tp = degree; break;
    case Axis::kExpert: ep = degree; break;
  }
}

int Shape::world() const { return pp * dp * cp * tsp * tp; }

Coord Shape::coord(int rank) const {
  Coord c;
  c.tp = rank % tp;
  rank /= tp;
  c.tsp = rank % tsp;
  rank /= tsp;
  c.cp = rank % cp;
  rank /= cp;
  c.dp = rank % dp;
  c.pp = rank / dp;
  const int j = c.dp * cp + c.cp;
  c.ep = j % ep;
  c.edp = j / ep;
  return c;
}

std::string Shape::str() const {
  std::string s;
  for (Axis a : kAxes) {
    if (a != Axis::kData && degree(a) == 1) continue;
    s += fmt::format("{}{}={}", s.empty() ? "" : ",", axis_name(a), degree(a));
  }
  if (zero != 0) s += fmt::format(",zero={}", zero);
  return s;
}

bool operator==(const Shape& a, const Shape& b) {
  for (Axis x : kAxes)
    if (a.degree(x) != b.degree(x)) return false;
  return a.zero == b.zero;
}

Shape parse(const std::string& text, bool* dp_given) {
  Shape s;
  if (dp_given) *dp_given = false;
  std::vector<std::string> seen;
  for (const std::string& part : split_list(text)) {
    const auto eq = part.find('=');
    if (eq == std::string::npos)
      throw UsageError(fmt::format("layout '{}': '{}' is not axis=degree (axes {}, and zero)", text, part, axis_names()));
    const std::string key = part.substr(0, eq), val = part.substr(eq + 1);
    // A repeated key is a typo, not an override: taking either value would be a guess.
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      throw UsageError(fmt::format("layout '{}': {} is given twice", text, key));
    seen.push_back(key);
    long v = 0;
    try {
      std::size_t used = 0;
      v = std::stol(val, &used);
      if (used != val.size()) throw std::invalid_argument("trailing characters");
    } catch (const std::exception&) {
      throw UsageError(fmt::format("layout '{}': {}={} is not an integer", text, key, val));
    }
    if (key == "zero") {
      if (v < 0 || v > 3) throw UsageError(fmt::format("layout '{}': zero must be 0, 1, 2 or 3 (got {})", text, v));
      s.zero = static_cast<int>(v);
      continue;
    }
    const std::optional<Axis> axis = parse_axis(key);
    if (!axis) throw UsageError(fmt::format("layout '{}': unknown axis '{}' (axes {}, and zero)", text, key, axis_names()));
    if (v < 1) throw UsageError(fmt::format("layout '{}': {} must be at least 1 (got {})", text, key, v));
    if (v > kMaxWorld)
      throw UsageError(fmt::format("layout '{}': {}={} is more than the {} ranks keel supports", text, key, v, kMaxWorld));
    s.set(*axis, static_cast<int>(v));
    if (*axis == Axis::kData && dp_given) *dp_given = true;
  }
  return s;
}

namespace {

// pp * cp * tsp * tp (* dp) in double: exact far past kMaxWorld, and never overflows.
double product(const Shape& s, bool with_dp) {
  return static_cast<double>(s.pp) * s.cp * s.tsp * s.tp * (with_dp ? s.dp : 1);
}

}  // namespace

void fill_data(Shape& s, bool dp_given, int world, const std::string& text) {
  const double replica = product(s, false);
  if (!dp_given) {
    if (replica > world || world % static_cast<int>(replica) != 0)
      throw UsageError(fmt::format("layout '{}': pp*cp*tsp*tp = {:.0f} does not divide the {} ranks", text, replica, world));
    s.dp = world / static_cast<int>(replica);
  }
  if (product(s, true) != world)
    throw UsageError(fmt::format("layout '{}' spans {:.0f} ranks (pp*dp*cp*tsp*tp), but there are {}", text,
                                 product(s, true), world));
}

void validate(const Shape& s, const std::string& what) {
  for (Axis a : kAxes)
    if (s.degree(a) < 1) throw UsageError(fmt::format("{}: {} must be at least 1 (got {})", what, axis_name(a), s.degree(a)));
  if (product(s, true) > kMaxWorld)
    throw UsageError(fmt::format("{}: pp*dp*cp*tsp*tp = {:.0f} ranks, more than the {} keel supports", what,
                                 product(s, true), kMaxWorld));
  if ((static_cast<long>(s.dp) * s.cp) % s.ep != 0)
    throw UsageError(fmt::format("{}: ep={} does not divide dp*cp = {} (expert parallelism is folded into the data and "
                                 "context ranks)",
                                 what, s.ep, static_cast<long>(s.dp) * s.cp));
  if (s.zero < 0 || s.zero > 3) throw UsageError(fmt::format("{}: zero must be 0, 1, 2 or 3 (got {})", what, s.zero));
}

}  // namespace keel::mesh
