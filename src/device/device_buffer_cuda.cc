#include "device/device_buffer.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"
#include "device/cuda_check.h"

namespace keel {

void throw_out_of_gpu_memory(const std::string& need, std::size_t bytes, const std::string& advice) {
  cudaGetLastError();
  std::size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  throw UsageError(fmt::format("{} need {:.2f} GiB, {:.2f} GiB of {:.2f} GiB are free ({})", need,
                               bytes / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0, advice));
}

GrowingDeviceBuffer::~GrowingDeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

void* GrowingDeviceBuffer::ensure(std::size_t bytes, cudaStream_t stream, const char* what) {
  if (ptr_ && bytes <= capacity_) return ptr_;
  if (ptr_) {
    KEEL_CUDA_CHECK(cudaStreamSynchronize(stream));
    KEEL_CUDA_CHECK(cudaFree(ptr_));
    ptr_ = nullptr;
    capacity_ = 0;
  }
  std::size_t want = std::max<std::size_t>(bytes, 256);
  if (headroom_ > 0) want = (want + static_cast<std::size_t>(static_cast<double>(want) * headroom_) + 255) / 256 * 256;
  if (cudaMalloc(&ptr_, want) != cudaSuccess) {
    ptr_ = nullptr;
    throw_out_of_gpu_memory(head_ + what, want, advice_);
  }
  capacity_ = want;
  return ptr_;
}

}  // namespace keel
