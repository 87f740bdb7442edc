#include "ops/cuda/moe.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>

#include "common/error.h"
#include "ops/cuda/gemm.h"
#include "ops/kernel_settings.h"

namespace keel::ops::cuda::moe {

namespace {

constexpr int kPlanThreads = 1024;  // one block: count + scan; one block per expert: scatter
constexpr int kMaxExperts = 8192;   // the count kernel keeps E int32 counters in shared memory
constexpr int kRowThreads = 128;    // one block per token or slot row
constexpr int kElemThreads = 256;

// offsets[0..E] = exclusive prefix sum of the loads; offsets[E + 1] = slots whose expert index
// is outside [0, E) (make_plan reports them).
// The slots to plan: `slots`, or *device_tokens x top_k when the tokens are counted on the device.
__device__ std::int64_t planned_slots(std::int64_t slots, const std::int32_t* device_tokens, int top_k) {
  if (!device_tokens) return slots;
  const std::int64_t s = std::int64_t(*device_tokens) * top_k;
  return s < 0 ? 0 : (s < slots ? s : slots);
}

__global__ void plan_count_kernel(const std::int32_t* __restrict__ expert_idx, std::int64_t max_slots,
                                  const std::int32_t* __restrict__ device_tokens, int top_k, int experts,
                                  std::int32_t* __restrict__ offsets) {
  extern __shared__ int load[];
  __shared__ int bad;
  const std::int64_t slots = planned_slots(max_slots, device_tokens, top_k);
  for (int e = threadIdx.x; e < experts; e += blockDim.x) load[e] = 0;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (std::int64_t a = threadIdx.x; a < slots; a += blockDim.x) {
    const int e = expert_idx[a];
    if (e < 0 || e >= experts) atomicAdd(&bad, 1);
    else atomicAdd(&load[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // E is small: a serial scan is a few microseconds at most
    int run = 0;
    for (int e = 0; e < experts; ++e) {
      offsets[e] = run;
      run += load[e];
    }
    offsets[experts] = run;
    offsets[experts + 1] = bad;
  }
}

// Block e walks the slots in increasing a, kPlanThreads at a time, and gives its matches
// consecutive rows from offsets[e]: a stable counting sort, identical to the CPU plan.
__global__ void plan_scatter_kernel(const std::int32_t* __restrict__ expert_idx, std::int64_t max_slots,
                                    const std::int32_t* __restrict__ device_tokens, int top_k,
                                    const std::int32_t* __restrict__ offsets, std::int32_t* __restrict__ source,
                                    std::int32_t* __restrict__ position) {
  __shared__ int warp_hits[kPlanThreads / 32];
  const std::int64_t slots = planned_slots(max_slots, device_tokens, top_k);
  const int e = blockIdx.x;
  const int base = offsets[e], load = offsets[e + 1] - base;
  if (load == 0) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int done = 0;  // rows of e assigned so far (uniform over the block)
  for (std::int64_t start = 0; start < slots && done < load; start += kPlanThreads) {
    const std::int64_t a = start + threadIdx.x;
    const bool hit = a < slots && expert_idx[a] == e;
    const unsigned mask = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_hits[warp] = __popc(mask);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kPlanThreads / 32; ++w) {
      const int h = warp_hits[w];
      before += w < warp ? h : 0;
      total += h;
    }
    if (hit) {
      const int slot = base + done + before + __popc(mask & ((1u << lane) - 1u));
      source[slot] = static_cast<std::int32_t>(a);
      position[a] = slot;
    }
    done += total;
    __syncthreads();  // warp_hits is rewritten by the next round
  }
}

// The row of x / y / dy / dx of planned token n (Plan::rows).
__device__ inline std::int64_t token_row(const std::int32_t* __restrict__ rows, std::int64_t n) {
  return rows ? rows[n] : n;
}

// xs[slot] = x[row(source[slot] / top_k)]. kVec: d % 8 == 0 and both pointers 16-byte aligned.
template <bool kVec>
__global__ void gather_kernel(const bf16* __restrict__ x, const std::int32_t* __restrict__ source,
                              const std::int32_t* __restrict__ rows, int top_k, std::int64_t d,
                              bf16* __restrict__ xs) {
  const std::int64_t slot = blockIdx.x;
  const bf16* src = x + token_row(rows, source[slot] / top_k) * d;
  bf16* dst = xs + slot * d;
  if constexpr (kVec) {
    for (std::int64_t j = threadIdx.x; j < d / 8; j += blockDim.x)
      reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(src)[j];
  } else {
    for (std::int64_t j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
  }
}

__device__ inline float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

__global__ void swiglu_forward_kernel(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                      bf16* __restrict__ act, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(gate[i]);
    act[i] = __float2bfloat16(g * sigmoid(g) * __bfloat162float(up[i]));
  }
}

// dh_up = dact * silu(g); dh_gate = dact * up * silu'(g), silu'(g) = s (1 + g (1 - s)).
__global__ void swiglu_backward_kernel(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                       const float* __restrict__ dact, bf16* __restrict__ dgate,
                                       bf16* __restrict__ dup, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(gate[i]), u = __bfloat162float(up[i]), d = dact[i], s = sigmoid(g);
    dup[i] = __float2bfloat16(d * g * s);
    dgate[i] = __float2bfloat16(d * u * s * (1.f + g * (1.f - s)));
  }
}

// The row kernels below take kVec = 8 columns per thread access (d % 8 == 0 and every pointer
// 16-byte aligned: 16-byte bf16 and 2 x 16-byte fp32 accesses) or 1. Each element's sum over k
// runs in k order (the CPU order) either way: the same bits. (dgates' dot products are summed
// over the columns in another order by the two.)
template <int kVec>
__device__ inline void load_cols(const bf16* p, float* v) {
  if constexpr (kVec == 8) load_bf16<8>(p, v);
  else v[0] = __bfloat162float(*p);
}
template <int kVec>
__device__ inline void load_cols(const float* p, float* v) {
  if constexpr (kVec == 8) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    v[0] = *p;
  }
}
template <int kVec>
__device__ inline void store_cols(bf16* p, const float* v) {
  if constexpr (kVec == 8) store_bf16<8>(p, v);
  else *p = __float2bfloat16(v[0]);
}
template <int kVec>
__device__ inline void store_cols(float* p, const float* v) {
  if constexpr (kVec == 8) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    *p = v[0];
  }
}

