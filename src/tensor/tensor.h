// A minimal non-owning tensor view: a float pointer and a row-major shape of up to 4 dims.
//
// Ownership: a Tensor never owns or frees its data. The memory belongs to whoever made it
// (an Arena region, a std::vector in a test, a mapped file); the view must not outlive it.
// Copying a Tensor copies the view, not the data. Views are always contiguous row-major:
// element (i0, i1, i2, i3) is at data[((i0 * s1 + i1) * s2 + i2) * s3 + i3].
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace keel {

class Tensor {
 public:
  static constexpr int kMaxDims = 4;

  Tensor() = default;
  // Throws keel::Error on more than 4 dims or a negative extent.
  Tensor(float* data, std::initializer_list<std::int64_t> shape);

  float* data() const { return data_; }
  int ndim() const { return ndim_; }
  // Extent of dimension i; negative i counts from the end (dim(-1) is the last).
  std::int64_t dim(int i) const;
  std::int64_t numel() const;
  bool empty() const { return data_ == nullptr; }

  // Element access (no bounds checks beyond the debug asserts of the caller's choosing).
  float& operator[](std::int64_t i) const { return data_[i]; }
  float& at(std::int64_t i0, std::int64_t i1) const { return data_[i0 * shape_[1] + i1]; }
  // Pointer to row i of the view seen as [numel / dim(-1), dim(-1)].
  float* row(std::int64_t i) const { return data_ + i * dim(-1); }
  // Number of rows of the view seen as [numel / dim(-1), dim(-1)].
  std::int64_t rows() const { return ndim_ == 0 ? 0 : numel() / dim(-1); }

  // The same data with another shape of equal numel (throws otherwise).
  Tensor reshaped(std::initializer_list<std::int64_t> shape) const;
  // Rows [begin, begin + count) of dimension 0 as a view with the same trailing dims.
  Tensor slice0(std::int64_t begin, std::int64_t count) const;

  void fill(float v) const;
  void zero() const { fill(0.f); }

  // "[2, 3, 4]"
  std::string shape_string() const;
  bool has_shape(std::initializer_list<std::int64_t> shape) const;

 private:
  float* data_ = nullptr;
  int ndim_ = 0;
  std::array<std::int64_t, kMaxDims> shape_{};
};

// dst += src elementwise; throws keel::Error unless both hold as many elements.
void add_into(const Tensor& dst, const Tensor& src);

// Throws keel::Error "<what>: expected shape [..], got [..]" unless t has exactly `shape`.
void require_shape(const Tensor& t, std::initializer_list<std::int64_t> shape, const char* what);

}  // namespace keel
