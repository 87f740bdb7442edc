#include "parallel/tensor_parallel_muon.h"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "optim/newton_schulz.h"

namespace keel::parallel {
namespace {

// How one stack's blocks map onto its whole matrices.
struct Geometry {
  int T = 1;
  std::int64_t E = 0, lr = 0, lc = 0, R = 0, C = 0;
  std::int64_t block = 0;  // lr * lc
  std::int64_t slot = 0;   // block + 2: the block, then k and lr * k as floats (on the way back)
  int split = kTpSplitRows;
  // kTpSplitRows: per part, the rows a rank holds and where the part starts in the whole matrix
  // and in a block.
  std::vector<std::int64_t> part_local, part_whole0, part_block0;
};

Geometry make_geometry(std::int64_t matrices, std::int64_t local_rows, std::int64_t local_cols, int split_dim, int T,
                       const std::vector<std::int64_t>& row_parts) {
  if (matrices < 1 || local_rows < 1 || local_cols < 1)
    fail("tensor-parallel muon: bad block batch {} x [{}, {}]", matrices, local_rows, local_cols);
  if (split_dim != kTpSplitRows && split_dim != kTpSplitCols)
    fail("tensor-parallel muon: split_dim must be 0 (rows) or 1 (columns), got {}", split_dim);
  if (T < 1) fail("tensor-parallel muon: bad group size {}", T);
  Geometry g;
  g.T = T;
  g.E = matrices;
  g.lr = local_rows;
  g.lc = local_cols;
  g.R = split_dim == kTpSplitRows ? local_rows * T : local_rows;
  g.C = split_dim == kTpSplitCols ? local_cols * T : local_cols;
  g.block = local_rows * local_cols;
  g.slot = g.block + 2;
  g.split = split_dim;
  if (g.slot > INT_MAX) fail("tensor-parallel muon: a block of {} floats is too large for one MPI message", g.block);
  if (split_dim == kTpSplitRows) {
    std::vector<std::int64_t> parts = row_parts;
    if (parts.empty()) parts.push_back(g.R);
    std::int64_t whole = 0, local = 0;
    for (std::int64_t part : parts) {
      if (part < 1 || part % T != 0)
        fail("tensor-parallel muon: row part {} does not split over {} ranks", part, T);
      g.part_local.push_back(part / T);
      g.part_whole0.push_back(whole);
      g.part_block0.push_back(local);
      whole += part;
      local += part / T;
    }
    if (whole != g.R)
      fail("tensor-parallel muon: row parts add up to {}, the matrix has {} rows ({} per rank x {})", whole, g.R,
           local_rows, T);
  } else if (!row_parts.empty()) {
    fail("tensor-parallel muon: row parts given for a column split");
  }
  return g;
}

// Copies rank src's block of one whole row-major R x C matrix between `whole` and `block`.
void copy_block(const Geometry& g, int src, float* whole, float* block, bool to_whole) {
  if (g.split == kTpSplitCols) {
    const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(g.lc);
    for (std::int64_t i = 0; i < g.R; ++i) {
      float* w = whole + i * g.C + src * g.lc;
      float* b = block + i * g.lc;
      if (to_whole)
        std::memcpy(w, b, bytes);
      else
        std::memcpy(b, w, bytes);
    }
    return;
  }
  for (std::size_t p = 0; p < g.part_local.size(); ++p) {
    const std::int64_t n = g.part_local[p];
    float* w = whole + (g.part_whole0[p] + src * n) * g.C;
    float* b = block + g.part_block0[p] * g.C;
    const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(n * g.C);
    if (to_whole)
      std::memcpy(w, b, bytes);
    else
      std::memcpy(b, w, bytes);
  }
}

// One matrix of a batch: tensor t's matrix e, orthogonalized on rank `owner`.
struct Job {
  std::size_t t;
  std::int64_t e;
  int owner;
};

// Where a batch's blocks lie on this rank. Local (send) buffer: the blocks in destination
// order, each a slot of block + 2 floats; owned (receive) buffer: one segment per source, each
// the slots of the jobs this rank owns in job order.
struct Plan {
  std::vector<std::int64_t> local_at;        // per job: its slot in the local buffer
  std::vector<int> sc, sd, rc, rd;           // Alltoallv counts and displacements, floats
  std::vector<std::size_t> mine;             // jobs this rank owns
  std::vector<std::int64_t> mine_at;         // their slots within a source's segment
  std::int64_t local_floats = 0, owned_floats = 0, whole_floats = 0;
};

Plan make_plan(const std::vector<Geometry>& gs, const std::vector<Job>& jobs, int T, int rank) {
  Plan pl;
  std::vector<std::int64_t> to(static_cast<std::size_t>(T), 0);  // floats for each destination
  for (const Job& j : jobs) to[static_cast<std::size_t>(j.owner)] += gs[j.t].slot;
  std::vector<std::int64_t> at(static_cast<std::size_t>(T), 0);
  for (int d = 1; d < T; ++d) at[d] = at[d - 1] + to[d - 1];
  pl.local_at.resize(jobs.size());
  std::int64_t seg = 0;
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    pl.local_at[i] = at[static_cast<std::size_t>(j.owner)];
    at[static_cast<std::size_t>(j.owner)] += gs[j.t].slot;
    if (j.owner == rank) {
      pl.mine.push_back(i);
      pl.mine_at.push_back(seg);
      seg += gs[j.t].slot;
      pl.whole_floats = std::max(pl.whole_floats, gs[j.t].R * gs[j.t].C +
                                                      optim::newton_schulz_scratch_floats(gs[j.t].R, gs[j.t].C));
    }
  }
  pl.local_floats = at[static_cast<std::size_t>(T - 1)];
  pl.owned_floats = T * seg;
  if (pl.local_floats > INT_MAX || pl.owned_floats > INT_MAX)
    fail("tensor-parallel muon: a batch of {} floats per rank ({} received) is too large for one MPI exchange; "
         "split it",
         pl.local_floats, pl.owned_floats);
  pl.sc.resize(T);
  pl.sd.resize(T);
  pl.rc.resize(T);
  pl.rd.resize(T);
  std::int64_t d0 = 0;
  for (int d = 0; d < T; ++d) {
    pl.sc[d] = static_cast<int>(to[static_cast<std::size_t>(d)]);
    pl.sd[d] = static_cast<int>(d0);
    d0 += to[static_cast<std::size_t>(d)];
    pl.rc[d] = static_cast<int>(seg);
    pl.rd[d] = static_cast<int>(d * seg);
  }
  return pl;
}

void exchange(const float* send, const std::vector<int>& sc, const std::vector<int>& sd, float* recv,
              const std::vector<int>& rc, const std::vector<int>& rd, MPI_Comm comm, const char* what) {
  PeerWait wait(what);
  mpi_check(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_FLOAT, recv, rc.data(), rd.data(), MPI_FLOAT, comm), what);
}