// out[row(n)] = sum_k g_k src[position[n k + k]] in fp32, k in order (the CPU order), with g_k =
// gates[n, k] (combine: src the experts' bf16 outputs) or 1 (gates null: the input gradient
// from the slots' fp32 dxs, bf16 or fp32 out).
template <int kVec, typename In, typename Out>
__global__ void sum_slots_kernel(const In* __restrict__ src, const float* __restrict__ gates,
                                 const std::int32_t* __restrict__ position, const std::int32_t* __restrict__ rows,
                                 int top_k, std::int64_t d, Out* __restrict__ out) {
  const std::int64_t n = blockIdx.x;
  Out* outr = out + token_row(rows, n) * d;
  for (std::int64_t c = threadIdx.x * kVec; c < d; c += blockDim.x * kVec) {
    float acc[kVec], v[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.f;
    for (int k = 0; k < top_k; ++k) {
      load_cols<kVec>(src + static_cast<std::int64_t>(position[n * top_k + k]) * d + c, v);
      if (gates) {
        const float g = gates[n * top_k + k];
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] += g * v[i];
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] += v[i];
      }
    }
    store_cols<kVec>(outr + c, acc);
  }
}

// dgates[n, k] = dy[row(n)] . ys[slot]; dys[slot] = gates[n, k] dy[row(n)] (bf16: a GEMM operand).
template <int kVec>
__global__ void combine_backward_kernel(const bf16* __restrict__ ys, const float* __restrict__ gates,
                                        const std::int32_t* __restrict__ position,
                                        const std::int32_t* __restrict__ rows, int top_k, std::int64_t d,
                                        const float* __restrict__ dy, bf16* __restrict__ dys,
                                        float* __restrict__ dgates) {
  const std::int64_t n = blockIdx.x;
  const float* dyr = dy + token_row(rows, n) * d;
  for (int k = 0; k < top_k; ++k) {
    const std::int64_t slot = position[n * top_k + k];
    const float g = gates[n * top_k + k];
    float dot = 0.f;
    for (std::int64_t c = threadIdx.x * kVec; c < d; c += blockDim.x * kVec) {
      float v[kVec], u[kVec];
      load_cols<kVec>(dyr + c, v);
      load_cols<kVec>(ys + slot * d + c, u);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        dot += v[i] * u[i];
        v[i] *= g;
      }
      store_cols<kVec>(dys + slot * d + c, v);
    }
    if (dgates) {  // uniform branch: every thread takes part in the block reduction
      dot = block_sum_all<kRowThreads>(dot);
      if (threadIdx.x == 0) dgates[n * top_k + k] = dot;
    }
  }
}

