// Causal linear attention on the GPU: the output and backward kernels and the op's entry points
// (ops/cuda/linear_attention.h has the math and the work split; linear_attention_scan.cu the
// scans, linear_attention_pointwise.cu decode, the feature map and the norm).
#include "ops/cuda/linear_attention_common.cuh"

namespace keel::ops::cuda::linear_attention {

using namespace detail;  // linear_attention_common.cuh

namespace {

// ---------------------------------------------- forward outputs ----------------------------------------------
//
// One block per (chunk, run * Hkv + kv head), 4 warps of 16 query rows; K, V, S_c (bf16) of the
// chunk in shared memory, the group's query heads in turn. Per warp and head:
//   o  = Q S_c                       (fp32 accumulators)
//   o *= gamma^(i+1)                 (row i)
//   s  = Q K^T over keys <= its rows, masked and decayed (mask_decay), rounded to bf16 A fragments
//   o += s V;  out = bf16(o), staged through the warp's own rows of q_s for 16-byte stores.
template <int kD>
struct Out {
  static constexpr int kLd = kD + 8, kThreads = 128, kNt = kD / 8;
  static constexpr int kSmemBytes = (3 * kChunk + kD) * kLd * static_cast<int>(sizeof(bf16));
};

struct OutArgs {
  const bf16 *q, *k, *v;
  const bf16* states;  // [R * Hkv, NT, d, d]
  bf16* out;
  int Hq, Hkv, L, d, NT, group;
  bool vec;
};

// 16 rows of kD columns from shared memory (row stride ld) to a token-major matrix (one warp):
// rows >= rows_valid and columns >= d skipped.
template <int kD>
__device__ __forceinline__ void copy_rows_out(bf16* g, std::int64_t stride, const bf16* s, int ld, int rows_valid, int d,
                                              bool vec, int lane) {
  if (vec) {
    constexpr int kPieces = kD / 8;
    for (int e = lane; e < 16 * kPieces; e += 32) {
      const int r = e / kPieces, c8 = e % kPieces * 8;
      if (r < rows_valid) *reinterpret_cast<uint4*>(g + r * stride + c8) = *reinterpret_cast<const uint4*>(s + r * ld + c8);
    }
  } else {
    for (int e = lane; e < 16 * kD; e += 32) {
      const int r = e / kD, c = e % kD;
      if (r < rows_valid && c < d) g[r * stride + c] = s[r * ld + c];
    }
  }
}

template <int kD>
__global__ void __launch_bounds__(Out<kD>::kThreads) output_kernel(const OutArgs p, const Gammas gm) {
  using C = Out<kD>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* k_s = reinterpret_cast<bf16*>(smem_raw);
  bf16* v_s = k_s + kChunk * C::kLd;
  bf16* q_s = v_s + kChunk * C::kLd;
  bf16* s_s = q_s + kChunk * C::kLd;  // [kD][kLd]: S_c[a][b]
  __shared__ float pw[kChunk + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
  const int c = static_cast<int>(blockIdx.x), task = static_cast<int>(blockIdx.y), r = task / p.Hkv, g = task % p.Hkv;
  const int d = p.d, t0 = c * kChunk, n = min(kChunk, p.L - t0);
  const std::int64_t row0 = static_cast<std::int64_t>(r) * p.L + t0;
  const std::int64_t qs = static_cast<std::int64_t>(p.Hq) * d, ks = static_cast<std::int64_t>(p.Hkv) * d;
  const std::int64_t dd = static_cast<std::int64_t>(d) * d;

  load_tile<kChunk, kD>(k_s, C::kLd, p.k + row0 * ks + g * d, ks, n, d, p.vec, tid, C::kThreads);
  load_tile<kChunk, kD>(v_s, C::kLd, p.v + row0 * ks + g * d, ks, n, d, p.vec, tid, C::kThreads);
  load_tile<kD, kD>(s_s, C::kLd, p.states + (static_cast<std::int64_t>(task) * p.NT + c) * dd, d, d, d, p.vec, tid,
                    C::kThreads);
  load_tile<kChunk, kD>(q_s, C::kLd, p.q + row0 * qs + static_cast<std::int64_t>(g) * p.group * d, qs, n, d, p.vec,
                        tid, C::kThreads);
  cp_async_commit();
  for (int i = tid; i <= kChunk; i += C::kThreads) pw[i] = gpow(gm.lg[g], i);

  const int m0 = warp * 16, i0 = m0 + gq, i1 = i0 + 8;
  for (int hh = 0; hh < p.group; ++hh) {
    const std::int64_t h = static_cast<std::int64_t>(g) * p.group + hh;
    if (hh > 0) {
      __syncthreads();  // every warp has copied its staged rows of q_s out
      load_tile<kChunk, kD>(q_s, C::kLd, p.q + row0 * qs + h * d, qs, n, d, p.vec, tid, C::kThreads);
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();

    float o[C::kNt][4], s[8][4];
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][e] = 0.f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;

    // o = Q S_c and s = Q K^T (key tiles wholly above this warp's rows skipped), one pass over Q.
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      std::uint32_t qa[4];
      load_a(qa, q_s, C::kLd, m0, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < kD / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, s_s, C::kLd, np * 16, kk * 16, lane);  // B[k = a][n = b] = S[a][b]
        mma(o[2 * np], qa, bf[0], bf[1]);
        mma(o[2 * np + 1], qa, bf[2], bf[3]);
      }
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np > warp) continue;  // keys 16 np.. are all after this warp's rows
        std::uint32_t bf[4];
        load_b_nk(bf, k_s, C::kLd, np * 16, kk * 16, lane);  // B[k = a][n = j] = K[j][a]
        mma(s[2 * np], qa, bf[0], bf[1]);
        mma(s[2 * np + 1], qa, bf[2], bf[3]);
      }
    }
    const float w0 = pw[i0 + 1], w1 = pw[i1 + 1];
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt) {
      o[nt][0] *= w0;
      o[nt][1] *= w0;
      o[nt][2] *= w1;
      o[nt][3] *= w1;
    }
    mask_decay(s, i0, cq, pw);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (kk > warp) continue;  // all zeros
      std::uint32_t pa[4];
      acc_to_a(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < kD / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, v_s, C::kLd, np * 16, kk * 16, lane);  // B[k = j][n = b] = V[j][b]
        mma(o[2 * np], pa, bf[0], bf[1]);
        mma(o[2 * np + 1], pa, bf[2], bf[3]);
      }
    }

    // Stage the warp's 16 rows in its own rows of q_s (no other warp reads them), then store.
    __syncwarp();
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt) {
      const int col = nt * 8 + 2 * cq;
      *reinterpret_cast<std::uint32_t*>(q_s + i0 * C::kLd + col) = pack_bf16(o[nt][0], o[nt][1]);
      *reinterpret_cast<std::uint32_t*>(q_s + i1 * C::kLd + col) = pack_bf16(o[nt][2], o[nt][3]);
    }
    __syncwarp();
    copy_rows_out<kD>(p.out + (row0 + m0) * qs + h * d, qs, q_s + m0 * C::kLd, C::kLd, n - m0, d, p.vec, lane);
  }
}

