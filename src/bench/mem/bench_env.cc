#include "bench/mem/bench_env.h"

#include <string>

extern char** environ;

namespace keel::bench {

nlohmann::json bench_relevant_env() {
  nlohmann::json env = nlohmann::json::object();
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = kv.substr(0, eq);
    for (const char* prefix : {"CUDA_", "NCCL_", "CUBLAS", "OPENBLAS_", "OMP_", "GOTO_", "SLURM_JOB"}) {
      if (key.rfind(prefix, 0) == 0) {
        env[key] = kv.substr(eq + 1);
        break;
      }
    }
  }
  return env;
}

}  // namespace keel::bench
