#include "parallel/expert_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "common/parallel_for.h"

namespace keel::parallel {
namespace {

void copy_rows(float* dst, const float* src, std::int64_t rows, std::int64_t width) {
  if (rows > 0) std::memcpy(dst, src, sizeof(float) * static_cast<std::size_t>(rows * width));
}

}  // namespace

ExpertMajorLayout expert_major_layout(const std::vector<std::int64_t>& recv, int sources, int local_experts) {
  if (sources < 1 || local_experts < 1 || recv.size() != static_cast<std::size_t>(sources) * local_experts)
    fail("expert parallel: {} row counts for {} sources x {} local experts", recv.size(), sources, local_experts);
  ExpertMajorLayout l;
  l.block_start.assign(recv.size(), 0);
  l.expert_offsets.assign(static_cast<std::size_t>(local_experts) + 1, 0);
  std::int64_t at = 0;
  for (int j = 0; j < local_experts; ++j) {
    l.expert_offsets[static_cast<std::size_t>(j)] = at;
    for (int p = 0; p < sources; ++p) {
      const std::size_t i = static_cast<std::size_t>(p) * local_experts + j;
      if (recv[i] < 0) fail("expert parallel: source {} announced {} rows for local expert {}", p, recv[i], j);
      l.block_start[i] = at;
      at += recv[i];
    }
  }
  l.expert_offsets.back() = at;
  return l;
}

ExpertParallelMoe::ExpertParallelMoe(MPI_Comm comm, int experts) : comm_(comm), experts_(experts) {
  if (comm == MPI_COMM_NULL) fail("expert parallel: no communicator");
  mpi_check(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
  mpi_check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
  if (experts < 1 || experts % size_ != 0)
    throw UsageError(fmt::format("expert parallel: {} experts do not split over {} ranks (the expert-parallel degree must "
                                 "divide the number of experts)",
                                 experts, size_));
}

void ExpertParallelMoe::exchange(const float* send, const std::vector<std::int64_t>& send_rows, float* recv,
                                 const std::vector<std::int64_t>& recv_rows, std::int64_t width) const {
  std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
  std::int64_t so = 0, ro = 0;
  for (int p = 0; p < size_; ++p) {
    const std::int64_t s = send_rows[p] * width, r = recv_rows[p] * width;
    if (so + s > INT_MAX || ro + r > INT_MAX)
      fail("expert parallel: more than {} floats in one exchange (MPI counts are int); use smaller micro-batches", INT_MAX);
    sc[p] = static_cast<int>(s), sd[p] = static_cast<int>(so);
    rc[p] = static_cast<int>(r), rd[p] = static_cast<int>(ro);
    so += s, ro += r;
  }
  // MPI wants valid buffers even for empty exchanges
  float dummy = 0;
  PeerWait wait("MPI_Alltoallv (expert parallel tokens)");
  mpi_check(MPI_Alltoallv(so > 0 ? send : &dummy, sc.data(), sd.data(), MPI_FLOAT, ro > 0 ? recv : &dummy, rc.data(),
                          rd.data(), MPI_FLOAT, comm_),
            "MPI_Alltoallv (expert parallel)");
}

void ExpertParallelMoe::forward(const ops::moe::Plan& plan, const Tensor& x, const Tensor& gates,
                                const ops::moe::Weights& local, const Tensor& y) {
  if (x.ndim() != 2) fail("expert parallel: x must be [N, D], got {}", x.shape_string());
  const std::int64_t n = x.dim(0), d = x.dim(1);
  const int top_k = plan.top_k;
  if (plan.experts != experts_ || plan.tokens != n)
    fail("expert parallel: plan is for {} tokens over {} experts, expected {} over {}", plan.tokens, plan.experts, n,
         experts_);
  const int el = local_experts();
  if (local.w_gate.ndim() != 3 || local.w_gate.dim(0) != el)
    fail("expert parallel: local W_gate must be [{}, F, D] (experts {}..{} of {}), got {}", el, first_expert(),
         first_expert() + el - 1, experts_, local.w_gate.shape_string());
  const std::int64_t f = local.w_gate.dim(1);
  require_shape(gates, {n, top_k}, "expert parallel gates");
  require_shape(y, {n, d}, "expert parallel y");
  d_ = d, f_ = f;
  plan_ = plan;
  const std::int64_t s = plan_.slots();
  gates_.assign(gates.data(), gates.data() + n * top_k);

  // 1-2. rows per destination, and how many of each local expert every source sends here
  send_rows_.assign(size_, 0);
  for (int p = 0; p < size_; ++p) send_rows_[p] = plan_.offsets[(p + 1) * el] - plan_.offsets[p * el];
  std::vector<std::int64_t> recv_counts(static_cast<std::size_t>(size_) * el);
  {
    PeerWait wait("MPI_Alltoall (expert parallel counts)");
    mpi_check(MPI_Alltoall(plan_.counts.data(), el, MPI_INT64_T, recv_counts.data(), el, MPI_INT64_T, comm_),
              "MPI_Alltoall (expert parallel counts)");
  }
  recv_rows_.assign(size_, 0);
  for (int p = 0; p < size_; ++p)
    for (int j = 0; j < el; ++j) recv_rows_[p] += recv_counts[static_cast<std::size_t>(p) * el + j];
  std::int64_t r = 0;
  for (auto v : recv_rows_) r += v;

  // 3. the slots' token rows in expert order, to the experts' ranks
  std::vector<float> xs_sorted(static_cast<std::size_t>(s * d));
  parallel_for(s, 256, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t slot = b; slot < e; ++slot)
      copy_rows(xs_sorted.data() + slot * d, x.row(plan_.source[slot] / top_k), 1, d);
  });
  std::vector<float> x_src(static_cast<std::size_t>(r * d));
  exchange(xs_sorted.data(), send_rows_, x_src.data(), recv_rows_, d);
  // source-major (each source's block in local-expert order) -> expert-major
  expert_major_.resize(static_cast<std::size_t>(r));
  std::vector<std::int32_t> local_idx(static_cast<std::size_t>(r));
  {
    std::vector<std::int64_t> block(static_cast<std::size_t>(size_) * el);  // source-major offset of (p, j)
    std::int64_t at = 0;
    for (int p = 0; p < size_; ++p)
      for (int j = 0; j < el; ++j) block[static_cast<std::size_t>(p) * el + j] = at, at += recv_counts[static_cast<std::size_t>(p) * el + j];
    std::int64_t i = 0;
    for (int j = 0; j < el; ++j)
      for (int p = 0; p < size_; ++p) {
        const std::size_t pj = static_cast<std::size_t>(p) * el + j;
        for (std::int64_t q = 0; q < recv_counts[pj]; ++q, ++i) {
          expert_major_[i] = static_cast<std::int32_t>(block[pj] + q);
          local_idx[i] = j;
        }
      }
  }
  x_local_.resize(static_cast<std::size_t>(r * d));
  for (std::int64_t i = 0; i < r; ++i) copy_rows(x_local_.data() + i * d, x_src.data() + std::int64_t(expert_major_[i]) * d, 1, d);

