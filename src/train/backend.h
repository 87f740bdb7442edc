// TrainBackend: what the training loop (trainer.h) needs from a model and its optimizer,
// wherever they live. The CPU backend wraps MoeTransformer and the host AdamW (+ Muon); the CUDA
// backend (cuda_backend_cuda.cc) keeps fp32 master weights, optimizer state, bf16 working
// weights and bf16 activations on one GPU. Both lay parameters out with model::param_layout()
// (groups re-assigned by param_rules.h when Muon is on; offsets never change) and initialize
// them with model::init_parameters(), so a checkpoint of one loads into the other.
//
// Optimizers (OptimizerConfig, param_rules.h): AdamW for every parameter, or with
// optimizer.muon.enabled Muon for the weight matrices and AdamW for the rest. Muon's momentum
// is kept in the AdamW m buffer at the Muon parameters' offsets, so TrainState is the same.
//
// One training step, as the trainer drives it:
//   zero_grads(); begin_step(micro-batches on this rank); for each micro-batch:
//   forward(tokens, targets); backward(1/accum);
//   clip_and_step(clip, lr); load() / set_load() (the trainer sums them over data-parallel
//   ranks); update_router_bias();
//
// Data parallelism (mesh.data().size > 1, parallel/zero1.h): each rank runs forward/backward on
// its own micro-batches; the gradients reach their ZeRO-1 shard's owner (a reduce-scatter after
// backward on CPU ranks; on GPUs, bucket reduces during the last backward, docs/parallel.md),
// clip_and_step() clips by the global norm, updates the rank's shard (AdamW elementwise, Muon
// on the whole matrices the shard holds) and the parameters return to every rank (an
// all-gather; on GPUs, per-bucket broadcasts the next forward waits for). Optimizer state
// exists only for the shard (optimizer_shard()), plus, with expert parallelism,
// the rank's shard of its expert region (state_slice()).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "optim/adamw.h"
#include "optim/param_groups.h"
#include "parallel/mesh.h"
#include "parallel/zero1.h"
#include "parallel/zero1_buckets.h"
#include "train/model.h"
#include "train/param_rules.h"
#include "train/step_profile.h"

namespace keel::train {

// What of the model's state one rank holds. Its parameters are laid out by
// model::param_layout(cfg, expert_parallel) (with expert parallelism: E / ep experts per MoE
// layer, those of expert_rank, after every replicated parameter). Its optimizer state covers
// the ZeRO-1 shard [shard_begin, shard_end) of the replicated parameters and, with expert
// parallelism, the ZeRO-1 shard [expert_begin, expert_end) of its expert region over the ranks
// holding the same experts. With tensor parallelism (tensor_parallel > 1) the layout is
// model::param_layout of a mesh with that tp (and ep = expert_parallel): the rank holds the
// blocks of tensor rank `tensor_rank` of the parameters split over tp (model::block_pieces), and
// its shards are of that flat buffer (the data ranks of one tensor rank shard it alike).
struct StateSlice {
  int expert_parallel = 1, expert_rank = 0;
  std::int64_t shard_begin = 0, shard_end = 0;
  std::int64_t expert_begin = 0, expert_end = 0;
  int tensor_parallel = 1, tensor_rank = 0;
  std::int64_t moments() const { return (shard_end - shard_begin) + (expert_end - expert_begin); }
};

// The optimizer ranges of a slice, each with where its moments start in adam_m / adam_v: the
// replicated shard's at 0, then (expert parallelism) the expert shard's.
struct MomentRange {
  std::int64_t begin = 0, end = 0, at = 0;
};
std::vector<MomentRange> moment_ranges(const StateSlice& s);

// Where a slice keeps AdamW's v: runs of moments [at, at + count) holding the flat floats
// [begin, begin + count) of AdamW parameters (and the padding between two of them). Neither
// optimizer reads or writes v at a Muon parameter, so no backend keeps it there: the CUDA
// backend backs no memory for it, state() reports zeros, set_state() and checkpoints skip it.
struct MomentSpan {
  std::int64_t begin = 0, count = 0, at = 0;
};
std::vector<MomentSpan> adamw_moment_spans(const optim::ParamLayout& layout, const StateSlice& s);

// Everything a checkpoint holds of the model and optimizer, in host memory.
struct TrainState {
  std::vector<float> params;  // layout().total_floats: every parameter this rank holds
  // The optimizer state of this rank's ZeRO-1 shard [shard_begin, shard_end) of the flat buffer
  // (all of it on one rank): shard_end - shard_begin floats each, element i at offset
  // shard_begin + i. adam_m holds Muon's momentum at Muon parameters (their adam_v is zero:
  // adamw_moment_spans()).
  std::int64_t shard_begin = 0, shard_end = 0;
  std::vector<float> adam_m, adam_v;
  // With expert parallelism: this rank's experts and their optimizer range (StateSlice); the
  // moments of [expert_begin, expert_end) follow the shard's in adam_m / adam_v.
  int expert_parallel = 1, expert_rank = 0;
  std::int64_t expert_begin = 0, expert_end = 0;
  // With tensor parallelism: which tensor rank's blocks `params` holds (StateSlice).
  int tensor_parallel = 1, tensor_rank = 0;
  StateSlice slice() const {
    return {expert_parallel, expert_rank, shard_begin, shard_end, expert_begin, expert_end, tensor_parallel, tensor_rank};
  }
  void set_slice(const StateSlice& s) {
    expert_parallel = s.expert_parallel, expert_rank = s.expert_rank;
    shard_begin = s.shard_begin, shard_end = s.shard_end;
    expert_begin = s.expert_begin, expert_end = s.expert_end;
    tensor_parallel = s.tensor_parallel, tensor_rank = s.tensor_rank;
  }
  std::vector<std::vector<float>> router_bias;    // one [E] per MoE layer
  BalanceMemory router_balance;                   // the balancing controller's moments (adam rule)
  std::int64_t adamw_step = 0;
};

// What a checkpoint of this rank writes, where it already lives: this rank's ZeRO-1 shard
// [shard_begin, shard_end) of the parameters and of the optimizer moments. In GPU memory
// (on_device) on the CUDA backend, so the checkpoint copies it once, straight into pinned
// staging, instead of through a host TrainState. Pointers stay valid until the next
// training step; `keep` holds a host copy when the view points into one.
struct CheckpointView {
  const float* params = nullptr;  // the flat parameter buffer: element i at params[i]
  const float* adam_m = nullptr;  // the shard's moments: element i at adam_m[i - shard_begin], then the expert range's
  const float* adam_v = nullptr;  // the same indexing; read only at adamw_moment_spans()
  StateSlice slice;
  bool on_device = false;
  std::vector<std::vector<float>> router_bias;
  BalanceMemory router_balance;
  std::int64_t adamw_step = 0;
  std::shared_ptr<const TrainState> keep;

