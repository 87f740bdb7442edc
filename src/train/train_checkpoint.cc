#include "train/train_checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <vector>

#include "ckpt/geometry.h"
#include "ckpt/metadata.h"
#include "ckpt/reader.h"
#include "ckpt/store.h"
#include "common/error.h"
#include "train/param_rules.h"

namespace keel::train {
namespace {

// keel.train/3 stores optim/exp_avg_sq only for the parameters the saving run trained with AdamW
// (keel.train/2 also stored zeros for the Muon ones); both load.
constexpr const char* kTrainFormat = "keel.train/3";
constexpr const char* kTrainFormatV2 = "keel.train/2";


// A box of a tensor this rank writes.
ckpt::SaveShard shard(std::string name, ckpt::Shape shape, ckpt::Box box, const float* data, bool zero) {
  ckpt::SaveShard s;
  s.name = std::move(name);
  s.type = ckpt::ElemType::kF32;
  s.placement.dims.assign(shape.size(), {});
  s.placement.zero = zero;
  s.box = std::move(box);
  s.shape = std::move(shape);
  s.data = data;
  s.write = true;
  return s;
}

ckpt::LoadRequest request(std::string name, ckpt::Shape shape, ckpt::Box box, float* data) {
  ckpt::LoadRequest r;
  r.name = std::move(name);
  r.type = ckpt::ElemType::kF32;
  r.box = std::move(box);
  r.shape = std::move(shape);
  r.data = data;
  return r;
}

// Calls f(box, flat_offset) for the boxes (of the global tensor) of parameter p's elements in the
// local flat range [b, e): flat_offset is the box's first element in the local flat buffer.
template <typename F>
void for_each_box_in(const optim::ParamInfo& p, const std::vector<model::BlockPiece>& pieces, std::int64_t b,
                     std::int64_t e, F&& f) {
  const std::int64_t lo = std::max(p.offset, b), hi = std::min(p.offset + p.numel, e);
  if (lo >= hi) return;
  std::int64_t at = lo;
  for (auto& box : block_boxes(p, pieces, lo - p.offset, hi - p.offset)) {
    const std::int64_t n = box.volume();
    f(std::move(box), at);
    at += n;
  }
}

// Every parameter's pieces at the slice's coordinate, in layout order.
std::vector<std::vector<model::BlockPiece>> all_pieces(const optim::ParamLayout& layout, const StateSlice& s) {
  const mesh::Shape m = slice_mesh(s);
  const mesh::Coord at = slice_coord(s);
  std::vector<std::vector<model::BlockPiece>> out;
  out.reserve(layout.params.size());
  for (const auto& p : layout.params) out.push_back(model::block_pieces(p, m, at));
  return out;
}

void check_slice(const StateSlice& s, const char* what) {
  if (s.expert_parallel < 1 || s.expert_rank < 0 || s.expert_rank >= s.expert_parallel)
    fail("checkpoint {}: expert rank {} of {}", what, s.expert_rank, s.expert_parallel);
  if (s.tensor_parallel < 1 || s.tensor_rank < 0 || s.tensor_rank >= s.tensor_parallel)
    fail("checkpoint {}: tensor rank {} of {}", what, s.tensor_rank, s.tensor_parallel);
}

}  // namespace

mesh::Shape slice_mesh(const StateSlice& s) {
  mesh::Shape m;
  m.dp = m.ep = s.expert_parallel;
  m.tp = s.tensor_parallel;
  return m;
}

mesh::Coord slice_coord(const StateSlice& s) {
  mesh::Coord at;
  at.dp = at.ep = s.expert_rank;
  at.tp = s.tensor_rank;
  return at;
}

std::vector<ckpt::Box> block_boxes(const optim::ParamInfo& p, const std::vector<model::BlockPiece>& pieces,
                                   std::int64_t lo, std::int64_t hi) {
  std::int64_t n = 1;
  for (auto d : p.shape) n *= d;
  if (lo < 0 || hi > n || lo > hi)
    fail("parameter '{}': local range [{}, {}) is outside its block of {} elements", p.name, lo, hi, n);
  std::vector<ckpt::Box> out;
  for (ckpt::Box& box : ckpt::flat_range_boxes(p.shape, lo, hi)) {
    if (box.ndim() == 0) {
      out.push_back(std::move(box));
      continue;
    }
    const std::int64_t r0 = box.offsets[0], r1 = r0 + box.lengths[0];
    for (const model::BlockPiece& pc : pieces) {  // in local row order: the boxes stay in flat order
      const std::int64_t a = std::max(r0, pc.local_row), b = std::min(r1, pc.local_row + pc.extent[0]);
      if (a >= b) continue;
      ckpt::Box g = box;
      g.offsets[0] = pc.offset[0] + (a - pc.local_row);
      g.lengths[0] = b - a;
      for (std::size_t d = 1; d < g.ndim(); ++d) g.offsets[d] += pc.offset[d];
      out.push_back(std::move(g));
    }
  }
  return out;
}

std::vector<ckpt::Box> block_boxes(const optim::ParamInfo& p, const StateSlice& slice, std::int64_t lo,
                                   std::int64_t hi) {
  return block_boxes(p, model::block_pieces(p, slice_mesh(slice), slice_coord(slice)), lo, hi);
}

std::string checkpoint_layout_name(int ranks, const StateSlice& s, int context_parallel, int tsp) {
  const int group = s.tensor_parallel * context_parallel;
  if (s.tensor_parallel < 1 || context_parallel < 1 || ranks < 1 || ranks % group != 0)
    fail("checkpoint: {} saving ranks are not whole tensor x context groups of {} (with tensor or context parallelism "
         "every rank of the world saves: pass its communicator)",
         ranks, group);
  mesh::Shape m;
  m.dp = ranks / group;
  m.cp = context_parallel;
  if (tsp < 1 || s.tensor_parallel % tsp != 0)
    fail("checkpoint: tsp degree {} does not divide the blocks' tensor degree {}", tsp, s.tensor_parallel);
  m.tsp = tsp;  // TSP's blocks are those of tensor degree tp * tsp
  m.tp = s.tensor_parallel / tsp;
  m.ep = s.expert_parallel;
  m.zero = m.dp * m.cp > 1 ? 1 : 0;
  return m.str();
}

std::vector<ckpt::SaveShard> checkpoint_shards(const CheckpointView& view, const optim::ParamLayout& layout, int rank,
                                               int ranks) {
  // Each rank writes its ZeRO-1 shards (of the replicated region, and with expert parallelism of
  // its experts' region): the optimizer state it owns and the parameters of the same ranges
  // (replicated over the data ranks, so any holder could; this spreads the writes). Under
  // tensor parallelism each tensor rank's shards cover its own blocks, which tensor rank 0's
  // copies of the parameters not split over tp would duplicate: only tensor rank 0 writes those.
  // The shards tile every tensor, so every element is written once.
  const StateSlice& sl = view.slice;
  const std::int64_t b = sl.shard_begin, e = sl.shard_end;
  if (b < 0 || b > e || e > layout.total_floats || sl.expert_begin < 0 || sl.expert_begin > sl.expert_end ||
      sl.expert_end > layout.total_floats || !view.params || (sl.moments() > 0 && (!view.adam_m || !view.adam_v)))
    fail("checkpoint: optimizer ranges [{}, {}) + [{}, {}) of {} floats have no data", b, e, sl.expert_begin,
         sl.expert_end, layout.total_floats);
  check_slice(sl, "save");
  if (ranks < 1 || rank < 0 || rank >= ranks) fail("checkpoint: rank {} of {} saving ranks", rank, ranks);
  const auto pieces = all_pieces(layout, sl);
  std::vector<ckpt::SaveShard> out;
  for (const MomentRange& r : moment_ranges(sl))
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      const optim::ParamInfo& p = layout.params[i];
      if (sl.tensor_rank != 0 && !p.placement.splits(mesh::Axis::kTensor)) continue;  // tensor rank 0's copy
      for_each_box_in(p, pieces[i], r.begin, r.end, [&](ckpt::Box box, std::int64_t at) {
        const ckpt::Shape& g = p.global_shape;
        const std::int64_t m = r.at + (at - r.begin);
        out.push_back(shard("model/" + p.name, g, box, view.params + at, false));
        out.push_back(shard("optim/exp_avg/" + p.name, g, box, view.adam_m + m, true));
        if (p.optimizer == optim::OptimizerKind::kAdamW)  // Muon keeps no v (adamw_moment_spans)
          out.push_back(shard("optim/exp_avg_sq/" + p.name, g, std::move(box), view.adam_v + m, true));
      });
    }
  for (auto& s : out) s.on_device = view.on_device;
  for (std::size_t i = 0; i < view.router_bias.size(); ++i) {  // replicated: spread over the ranks (host memory)
    if (static_cast<int>(i % static_cast<std::size_t>(ranks)) != rank) continue;
    const ckpt::Shape shape{static_cast<std::int64_t>(view.router_bias[i].size())};
    out.push_back(shard(fmt::format("router/bias.{}", i), shape, ckpt::full_box(shape), view.router_bias[i].data(), false));
    const BalanceMemory& mem = view.router_balance;  // the adam or pid rule's memory, when it keeps one
    if (i < mem.m.size() && i < mem.v.size()) {
      out.push_back(shard(fmt::format("router/bias_m.{}", i), shape, ckpt::full_box(shape), mem.m[i].data(), false));
      out.push_back(shard(fmt::format("router/bias_v.{}", i), shape, ckpt::full_box(shape), mem.v[i].data(), false));
    }
  }
  return out;
}