// Whether d and every pointer allow the 8-column accesses.
bool vec8(std::int64_t d, std::initializer_list<const void*> ptrs) {
  if (d % 8 != 0) return false;
  for (const void* p : ptrs)
    if (!aligned_to(p, 16)) return false;
  return true;
}

unsigned elem_grid(std::int64_t n) {
  const std::int64_t cap = 132 * 16;  // grid-stride: a few waves on an H100 are enough
  const std::int64_t g = (n + kElemThreads - 1) / kElemThreads;
  return static_cast<unsigned>(g < 1 ? 1 : (g > cap ? cap : g));
}

std::int64_t align_up(std::int64_t bytes) { return (bytes + 255) / 256 * 256; }

void check_plan(const Plan& p, std::int64_t d, std::int64_t f) {
  if (p.top_k < 1 || p.experts < 1 || p.tokens < 0) fail("cuda moe: the plan is empty or invalid (make_plan makes one)");
  if (static_cast<std::int64_t>(p.host_offsets.size()) != p.experts + 1)
    fail("cuda moe: plan has {} host offsets for {} experts", p.host_offsets.size(), p.experts);
  if (d < 1 || f < 1) fail("cuda moe: model width {} and expert width {} must be >= 1", d, f);
}

GemmDesc desc(std::int64_t m, std::int64_t n, std::int64_t k, bool trans_a, bool trans_b, GemmOut out, float beta) {
  GemmDesc g;
  g.m = m, g.n = n, g.k = k;
  g.trans_a = trans_a, g.trans_b = trans_b;
  g.c_type = out;
  g.beta = beta;
  return g;
}

// The experts' GEMMs side by side. One expert's GEMMs are small (balanced top-1 routing of
// 8,192 tokens over 16 experts gives each ~512 rows: 64-128 tiles, under one wave of an H200's
// 132 SMs), so run one after another they leave much of the GPU idle. Each expert's chain
// (GEMMs and its SwiGLU rows) runs on one of kLanes side streams forked from and joined back to
// the caller's stream, each lane with its own cuBLASLt runner (a workspace may not be shared by
// concurrent GEMMs). Experts own disjoint rows and disjoint weight-gradient blocks, so the
// lanes never write the same memory and the results do not depend on how they interleave.
// ops::set_moe_lanes (kernels.moe_lanes of keel train's config, 1..kLanes) uses fewer: 1 runs
// the experts one after another on the caller's stream.
constexpr int kLanes = 8;
constexpr int kDefaultLanes = 4;
std::atomic<int> g_lanes{kDefaultLanes};

int lanes_wanted() { return g_lanes.load(std::memory_order_relaxed); }

