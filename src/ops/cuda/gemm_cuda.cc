#include "ops/cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/error.h"
#include "ops/cuda/cast.h"

namespace keel::ops::cuda {

namespace {

const char* out_name(GemmOut t) { return t == GemmOut::kFp32 ? "fp32" : "bf16"; }

std::string describe(const GemmDesc& d) {
  return fmt::format("m={} n={} k={} trans_a={} trans_b={} lda={} ldb={} ldc={} batch={} out={}", d.m, d.n, d.k,
                     d.trans_a ? 1 : 0, d.trans_b ? 1 : 0, d.lda, d.ldb, d.ldc, d.batch, out_name(d.c_type));
}

void lt_check(cublasStatus_t status, const char* call, const GemmDesc& d) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt {} failed for GEMM {}: {}", call, describe(d), cublasLtGetStatusString(status));
}

// Largest power of two (capped at 256, all cuBLASLt asks about) dividing the address of every
// batch entry: the pointer and, with batch > 1, each stride step.
std::uint32_t alignment_of(const void* p, std::int64_t stride_elements, std::size_t element_bytes, int batch) {
  std::uint64_t bits = reinterpret_cast<std::uintptr_t>(p);
  if (batch > 1) bits |= static_cast<std::uint64_t>(stride_elements) * element_bytes;
  if (bits == 0) return 256;
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(bits & (~bits + 1), 256));
}

// The extent an algorithm is chosen for: m and k rounded up to a quarter of their power of two
// (at least 128). MoE expert GEMMs see a new row count (m, or k for the weight gradient) almost
// every step; asking cuBLASLt's heuristic for each would cost more than the GEMM. Each exact
// shape still gets its own layouts, and the bucket's algorithm is only used once
// cublasLtMatmulAlgoCheck accepts it for that shape.
std::int64_t bucket_extent(std::int64_t x) {
  if (x <= 128) return 128;
  std::int64_t p = 1;
  while (p * 2 <= x) p *= 2;
  const std::int64_t step = std::max<std::int64_t>(128, p / 4);
  return (x + step - 1) / step * step;
}

// Everything the cached plan depends on. The layouts carry extents, leading dimensions and
// batch strides; the algorithm also depends on operand alignment.
using PlanKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool, std::int64_t, std::int64_t,
                           std::int64_t, int, std::int64_t, std::int64_t, std::int64_t, GemmOut, std::uint32_t,
                           std::uint32_t, std::uint32_t>;

// The shapes that share an algorithm choice: bucketed m and k, n, transposes, batch, output
// type and operand alignment.
using AlgoKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool, int, GemmOut, std::uint32_t,
                           std::uint32_t, std::uint32_t>;

// One GEMM's cuBLASLt descriptors and the chosen algorithm, kept for the runner's lifetime.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A (our B), B (our A), C = D
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
};

void set_batch(cublasLtMatrixLayout_t layout, int batch, std::int64_t stride, const GemmDesc& d) {
  if (batch <= 1) return;
  const std::int32_t count = batch;
  lt_check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
           "MatrixLayoutSetAttribute(BATCH_COUNT)", d);
  lt_check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                            sizeof(stride)),
           "MatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)", d);
}

// Fills the tight leading dimensions and rejects descriptors cuBLASLt would misread.
GemmDesc checked(const GemmDesc& in) {
  GemmDesc d = in;
  if (d.m < 0 || d.n < 0 || d.k < 0) fail("GEMM {}: extents must be >= 0", describe(d));
  if (d.batch < 1) fail("GEMM {}: batch must be >= 1", describe(d));
  // Stored row lengths: A is [m, k] or [k, m], B is [k, n] or [n, k], C is [m, n].
  const std::int64_t a_row = d.trans_a ? d.m : d.k, b_row = d.trans_b ? d.k : d.n, c_row = d.n;
  if (d.lda == 0) d.lda = std::max<std::int64_t>(a_row, 1);
  if (d.ldb == 0) d.ldb = std::max<std::int64_t>(b_row, 1);
  if (d.ldc == 0) d.ldc = std::max<std::int64_t>(c_row, 1);
  if (d.lda < a_row || d.ldb < b_row || d.ldc < c_row)
    fail("GEMM {}: a leading dimension is shorter than its stored row (A row {}, B row {}, C row {})", describe(d),
         a_row, b_row, c_row);
  if (d.batch > 1) {
    if (d.stride_a < 0 || d.stride_b < 0 || d.stride_c < 0)
      fail("GEMM {}: batch strides must be >= 0 (got {}, {}, {})", describe(d), d.stride_a, d.stride_b, d.stride_c);
    // Inputs may be shared across the batch (stride 0); outputs must not overlap: either each
    // output lies wholly past the previous one, or the outputs sit side by side within the
    // rows (column blocks of one matrix, as per-head outputs of a grouped layer do).
    const bool disjoint_blocks = d.stride_c >= (d.m - 1) * d.ldc + d.n;
    const bool side_by_side = d.stride_c >= d.n && (d.batch - 1) * d.stride_c + d.n <= d.ldc;
    if (d.m > 0 && d.n > 0 && !disjoint_blocks && !side_by_side)
      fail("GEMM {}: stride_c {} makes the batch's outputs overlap", describe(d), d.stride_c);
  }
  return d;
}

}  // namespace

