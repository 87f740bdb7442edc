// A strided device-to-device copy the CUDA context-parallel cores lay out sequences with.
// CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "device/cuda_check.h"

namespace keel::parallel {

// `height` rows of `width` bytes from src (rows `src_pitch` apart) to dst (`dst_pitch` apart).
inline void copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t width,
                      std::size_t height, cudaStream_t stream) {
  if (width == 0 || height == 0) return;
  KEEL_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDeviceToDevice, stream));
}

}  // namespace keel::parallel
