// Element types shared by communication benchmarks and kernels. Host conversions are plain
// bit manipulation (round-to-nearest-even) so CPU paths need no CUDA headers.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace keel {

enum class DType { kBF16, kFP16, kFP32 };

inline constexpr std::size_t dtype_size(DType t) { return t == DType::kFP32 ? 4 : 2; }
std::string_view dtype_name(DType t);
// Accepts bf16/bfloat16, fp16/half/float16, fp32/float/float32; throws keel::Error otherwise.
DType parse_dtype(std::string_view name);

// Largest integer N such that every integer in [-N, N] is exactly representable.
inline constexpr std::int64_t dtype_exact_int_limit(DType t) {
  return t == DType::kBF16 ? 256 : t == DType::kFP16 ? 2048 : (1 << 24);
}

inline float bf16_bits_to_float(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// x rounded to the nearest bf16 value (ties to even), as a float.
inline float bf16_round(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

float fp16_bits_to_float(std::uint16_t h);
std::uint16_t float_to_fp16_bits(float f);

// Reads/writes element i of a buffer of type t as float.
inline float load_as_float(const void* data, std::size_t i, DType t) {
  switch (t) {
    case DType::kBF16: return bf16_bits_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::kFP16: return fp16_bits_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::kFP32: return static_cast<const float*>(data)[i];
  }
  return 0.f;
}
inline void store_from_float(void* data, std::size_t i, DType t, float v) {
  switch (t) {
    case DType::kBF16: static_cast<std::uint16_t*>(data)[i] = float_to_bf16_bits(v); break;
    case DType::kFP16: static_cast<std::uint16_t*>(data)[i] = float_to_fp16_bits(v); break;
    case DType::kFP32: static_cast<float*>(data)[i] = v; break;
  }
}

}  // namespace keel
