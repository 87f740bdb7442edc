#include "parallel/expert_parallel_cuda.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "parallel/expert_parallel.h"

namespace keel::parallel {

namespace moe = ops::cuda::moe;
using ops::cuda::bf16;

namespace {

std::size_t align_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

CudaExpertParallelGroup::CudaExpertParallelGroup(MPI_Comm comm, std::shared_ptr<NcclGroup> nccl, int experts)
    : comm_(comm), experts_(experts), nccl_(std::move(nccl)) {
  mpi_check(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
  mpi_check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
  if (experts < 1 || experts % size_ != 0)
    throw UsageError(fmt::format("expert parallelism: {} experts do not split over {} ranks", experts, size_));
  if (nccl_->size() != size_ || nccl_->rank() != rank_)
    fail("expert parallelism: the NCCL communicator ({} of {}) is not over the expert group ({} of {})", nccl_->rank(),
         nccl_->size(), rank_, size_);
}

CudaExpertParallelMoe::CudaExpertParallelMoe(std::shared_ptr<CudaExpertParallelGroup> group)
    : group_(std::move(group)) {}

void CudaExpertParallelMoe::exchange(const moe::Plan& plan, void* slots, void* local, std::int64_t width,
                                     NcclType type, bool to_experts, cudaStream_t stream) {
  const int P = group_->size(), El = group_->local_experts();
  const std::int64_t elem = type == NcclType::kBfloat16 ? 2 : 4;
  NcclGroup& nccl = group_->nccl();
  char* s = static_cast<char*>(slots);
  char* l = static_cast<char*>(local);
  nccl.group_start();
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < El; ++j) {
      const int e = p * El + j;  // the global expert, held by rank p
      const std::int64_t out = plan.count(e), in = recv_[static_cast<std::size_t>(p) * El + j];
      char* at_slots = s + plan.host_offsets[e] * width * elem;
      char* at_local = l + recv_at_[static_cast<std::size_t>(p) * El + j] * width * elem;
      // to the experts: my slots of expert e go to p; p's rows for my expert j arrive
      if (out > 0) {
        if (to_experts) nccl.send(at_slots, out * width, type, p, stream);
        else nccl.recv(at_slots, out * width, type, p, stream);
      }
      if (in > 0) {
        if (to_experts) nccl.recv(at_local, in * width, type, p, stream);
        else nccl.send(at_local, in * width, type, p, stream);
      }
    }
  nccl.group_end();
}

void CudaExpertParallelMoe::forward(const moe::Plan& plan, const bf16* x, const float* gates, const moe::Weights& w,
                                    std::int64_t d, std::int64_t f, const moe::Saved& saved, float* y,
                                    cudaStream_t stream) {
  const int P = group_->size(), El = group_->local_experts();
  if (plan.experts != group_->experts() || static_cast<int>(plan.host_offsets.size()) != plan.experts + 1)
    fail("expert parallelism: the plan routes over {} experts, the layer has {}", plan.experts, group_->experts());
  if (d < 1 || f < 1) fail("expert parallelism: model width {} and expert width {} must be >= 1", d, f);
  if (plan.slots() > 0 && (!x || !gates || !saved.xs || !saved.ys || !y))
    fail("expert parallelism: forward got a null pointer");
  d_ = d, f_ = f;
  // 2. counts: what I send to rank p for its expert j, and what p sends me for mine
  std::vector<std::int64_t> sent(static_cast<std::size_t>(P) * El);
  for (int e = 0; e < P * El; ++e) sent[static_cast<std::size_t>(e)] = plan.count(e);
  recv_.assign(sent.size(), 0);
  {
    PeerWait wait("MPI_Alltoall (expert counts)");
    mpi_check(MPI_Alltoall(sent.data(), El, MPI_INT64_T, recv_.data(), El, MPI_INT64_T, group_->comm()),
              "MPI_Alltoall (expert counts)");
  }
  // expert-major: local expert j's rows from sources 0..P-1, one after another
  ExpertMajorLayout layout = expert_major_layout(recv_, P, El);
  recv_at_ = std::move(layout.block_start);
  local_offsets_ = std::move(layout.expert_offsets);
  const std::int64_t R = local_offsets_.back();
  // the received rows' saved tensors: xs, ys [R, D], h_gate, h_up, act [R, F] (bf16)
  const std::size_t rd = align_up(static_cast<std::size_t>(R * d) * 2), rf = align_up(static_cast<std::size_t>(R * f) * 2);
  char* base = static_cast<char*>(rows_.ensure(std::max<std::size_t>(2 * rd + 3 * rf, 256), stream, "received rows"));
  local_.xs = reinterpret_cast<bf16*>(base);
  local_.ys = reinterpret_cast<bf16*>(base + rd);
  local_.h_gate = reinterpret_cast<bf16*>(base + 2 * rd);
  local_.h_up = reinterpret_cast<bf16*>(base + 2 * rd + rf);
  local_.act = reinterpret_cast<bf16*>(base + 2 * rd + 2 * rf);
  // the backward scratch grows here too (backward never waits): the slot order's dys (bf16) and
  // dxs (fp32) [S, D], the received rows' dys (bf16) and dxs (fp32) [R, D], the experts' own
  const std::size_t S = static_cast<std::size_t>(plan.slots());
  group_->scratch().ensure(align_up(S * d * 2) + align_up(S * d * 4) + align_up(R * d * 2) + align_up(R * d * 4) +
                               static_cast<std::size_t>(moe::experts_backward_scratch_bytes(R, f)),
                           stream, "backward scratch");
  // 1, 3. dispatch, rows to the experts
  moe::dispatch_rows(plan, x, d, saved.xs, stream);
  exchange(plan, saved.xs, local_.xs, d, NcclType::kBfloat16, /*to_experts=*/true, stream);
  // 4. the local experts
  if (R > 0) moe::experts_forward(local_offsets_, w, d, f, local_, stream);
  // 5. outputs back, combine
  exchange(plan, saved.ys, local_.ys, d, NcclType::kBfloat16, /*to_experts=*/false, stream);
  moe::combine(plan, saved.ys, gates, d, y, stream);
}

void CudaExpertParallelMoe::backward(const moe::Plan& plan, const float* gates, const moe::Weights& w, std::int64_t d,
                                     std::int64_t f, const moe::Saved& saved, const float* dy, void* scratch, bf16* dx,
                                     float* dgates, const moe::Grads& dw, cudaStream_t stream) {
  (void)scratch;
  if (local_offsets_.empty() || d != d_ || f != f_)
    fail("expert parallelism: backward() without the layer's forward()");
  const std::size_t S = static_cast<std::size_t>(plan.slots());
  const std::int64_t R = received_rows();
  char* base = static_cast<char*>(group_->scratch().get());
  bf16* dys = reinterpret_cast<bf16*>(base);
  base += align_up(S * d * 2);
  float* dxs = reinterpret_cast<float*>(base);
  base += align_up(S * d * 4);
  bf16* dys_local = reinterpret_cast<bf16*>(base);
  base += align_up(static_cast<std::size_t>(R * d) * 2);
  float* dxs_local = reinterpret_cast<float*>(base);
  base += align_up(static_cast<std::size_t>(R * d) * 4);
  void* experts_scratch = base;
  moe::combine_backward(plan, saved.ys, gates, d, dy, dys, dgates, stream);
  exchange(plan, dys, dys_local, d, NcclType::kBfloat16, /*to_experts=*/true, stream);
  // with no received rows this only zeroes the gradients an overwriting backward owes (dw.overwrite)
  moe::experts_backward(local_offsets_, w, d, f, local_, dys_local, experts_scratch, dx ? dxs_local : nullptr, dw, stream);
  if (!dx) return;
  exchange(plan, dxs, dxs_local, d, NcclType::kFloat32, /*to_experts=*/false, stream);
  moe::combine_dx(plan, dxs, d, dx, stream);
}

}  // namespace keel::parallel
