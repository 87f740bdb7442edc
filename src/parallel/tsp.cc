#include "parallel/tsp.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "common/error.h"
#include "common/mpi_session.h"
#include "mesh/placement.h"

namespace keel::parallel {

Tensor TspAccumulator::like(std::vector<float>& buf, const Tensor& t) {
  if (buf.size() < static_cast<std::size_t>(t.numel())) buf.resize(static_cast<std::size_t>(t.numel()));
  return Tensor(buf.data(), {t.dim(0), t.numel() / std::max<std::int64_t>(t.dim(0), 1)});
}

Tensor TspAccumulator::out(const Tensor& y) { return first_ ? y : like(out_, y); }

void TspAccumulator::exit(const Tensor& partial, const Tensor& y) {
  if (!first_) add_into(y, partial);
}

Tensor TspAccumulator::dx_out(const Tensor& dx) { return first_ ? dx : like(dx_, dx); }

void TspAccumulator::enter_backward(const Tensor& partial, const Tensor& dx) {
  if (!first_) add_into(dx, partial);
}

namespace {

bool attention_slot(blocks::Slot s) {
  using blocks::Slot;
  switch (s) {
    case Slot::kWq: case Slot::kWk: case Slot::kWv: case Slot::kWo: case Slot::kCcaWqk: case Slot::kCcaWv:
    case Slot::kCcaConv0W: case Slot::kCcaConv0B: case Slot::kCcaConv1W: case Slot::kCcaConv1B: case Slot::kCcaTemp:
    case Slot::kCcaWo:
      return true;
    default:
      return false;
  }
}

bool mlp_slot(blocks::Slot s) {
  using blocks::Slot;
  return s == Slot::kGate || s == Slot::kUp || s == Slot::kDown || s == Slot::kExpertGate || s == Slot::kExpertUp ||
         s == Slot::kExpertDown;
}

void wait(MPI_Request* r) {
  if (*r != MPI_REQUEST_NULL) mpi_check(MPI_Wait(r, MPI_STATUS_IGNORE), "MPI_Wait");
}

}  // namespace

TspShards::TspShards(MPI_Comm tsp) : group_(tsp) {
  if (tsp != MPI_COMM_NULL) mpi_check(MPI_Comm_dup(tsp, &comm_), "MPI_Comm_dup");
}

TspShards::~TspShards() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

int tsp_unit(const optim::ParamInfo& p, int layers) {
  if (!p.placement.splits(mesh::Axis::kTensor)) return -1;
  const blocks::ParamRole role = blocks::role_of(p.name);
  if (role.slot == blocks::Slot::kEmbed) return 2 * layers;
  if (role.slot == blocks::Slot::kLmHead) return 2 * layers + 1;
  if (role.layer >= 0 && role.layer < layers && (attention_slot(role.slot) || mlp_slot(role.slot)))
    return 2 * role.layer + (attention_slot(role.slot) ? 0 : 1);
  fail("tsp: parameter '{}' is split but belongs to no sub-block", p.name);
}

TspSizes tsp_sizes(const optim::ParamLayout& layout, int layers) {
  std::vector<std::int64_t> floats(static_cast<std::size_t>(layers) * 2, 0);
  std::int64_t layer_most = 0, width = 1, rows = 0;
  TspSizes z;
  for (const auto& p : layout.params) {
    const int i = tsp_unit(p, layers);
    if (i < 0) continue;
    if (i < 2 * layers) {
      layer_most = std::max(layer_most, floats[static_cast<std::size_t>(i)] += p.numel);
    } else {
      width = p.shape.back(), rows = std::max(rows, p.shape.front());
      z.own_head = z.own_head || i == 2 * layers + 1;
    }
  }
  // table pieces no larger than a layer's shard, and at least 64 rows (a table of a model with
  // tiny layers goes in few messages)
  z.piece_rows = std::min(rows, std::max<std::int64_t>(64, layer_most / std::max<std::int64_t>(width, 1)));
  z.largest = std::max(layer_most, z.piece_rows * width);
  return z;
}

void TspShards::bind(const optim::ParamLayout& layout, const blocks::WeightViews& params,
                     const blocks::WeightViews& grads) {
  w_ = params;
  g_ = grads;
  const int layers = static_cast<int>(w_.layers.size());
  units_.assign(static_cast<std::size_t>(layers) * 2, Unit{});
  for (const auto& p : layout.params) {
    const int i = tsp_unit(p, layers);
    if (i < 0 || i >= 2 * layers) continue;  // replicated: read in place; the tables: table_sweep
    Unit& u = units_[static_cast<std::size_t>(i)];
    u.slices.push_back({blocks::role_of(p.name).slot, p.numel, u.floats, p.shape});
    u.floats += p.numel;
  }
  sizes_ = tsp_sizes(layout, layers);
  const std::int64_t largest = sizes_.largest;
  if (largest > INT_MAX) fail("tsp: a shard of {} floats is beyond one MPI message", largest);
  for (int i = 0; i < 2; ++i) {
    shard_[i].assign(static_cast<std::size_t>(largest), 0.f);
    grad_[i].assign(static_cast<std::size_t>(largest), 0.f);
  }
  sum_.assign(static_cast<std::size_t>(largest), 0.f);
}

const TspShards::Unit& TspShards::unit(int layer, Part part) const {
  if (part != Part::kAttention && part != Part::kMlp) fail("tsp: the vocabulary tables are visited by table_sweep");
  return units_.at(static_cast<std::size_t>(layer) * 2 + (part == Part::kAttention ? 0 : 1));
}

void TspShards::post(int layer, const Unit& u, int r, float* buf, MPI_Request* req) {
  *req = MPI_REQUEST_NULL;
  if (u.floats == 0) return;
  if (r == rank())  // the root packs its slices
    for (const Slice& s : u.slices)
      std::memcpy(buf + s.at, blocks::layer_slot(w_.layers[static_cast<std::size_t>(layer)], s.slot)->data(),
                  sizeof(float) * static_cast<std::size_t>(s.numel));
  mpi_check(MPI_Ibcast(buf, static_cast<int>(u.floats), MPI_FLOAT, r, comm_, req), "MPI_Ibcast");
}

blocks::LayerWeights TspShards::view(const blocks::WeightViews& base, int layer, const Unit& u, float* buf) const {
  blocks::LayerWeights v = base.layers[static_cast<std::size_t>(layer)];
  if (!buf) return v;
  for (const Slice& s : u.slices) {
    Tensor* t = blocks::layer_slot(v, s.slot);
    const auto& d = s.shape;
    float* at = buf + s.at;
    *t = d.size() == 1 ? Tensor(at, {d[0]}) : d.size() == 2 ? Tensor(at, {d[0], d[1]}) : Tensor(at, {d[0], d[1], d[2]});
  }
  return v;
}

template <typename Compute>
void TspShards::sweep(int layer, const Unit& u, bool backward, Compute&& compute) {
  MPI_Request req = MPI_REQUEST_NULL, reduce[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  post(layer, u, 0, shard_[0].data(), &req);
  for (int r = 0; r < size(); ++r) {
    wait(&req);
    float* buf = shard_[r % 2].data();
    if (r + 1 < size()) post(layer, u, r + 1, shard_[(r + 1) % 2].data(), &req);  // prefetch the next shard
    const blocks::LayerWeights w = view(w_, layer, u, r == rank() ? nullptr : buf);
    acc_.begin(r == 0);
    if (!backward) {
      compute(r, w, nullptr);
      continue;
    }
    float* gbuf = grad_[r % 2].data();
    wait(&reduce[r % 2]);  // the shard before last's sum has left this buffer
    std::fill(gbuf, gbuf + u.floats, 0.f);
    blocks::LayerWeights g = view(g_, layer, u, gbuf);
    compute(r, w, &g);
    if (u.floats > 0)  // every rank's share of shard r's gradients, summed on rank r
      mpi_check(MPI_Ireduce(gbuf, r == rank() ? sum_.data() : nullptr, static_cast<int>(u.floats), MPI_FLOAT, MPI_SUM, r,
                            comm_, &reduce[r % 2]),
                "MPI_Ireduce");
  }
  if (!backward) return;
  wait(&reduce[0]);
  wait(&reduce[1]);
  add_sum(layer, u);
}

template <typename Compute>
void TspShards::ring(int layer, const Unit& u, bool backward, Compute&& compute) {
  const int D = size(), s = rank(), next = (s + 1) % D, prev = (s + D - 1) % D;
  const int n = static_cast<int>(u.floats);
  constexpr int kWeights = 1, kGrads = 2;
  if (n > 0)  // this rank's shard travels first
    for (const Slice& sl : u.slices)
      std::memcpy(shard_[0].data() + sl.at, blocks::layer_slot(w_.layers[static_cast<std::size_t>(layer)], sl.slot)->data(),
                  sizeof(float) * static_cast<std::size_t>(sl.numel));
  MPI_Request wreq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL}, gsend[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  MPI_Request grecv = MPI_REQUEST_NULL;
  for (int k = 0; k < D; ++k) {
    const int j = (s - k + D) % D;  // the shard this rank holds at step k
    float* buf = shard_[k % 2].data();
    if (k + 1 < D && n > 0) {  // pass it on while computing with it; the next one arrives from prev
      mpi_check(MPI_Isend(buf, n, MPI_FLOAT, next, kWeights, comm_, &wreq[0]), "MPI_Isend");
      mpi_check(MPI_Irecv(shard_[(k + 1) % 2].data(), n, MPI_FLOAT, prev, kWeights, comm_, &wreq[1]), "MPI_Irecv");
    }
    const blocks::LayerWeights w = view(w_, layer, u, k == 0 ? nullptr : buf);
    acc_.begin(k == 0);
    if (!backward) {
      compute(j, w, nullptr);
    } else {
      // Shard j's gradients ride the ring behind its weights: the ranks that held it before
      // this one summed theirs into the message from prev; this rank adds its share and passes
      // the sum on, the last holder to j's rank itself.
      if (k > 0 && n > 0) mpi_check(MPI_Irecv(sum_.data(), n, MPI_FLOAT, prev, kGrads, comm_, &grecv), "MPI_Irecv");
      float* gbuf = grad_[k % 2].data();
      wait(&gsend[k % 2]);
      std::fill(gbuf, gbuf + n, 0.f);
      blocks::LayerWeights g = view(g_, layer, u, gbuf);
      compute(j, w, &g);
      if (n > 0) {
        if (k > 0) {
          wait(&grecv);
          for (int i = 0; i < n; ++i) gbuf[i] += sum_[static_cast<std::size_t>(i)];
        }
        mpi_check(MPI_Isend(gbuf, n, MPI_FLOAT, next, kGrads, comm_, &gsend[k % 2]), "MPI_Isend");
      }
    }
    wait(&wreq[0]);
    wait(&wreq[1]);
  }
  if (!backward || n == 0) return;
  // This rank's own shard, summed over every rank, comes back from prev.
  mpi_check(MPI_Recv(sum_.data(), n, MPI_FLOAT, prev, kGrads, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
  wait(&gsend[0]);
  wait(&gsend[1]);
  add_sum(layer, u);
}

void TspShards::add_sum(int layer, const Unit& u) {
  for (const Slice& s : u.slices) {  // accumulated, as every block's gradients are
    float* d = blocks::layer_slot(g_.layers[static_cast<std::size_t>(layer)], s.slot)->data();
    for (std::int64_t i = 0; i < s.numel; ++i) d[i] += sum_[static_cast<std::size_t>(s.at + i)];
  }
}

void TspShards::forward(int layer, Part part, const Forward& fn) {
  const auto compute = [&](int r, const blocks::LayerWeights& w, blocks::LayerWeights*) { fn(r, w, acc_); };
  if (part == Part::kMlp) return ring(layer, unit(layer, part), false, compute);
  sweep(layer, unit(layer, part), false, compute);
}

void TspShards::backward(int layer, Part part, const Backward& fn) {
  const auto compute = [&](int r, const blocks::LayerWeights& w, blocks::LayerWeights* g) { fn(r, w, *g, acc_); };
  if (part == Part::kMlp) return ring(layer, unit(layer, part), true, compute);
  sweep(layer, unit(layer, part), true, compute);
}

// Every shard's rows in pieces of at most sizes_.piece_rows (contiguous in the owner's table: it
// broadcasts from the table itself), the next piece's broadcast posted before the current one
// is computed; in backward each piece's gradients summed onto its owner and added to its rows.
void TspShards::table_sweep(Part table, bool backward, const TableBackward& fn) {
  // a tied head has no parameter of its own: its shards are the embedding's
  const bool head = table == Part::kHead && sizes_.own_head;
  const Tensor own = head ? w_.lm_head : w_.embed, own_grad = head ? g_.lm_head : g_.embed;
  const std::int64_t rows = own.dim(0), width = own.dim(1), piece = std::max<std::int64_t>(1, sizes_.piece_rows);
  struct Item {
    int shard;
    std::int64_t first, rows;  // in the shard's rows
  };
  std::vector<Item> items;
  for (int r = 0; r < size(); ++r)
    for (std::int64_t c = 0; c < rows; c += piece) items.push_back({r, c, std::min(piece, rows - c)});
  const auto post = [&](std::size_t i, MPI_Request* req) {
    const Item& it = items[i];
    float* buf = it.shard == rank() ? own.row(it.first) : shard_[i % 2].data();
    mpi_check(MPI_Ibcast(buf, static_cast<int>(it.rows * width), MPI_FLOAT, it.shard, comm_, req), "MPI_Ibcast");
  };
  MPI_Request req = MPI_REQUEST_NULL, reduce[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  // A piece this rank owns is summed into sum_ (one at a time): added to its gradient rows once
  // that reduction is done, before the next such piece's is posted.
  int owned_slot = -1;
  std::int64_t owned_first = 0, owned_rows = 0;
  const auto add_owned = [&] {
    if (owned_slot < 0) return;
    wait(&reduce[owned_slot]);
    float* d = own_grad.row(owned_first);
    for (std::int64_t j = 0; j < owned_rows * width; ++j) d[j] += sum_[static_cast<std::size_t>(j)];  // accumulated
    owned_slot = -1;
  };
  post(0, &req);
  for (std::size_t i = 0; i < items.size(); ++i) {
    wait(&req);
    const Item& it = items[i];
    if (i + 1 < items.size()) post(i + 1, &req);
    const float* at = it.shard == rank() ? own.row(it.first) : shard_[i % 2].data();
    const Tensor w(const_cast<float*>(at), {it.rows, width});
    const std::int64_t first = rows * it.shard + it.first;  // the vocabulary id of its first row
    if (!backward) {
      fn(it.shard, first, w, Tensor());
      continue;
    }
    const int slot = static_cast<int>(i % 2);
    if (owned_slot == slot) add_owned();
    wait(&reduce[slot]);  // the piece before last's sum has left this buffer
    float* gbuf = grad_[slot].data();
    std::fill(gbuf, gbuf + it.rows * width, 0.f);
    fn(it.shard, first, w, Tensor(gbuf, {it.rows, width}));
    if (it.shard == rank()) add_owned();  // sum_ is free again
    mpi_check(MPI_Ireduce(gbuf, it.shard == rank() ? sum_.data() : nullptr, static_cast<int>(it.rows * width), MPI_FLOAT,
                          MPI_SUM, it.shard, comm_, &reduce[slot]),
              "MPI_Ireduce");
    if (it.shard == rank()) owned_slot = slot, owned_first = it.first, owned_rows = it.rows;
  }
  if (!backward) return;
  add_owned();
  wait(&reduce[0]);
  wait(&reduce[1]);
}

void TspShards::forward(Part table, const TableForward& fn) {
  table_sweep(table, false, [&](int r, std::int64_t first, const Tensor& w, const Tensor&) { fn(r, first, w); });
}

void TspShards::backward(Part table, const TableBackward& fn) { table_sweep(table, true, fn); }

}  // namespace keel::parallel
