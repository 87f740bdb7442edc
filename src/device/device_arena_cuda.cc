#include "device/device_arena.h"

#include <cuda_runtime.h>

#include "device/cuda_check.h"
#include "device/device_buffer.h"

namespace keel {

DeviceArena::~DeviceArena() {
  if (base_) cudaFree(base_);
}

void DeviceArena::allocate(const std::string& advice) {
  capacity_ = std::max<std::size_t>(carver_.used(), 256);
  const cudaError_t e = cudaMalloc(&base_, capacity_);
  if (e != cudaSuccess)
    throw_out_of_gpu_memory("out of GPU memory: the " + name_, capacity_, advice);
  KEEL_CUDA_CHECK(cudaMemset(base_, 0, capacity_));
  carver_ = DeviceCarver(base_, capacity_);
}

}  // namespace keel