// The gather-to-owner step on a batch (every tensor's geometry in gs, one Job per matrix).
// scratch: at least plan.local_floats + plan.owned_floats + plan.whole_floats.
std::int64_t run_batch(const std::vector<TpMuonTensor>& ts, const std::vector<Geometry>& gs, const std::vector<Job>& jobs,
                       const Plan& pl, const optim::MuonConfig& c, float grad_scale, int T, MPI_Comm comm,
                       float* scratch) {
  float* local = scratch;
  float* owned = local + pl.local_floats;
  float* whole = owned + pl.owned_floats;

  // 1. Momentum and the Nesterov input, elementwise on this rank's blocks (muon_matrix_step's).
  const float beta = static_cast<float>(c.momentum), one_beta = static_cast<float>(1.0 - c.momentum);
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const TpMuonTensor& t = ts[jobs[i].t];
    const Geometry& g = gs[jobs[i].t];
    const float* gr = t.grad + jobs[i].e * g.block;
    float* m = t.momentum + jobs[i].e * g.block;
    float* u = local + pl.local_at[i];
    for (std::int64_t k = 0; k < g.block; ++k) {
      float gi = grad_scale * gr[k];
      float mi = beta * m[k] + one_beta * gi;
      m[k] = mi;
      u[k] = c.nesterov ? one_beta * gi + beta * mi : mi;
    }
    u[g.block] = u[g.block + 1] = 0.f;
  }

  // 2. Blocks to their matrices' owners.
  exchange(local, pl.sc, pl.sd, owned, pl.rc, pl.rd, comm, "MPI_Alltoallv (tensor-parallel muon, to owners)");

  // 3. Whole matrices: Newton-Schulz and the scale, then cut up again with k and lr * k.
  const std::int64_t seg = T > 0 ? pl.owned_floats / T : 0;
  for (std::size_t n = 0; n < pl.mine.size(); ++n) {
    const Geometry& g = gs[jobs[pl.mine[n]].t];
    const double lr = ts[jobs[pl.mine[n]].t].lr;
    for (int src = 0; src < T; ++src) copy_block(g, src, whole, owned + src * seg + pl.mine_at[n], true);
    const double k = optim::muon_orthogonalize(whole, g.R, g.C, c, whole + g.R * g.C);
    const float kf = static_cast<float>(k), step = static_cast<float>(lr * k);
    for (int src = 0; src < T; ++src) {
      float* b = owned + src * seg + pl.mine_at[n];
      copy_block(g, src, whole, b, false);
      b[g.block] = kf;
      b[g.block + 1] = step;
    }
  }

  // 4. The orthogonalized blocks back (the exchange mirrored), and the update.
  exchange(owned, pl.rc, pl.rd, local, pl.sc, pl.sd, comm, "MPI_Alltoallv (tensor-parallel muon, from owners)");
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const TpMuonTensor& t = ts[jobs[i].t];
    const Geometry& g = gs[jobs[i].t];
    const float keep = static_cast<float>(1.0 - (t.decay ? t.lr * c.weight_decay : 0.0));
    float* p = t.param + jobs[i].e * g.block;
    const float* u = local + pl.local_at[i];
    const float kf = u[g.block], step = u[g.block + 1];
    for (std::int64_t k = 0; k < g.block; ++k) p[k] = p[k] * keep - step * u[k];
    if (t.update_out)
      for (std::int64_t k = 0; k < g.block; ++k) t.update_out[jobs[i].e * g.block + k] = kf * u[k];
  }
  return static_cast<std::int64_t>(pl.mine.size());
}

