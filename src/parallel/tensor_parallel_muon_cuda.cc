#include "parallel/tensor_parallel_muon_cuda.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"
#include "device/cuda_check.h"
#include "parallel/tensor_parallel_muon.h"

namespace keel::parallel {

namespace km = ops::cuda::muon;

// The matrices of one tensor-split Muon parameter inside the range: `matrices` blocks of rows x
// cols here (this rank's) from flat offset `offset` on, whole matrices of R x C.
struct CudaTensorParallelMuon::Tensor {
  const optim::ParamInfo* p = nullptr;
  std::int64_t offset = 0, moment = 0, matrices = 1, rows = 0, cols = 0, R = 0, C = 0;  // moment: momentum index of offset
  std::int64_t numel() const { return matrices * block(); }
  TpMuonSplit split;
  std::int64_t block() const { return rows * cols; }
  std::int64_t whole() const { return R * C; }
};

namespace {
constexpr const char* kOomHead = "out of GPU memory: tensor-parallel Muon's ";
constexpr const char* kOomAdvice = "train on more GPUs or a smaller model";
}  // namespace

CudaTensorParallelMuon::CudaTensorParallelMuon(const optim::MuonConfig& c, const optim::ParamLayout& layout,
                                               std::shared_ptr<NcclGroup> group, std::vector<Range> ranges)
    : c_(c), owner_c_(c), layout_(layout), group_(std::move(group)), local_(kOomHead, kOomAdvice, 0.25),
      owned_(kOomHead, kOomAdvice, 0.25), workspace_(kOomHead, kOomAdvice, 0.25) {
  optim::validate(c_);
  owner_c_.momentum = 0.0;
  owner_c_.nesterov = false;
  if (!group_) fail("tensor-parallel muon (cuda): no tensor group");
  const int T = group_->size();
  if (ranges.empty()) ranges.push_back({0, layout_.total_floats, 0});
  split_.assign(layout_.params.size(), false);
  std::vector<const Tensor*> batch;
  std::int64_t batch_floats = 0;
  for (std::size_t i = 0; i < layout_.params.size(); ++i) {
    const optim::ParamInfo& p = layout_.params[i];
    if (p.optimizer != optim::OptimizerKind::kMuon) continue;
    const TpMuonSplit sp = tp_muon_split(p, T);
    if (!sp.split) continue;
    split_[i] = true;
    for (const Range& range : ranges) {
      const std::int64_t lo = std::max(p.offset, range.begin), hi = std::min(p.offset + p.numel, range.end);
      if (lo >= hi) continue;
      auto t = std::make_unique<Tensor>();
      t->p = &p;
      t->rows = p.rows(), t->cols = p.cols();
      if ((lo - p.offset) % t->block() != 0 || (hi - lo) % t->block() != 0)
        fail("tensor-parallel muon: the range [{}, {}) cuts a matrix of '{}'", range.begin, range.end, p.name);
      t->offset = lo;
      t->moment = range.at + (lo - range.begin);
      t->matrices = (hi - lo) / t->block();
      t->split = sp;
      t->R = sp.split_dim == kTpSplitRows ? t->rows * T : t->rows;
      t->C = sp.split_dim == kTpSplitCols ? t->cols * T : t->cols;
      std::int64_t parts = 0;
      for (std::int64_t r : sp.row_parts) {
        if (r % T != 0) fail("tensor-parallel muon: '{}' has a row part of {} rows, not split over {} ranks", p.name, r, T);
        parts += r;
      }
      if (!sp.row_parts.empty() && parts != t->R)
        fail("tensor-parallel muon: '{}' row parts add up to {}, not its {} rows", p.name, parts, t->R);
      if (!batch.empty() && batch_floats + t->numel() > kBatchFloats) {
        batches_.push_back(batch);
        batch.clear();
        batch_floats = 0;
      }
      batch.push_back(t.get());
      batch_floats += t->numel();
      tensors_.push_back(std::move(t));
    }
  }
  if (!batch.empty()) batches_.push_back(batch);
}

CudaTensorParallelMuon::~CudaTensorParallelMuon() = default;

void CudaTensorParallelMuon::step(float* params, const float* grads, float* momentum, bf16* params_bf16, double lr,
                                  const float* device_grad_scale, ops::cuda::GemmRunner& gemm, cudaStream_t stream) {
  for (const auto& b : batches_) step_batch(b, params, grads, momentum, params_bf16, lr, device_grad_scale, gemm, stream);
}

void CudaTensorParallelMuon::step_batch(const std::vector<const Tensor*>& batch, float* params, const float* grads,
                                        float* momentum, bf16* params_bf16, double lr, const float* device_grad_scale,
                                        ops::cuda::GemmRunner& gemm, cudaStream_t stream) {
  const int T = group_->size(), me = group_->rank();
  // Owners, balanced over the batch (the same on every rank).
  std::vector<TpMuonTensor> shapes;
  for (const Tensor* t : batch) {
    TpMuonTensor s;
    s.matrices = t->matrices, s.local_rows = t->rows, s.local_cols = t->cols, s.split_dim = t->split.split_dim;
    shapes.push_back(s);
  }
  const std::vector<int> owners = tp_muon_balance_owners(shapes, T, c_.ns_steps);
  // Where everything goes: this rank's blocks (U, then k X) at local offsets; the matrices this
  // rank owns, per tensor consecutive, at `owned` offsets of whole matrices in five regions:
  // staging (T blocks), whole U, scratch momentum, scratch parameter, whole k X.
  std::vector<std::int64_t> local_at(batch.size()), owned_at(batch.size()), owned_count(batch.size(), 0);
  std::int64_t local_total = 0, owned_total = 0;
  std::size_t job = 0;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    local_at[i] = local_total;
    local_total += batch[i]->numel();
    owned_at[i] = owned_total;
    for (std::int64_t e = 0; e < batch[i]->matrices; ++e)
      if (owners[job++] == me) ++owned_count[i], owned_total += batch[i]->whole();
  }
  float* local = static_cast<float*>(local_.ensure(static_cast<std::size_t>(local_total) * sizeof(float), stream, "blocks"));
  float* owned = owned_total > 0 ? static_cast<float*>(owned_.ensure(
                                       static_cast<std::size_t>(5 * owned_total) * sizeof(float), stream, "whole matrices"))
                                 : nullptr;
  float *stage = owned, *whole_u = owned + owned_total, *tmp_m = owned + 2 * owned_total,
        *tmp_p = owned + 3 * owned_total, *kx = owned + 4 * owned_total;
  const std::size_t F = sizeof(float);