// Up to kLanes streams, each with its own cuBLASLt runner (and its 32 MiB workspace), made the
// first time a call uses that many.
class ExpertLanes {
 public:
  ExpertLanes() { KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&start_, cudaEventDisableTiming)); }
  ~ExpertLanes() {  // at thread exit, possibly after the CUDA runtime: errors are ignored
    for (int i = 0; i < count_; ++i) {
      if (done_[i]) cudaEventDestroy(done_[i]);
      if (streams_[i]) cudaStreamDestroy(streams_[i]);
    }
    if (start_) cudaEventDestroy(start_);
  }
  ExpertLanes(const ExpertLanes&) = delete;
  ExpertLanes& operator=(const ExpertLanes&) = delete;

  // The lanes of the calling thread's current device.
  static ExpertLanes& for_thread() { return for_thread_and_device<ExpertLanes>(); }

  // Lanes 0..used-1 start after the work queued on `stream` so far.
  void fork(cudaStream_t stream, int used) {
    for (; count_ < used; ++count_) {
      KEEL_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[count_], cudaStreamNonBlocking));
      KEEL_CUDA_CHECK(cudaEventCreateWithFlags(&done_[count_], cudaEventDisableTiming));
      gemms_[count_] = std::make_unique<GemmRunner>();
    }
    KEEL_CUDA_CHECK(cudaEventRecord(start_, stream));
    for (int i = 0; i < used; ++i) KEEL_CUDA_CHECK(cudaStreamWaitEvent(streams_[i], start_, 0));
  }
  // Work queued on `stream` after this waits for lanes 0..used-1.
  void join(cudaStream_t stream, int used) {
    for (int i = 0; i < used; ++i) {
      KEEL_CUDA_CHECK(cudaEventRecord(done_[i], streams_[i]));
      KEEL_CUDA_CHECK(cudaStreamWaitEvent(stream, done_[i], 0));
    }
  }
  cudaStream_t stream(int i) const { return streams_[i]; }
  GemmRunner& gemm(int i) { return *gemms_[i]; }

 private:
  int count_ = 0;  // lanes made so far
  std::array<cudaStream_t, kLanes> streams_{};
  std::array<cudaEvent_t, kLanes> done_{};
  std::array<std::unique_ptr<GemmRunner>, kLanes> gemms_;
  cudaEvent_t start_ = nullptr;
};

// Where each expert with rows runs: lane[e] in [0, used), or -1 for none. Largest experts first,
// each to the lane with the fewest rows so far (ties to the lower lane): deterministic, and the
// lanes finish close together. used = 0 when no expert has rows; 1 lane means the caller's
// stream (no fork).
struct LaneAssignment {
  std::vector<int> lane;
  int used = 0;
};

LaneAssignment assign_lanes(const std::vector<std::int64_t>& offsets) {
  const int experts = static_cast<int>(offsets.size()) - 1;
  LaneAssignment a;
  a.lane.assign(static_cast<std::size_t>(experts), -1);
  std::vector<int> order;
  for (int e = 0; e < experts; ++e)
    if (offsets[e + 1] > offsets[e]) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    return offsets[x + 1] - offsets[x] > offsets[y + 1] - offsets[y];
  });
  a.used = std::min<int>(lanes_wanted(), static_cast<int>(order.size()));
  std::array<std::int64_t, kLanes> rows{};
  for (int e : order) {
    int best = 0;
    for (int i = 1; i < a.used; ++i)
      if (rows[i] < rows[best]) best = i;
    a.lane[static_cast<std::size_t>(e)] = best;
    rows[best] += offsets[e + 1] - offsets[e];
  }
  return a;
}

// Runs body(e, gemm, stream) for every expert with rows, on its lane (or on `stream` with the
// thread's runner when one expert has rows), forking and joining around it.
template <class Body>
void for_each_expert(const std::vector<std::int64_t>& offsets, cudaStream_t stream, Body&& body) {
  const LaneAssignment a = assign_lanes(offsets);
  if (a.used == 0) return;
  if (a.used == 1) {
    for (std::size_t e = 0; e < a.lane.size(); ++e)
      if (a.lane[e] >= 0) body(static_cast<int>(e), thread_gemm(), stream);
    return;
  }
  ExpertLanes& lanes = ExpertLanes::for_thread();
  lanes.fork(stream, a.used);
  for (std::size_t e = 0; e < a.lane.size(); ++e)
    if (a.lane[e] >= 0) body(static_cast<int>(e), lanes.gemm(a.lane[e]), lanes.stream(a.lane[e]));
  lanes.join(stream, a.used);
}

}  // namespace

