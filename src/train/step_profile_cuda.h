// kernels.profile on the GPU: CUDA events at the phase marks of a step (train/step_profile.h).
// Two sets of events alternate: a step's events are read one step later, when its work is long
// done, so profiling adds no host sync of its own. CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <vector>

#include "train/step_profile.h"

namespace keel::train {

class CudaStepProfile {
 public:
  explicit CudaStepProfile(int warmup_steps) : warmup_(warmup_steps) {}
  ~CudaStepProfile();
  CudaStepProfile(const CudaStepProfile&) = delete;
  CudaStepProfile& operator=(const CudaStepProfile&) = delete;

  // The step boundary, where phase `first` starts: closes the step before, if any.
  void step(const char* first, cudaStream_t stream);
  // Phase `name` (a string literal: kept by pointer) starts here on `stream`.
  void mark(const char* name, cudaStream_t stream);
  // Closes the open step and reads every step's events (a host sync): the report so far.
  ProfileReport report(cudaStream_t stream);

 private:
  struct Mark {
    const char* name = nullptr;  // null: the step's end
    cudaEvent_t event = nullptr;
  };
  struct Step {
    std::vector<Mark> marks;
    std::size_t used = 0;
  };
  void record(Step& s, const char* name, cudaStream_t stream);
  void close(cudaStream_t stream);  // ends the open step: it waits to be read
  void read(Step& s);               // adds a closed step's phases (after warm-up) and empties it

  int warmup_ = 0, seen_ = 0, counted_ = 0;
  Step steps_[2];
  int open_ = -1;     // the step being marked, or -1
  int pending_ = -1;  // a closed step not read yet, or -1
  std::vector<std::string> names_;
  std::vector<double> ms_, entries_;
};

}  // namespace keel::train
