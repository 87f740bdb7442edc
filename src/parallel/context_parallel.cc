#include "parallel/context_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "ops/attention.h"

namespace keel::parallel {

namespace {

int mpi_count(std::int64_t n, const char* what) {
  if (n > INT_MAX) fail("context parallel: {} of {} floats per rank is too large for one MPI call", what, n);
  return static_cast<int>(n);
}

// Rows [row0, row0 + rows) of `t` seen as [*, width] floats.
float* row_ptr(const Tensor& t, std::int64_t row, std::int64_t width) { return t.data() + row * width; }

}  // namespace

void check_context_split(std::int64_t seq, int degree, std::int64_t min_chunk, const std::string& what) {
  if (degree <= 1) return;
  if (seq % (2 * degree) != 0)
    throw UsageError(fmt::format("{}: seq_length {} does not split over context-parallel degree {} (parallel.context): "
                                 "the zigzag partition needs 2 x {} = {} equal chunks",
                                 what, seq, degree, degree, 2 * degree));
  if (seq / (2 * degree) < min_chunk)
    throw UsageError(fmt::format("{}: seq_length {} over context-parallel degree {} gives chunks of {} tokens, fewer "
                                 "than the {} CCA's convolutions read before each chunk",
                                 what, seq, degree, seq / (2 * degree), min_chunk));
}

std::vector<std::int32_t> zigzag_positions(std::int64_t seq, int degree, int rank) {
  std::vector<std::int32_t> pos;
  if (degree == 1) {
    for (std::int64_t t = 0; t < seq; ++t) pos.push_back(static_cast<std::int32_t>(t));
    return pos;
  }
  const std::int64_t chunk = seq / (2 * degree);
  for (const std::int64_t c : {std::int64_t(rank), std::int64_t(2 * degree - 1 - rank)})
    for (std::int64_t t = 0; t < chunk; ++t) pos.push_back(static_cast<std::int32_t>(c * chunk + t));
  return pos;
}

ContextParallel::ContextParallel(MPI_Comm context, std::int64_t seq, ContextMode mode)
    : comm_(context), seq_(seq), mode_(mode) {
  if (comm_ != MPI_COMM_NULL) {
    mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  }
  check_context_split(seq, size_, 1, "context parallel");
  chunk_ = seq / (2 * size_);
  pos_ = zigzag_positions(seq, size_, rank_);
  if (ring())
    for (int r = 0; r < size_; ++r) ring_pos_.push_back(zigzag_positions(seq, size_, r));
}

std::int64_t ContextParallel::seq_row(int rank, std::int64_t b, std::int64_t t) const {
  const std::int64_t run = t / chunk_, c = run == 0 ? rank : 2 * size_ - 1 - rank;
  return b * seq_ + c * chunk_ + t % chunk_;
}

void ContextParallel::sum(std::int64_t* x, int n) {
  if (size_ == 1 || n == 0) return;
  PeerWait wait("MPI_Allreduce (context group)");
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_INT64_T, MPI_SUM, comm_), "MPI_Allreduce");
}

void sum_over_context(MPI_Comm context, double* x, int n) {
  int size = 1;
  if (context != MPI_COMM_NULL) mpi_check(MPI_Comm_size(context, &size), "MPI_Comm_size");
  if (size == 1 || n == 0) return;
  std::vector<double> all(static_cast<std::size_t>(size) * n);
  {
    PeerWait wait("MPI_Allgather (context group)");
    mpi_check(MPI_Allgather(x, n, MPI_DOUBLE, all.data(), n, MPI_DOUBLE, context), "MPI_Allgather");
  }
  for (int i = 0; i < n; ++i) {
    double s = 0;
    for (int j = 0; j < size; ++j) s += all[static_cast<std::size_t>(j) * n + i];
    x[i] = s;
  }
}

void ContextParallel::sum(double* x, int n) const { sum_over_context(comm_, x, n); }