void set_lanes(int n) {
  if (n < 1 || n > kLanes) throw UsageError(fmt::format("kernels.moe_lanes {}: expected an integer in [1, {}]", n, kLanes));
  g_lanes.store(n, std::memory_order_relaxed);
}

std::int64_t plan_ints(std::int64_t slots, int experts) { return experts + 2 + 2 * slots; }

Plan make_plan(const std::int32_t* expert_idx, std::int64_t tokens, int top_k, int experts, std::int32_t* workspace,
               cudaStream_t stream, const std::int32_t* device_tokens) {
  if (top_k < 1 || experts < 1) fail("cuda moe: need top_k >= 1 and experts >= 1, got {} and {}", top_k, experts);
  if (experts > kMaxExperts) fail("cuda moe: {} experts exceed the supported {}", experts, kMaxExperts);
  if (tokens < 0 || tokens * top_k > INT32_MAX) fail("cuda moe: {} tokens x top_k {} is out of range", tokens, top_k);
  if (!workspace || (tokens > 0 && !expert_idx)) fail("cuda moe: make_plan got a null pointer");
  Plan p;
  p.tokens = tokens;
  p.top_k = top_k;
  p.experts = experts;
  const std::int64_t s = p.slots();
  p.offsets = workspace;
  p.source = workspace + experts + 2;
  p.position = p.source + s;
  plan_count_kernel<<<1, kPlanThreads, sizeof(int) * experts, stream>>>(expert_idx, s, device_tokens, top_k, experts,
                                                                         p.offsets);
  KEEL_CUDA_CHECK_LAUNCH();
  plan_scatter_kernel<<<experts, kPlanThreads, 0, stream>>>(expert_idx, s, device_tokens, top_k, p.offsets, p.source,
                                                            p.position);
  KEEL_CUDA_CHECK_LAUNCH();
  // The one host sync of the MoE layer: the GEMM loop needs each expert's row range.
  std::vector<std::int32_t> h(static_cast<std::size_t>(experts) + 2);
  KEEL_CUDA_CHECK(cudaMemcpyAsync(h.data(), p.offsets, sizeof(std::int32_t) * h.size(), cudaMemcpyDeviceToHost, stream));
  KEEL_CUDA_CHECK(keel::stream_sync(stream));
  if (h[experts + 1] != 0)
    fail("cuda moe: {} routed slots name an expert outside [0, {})", h[experts + 1], experts);
  p.host_offsets.assign(h.begin(), h.begin() + experts + 1);
  if (device_tokens) p.tokens = h[experts] / top_k;  // every planned slot is valid here
  return p;
}

void dispatch_rows(const Plan& plan, const bf16* x, std::int64_t d, bf16* xs, cudaStream_t stream) {
  const std::int64_t s = plan.slots();
  if (s == 0) return;
  const unsigned grid = static_cast<unsigned>(s);
  if (vec8(d, {x, xs}))
    gather_kernel<true><<<grid, kRowThreads, 0, stream>>>(x, plan.source, plan.rows, plan.top_k, d, xs);
  else
    gather_kernel<false><<<grid, kRowThreads, 0, stream>>>(x, plan.source, plan.rows, plan.top_k, d, xs);
  KEEL_CUDA_CHECK_LAUNCH();
}

