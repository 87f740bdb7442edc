#include "device/cuda_devices.h"

#include <cstdlib>
#include <string>

#include "common/error.h"

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

void set_cuda_device(int device) {
#if defined(KEEL_HAVE_CUDA)
  const cudaError_t rc = cudaSetDevice(device);
  if (rc != cudaSuccess) fail("cudaSetDevice({}): {}", device, cudaGetErrorString(rc));
#else
  fail("cudaSetDevice({}): this keel was built without CUDA", device);
#endif
}

bool nccl_over_mpi() {
  const char* v = std::getenv("KEEL_NCCL_OVER_MPI");
  return v && *v && std::string(v) != "0";
}

}  // namespace keel