void group_of(MPI_Comm comm, int* T, int* rank) {
  if (comm == MPI_COMM_NULL) fail("tensor-parallel muon: no communicator");
  mpi_check(MPI_Comm_size(comm, T), "MPI_Comm_size");
  mpi_check(MPI_Comm_rank(comm, rank), "MPI_Comm_rank");
}

}  // namespace

int tp_muon_owner(std::int64_t index, int tensor_size) {
  if (tensor_size < 1) fail("tensor-parallel muon: bad group size {}", tensor_size);
  if (index < 0) fail("tensor-parallel muon: negative owner index {}", index);
  return static_cast<int>(index % tensor_size);
}

std::int64_t tp_muon_scratch_floats(std::int64_t matrices, std::int64_t local_rows, std::int64_t local_cols,
                                    int split_dim, int tensor_size) {
  const std::int64_t T = std::max(1, tensor_size);
  const std::int64_t R = split_dim == kTpSplitRows ? local_rows * T : local_rows;
  const std::int64_t C = split_dim == kTpSplitCols ? local_cols * T : local_cols;
  const std::int64_t slot = local_rows * local_cols + 2;
  const std::int64_t owned = (matrices + T - 1) / T;  // the most matrices one rank owns
  return matrices * slot + T * owned * slot + R * C + optim::newton_schulz_scratch_floats(R, C);
}

