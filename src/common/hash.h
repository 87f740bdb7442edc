// One mixing function for reproducible pseudo-random data on host and device (benchmark
// inputs, synthetic checkpoint contents, test data) and one hash of bytes. Never used for
// anything secret.
#pragma once

#include <cstdint>
#include <string_view>

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

inline constexpr std::uint64_t kFnv1aBasis = 1469598103934665603ull;

// FNV-1a over bytes, continuing from `h`: the same on every host and in every binary (a config's
// hash compared across the ranks of a launch, a tensor name's seed, a batch's fingerprint).
inline std::uint64_t fnv1a(std::string_view bytes, std::uint64_t h = kFnv1aBasis) {
  for (const unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace keel
