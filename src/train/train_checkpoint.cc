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

// A parameter as this rank holds it: its global (checkpoint) shape, and where its local block
// starts in the global tensor (its placement: an expert-parallel rank holds E / ep experts of an
// expert tensor, a contiguous slab of the global [E, ...] tensor starting at expert
// expert_rank * E / ep).
struct Held {
  ckpt::Shape global;
  std::int64_t first = 0;  // flat index in the global tensor of the local element 0
};

Held held(const optim::ParamInfo& p, const StateSlice& slice) {
  mesh::Shape m;
  m.dp = m.ep = slice.expert_parallel;
  mesh::Coord at;
  at.ep = slice.expert_rank;
  return {p.global_shape, model::block_start(p, m, at)};
}

// Calls f(box, flat_offset) for the boxes (of the global tensor) of parameter p's elements in the
// local flat range [b, e): flat_offset is the box's first element in the local flat buffer.
template <typename F>
void for_each_box_in(const optim::ParamInfo& p, const StateSlice& slice, std::int64_t b, std::int64_t e, F&& f) {
  const std::int64_t lo = std::max(p.offset, b), hi = std::min(p.offset + p.numel, e);
  if (lo >= hi) return;
  const Held h = held(p, slice);
  std::int64_t at = lo;
  for (auto& box : ckpt::flat_range_boxes(h.global, h.first + lo - p.offset, h.first + hi - p.offset)) {
    const std::int64_t n = box.volume();
    f(std::move(box), at);
    at += n;
  }
}

// The saved layout in the mesh vocabulary (mesh/shape.h): ep is folded into the data ranks, so
// "dp=4,ep=2,zero=1" spans the 4 ranks that ran (the checkpoint's "world").
std::string layout_name(int ranks, const StateSlice& s) {
  std::string name = fmt::format("dp={}", ranks);
  if (s.expert_parallel > 1) name += fmt::format(",ep={}", s.expert_parallel);
  if (ranks > 1) name += ",zero=1";
  return name;
}

}  // namespace

TrainCheckpointer::TrainCheckpointer(std::string root, const TrainCheckpointOptions& options, MPI_Comm data_comm)
    : root_(std::move(root)),
      comm_(data_comm == MPI_COMM_NULL ? ckpt::make_self_comm() : ckpt::make_mpi_comm(data_comm)) {
  ckpt::SaveOptions o;
  o.keep_last = options.keep_last;
  o.keep_every = options.keep_every;
  o.threads = options.threads;
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
  // Each rank writes its ZeRO-1 shards (of the replicated region, and with expert parallelism of
  // its experts' region): the optimizer state it owns and the parameters of the same ranges
  // (replicated, so any holder could; this spreads the writes). The shards tile every tensor,
  // so every element is written once.
  const StateSlice& sl = view.slice;
  const std::int64_t b = sl.shard_begin, e = sl.shard_end;
  if (b < 0 || b > e || e > layout.total_floats || sl.expert_begin < 0 || sl.expert_begin > sl.expert_end ||
      sl.expert_end > layout.total_floats || !view.params || (sl.moments() > 0 && (!view.adam_m || !view.adam_v)))
    fail("checkpoint: optimizer ranges [{}, {}) + [{}, {}) of {} floats have no data", b, e, sl.expert_begin,
         sl.expert_end, layout.total_floats);
  std::vector<ckpt::SaveShard> out;
  for (const MomentRange& r : moment_ranges(sl))
    for (const auto& p : layout.params)
      for_each_box_in(p, sl, r.begin, r.end, [&](ckpt::Box box, std::int64_t at) {
        const ckpt::Shape g = held(p, sl).global;
        const std::int64_t m = r.at + (at - r.begin);
        out.push_back(shard("model/" + p.name, g, box, view.params + at, false));
        out.push_back(shard("optim/exp_avg/" + p.name, g, box, view.adam_m + m, true));
        if (p.optimizer == optim::OptimizerKind::kAdamW)  // Muon keeps no v (adamw_moment_spans)
          out.push_back(shard("optim/exp_avg_sq/" + p.name, g, std::move(box), view.adam_v + m, true));
      });
  for (auto& s : out) s.on_device = view.on_device;
  for (std::size_t i = 0; i < view.router_bias.size(); ++i) {  // replicated: spread over the ranks (host memory)
    if (static_cast<int>(i % static_cast<std::size_t>(comm_->size())) != comm_->rank()) continue;
    const ckpt::Shape shape{static_cast<std::int64_t>(view.router_bias[i].size())};
    out.push_back(shard(fmt::format("router/bias.{}", i), shape, ckpt::full_box(shape), view.router_bias[i].data(), false));
  }
  return out;
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
  return saver_->save(step, shards(view, layout), s, nlohmann::json::object(), layout_name(comm_->size(), view.slice));
}

