// Muon (optim/muon.h) over tensor-parallel shards, on CPU ranks under MPI.
//
// Under Megatron tensor parallelism each of the T ranks of a tensor group holds one block of a
// weight matrix: column-parallel weights split the matrix rows (dimension 0 of a 2-D [out, in]
// weight, dimension 1 of an expert stack [E, F, D]), row-parallel weights split the columns
// (the last dimension: [D, F] or [E, D, F]); every matrix of a stack is split the same way.
// Momentum and the update's scaling are elementwise, but Newton-Schulz needs the whole matrix.
// tp_muon_matrix_step() performs exactly what optim::muon_matrix_step() does on the whole
// matrices, given only this rank's block of param, grad and momentum:
//   1. every rank updates its block of the momentum and forms its block of the Nesterov input U
//      (elementwise, so they stay sharded: the same floats as the single-rank step);
//   2. matrix e of the stack has an owner, rank (owner + e) % T of the group; each rank sends its
//      block of U_e to that owner (one MPI_Alltoallv for the whole stack);
//   3. each owner reassembles its whole row-major matrices (a column split re-interleaves every
//      row; a row split made of parts, Placement::parts, puts each rank's slice of every part in
//      place), runs optim::muon_orthogonalize() on each (NS5 and the scale k of the WHOLE
//      matrix's shape; kExactRms measured on the whole result) and cuts them up again;
//   4. the blocks of O_e and k_e go back (one MPI_Alltoallv), and every rank applies
//      p = p * (1 - lr wd) - lr k O to its block.
// The result is the same floats as the single-rank step on the whole matrices (the same
// elementwise operations and the same newton_schulz call on the same whole matrix), so the
// tests compare within fp32 rounding only.
//
// Owners and balance: the owner of a stack's matrices rotates (owner, owner + 1, ...), so an
// expert stack of E >= T matrices spreads its Newton-Schulz work over the whole group in one
// call. Each call is collective and waits for its owners, so separate calls for single
// matrices run one after the other however their owners rotate (tp_muon_owner(i, T) only
// spreads the work of holding whole matrices, not the time). To have the owners work at once,
// step many parameters in one call: tp_muon_step_batch() (owners balanced by Newton-Schulz
// FLOPs, two MPI_Alltoallv for the whole batch), which TensorParallelMuon::step uses.
//
// Every rank of `comm` must call with the same arguments (sizes, split, owner, config, lr,
// decay, grad_scale) except the buffers.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

#include "optim/muon.h"
#include "optim/param_groups.h"

