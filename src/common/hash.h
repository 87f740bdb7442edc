// One mixing function for reproducible pseudo-random data on host and device: benchmark
// inputs, synthetic checkpoint contents, test data. Never used for anything secret.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KEEL_HOST_DEVICE __host__ __device__
#else
#define KEEL_HOST_DEVICE
#endif

namespace keel {

// splitmix64's finalizer (Steele, Lea and Flood, 2014): a bijective, well-mixed 64-bit hash.
KEEL_HOST_DEVICE inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace keel