  static CheckpointView of(std::shared_ptr<const TrainState> s) {
    CheckpointView v;
    v.params = s->params.data();
    v.adam_m = s->adam_m.data();
    v.adam_v = s->adam_v.data();
    v.slice = s->slice();
    v.router_bias = s->router_bias;
    v.router_balance = s->router_balance;
    v.adamw_step = s->adamw_step;
    v.keep = std::move(s);
    return v;
  }
};

struct StepResult {
  double grad_norm = 0;          // global L2 norm before clipping
  double clip_coefficient = 1;   // what the gradients were multiplied by
};

class TrainBackend {
 public:
  virtual ~TrainBackend() = default;

  virtual std::string device() const = 0;  // "cpu" or the GPU's name
  // This rank's GPU, as keel run's events name it: its CUDA ordinal and PCI bus id
  // ("cuda:1 0000:1B:00.0"); empty on the CPU.
  virtual std::string device_id() const { return {}; }
  virtual const optim::ParamLayout& layout() const = 0;
  virtual std::int64_t param_count() const = 0;  // without padding
  virtual int moe_layer_count() const = 0;
  virtual double flops_per_micro_batch() const = 0;
  // The bytes the backend holds (parameters, gradients, optimizer, activations, workspaces;
  // on a GPU what it allocated) by what holds them, and their sum.
  struct MemoryItem {
    std::string name;
    std::size_t bytes = 0;
  };
  virtual std::vector<MemoryItem> memory_breakdown() const = 0;
  // Seconds this rank's device takes for a fixed piece of work, enqueued after the step's work
  // (keel run's GPU straggler check: a GPU whose own speed drops shows here, where the step time
  // cannot show it, every rank waiting for the slowest in the collectives). The CUDA backend's
  // probe (device/device_canary_cuda.h) times its SMs, not what other streams run beside it;
  // `repeats` times as long (fault injection: a throttled GPU). Returns the previous call's time
  // (0 at the first: the host never waits for it); 0 where there is no such device (the CPU).
  // repeats 0: only makes the probe.
  virtual double device_canary_seconds(int repeats) {
    (void)repeats;
    return 0;
  }
  std::size_t memory_bytes() const {
    std::size_t sum = 0;
    for (const auto& it : memory_breakdown()) sum += it.bytes;
    return sum;
  }

  // kernels.profile: from now on time each step phase by phase, the first `warmup` steps not
  // counted (train/step_profile.h); report() closes the open step. GPU backends only: the CPU's
  // throws keel::UsageError.
  virtual void enable_profile(int warmup);
  virtual ProfileReport profile_report() { return {}; }

  virtual void zero_grads() = 0;
  // The trainer announces, after zero_grads(), how many backward() calls this step makes on
  // this rank, so a data-parallel GPU backend starts reducing gradients during the last one.
  // Without it (tests driving a backend directly) every reduction waits for clip_and_step().
  virtual void begin_step(int micro_batches) { (void)micro_batches; }
  // tokens: micro_batch * seq_length input ids (host), targets: labels (-1 ignored).
  virtual LossParts forward(const std::uint32_t* tokens, const std::int32_t* targets) = 0;
  virtual void backward(float loss_scale) = 0;
  // Global-norm clipping over every gradient (max_norm <= 0: none), then one step of AdamW on
  // its parameters and Muon on its matrices at `lr` (times each group's lr_scale), both with the
  // clip coefficient as gradient scale. Throws optim::NonFiniteGradient (nothing updated) when
  // the norm is not finite.
  virtual StepResult clip_and_step(double max_norm, double lr) = 0;

