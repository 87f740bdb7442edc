// Warp-level building blocks of the tensor-core kernels (ops/cuda/attention.cu,
// ops/cuda/linear_attention*.cu): shared-memory addresses, cp.async, ldmatrix and the bf16 MMA.
// Included only from .cu files.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, c = lane % 4), which the helpers rely on:
//   A 16x16 (row major)  a0: (g, 2c..2c+1)  a1: (g+8, 2c..)  a2: (g, 2c+8..)  a3: (g+8, 2c+8..)
//   B 16x8  (k x n)      b0: (k 2c..2c+1, n g)               b1: (k 2c+8..2c+9, n g)
//   C 16x8  (fp32)       c0, c1: (g, 2c..2c+1)               c2, c3: (g+8, 2c..2c+1)
// ldmatrix.x4 hands lane l the (l/4, 2(l%4)..) pair of each of four 8x8 matrices whose row
// addresses lanes 8i..8i+7 supply; .trans hands the transposed pair. The load_* helpers choose
// those row addresses so that one ldmatrix yields a whole A fragment, or the B fragments of two
// adjacent 8-column n-tiles, from a row-major tile in shared memory. Each 32-bit register holds
// two bf16 values, the lower column (k) in the low half.
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"

namespace keel::ops::cuda::mma_frag {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; bytes == 0 zero-fills the destination (rows past the sequence end).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4(std::uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

__device__ __forceinline__ void ldsm_x4_trans(std::uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// A fragment (rows m0..m0+15, k k0..k0+15) of a tile stored [m][k] with row stride `ld`.
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], const bf16* s, int ld, int m0, int k0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4(a, s + (m0 + (i & 1) * 8 + r) * ld + k0 + (i >> 1) * 8);
}

// A fragment of the transpose of a tile stored [k][m] (A[m][k] = stored[k][m]).
__device__ __forceinline__ void load_a_trans(std::uint32_t (&a)[4], const bf16* s, int ld, int m0, int k0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4_trans(a, s + (k0 + (i >> 1) * 8 + r) * ld + m0 + (i & 1) * 8);
}

// B fragments of n-tiles n0 and n0+8 (k k0..k0+15) of B[k][n] = stored[n][k] (e.g. K for q.k):
// b = {b0(n0), b1(n0), b0(n0+8), b1(n0+8)}.
__device__ __forceinline__ void load_b_nk(std::uint32_t (&b)[4], const bf16* s, int ld, int n0, int k0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4(b, s + (n0 + (i >> 1) * 8 + r) * ld + k0 + (i & 1) * 8);
}

// The same for B[k][n] = stored[k][n] (e.g. V for p.v).
__device__ __forceinline__ void load_b_kn(std::uint32_t (&b)[4], const bf16* s, int ld, int n0, int k0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4_trans(b, s + (k0 + (i & 1) * 8 + r) * ld + n0 + (i >> 1) * 8);
}

// d += a * b (16x8x16, bf16 in, fp32 accumulate).
__device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half: the lower column
  return *reinterpret_cast<std::uint32_t*>(&v);
}

// The A fragment (k-step kk) made of the fp32 accumulators of n-tiles 2kk and 2kk+1: how a
// probability tile computed by one MMA feeds the next MMA without leaving registers.
__device__ __forceinline__ void acc_to_a(std::uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

}  // namespace keel::ops::cuda::mma_frag
