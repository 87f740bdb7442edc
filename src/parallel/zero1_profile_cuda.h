// parallel.zero1.profile: the data-parallel step's device timeline (CUDA builds only).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>

#include "device/cuda_check.h"

namespace keel::parallel {

// parallel.zero1.profile: a per-step timeline from device events, printed to stderr by the first
// and last rank after each step's norm (docs/parallel.md). Two sets of events, alternating by
// step, so the previous step's tail (optimizer, broadcasts) reads beside the current step's
// forward and backward.
struct Zero1Profile {
  enum Mark { kFwd0, kFwdGo, kFwdEnd, kBwd0, kBwdEnd, kRed0, kRedEnd, kJoined, kNormed, kBc0, kBcEnd, kOptEnd, kMarks };
  cudaEvent_t ev[2][kMarks] = {};
  bool rec[2][kMarks] = {};
  long step = 0;
  bool forward_seen = false, reduce_seen = false, first_forward = false;

  Zero1Profile() {
    for (auto& set : ev)
      for (auto& e : set) KEEL_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~Zero1Profile() {
    for (auto& set : ev)
      for (auto& e : set) cudaEventDestroy(e);
  }
  void new_step() {
    ++step;
    forward_seen = reduce_seen = false;
    for (bool& r : rec[step % 2]) r = false;
  }
  void mark(Mark m, cudaStream_t s) {
    KEEL_CUDA_CHECK(cudaEventRecord(ev[step % 2][m], s));
    rec[step % 2][m] = true;
  }
  // ms from a to b (set p), or NaN when either was not recorded
  double ms(int pa, Mark a, int pb, Mark b) const {
    if (!rec[pa][a] || !rec[pb][b]) return std::nan("");
    float t = 0;
    return cudaEventElapsedTime(&t, ev[pa][a], ev[pb][b]) == cudaSuccess ? t : std::nan("");
  }
  void report(int rank, int ranks) const {
    if (rank != 0 && rank != ranks - 1) return;
    const int c = static_cast<int>(step % 2), p = 1 - c;
    std::fprintf(stderr,
                 "dp profile rank %d step %ld: period %.2f | fwd wait %.2f fwd %.2f bwd %.2f tail %.2f norm %.2f | "
                 "reduces %.2f, end %.2f after bwd | prev: opt %.2f bcast %.2f, ends %.2f after fwd go, opt->fwd %.2f ms\n",
                 rank, step, ms(p, kFwd0, c, kFwd0), ms(c, kFwd0, c, kFwdGo), ms(c, kFwdGo, c, kFwdEnd),
                 ms(c, kBwd0, c, kBwdEnd), ms(c, kBwdEnd, c, kJoined), ms(c, kJoined, c, kNormed),
                 ms(c, kRed0, c, kRedEnd), ms(c, kBwdEnd, c, kRedEnd), ms(p, kNormed, p, kOptEnd), ms(p, kBc0, p, kBcEnd),
                 ms(c, kFwdGo, p, kBcEnd), ms(p, kOptEnd, c, kFwd0));
  }
};

}  // namespace keel::parallel
