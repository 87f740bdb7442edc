// keel run's GPU straggler probe (CUDA builds only; docs/fault_tolerance.md, "GPU stragglers"):
// how fast this GPU's SMs run, measured so that other work on the GPU does not count.
//
// One block per SM runs a fixed loop of independent fp32 FMAs and reads the GPU's nanosecond
// timer when all its threads have started and when all have finished; the probe's time is the
// fastest block's. Each block asks for all the shared memory a block may have, so no other
// block that uses shared memory (a GEMM's, NCCL's, a second probe block) shares its SM.
// A block only measures the SM it runs on while it runs: time spent waiting for an SM (other
// streams' kernels holding them: an overlapped optimizer update, NCCL's kernels) is not in it,
// and the fastest block is one that had its SM to itself. What slows every SM (power or
// thermal throttling, a lowered clock) slows every block. The loop takes about 130 us at an
// H200's boost clock.
//
// The earlier probe, a bf16 GEMM timed by CUDA events on the compute stream, counted the SMs
// other streams held: on 2 H200s with the overlapped ZeRO-1 step it named healthy GPUs (2.5-4.6x
// the other rank's time); with the classic step, nothing beside it, never.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace keel {

class DeviceCanary {
 public:
  // On the current device: 8 bytes of device and of pinned host memory, an event.
  DeviceCanary();
  ~DeviceCanary();
  DeviceCanary(const DeviceCanary&) = delete;
  DeviceCanary& operator=(const DeviceCanary&) = delete;

  // Enqueues a probe on `stream`, its loop `repeats` (>= 1) times as long (fault injection: a
  // GPU that many times slower). Returns the previous probe's seconds (0 before any): the host
  // does not wait for the one it enqueues.
  double sample(int repeats, cudaStream_t stream);
  // The seconds of the probe last enqueued, waiting for it (0 if none is pending).
  double wait();

 private:
  unsigned long long* fastest_ = nullptr;  // device: the fastest block's nanoseconds
  unsigned long long* host_ = nullptr;     // pinned: its copy
  cudaEvent_t copied_ = nullptr;
  int blocks_ = 0, shared_bytes_ = 0;
  bool pending_ = false;
};

}  // namespace keel
