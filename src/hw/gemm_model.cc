#include "hw/gemm_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"

namespace keel::hw {
namespace {

// Output tiles a GEMM library picks from (cuBLASLt/hipBLASLt bf16 kernels on Hopper/CDNA3).
struct Tile {
  std::int64_t m, n;
};
constexpr Tile kTiles[] = {{256, 128}, {128, 256}, {128, 128}, {128, 64}, {64, 128}, {64, 64}};

// Relative per-SM throughput of a tile: operand reuse is Tm*Tn/(Tm+Tn) multiply-adds per
// element loaded; a tile with less reuse waits more on shared memory/L2. x/(x + 16),
// normalised to the 256x128 tile: 1.00, 0.95 (128x128), 0.86 (128x64), 0.79 (64x64).
double tile_throughput(const Tile& t) {
  auto f = [](double tm, double tn) {
    const double reuse = tm * tn / (tm + tn);
    return reuse / (reuse + 16);
  };
  return f(static_cast<double>(t.m), static_cast<double>(t.n)) / f(256, 128);
}

// Each tile also pays a fixed pipeline fill and epilogue, worth this many k-steps.
constexpr double kTileOverheadK = 128;
// Launch and synchronisation per GEMM call.
constexpr double kLaunchSeconds = 4e-6;
// Dimensions that are not multiples of 8 elements (16 bytes) lose vectorised, tensor-core
// friendly loads. 0.7 is calibrated to the SwiGLU measurement in ml-engineering
// (swiglu-maf-bench.py, H100, h = 4096: d_ff 10922 -> 272.7 TFLOPS, 10944 -> 398.4, +46%).
constexpr double kMisalignedFactor = 0.7;
// HBM traffic reaches about this fraction of the spec in GEMMs (BabelStream: 84-89% on H100/H200).
constexpr double kHbmFraction = 0.85;

double log_distance(const GemmShape& a, const GemmShape& b) {
  auto d = [](std::int64_t x, std::int64_t y) { return std::log(static_cast<double>(x)) - std::log(static_cast<double>(y)); };
  return std::sqrt(d(a.m, b.m) * d(a.m, b.m) + d(a.n, b.n) * d(a.n, b.n) + d(a.k, b.k) * d(a.k, b.k) +
                   d(a.batch, b.batch) * d(a.batch, b.batch));
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Output tiles of `s` in tiles of `t`, or a one-line error when the count overflows int64
// (absurd sizes must fail, not wrap into a small or negative wave count).
std::int64_t tile_count(const GemmShape& s, const Tile& t) {
  std::int64_t tiles = 0;
  if (__builtin_mul_overflow(ceil_div(s.m, t.m), ceil_div(s.n, t.n), &tiles) ||
      __builtin_mul_overflow(tiles, s.batch, &tiles))
    throw UsageError(fmt::format("GEMM {}x{}x{} x{} is too large to model: its tile count overflows int64", s.m, s.n,
                                 s.k, s.batch));
  return tiles;
}

double flops_of(const GemmShape& s) {
  return 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k) *
         static_cast<double>(s.batch);
}

}  // namespace

GemmModel::GemmModel(const HardwareProfile& hw, std::vector<GemmSample> profile, std::string dtype) : hw_(hw) {
  peak_ = dtype == "fp8" ? hw.fp8_tflops : dtype == "fp16" ? hw.fp16_tflops : dtype == "fp32" ? hw.fp32_tflops
          : dtype == "tf32"                                                  ? hw.tf32_tflops
                                                                             : hw.bf16_tflops;
  if (peak_ <= 0) peak_ = hw.bf16_tflops;
  ceiling_ = hw.mamf_bf16_tflops > 0 && hw.bf16_tflops > 0 ? hw.mamf_bf16_tflops / hw.bf16_tflops : 0.8;
  for (auto& s : profile)
    if (s.dtype == dtype && s.tflops > 0 && s.shape.m > 0 && s.shape.n > 0 && s.shape.k > 0) profile_.push_back(s);
  if (!profile_.empty()) {
    // Calibrate the ceiling: the analytic model's efficiency for the best measured shape
    // should reproduce that measurement.
    ceiling_ = 1.0;
    double best = 0;
    for (const auto& s : profile_) {
      const double eff = s.tflops / peak_;
      const double model = analytic(s.shape).efficiency;  // at ceiling 1
      if (model > 0) best = std::max(best, eff / model);
    }
    ceiling_ = std::clamp(best, 0.05, 1.0);
  }
}

GemmPrediction GemmModel::analytic(const GemmShape& s) const {
  GemmPrediction best;
  best.seconds = std::numeric_limits<double>::infinity();
  const int sms = std::max(1, hw_.sm_count);
  const double per_sm = peak_ * 1e12 * ceiling_ / sms;  // FLOP/s of one SM at the ceiling
  double align = 1;
  if (s.k % 8 != 0) align *= kMisalignedFactor;
  if (s.n % 8 != 0) align *= kMisalignedFactor;
  const double bytes = 2.0 * static_cast<double>(s.batch) *
                       (static_cast<double>(s.m) * s.k + static_cast<double>(s.k) * s.n + static_cast<double>(s.m) * s.n);
  const double t_mem = bytes / (hw_.hbm_tbps * 1e12 * kHbmFraction);
  for (const Tile& t : kTiles) {
    const std::int64_t tiles = tile_count(s, t);
    const std::int64_t waves = tiles / sms + (tiles % sms != 0 ? 1 : 0);
    const double tile_seconds =
        2.0 * t.m * t.n * (static_cast<double>(s.k) + kTileOverheadK) / (per_sm * tile_throughput(t) * align);
    const double t_compute = static_cast<double>(waves) * tile_seconds;
    const double seconds = std::max(t_compute, t_mem) + kLaunchSeconds;
    if (seconds < best.seconds) {
      best.seconds = seconds;
      best.tile_m = t.m;
      best.tile_n = t.n;
      best.tiles = tiles;
      best.waves = waves;
      best.wave_efficiency = static_cast<double>(tiles) / (static_cast<double>(waves) * sms);
      best.tile_efficiency = static_cast<double>(s.m) * s.n * s.batch / (static_cast<double>(tiles) * t.m * t.n);
      best.memory_bound = t_mem > t_compute;
    }
  }
  best.align_factor = align;
  best.tflops = flops_of(s) / best.seconds / 1e12;
  best.efficiency = best.tflops / peak_;
  best.source = "analytic";
  return best;
}

GemmPrediction GemmModel::predict(const GemmShape& s) const {
  GemmPrediction a = analytic(s);
  if (profile_.empty()) return a;
  // Inverse-square-distance blend of the 4 nearest measured shapes (log space), each scaled
  // by the analytic model's ratio target/sample so quantization and alignment differences
  // between the sample and the target carry through. An exact match returns the measurement.
  std::vector<std::pair<double, const GemmSample*>> near;
  for (const auto& p : profile_) near.push_back({log_distance(s, p.shape), &p});
  std::sort(near.begin(), near.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  if (near.size() > 4) near.resize(4);
  double tflops = 0;
  if (near.front().first < 1e-12) {
    tflops = near.front().second->tflops;
  } else {
    double wsum = 0;
    for (const auto& [d, p] : near) {
      const double w = 1.0 / (d * d);
      tflops += w * p->tflops * (a.tflops / analytic(p->shape).tflops);
      wsum += w;
    }
    tflops /= wsum;
  }
  tflops = std::min(tflops, peak_);
  GemmPrediction out = a;
  out.tflops = tflops;
  out.efficiency = tflops / peak_;
  out.seconds = flops_of(s) / (tflops * 1e12);
  const GemmShape& n0 = near.front().second->shape;
  out.source = fmt::format("profile (nearest {}x{}x{}{})", n0.m, n0.n, n0.k,
                           n0.batch > 1 ? fmt::format(" x{}", n0.batch) : std::string());
  return out;
}

}  // namespace keel::hw
