#include "parallel/tsp_tables.h"

#include <fmt/format.h>

#include "common/error.h"

namespace keel::parallel {

TspTables parse_tsp_tables(const std::string& word) {
  if (word == "auto") return TspTables::kAuto;
  if (word == "sweep") return TspTables::kSweep;
  if (word == "gather") return TspTables::kGather;
  throw UsageError(fmt::format("parallel.tsp_tables: '{}' (must be auto, sweep or gather)", word));
}

bool tsp_gathers_tables(TspTables t, std::int64_t tokens, std::int64_t vocab) {
  if (t == TspTables::kAuto) return tokens <= vocab;
  return t == TspTables::kGather;
}

}  // namespace keel::parallel
