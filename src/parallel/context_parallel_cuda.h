// Context parallelism on GPUs: the GPU twin of context_parallel.h (read that first: the zigzag
// partition, what is gathered and what the halos are), over the context group's NCCL
// communicator. The attention core every block gets from the plan (plan_cuda.h) when the mesh's
// cp degree is above 1. CUDA builds only.
//
//   attention  every rank's k and v (bf16) all-gathered, laid out in sequence order, and this
//              rank's two runs of queries attend at their positions (attention::forward_runs).
//              Backward gathers again, computes the whole sequence's dk, dv in fp32
//              (attention::backward_runs), reduce-scatters them in fp32 to the ranks holding
//              those keys and rounds them to bf16 once.
//   halos      one NCCL send-receive with each neighbour (bf16 forward, fp32 backward).
//   heads      with use_heads() (parallel.context_mode: alltoall; context_alltoall_cuda.cc):
//              DeepSpeed-Ulysses' schedule instead of the gather, for the softmax and the linear
//              cores alike. One NCCL all-to-all (grouped send/receive) per tensor gives each rank
//              the whole sequences of 1/C of the heads; the plain kernels run over them; one
//              all-to-all brings the outputs back. Backward sends q, k, v, out, lse and dout and
//              returns dq, dk, dv whole: nothing is summed.
//   ring       with use_ring() (parallel.context_mode: ring; context_ring_cuda.cc): each
//              rank's k, v block travels around the group instead of the gather, one NCCL
//              send/receive hop per step on a side stream while the current block is computed;
//              the queries attend block by block (attention::forward_block, merged by
//              log-sum-exp in fp32). Backward passes the blocks again with their fp32 dk, dv
//              accumulators, which come home after C hops. Two blocks held at once.
//   linear     LASP-2 (lasp2_cuda.cc): the runs' fp32 memory states all-gathered, walked in
//              sequence order to each run's initial state; backward gathers the initial-state
//              gradients and walks them back. With the linear ring (parallel.context_mode:
//              ring, LASP-1) the states are passed rank to rank instead, in sequence order: up
//              the ranks for the first runs, down for the second, one NCCL send and receive
//              per hop (reversed in backward).
// Collectives run on the caller's stream, in the order the blocks call them. Buffers: the
// gathered k and v (bf16 [B, S, Hkv, Dh] each, plus the all-gather's receive buffer of the same
// size), the fp32 dk, dv of the whole sequence and their reduce-scatter buffers, and the halos'
// staging: allocated once, for the largest layer (the gathers' released by use_ring() and
// use_heads(), whose modes never gather).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "blocks/cuda/runners.h"
#include "device/device_buffer.h"
#include "device/side_stream.h"
#include "parallel/nccl_group.h"

namespace keel::parallel {

class CudaContextParallel final : public blocks::cuda::AttentionCore {
 public:
  using bf16 = blocks::cuda::bf16;
  // group: the context group's NCCL communicator; context: its MPI communicator (host sums);
  // batch x seq: the micro-batch (seq: whole sequences); kv_dim: this rank's kv heads x head dim
  // (the widest layer's). Allocates its buffers (this rank's GPU).
  CudaContextParallel(std::shared_ptr<NcclGroup> group, MPI_Comm context, std::int64_t batch, std::int64_t seq,
                      std::int64_t kv_dim);
  ~CudaContextParallel() override;
  CudaContextParallel(const CudaContextParallel&) = delete;
  CudaContextParallel& operator=(const CudaContextParallel&) = delete;

  int size() const { return group_->size(); }
  int rank() const { return group_->rank(); }
  const std::vector<std::int32_t>& positions() const { return pos_; }  // this rank's rows' positions in a sequence
  // Sums x[0..n) over the group on the host, in rank order (the same bits on every rank).
  void sum(double* x, int n) const;
  // the k/v gathers, or in the ring and all-to-all modes their buffers (context_mode.h); not
  // the halos or LASP-2's states
  std::size_t device_bytes() const { return bytes_ + scratch_.capacity(); }
  // LASP-2's state buffers for `floats` states per rank (grown on demand otherwise; nothing may be
  // queued on them), and their bytes.
  void reserve_states(std::int64_t floats);
  std::size_t state_bytes() const { return state_bytes_; }