namespace keel::parallel {

// split_dim of tp_muon_matrix_step().
inline constexpr int kTpSplitRows = 0;  // column-parallel: each rank holds local_rows whole rows
inline constexpr int kTpSplitCols = 1;  // row-parallel: each rank holds local_cols columns of every row

// The rank of a tensor group of `tensor_size` ranks that owns matrix `index` (>= 0) of a
// rotation: index % tensor_size. Pass a running count of matrices (or a parameter index).
int tp_muon_owner(std::int64_t index, int tensor_size);

// Scratch floats tp_muon_matrix_step() needs on any rank of a group of `tensor_size` ranks (the
// same on every rank): the local blocks of the stack, the whole-matrix blocks this rank may
// own, one whole matrix and newton_schulz's scratch for it.
std::int64_t tp_muon_scratch_floats(std::int64_t matrices, std::int64_t local_rows, std::int64_t local_cols,
                                    int split_dim, int tensor_size);

// One Muon step on `matrices` consecutive local_rows x local_cols blocks (param, grad, momentum
// each matrices * local_rows * local_cols floats): this rank's blocks of matrices whole
// matrices of rows x cols, where rows = T * local_rows (split_dim kTpSplitRows) or cols =
// T * local_cols (kTpSplitCols), T the size of `comm`, rank r of comm holding block r. Updates
// param and momentum in place exactly as optim::muon_matrix_step() on the whole matrices would
// update this rank's block (c, lr, decay, grad_scale as there; lr already includes the
// parameter's lr_scale). Matrix e is orthogonalized on rank (owner + e) % T. scratch:
// tp_muon_scratch_floats(...) floats.
// row_parts (kTpSplitRows only; empty: one part): the whole matrix's rows as the concatenation
// of parts of these sizes, each split evenly over the group (mesh::Placement::parts, e.g.
// CCA's fused [q; k]): a rank's block is its slice of every part, in order. Each part must be a
// multiple of T and they must add up to rows.
// update_out (optional, matrices * local_rows * local_cols floats): this rank's block of k * O.
// Returns how many of the matrices this rank orthogonalized. Collective over comm. Throws
// keel::Error on bad sizes, split_dim, owner or parts (the same on every rank, so no rank is left
// waiting).
std::int64_t tp_muon_matrix_step(float* param, const float* grad, float* momentum, std::int64_t matrices,
                                 std::int64_t local_rows, std::int64_t local_cols, int split_dim,
                                 const optim::MuonConfig& c, double lr, bool decay, float grad_scale, int owner,
                                 MPI_Comm comm, float* scratch, const std::vector<std::int64_t>& row_parts = {},
                                 float* update_out = nullptr);

// The alternative: Newton-Schulz distributed over the group instead of gathered on an owner.
// Each NS iteration X <- a X + (b A + c A^2) X with A = X X^T (X the wide orientation, s x l,
// s = min(rows, cols)) needs only A when every rank holds a slice of X's long dimension:
// A = sum over ranks of X_r X_r^T (one MPI_Allreduce of s^2 floats per iteration), B = b A +
// c A^2 on every rank (redundantly), X_r <- a X_r + B X_r locally. The Frobenius norm (and
// kExactRms's RMS) are all-reduced too. That holds when the split dimension is the long one:
// kTpSplitRows with rows >= cols, kTpSplitCols with cols >= rows (square: either);
// tp_muon_can_distribute() says so. A split along the short dimension would need the whole X
// on every rank: use tp_muon_matrix_step there. Row parts need no reassembly (NS commutes with a
// permutation of the long dimension). The result equals muon_matrix_step's up to fp32 rounding
// (partial Gram matrices summed across ranks; a square matrix split by rows is iterated
// transposed), not bit for bit. Costs per matrix and rank: ns_steps all-reduces of s^2 floats
// and the s^3 work of B on every rank, against the gather version's two exchanges of one
// matrix and the whole NS on one owner. So it wins only on latency for a lone matrix: at 2 CPU
// ranks (one core each, OpenBLAS 1 thread) one 512 x 512 step took 30 ms against 41 ms
// gathered, one 2048 x 512 (rows split) 79 against 138; but two matrices took 56-63 against 43,
// and 161 against 143, in one gathered batch (tp_muon_step_batch), where the owners work at once.
// A training step has many matrices per tensor group: use the gather version there.
bool tp_muon_can_distribute(std::int64_t local_rows, std::int64_t local_cols, int split_dim, int tensor_size);
std::int64_t tp_muon_distributed_scratch_floats(std::int64_t local_rows, std::int64_t local_cols, int split_dim,
                                                int tensor_size);
// As tp_muon_matrix_step (no owner: every rank works on every matrix). Throws keel::Error when
// !tp_muon_can_distribute(...). row_parts: checked as there, otherwise not needed.
void tp_muon_matrix_step_distributed(float* param, const float* grad, float* momentum, std::int64_t matrices,
                                     std::int64_t local_rows, std::int64_t local_cols, int split_dim,
                                     const optim::MuonConfig& c, double lr, bool decay, float grad_scale, MPI_Comm comm,
                                     float* scratch, const std::vector<std::int64_t>& row_parts = {},
                                     float* update_out = nullptr);

// A batch: one collective step on many tensor-split parameters, so that the owners work at the
// same time. (Separate tp_muon_matrix_step calls each wait for their owner: rotating the owner
// from call to call balances nothing in time. Within one call, a stack's matrices do spread.)
struct TpMuonTensor {
  float* param = nullptr;
  const float* grad = nullptr;
  float* momentum = nullptr;
  std::int64_t matrices = 1, local_rows = 0, local_cols = 0;
  int split_dim = kTpSplitRows;
  std::vector<std::int64_t> row_parts;  // as tp_muon_matrix_step's
  double lr = 0;                        // the scheduled lr times the parameter's lr_scale
  bool decay = true;
  float* update_out = nullptr;          // optional, as tp_muon_matrix_step's
};
// Owners for a batch's matrices (tensor-major, each stack's matrices in order): longest
// Newton-Schulz first (optim::newton_schulz_flops of the whole matrix), each to the least
// loaded rank, the lowest on ties. Deterministic, so every rank computes the same.
std::vector<int> tp_muon_balance_owners(const std::vector<TpMuonTensor>& batch, int tensor_size, int ns_steps = 5);
// Each tensor as tp_muon_matrix_step would update it, all in two MPI_Alltoallv: the blocks of
// every matrix to its owner, the orthogonalized blocks back. owners: one per matrix as
// tp_muon_balance_owners orders them (empty: tp_muon_balance_owners(batch, T, c.ns_steps)).
// workspace grows as needed (this rank's blocks of the batch, the whole matrices it owns and
// one matrix's NS scratch). Returns how many matrices this rank orthogonalized. Collective over
// comm; every rank passes the same batch shapes. Throws keel::Error on bad sizes or owners, or a
// batch over INT_MAX floats per exchange.
std::int64_t tp_muon_step_batch(const std::vector<TpMuonTensor>& batch, const optim::MuonConfig& c, float grad_scale,
                                MPI_Comm comm, std::vector<float>& workspace, const std::vector<int>& owners = {});

// How a Muon parameter lies over the tensor axis (mesh::Axis::kTensor of its placement).
struct TpMuonSplit {
  // False: every matrix is whole on this rank (not split over tp, or split along a leading batch
  // dimension such as the experts): a plain optim::muon_matrix_step on the local block.
  bool split = false;
  int split_dim = kTpSplitRows;             // when split
  std::vector<std::int64_t> row_parts;      // kTpSplitRows of a 2-D tensor with Placement::parts
};
// Reads p.placement: tp on shape[-2] is kTpSplitRows, on shape[-1] kTpSplitCols. Throws
// keel::Error when another axis splits the matrix dims, tp splits both, or p.global_shape (when
// given) is not tensor_size times the local extent along the split.
TpMuonSplit tp_muon_split(const optim::ParamInfo& p, int tensor_size);

// Muon for a rank of a tensor group: the optim::Muon interface over tensor-parallel layouts.
class TensorParallelMuon {
 public:
  // comm: the tensor group (not owned; it must outlive the object).
  TensorParallelMuon(const optim::MuonConfig& c, MPI_Comm tensor_comm);

