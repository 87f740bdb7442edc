// Element types and n-d boxes: the vocabulary every part of the checkpoint library shares.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel::ckpt {

// Element types a checkpoint stores. Bytes are stored raw, little-endian, row-major.
enum class ElemType { kF32, kBF16, kF16, kF64, kI64, kI32, kU8 };

std::size_t elem_size(ElemType t);
std::string_view elem_name(ElemType t);          // "f32", "bf16", ...
std::string_view safetensors_name(ElemType t);   // "F32", "BF16", ...
// Accepts keel names and safetensors names; throws keel::Error otherwise.
ElemType parse_elem(std::string_view name);

using Shape = std::vector<std::int64_t>;

// Elements of a shape. Throws keel::Error for a negative dimension or a count beyond int64
// (a corrupt header or metadata file must not wrap around into a small, plausible size).
std::int64_t numel(const Shape& s);
// numel(s) * elem_size(t), checked the same way.
std::uint64_t byte_size(const Shape& s, ElemType t);
std::string shape_str(const Shape& s);  // "[4, 8]"

// A hyper-rectangle of a tensor: per-dimension offsets and lengths (global coordinates).
struct Box {
  Shape offsets, lengths;
  std::int64_t volume() const { return numel(lengths); }
  bool empty() const { return volume() == 0; }
  std::size_t ndim() const { return lengths.size(); }
  bool operator==(const Box&) const = default;
};

Box full_box(const Shape& shape);
std::string box_str(const Box& b);  // "[0:4, 8:16]"
// True when `b` lies inside a tensor of shape `shape`.
bool box_within(const Box& b, const Shape& shape);

}  // namespace keel::ckpt
