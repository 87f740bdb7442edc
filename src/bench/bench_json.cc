#include "bench/bench_json.h"

#include <string>

#include "common/env_info.h"

namespace keel::bench {

nlohmann::json bench_json_header(std::string_view schema, std::string_view command, nlohmann::json args,
                                 std::string_view backend, nlohmann::json devices, nlohmann::json libraries) {
  return {{"schema", std::string(schema)},   {"keel_version", KEEL_VERSION},
          {"command", std::string(command)}, {"args", std::move(args)},
          {"env", recorded_env()},           {"backend", std::string(backend)},
          {"devices", std::move(devices)},   {"libraries", std::move(libraries)}};
}

}  // namespace keel::bench
