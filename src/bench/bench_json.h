// The top of every `keel bench` JSON document (schema keel.bench.<name>/1): the fields that
// `keel size --hardware` and users' scripts rely on, built in one place so the benchmarks
// cannot drift apart. Each benchmark adds its own conventions and results.
#pragma once

#include <nlohmann/json.hpp>

#include <string_view>

namespace keel::bench {

// {schema, keel_version, command, args, env (recorded_env()), backend, devices, libraries}.
nlohmann::json bench_json_header(std::string_view schema, std::string_view command, nlohmann::json args,
                                 std::string_view backend, nlohmann::json devices, nlohmann::json libraries);

}  // namespace keel::bench
