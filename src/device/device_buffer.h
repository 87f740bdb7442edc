// Device memory that grows on demand, and the one out-of-memory message every GPU allocation
// of keel gives (what needed how much, how much is free, and what the user can lower).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace keel {

// keel::UsageError "{need} need X GiB, Y GiB of Z GiB are free ({advice})" after a failed
// cudaMalloc of `bytes` (clears the CUDA error first).
[[noreturn]] void throw_out_of_gpu_memory(const std::string& need, std::size_t bytes, const std::string& advice);

// A device allocation that grows (and never shrinks) to the largest size asked of it; its
// contents are lost when it grows.
class GrowingDeviceBuffer {
 public:
  // head + what names the need in the out-of-memory error ("out of GPU memory: the " +
  // "weights"), advice says what to lower; headroom: a growth allocates that fraction more
  // (rounded up to 256 bytes), so sizes that creep up do not reallocate every time.
  GrowingDeviceBuffer(std::string head, std::string advice, double headroom = 0)
      : head_(std::move(head)), advice_(std::move(advice)), headroom_(headroom) {}
  ~GrowingDeviceBuffer();
  GrowingDeviceBuffer(const GrowingDeviceBuffer&) = delete;
  GrowingDeviceBuffer& operator=(const GrowingDeviceBuffer&) = delete;

  // At least `bytes` (256 at least). Growing waits for `stream` first, since work queued there
  // may still read the old buffer.
  void* ensure(std::size_t bytes, cudaStream_t stream, const char* what);
  void* get() const { return ptr_; }
  std::size_t capacity() const { return capacity_; }

 private:
  std::string head_, advice_;
  double headroom_ = 0;
  void* ptr_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace keel
