// The one vocabulary of parallel layouts: named mesh axes, their degrees, and where a rank sits
// on each. `keel train` (parallel/mesh.h builds its process groups from a Shape), checkpoint
// placements (ckpt/layout.h) and `keel size` layouts all speak it; no MPI here.
//
// Axes and their short names (as written in configs, `--layout` strings and checkpoint metadata):
//   pp   pipeline  (reserved: keel train has no pipeline schedule yet)
//   dp   data      replicas of the model that split the batch
//   cp   context   each sequence's tokens split over cp ranks
//   tsp  tsp       tensor and sequence parallelism folded on one axis
//   tp   tensor    Megatron tensor parallelism (with sequence parallelism as an option)
//   ep   expert    the experts of each MoE layer split over ep ranks
// world = pp * dp * cp * tsp * tp. Expert parallelism takes no ranks of its own: it is folded
// into the dp * cp ranks (as Megatron, DeepSpeed-MoE and torchtitan fold it), so ep divides
// dp * cp; the dp * cp / ep ranks holding the same experts are the expert-data ranks ("edp"),
// over which expert gradients are reduced and expert optimizer states are ZeRO-sharded.
//
// Rank order (outermost first): rank = (((pp * dp + d) * cp + c) * tsp + s) * tp + t, so a
// tensor group is tp consecutive ranks. Inside the dp * cp block, with j = d * cp + c, the
// expert coordinate is j % ep and the expert-data coordinate j / ep: an expert group is ep
// ranks of consecutive j.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace keel::mesh {

enum class Axis { kPipeline, kData, kContext, kTsp, kTensor, kExpert };

// Every axis, in rank order (pp outermost ... tp innermost), then ep.
inline constexpr std::array<Axis, 6> kAxes = {Axis::kPipeline, Axis::kData,   Axis::kContext,
                                              Axis::kTsp,      Axis::kTensor, Axis::kExpert};

const char* axis_name(Axis a);   // "pp", "dp", "cp", "tsp", "tp", "ep"
const char* axis_title(Axis a);  // "pipeline", "data", "context", "tsp", "tensor", "expert"
std::optional<Axis> parse_axis(std::string_view name);  // short name
// "pp, dp, cp, tsp, tp, ep": for messages listing the choices.
const char* axis_names();

// The largest world a mesh may span: far beyond any job, and small enough that rank arithmetic
// in int cannot overflow.
inline constexpr int kMaxWorld = 1 << 20;

// Where one rank sits: its coordinate on every axis, and on the two derived from dp * cp.
struct Coord {
  int pp = 0, dp = 0, cp = 0, tsp = 0, tp = 0;
  int ep = 0;   // expert coordinate: (dp * cp_degree + cp) % ep_degree
  int edp = 0;  // expert-data coordinate: (dp * cp_degree + cp) / ep_degree
  int on(Axis a) const;
};

struct Shape {
  int pp = 1, dp = 1, cp = 1, tsp = 1, tp = 1, ep = 1;
  // ZeRO stage: 0 nothing sharded, 1 optimizer states sharded over the data ranks (keel train),
  // 2 gradients too, 3 weights too (keel size models all four; checkpoints know 0 and 1).
  int zero = 0;

  int degree(Axis a) const;
  void set(Axis a, int degree);
  // Ranks the mesh spans: pp * dp * cp * tsp * tp (ep is folded into dp * cp).
  int world() const;
  // Ranks holding the same experts: dp * cp / ep.
  int expert_data() const { return dp * cp / ep; }
  Coord coord(int rank) const;
  // "dp=4,ep=2,zero=1": dp always, every other axis whose degree is not 1, zero when not 0.
  std::string str() const;
};

bool operator==(const Shape& a, const Shape& b);

// Parses "dp=2,tp=2,ep=4,zero=1": any subset of the axes and zero, any order; missing axes are 1.
// An unknown key, a value that is not an integer, a degree < 1 or above kMaxWorld, zero outside
// 0..3, or a key given twice is an error naming the text and the key (keel::Error). Sets
// *dp_given to whether dp was written (callers fill it from the world otherwise). Does not
// check the combination: validate() does.
Shape parse(const std::string& text, bool* dp_given = nullptr);

// Fills dp so the shape spans `world` ranks when dp was not given (pp * cp * tsp * tp must
// divide world), then checks world() == world. keel::Error naming the text otherwise.
void fill_data(Shape& s, bool dp_given, int world, const std::string& text);

// The combination checks every consumer needs, one message per bad combination (keel::Error,
// `what` names the source: "parallel", "--layout 'dp=2,ep=3'"): the world within kMaxWorld, and
// ep dividing dp * cp.
void validate(const Shape& s, const std::string& what);

}  // namespace keel::mesh