struct GemmRunner::Impl {
  int device = 0;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::map<AlgoKey, cublasLtMatmulHeuristicResult_t> algos;  // per bucketed shape

  ~Impl() {
    // Destructors must not throw; at process exit the runtime may already be gone, so statuses
    // are ignored here.
    plans.clear();
    if (lt) cublasLtDestroy(lt);
    if (workspace) cudaFree(workspace);
  }

  // cuBLASLt's first heuristic choice for the plan's exact layouts.
  cublasLtMatmulHeuristicResult_t heuristic(const Plan& p, const GemmDesc& d, std::uint32_t align_a,
                                            std::uint32_t align_b, std::uint32_t align_c) {
    cublasLtMatmulPreference_t pref = nullptr;
    lt_check(cublasLtMatmulPreferenceCreate(&pref), "MatmulPreferenceCreate", d);
    const std::uint64_t ws = workspace_bytes;
    // cuBLASLt's A/B/C are our B/A/C; D is C.
    const std::uint32_t lt_align_a = align_b, lt_align_b = align_a;
    cublasStatus_t status =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &lt_align_a,
                                                    sizeof(lt_align_a));
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &lt_align_b,
                                                    sizeof(lt_align_b));
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                    sizeof(align_c));
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                                    sizeof(align_c));
    cublasLtMatmulHeuristicResult_t found{};
    int returned = 0;
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulAlgoGetHeuristic(lt, p.op, p.a, p.b, p.c, p.c, pref, 1, &found, &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    lt_check(status, "MatmulAlgoGetHeuristic", d);
    if (returned == 0)
      fail("cuBLASLt has no algorithm for GEMM {} (operand alignment A {} B {} C {} bytes)", describe(d), align_a,
           align_b, align_c);
    return found;
  }

  const Plan& plan_for(const GemmDesc& d, const bf16* a, const bf16* b, const void* c_in, const void* c) {
    const std::size_t c_bytes = d.c_type == GemmOut::kFp32 ? sizeof(float) : sizeof(bf16);
    const std::uint32_t align_a = alignment_of(a, d.stride_a, sizeof(bf16), d.batch);
    const std::uint32_t align_b = alignment_of(b, d.stride_b, sizeof(bf16), d.batch);
    // C and D share one layout and one algorithm: the alignment both allow.
    const std::uint32_t align_c =
        std::min(alignment_of(c, d.stride_c, c_bytes, d.batch), alignment_of(c_in, d.stride_c, c_bytes, d.batch));
    const PlanKey key{d.m, d.n, d.k, d.trans_a, d.trans_b, d.lda, d.ldb, d.ldc, d.batch,
                      d.batch > 1 ? d.stride_a : 0, d.batch > 1 ? d.stride_b : 0, d.batch > 1 ? d.stride_c : 0,
                      d.c_type, align_a, align_b, align_c};
    if (auto it = plans.find(key); it != plans.end()) return *it->second;

    auto p = std::make_unique<Plan>();
    const cudaDataType_t c_type = d.c_type == GemmOut::kFp32 ? CUDA_R_32F : CUDA_R_16BF;
    lt_check(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate", d);
    // Column-major view of the row-major problem: C^T [n x m] = op(B)^T [n x k] op(A)^T [k x m],
    // so cuBLASLt's A is our B and its B is our A, each keeping its own transpose flag.
    const cublasOperation_t op_a = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    lt_check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)),
             "MatmulDescSetAttribute(TRANSA)", d);
    lt_check(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)),
             "MatmulDescSetAttribute(TRANSB)", d);
    // Our B stored [k, n] is column-major n x k; stored [n, k] (trans_b) it is k x n.
    lt_check(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, d.trans_b ? d.k : d.n, d.trans_b ? d.n : d.k, d.ldb),
             "MatrixLayoutCreate(B)", d);
    // Our A stored [m, k] is column-major k x m; stored [k, m] (trans_a) it is m x k.
    lt_check(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, d.trans_a ? d.m : d.k, d.trans_a ? d.k : d.m, d.lda),
             "MatrixLayoutCreate(A)", d);
    lt_check(cublasLtMatrixLayoutCreate(&p->c, c_type, d.n, d.m, d.ldc), "MatrixLayoutCreate(C)", d);
    set_batch(p->a, d.batch, d.stride_b, d);
    set_batch(p->b, d.batch, d.stride_a, d);
    set_batch(p->c, d.batch, d.stride_c, d);

    // The algorithm: the one the bucket's first shape got, when cuBLASLt accepts it for this
    // exact shape; otherwise the heuristic's first choice for the exact shape.
    const AlgoKey akey{bucket_extent(d.m), d.n, bucket_extent(d.k), d.trans_a, d.trans_b, d.batch, d.c_type,
                       align_a, align_b, align_c};
    cublasLtMatmulHeuristicResult_t found{};
    bool have = false;
    if (auto it = algos.find(akey); it != algos.end()) {
      found = it->second;
      cublasLtMatmulHeuristicResult_t checked_result{};
      if (cublasLtMatmulAlgoCheck(lt, p->op, p->a, p->b, p->c, p->c, &found.algo, &checked_result) ==
              CUBLAS_STATUS_SUCCESS &&
          checked_result.workspaceSize <= workspace_bytes) {
        found.workspaceSize = checked_result.workspaceSize;
        have = true;
      }
    }
    if (!have) {
      found = heuristic(*p, d, align_a, align_b, align_c);
      algos.emplace(akey, found);
    }
    p->algo = found.algo;
    p->workspace = found.workspaceSize;
    return *plans.emplace(key, std::move(p)).first->second;
  }
};