// ---------------------------------------------- backward ----------------------------------------------
//
// One block per (chunk, run * Hkv + kv head); 4 row groups of 16 (rw) x kSplit column groups
// (cw) of warps. K, V, then Gk_c (later S_c) of the chunk in shared memory:
//   1. dk = gamma^(n-1-j) (V Gk^T)[j],  dv = gamma^(n-1-j) (K Gk)[j]     (accumulators, kept)
//   then per query head of the group (Q, dO in shared memory):
//   2. P~ = mask(Q K^T) gamma^(i-j), dP~ = mask(dO V^T) gamma^(i-j) to shared memory (bf16)
//   3. dq = gamma^(i+1) (dO S_c^T)[i] + (dP~ K)[i]                      (stored)
//   4. dk += dP~^T Q,  dv += P~^T dO
// and dk, dv stored after the last head.
template <int kD>
struct Bwd {
  static constexpr int kSplit = kD >= 32 ? 2 : 1;
  static constexpr int kWarps = 4 * kSplit, kThreads = 32 * kWarps;
  static constexpr int kCols = kD / kSplit, kNt = kCols / 8;  // per warp
  static constexpr int kLd = kD + 8, kPLd = kChunk + 8;
  static constexpr int kSmemBytes =
      ((4 * kChunk + kD) * kLd + 2 * kChunk * kPLd) * static_cast<int>(sizeof(bf16));
};

struct BwdArgs {
  const bf16 *q, *k, *v, *dout;
  const bf16* states;   // S_c [R * Hkv, NT, d, d]
  const bf16* gstates;  // Gk_c
  bf16 *dq, *dk, *dv;
  int Hq, Hkv, L, d, NT, group;
  bool vec;
};

