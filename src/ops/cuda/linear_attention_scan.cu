// Causal linear attention on the GPU: the scans over chunks (ops/cuda/linear_attention.h has the
// math and the work split; linear_attention_common.cuh the shared pieces).
#include "ops/cuda/linear_attention_common.cuh"

namespace keel::ops::cuda::linear_attention::detail {

// ---------------------------------------------- the scan over chunks ----------------------------------------------
//
// One block per (kT x kT tile of the d x d state, segment of a run, run * Hkv + kv head); warps
// of 16 state rows. A segment is `seg` consecutive chunks of a run (all of them when the run is
// one segment). The tile lives in fp32 MMA accumulators through the segment's chunks, in order
// (or reversed), from the segment's initial tile (init, or zeros):
//   at a chunk's first pair: store the tile (+ gamma^(L - t1) extra) to states[chunk] in bf16,
//                            then tile *= gamma^n
//   for each of `pairs` (A, B) pairs: tile += A~^T B   (A~ row i = w_i a_i, 64 tokens of the chunk)
// and the final tile goes to final_state in fp32. Without a final_state the segment's last chunk
// is only stored (its MMAs would feed nothing). Forward states: A = K, B = V of kv head g,
// w_j = gamma^(n-1-j), in order (S_c, the state before chunk c). Backward: A = Q, B = dO of the
// group's query heads, w_i = gamma^(i+1), reversed (Gk_c, the gradient of the state after chunk c).
// Tiles of A and B stream through kStages cp.async stages; the decay weights are applied to the
// A fragments in registers. kExtra: the `extra` tile is held in registers (the one-segment scan;
// the segmented scan folds it into the segments' initial tiles instead, see scan_gradients).
template <int kT, bool kExtra>
struct Scan {
  static constexpr int kWarps = kT / 16, kThreads = kWarps * 32, kLd = kT + 8, kNt = kT / 8;
  static constexpr int kTile = kChunk * kLd;  // one stage of A or B (elements)
  static constexpr int kSmemBytes = 2 * kStages * kTile * static_cast<int>(sizeof(bf16));
  // Blocks per SM the registers must allow (128: two of 104 KB shared memory, 64: four of 54 KB).
  static constexpr int kMinBlocks = kT == 128 ? 2 : kT == 64 ? 4 : 8;
};

struct ScanArgs {
  const bf16* a;             // token-major [R * L, a_stride]; pair p of kv head g reads head g * pairs + p
  const bf16* b;             // the same, b_stride
  std::int64_t a_stride, b_stride;
  const float* init;         // [R * Hkv, NS, d, d] each segment's starting tile, or null (zeros)
  const float* extra;        // [R * Hkv, d, d] added to the stored states times gamma^(L - t1), or null (kExtra)
  bf16* states;              // [R * Hkv, NT, d, d], or null (not stored)
  float* final_state;        // [R * Hkv, NS, d, d] each segment's end tile, or null
  int Hkv, L, d, NT, seg, NS, pairs;  // seg: chunks per segment, NS: segments per run
  bool reverse, vec;
  bool f2;                   // init, extra, final_state in 8-byte column pairs (d even, 8-byte aligned)
};

template <int kT, bool kExtra>
__global__ void __launch_bounds__(Scan<kT, kExtra>::kThreads, Scan<kT, kExtra>::kMinBlocks)
    scan_kernel(const ScanArgs p, const Gammas gm) {
  using C = Scan<kT, kExtra>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* a_s = reinterpret_cast<bf16*>(smem_raw);  // [kStages][kChunk][kLd]
  bf16* b_s = a_s + kStages * C::kTile;
  __shared__ float pw[kChunk + 1];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, cq = lane & 3;
  const int d = p.d, tiles = (d + kT - 1) / kT, tile = static_cast<int>(blockIdx.x) % (tiles * tiles);
  const int sg = static_cast<int>(blockIdx.x) / (tiles * tiles);
  const int a0 = tile / tiles * kT, b0 = tile % tiles * kT;
  const int task = static_cast<int>(blockIdx.y), r = task / p.Hkv, g = task % p.Hkv;
  const int c_first = sg * p.seg, nc = min(p.NT, c_first + p.seg) - c_first;  // this segment's chunks
  const float lg = gm.lg[g];
  const bool decay = lg != 0.f;
  for (int i = tid; i <= kChunk; i += C::kThreads) pw[i] = gpow(lg, i);

  // This thread's tile elements: state rows ra (acc[nt][0..1]) and ra + 8 ([2..3]), columns
  // cb + 8 nt and cb + 8 nt + 1.
  const int ra = a0 + warp * 16 + gq, cb = b0 + 2 * cq;
  const std::int64_t dd = static_cast<std::int64_t>(d) * d, base = task * dd;
  const std::int64_t seg_base = (static_cast<std::int64_t>(task) * p.NS + sg) * dd;
  // Columns col, col + 1 of row `row` of a d x d fp32 tile t (null: zeros), zeros outside.
  auto load_pair = [&](const float* t, int row, int col, float& x0, float& x1) {
    x0 = x1 = 0.f;
    if (!t || row >= d || col >= d) return;
    const float* q = t + row * d + col;
    if (p.f2) {
      const float2 v = *reinterpret_cast<const float2*>(q);
      x0 = v.x;
      x1 = v.y;
    } else {
      x0 = q[0];
      if (col + 1 < d) x1 = q[1];
    }
  };
  float acc[C::kNt][4], ex[kExtra ? C::kNt : 1][4];
#pragma unroll
  for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = ra + 8 * half, col = cb + 8 * nt;
      load_pair(p.init ? p.init + seg_base : nullptr, row, col, acc[nt][2 * half], acc[nt][2 * half + 1]);
      if constexpr (kExtra)
        load_pair(p.extra ? p.extra + base : nullptr, row, col, ex[nt][2 * half], ex[nt][2 * half + 1]);
    }