GemmRunner::GemmRunner(std::size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  KEEL_CUDA_CHECK(cudaGetDevice(&impl_->device));
  const cublasStatus_t status = cublasLtCreate(&impl_->lt);
  if (status != CUBLAS_STATUS_SUCCESS) fail("cublasLtCreate failed: {}", cublasLtGetStatusString(status));
  impl_->workspace_bytes = workspace_bytes;
  if (workspace_bytes > 0) KEEL_CUDA_CHECK(cudaMalloc(&impl_->workspace, workspace_bytes));
}

GemmRunner::~GemmRunner() = default;

std::size_t GemmRunner::cached_plans() const { return impl_->plans.size(); }
std::size_t GemmRunner::cached_algorithms() const { return impl_->algos.size(); }

void GemmRunner::run(const GemmDesc& desc, const bf16* a, const bf16* b, void* c, cudaStream_t stream) {
  run(desc, a, b, c, c, stream);
}

void GemmRunner::run(const GemmDesc& desc, const bf16* a, const bf16* b, const void* c_in, void* c,
                     cudaStream_t stream) {
  const GemmDesc d = checked(desc);
  if (d.m == 0 || d.n == 0) return;
  if (c == nullptr || c_in == nullptr) fail("GEMM {}: C is null", describe(d));
  if (c_in != c && d.k == 0) fail("GEMM {}: k == 0 with a separate C input is not supported", describe(d));
  int device = -1;
  KEEL_CUDA_CHECK(cudaGetDevice(&device));
  if (device != impl_->device)
    fail("GEMM {}: this GemmRunner belongs to device {} but device {} is current", describe(d), impl_->device, device);

  if (d.k == 0) {
    // An empty sum: C = beta * C. cuBLASLt does not take k == 0, and nothing needs A or B.
    if (d.beta == 1.f) return;
    const std::int64_t stride = d.batch > 1 ? d.stride_c : 0;
    if (d.c_type == GemmOut::kFp32)
      scale_matrix_f32(static_cast<float*>(c), d.m, d.n, d.ldc, d.batch, stride, d.beta, stream);
    else
      scale_matrix_bf16(static_cast<bf16*>(c), d.m, d.n, d.ldc, d.batch, stride, d.beta, stream);
    return;
  }
  if (a == nullptr || b == nullptr) fail("GEMM {}: A or B is null", describe(d));

  const Plan& p = impl_->plan_for(d, a, b, c_in, c);
  // With beta == 0 cuBLASLt does not read C (the BLAS convention), so stale NaNs there do not leak.
  const cublasStatus_t status = cublasLtMatmul(impl_->lt, p.op, &d.alpha, b, p.a, a, p.b, &d.beta, c_in, p.c, c,
                                               p.c, &p.algo, impl_->workspace, p.workspace, stream);
  lt_check(status, "Matmul", d);
}

GemmRunner& thread_gemm() { return for_thread_and_device<GemmRunner>(); }

}  // namespace keel::ops::cuda
