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

void TspShards::bind(const optim::ParamLayout& layout, const blocks::WeightViews& params,
                     const blocks::WeightViews& grads) {
  w_ = params;
  g_ = grads;
  units_.assign(w_.layers.size() * 2, Unit{});
  largest_ = 0;
  for (const auto& p : layout.params) {
    if (!p.placement.splits(mesh::Axis::kTensor)) continue;  // replicated: read in place
    const blocks::ParamRole role = blocks::role_of(p.name);
    if (role.layer < 0) continue;  // the embedding and the head: vocabulary-parallel
    const bool attn = attention_slot(role.slot);
    if (!attn && !mlp_slot(role.slot)) fail("tsp: parameter '{}' is split but belongs to no sub-block", p.name);
    Unit& u = units_[static_cast<std::size_t>(role.layer) * 2 + (attn ? 0 : 1)];
    u.slices.push_back({role.slot, p.numel, u.floats, p.shape});
    u.floats += p.numel;
    largest_ = std::max(largest_, u.floats);
  }
  if (largest_ > INT_MAX) fail("tsp: a sub-block shard of {} floats is beyond one MPI message", largest_);
  for (int i = 0; i < 2; ++i) {
    shard_[i].assign(static_cast<std::size_t>(largest_), 0.f);
    grad_[i].assign(static_cast<std::size_t>(largest_), 0.f);
  }
  sum_.assign(static_cast<std::size_t>(largest_), 0.f);
}

const TspShards::Unit& TspShards::unit(int layer, Part part) const {
  return units_.at(static_cast<std::size_t>(layer) * 2 + (part == Part::kAttention ? 0 : 1));
}

void TspShards::post(int layer, const Unit& u, int r, float* buf, MPI_Request* req) {
  *req = MPI_REQUEST_NULL;
  if (u.floats == 0) return;
  if (r == rank()) {  // the root packs its slices
    blocks::LayerWeights& own = w_.layers[static_cast<std::size_t>(layer)];
    for (const Slice& s : u.slices)
      std::memcpy(buf + s.at, blocks::layer_slot(own, s.slot)->data(), sizeof(float) * static_cast<std::size_t>(s.numel));
  }
  mpi_check(MPI_Ibcast(buf, static_cast<int>(u.floats), MPI_FLOAT, r, comm_, req), "MPI_Ibcast");
}

blocks::LayerWeights TspShards::view(const blocks::WeightViews& base, int layer, const Unit& u, float* buf) const {
  blocks::LayerWeights L = base.layers[static_cast<std::size_t>(layer)];
  if (!buf) return L;
  for (const Slice& s : u.slices) {
    Tensor* t = blocks::layer_slot(L, s.slot);
    const auto& d = s.shape;
    float* at = buf + s.at;
    *t = d.size() == 1 ? Tensor(at, {d[0]}) : d.size() == 2 ? Tensor(at, {d[0], d[1]}) : Tensor(at, {d[0], d[1], d[2]});
  }
  return L;
}

void TspShards::forward(int layer, Part part, const Forward& fn) {
  const Unit& u = unit(layer, part);
  MPI_Request req = MPI_REQUEST_NULL;
  post(layer, u, 0, shard_[0].data(), &req);
  for (int r = 0; r < size(); ++r) {
    wait(&req);
    float* buf = shard_[r % 2].data();
    if (r + 1 < size()) post(layer, u, r + 1, shard_[(r + 1) % 2].data(), &req);  // prefetch the next shard
    const blocks::LayerWeights w = view(w_, layer, u, r == rank() ? nullptr : buf);
    acc_.begin(r == 0);
    fn(r, w, acc_);
  }
}

void TspShards::backward(int layer, Part part, const Backward& fn) {
  const Unit& u = unit(layer, part);
  MPI_Request req = MPI_REQUEST_NULL, reduce[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  post(layer, u, 0, shard_[0].data(), &req);
  for (int r = 0; r < size(); ++r) {
    wait(&req);
    float* buf = shard_[r % 2].data();
    if (r + 1 < size()) post(layer, u, r + 1, shard_[(r + 1) % 2].data(), &req);
    float* gbuf = grad_[r % 2].data();
    wait(&reduce[r % 2]);  // the shard before last's sum has left this buffer
    std::fill(gbuf, gbuf + u.floats, 0.f);
    const blocks::LayerWeights w = view(w_, layer, u, r == rank() ? nullptr : buf);
    blocks::LayerWeights g = view(g_, layer, u, gbuf);
    acc_.begin(r == 0);
    fn(r, w, g, acc_);
    if (u.floats > 0)  // every rank's share of shard r's gradients, summed on rank r
      mpi_check(MPI_Ireduce(gbuf, r == rank() ? sum_.data() : nullptr, static_cast<int>(u.floats), MPI_FLOAT, MPI_SUM, r,
                            comm_, &reduce[r % 2]),
                "MPI_Ireduce");
  }
  wait(&reduce[0]);
  wait(&reduce[1]);
  blocks::LayerWeights& own = g_.layers[static_cast<std::size_t>(layer)];
  for (const Slice& s : u.slices) {  // accumulated, as every block's gradients are
    float* d = blocks::layer_slot(own, s.slot)->data();
    for (std::int64_t i = 0; i < s.numel; ++i) d[i] += sum_[static_cast<std::size_t>(s.at + i)];
  }
}

}  // namespace keel::parallel