std::int64_t tp_muon_matrix_step(float* param, const float* grad, float* momentum, std::int64_t matrices,
                                 std::int64_t local_rows, std::int64_t local_cols, int split_dim,
                                 const optim::MuonConfig& c, double lr, bool decay, float grad_scale, int owner,
                                 MPI_Comm comm, float* scratch, const std::vector<std::int64_t>& row_parts,
                                 float* update_out) {
  int T = 1, rank = 0;
  group_of(comm, &T, &rank);
  std::vector<Geometry> gs{make_geometry(matrices, local_rows, local_cols, split_dim, T, row_parts)};
  if (owner < 0 || owner >= T) fail("tensor-parallel muon: owner {} outside the group of {} ranks", owner, T);
  std::vector<TpMuonTensor> ts(1);
  ts[0].param = param;
  ts[0].grad = grad;
  ts[0].momentum = momentum;
  ts[0].matrices = matrices;
  ts[0].local_rows = local_rows;
  ts[0].local_cols = local_cols;
  ts[0].split_dim = split_dim;
  ts[0].lr = lr;
  ts[0].decay = decay;
  ts[0].update_out = update_out;
  std::vector<Job> jobs;
  for (std::int64_t e = 0; e < matrices; ++e) jobs.push_back({0, e, static_cast<int>((owner + e) % T)});
  const Plan pl = make_plan(gs, jobs, T, rank);
  return run_batch(ts, gs, jobs, pl, c, grad_scale, T, comm, scratch);
}

std::vector<int> tp_muon_balance_owners(const std::vector<TpMuonTensor>& batch, int tensor_size, int ns_steps) {
  if (tensor_size < 1) fail("tensor-parallel muon: bad group size {}", tensor_size);
  struct M {
    double flops;
    std::size_t index;
  };
  std::vector<M> ms;
  for (const auto& t : batch) {
    const std::int64_t R = t.split_dim == kTpSplitRows ? t.local_rows * tensor_size : t.local_rows;
    const std::int64_t C = t.split_dim == kTpSplitCols ? t.local_cols * tensor_size : t.local_cols;
    const double f = optim::newton_schulz_flops(std::max<std::int64_t>(R, 1), std::max<std::int64_t>(C, 1), ns_steps);
    for (std::int64_t e = 0; e < t.matrices; ++e) ms.push_back({f, ms.size()});
  }
  // Longest first, each to the least loaded rank (the lowest on ties): the same on every rank.
  std::stable_sort(ms.begin(), ms.end(), [](const M& a, const M& b) { return a.flops > b.flops; });
  std::vector<double> load(static_cast<std::size_t>(tensor_size), 0.0);
  std::vector<int> owners(ms.size(), 0);
  for (const M& m : ms) {
    const auto d = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owners[m.index] = static_cast<int>(d);
    load[d] += m.flops;
  }
  return owners;
}

std::int64_t tp_muon_step_batch(const std::vector<TpMuonTensor>& batch, const optim::MuonConfig& c, float grad_scale,
                                MPI_Comm comm, std::vector<float>& workspace, const std::vector<int>& owners_in) {
  int T = 1, rank = 0;
  group_of(comm, &T, &rank);
  std::vector<Geometry> gs;
  std::int64_t total = 0;
  for (const auto& t : batch) {
    gs.push_back(make_geometry(t.matrices, t.local_rows, t.local_cols, t.split_dim, T, t.row_parts));
    if (!t.param || !t.grad || !t.momentum) fail("tensor-parallel muon: a tensor of the batch has no buffers");
    total += t.matrices;
  }
  const std::vector<int> owners = owners_in.empty() ? tp_muon_balance_owners(batch, T, c.ns_steps) : owners_in;
  if (static_cast<std::int64_t>(owners.size()) != total)
    fail("tensor-parallel muon: {} owners for a batch of {} matrices", owners.size(), total);
  std::vector<Job> jobs;
  for (std::size_t t = 0; t < batch.size(); ++t)
    for (std::int64_t e = 0; e < batch[t].matrices; ++e) {
      const int o = owners[jobs.size()];
      if (o < 0 || o >= T) fail("tensor-parallel muon: owner {} outside the group of {} ranks", o, T);
      jobs.push_back({t, e, o});
    }
  if (jobs.empty()) return 0;
  const Plan pl = make_plan(gs, jobs, T, rank);
  const auto need = static_cast<std::size_t>(pl.local_floats + pl.owned_floats + pl.whole_floats);
  if (workspace.size() < need) workspace.resize(need);
  return run_batch(batch, gs, jobs, pl, c, grad_scale, T, comm, workspace.data());
}