void experts_forward(const std::vector<std::int64_t>& offsets, const Weights& w, std::int64_t d, std::int64_t f,
                     const Saved& sv, cudaStream_t stream) {
  const int experts = static_cast<int>(offsets.size()) - 1;
  if (experts < 1 || offsets.front() != 0) fail("cuda moe: expert row offsets must start at 0 ({} experts)", experts);
  const std::int64_t rows = offsets.back();
  if (rows == 0) return;
  if (!w.w_gate || !w.w_up || !w.w_down || !sv.xs || !sv.h_gate || !sv.h_up || !sv.act || !sv.ys)
    fail("cuda moe: experts_forward got a null pointer");
  // One chain per expert on its rows: gate and up GEMMs, SwiGLU, down GEMM.
  for_each_expert(offsets, stream, [&](int e, GemmRunner& gemm, cudaStream_t lane) {
    const std::int64_t off = offsets[e], cnt = offsets[e + 1] - off;
    const GemmDesc up = desc(cnt, f, d, false, true, GemmOut::kBf16, 0.f);
    gemm.run(up, sv.xs + off * d, w.w_gate + e * f * d, sv.h_gate + off * f, lane);
    gemm.run(up, sv.xs + off * d, w.w_up + e * f * d, sv.h_up + off * f, lane);
    swiglu_forward_kernel<<<elem_grid(cnt * f), kElemThreads, 0, lane>>>(sv.h_gate + off * f, sv.h_up + off * f,
                                                                        sv.act + off * f, cnt * f);
    KEEL_CUDA_CHECK_LAUNCH();
    gemm.run(desc(cnt, d, f, false, true, GemmOut::kBf16, 0.f), sv.act + off * f, w.w_down + e * d * f,
             sv.ys + off * d, lane);
  });
}

void combine(const Plan& plan, const bf16* ys, const float* gates, std::int64_t d, float* y, cudaStream_t stream) {
  if (plan.tokens == 0) return;
  const unsigned grid = static_cast<unsigned>(plan.tokens);
  if (!gates) fail("cuda moe: combine got no gates");
  if (vec8(d, {ys, y}))
    sum_slots_kernel<8><<<grid, kRowThreads, 0, stream>>>(ys, gates, plan.position, plan.rows, plan.top_k, d, y);
  else
    sum_slots_kernel<1><<<grid, kRowThreads, 0, stream>>>(ys, gates, plan.position, plan.rows, plan.top_k, d, y);
  KEEL_CUDA_CHECK_LAUNCH();
}

void combine_backward(const Plan& plan, const bf16* ys, const float* gates, std::int64_t d, const float* dy,
                      bf16* dys, float* dgates, cudaStream_t stream) {
  if (plan.tokens == 0) return;
  const unsigned grid = static_cast<unsigned>(plan.tokens);
  if (vec8(d, {ys, dy, dys}))
    combine_backward_kernel<8><<<grid, kRowThreads, 0, stream>>>(ys, gates, plan.position, plan.rows, plan.top_k, d,
                                                                 dy, dys, dgates);
  else
    combine_backward_kernel<1><<<grid, kRowThreads, 0, stream>>>(ys, gates, plan.position, plan.rows, plan.top_k, d,
                                                                 dy, dys, dgates);
  KEEL_CUDA_CHECK_LAUNCH();
}

std::int64_t experts_backward_scratch_bytes(std::int64_t rows, std::int64_t f) {
  // dact fp32 [R, F], dh_gate, dh_up bf16 [R, F]
  return align_up(rows * f * 4) + 2 * align_up(rows * f * 2);
}

namespace {

// Zeroes dw's blocks of experts [first, first + count) (each block d x f floats).
void zero_expert_blocks(const Grads& dw, int first, int count, std::int64_t d, std::int64_t f, cudaStream_t stream) {
  const std::size_t bytes = static_cast<std::size_t>(count * d * f) * sizeof(float);
  for (float* g : {dw.w_gate, dw.w_up, dw.w_down})
    if (g) KEEL_CUDA_CHECK(cudaMemsetAsync(g + first * d * f, 0, bytes, stream));
}

}  // namespace

void zero_expert_grads(const Grads& dw, int experts, std::int64_t d, std::int64_t f, cudaStream_t stream) {
  if (dw.overwrite) zero_expert_blocks(dw, 0, experts, d, f, stream);
}