  // One step on every Muon parameter of `layout` (this rank's layout: whole flat buffers,
  // momentum indexed by the layout's offsets). Tensor-split parameters go through
  // tp_muon_step_batch, in layout order, in batches of at most max_batch_floats() local floats
  // (owners balanced within each batch); the others (whole on this rank: replicated over tp,
  // or split along a leading batch dimension) run muon_matrix_step locally, every tensor rank
  // alike. Increments the step counter. Collective.
  void step(const optim::ParamLayout& layout, float* params, const float* grads, float* momentum, double lr,
            float grad_scale = 1.0f);
  // One step on one parameter (views of that parameter only); owner: the rank orthogonalizing
  // its first matrix (ignored when it is not tensor-split). Collective when it is tensor-split.
  void step_param(const optim::ParamInfo& p, float* param, const float* grad, float* momentum, double lr,
                  float grad_scale, int owner);

  std::int64_t step_count() const { return t_; }
  void set_step_count(std::int64_t t);
  const optim::MuonConfig& config() const { return c_; }
  int tensor_size() const { return size_; }
  // The most local floats of tensor-split parameters step() exchanges at once (default 2^25:
  // 128 MiB of blocks, about as much again for the whole matrices a rank owns).
  void set_max_batch_floats(std::int64_t n);
  std::int64_t max_batch_floats() const { return max_batch_floats_; }

 private:
  optim::MuonConfig c_;
  MPI_Comm comm_;
  int size_ = 1, rank_ = 0;
  std::int64_t t_ = 0;
  std::int64_t max_batch_floats_ = std::int64_t{1} << 25;
  std::vector<float> scratch_;
};

}  // namespace keel::parallel