template <int kD>
__global__ void __launch_bounds__(Bwd<kD>::kThreads) backward_kernel(const BwdArgs p, const Gammas gm) {
  using C = Bwd<kD>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* k_s = reinterpret_cast<bf16*>(smem_raw);
  bf16* v_s = k_s + kChunk * C::kLd;
  bf16* q_s = v_s + kChunk * C::kLd;
  bf16* do_s = q_s + kChunk * C::kLd;
  bf16* m_s = do_s + kChunk * C::kLd;  // [kD][kLd]: Gk_c, then S_c
  bf16* p_s = m_s + kD * C::kLd;       // [kChunk][kPLd]: P~
  bf16* dp_s = p_s + kChunk * C::kPLd; // dP~
  __shared__ float pw[kChunk + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
  const int rw = warp & 3, cw = warp >> 2, m0 = rw * 16, n_base = cw * C::kCols;
  const int i0 = m0 + gq, i1 = i0 + 8;
  const int c = static_cast<int>(blockIdx.x), task = static_cast<int>(blockIdx.y), r = task / p.Hkv, g = task % p.Hkv;
  const int d = p.d, t0 = c * kChunk, n = min(kChunk, p.L - t0);
  const std::int64_t row0 = static_cast<std::int64_t>(r) * p.L + t0;
  const std::int64_t qs = static_cast<std::int64_t>(p.Hq) * d, ks = static_cast<std::int64_t>(p.Hkv) * d;
  const std::int64_t st_off = (static_cast<std::int64_t>(task) * p.NT + c) * d * d;

  load_tile<kChunk, kD>(k_s, C::kLd, p.k + row0 * ks + g * d, ks, n, d, p.vec, tid, C::kThreads);
  load_tile<kChunk, kD>(v_s, C::kLd, p.v + row0 * ks + g * d, ks, n, d, p.vec, tid, C::kThreads);
  load_tile<kD, kD>(m_s, C::kLd, p.gstates + st_off, d, d, d, p.vec, tid, C::kThreads);
  cp_async_commit();
  for (int i = tid; i <= kChunk; i += C::kThreads) pw[i] = gpow(gm.lg[g], i);
  cp_async_wait<0>();
  __syncthreads();

  // 1. The state path: this warp's rows j of dk, dv, columns n_base..n_base + kCols.
  float dk[C::kNt][4], dv[C::kNt][4];
#pragma unroll
  for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[nt][e] = dv[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    std::uint32_t va[4], ka[4];
    load_a(va, v_s, C::kLd, m0, kk * 16, lane);  // A[j][k = b] = V[j][b]
    load_a(ka, k_s, C::kLd, m0, kk * 16, lane);  // A[j][k = a] = K[j][a]
#pragma unroll
    for (int np = 0; np < C::kCols / 16; ++np) {
      std::uint32_t bf[4];
      load_b_nk(bf, m_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = b][n = a] = Gk[a][b]
      mma(dk[2 * np], va, bf[0], bf[1]);
      mma(dk[2 * np + 1], va, bf[2], bf[3]);
      load_b_kn(bf, m_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = a][n = b] = Gk[a][b]
      mma(dv[2 * np], ka, bf[0], bf[1]);
      mma(dv[2 * np + 1], ka, bf[2], bf[3]);
    }
  }
  {
    const float w0 = i0 < n ? pw[n - 1 - i0] : 0.f, w1 = i1 < n ? pw[n - 1 - i1] : 0.f;
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt) {
      dk[nt][0] *= w0;
      dk[nt][1] *= w0;
      dk[nt][2] *= w1;
      dk[nt][3] *= w1;
      dv[nt][0] *= w0;
      dv[nt][1] *= w0;
      dv[nt][2] *= w1;
      dv[nt][3] *= w1;
    }
  }
  __syncthreads();  // everyone is done with Gk_c

  load_tile<kD, kD>(m_s, C::kLd, p.states + st_off, d, d, d, p.vec, tid, C::kThreads);
  for (int hh = 0; hh < p.group; ++hh) {
    const std::int64_t h = static_cast<std::int64_t>(g) * p.group + hh;
    load_tile<kChunk, kD>(q_s, C::kLd, p.q + row0 * qs + h * d, qs, n, d, p.vec, tid, C::kThreads);
    load_tile<kChunk, kD>(do_s, C::kLd, p.dout + row0 * qs + h * d, qs, n, d, p.vec, tid, C::kThreads);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // 2. P~ (which 0) and dP~ (which 1): rows i of this row group, all 64 keys (zeros above the
    // diagonal written too: steps 3 and 4 read whole k-steps).
    for (int which = cw; which < 2; which += C::kSplit) {
      const bf16* am = which ? do_s : q_s;
      const bf16* bm = which ? v_s : k_s;
      bf16* pm = which ? dp_s : p_s;
      float s[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        std::uint32_t a[4];
        load_a(a, am, C::kLd, m0, kk * 16, lane);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (np > rw) continue;
          std::uint32_t bf[4];
          load_b_nk(bf, bm, C::kLd, np * 16, kk * 16, lane);  // B[k][n = j] = K[j][k] (or V)
          mma(s[2 * np], a, bf[0], bf[1]);
          mma(s[2 * np + 1], a, bf[2], bf[3]);
        }
      }
      mask_decay(s, i0, cq, pw);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int col = nt * 8 + 2 * cq;
        *reinterpret_cast<std::uint32_t*>(pm + i0 * C::kPLd + col) = pack_bf16(s[nt][0], s[nt][1]);
        *reinterpret_cast<std::uint32_t*>(pm + i1 * C::kPLd + col) = pack_bf16(s[nt][2], s[nt][3]);
      }
    }
    __syncthreads();

    // 3. dq of this head: rows i, columns n_base..
    {
      float dq[C::kNt][4];
#pragma unroll
      for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        std::uint32_t a[4];
        load_a(a, do_s, C::kLd, m0, kk * 16, lane);  // A[i][k = b] = dO[i][b]
#pragma unroll
        for (int np = 0; np < C::kCols / 16; ++np) {
          std::uint32_t bf[4];
          load_b_nk(bf, m_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = b][n = a] = S[a][b]
          mma(dq[2 * np], a, bf[0], bf[1]);
          mma(dq[2 * np + 1], a, bf[2], bf[3]);
        }
      }
      const float w0 = pw[i0 + 1], w1 = pw[i1 + 1];
