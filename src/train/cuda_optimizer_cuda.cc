#include "train/cuda_optimizer_cuda.h"

#include <fmt/format.h>

#include <cmath>

#include "common/error.h"
#include "device/cuda_check.h"
#include "ops/cuda/grad_norm.h"
#include "optim/clip.h"
#include "parallel/zero1.h"

namespace keel::train {

namespace k = ops::cuda;

CudaOptimizer::CudaOptimizer(const OptimizerConfig& config, const optim::ParamLayout& layout, const StateSlice& slice)
    : layout_(layout), slice_(slice), adam_(config.adamw), muon_(config.muon.config) {}

void CudaOptimizer::carve(DeviceCarver& c) {
  norm_ws_ = c.take<double>(k::grad_norm::kWorkspaceDoubles);
  sum_sq_ = c.take<double>(2);  // sum_squares_part's two parts
  norm_ = c.take<double>(1);
  coef_ = c.take<float>(1);
}

void CudaOptimizer::require_finite(double norm) {
  if (!std::isfinite(norm)) throw optim::NonFiniteGradient(fmt::format("gradient norm is {}", norm), "", norm);
}

std::pair<double, float> CudaOptimizer::step_all(double max_norm, k::GemmRunner& gemm, cudaStream_t stream) {
  const std::int64_t n = layout_.total_floats;
  sum_squares(0, n, /*accumulate=*/false, stream);
  clip(max_norm, stream);
  const auto [norm, coef] = read_norm(stream);
  require_finite(norm);
  k::adamw::DeviceFlatRange r;
  r.begin = 0;
  r.end = n;
  r.param = buf_.params;
  r.grad = buf_.grads;
  r.m = buf_.m;
  r.v = buf_.v;
  r.param_bf16 = buf_.params_bf16;
  adam_.step(layout_, r, lr_, 1.0f, coef_, stream);  // skips Muon parameters
  // Muon on the matrices: the same device-side clip coefficient as gradient scale
  if (buf_.muon_workspace)
    muon_.step(layout_, buf_.params, buf_.grads, buf_.m, buf_.params_bf16, lr_, 1.0f, coef_, buf_.muon_workspace, gemm,
               stream);
  return {norm, coef};
}

void CudaOptimizer::sum_squares(std::int64_t begin, std::int64_t end, bool accumulate, cudaStream_t stream) {
  sum_squares_part(0, begin, end, accumulate, stream);
}

void CudaOptimizer::sum_squares_part(int part, std::int64_t begin, std::int64_t end, bool accumulate,
                                     cudaStream_t stream) {
  if (part < 0 || part > 1) fail("cuda optimizer: sum-of-squares part {} (0 or 1)", part);
  k::grad_norm::sum_squares(buf_.grads + begin, end - begin, norm_ws_, sum_sq_ + part, accumulate, stream);
}

void CudaOptimizer::clip(double max_norm, cudaStream_t stream) {
  k::grad_norm::clip_coefficient(sum_sq_, max_norm, coef_, norm_, stream);
}

void CudaOptimizer::clip_parts(double max_norm, cudaStream_t stream) {
  k::grad_norm::clip_coefficient(sum_sq_, max_norm, coef_, norm_, stream, /*parts=*/2);
}

std::pair<double, float> CudaOptimizer::read_norm(cudaStream_t stream) {
  double norm = 0;
  float coef = 1;
  KEEL_CUDA_CHECK(cudaMemcpyAsync(&norm, norm_, sizeof(double), cudaMemcpyDeviceToHost, stream));
  KEEL_CUDA_CHECK(cudaMemcpyAsync(&coef, coef_, sizeof(float), cudaMemcpyDeviceToHost, stream));
  KEEL_CUDA_CHECK(keel::stream_sync(stream));
  return {norm, coef};
}

std::int64_t CudaOptimizer::moment_index(std::int64_t o) const {
  if (o >= slice_.expert_begin && o < slice_.expert_end)
    return (slice_.shard_end - slice_.shard_begin) + (o - slice_.expert_begin);
  return o - slice_.shard_begin;
}

void CudaOptimizer::update(std::int64_t begin, std::int64_t end, k::GemmRunner& gemm, cudaStream_t stream) {
  adam_.set_step_count(t0_);
  k::adamw::DeviceFlatRange r;
  r.begin = begin;
  r.end = end;
  r.param = buf_.params + begin;
  r.grad = buf_.grads + begin;
  r.m = buf_.m + moment_index(begin);
  r.v = buf_.v + moment_index(begin);
  r.param_bf16 = buf_.params_bf16 + begin;
  adam_.step(layout_, r, lr_, 1.0f, coef_, stream);  // skips Muon parameters
  // Muon on the whole matrices inside [begin, end), consecutive ones of a stack in one batched call
  const auto mats = parallel::muon_matrices_in(layout_, begin, end);
  for (std::size_t i = 0; i < mats.size();) {
    std::size_t j = i + 1;
    while (j < mats.size() && mats[j].param == mats[i].param) ++j;
    if (static_cast<std::size_t>(mats[i].param) < muon_elsewhere_.size() && muon_elsewhere_[mats[i].param]) {
      i = j;
      continue;
    }
    const auto& p = layout_.params[static_cast<std::size_t>(mats[i].param)];
    const std::int64_t o = mats[i].offset;
    k::muon::matrix_step(buf_.params + o, buf_.grads + o, buf_.m + moment_index(o), buf_.params_bf16 + o,
                         static_cast<std::int64_t>(j - i), p.rows(), p.cols(), muon_.config(), lr_ * p.lr_scale,
                         p.weight_decay, 1.0f, coef_, buf_.muon_workspace, gemm, stream);
    i = j;
  }
}

}  // namespace keel::train
