#include "bench/gemm/tiling.h"

#include <algorithm>

namespace keel::bench {

TileStats tile_stats(std::int64_t m, std::int64_t n, std::int64_t batch, int tile_m, int tile_n, int split_k,
                     int sm_count) {
  TileStats s;
  if (tile_m <= 0 || tile_n <= 0 || sm_count <= 0 || m <= 0 || n <= 0) return s;
  s.tiles_m = (m + tile_m - 1) / tile_m;
  s.tiles_n = (n + tile_n - 1) / tile_n;
  s.ctas = s.tiles_m * s.tiles_n * std::max<std::int64_t>(batch, 1) * std::max(split_k, 1);
  s.waves = static_cast<double>(s.ctas) / sm_count;
  s.full_waves = (s.ctas + sm_count - 1) / sm_count;
  s.wave_efficiency = s.waves / static_cast<double>(s.full_waves);
  const double covered = static_cast<double>(s.tiles_m * tile_m) * static_cast<double>(s.tiles_n * tile_n);
  s.tile_waste = 1.0 - static_cast<double>(m) * static_cast<double>(n) / covered;
  return s;
}

}  // namespace keel::bench