#pragma unroll
      for (int nt = 0; nt < C::kNt; ++nt) {
        dq[nt][0] *= w0;
        dq[nt][1] *= w0;
        dq[nt][2] *= w1;
        dq[nt][3] *= w1;
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if (kk > rw) continue;  // keys after this row group: dP~ is zero there
        std::uint32_t a[4];
        load_a(a, dp_s, C::kPLd, m0, kk * 16, lane);  // A[i][k = j] = dP~[i][j]
#pragma unroll
        for (int np = 0; np < C::kCols / 16; ++np) {
          std::uint32_t bf[4];
          load_b_kn(bf, k_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = j][n = a] = K[j][a]
          mma(dq[2 * np], a, bf[0], bf[1]);
          mma(dq[2 * np + 1], a, bf[2], bf[3]);
        }
      }
      store_acc(p.dq + row0 * qs + h * d, qs, dq, i0, n_base + 2 * cq, n, d, p.vec);
    }

    // 4. dk += dP~^T Q, dv += P~^T dO: rows j of this row group, queries i >= j.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if (kk < rw) continue;  // queries before this row group: zero
      std::uint32_t a_dp[4], a_p[4];
      load_a_trans(a_dp, dp_s, C::kPLd, m0, kk * 16, lane);  // A[j][k = i] = dP~[i][j]
      load_a_trans(a_p, p_s, C::kPLd, m0, kk * 16, lane);    // A[j][k = i] = P~[i][j]
#pragma unroll
      for (int np = 0; np < C::kCols / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, q_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = i][n = a] = Q[i][a]
        mma(dk[2 * np], a_dp, bf[0], bf[1]);
        mma(dk[2 * np + 1], a_dp, bf[2], bf[3]);
        load_b_kn(bf, do_s, C::kLd, n_base + np * 16, kk * 16, lane);  // B[k = i][n = b] = dO[i][b]
        mma(dv[2 * np], a_p, bf[0], bf[1]);
        mma(dv[2 * np + 1], a_p, bf[2], bf[3]);
      }
    }
    __syncthreads();  // before the next head's Q, dO and P~ overwrite these
  }
  store_acc(p.dk + row0 * ks + g * d, ks, dk, i0, n_base + 2 * cq, n, d, p.vec);
  store_acc(p.dv + row0 * ks + g * d, ks, dv, i0, n_base + 2 * cq, n, d, p.vec);
}