bool tp_muon_can_distribute(std::int64_t local_rows, std::int64_t local_cols, int split_dim, int tensor_size) {
  const std::int64_t T = std::max(1, tensor_size);
  if (split_dim == kTpSplitRows) return local_rows * T >= local_cols;
  if (split_dim == kTpSplitCols) return local_cols * T >= local_rows;
  return false;
}

std::int64_t tp_muon_distributed_scratch_floats(std::int64_t local_rows, std::int64_t local_cols, int split_dim,
                                                int /*tensor_size*/) {
  const std::int64_t s = split_dim == kTpSplitRows ? local_cols : local_rows;  // the whole short dimension
  const std::int64_t ll = split_dim == kTpSplitRows ? local_rows : local_cols;  // this rank's slice of the long one
  return 3 * s * ll + 2 * s * s;  // U block, X_r, Y_r, A, B
}

void tp_muon_matrix_step_distributed(float* param, const float* grad, float* momentum, std::int64_t matrices,
                                     std::int64_t local_rows, std::int64_t local_cols, int split_dim,
                                     const optim::MuonConfig& c, double lr, bool decay, float grad_scale, MPI_Comm comm,
                                     float* scratch, const std::vector<std::int64_t>& row_parts, float* update_out) {
  int T = 1, rank = 0;
  group_of(comm, &T, &rank);
  const Geometry g = make_geometry(matrices, local_rows, local_cols, split_dim, T, row_parts);
  if (!tp_muon_can_distribute(local_rows, local_cols, split_dim, T))
    fail("tensor-parallel muon: a [{}, {}] matrix split along its short dimension ({}) cannot run Newton-Schulz "
         "distributed; gather it (tp_muon_matrix_step)",
         g.R, g.C, split_dim == kTpSplitRows ? "rows" : "columns");
  // X_r (s x ll): the block itself for a column split, its transpose for a row split.
  const bool transpose = split_dim == kTpSplitRows;
  const std::int64_t s = transpose ? g.C : g.R, ll = transpose ? g.lr : g.lc;
  if (s > INT_MAX / s || ll > INT_MAX) fail("tensor-parallel muon: matrix too large");
  float* u = scratch;
  float* x = u + g.block;
  float* y = x + s * ll;
  float* a = y + s * ll;
  float* b = a + s * s;
  const int S = static_cast<int>(s), L = static_cast<int>(ll);
  const float ka = static_cast<float>(c.coeffs.a), kb = static_cast<float>(c.coeffs.b),
              kc = static_cast<float>(c.coeffs.c);
  const float beta = static_cast<float>(c.momentum), one_beta = static_cast<float>(1.0 - c.momentum);
  const float keep = static_cast<float>(1.0 - (decay ? lr * c.weight_decay : 0.0));
  const auto sum_all = [&](double v) {
    PeerWait wait("MPI_Allreduce (tensor-parallel muon, norm)");
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_SUM, comm), "MPI_Allreduce (tensor-parallel muon)");
    return v;
  };
  for (std::int64_t e = 0; e < g.E; ++e) {
    float* p = param + e * g.block;
    const float* gr = grad + e * g.block;
    float* m = momentum + e * g.block;
    double sq = 0;
    for (std::int64_t i = 0; i < g.block; ++i) {
      float gi = grad_scale * gr[i];
      float mi = beta * m[i] + one_beta * gi;
      m[i] = mi;
      u[i] = c.nesterov ? one_beta * gi + beta * mi : mi;
      sq += static_cast<double>(u[i]) * u[i];
    }
    // X_0 = G / (||G||_F + eps), as newton_schulz (eps 1e-7).
    const float inv = static_cast<float>(1.0 / (std::sqrt(sum_all(sq)) + 1e-7f));
    if (transpose) {
      for (std::int64_t i = 0; i < g.lr; ++i)
        for (std::int64_t j = 0; j < g.lc; ++j) x[j * ll + i] = u[i * g.lc + j] * inv;
    } else {
      for (std::int64_t i = 0; i < g.block; ++i) x[i] = u[i] * inv;
    }
    for (int it = 0; it < c.ns_steps; ++it) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, S, S, L, 1.0f, x, L, x, L, 0.0f, a, S);
      {
        PeerWait wait("MPI_Allreduce (tensor-parallel muon, Gram matrix)");
        mpi_check(MPI_Allreduce(MPI_IN_PLACE, a, S * S, MPI_FLOAT, MPI_SUM, comm),
                  "MPI_Allreduce (tensor-parallel muon)");
      }
      for (std::int64_t i = 0; i < s * s; ++i) b[i] = kb * a[i];
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, S, S, S, kc, a, S, a, S, 1.0f, b, S);
      for (std::int64_t i = 0; i < s * ll; ++i) y[i] = ka * x[i];
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, S, L, S, 1.0f, b, S, x, L, 1.0f, y, L);
      std::swap(x, y);
    }
    if (transpose) {
      for (std::int64_t i = 0; i < g.lr; ++i)
        for (std::int64_t j = 0; j < g.lc; ++j) u[i * g.lc + j] = x[j * ll + i];
    } else {
      std::copy(x, x + g.block, u);
    }
    double k = optim::muon_scale(c, g.R, g.C);
    if (c.scale == optim::MuonScale::kExactRms) {
      double osq = 0;
      for (std::int64_t i = 0; i < g.block; ++i) osq += static_cast<double>(u[i]) * u[i];
      const double rms = std::sqrt(sum_all(osq) / static_cast<double>(g.R * g.C));
      k = rms > 0 ? c.rms_target / rms : 0.0;
    }
    const float kf = static_cast<float>(k), step = static_cast<float>(lr * k);
    for (std::int64_t i = 0; i < g.block; ++i) p[i] = p[i] * keep - step * u[i];
    if (update_out)
      for (std::int64_t i = 0; i < g.block; ++i) update_out[e * g.block + i] = kf * u[i];
  }
}

