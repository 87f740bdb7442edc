// Accelerator profiles: the spec-sheet numbers sizing and benchmarks compare against.
// Peaks are dense (no structured sparsity) tensor-core rates in TFLOP/s; bandwidths in
// decimal units (TB/s = 1e12 B/s, GB/s = 1e9 B/s). A measured `keel bench` JSON can
// override any of them (see keel size --hardware).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace keel::hw {

struct HardwareProfile {
  std::string name;         // short key: h100, h200, b200, a100, mi300x, mi325x
  std::string description;  // e.g. "NVIDIA H200 SXM 141GB"
  double bf16_tflops = 0;   // dense tensor-core peak
  double fp16_tflops = 0;
  double fp8_tflops = 0;    // 0: no fp8 tensor cores
  double tf32_tflops = 0;
  double fp32_tflops = 0;   // non-tensor fp32 (FMA) peak
  double hbm_tbps = 0;      // memory bandwidth
  double hbm_gib = 0;       // memory capacity
  int sm_count = 0;         // SMs (NVIDIA) or CUs (AMD): the wave-quantization divisor
  double l2_mib = 0;        // last-level on-chip cache seen by GEMMs
  double link_gbps = 0;     // intra-node GPU-to-GPU bandwidth per GPU, one direction
  // Largest bf16 GEMM throughput measured in practice (max achievable matmul FLOPS): the
  // ceiling of keel's analytic GEMM model. 0: assume 80% of bf16_tflops.
  double mamf_bf16_tflops = 0;
};

// The built-in profiles, in a fixed order.
const std::vector<HardwareProfile>& builtin_profiles();
// A built-in profile by key (case-insensitive; "h100-sxm" etc. accepted); nullptr if none.
const HardwareProfile* find_profile(std::string_view name);
// The built-in profile matching a device name as the driver reports it ("NVIDIA H200",
// "NVIDIA H100 80GB HBM3", "AMD Instinct MI300X"); nullptr if none.
const HardwareProfile* match_device_name(std::string_view device_name);

}  // namespace keel::hw