  const std::int64_t row0 = static_cast<std::int64_t>(r) * p.L;
  const int total = (p.final_state ? nc : nc - 1) * p.pairs;  // load-and-MMA steps
  const int a_cols = min(kT, d - a0), b_cols = min(kT, d - b0);
  auto chunk_of = [&](int s) {
    const int i = s / p.pairs;
    return p.reverse ? c_first + nc - 1 - i : c_first + i;
  };
  auto issue = [&](int s) {
    const int c = chunk_of(s), head = g * p.pairs + s % p.pairs;
    const int t0 = c * kChunk, n = min(kChunk, p.L - t0);
    const std::int64_t row = row0 + t0, col = static_cast<std::int64_t>(head) * d;
    load_tile<kChunk, kT>(a_s + (s % kStages) * C::kTile, C::kLd, p.a + row * p.a_stride + col + a0, p.a_stride, n,
                          a_cols, p.vec, tid, C::kThreads);
    load_tile<kChunk, kT>(b_s + (s % kStages) * C::kTile, C::kLd, p.b + row * p.b_stride + col + b0, p.b_stride, n,
                          b_cols, p.vec, tid, C::kThreads);
  };
  // The tile (+ gamma^(L - t1) extra) as chunk c's stored state, bf16.
  auto store_state = [&](int c) {
    const int t1 = min(p.L, (c + 1) * kChunk);
    float wx = 0.f;
    if constexpr (kExtra) wx = p.extra ? gpow(lg, p.L - t1) : 0.f;
    bf16* st = p.states + (static_cast<std::int64_t>(task) * p.NT + c) * dd;
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = ra + 8 * half, col = cb + 8 * nt;
        if (row >= d) continue;
        float v0 = acc[nt][2 * half], v1 = acc[nt][2 * half + 1];
        if constexpr (kExtra) {
          v0 += wx * ex[nt][2 * half];
          v1 += wx * ex[nt][2 * half + 1];
        }
        bf16* q = st + static_cast<std::int64_t>(row) * d + col;
        if (p.vec) {
          *reinterpret_cast<std::uint32_t*>(q) = pack_bf16(v0, v1);
        } else {
          if (col < d) q[0] = __float2bfloat16(v0);
          if (col + 1 < d) q[1] = __float2bfloat16(v1);
        }
      }
  };

  for (int s = 0; s < kStages - 1; ++s) {
    if (s < total) issue(s);
    cp_async_commit();
  }
  for (int s = 0; s < total; ++s) {
    cp_async_wait<kStages - 2>();  // step s's tiles have landed (this thread's copies) ...
    __syncthreads();               // ... everyone's; and everyone is done with step s - 1's stage
    if (s + kStages - 1 < total) issue(s + kStages - 1);  // into step s - 1's stage
    cp_async_commit();

    const int c = chunk_of(s);
    const int n = min(kChunk, p.L - c * kChunk);
    if (s % p.pairs == 0) {
      if (p.states) store_state(c);
      if (decay) {
        const float dn = pw[n];
#pragma unroll
        for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] *= dn;
      }
    }

    const bf16* as = a_s + (s % kStages) * C::kTile;
    const bf16* bs = b_s + (s % kStages) * C::kTile;
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      std::uint32_t af[4];
      load_a_trans(af, as, C::kLd, warp * 16, kk * 16, lane);  // A[m = state row][k = token] = a_s[token][row]
      if (decay) {
        // a0, a1 hold tokens i, i + 1; a2, a3 tokens i + 8, i + 9 (i = 16 kk + 2c).
        float w[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int i = kk * 16 + 2 * cq + (u & 1) + (u >> 1) * 8;
          w[u] = p.reverse ? pw[i + 1] : (i < n ? pw[n - 1 - i] : 0.f);
        }
        af[0] = scale_pair(af[0], w[0], w[1]);
        af[1] = scale_pair(af[1], w[0], w[1]);
        af[2] = scale_pair(af[2], w[2], w[3]);
        af[3] = scale_pair(af[3], w[2], w[3]);
      }
