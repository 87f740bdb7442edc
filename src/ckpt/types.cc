#include "ckpt/types.h"

#include <fmt/format.h>

#include "common/error.h"

namespace keel::ckpt {

std::size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::kF64: case ElemType::kI64: return 8;
    case ElemType::kF32: case ElemType::kI32: return 4;
    case ElemType::kBF16: case ElemType::kF16: return 2;
    case ElemType::kU8: return 1;
  }
  return 1;
}

std::string_view elem_name(ElemType t) {
  switch (t) {
    case ElemType::kF32: return "f32";
    case ElemType::kBF16: return "bf16";
    case ElemType::kF16: return "f16";
    case ElemType::kF64: return "f64";
    case ElemType::kI64: return "i64";
    case ElemType::kI32: return "i32";
    case ElemType::kU8: return "u8";
  }
  return "?";
}

std::string_view safetensors_name(ElemType t) {
  switch (t) {
    case ElemType::kF32: return "F32";
    case ElemType::kBF16: return "BF16";
    case ElemType::kF16: return "F16";
    case ElemType::kF64: return "F64";
    case ElemType::kI64: return "I64";
    case ElemType::kI32: return "I32";
    case ElemType::kU8: return "U8";
  }
  return "?";
}

ElemType parse_elem(std::string_view name) {
  for (ElemType t : {ElemType::kF32, ElemType::kBF16, ElemType::kF16, ElemType::kF64, ElemType::kI64, ElemType::kI32,
                     ElemType::kU8})
    if (name == elem_name(t) || name == safetensors_name(t)) return t;
  fail("unknown element type '{}' (f32, bf16, f16, f64, i64, i32, u8)", name);
}

std::int64_t numel(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) {
    if (d < 0) fail("shape {} has a negative dimension", shape_str(s));
    if (__builtin_mul_overflow(n, d, &n)) fail("shape {} has more elements than a 64-bit count holds", shape_str(s));
  }
  return n;
}

std::uint64_t byte_size(const Shape& s, ElemType t) {
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(numel(s), static_cast<std::int64_t>(elem_size(t)), &bytes))
    fail("shape {} of {} holds more bytes than a 64-bit size holds", shape_str(s), elem_name(t));
  return static_cast<std::uint64_t>(bytes);
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

Box full_box(const Shape& shape) { return Box{Shape(shape.size(), 0), shape}; }

std::string box_str(const Box& b) {
  std::string out = "[";
  for (std::size_t d = 0; d < b.ndim(); ++d)
    out += fmt::format("{}{}:{}", d ? ", " : "", b.offsets[d], b.offsets[d] + b.lengths[d]);
  return out + "]";
}

bool box_within(const Box& b, const Shape& shape) {
  if (b.offsets.size() != shape.size() || b.lengths.size() != shape.size()) return false;
  // Written so that no sum can overflow: offsets and lengths may come from a damaged file.
  for (std::size_t d = 0; d < shape.size(); ++d)
    if (b.offsets[d] < 0 || b.lengths[d] < 0 || b.offsets[d] > shape[d] || b.lengths[d] > shape[d] - b.offsets[d])
      return false;
  return true;
}

}  // namespace keel::ckpt
