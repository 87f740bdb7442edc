// Muon on the GPU: the CUDA twin of optim/muon.h (momentum, quintic Newton-Schulz, RMS-matching
// scale, decoupled weight decay) for 2-D matrices and [E, rows, cols] expert stacks.
//
// Per matrix, with s = grad_scale (host) * *device_grad_scale (when not null):
//   g = s grad;  M = beta M + (1 - beta) g;  U = (1 - beta) g + beta M (Nesterov) or M
//   X0 = bf16(U / (||U||_F + 1e-7))                        norm of the fp32 U, in fp64
//   wide (rows <= cols):  5x  A = X X^T;  B = b A + c A A;  X = a X + B X
//   tall (rows >  cols):  5x  A = X^T X;  B = b A + c A A;  X = a X + X B^T
//   p = p (1 - lr wd) - lr k X;   param_bf16 = bf16(p)
// The tall form is the wide iteration on G^T written without transposing anything (A is the
// small min(rows, cols)^2 Gram matrix either way). Each iteration is three GEMMs and nothing
// else: the b A and a X terms ride in the epilogues of the second and third (cuBLASLt reads
// them as its C input and writes the result elsewhere, GemmRunner::run with c_in).
//
// Precision: momentum and parameters fp32 (the momentum update rounds every multiply and add
// separately, so M matches optim::muon_matrix_step bit for bit); the Newton-Schulz iterates X,
// A and B are bf16 GEMM operands with fp32 accumulation, rounded once per GEMM
// (ops/cuda/gemm.h), the standard practice for Muon: the orthogonalized update differs from the
// fp32 CPU reference by about 2% in relative Frobenius norm (tests/ops/cuda/muon_cuda_test.cc).
//
// Expert stacks run as batched GEMMs (batch = E). Deterministic: fixed grids and fixed-order
// reductions. Nothing here synchronizes the host. A non-finite device gradient scale (the clip
// coefficient that grad_norm.h writes as NaN for a non-finite gradient norm) makes the step a
// no-op: param, momentum and param_bf16 are left as they were (adamw.h does the same).
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/cuda/common.h"
#include "ops/cuda/gemm.h"
#include "optim/muon.h"
#include "optim/param_groups.h"

namespace keel::ops::cuda::muon {

// Device workspace bytes matrix_step() needs for `matrices` rows x cols matrices (two bf16
// iterates [E, rows, cols], two bf16 [E, s, s] Gram buffers, reduction partials).
std::size_t workspace_bytes(std::int64_t matrices, std::int64_t rows, std::int64_t cols);
// The largest workspace_bytes() over the Muon parameters of `layout` (0 when there are none).
std::size_t workspace_bytes(const optim::ParamLayout& layout);

// One Muon step on `matrices` consecutive rows x cols fp32 matrices (param, grad, momentum:
// matrices * rows * cols floats each, device). lr: already times the group's lr_scale; decay:
// whether wd = c.weight_decay applies. param_bf16 (optional) receives bf16 of the new
// parameters; update_out (optional, fp32, tests) receives k X. workspace: workspace_bytes()
// bytes, 256-byte aligned. Throws keel::Error before launching on bad extents, a non-finite or
// negative lr, a non-finite grad_scale, a null workspace or a config optim::validate rejects.
void matrix_step(float* param, const float* grad, float* momentum, bf16* param_bf16, std::int64_t matrices,
                 std::int64_t rows, std::int64_t cols, const optim::MuonConfig& c, double lr, bool decay,
                 float grad_scale, const float* device_grad_scale, void* workspace, GemmRunner& gemm,
                 cudaStream_t stream, float* update_out = nullptr);

// Tensor parallelism (parallel/tensor_parallel_muon_cuda.h) splits a step in three: on every
// rank's block of a matrix, block_momentum (the momentum update, and U written to u, exactly as
// matrix_step computes them); the whole matrix's U gathered to one rank, which orthogonalizes it
// (matrix_step with momentum 0 and no Nesterov, so M = U, on scratch, its update_out = k X); the
// blocks of k X back, and on every rank block_update: p = p (1 - lr wd) - lr kX (wd when
// decay), param_bf16 = bf16(p) (optional). n elements each, device; the device clip coefficient
// skips both like matrix_step when it is not finite.
void block_momentum(const float* grad, float* momentum, float* u, std::int64_t n, const optim::MuonConfig& c,
                    float grad_scale, const float* device_grad_scale, cudaStream_t stream);
void block_update(float* param, bf16* param_bf16, const float* kx, std::int64_t n, const optim::MuonConfig& c,
                  double lr, bool decay, float grad_scale, const float* device_grad_scale, cudaStream_t stream);

// optim::Muon on device buffers: every Muon parameter of `layout`, one matrix_step each, with
// lr * the parameter's lr_scale. params, grads, momentum (and params_bf16 when not null) are
// whole flat buffers indexed by the layout's offsets. AdamW parameters are not touched.
class DeviceMuon {
 public:
  explicit DeviceMuon(const optim::MuonConfig& c);

  void step(const optim::ParamLayout& layout, float* params, const float* grads, float* momentum, bf16* params_bf16,
            double lr, float grad_scale, const float* device_grad_scale, void* workspace, GemmRunner& gemm,
            cudaStream_t stream);

  const optim::MuonConfig& config() const { return c_; }

 private:
  optim::MuonConfig c_;
};

}  // namespace keel::ops::cuda::muon
