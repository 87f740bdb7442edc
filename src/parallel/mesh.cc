#include "parallel/mesh.h"

#include <fmt/format.h>

#include <array>
#include <mutex>
#include <vector>

#include "common/error.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"

namespace keel::parallel {

const char* group_name(GroupKind g) {
  switch (g) {
    case GroupKind::kData: return "data";
    case GroupKind::kExpert: return "expert";
    case GroupKind::kExpertData: return "expert-data";
    case GroupKind::kTensor: return "tensor";
    case GroupKind::kContext: return "context";
    case GroupKind::kTsp: return "tsp";
    case GroupKind::kPipeline: return "pipeline";
  }
  return "?";
}

struct Mesh::State {
  mesh::Shape shape;
  mesh::Coord coord;
  int rank = 0, size = 1;
  MPI_Comm world = MPI_COMM_NULL;  // the launch's (not owned)
  std::array<Group, kGroupKinds> groups{};
  std::vector<MPI_Comm> owned;  // sub-communicators this mesh split off (freed with it)
  std::mutex nccl_mu;           // abort_all() may run on the watchdog's thread
  std::array<std::shared_ptr<NcclGroup>, kGroupKinds> nccl{};
  std::array<std::shared_ptr<NcclGroup>, kGroupKinds> side{};  // nccl_side()

  ~State() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto& n : side) n.reset();
    for (auto& n : nccl) n.reset();  // NCCL communicators before the MPI ones they were built over
    for (MPI_Comm& c : owned) MPI_Comm_free(&c);
  }
};

Mesh::Mesh() : s_(std::make_shared<State>()) {}

namespace {

// The key that puts rank r's group of kind g together: every coordinate but the group's own.
// Ranks are ordered inside a group by their world rank, so group ranks follow the coordinates.
int color_of(const mesh::Shape& s, const mesh::Coord& c, GroupKind g) {
  const int j = c.dp * s.cp + c.cp;  // position in the data block (dp * cp)
  int color = c.pp;
  auto mix = [&color](int v, int n) { color = color * n + v; };
  switch (g) {
    case GroupKind::kData:  // differs in dp and cp
      mix(c.tsp, s.tsp), mix(c.tp, s.tp);
      break;
    case GroupKind::kExpert:  // differs in the expert coordinate: consecutive j of one block of ep
      mix(j / s.ep, s.dp * s.cp / s.ep), mix(c.tsp, s.tsp), mix(c.tp, s.tp);
      break;
    case GroupKind::kExpertData:  // differs in j / ep
      mix(j % s.ep, s.ep), mix(c.tsp, s.tsp), mix(c.tp, s.tp);
      break;
    case GroupKind::kTensor:
      mix(c.dp, s.dp), mix(c.cp, s.cp), mix(c.tsp, s.tsp);
      break;
    case GroupKind::kContext:
      mix(c.dp, s.dp), mix(c.tsp, s.tsp), mix(c.tp, s.tp);
      break;
    case GroupKind::kTsp:
      mix(c.dp, s.dp), mix(c.cp, s.cp), mix(c.tp, s.tp);
      break;
    case GroupKind::kPipeline:
      color = 0;
      mix(c.dp, s.dp), mix(c.cp, s.cp), mix(c.tsp, s.tsp), mix(c.tp, s.tp);
      break;
  }
  return color;
}

int group_size(const mesh::Shape& s, GroupKind g) {
  switch (g) {
    case GroupKind::kData: return s.dp * s.cp;
    case GroupKind::kExpert: return s.ep;
    case GroupKind::kExpertData: return s.dp * s.cp / s.ep;
    case GroupKind::kTensor: return s.tp;
    case GroupKind::kContext: return s.cp;
    case GroupKind::kTsp: return s.tsp;
    case GroupKind::kPipeline: return s.pp;
  }
  return 1;
}

}  // namespace

Mesh::Mesh(const mesh::Shape& shape, MPI_Comm world, const std::string& what) : s_(std::make_shared<State>()) {
  mesh::validate(shape, what);
  State& st = *s_;
  st.shape = shape;
  st.world = world;
  if (world != MPI_COMM_NULL) {
    mpi_check(MPI_Comm_rank(world, &st.rank), "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(world, &st.size), "MPI_Comm_size");
  }
  if (shape.world() != st.size)
    throw UsageError(fmt::format("{}: the layout {} spans {} ranks (pp*dp*cp*tsp*tp), but {} are running", what,
                                 shape.str(), shape.world(), st.size));
  st.coord = shape.coord(st.rank);
  for (int k = 0; k < kGroupKinds; ++k) {
    const auto g = static_cast<GroupKind>(k);
    Group& grp = st.groups[static_cast<std::size_t>(k)];
    grp.size = group_size(shape, g);
    if (grp.size == 1) continue;  // a group of this rank alone: no communicator
    if (grp.size == st.size) {
      // The whole world (the common case of one axis, e.g. pure data parallelism): no split, so
      // that a one-axis run uses the launch's communicator as before.
      grp.comm = world;
      mpi_check(MPI_Comm_rank(world, &grp.rank), "MPI_Comm_rank");
      continue;
    }
    MPI_Comm c = MPI_COMM_NULL;
    PeerWait wait("MPI_Comm_split (the mesh's groups)");
    mpi_check(MPI_Comm_split(world, color_of(shape, st.coord, g), st.rank, &c),
              fmt::format("MPI_Comm_split ({} group)", group_name(g)).c_str());
    st.owned.push_back(c);
    grp.comm = c;
    int n = 0;
    mpi_check(MPI_Comm_rank(c, &grp.rank), "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(c, &n), "MPI_Comm_size");
    if (n != grp.size) fail("mesh: the {} group has {} ranks, expected {}", group_name(g), n, grp.size);
  }
}

const mesh::Shape& Mesh::shape() const { return s_->shape; }
const mesh::Coord& Mesh::coord() const { return s_->coord; }
int Mesh::rank() const { return s_->rank; }
int Mesh::size() const { return s_->size; }
MPI_Comm Mesh::world() const { return s_->world; }
const Group& Mesh::group(GroupKind g) const { return s_->groups[static_cast<std::size_t>(g)]; }

namespace {
std::shared_ptr<NcclGroup> made_once(std::mutex& mu, std::shared_ptr<NcclGroup>& slot, MPI_Comm comm) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (slot) return slot;
  }
  // Collective over the group: made outside the lock (abort_all() must not wait for it).
  std::shared_ptr<NcclGroup> made = make_nccl_group(comm);
  std::lock_guard<std::mutex> lock(mu);
  slot = std::move(made);
  return slot;
}
}  // namespace

std::shared_ptr<NcclGroup> Mesh::nccl(GroupKind g) {
  return made_once(s_->nccl_mu, s_->nccl[static_cast<std::size_t>(g)], group(g).comm);
}

std::shared_ptr<NcclGroup> Mesh::nccl_side(GroupKind g) {
  return made_once(s_->nccl_mu, s_->side[static_cast<std::size_t>(g)], group(g).comm);
}

void Mesh::abort_all() {
  std::lock_guard<std::mutex> lock(s_->nccl_mu);
  for (auto& n : s_->nccl)
    if (n) n->abort();
  for (auto& n : s_->side)
    if (n) n->abort();
}

}  // namespace keel::parallel