TpMuonSplit tp_muon_split(const optim::ParamInfo& p, int tensor_size) {
  const int nd = p.ndim();
  if (nd < 2) fail("tensor-parallel muon: parameter '{}' has {} dims; Muon needs >= 2", p.name, nd);
  const auto axes = [&](int d) -> const std::vector<mesh::Axis>& {
    static const std::vector<mesh::Axis> none;
    return static_cast<std::size_t>(d) < p.placement.dims.size() ? p.placement.dims[static_cast<std::size_t>(d)]
                                                                  : none;
  };
  const auto has_tp = [&](int d) {
    const auto& a = axes(d);
    return std::find(a.begin(), a.end(), mesh::Axis::kTensor) != a.end();
  };
  for (int d : {nd - 2, nd - 1})
    for (mesh::Axis a : axes(d))
      if (a != mesh::Axis::kTensor)
        fail("tensor-parallel muon: parameter '{}' has matrix dimension {} split over the {} axis (only tp is supported)",
             p.name, d, mesh::axis_name(a));
  const bool rows = has_tp(nd - 2), cols = has_tp(nd - 1);
  if (rows && cols) fail("tensor-parallel muon: parameter '{}' is split over tp along both matrix dimensions", p.name);
  TpMuonSplit s;
  if (!rows && !cols) return s;
  s.split = true;
  s.split_dim = rows ? kTpSplitRows : kTpSplitCols;
  const int d = rows ? nd - 2 : nd - 1;
  if (p.global_shape.size() == p.shape.size() &&
      p.global_shape[static_cast<std::size_t>(d)] != p.shape[static_cast<std::size_t>(d)] * tensor_size)
    fail("tensor-parallel muon: parameter '{}' dimension {} is {} here and {} whole, not split over {} tensor ranks",
         p.name, d, p.shape[static_cast<std::size_t>(d)], p.global_shape[static_cast<std::size_t>(d)], tensor_size);
  if (rows && d == 0) s.row_parts = p.placement.parts;
  return s;
}

TensorParallelMuon::TensorParallelMuon(const optim::MuonConfig& c, MPI_Comm tensor_comm) : c_(c), comm_(tensor_comm) {
  optim::validate(c_);
  if (comm_ == MPI_COMM_NULL) fail("tensor-parallel muon: no communicator");
  mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
}