TrainCheckpointer::TrainCheckpointer(std::string root, const TrainCheckpointOptions& options, MPI_Comm comm)
    : TrainCheckpointer(std::move(root), options,
                        comm == MPI_COMM_NULL ? ckpt::make_self_comm() : ckpt::make_mpi_comm(comm)) {}

TrainCheckpointer::TrainCheckpointer(std::string root, const TrainCheckpointOptions& options,
                                     std::unique_ptr<ckpt::Comm> comm)
    : root_(std::move(root)), comm_(std::move(comm)), context_parallel_(options.context_parallel), tsp_(options.tsp) {
  if (!comm_) fail("checkpoint {}: no communicator", root_);
  ckpt::SaveOptions o;
  o.keep_last = options.keep_last;
  o.keep_every = options.keep_every;
  o.threads = options.threads;
  o.flush_behind_bytes = options.flush_behind_bytes;
  o.fail_with_enospc_at = options.fail_with_enospc_at;
  o.write_delay_ms_at = options.write_delay_ms_at;
  saver_ = std::make_unique<ckpt::Saver>(*comm_, root_, o);
}

TrainCheckpointer::~TrainCheckpointer() {
  // A save still in flight is completed, not abandoned: training has ended or is failing,
  // and the last good state is worth its commit. Errors here cannot propagate.
  try {
    saver_->wait();
  } catch (...) {
  }
}

