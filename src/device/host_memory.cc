#include "device/host_memory.h"

#include <cstring>
#include <utility>

#include "common/error.h"
#include "device/cuda_devices.h"

#if defined(KEEL_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace keel {

bool pinned_host_memory_available() { return visible_cuda_devices() > 0; }

HostBuffer::HostBuffer(std::size_t bytes, bool pinned) : size_(bytes) {
  if (bytes == 0) return;
#if defined(KEEL_HAVE_CUDA)
  if (pinned && pinned_host_memory_available()) {
    void* p = nullptr;
    const cudaError_t rc = cudaMallocHost(&p, bytes);
    if (rc != cudaSuccess) fail("cudaMallocHost({} bytes): {}", bytes, cudaGetErrorString(rc));
    data_ = static_cast<char*>(p);
    pinned_ = true;
    return;
  }
#endif
  (void)pinned;
  data_ = new char[bytes];
}

HostBuffer::~HostBuffer() {
  if (!data_) return;
#if defined(KEEL_HAVE_CUDA)
  if (pinned_) {
    cudaFreeHost(data_);
    return;
  }
#endif
  delete[] data_;
}

HostBuffer::HostBuffer(HostBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), pinned_(std::exchange(o.pinned_, false)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    HostBuffer old(std::move(*this));
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    pinned_ = std::exchange(o.pinned_, false);
  }
  return *this;
}

void copy_to_host(void* dst, const void* src, std::size_t n, bool from_device) {
  if (n == 0) return;
  if (!from_device) {
    std::memcpy(dst, src, n);
    return;
  }
#if defined(KEEL_HAVE_CUDA)
  const cudaError_t rc = cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost);
  if (rc != cudaSuccess) fail("cudaMemcpy device to host ({} bytes): {}", n, cudaGetErrorString(rc));
#else
  fail("copy_to_host: device memory in a keel built without CUDA");
#endif
}

}  // namespace keel