void TensorParallelMuon::set_step_count(std::int64_t t) {
  if (t < 0) fail("muon: step count must be >= 0, got {}", t);
  t_ = t;
}

void TensorParallelMuon::step_param(const optim::ParamInfo& p, float* param, const float* grad, float* momentum,
                                    double lr, float grad_scale, int owner) {
  if (p.optimizer != optim::OptimizerKind::kMuon) fail("muon: parameter '{}' is not in a Muon group", p.name);
  if (p.ndim() < 2) fail("muon: parameter '{}' has {} dims; Muon needs >= 2", p.name, p.ndim());
  if (!(std::isfinite(lr) && lr >= 0)) fail("muon: lr must be finite and >= 0, got {}", lr);
  if (!std::isfinite(grad_scale)) fail("muon: grad_scale is not finite ({})", grad_scale);
  const TpMuonSplit s = tp_muon_split(p, size_);
  const double plr = lr * p.lr_scale;
  if (!s.split) {
    auto need = static_cast<std::size_t>(optim::muon_scratch_floats(p.rows(), p.cols()));
    if (scratch_.size() < need) scratch_.resize(need);
    optim::muon_matrix_step(param, grad, momentum, p.matrices(), p.rows(), p.cols(), c_, plr, p.weight_decay,
                            grad_scale, scratch_.data());
    return;
  }
  auto need = static_cast<std::size_t>(tp_muon_scratch_floats(p.matrices(), p.rows(), p.cols(), s.split_dim, size_));
  if (scratch_.size() < need) scratch_.resize(need);
  tp_muon_matrix_step(param, grad, momentum, p.matrices(), p.rows(), p.cols(), s.split_dim, c_, plr, p.weight_decay,
                      grad_scale, owner, comm_, scratch_.data(), s.row_parts);
}

void TensorParallelMuon::step(const optim::ParamLayout& layout, float* params, const float* grads, float* momentum,
                              double lr, float grad_scale) {
  if (!(std::isfinite(lr) && lr >= 0)) fail("muon: lr must be finite and >= 0, got {}", lr);
  if (!std::isfinite(grad_scale)) fail("muon: grad_scale is not finite ({})", grad_scale);
  ++t_;
  // Tensor-split parameters in batches of at most max_batch_floats_ local floats (a parameter
  // larger than that is a batch alone); the others locally, in layout order.
  std::vector<TpMuonTensor> batch;
  std::int64_t batch_floats = 0;
  const auto flush = [&] {
    if (!batch.empty()) tp_muon_step_batch(batch, c_, grad_scale, comm_, scratch_);
    batch.clear();
    batch_floats = 0;
  };
  for (const auto& p : layout.params) {
    if (p.optimizer != optim::OptimizerKind::kMuon) continue;
    if (p.ndim() < 2) fail("muon: parameter '{}' has {} dims; Muon needs >= 2", p.name, p.ndim());
    TpMuonSplit s = tp_muon_split(p, size_);
    if (!s.split) {
      step_param(p, params + p.offset, grads + p.offset, momentum + p.offset, lr, grad_scale, 0);
      continue;
    }
    if (batch_floats > 0 && batch_floats + p.numel > max_batch_floats_) flush();
    TpMuonTensor t;
    t.param = params + p.offset;
    t.grad = grads + p.offset;
    t.momentum = momentum + p.offset;
    t.matrices = p.matrices();
    t.local_rows = p.rows();
    t.local_cols = p.cols();
    t.split_dim = s.split_dim;
    t.row_parts = std::move(s.row_parts);
    t.lr = lr * p.lr_scale;
    t.decay = p.weight_decay;
    batch.push_back(std::move(t));
    batch_floats += p.numel;
  }
  flush();
}

void TensorParallelMuon::set_max_batch_floats(std::int64_t n) {
  if (n < 1) fail("tensor-parallel muon: batch limit must be >= 1 float, got {}", n);
  max_batch_floats_ = n;
}

}  // namespace keel::parallel
