// Device memory carved by a bump pointer, the one way keel's GPU models lay out their buffers:
// a sizing pass with no memory counts the bytes every region takes, then one allocation of
// exactly that size is carved by the same calls in the same order (CUDA builds only).
//
//   DeviceCarver   carves 256-byte-aligned regions from a base it does not own (null base:
//                  the sizing pass, every region null);
//   DeviceArena    owns one cudaMalloc: take() counts until allocate(), then carves it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/error.h"

namespace keel {

class DeviceCarver {
 public:
  explicit DeviceCarver(void* base = nullptr, std::size_t capacity = 0)
      : base_(static_cast<std::byte*>(base)), capacity_(capacity) {}

  // `count` elements of T (negative counts as 0), 256-byte aligned; null in the sizing pass.
  template <typename T>
  T* take(std::int64_t count) {
    const std::size_t bytes = (static_cast<std::size_t>(std::max<std::int64_t>(count, 0)) * sizeof(T) + 255) / 256 * 256;
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += bytes;
    if (base_ && capacity_ > 0 && used_ > capacity_) fail("device carve overflow ({} > {} bytes)", used_, capacity_);
    return p;
  }
  std::size_t used() const { return used_; }  // bytes taken so far (in either pass)
  bool sizing() const { return base_ == nullptr; }

 private:
  std::byte* base_ = nullptr;
  std::size_t capacity_ = 0, used_ = 0;
};

class DeviceArena {
 public:
  explicit DeviceArena(std::string name) : name_(std::move(name)) {}
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  template <typename T>
  T* take(std::int64_t count) {
    return carver_.template take<T>(count);
  }
  // Ends the sizing pass: allocates what was counted (zero-filled) and starts handing out real
  // pointers. Out of memory is one keel::UsageError naming the arena and `advice` (what to lower).
  void allocate(const std::string& advice = "lower batch.micro_batch or data.seq_length, or set recompute: full");
  std::size_t capacity() const { return capacity_; }
  std::size_t used() const { return carver_.used(); }
  DeviceCarver& carver() { return carver_; }

 private:
  std::string name_;
  void* base_ = nullptr;
  std::size_t capacity_ = 0;
  DeviceCarver carver_;
};

}  // namespace keel