  // 1. momentum and U on this rank's blocks
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const Tensor& t = *batch[i];
    km::block_momentum(grads + t.offset, momentum + t.moment, local + local_at[i], t.numel(), c_, 1.0f,
                       device_grad_scale, stream);
  }
  // The blocks of one whole matrix (tensor i, its j-th owned) in staging: rank r's at r x block.
  auto stage_of = [&](std::size_t i, std::int64_t j) { return stage + owned_at[i] + j * batch[i]->whole(); };
  // Runs f(i, e, owner, j): every matrix of the batch, j its index among the owner's of tensor i.
  auto for_each_matrix = [&](auto&& f) {
    std::size_t k = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      std::int64_t j = 0;
      for (std::int64_t e = 0; e < batch[i]->matrices; ++e) {
        const int o = owners[k++];
        f(i, e, o, o == me ? j++ : -1);
      }
    }
  };
  // 2. every block of U to its matrix's owner
  group_->group_start();
  for_each_matrix([&](std::size_t i, std::int64_t e, int o, std::int64_t j) {
    const std::int64_t blk = batch[i]->block();
    float* mine = local + local_at[i] + e * blk;
    if (o != me) return group_->send(mine, blk, NcclType::kFloat32, o, stream);
    for (int r = 0; r < T; ++r)
      if (r == me)
        KEEL_CUDA_CHECK(cudaMemcpyAsync(stage_of(i, j) + r * blk, mine, blk * F, cudaMemcpyDeviceToDevice, stream));
      else
        group_->recv(stage_of(i, j) + r * blk, blk, NcclType::kFloat32, r, stream);
  });
  group_->group_end();
  // 3. the owner's whole matrices: assemble, orthogonalize (k X), cut up into staging again.
  //    copy(to_whole): between rank r's block in staging and its place in the whole matrix.
  auto move_blocks = [&](std::size_t i, float* blocks, float* whole, bool to_whole) {
    const Tensor& t = *batch[i];
    const std::int64_t blk = t.block();
    for (int r = 0; r < T; ++r) {
      float* b = blocks + r * blk;
      if (t.split.split_dim == kTpSplitCols) {
        float* w = whole + r * t.cols;
        if (to_whole)
          KEEL_CUDA_CHECK(cudaMemcpy2DAsync(w, t.C * F, b, t.cols * F, t.cols * F, t.R, cudaMemcpyDeviceToDevice, stream));
        else
          KEEL_CUDA_CHECK(cudaMemcpy2DAsync(b, t.cols * F, w, t.C * F, t.cols * F, t.R, cudaMemcpyDeviceToDevice, stream));
        continue;
      }
      // rows: rank r's block is its slice of every row part, in order (one part: rows r R / T on)
      const std::vector<std::int64_t> parts = t.split.row_parts.empty() ? std::vector<std::int64_t>{t.R} : t.split.row_parts;
      std::int64_t whole_row = 0, local_row = 0;
      for (std::int64_t part : parts) {
        const std::int64_t n = part / T;
        float* w = whole + (whole_row + r * n) * t.C;
        float* l = b + local_row * t.cols;
        if (to_whole)
          KEEL_CUDA_CHECK(cudaMemcpyAsync(w, l, n * t.C * F, cudaMemcpyDeviceToDevice, stream));
        else
          KEEL_CUDA_CHECK(cudaMemcpyAsync(l, w, n * t.C * F, cudaMemcpyDeviceToDevice, stream));
        whole_row += part, local_row += n;
      }
    }
  };
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const Tensor& t = *batch[i];
    const std::int64_t m = owned_count[i];
    if (m == 0) continue;
    for (std::int64_t j = 0; j < m; ++j)
      move_blocks(i, stage_of(i, j), whole_u + owned_at[i] + j * t.whole(), /*to_whole=*/true);
    float* M = tmp_m + owned_at[i];
    KEEL_CUDA_CHECK(cudaMemsetAsync(M, 0, static_cast<std::size_t>(m * t.whole()) * F, stream));  // 0 x M must be 0
    void* ws = workspace_.ensure(km::workspace_bytes(m, t.R, t.C), stream, "Newton-Schulz workspace");
    km::matrix_step(tmp_p + owned_at[i], whole_u + owned_at[i], M, nullptr, m, t.R, t.C, owner_c_, /*lr=*/1.0,
                    /*decay=*/false, 1.0f, nullptr, ws, gemm, stream, kx + owned_at[i]);
    for (std::int64_t j = 0; j < m; ++j)
      move_blocks(i, stage_of(i, j), kx + owned_at[i] + j * t.whole(), /*to_whole=*/false);
  }
  // 4. the blocks of k X back to their ranks, into `local` (U's place)
  group_->group_start();
  for_each_matrix([&](std::size_t i, std::int64_t e, int o, std::int64_t j) {
    const std::int64_t blk = batch[i]->block();
    float* mine = local + local_at[i] + e * blk;
    if (o != me) return group_->recv(mine, blk, NcclType::kFloat32, o, stream);
    for (int r = 0; r < T; ++r)
      if (r == me)
        KEEL_CUDA_CHECK(cudaMemcpyAsync(mine, stage_of(i, j) + r * blk, blk * F, cudaMemcpyDeviceToDevice, stream));
      else
        group_->send(stage_of(i, j) + r * blk, blk, NcclType::kFloat32, r, stream);
  });
  group_->group_end();
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const Tensor& t = *batch[i];
    km::block_update(params + t.offset, params_bf16 ? params_bf16 + t.offset : nullptr, local + local_at[i], t.numel(),
                     c_, lr * t.p->lr_scale, t.p->weight_decay, 1.0f, device_grad_scale, stream);
  }
}

}  // namespace keel::parallel