void experts_backward(const std::vector<std::int64_t>& offsets, const Weights& w, std::int64_t d, std::int64_t f,
                      const Saved& sv, const bf16* dys, void* scratch, float* dxs, const Grads& dw,
                      cudaStream_t stream) {
  const int experts = static_cast<int>(offsets.size()) - 1;
  if (experts < 1 || offsets.front() != 0) fail("cuda moe: expert row offsets must start at 0 ({} experts)", experts);
  const std::int64_t rows = offsets.back();
  if (rows == 0) return zero_expert_grads(dw, experts, d, f, stream);
  const bool need_dh = dxs || dw.w_gate || dw.w_up;
  if (!need_dh && !dw.w_down) return;
  if (!w.w_gate || !w.w_up || !w.w_down || !sv.xs || !sv.h_gate || !sv.h_up || !sv.act || !dys || !scratch)
    fail("cuda moe: experts_backward got a null pointer");
  if (dw.overwrite)  // the experts without rows: no GEMM writes theirs
    for (int e = 0; e < experts; ++e)
      if (offsets[e + 1] == offsets[e]) zero_expert_blocks(dw, e, 1, d, f, stream);
  const float beta = dw.overwrite ? 0.f : 1.f;
  char* base = static_cast<char*>(scratch);
  float* dact = reinterpret_cast<float*>(base);
  base += align_up(rows * f * 4);
  bf16* dhg = reinterpret_cast<bf16*>(base);
  base += align_up(rows * f * 2);
  bf16* dhu = reinterpret_cast<bf16*>(base);
  // One chain per expert on its rows (experts without tokens launch no zero-size GEMM).
  for_each_expert(offsets, stream, [&](int e, GemmRunner& gemm, cudaStream_t lane) {
    const std::int64_t off = offsets[e], cnt = offsets[e + 1] - off;
    // dW_down[e] [D, F] += dys_e^T act_e (= with dw.overwrite)
    if (dw.w_down)
      gemm.run(desc(d, f, cnt, true, false, GemmOut::kFp32, beta), dys + off * d, sv.act + off * f,
               dw.w_down + e * d * f, lane);
    if (!need_dh) return;
    // dact_e [cnt, F] = dys_e W_down[e]
    gemm.run(desc(cnt, f, d, false, false, GemmOut::kFp32, 0.f), dys + off * d, w.w_down + e * d * f, dact + off * f,
             lane);
    swiglu_backward_kernel<<<elem_grid(cnt * f), kElemThreads, 0, lane>>>(
        sv.h_gate + off * f, sv.h_up + off * f, dact + off * f, dhg + off * f, dhu + off * f, cnt * f);
    KEEL_CUDA_CHECK_LAUNCH();
    // dW_gate[e] [F, D] += dh_gate_e^T xs_e; the same for up.
    const GemmDesc wgrad = desc(f, d, cnt, true, false, GemmOut::kFp32, beta);
    if (dw.w_gate) gemm.run(wgrad, dhg + off * f, sv.xs + off * d, dw.w_gate + e * f * d, lane);
    if (dw.w_up) gemm.run(wgrad, dhu + off * f, sv.xs + off * d, dw.w_up + e * f * d, lane);
    // dxs_e [cnt, D] = dh_gate_e W_gate[e] + dh_up_e W_up[e]
    if (dxs) {
      gemm.run(desc(cnt, d, f, false, false, GemmOut::kFp32, 0.f), dhg + off * f, w.w_gate + e * f * d, dxs + off * d,
               lane);
      gemm.run(desc(cnt, d, f, false, false, GemmOut::kFp32, 1.f), dhu + off * f, w.w_up + e * f * d, dxs + off * d,
               lane);
    }
  });
}

namespace {

template <typename DX>
void combine_dx_impl(const Plan& plan, const float* dxs, std::int64_t d, DX* dx, cudaStream_t stream) {
  if (plan.tokens == 0) return;
  const unsigned grid = static_cast<unsigned>(plan.tokens);
  const float* no_gates = nullptr;
  if (vec8(d, {dxs, dx}))
    sum_slots_kernel<8><<<grid, kRowThreads, 0, stream>>>(dxs, no_gates, plan.position, plan.rows, plan.top_k, d, dx);
  else
    sum_slots_kernel<1><<<grid, kRowThreads, 0, stream>>>(dxs, no_gates, plan.position, plan.rows, plan.top_k, d, dx);
  KEEL_CUDA_CHECK_LAUNCH();
}

}  // namespace