  int segments() const override { return 2; }
  void halo(const bf16* tails, bf16* halos, std::int64_t rows, std::int64_t F, cudaStream_t stream) override;
  void halo_backward(const float* dhalos, float* dtails, std::int64_t rows, std::int64_t F,
                     cudaStream_t stream) override;
  void forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int B, int T, int Hq, int Hkv,
               int Dh, float scale, int window, cudaStream_t stream) override;
  std::size_t backward_workspace_bytes(int B, int T, int Hq, int Hkv, int Dh) const override;
  void backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse, const bf16* dout,
                bf16* dq, bf16* dk, bf16* dv, void* workspace, int B, int T, int Hq, int Hkv, int Dh, float scale,
                int window, cudaStream_t stream) override;
  // parallel.context_mode: ring: the softmax core passes k, v blocks around the group
  // (context_ring_cuda.cc) and the linear core LASP-1's chain of states (lasp2_cuda.cc). Frees
  // the whole-sequence gather buffers, which this mode never uses, and allocates the ring's for
  // the widest layer (hq query heads of dh on this tensor rank) where the model has softmax (or
  // CCA) layers; call before any work.
  void use_ring(int hq, int dh, bool softmax);
  // parallel.context_mode: alltoall: heads by all-to-all (every layer's heads and kv heads must
  // divide by the context degree: the plan checks it). Frees the gather buffers and allocates
  // its own as use_ring(); softmax / linear: whether the model has such layers.
  void use_heads(int hq, int dh, bool softmax, bool linear);
  std::size_t linear_workspace_bytes(const ops::linear_attention::Config& c, std::int64_t runs,
                                     std::int64_t len) const override;
  void attend_linear(const ops::linear_attention::Config& c, std::int64_t runs, std::int64_t len, const bf16* q,
                     const bf16* k, const bf16* v, float* init, bf16* out, void* workspace,
                     cudaStream_t stream) override;
  void attend_linear_backward(const ops::linear_attention::Config& c, std::int64_t runs, std::int64_t len,
                              const bf16* q, const bf16* k, const bf16* v, const float* init, const bf16* dout,
                              bf16* dq, bf16* dk, bf16* dv, void* workspace, cudaStream_t stream) override;
  // LASP-2's all-gathers on a side stream from here, waited for by the attend call after
  void begin_linear(const ops::linear_attention::Config& c, std::int64_t runs, std::int64_t len, const bf16* k,
                    const bf16* v, cudaStream_t stream) override;
  void begin_linear_backward(const ops::linear_attention::Config& c, std::int64_t runs, std::int64_t len,
                             const bf16* q, const bf16* dout, cudaStream_t stream) override;

 private:
  void release_gather();  // the ring and all-to-all modes: no whole-sequence k, v
  // k, v [B, T, w] of every rank -> k_, v_ [B, S, w] in sequence order.
  void gather(const bf16* k, const bf16* v, std::int64_t B, std::int64_t T, std::int64_t w, cudaStream_t stream);
  // The halo exchange of either direction's element type: `first` (rows b*2) go up and
  // `second` (rows b*2+1) down in forward; reversed in backward.
  void exchange(const void* in, void* out, std::int64_t rows, std::int64_t F, std::size_t elem, NcclType type,
                bool backward, cudaStream_t stream);

  std::shared_ptr<NcclGroup> group_;
  MPI_Comm comm_;
  std::int64_t batch_, seq_, chunk_, kv_dim_;
  std::vector<std::int32_t> pos_;
  int run_start_[2] = {0, 0};
  std::size_t bytes_ = 0;
  void* mem_ = nullptr;  // one allocation, carved below
  bf16 *send_ = nullptr, *recv_ = nullptr, *k_ = nullptr, *v_ = nullptr;  // gather: [2 n], [C 2 n], [B S w] x 2
  float *dk_ = nullptr, *dv_ = nullptr, *rs_send_ = nullptr, *rs_recv_ = nullptr;  // [B S w] x 2, [C 2 n], [2 n]
  std::size_t halo_bytes_ = 0;
  void* halo_ = nullptr;  // halos' staging, grown on demand: 3 x [B, F] of the larger element
  // LASP-2: two buffers of `floats` (this rank's states, and the walk's output in backward) and
  // the all-gather's C x floats, grown on demand.
  float* state_buffers(std::int64_t floats, cudaStream_t stream);
  std::size_t state_bytes_ = 0;
  void* states_ = nullptr;
  // A LASP-2 all-gather begun (1: the states, 2: their gradients) on the side stream.
  int begun_ = 0;
  std::int64_t linear_states(const ops::linear_attention::Config& c, std::int64_t runs, std::int64_t len) const;
  void start_gather(float* mine, std::int64_t n, cudaStream_t stream);
  void finish_gather(cudaStream_t stream);
  bool ring_ = false;
  // The collectives that overlap the blocks (the ring's hops, LASP-2's all-gathers; one mode
  // at a time).
  SideStream side_;
  // The ring (context_ring_cuda.cc): posts one hop on side_ once `stream` gets here: send to
  // rank + 1, receive from rank - 1; side_.wait makes `stream` wait for the hops so far.
  void ring_post(const void* send, void* recv, std::int64_t count, NcclType type, cudaStream_t stream);
  void ring_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int Hq, int Hkv, int Dh,
                    float scale, int window, cudaStream_t stream);
  void ring_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse, const bf16* dout,
                     bf16* dq, bf16* dk, bf16* dv, int Hq, int Hkv, int Dh, float scale, int window,
                     cudaStream_t stream);
  // Heads by all-to-all (context_alltoall_cuda.cc). x [B, T, H, w] (elem bytes) of this rank's
  // rows <-> whole [B, S, H/C, w] of this rank's heads in sequence order; lse [B, H, T] <-> [B,
  // H/C, S]. The staging and the whole-sequence tensors live in one buffer grown on demand,
  // which the ring's blocks and accumulators use too (one mode at a time).
  bool heads_ = false;
  GrowingDeviceBuffer scratch_{"out of GPU memory: context parallelism's ",
                               "lower batch.micro_batch or data.seq_length, or raise parallel.context"};
  std::byte* heads_scratch(std::size_t bytes, cudaStream_t stream);
  void all_to_all(const void* send, void* recv, std::int64_t per_rank, NcclType type, std::size_t elem,
                  cudaStream_t stream);
  void to_heads(const void* x, std::int64_t H, std::int64_t w, std::size_t elem, NcclType type, void* whole,
                cudaStream_t stream);
  void from_heads(const void* whole, std::int64_t H, std::int64_t w, std::size_t elem, NcclType type, void* x,
                  cudaStream_t stream);
  void lse_to_heads(const float* lse, std::int64_t H, float* whole, cudaStream_t stream);
  void lse_from_heads(const float* whole, std::int64_t H, float* lse, cudaStream_t stream);
  std::int64_t heads_of(std::int64_t H, const char* what) const;
  void heads_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int Hq, int Hkv, int Dh,
                     float scale, int window, cudaStream_t stream);
  void heads_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                      const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace, int Hq, int Hkv, int Dh,
                      float scale, int window, cudaStream_t stream);
  ops::linear_attention::Config heads_config(const ops::linear_attention::Config& c) const;
  void heads_linear(const ops::linear_attention::Config& c, const bf16* q, const bf16* k, const bf16* v, float* init,
                    bf16* out, void* workspace, cudaStream_t stream);
  void heads_linear_backward(const ops::linear_attention::Config& c, const bf16* q, const bf16* k, const bf16* v,
                             const bf16* dout, bf16* dq, bf16* dk, bf16* dv, void* workspace, cudaStream_t stream);
  // LASP-1's hops: the message from `from` (or zeros, from -1) and to `to` (-1: none).
  void chain_recv(float* msg, std::int64_t n, int from, cudaStream_t stream);
  void chain_send(const float* msg, std::int64_t n, int to, cudaStream_t stream);
};

}  // namespace keel::parallel