std::optional<ckpt::SaveStats> TrainCheckpointer::finish() { return saver_->wait(); }

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

}  // namespace

LoadedTrainState load_train_checkpoint(const std::string& path, const model::ModelConfig& cfg,
                                       std::pair<std::int64_t, std::int64_t> shard) {
  StateSlice slice;
  slice.shard_begin = shard.first;
  slice.shard_end = shard.second < 0 ? model::param_layout(cfg).total_floats : shard.second;
  return load_train_checkpoint(path, cfg, slice);
}

LoadedTrainState load_train_checkpoint(const std::string& path, const model::ModelConfig& cfg, const StateSlice& slice) {
  const optim::ParamLayout layout = model::param_layout(cfg, slice.expert_parallel);
  for (const MomentRange& r : moment_ranges(slice))
    if (r.begin < 0 || r.begin > r.end || r.end > layout.total_floats)
      fail("checkpoint load: optimizer range [{}, {}) is outside this rank's {} floats", r.begin, r.end,
           layout.total_floats);
  if (slice.expert_rank < 0 || slice.expert_rank >= slice.expert_parallel)
    fail("checkpoint load: expert rank {} of {}", slice.expert_rank, slice.expert_parallel);
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
  TrainState& st = out.state;
  st.params.assign(static_cast<std::size_t>(layout.total_floats), 0.f);
  st.shard_begin = slice.shard_begin;
  st.shard_end = slice.shard_end;
  st.expert_parallel = slice.expert_parallel;
  st.expert_rank = slice.expert_rank;
  st.expert_begin = slice.expert_begin;
  st.expert_end = slice.expert_end;
  st.adam_m.assign(static_cast<std::size_t>(slice.moments()), 0.f);
  st.adam_v.assign(static_cast<std::size_t>(slice.moments()), 0.f);
  // one selection bias per MoE layer over its classes (the experts, plus the skip class)
  const std::size_t classes = static_cast<std::size_t>(cfg.experts + (cfg.router_skip_expert ? 1 : 0));
  st.router_bias.assign(static_cast<std::size_t>(model::moe_layer_count(cfg)), std::vector<float>(classes, 0.f));
  std::vector<ckpt::LoadRequest> reqs;
  // Every parameter this rank holds, and the optimizer state of its ranges, whatever the layout saved.
  for (const auto& p : layout.params)
    for_each_box_in(p, slice, p.offset, p.offset + p.numel, [&](ckpt::Box box, std::int64_t at) {
      reqs.push_back(request("model/" + p.name, held(p, slice).global, std::move(box), st.params.data() + at));
    });
  for (const MomentRange& r : moment_ranges(slice))
    for (const auto& p : layout.params)
      for_each_box_in(p, slice, r.begin, r.end, [&](ckpt::Box box, std::int64_t at) {
        const ckpt::Shape g = held(p, slice).global;
        const std::int64_t m = r.at + (at - r.begin);
        reqs.push_back(request("optim/exp_avg/" + p.name, g, box, st.adam_m.data() + m));
        // A parameter the saving run trained with Muon has no v; it stays zero (and
        // check_state_matches_optimizers refuses that momentum where this run needs AdamW's).
        if (format == kTrainFormatV2 || stored.contains("optim/exp_avg_sq/" + p.name))
          reqs.push_back(request("optim/exp_avg_sq/" + p.name, g, std::move(box), st.adam_v.data() + m));
      });
  for (std::size_t i = 0; i < st.router_bias.size(); ++i) {
    const ckpt::Shape shape{static_cast<std::int64_t>(st.router_bias[i].size())};
    reqs.push_back(request(fmt::format("router/bias.{}", i), shape, ckpt::full_box(shape), st.router_bias[i].data()));
  }
  const ckpt::LoadStats ls = reader.load(reqs);
  out.read_amplification = ls.amplification();
  out.bytes_read = ls.bytes_read;
  out.read_seconds = ls.seconds;
  st.adamw_step = optimizer_step;
  return out;
}

LoadedWeights load_model_weights(const std::string& path, const model::ModelConfig& cfg, int expert_parallel,
                                 int expert_rank) {
  StateSlice slice;
  slice.expert_parallel = expert_parallel;
  slice.expert_rank = expert_rank;
  const optim::ParamLayout layout = model::param_layout(cfg, expert_parallel);
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
  for (const auto& p : layout.params)
    for_each_box_in(p, slice, p.offset, p.offset + p.numel, [&](ckpt::Box box, std::int64_t at) {
      reqs.push_back(request("model/" + p.name, held(p, slice).global, std::move(box), out.state.params.data() + at));
    });
  out.state.expert_parallel = expert_parallel;
  out.state.expert_rank = expert_rank;
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
