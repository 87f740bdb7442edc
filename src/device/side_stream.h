// A side stream for collectives that overlap the compute stream's work, ordered against it by
// two events (CUDA builds only): start(stream) makes the side stream wait until `stream` gets
// here and returns it, end() marks what was posted on it so far, wait(stream) makes `stream`
// wait for that. Made on first use. synchronize() waits on the host for its work (an owner
// does before freeing the buffers that work reads or writes); the destructor does too.
// Used by tensor parallelism's input prefetch and context parallelism's ring hops and LASP-2
// all-gathers.
#pragma once

#include <cuda_runtime.h>

#include "device/cuda_check.h"

namespace keel {

class SideStream {
 public:
  SideStream() = default;
  ~SideStream() {
    if (!stream_) return;
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  cudaStream_t start(cudaStream_t after) {
    if (!stream_) {
      KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    }
    KEEL_CUDA_CHECK(cudaEventRecord(ready_, after));
    KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    return stream_;
  }
  void end() { KEEL_CUDA_CHECK(cudaEventRecord(done_, stream_)); }
  void wait(cudaStream_t stream) { KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, done_, 0)); }
  void synchronize() {
    if (stream_) cudaStreamSynchronize(stream_);
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
};

}  // namespace keel