  // 4. the local experts on their blocks: moe::forward, top-1 with unit gates
  local_plan_ = ops::moe::make_plan(local_idx.data(), r, 1, el);
  unit_gates_.assign(static_cast<std::size_t>(r), 1.f);
  xs_local_.resize(static_cast<std::size_t>(r * d));
  ys_local_.resize(static_cast<std::size_t>(r * d));
  h_gate_.resize(static_cast<std::size_t>(r * f));
  h_up_.resize(static_cast<std::size_t>(r * f));
  act_.resize(static_cast<std::size_t>(r * f));
  std::vector<float> y_local(static_cast<std::size_t>(r * d));
  if (r > 0) {
    const ops::moe::Saved sv{Tensor(xs_local_.data(), {r, d}), Tensor(h_gate_.data(), {r, f}), Tensor(h_up_.data(), {r, f}),
                             Tensor(act_.data(), {r, f}), Tensor(ys_local_.data(), {r, d})};
    ops::moe::forward(local_plan_, Tensor(x_local_.data(), {r, d}), Tensor(unit_gates_.data(), {r, 1}), local, sv,
                      Tensor(y_local.data(), {r, d}));
  }

  // 5. outputs back to the tokens' ranks (source-major again), then the gate-weighted combine
  std::vector<float> y_src(static_cast<std::size_t>(r * d));
  for (std::int64_t i = 0; i < r; ++i) copy_rows(y_src.data() + std::int64_t(expert_major_[i]) * d, y_local.data() + i * d, 1, d);
  ys_sorted_.resize(static_cast<std::size_t>(s * d));
  exchange(y_src.data(), recv_rows_, ys_sorted_.data(), send_rows_, d);
  parallel_for(n, 64, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      float* yr = y.row(i);
      std::fill(yr, yr + d, 0.f);
      for (int k = 0; k < top_k; ++k) {
        const float g = gates_[i * top_k + k];
        const float* src = ys_sorted_.data() + std::int64_t(plan_.position[i * top_k + k]) * d;
        for (std::int64_t c = 0; c < d; ++c) yr[c] += g * src[c];
      }
    }
  });
}

