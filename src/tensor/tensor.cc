#include "tensor/tensor.h"

#include <algorithm>

#include "common/error.h"

namespace keel {

Tensor::Tensor(float* data, std::initializer_list<std::int64_t> shape) : data_(data) {
  if (shape.size() > static_cast<std::size_t>(kMaxDims)) fail("tensor: {} dims, at most {} supported", shape.size(), kMaxDims);
  for (std::int64_t e : shape) {
    if (e < 0) fail("tensor: negative extent {}", e);
    shape_[ndim_++] = e;
  }
}

std::int64_t Tensor::dim(int i) const {
  if (i < 0) i += ndim_;
  if (i < 0 || i >= ndim_) fail("tensor: dim {} out of range for shape {}", i, shape_string());
  return shape_[i];
}

std::int64_t Tensor::numel() const {
  if (ndim_ == 0) return 0;
  std::int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= shape_[i];
  return n;
}

Tensor Tensor::reshaped(std::initializer_list<std::int64_t> shape) const {
  Tensor t(data_, shape);
  if (t.numel() != numel()) fail("tensor: cannot reshape {} to {}", shape_string(), t.shape_string());
  return t;
}

Tensor Tensor::slice0(std::int64_t begin, std::int64_t count) const {
  if (ndim_ == 0 || begin < 0 || count < 0 || begin + count > shape_[0])
    fail("tensor: rows [{}, {}) out of range for shape {}", begin, begin + count, shape_string());
  Tensor t = *this;
  std::int64_t inner = shape_[0] == 0 ? 0 : numel() / shape_[0];
  t.data_ = data_ + begin * inner;
  t.shape_[0] = count;
  return t;
}

void Tensor::fill(float v) const { std::fill(data_, data_ + numel(), v); }

std::string Tensor::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim_; ++i) s += (i ? ", " : "") + std::to_string(shape_[i]);
  return s + "]";
}

bool Tensor::has_shape(std::initializer_list<std::int64_t> shape) const {
  if (static_cast<int>(shape.size()) != ndim_) return false;
  int i = 0;
  for (std::int64_t e : shape)
    if (shape_[i++] != e) return false;
  return true;
}

void add_into(const Tensor& dst, const Tensor& src) {
  if (dst.numel() != src.numel()) fail("add_into: {} += {}: element counts differ", dst.shape_string(), src.shape_string());
  const std::int64_t n = dst.numel();
  float* d = dst.data();
  const float* s = src.data();
  for (std::int64_t i = 0; i < n; ++i) d[i] += s[i];
}

void require_shape(const Tensor& t, std::initializer_list<std::int64_t> shape, const char* what) {
  if (t.empty() && Tensor(nullptr, shape).numel() > 0) fail("{}: missing tensor (null data)", what);
  if (!t.has_shape(shape)) fail("{}: expected shape {}, got {}", what, Tensor(nullptr, shape).shape_string(), t.shape_string());
}

}  // namespace keel
