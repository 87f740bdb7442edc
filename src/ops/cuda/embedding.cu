#include "ops/cuda/embedding.h"

#include "common/error.h"

namespace keel::ops::cuda::embedding {

namespace {

constexpr int kThreads = 128;
constexpr std::int64_t kMaxBlocks = 1 << 20;  // blocks loop over tokens beyond this

__device__ inline void record_bad_id(unsigned long long* bad_id, std::int64_t pos, std::uint32_t id) {
  if (bad_id) atomicMin(bad_id, (static_cast<unsigned long long>(pos) << 32) | id);
}

__device__ inline float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ inline float4 load4(const bf16* p) {
  const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(p);
  const float2 a = __bfloat1622float2(q[0]), b = __bfloat1622float2(q[1]);
  return make_float4(a.x, a.y, b.x, b.y);
}

// The table's rows: ids [begin, begin + rows) of a vocabulary of `vocab` ids (the whole table:
// begin 0, rows = vocab). Row r of the table is id begin + r.
struct Rows {
  std::int64_t begin, rows, vocab;
};

// One block per token (looping when n exceeds the grid); kVec: rows are float4-addressable.
// Ids >= vocab are bad (recorded, zero row); valid ids outside the table's rows get a zero row.
template <typename T, bool kVec>
__global__ void forward_kernel(const std::uint32_t* ids, std::int64_t n, const T* table, float* out, Rows rows,
                               std::int64_t dim, unsigned long long* bad_id) {
  for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const std::uint32_t id = ids[i];
    float* dst = out + i * dim;
    const std::int64_t r = static_cast<std::int64_t>(id) - rows.begin;
    if (id >= rows.vocab || r < 0 || r >= rows.rows) {
      if (id >= rows.vocab && threadIdx.x == 0) record_bad_id(bad_id, i, id);
      for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = 0.f;
      continue;
    }
    const T* src = table + r * dim;
    if constexpr (kVec) {
      for (std::int64_t j = threadIdx.x; j < dim / 4; j += blockDim.x)
        reinterpret_cast<float4*>(dst)[j] = load4(src + 4 * j);
    } else {
      for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = static_cast<float>(src[j]);
    }
  }
}

// Ids >= vocab are bad (recorded, skipped); valid ids outside the table's rows are skipped.
__global__ void backward_kernel(const std::uint32_t* ids, std::int64_t n, const float* dout, float* dtable, Rows rows,
                                std::int64_t dim, unsigned long long* bad_id) {
  for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const std::uint32_t id = ids[i];
    if (id >= rows.vocab) {
      if (threadIdx.x == 0) record_bad_id(bad_id, i, id);
      continue;
    }
    const std::int64_t r = static_cast<std::int64_t>(id) - rows.begin;
    if (r < 0 || r >= rows.rows) continue;
    const float* src = dout + i * dim;
    float* dst = dtable + r * dim;
    for (std::int64_t j = threadIdx.x; j < dim; j += blockDim.x) atomicAdd(dst + j, src[j]);
  }
}

__global__ void reset_kernel(unsigned long long* bad_id) { *bad_id = kNoBadId; }

void check_args(std::int64_t n, std::int64_t vocab, std::int64_t dim, const char* what) {
  if (n < 0 || vocab <= 0 || dim <= 0)
    fail("embedding {}: need n >= 0, vocab > 0 and dim > 0, got n {}, vocab {}, dim {}", what, n, vocab, dim);
  if (n >= (std::int64_t{1} << 32)) fail("embedding {}: n {} must be below 2^32", what, n);
}

// A slice of the vocabulary: rows [begin, begin + rows) inside [0, vocab) (rows may be 0).
Rows check_slice(std::int64_t n, std::int64_t begin, std::int64_t rows, std::int64_t vocab, std::int64_t dim,
                 const char* what) {
  check_args(n, vocab, dim, what);
  if (begin < 0 || rows < 0 || begin + rows > vocab)
    fail("embedding {}: rows [{}, {}) are not a slice of the vocabulary of {}", what, begin, begin + rows, vocab);
  return {begin, rows, vocab};
}


unsigned blocks_for_tokens(std::int64_t n) { return static_cast<unsigned>(n < kMaxBlocks ? n : kMaxBlocks); }