void ExpertParallelMoe::backward(const Tensor& dy, const ops::moe::Weights& local, const Tensor& dx, const Tensor& dgates,
                                 const ops::moe::Weights& local_grads) {
  const std::int64_t n = plan_.tokens, d = d_, f = f_, s = plan_.slots();
  const int top_k = plan_.top_k;
  require_shape(dy, {n, d}, "expert parallel dy");
  if (!dx.empty()) require_shape(dx, {n, d}, "expert parallel dx");
  if (!dgates.empty()) require_shape(dgates, {n, top_k}, "expert parallel dgates");
  // combine backward at the tokens' rank: gate gradients, gate-weighted slot gradients
  std::vector<float> dys_sorted(static_cast<std::size_t>(s * d));
  parallel_for(n, 64, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      const float* dyr = dy.row(i);
      for (int k = 0; k < top_k; ++k) {
        const std::int64_t slot = plan_.position[i * top_k + k];
        const float* ysr = ys_sorted_.data() + slot * d;
        if (!dgates.empty()) {
          float acc = 0.f;
          for (std::int64_t c = 0; c < d; ++c) acc += dyr[c] * ysr[c];
          dgates.row(i)[k] = acc;
        }
        const float g = gates_[i * top_k + k];
        float* o = dys_sorted.data() + slot * d;
        for (std::int64_t c = 0; c < d; ++c) o[c] = g * dyr[c];
      }
    }
  });
  // slot gradients to the experts' ranks, expert-major there
  const std::int64_t r = received_rows();
  std::vector<float> dy_src(static_cast<std::size_t>(r * d));
  exchange(dys_sorted.data(), send_rows_, dy_src.data(), recv_rows_, d);
  std::vector<float> dy_local(static_cast<std::size_t>(r * d)), dx_local(static_cast<std::size_t>(r * d));
  for (std::int64_t i = 0; i < r; ++i) copy_rows(dy_local.data() + i * d, dy_src.data() + std::int64_t(expert_major_[i]) * d, 1, d);
  if (r > 0) {
    const ops::moe::Saved sv{Tensor(xs_local_.data(), {r, d}), Tensor(h_gate_.data(), {r, f}), Tensor(h_up_.data(), {r, f}),
                             Tensor(act_.data(), {r, f}), Tensor(ys_local_.data(), {r, d})};
    std::vector<float> scratch(static_cast<std::size_t>(ops::moe::backward_scratch_floats(r, d, f)));
    ops::moe::backward(local_plan_, Tensor(x_local_.data(), {r, d}), Tensor(unit_gates_.data(), {r, 1}), local, sv,
                       Tensor(dy_local.data(), {r, d}), Tensor(scratch.data(), {static_cast<std::int64_t>(scratch.size())}),
                       Tensor(dx_local.data(), {r, d}), Tensor(), local_grads);
  }
  // input gradients back to the tokens' ranks, summed per token in k order
  std::vector<float> dx_src(static_cast<std::size_t>(r * d)), dxs_sorted(static_cast<std::size_t>(s * d));
  for (std::int64_t i = 0; i < r; ++i) copy_rows(dx_src.data() + std::int64_t(expert_major_[i]) * d, dx_local.data() + i * d, 1, d);
  exchange(dx_src.data(), recv_rows_, dxs_sorted.data(), send_rows_, d);
  if (dx.empty()) return;
  parallel_for(n, 64, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) {
      float* dxr = dx.row(i);
      std::fill(dxr, dxr + d, 0.f);
      for (int k = 0; k < top_k; ++k) {
        const float* src = dxs_sorted.data() + std::int64_t(plan_.position[i * top_k + k]) * d;
        for (std::int64_t c = 0; c < d; ++c) dxr[c] += src[c];
      }
    }
  });
}

}  // namespace keel::parallel