#pragma unroll
      for (int np = 0; np < kT / 16; ++np) {
        std::uint32_t bf[4];
        load_b_kn(bf, bs, C::kLd, np * 16, kk * 16, lane);  // B[k = token][n = state column]
        mma(acc[2 * np], af, bf[0], bf[1]);
        mma(acc[2 * np + 1], af, bf[2], bf[3]);
      }
    }
  }
  cp_async_wait<0>();

  if (p.final_state) {
#pragma unroll
    for (int nt = 0; nt < C::kNt; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = ra + 8 * half, col = cb + 8 * nt;
        if (row >= d || col >= d) continue;
        float* q = p.final_state + seg_base + row * d + col;
        if (p.f2) {
          *reinterpret_cast<float2*>(q) = make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]);
        } else {
          q[0] = acc[nt][2 * half];
          if (col + 1 < d) q[1] = acc[nt][2 * half + 1];
        }
      }
  } else if (p.states && nc > 0) {
    store_state(chunk_of((nc - 1) * p.pairs));  // the segment's last chunk: the tile as it stands
  }
}

// The segmented scan's middle phase: each segment's starting tile from the segments' own sums
// M_s (a scan from zeros over the segment), over the segments of a run in order (reversed):
//   x = start (null: zeros);  for each segment s: x_s = x, stored over M_s;  x = gamma^(len_s) x + M_s
// with len_s the segment's tokens. One thread per kV consecutive elements of a (run, kv head)'s
// d x d state (kV = 4: float4 loads and stores); the loads of 8 segments are issued ahead.
template <int kV>
__device__ __forceinline__ void load_v(float (&x)[kV], const float* p) {
  if constexpr (kV == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    x[0] = t.x;
    x[1] = t.y;
    x[2] = t.z;
    x[3] = t.w;
  } else {
    x[0] = *p;
  }
}
template <int kV>
__device__ __forceinline__ void store_v(float* p, const float (&x)[kV]) {
  if constexpr (kV == 4)
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
  else
    *p = x[0];
}