std::vector<ckpt::SaveShard> TrainCheckpointer::shards(const CheckpointView& view, const optim::ParamLayout& layout) const {
  return checkpoint_shards(view, layout, comm_->rank(), comm_->size());
}

void TrainCheckpointer::reserve(const CheckpointView& view, const optim::ParamLayout& layout) {
  saver_->reserve(shards(view, layout));
}

double TrainCheckpointer::save(std::int64_t step, const CheckpointView& view, const optim::ParamLayout& layout,
                               const nlohmann::json& extra) {
  nlohmann::json s = extra;
  s["format"] = kTrainFormat;
  s["step"] = step;
  s["optimizer_step"] = view.adamw_step;
  if (!view.router_balance.m.empty()) {
    s["router_balance_updates"] = view.router_balance.updates;
    s["router_balance_rule"] = view.router_balance.rule == ops::bias_controller::Rule::Pid ? "pid" : "adam";
  }
  // The parameters saved without optim/exp_avg_sq (Muon keeps no v): what makes the state whole
  // checkable (keel ckpt verify, the load) rather than a missing v passing for Muon's.
  nlohmann::json muon = nlohmann::json::array();
  for (const auto& p : layout.params)
    if (p.optimizer != optim::OptimizerKind::kAdamW) muon.push_back(p.name);
  s["muon_params"] = std::move(muon);
  const std::string name = checkpoint_layout_name(comm_->size(), view.slice, context_parallel_, tsp_);
  return saver_->save(step, shards(view, layout), s, nlohmann::json::object(), name);
}