void ContextParallel::gather(const Tensor& k, const Tensor& v) {
  const std::int64_t B = k.dim(0), T = k.dim(1), w = k.dim(2) * k.dim(3), n = k.numel();
  if (T != 2 * chunk_) fail("context parallel: {} tokens per sequence here, expected {}", T, 2 * chunk_);
  require_shape(v, {k.dim(0), k.dim(1), k.dim(2), k.dim(3)}, "context parallel v");
  send_.resize(static_cast<std::size_t>(2 * n));
  recv_.resize(static_cast<std::size_t>(2 * n * size_));
  std::memcpy(send_.data(), k.data(), sizeof(float) * static_cast<std::size_t>(n));
  std::memcpy(send_.data() + n, v.data(), sizeof(float) * static_cast<std::size_t>(n));
  {
    PeerWait wait("MPI_Allgather (context-parallel k, v)");
    mpi_check(MPI_Allgather(send_.data(), mpi_count(2 * n, "an all-gather"), MPI_FLOAT, recv_.data(),
                            mpi_count(2 * n, "an all-gather"), MPI_FLOAT, comm_),
              "MPI_Allgather");
  }
  k_.resize(static_cast<std::size_t>(B * seq_ * w));
  v_.resize(k_.size());
  for (int j = 0; j < size_; ++j) {
    const float* rk = recv_.data() + std::int64_t(j) * 2 * n;
    const float* rv = rk + n;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t src = (b * T + t) * w, dst = seq_row(j, b, t) * w;
        std::memcpy(k_.data() + dst, rk + src, sizeof(float) * static_cast<std::size_t>(w));
        std::memcpy(v_.data() + dst, rv + src, sizeof(float) * static_cast<std::size_t>(w));
      }
  }
}

void ContextParallel::attend(const Tensor& q, const Tensor& k, const Tensor& v, float scale, int window,
                             const Tensor& out, const Tensor& lse) {
  if (ring()) return attend_ring(q, k, v, scale, window, out, lse);
  if (mode_ == ContextMode::kAllToAll) return attend_heads(q, k, v, scale, window, out, lse);
  gather(k, v);
  const std::int64_t B = k.dim(0), H = k.dim(2), D = k.dim(3);
  ops::attention::forward_at(q, Tensor(k_.data(), {B, seq_, H, D}), Tensor(v_.data(), {B, seq_, H, D}), pos_.data(),
                             scale, out, lse, window);
}

void ContextParallel::attend_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                      const Tensor& lse, const Tensor& dout, float scale, int window, const Tensor& dq,
                                      const Tensor& dk, const Tensor& dv) {
  if (ring()) return attend_ring_backward(q, k, v, out, lse, dout, scale, window, dq, dk, dv);
  if (mode_ == ContextMode::kAllToAll) return attend_heads_backward(q, k, v, out, lse, dout, scale, window, dq, dk, dv);
  gather(k, v);  // forward's gathered keys are not kept: one buffer serves every layer
  const std::int64_t B = k.dim(0), T = k.dim(1), H = k.dim(2), D = k.dim(3), w = H * D, n = k.numel();
  dk_.resize(k_.size());
  dv_.resize(k_.size());
  const Tensor dK(dk_.data(), {B, seq_, H, D}), dV(dv_.data(), {B, seq_, H, D});
  ops::attention::backward_at(q, Tensor(k_.data(), {B, seq_, H, D}), Tensor(v_.data(), {B, seq_, H, D}), pos_.data(),
                              out, lse, dout, scale, dq, dK, dV, window);
  // The whole sequence's dk, dv in rank order (each rank's rows as its k and v hold them), then
  // summed over the group into the rank holding those keys.
  recv_.resize(static_cast<std::size_t>(2 * n * size_));
  for (int j = 0; j < size_; ++j) {
    float* sk = recv_.data() + std::int64_t(j) * 2 * n;
    float* sv = sk + n;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t dst = (b * T + t) * w, src = seq_row(j, b, t) * w;
        std::memcpy(sk + dst, dk_.data() + src, sizeof(float) * static_cast<std::size_t>(w));
        std::memcpy(sv + dst, dv_.data() + src, sizeof(float) * static_cast<std::size_t>(w));
      }
  }
  send_.resize(static_cast<std::size_t>(2 * n));
  {
    PeerWait wait("MPI_Reduce_scatter_block (context-parallel dk, dv)");
    mpi_check(MPI_Reduce_scatter_block(recv_.data(), send_.data(), mpi_count(2 * n, "a reduce-scatter"), MPI_FLOAT,
                                       MPI_SUM, comm_),
              "MPI_Reduce_scatter_block");
  }
  require_shape(dk, {B, T, H, D}, "context parallel dk");
  require_shape(dv, {B, T, H, D}, "context parallel dv");
  std::memcpy(dk.data(), send_.data(), sizeof(float) * static_cast<std::size_t>(n));
  std::memcpy(dv.data(), send_.data() + n, sizeof(float) * static_cast<std::size_t>(n));
}