template <int kV>
__global__ void segment_prefix_kernel(float* __restrict__ buf, const float* __restrict__ start, std::int64_t n,
                                      int Hkv, int dd, int NS, int seg_tokens, int L, bool reverse, const Gammas gm) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int per = dd / kV;
  const std::int64_t task = i / per;
  const int e = static_cast<int>(i % per) * kV, g = static_cast<int>(task % Hkv);
  const float lg = gm.lg[g];
  const float w_full = gpow(lg, seg_tokens), w_last = gpow(lg, L - (NS - 1) * seg_tokens);
  float x[kV];
  if (start) {
    load_v(x, start + task * dd + e);
  } else {
#pragma unroll
    for (int u = 0; u < kV; ++u) x[u] = 0.f;
  }
  float* row = buf + task * NS * dd + e;
  for (int j0 = 0; j0 < NS; j0 += 8) {
    float m[8][kV];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int j = j0 + u, sgi = reverse ? NS - 1 - j : j;
      if (j < NS) load_v(m[u], row + static_cast<std::int64_t>(sgi) * dd);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int j = j0 + u, sgi = reverse ? NS - 1 - j : j;
      if (j < NS) {
        store_v(row + static_cast<std::int64_t>(sgi) * dd, x);
        const float w = sgi == NS - 1 ? w_last : w_full;
#pragma unroll
        for (int t = 0; t < kV; ++t) x[t] = w * x[t] + m[u][t];
      }
    }
  }
}

// ---- the scans ----
//
// A run of many chunks is scanned in segments of `seg` consecutive chunks, all in parallel, in
// three launches (the segmented scan), instead of one block walking all its chunks:
//   1. each segment's own sum M_s from zeros (scan_kernel over every segment at once, its
//      final_state the segment buffer; no states);
//   2. segment_prefix_kernel: each segment's starting state from the M_s, in place;
//   3. scan_kernel over every segment again from those starting states, storing the chunks'
//      states (the segment's last chunk only stored: nothing reads the state after it).
// Phases 1 and 3 take one block per (segment, run, kv head) holding the whole padded d x d state
// (tile padded(d), d / 16 warps). The chunks per segment aim at about kSegBlocks blocks per phase
// (R * Hkv * NS), within [kSegMin, kSegMax]; a run that is one segment (NS = 1) takes the single
// scan: one block per (32 x 32 tile of the state, run, kv head; 16 x 16 for d < 32) walking all
// its chunks. local_states and init_gradient (and backward's dinit) always take the single scan:
// they have no workspace for the segment buffer.
constexpr int kSegBlocks = 1024, kSegMin = 4, kSegMax = 32;

struct Segments {
  int seg, NS;  // chunks per segment, segments per run
};

Segments segments_of(const Dims& s) {
  const std::int64_t want = (static_cast<std::int64_t>(s.NT) * s.R * s.Hkv + kSegBlocks - 1) / kSegBlocks;
  const int seg = static_cast<int>(std::min<std::int64_t>(kSegMax, std::max<std::int64_t>(kSegMin, want)));
  return {seg, (s.NT + seg - 1) / seg};
}

// The segment buffer [R, Hkv, NS, d, d] fp32 of the segmented scan, sized for an upper bound of
// R * NS that never decreases as R or NT grow (so neither does workspace_bytes, as before: a
// workspace sized for longer or more runs serves shorter or fewer): R * NS <= R * NT / seg + R,
// and R * NT / seg <= min(R NT / kSegMin, max(R NT / kSegMax, kSegBlocks / Hkv)) whatever seg
// segments_of picks. Runs of at most kSegMin chunks are one segment whatever R: no buffer.
std::size_t segment_bytes(const Dims& s) {
  if (s.NT <= kSegMin) return 0;
  auto ceil_div = [](std::int64_t a, std::int64_t b) { return (a + b - 1) / b; };
  const std::int64_t rn = static_cast<std::int64_t>(s.R) * s.NT;
  const std::int64_t bound =
      std::min(ceil_div(rn, kSegMin), std::max(ceil_div(rn, kSegMax), ceil_div(kSegBlocks, s.Hkv))) + s.R;
  return round_up(sizeof(float) * static_cast<std::size_t>(bound) * s.Hkv * s.d * s.d);
}