template <int kD>
void launch_output(const Dims& s, const OutArgs& a, const Gammas& gm, cudaStream_t stream) {
  using C = Out<kD>;
  KEEL_CUDA_CHECK(cudaFuncSetAttribute(output_kernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const dim3 grid(static_cast<unsigned>(s.NT), static_cast<unsigned>(s.R * s.Hkv));
  output_kernel<kD><<<grid, C::kThreads, C::kSmemBytes, stream>>>(a, gm);
  KEEL_CUDA_CHECK_LAUNCH();
}

template <int kD>
void launch_backward(const Dims& s, const BwdArgs& a, const Gammas& gm, cudaStream_t stream) {
  using C = Bwd<kD>;
  KEEL_CUDA_CHECK(
      cudaFuncSetAttribute(backward_kernel<kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const dim3 grid(static_cast<unsigned>(s.NT), static_cast<unsigned>(s.R * s.Hkv));
  backward_kernel<kD><<<grid, C::kThreads, C::kSmemBytes, stream>>>(a, gm);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace

std::size_t workspace_bytes(const Config& c, std::int64_t runs, std::int64_t len) {
  const Dims s = check(c, runs, len);
  return 2 * states_bytes(s) + segment_bytes(s);
}

void forward(const Config& c, std::int64_t runs, std::int64_t len, const bf16* q, const bf16* k, const bf16* v,
             const float* init, bf16* out, void* workspace, cudaStream_t stream) {
  const Dims s = check(c, runs, len);
  if (s.R == 0 || s.L == 0) return;
  check_workspace(workspace);
  const Gammas gm = gammas_of(c);
  bf16* states = static_cast<bf16*>(workspace);
  scan_states(s, k, v, init, states, segment_buffer(s, workspace), gm, stream);

  const int kD = padded(s.d);
  OutArgs oa{q, k, v, states, out, s.Hq, s.Hkv, s.L, s.d, s.NT, s.group,
             s.d == kD && aligned_to(q, 16) && aligned_to(k, 16) && aligned_to(v, 16) && aligned_to(out, 16)};
  switch (kD) {
    case 16: launch_output<16>(s, oa, gm, stream); break;
    case 32: launch_output<32>(s, oa, gm, stream); break;
    case 64: launch_output<64>(s, oa, gm, stream); break;
    default: launch_output<128>(s, oa, gm, stream); break;
  }
}

void backward(const Config& c, std::int64_t runs, std::int64_t len, const bf16* q, const bf16* k, const bf16* v,
              const float* init, const bf16* dout, const float* dlocal, bf16* dq, bf16* dk, bf16* dv, float* dinit,
              void* workspace, cudaStream_t stream) {
  const Dims s = check(c, runs, len);
  if (s.R == 0) return;
  if (s.L == 0) {  // no tokens: the initial state reaches nothing
    if (dinit)
      KEEL_CUDA_CHECK(cudaMemsetAsync(dinit, 0, sizeof(float) * s.R * s.Hkv * s.d * s.d, stream));
    return;
  }
  check_workspace(workspace);
  const Gammas gm = gammas_of(c);
  bf16* states = static_cast<bf16*>(workspace);
  bf16* gstates = reinterpret_cast<bf16*>(static_cast<unsigned char*>(workspace) + states_bytes(s));

  float* seg_buf = segment_buffer(s, workspace);
  scan_states(s, k, v, init, states, seg_buf, gm, stream);                  // S_c, as forward
  scan_gradients(s, q, dout, dlocal, gstates, dinit, seg_buf, gm, stream);  // Gk_c and dinit

  const int kD = padded(s.d);
  BwdArgs ba{q, k, v, dout, states, gstates, dq, dk, dv, s.Hq, s.Hkv, s.L, s.d, s.NT, s.group,
             s.d == kD && aligned_to(q, 16) && aligned_to(k, 16) && aligned_to(v, 16) && aligned_to(dout, 16) &&
                 aligned_to(dq, 16) && aligned_to(dk, 16) && aligned_to(dv, 16)};
  switch (kD) {
    case 16: launch_backward<16>(s, ba, gm, stream); break;
    case 32: launch_backward<32>(s, ba, gm, stream); break;
    case 64: launch_backward<64>(s, ba, gm, stream); break;
    default: launch_backward<128>(s, ba, gm, stream); break;
  }
}

void local_states(const Config& c, std::int64_t runs, std::int64_t len, const bf16* k, const bf16* v, float* states,
                  cudaStream_t stream) {
  const Dims s = check(c, runs, len);
  if (s.R == 0) return;
  if (s.L == 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(states, 0, sizeof(float) * s.R * s.Hkv * s.d * s.d, stream));
    return;
  }
  scan_local(s, k, v, states, gammas_of(c), stream);
}

void init_gradient(const Config& c, std::int64_t runs, std::int64_t len, const bf16* q, const bf16* dout, float* dinit,
                   cudaStream_t stream) {
  const Dims s = check(c, runs, len);
  if (s.R == 0) return;
  if (s.L == 0) {
    KEEL_CUDA_CHECK(cudaMemsetAsync(dinit, 0, sizeof(float) * s.R * s.Hkv * s.d * s.d, stream));
    return;
  }
  scan_init_gradient(s, q, dout, dinit, gammas_of(c), stream);
}

}  // namespace keel::ops::cuda::linear_attention