void ContextParallel::sendrecv(const float* send, int to, float* recv, int from, std::int64_t n) const {
  std::fill(recv, recv + n, 0.f);  // stays zero where there is no sender
  PeerWait wait("MPI_Sendrecv (context-parallel halo)");
  mpi_check(MPI_Sendrecv(send, mpi_count(n, "a halo"), MPI_FLOAT, to < 0 ? MPI_PROC_NULL : to, 0, recv,
                         mpi_count(n, "a halo"), MPI_FLOAT, from < 0 ? MPI_PROC_NULL : from, 0, comm_,
                         MPI_STATUS_IGNORE),
            "MPI_Sendrecv");
}

// Runs: row b * 2 + 0 is chunk r, b * 2 + 1 chunk 2C-1-r. The run before chunk r is chunk r-1,
// rank r-1's first run; before chunk 2C-1-r, chunk 2C-2-r: rank r+1's second run, or for the
// last rank its own first run (chunk C-1 precedes chunk C). Forward a first run's tail goes one
// rank up and a second run's one rank down; backward the halos' gradients go the other way.
void ContextParallel::exchange(const Tensor& in, const Tensor& out, bool backward) const {
  const std::int64_t F = in.dim(1), B = in.dim(0) / 2, n = B * F;
  require_shape(out, {2 * B, F}, backward ? "context parallel dtails" : "context parallel halos");
  const int up = rank_ + 1 < size_ ? rank_ + 1 : -1, down = rank_ - 1;
  std::vector<float> first(n), second(n), got(n);
  const auto rows = [&](const Tensor& t, int run, float* buf, bool into_t) {  // rows b * 2 + run <-> buf
    for (std::int64_t b = 0; b < B; ++b) {
      float* row = row_ptr(t, 2 * b + run, F);
      if (into_t)
        std::memcpy(row, buf + b * F, sizeof(float) * F);
      else
        std::memcpy(buf + b * F, row, sizeof(float) * F);
    }
  };
  rows(in, 0, first.data(), false);
  rows(in, 1, second.data(), false);
  sendrecv(first.data(), backward ? down : up, got.data(), backward ? up : down, n);
  rows(out, 0, (backward && up < 0 ? second : got).data(), true);
  sendrecv(second.data(), backward ? up : down, got.data(), backward ? down : up, n);
  rows(out, 1, (!backward && up < 0 ? first : got).data(), true);
}

void ContextParallel::halo(const Tensor& tails, const Tensor& halos) { exchange(tails, halos, false); }

// The adjoint of halo(): each halo's gradient goes back to the run whose tail it was.
void ContextParallel::halo_backward(const Tensor& dhalos, const Tensor& dtails) { exchange(dhalos, dtails, true); }

}  // namespace keel::parallel
