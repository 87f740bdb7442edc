#include "device/cuda_devices.h"

#if defined(KEEL_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace keel {

int visible_cuda_devices() {
#if defined(KEEL_HAVE_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

}  // namespace keel
