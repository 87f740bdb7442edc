// Tile and wave quantization (NVIDIA's "Matrix Multiplication Background" guide, section 3):
// the output is cut into tiles, a partial last tile does wasted work, and tiles run in waves
// of one per SM, so time steps up when the tile count crosses a multiple of the SM count.
#pragma once

#include <cstdint>

namespace keel::bench {

struct TileStats {
  std::int64_t tiles_m = 0, tiles_n = 0;  // along m and n
  std::int64_t ctas = 0;                  // tiles x batch x split-k slices
  double waves = 0;                       // ctas / SMs (fractional: the sawtooth's phase)
  std::int64_t full_waves = 0;            // ceil(waves): what the time scales with
  double wave_efficiency = 0;             // waves / full_waves: busy share of the SM-waves paid for
  double tile_waste = 0;                  // share of computed output that lies outside C
};

// tile_m x tile_n output tiles (along m and n), split_k slices of k, batch independent GEMMs,
// sm_count SMs (one CTA per SM at a time, which cuBLASLt's Hopper kernels use). Any of tile_m,
// tile_n, sm_count <= 0 gives all-zero stats (unknown).
TileStats tile_stats(std::int64_t m, std::int64_t n, std::int64_t batch, int tile_m, int tile_n, int split_k,
                     int sm_count);

}  // namespace keel::bench
