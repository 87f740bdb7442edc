// Predicted GEMM throughput on an accelerator: an analytic tile + wave quantization model
// (NVIDIA's Matrix Multiplication Background guide, section 3), or a measured `keel bench
// gemm` profile corrected by that model. docs/size.md states the model and its constants.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hw/hardware.h"

namespace keel::hw {

struct GemmShape {
  std::int64_t m = 0, n = 0, k = 0;  // C[m x n] = A[m x k] B[k x n]
  std::int64_t batch = 1;
};

// One measured point of a GEMM profile (a `keel bench gemm` result row).
struct GemmSample {
  GemmShape shape;
  std::string dtype = "bf16";
  double tflops = 0;
};

struct GemmPrediction {
  double seconds = 0;
  double tflops = 0;
  double efficiency = 0;     // of the dense peak
  std::int64_t tile_m = 0, tile_n = 0;
  std::int64_t tiles = 0, waves = 0;
  double wave_efficiency = 1;   // tiles / (waves x SMs)
  double tile_efficiency = 1;   // useful / computed elements after rounding m, n up to tiles
  double align_factor = 1;      // < 1 when k or n is not a multiple of 8 elements (16 bytes)
  bool memory_bound = false;
  std::string source;           // "analytic" or "profile (nearest m x n x k ...)"
};

class GemmModel {
 public:
  // `peak_tflops`: the dense peak of the dtype modelled (bf16 unless told). With samples, the
  // analytic ceiling is calibrated to the best measured throughput and predictions start from
  // the nearest measured shapes.
  explicit GemmModel(const HardwareProfile& hw, std::vector<GemmSample> profile = {}, std::string dtype = "bf16");

  GemmPrediction predict(const GemmShape& s) const;
  // The analytic model alone (what the profile is corrected with).
  GemmPrediction analytic(const GemmShape& s) const;

  bool has_profile() const { return !profile_.empty(); }
  double peak_tflops() const { return peak_; }
  double ceiling_fraction() const { return ceiling_; }

 private:
  HardwareProfile hw_;
  std::vector<GemmSample> profile_;
  double peak_ = 0, ceiling_ = 0.8;
};

}  // namespace keel::hw
