// Error checks for the CUDA runtime and NCCL. Every call's status is checked; a failure
// becomes a one-line keel::Error naming the call. Kept in one header so a HIP/RCCL port
// changes the spelling here, not at every call site.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include "common/error.h"
#include "common/watchdog.h"

#define KEEL_CUDA_CHECK(call)                                                                   \
  do {                                                                                          \
    cudaError_t keel_status_ = (call);                                                          \
    if (keel_status_ != cudaSuccess)                                                            \
      ::keel::fail("CUDA call {} failed: {}", #call, cudaGetErrorString(keel_status_));         \
  } while (0)

#define KEEL_NCCL_CHECK(call)                                                                   \
  do {                                                                                          \
    ncclResult_t keel_status_ = (call);                                                         \
    if (keel_status_ != ncclSuccess && keel_status_ != ncclInProgress)                          \
      ::keel::fail("NCCL call {} failed: {} ({})", #call, ncclGetErrorString(keel_status_),     \
                   ncclGetLastError(nullptr));                                                  \
  } while (0)

namespace keel {

// cudaStreamSynchronize marked as a wait on other ranks for the watchdog's hang report
// (common/watchdog.h): under data or expert parallelism the stream may be waiting in, or on,
// collectives that need every rank.
inline cudaError_t stream_sync(cudaStream_t stream) {
  PeerWait wait("a GPU stream sync (the GPU may be waiting in collectives with other ranks)");
  return cudaStreamSynchronize(stream);
}

}  // namespace keel