template <typename T>
void launch_forward(const std::uint32_t* ids, std::int64_t n, const T* table, float* out, const Rows& rows,
                    std::int64_t dim, cudaStream_t stream, unsigned long long* bad_id, bool vec) {
  if (n == 0) return;
  const unsigned grid = blocks_for_tokens(n);
  if (vec)
    forward_kernel<T, true><<<grid, kThreads, 0, stream>>>(ids, n, table, out, rows, dim, bad_id);
  else
    forward_kernel<T, false><<<grid, kThreads, 0, stream>>>(ids, n, table, out, rows, dim, bad_id);
  KEEL_CUDA_CHECK_LAUNCH();
}

void launch_backward(const std::uint32_t* ids, std::int64_t n, const float* dout, float* dtable, const Rows& rows,
                     std::int64_t dim, cudaStream_t stream, unsigned long long* bad_id) {
  if (n == 0) return;
  backward_kernel<<<blocks_for_tokens(n), kThreads, 0, stream>>>(ids, n, dout, dtable, rows, dim, bad_id);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void reset_bad_id(unsigned long long* bad_id, cudaStream_t stream) {
  reset_kernel<<<1, 1, 0, stream>>>(bad_id);
  KEEL_CUDA_CHECK_LAUNCH();
}

void throw_if_bad_id(const unsigned long long* bad_id, std::int64_t vocab, cudaStream_t stream) {
  unsigned long long v = kNoBadId;
  KEEL_CUDA_CHECK(cudaMemcpyAsync(&v, bad_id, sizeof v, cudaMemcpyDeviceToHost, stream));
  KEEL_CUDA_CHECK(keel::stream_sync(stream));
  if (v != kNoBadId)
    fail("embedding: token id {} at position {} is outside the vocabulary of {}", static_cast<std::uint32_t>(v),
         v >> 32, vocab);
}

void forward(const std::uint32_t* ids, std::int64_t n, const float* table, float* out, std::int64_t vocab,
             std::int64_t dim, cudaStream_t stream, unsigned long long* bad_id) {
  check_args(n, vocab, dim, "forward");
  launch_forward(ids, n, table, out, Rows{0, vocab, vocab}, dim, stream, bad_id,
                 dim % 4 == 0 && aligned_to(table, 16) && aligned_to(out, 16));
}

void forward_bf16_table(const std::uint32_t* ids, std::int64_t n, const bf16* table, float* out, std::int64_t vocab,
                        std::int64_t dim, cudaStream_t stream, unsigned long long* bad_id) {
  check_args(n, vocab, dim, "forward");
  launch_forward(ids, n, table, out, Rows{0, vocab, vocab}, dim, stream, bad_id,
                 dim % 4 == 0 && aligned_to(table, 8) && aligned_to(out, 16));
}

void forward_bf16_table_slice(const std::uint32_t* ids, std::int64_t n, const bf16* table_local, float* out,
                              std::int64_t vocab_begin, std::int64_t vocab_local, std::int64_t vocab, std::int64_t dim,
                              cudaStream_t stream, unsigned long long* bad_id) {
  const Rows rows = check_slice(n, vocab_begin, vocab_local, vocab, dim, "slice forward");
  launch_forward(ids, n, table_local, out, rows, dim, stream, bad_id,
                 dim % 4 == 0 && aligned_to(table_local, 8) && aligned_to(out, 16));
}

void backward(const std::uint32_t* ids, std::int64_t n, const float* dout, float* dtable, std::int64_t vocab,
              std::int64_t dim, cudaStream_t stream, unsigned long long* bad_id) {
  check_args(n, vocab, dim, "backward");
  launch_backward(ids, n, dout, dtable, Rows{0, vocab, vocab}, dim, stream, bad_id);
}

void backward_slice(const std::uint32_t* ids, std::int64_t n, const float* dout, float* dtable_local,
                    std::int64_t vocab_begin, std::int64_t vocab_local, std::int64_t vocab, std::int64_t dim,
                    cudaStream_t stream, unsigned long long* bad_id) {
  const Rows rows = check_slice(n, vocab_begin, vocab_local, vocab, dim, "slice backward");
  launch_backward(ids, n, dout, dtable_local, rows, dim, stream, bad_id);
}

}  // namespace keel::ops::cuda::embedding
