// A hardware description for sizing: a built-in profile, optionally overridden by what
// `keel bench` measured (schemas keel.bench.comm/1, keel.bench.gemm/1, keel.bench.mem/1).
#pragma once

#include <string>
#include <vector>

#include "hw/gemm_model.h"
#include "hw/hardware.h"

namespace keel::hw {

struct Hardware {
  HardwareProfile profile;     // spec sheet, with measured values substituted where measured
  HardwareProfile spec;        // the built-in profile as shipped
  std::vector<std::string> sources;  // "built-in h200", "gemm.json: keel.bench.gemm/1, 42 shapes", ...
  double measured_hbm_tbps = 0;      // keel.bench.mem: best gbps / 1000 (0 = not measured)
  double measured_busbw_gbps = 0;    // keel.bench.comm: all_reduce busbw at the largest size and rank count
  int measured_busbw_ranks = 0;
  std::vector<GemmSample> gemm_profile;  // keel.bench.gemm rows
};

// `spec` is a comma list: an optional built-in name (h100, h200, b200, a100, mi300x, mi325x)
// and any number of keel bench JSON files. Without a name, the first file's device name
// picks the base profile. Throws keel::UsageError naming the file and field on bad input.
Hardware load_hardware(const std::string& spec);

}  // namespace keel::hw
