#include "common/env_info.h"

#include <string>

extern char** environ;

namespace keel {

nlohmann::json recorded_env() {
  static const char* const kPrefixes[] = {"NCCL_",    "CUDA_", "CUBLAS", "UCX_",      "OMPI_MCA_",  "OPENBLAS_",
                                          "OMP_",     "GOTO_", "SLURM_JOB", "SLURM_NNODES", "SLURM_NTASKS"};
  nlohmann::json env = nlohmann::json::object();
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = kv.substr(0, eq);
    for (const char* prefix : kPrefixes) {
      if (key.rfind(prefix, 0) == 0) {
        env[key] = kv.substr(eq + 1);
        break;
      }
    }
  }
  return env;
}

}  // namespace keel
