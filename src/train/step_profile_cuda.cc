#include "train/step_profile_cuda.h"

#include <algorithm>

#include "device/cuda_check.h"

namespace keel::train {

CudaStepProfile::~CudaStepProfile() {
  for (Step& s : steps_)
    for (Mark& m : s.marks) cudaEventDestroy(m.event);
}

void CudaStepProfile::record(Step& s, const char* name, cudaStream_t stream) {
  if (s.used == s.marks.size()) {
    Mark m;
    KEEL_CUDA_CHECK(cudaEventCreate(&m.event));
    s.marks.push_back(m);
  }
  Mark& m = s.marks[s.used++];
  m.name = name;
  KEEL_CUDA_CHECK(cudaEventRecord(m.event, stream));
}

void CudaStepProfile::close(cudaStream_t stream) {
  if (open_ < 0) return;
  record(steps_[open_], nullptr, stream);
  if (pending_ >= 0) read(steps_[pending_]);  // the step before last: done by now
  pending_ = open_;
  open_ = -1;
}

void CudaStepProfile::step(const char* first, cudaStream_t stream) {
  close(stream);
  open_ = pending_ == 0 ? 1 : 0;
  steps_[open_].used = 0;
  record(steps_[open_], first, stream);
}

void CudaStepProfile::mark(const char* name, cudaStream_t stream) {
  if (open_ >= 0) record(steps_[open_], name, stream);
}

void CudaStepProfile::read(Step& s) {
  const bool count = seen_++ >= warmup_;
  if (count) ++counted_;
  for (std::size_t i = 0; count && i + 1 < s.used; ++i) {
    KEEL_CUDA_CHECK(cudaEventSynchronize(s.marks[i + 1].event));
    float ms = 0;
    KEEL_CUDA_CHECK(cudaEventElapsedTime(&ms, s.marks[i].event, s.marks[i + 1].event));
    const std::string key = s.marks[i].name;
    const auto at = std::find(names_.begin(), names_.end(), key);
    const std::size_t k = static_cast<std::size_t>(at - names_.begin());
    if (at == names_.end()) names_.push_back(key), ms_.push_back(0), entries_.push_back(0);
    ms_[k] += ms;
    entries_[k] += 1;
  }
  s.used = 0;
}

ProfileReport CudaStepProfile::report(cudaStream_t stream) {
  close(stream);
  if (pending_ >= 0) read(steps_[pending_]), pending_ = -1;
  ProfileReport r;
  r.steps = counted_;
  r.skipped = std::min(seen_, warmup_);
  for (std::size_t k = 0; k < names_.size() && counted_ > 0; ++k)
    r.rows.push_back({names_[k], ms_[k] / counted_, entries_[k] / counted_});
  return r;
}

}  // namespace keel::train