  // Expert load counters of MoE layer i, summed since the last reset.
  virtual std::vector<std::int64_t> load(int moe_index) const = 0;
  // Aux-loss-free balancing from the counters, then resets them.
  // Replaces the counters of MoE layer i (the data-parallel sum, before update_router_bias()).
  virtual void set_load(int moe_index, const std::vector<std::int64_t>& counts) = 0;
  virtual void update_router_bias() = 0;
  virtual void reset_load() = 0;

  // This rank's ZeRO-1 shard of the flat buffer: [first, second) (all of it on one rank).
  virtual std::pair<std::int64_t, std::int64_t> optimizer_shard() const = 0;
  // What of the state this rank holds (its experts, its optimizer ranges).
  virtual StateSlice state_slice() const {
    StateSlice s;
    std::tie(s.shard_begin, s.shard_end) = optimizer_shard();
    return s;
  }

  // The CPU reference model behind this backend (keel eval's per-token log-probabilities read
  // its LM head after forward()); nullptr on the GPU, whose forward keeps no per-token values.
  virtual const MoeTransformer* cpu_model() const { return nullptr; }

  // The fp32 gradients (layout().total_floats) in host memory: for tests and debugging.
  virtual std::vector<float> gradients() const = 0;

  virtual TrainState state() const = 0;
  // The state a checkpoint writes, without copying it where the backend can (a collective under
  // data parallelism, like state()). Default: a host copy through state().
  virtual CheckpointView checkpoint_view() { return CheckpointView::of(std::make_shared<const TrainState>(state())); }
  // Throws keel::Error when the sizes or the shard do not match this model and rank, or when
  // the state holds Muon
  // momentum for a parameter this backend trains with AdamW (check_state_matches_optimizers).
  virtual void set_state(const TrainState& s) = 0;
};

// How both backends shard a rank's flat buffer for ZeRO-1 (parallel/zero1.h). With expert
// parallelism the experts come last: the replicated region [0, replicated_end) is sharded over
// the data group (all ranks) and the expert region [replicated_end, total) over the expert-data
// group (the ranks holding the same experts), whose gradients it sums. `replicated` is empty on
// one rank (the slice's shard is then the whole buffer), `experts` without expert parallelism.
struct StateShards {
  std::int64_t replicated_end = 0;
  parallel::Zero1Plan replicated, experts;
  StateSlice slice;  // this rank's shard of each region, its experts
};
// The rank at coordinate `at` of a mesh of shape `shape` (pure arithmetic: keel size asks it for
// meshes it does not run); the second form for this rank of a running mesh.
StateShards plan_state_shards(const optim::ParamLayout& layout, const mesh::Shape& shape, const mesh::Coord& at);
inline StateShards plan_state_shards(const optim::ParamLayout& layout, const parallel::Mesh& mesh) {
  return plan_state_shards(layout, mesh.shape(), mesh.coord());
}

// What every backend's set_state() checks before touching anything: `s` holds this rank's
// parameters (layout.total_floats), exactly its slice (optimizer shard and experts) with
// moments of that size, one router bias per MoE layer of the given sizes, and no Muon momentum
// where this layout trains with AdamW (check_state_matches_optimizers). Throws keel::Error
// naming the first mismatch.
void check_train_state(const TrainState& s, const optim::ParamLayout& layout, const StateSlice& slice,
                       const std::vector<std::size_t>& router_bias_sizes);

// One line: "memory on this rank: 41.15 GiB = fp32 master weights 8.19 GiB + ..." from
// memory_breakdown(), items of 0 bytes left out.
std::string memory_report(const TrainBackend& b);

// True when this keel was built with CUDA and a GPU is visible (`device: auto` picks cuda then).
bool cuda_training_available();
// The dense bf16 tensor-core peak (FLOP/s) of a GPU from its name (hw/hardware.h profiles);
// throws keel::UsageError naming the device when keel has no profile (set mfu_peak_flops).
double device_peak_bf16_flops(const std::string& device_name);

// The groups of `mesh` (parallel/mesh.h; a one-process mesh by default); `dp`: how gradients
// are reduced and the GPU ZeRO-1 step runs (`parallel.grad_reduce`, `parallel.zero1`).
std::unique_ptr<TrainBackend> make_cpu_backend(const model::ModelConfig& cfg, const ModelOptions& options,
                                               const OptimizerConfig& optimizer, const parallel::Mesh& mesh = {},
                                               const parallel::DataParallelOptions& dp = {});
// One GPU (the current CUDA device). Throws keel::UsageError in a build without CUDA or when
// no GPU is visible.
std::unique_ptr<TrainBackend> make_cuda_backend(const model::ModelConfig& cfg, const ModelOptions& options,
                                                const OptimizerConfig& optimizer, const parallel::Mesh& mesh = {},
                                                const parallel::DataParallelOptions& dp = {});

}  // namespace keel::train
