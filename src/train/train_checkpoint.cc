#include "train/train_checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "ckpt/geometry.h"
#include "ckpt/metadata.h"
#include "ckpt/reader.h"
#include "ckpt/store.h"
#include "common/error.h"

namespace keel::train {
namespace {

constexpr const char* kTrainFormat = "keel.train/2";

ckpt::Shape shape_of(const optim::ParamInfo& p) { return ckpt::Shape(p.shape.begin(), p.shape.end()); }

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

// Calls f(box, flat_offset) for the boxes of parameter p that lie in the flat range [b, e):
// flat_offset is the box's first element in the flat buffer.
template <typename F>
void for_each_box_in(const optim::ParamInfo& p, std::int64_t b, std::int64_t e, F&& f) {
  const std::int64_t lo = std::max(p.offset, b), hi = std::min(p.offset + p.numel, e);
  if (lo >= hi) return;
  std::int64_t at = lo;
  for (auto& box : ckpt::flat_range_boxes(shape_of(p), lo - p.offset, hi - p.offset)) {
    const std::int64_t n = box.volume();
    f(std::move(box), at);
    at += n;
  }
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

double TrainCheckpointer::save(std::int64_t step, const CheckpointView& view, const optim::ParamLayout& layout,
                               const nlohmann::json& extra) {
  // Each rank writes its ZeRO-1 shard of every tensor: the optimizer state it owns and the
  // parameters of the same range (replicated, so any rank could; this spreads the writes).
  const std::int64_t b = view.shard_begin, e = view.shard_end;
  if (b < 0 || b > e || e > layout.total_floats || !view.params || (e > b && (!view.adam_m || !view.adam_v)))
    fail("checkpoint: optimizer shard [{}, {}) of {} floats has no data", b, e, layout.total_floats);
  std::vector<ckpt::SaveShard> shards;
  for (const auto& p : layout.params)
    for_each_box_in(p, b, e, [&](ckpt::Box box, std::int64_t at) {
      shards.push_back(shard("model/" + p.name, shape_of(p), box, view.params + at, false));
      shards.push_back(shard("optim/exp_avg/" + p.name, shape_of(p), box, view.adam_m + (at - b), true));
      shards.push_back(shard("optim/exp_avg_sq/" + p.name, shape_of(p), std::move(box), view.adam_v + (at - b), true));
    });
  for (auto& s : shards) s.on_device = view.on_device;
  for (std::size_t i = 0; i < view.router_bias.size(); ++i) {  // replicated: spread over the ranks (host memory)
    if (static_cast<int>(i % static_cast<std::size_t>(comm_->size())) != comm_->rank()) continue;
    const ckpt::Shape shape{static_cast<std::int64_t>(view.router_bias[i].size())};
    shards.push_back(shard(fmt::format("router/bias.{}", i), shape, ckpt::full_box(shape), view.router_bias[i].data(), false));
  }
  nlohmann::json s = extra;
  s["format"] = kTrainFormat;
  s["step"] = step;
  s["optimizer_step"] = view.adamw_step;
  const std::string layout_name = comm_->size() > 1 ? fmt::format("dp={},zero=1", comm_->size()) : "dp=1";
  return saver_->save(step, shards, s, nlohmann::json::object(), layout_name);
}

std::optional<ckpt::SaveStats> TrainCheckpointer::finish() { return saver_->wait(); }

LoadedTrainState load_train_checkpoint(const std::string& path, const model::ModelConfig& cfg,
                                       std::pair<std::int64_t, std::int64_t> shard) {
  const optim::ParamLayout layout = model_param_layout(cfg);
  if (shard.second < 0) shard = {0, layout.total_floats};
  if (shard.first < 0 || shard.first > shard.second || shard.second > layout.total_floats)
    fail("checkpoint load: optimizer shard [{}, {}) is outside the model's {} floats", shard.first, shard.second,
         layout.total_floats);
  const ckpt::Reader reader(path);
  const nlohmann::json& s = reader.metadata().state;
  if (s.value("format", "") != kTrainFormat)
    fail("checkpoint {}: not a keel train checkpoint (state format '{}', expected '{}')", reader.dir(),
         s.value("format", ""), kTrainFormat);
  LoadedTrainState out;
  out.dir = reader.dir();
  out.extra = s;
  const std::size_t n = static_cast<std::size_t>(layout.total_floats);
  const auto [b, e] = shard;
  out.state.params.assign(n, 0.f);
  out.state.shard_begin = b;
  out.state.shard_end = e;
  out.state.adam_m.assign(static_cast<std::size_t>(e - b), 0.f);
  out.state.adam_v.assign(static_cast<std::size_t>(e - b), 0.f);
  // one selection bias per MoE layer over its classes (the experts, plus the skip class)
  const std::size_t classes = static_cast<std::size_t>(cfg.experts + (cfg.router_skip_expert ? 1 : 0));
  out.state.router_bias.assign(static_cast<std::size_t>(model::moe_layer_count(cfg)), std::vector<float>(classes, 0.f));
  std::vector<ckpt::LoadRequest> reqs;
  // Whole parameters, and the optimizer state of this rank's shard, whatever the layout saved.
  for (const auto& p : layout.params) {
    reqs.push_back(request("model/" + p.name, shape_of(p), ckpt::full_box(shape_of(p)), out.state.params.data() + p.offset));
    for_each_box_in(p, b, e, [&](ckpt::Box box, std::int64_t at) {
      reqs.push_back(request("optim/exp_avg/" + p.name, shape_of(p), box, out.state.adam_m.data() + (at - b)));
      reqs.push_back(request("optim/exp_avg_sq/" + p.name, shape_of(p), std::move(box), out.state.adam_v.data() + (at - b)));
    });
  }
  for (std::size_t i = 0; i < out.state.router_bias.size(); ++i) {
    const ckpt::Shape shape{static_cast<std::int64_t>(out.state.router_bias[i].size())};
    reqs.push_back(request(fmt::format("router/bias.{}", i), shape, ckpt::full_box(shape), out.state.router_bias[i].data()));
  }
  const ckpt::LoadStats st = reader.load(reqs);
  out.read_amplification = st.amplification();
  out.state.adamw_step = s.at("optimizer_step").get<std::int64_t>();
  return out;
}

LoadedWeights load_model_weights(const std::string& path, const model::ModelConfig& cfg) {
  const optim::ParamLayout layout = model_param_layout(cfg);
  const ckpt::Reader reader(path);
  const ckpt::Metadata& meta = reader.metadata();
  const nlohmann::json& s = meta.state;
  LoadedWeights out;
  out.dir = reader.dir();
  if (s.value("format", "") == kTrainFormat)
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
    reqs.push_back(request("model/" + p.name, shape_of(p), ckpt::full_box(shape_of(p)), out.state.params.data() + p.offset));
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
  reader.load(reqs);
  return out;
}

bool is_ckpt_directory(const std::string& path) {
  namespace fs = std::filesystem;
  return fs::is_directory(path) &&
         (fs::exists(fs::path(path) / ckpt::kLatestFile) || fs::exists(fs::path(path) / ckpt::kMetadataFile));
}

}  // namespace keel::train