std::optional<ckpt::SaveStats> TrainCheckpointer::finish() {
  try {
    return saver_->wait();
  } catch (const Error& e) {
    std::string latest;
    try {
      latest = ckpt::latest_dir(root_);
    } catch (const Error&) {
    }
    throw Error(fmt::format("checkpoint.dir {}: {}; `latest` is {}", root_, e.what(),
                            latest.empty() ? "none" : std::filesystem::path(latest).filename().string()));
  }
}

namespace {

// The first model/* or router/bias.* tensor of the checkpoint that no request reads, or "".
// Loading by name alone would accept a checkpoint of a larger model (more layers, experts...)
// and silently drop what the target model has no place for.
std::string first_unused_weight(const ckpt::Metadata& meta, const std::vector<ckpt::LoadRequest>& reqs) {
  std::set<std::string> used;
  for (const auto& r : reqs) used.insert(r.name);
  for (const auto& t : meta.tensors) {
    const bool weight = t.name.starts_with("model/") || t.name.starts_with("router/bias.");
    if (weight && !used.contains(t.name)) return t.name;
  }
  return "";
}

// A non-negative integer of a checkpoint's "state", or an error naming the checkpoint and key.
std::int64_t state_count(const nlohmann::json& s, const char* key, const std::string& dir) {
  if (!s.is_object() || !s.contains(key) || !s[key].is_number_integer() || s[key].get<std::int64_t>() < 0)
    fail("checkpoint {}: state '{}' is {} (expected a non-negative integer): the metadata is damaged", dir, key,
         s.is_object() && s.contains(key) ? s[key].dump() : "missing");
  return s[key].get<std::int64_t>();
}

// What a whole train state of `layout` holds and this checkpoint lacks: every parameter's
// optim/exp_avg, and optim/exp_avg_sq for every parameter the saving run trained with AdamW (the
// state's muon_params lists the others; keel.train/2 stored v for all; a keel.train/3 state
// saved before muon_params was recorded needs v where no Muon run could have trained the
// parameter). Returns the first missing tensor, described, or "".
std::string missing_optimizer_tensor(const ckpt::Metadata& meta, const optim::ParamLayout& layout,
                                     const std::string& format) {
  std::set<std::string> stored, muon;
  for (const auto& t : meta.tensors) stored.insert(t.name);
  const nlohmann::json& s = meta.state;
  const bool listed = s.is_object() && s.contains("muon_params") && s["muon_params"].is_array();
  if (listed) {
    for (const auto& n : s["muon_params"])
      if (n.is_string()) muon.insert(n.get<std::string>());
  } else if (format != kTrainFormatV2) {
    MuonTrainOptions m;
    m.enabled = true;
    try {
      for (const auto& p : regroup_layout(layout, train_group_rules(m)).params)
        if (p.optimizer == optim::OptimizerKind::kMuon) muon.insert(p.name);
    } catch (const Error&) {  // no Muon rule set fits: cannot tell, so nothing is required
      for (const auto& p : layout.params) muon.insert(p.name);
    }
  }
  for (const auto& p : layout.params) {
    if (!stored.contains("optim/exp_avg/" + p.name))
      return fmt::format("tensor 'optim/exp_avg/{}' (the optimizer's first moment of '{}') is missing", p.name, p.name);
    if (stored.contains("optim/exp_avg_sq/" + p.name) || muon.contains(p.name)) continue;
    return fmt::format("tensor 'optim/exp_avg_sq/{}' (AdamW's second moment of '{}') is missing, and {}", p.name, p.name,
                       listed ? "the saving run trained that parameter with AdamW (its state's muon_params does not list it)"
                              : "AdamW trains that parameter with or without Muon");
  }
  return "";
}

}  // namespace