// The segment buffer in the workspace, after S_c and Gk_c; null for the single scan (one segment).
float* segment_buffer(const Dims& s, void* workspace) {
  if (segments_of(s).NS < 2) return nullptr;
  return reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + 2 * states_bytes(s));
}


template <int kT, bool kExtra>
void launch_scan_tiles(ScanArgs a, int tasks, const Gammas& gm, cudaStream_t stream) {
  using C = Scan<kT, kExtra>;
  a.f2 = a.d % 2 == 0 && aligned_to(a.init, 8) && aligned_to(a.extra, 8) && aligned_to(a.final_state, 8);
  if (C::kSmemBytes > 48 * 1024)
    KEEL_CUDA_CHECK(
        cudaFuncSetAttribute(scan_kernel<kT, kExtra>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  const int tiles = (a.d + kT - 1) / kT;
  const dim3 grid(static_cast<unsigned>(tiles * tiles * a.NS), static_cast<unsigned>(tasks));
  scan_kernel<kT, kExtra><<<grid, C::kThreads, C::kSmemBytes, stream>>>(a, gm);
  KEEL_CUDA_CHECK_LAUNCH();
}

ScanArgs scan_args(const Dims& s, const bf16* a, const bf16* b, std::int64_t stride, int pairs, bool reverse) {
  ScanArgs p{};
  p.a = a;
  p.b = b;
  p.a_stride = p.b_stride = stride;
  p.Hkv = s.Hkv;
  p.L = s.L;
  p.d = s.d;
  p.NT = s.NT;
  p.pairs = pairs;
  p.reverse = reverse;
  p.vec = aligned_to(a, 16) && aligned_to(b, 16);
  return p;
}

// The single scan: each run one segment; vec where the tiles are whole and aligned.
void single_scan(const Dims& s, ScanArgs a, const Gammas& gm, cudaStream_t stream) {
  a.seg = s.NT;
  a.NS = 1;
  const int kT = s.d >= 32 ? 32 : 16;
  a.vec = a.vec && s.d % kT == 0;
  if (kT == 32)
    launch_scan_tiles<32, true>(a, s.R * s.Hkv, gm, stream);
  else
    launch_scan_tiles<16, true>(a, s.R * s.Hkv, gm, stream);
}

// One phase (1 or 3) of the segmented scan: a block per (segment, run, kv head), the whole state.
void segment_scan(const Dims& s, ScanArgs a, const Segments& sg, const Gammas& gm, cudaStream_t stream) {
  a.seg = sg.seg;
  a.NS = sg.NS;
  a.extra = nullptr;
  const int kT = padded(s.d);
  a.vec = a.vec && s.d == kT;
  const int tasks = s.R * s.Hkv;
  switch (kT) {
    case 16: launch_scan_tiles<16, false>(a, tasks, gm, stream); break;
    case 32: launch_scan_tiles<32, false>(a, tasks, gm, stream); break;
    case 64: launch_scan_tiles<64, false>(a, tasks, gm, stream); break;
    default: launch_scan_tiles<128, false>(a, tasks, gm, stream); break;
  }
}

// The segmented scan of a (states stored, no final state) from `start` (null: zeros) at the
// run's beginning (in order) or end (reversed), through the segment buffer seg_buf.
void segmented_scan(const Dims& s, const ScanArgs& a, const float* start, float* seg_buf, const Gammas& gm,
                    cudaStream_t stream) {
  const Segments sg = segments_of(s);
  ScanArgs own = a;  // 1. the segments' own sums
  own.init = nullptr;
  own.states = nullptr;
  own.final_state = seg_buf;
  segment_scan(s, own, sg, gm, stream);

  const int dd = s.d * s.d;  // 2. their starting states
  const bool vec = dd % 4 == 0 && (!start || aligned_to(start, 16));
  const std::int64_t n = static_cast<std::int64_t>(s.R) * s.Hkv * dd / (vec ? 4 : 1);
  const int seg_tokens = sg.seg * kChunk;
  if (vec)
    segment_prefix_kernel<4><<<grid_for(n, 256), 256, 0, stream>>>(seg_buf, start, n, s.Hkv, dd, sg.NS, seg_tokens,
                                                                     s.L, a.reverse, gm);
  else
    segment_prefix_kernel<1><<<grid_for(n, 256), 256, 0, stream>>>(seg_buf, start, n, s.Hkv, dd, sg.NS, seg_tokens,
                                                                     s.L, a.reverse, gm);
  KEEL_CUDA_CHECK_LAUNCH();

  ScanArgs from = a;  // 3. the chunks' states from them
  from.init = seg_buf;
  from.final_state = nullptr;
  segment_scan(s, from, sg, gm, stream);
}

// S_c (bf16, the state before each chunk) of the runs from init (null: zeros): A = K, B = V, in
// order. seg_buf: the segmented scan's buffer, null for the single scan.
void scan_states(const Dims& s, const bf16* k, const bf16* v, const float* init, bf16* states, float* seg_buf,
                 const Gammas& gm, cudaStream_t stream) {
  ScanArgs a = scan_args(s, k, v, static_cast<std::int64_t>(s.Hkv) * s.d, 1, false);
  a.states = states;
  if (seg_buf) {
    segmented_scan(s, a, init, seg_buf, gm, stream);
  } else {
    a.init = init;
    single_scan(s, a, gm, stream);
  }
}

// Each run's end state from zeros (fp32): the single scan with no states.
void scan_local(const Dims& s, const bf16* k, const bf16* v, float* final_state, const Gammas& gm,
                cudaStream_t stream) {
  ScanArgs a = scan_args(s, k, v, static_cast<std::int64_t>(s.Hkv) * s.d, 1, false);
  a.final_state = final_state;
  single_scan(s, a, gm, stream);
}

// dinit = G_{-1} (fp32) alone: the reverse single scan over A = Q, B = dO with no states (the
// code of init_gradient, and of backward's dinit whichever scan gives its Gk_c).
void scan_init_gradient(const Dims& s, const bf16* q, const bf16* dout, float* dinit, const Gammas& gm,
                        cudaStream_t stream) {
  ScanArgs a = scan_args(s, q, dout, static_cast<std::int64_t>(s.Hq) * s.d, s.group, true);
  a.final_state = dinit;
  single_scan(s, a, gm, stream);
}

// Gk_c = G_c + gamma^(L - t1) dlocal (bf16) and dinit = G_{-1} (fp32; null: none): A = Q, B = dO
// over the group's query heads, chunks last first. The single scan adds dlocal's term to the
// stored states and gives dinit in the same pass (the same bits as scan_init_gradient: the
// stored states do not touch the accumulators); the segmented one starts from dlocal at the runs'
// ends (gamma^(L - t1) is exactly the decay from there) and leaves dinit to scan_init_gradient.
void scan_gradients(const Dims& s, const bf16* q, const bf16* dout, const float* dlocal, bf16* gstates, float* dinit,
                    float* seg_buf, const Gammas& gm, cudaStream_t stream) {
  ScanArgs a = scan_args(s, q, dout, static_cast<std::int64_t>(s.Hq) * s.d, s.group, true);
  a.states = gstates;
  if (seg_buf) {
    segmented_scan(s, a, dlocal, seg_buf, gm, stream);
    if (dinit) scan_init_gradient(s, q, dout, dinit, gm, stream);
  } else {
    a.extra = dlocal;
    a.final_state = dinit;
    single_scan(s, a, gm, stream);
  }
}

}  // namespace keel::ops::cuda::linear_attention::detail
