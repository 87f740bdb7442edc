#include "ckpt/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define KEEL_CRC32C_X86 1
#endif

namespace keel::ckpt {
namespace {

using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][i] = c;
  }
  for (std::uint32_t i = 0; i < 256; ++i)
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  return t;
}

const Tables& tables() {
  static const Tables t = make_tables();
  return t;
}

#ifdef KEEL_CRC32C_X86
// The same sum with SSE4.2's crc32 (the Castagnoli polynomial, reflected): 8 bytes per
// instruction. Compiled for SSE4.2 whatever the build's target; called only where the CPU has it.
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::uint32_t crc, const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t c = ~crc;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}
#endif

}  // namespace

bool crc32c_hardware() {
#ifdef KEEL_CRC32C_X86
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n) {
#ifdef KEEL_CRC32C_X86
  if (crc32c_hardware()) return crc32c_sse42(crc, data, n);
#endif
  return crc32c_table(crc, data, n);
}

std::uint32_t crc32c_table(std::uint32_t crc, const void* data, std::size_t n) {
  const Tables& t = tables();
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts (x86-64, aarch64)
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return ~c;
}

}  // namespace keel::ckpt