LoadedTrainState load_train_checkpoint(const std::string& path, const model::ModelConfig& cfg,
                                       std::pair<std::int64_t, std::int64_t> shard) {
  StateSlice slice;
  slice.shard_begin = shard.first;
  slice.shard_end = shard.second < 0 ? model::param_layout(cfg).total_floats : shard.second;
  return load_train_checkpoint(path, cfg, slice);
}

LoadedTrainState load_train_checkpoint(const std::string& path, const model::ModelConfig& cfg, const StateSlice& slice) {
  check_slice(slice, "load");
  const optim::ParamLayout layout = model::param_layout(cfg, slice_mesh(slice));
  for (const MomentRange& r : moment_ranges(slice))
    if (r.begin < 0 || r.begin > r.end || r.end > layout.total_floats)
      fail("checkpoint load: optimizer range [{}, {}) is outside this rank's {} floats", r.begin, r.end,
           layout.total_floats);
  const auto pieces = all_pieces(layout, slice);
  const ckpt::Reader reader(path);
  const nlohmann::json& s = reader.metadata().state;
  const bool has_format = s.is_object() && s.contains("format") && s["format"].is_string();
  const std::string format = has_format ? s["format"].get<std::string>() : "";
  if (format != kTrainFormat && format != kTrainFormatV2)
    fail("checkpoint {}: not a keel train checkpoint (state format {}, expected '{}')", reader.dir(),
         s.is_object() && s.contains("format") ? s["format"].dump() : "none", kTrainFormat);
  std::set<std::string> stored;
  for (const auto& t : reader.metadata().tensors) stored.insert(t.name);
  LoadedTrainState out;
  out.dir = reader.dir();
  out.extra = s;
  // Checked before reading gigabytes: a damaged state is named here, not deep in the resume.
  out.step = state_count(s, "step", reader.dir());
  const std::int64_t optimizer_step = state_count(s, "optimizer_step", reader.dir());
  if (out.step != reader.metadata().step)
    fail("checkpoint {}: its state says step {} but its metadata step {}: the metadata is damaged", reader.dir(),
         out.step, reader.metadata().step);
  // A whole train state, or one line naming what is missing (not a zero v read as Muon's later).
  if (const std::string missing = missing_optimizer_tensor(reader.metadata(), layout, format); !missing.empty())
    fail("checkpoint {}: {}: not a complete train state (damaged, or copied in part); `keel ckpt verify {}` lists "
         "every problem",
         reader.dir(), missing, reader.dir());
  TrainState& st = out.state;
  st.params.assign(static_cast<std::size_t>(layout.total_floats), 0.f);
  st.set_slice(slice);
  st.adam_m.assign(static_cast<std::size_t>(slice.moments()), 0.f);
  st.adam_v.assign(static_cast<std::size_t>(slice.moments()), 0.f);
  // one selection bias per MoE layer over its classes (the experts, plus the skip class)
  const std::size_t classes = static_cast<std::size_t>(cfg.experts + (cfg.router_skip_expert ? 1 : 0));
  st.router_bias.assign(static_cast<std::size_t>(model::moe_layer_count(cfg)), std::vector<float>(classes, 0.f));
  std::vector<ckpt::LoadRequest> reqs;
  // Every parameter this rank holds, and the optimizer state of its ranges, whatever the layout saved.
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const optim::ParamInfo& p = layout.params[i];
    for_each_box_in(p, pieces[i], p.offset, p.offset + p.numel, [&](ckpt::Box box, std::int64_t at) {
      reqs.push_back(request("model/" + p.name, p.global_shape, std::move(box), st.params.data() + at));
    });
  }
  for (const MomentRange& r : moment_ranges(slice))
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      const optim::ParamInfo& p = layout.params[i];
      for_each_box_in(p, pieces[i], r.begin, r.end, [&](ckpt::Box box, std::int64_t at) {
        const ckpt::Shape& g = p.global_shape;
        const std::int64_t m = r.at + (at - r.begin);
        reqs.push_back(request("optim/exp_avg/" + p.name, g, box, st.adam_m.data() + m));
        // A parameter the saving run trained with Muon has no v; it stays zero (and
        // check_state_matches_optimizers refuses that momentum where this run needs AdamW's).
        if (format == kTrainFormatV2 || stored.contains("optim/exp_avg_sq/" + p.name))
          reqs.push_back(request("optim/exp_avg_sq/" + p.name, g, std::move(box), st.adam_v.data() + m));
      });
    }
  for (std::size_t i = 0; i < st.router_bias.size(); ++i) {
    const ckpt::Shape shape{static_cast<std::int64_t>(st.router_bias[i].size())};
    reqs.push_back(request(fmt::format("router/bias.{}", i), shape, ckpt::full_box(shape), st.router_bias[i].data()));
  }
  // The adam controller's moments: all of them or none (a run saved under sign or proportional
  // has none, and an adam run resumed from it starts them at zero).
  int moments = 0;
  for (std::size_t i = 0; i < st.router_bias.size(); ++i)
    moments += stored.contains(fmt::format("router/bias_m.{}", i)) + stored.contains(fmt::format("router/bias_v.{}", i));
  if (moments != 0 && (moments != 2 * static_cast<int>(st.router_bias.size()) || !s.contains("router_balance_updates")))
    fail("checkpoint {}: has {} of the {} router/bias_m.<i> and router/bias_v.<i> tensors (or no router_balance_updates): "
         "damaged, or copied in part",
         reader.dir(), moments, 2 * st.router_bias.size());
  if (moments != 0) {
    BalanceMemory& mem = st.router_balance;
    mem.updates = state_count(s, "router_balance_updates", reader.dir());
    // Checkpoints from before the pid rule kept only Adam's moments (and no rule name).
    const nlohmann::json rule = s.value("router_balance_rule", nlohmann::json("adam"));
    if (rule != "adam" && rule != "pid")
      fail("checkpoint {}: router_balance_rule {} is neither \"adam\" nor \"pid\"", reader.dir(), rule.dump());
    mem.rule = rule == "pid" ? ops::bias_controller::Rule::Pid : ops::bias_controller::Rule::Adam;
    mem.m.assign(st.router_bias.size(), std::vector<float>(classes, 0.f));
    mem.v = mem.m;
    for (std::size_t i = 0; i < st.router_bias.size(); ++i) {
      const ckpt::Shape shape{static_cast<std::int64_t>(classes)};
      reqs.push_back(request(fmt::format("router/bias_m.{}", i), shape, ckpt::full_box(shape), mem.m[i].data()));
      reqs.push_back(request(fmt::format("router/bias_v.{}", i), shape, ckpt::full_box(shape), mem.v[i].data()));
    }
  }
  const ckpt::LoadStats ls = reader.load(reqs);
  out.read_amplification = ls.amplification();
  out.bytes_read = ls.bytes_read;
  out.read_seconds = ls.seconds;
  st.adamw_step = optimizer_step;
  return out;
}