void combine_dx(const Plan& plan, const float* dxs, std::int64_t d, bf16* dx, cudaStream_t stream) {
  combine_dx_impl(plan, dxs, d, dx, stream);
}
void combine_dx(const Plan& plan, const float* dxs, std::int64_t d, float* dx, cudaStream_t stream) {
  combine_dx_impl(plan, dxs, d, dx, stream);
}

void forward(const Plan& plan, const bf16* x, const float* gates, const Weights& w, std::int64_t d, std::int64_t f,
             const Saved& sv, float* y, cudaStream_t stream) {
  check_plan(plan, d, f);
  if (plan.tokens == 0) return;
  if (!x || !gates || !w.w_gate || !w.w_up || !w.w_down || !sv.xs || !sv.h_gate || !sv.h_up || !sv.act || !sv.ys || !y)
    fail("cuda moe: forward got a null pointer");
  dispatch_rows(plan, x, d, sv.xs, stream);
  experts_forward(plan.host_offsets, w, d, f, sv, stream);
  combine(plan, sv.ys, gates, d, y, stream);
}

std::int64_t backward_scratch_bytes(std::int64_t slots, std::int64_t d, std::int64_t f) {
  // dys bf16 [S, D], the experts' scratch, dxs fp32 [S, D]
  return align_up(slots * d * 2) + experts_backward_scratch_bytes(slots, f) + align_up(slots * d * 4);
}

namespace {

template <typename DX>
void backward_impl(const Plan& plan, const float* gates, const Weights& w, std::int64_t d, std::int64_t f,
                   const Saved& sv, const float* dy, void* scratch, DX* dx, float* dgates, const Grads& dw,
                   cudaStream_t stream) {
  check_plan(plan, d, f);
  const std::int64_t s = plan.slots();
  if (plan.tokens == 0) return zero_expert_grads(dw, plan.experts, d, f, stream);
  if (!gates || !w.w_gate || !w.w_up || !w.w_down || !sv.xs || !sv.h_gate || !sv.h_up || !sv.act || !sv.ys || !dy ||
      !scratch)
    fail("cuda moe: backward got a null pointer");
  char* base = static_cast<char*>(scratch);
  bf16* dys = reinterpret_cast<bf16*>(base);
  base += align_up(s * d * 2);
  void* experts_scratch = base;
  base += experts_backward_scratch_bytes(s, f);
  float* dxs = reinterpret_cast<float*>(base);
  combine_backward(plan, sv.ys, gates, d, dy, dys, dgates, stream);
  experts_backward(plan.host_offsets, w, d, f, sv, dys, experts_scratch, dx ? dxs : nullptr, dw, stream);
  if (dx) combine_dx(plan, dxs, d, dx, stream);
}

}  // namespace

void backward(const Plan& plan, const float* gates, const Weights& w, std::int64_t d, std::int64_t f, const Saved& sv,
              const float* dy, void* scratch, bf16* dx, float* dgates, const Grads& dw, cudaStream_t stream) {
  backward_impl(plan, gates, w, d, f, sv, dy, scratch, dx, dgates, dw, stream);
}

void backward_f32(const Plan& plan, const float* gates, const Weights& w, std::int64_t d, std::int64_t f,
                  const Saved& sv, const float* dy, void* scratch, float* dx, float* dgates, const Grads& dw,
                  cudaStream_t stream) {
  backward_impl(plan, gates, w, d, f, sv, dy, scratch, dx, dgates, dw, stream);
}

}  // namespace keel::ops::cuda::moe

namespace keel::ops {
void set_moe_lanes(int n) { cuda::moe::set_lanes(n); }
}  // namespace keel::ops