LoadedWeights load_model_weights(const std::string& path, const model::ModelConfig& cfg, int expert_parallel,
                                 int expert_rank, int tensor_parallel, int tensor_rank) {
  StateSlice slice;
  slice.expert_parallel = expert_parallel;
  slice.expert_rank = expert_rank;
  slice.tensor_parallel = tensor_parallel;
  slice.tensor_rank = tensor_rank;
  check_slice(slice, "load");
  const optim::ParamLayout layout = model::param_layout(cfg, slice_mesh(slice));
  const auto pieces = all_pieces(layout, slice);
  const ckpt::Reader reader(path);
  const ckpt::Metadata& meta = reader.metadata();
  const nlohmann::json& s = meta.state;
  LoadedWeights out;
  out.dir = reader.dir();
  if (const std::string f = s.value("format", ""); f == kTrainFormat || f == kTrainFormatV2)
    out.description = fmt::format("step {}", s.value("step", std::int64_t{0}));
  else if (s.contains("imported_from"))
    out.description = fmt::format("weights imported from {}{}", s["imported_from"].get<std::string>(),
                                  s.contains("names") ? fmt::format(" ({} names)", s["names"].get<std::string>()) : "");
  else
    out.description = fmt::format("checkpoint step {}", meta.step);
  out.state.params.assign(static_cast<std::size_t>(layout.total_floats), 0.f);
  const std::size_t classes = static_cast<std::size_t>(cfg.experts + (cfg.router_skip_expert ? 1 : 0));
  out.state.router_bias.assign(static_cast<std::size_t>(model::moe_layer_count(cfg)), std::vector<float>(classes, 0.f));
  std::vector<ckpt::LoadRequest> reqs;
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const optim::ParamInfo& p = layout.params[i];
    for_each_box_in(p, pieces[i], p.offset, p.offset + p.numel, [&](ckpt::Box box, std::int64_t at) {
      reqs.push_back(request("model/" + p.name, p.global_shape, std::move(box), out.state.params.data() + at));
    });
  }
  out.state.expert_parallel = expert_parallel;
  out.state.expert_rank = expert_rank;
  out.state.tensor_parallel = tensor_parallel;
  out.state.tensor_rank = tensor_rank;
  // Balancing biases are carried when the source had them (a release may not): all or none,
  // since a partial set would route some layers with trained biases and others without.
  int have = 0;
  for (std::size_t i = 0; i < out.state.router_bias.size(); ++i) have += meta.find(fmt::format("router/bias.{}", i)) != nullptr;
  if (have != 0 && have != static_cast<int>(out.state.router_bias.size()))
    fail("checkpoint {}: has {} of the {} router/bias.<i> tensors of model '{}'", reader.dir(), have,
         out.state.router_bias.size(), cfg.name);
  out.router_bias = have != 0;
  if (out.router_bias)
    for (std::size_t i = 0; i < out.state.router_bias.size(); ++i) {
      const ckpt::Shape shape{static_cast<std::int64_t>(classes)};
      reqs.push_back(request(fmt::format("router/bias.{}", i), shape, ckpt::full_box(shape), out.state.router_bias[i].data()));
    }
  if (const std::string unused = first_unused_weight(meta, reqs); !unused.empty())
    fail("checkpoint {}: tensor {} has no place in model '{}' ({} layers): the checkpoint holds another model",
         reader.dir(), unused, cfg.name, cfg.layers);
  reader.load(reqs);
  return out;
}

bool is_ckpt_directory(const std::string& path) {
  namespace fs = std::filesystem;
  return fs::is_directory(path) &&
         (fs::exists(fs::path(path) / ckpt::kLatestFile) || fs::exists(fs::path(path) / ckpt::kMetadataFile));
}

}  // namespace keel::train
