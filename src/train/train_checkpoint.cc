#include "train/train_checkpoint.h"

#include <fmt/format.h>

#include <filesystem>
#include <vector>

#include "ckpt/metadata.h"
#include "ckpt/reader.h"
#include "ckpt/store.h"
#include "common/error.h"

namespace keel::train {
namespace {

constexpr const char* kTrainFormat = "keel.train/2";

ckpt::Shape shape_of(const optim::ParamInfo& p) { return ckpt::Shape(p.shape.begin(), p.shape.end()); }

// A tensor held whole by this rank (world 1), written by it.
ckpt::SaveShard whole(std::string name, ckpt::Shape shape, const float* data) {
  ckpt::SaveShard s;
  s.name = std::move(name);
  s.type = ckpt::ElemType::kF32;
  s.placement.dims.assign(shape.size(), {});
  s.box = ckpt::full_box(shape);
  s.shape = std::move(shape);
  s.data = data;
  s.write = true;
  return s;
}

ckpt::LoadRequest request(std::string name, ckpt::Shape shape, float* data) {
  ckpt::LoadRequest r;
  r.name = std::move(name);
  r.type = ckpt::ElemType::kF32;
  r.box = ckpt::full_box(shape);
  r.shape = std::move(shape);
  r.data = data;
  return r;
}

}  // namespace

TrainCheckpointer::TrainCheckpointer(std::string root, const TrainCheckpointOptions& options)
    : root_(std::move(root)), comm_(ckpt::make_self_comm()) {
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

double TrainCheckpointer::save(std::int64_t step, const TrainState& state, const optim::ParamLayout& layout,
                               const nlohmann::json& extra) {
  std::vector<ckpt::SaveShard> shards;
  for (const auto& p : layout.params) {
    shards.push_back(whole("model/" + p.name, shape_of(p), state.params.data() + p.offset));
    shards.push_back(whole("optim/exp_avg/" + p.name, shape_of(p), state.adam_m.data() + p.offset));
    shards.push_back(whole("optim/exp_avg_sq/" + p.name, shape_of(p), state.adam_v.data() + p.offset));
  }
  for (std::size_t i = 0; i < state.router_bias.size(); ++i)
    shards.push_back(whole(fmt::format("router/bias.{}", i),
                           {static_cast<std::int64_t>(state.router_bias[i].size())}, state.router_bias[i].data()));
  nlohmann::json s = extra;
  s["format"] = kTrainFormat;
  s["step"] = step;
  s["optimizer_step"] = state.adamw_step;
  return saver_->save(step, shards, s, nlohmann::json::object(), "dp=1");
}

std::optional<ckpt::SaveStats> TrainCheckpointer::finish() { return saver_->wait(); }

LoadedTrainState load_train_checkpoint(const std::string& path, const model::ModelConfig& cfg) {
  const optim::ParamLayout layout = model_param_layout(cfg);
  const ckpt::Reader reader(path);
  const nlohmann::json& s = reader.metadata().state;
  if (s.value("format", "") != kTrainFormat)
    fail("checkpoint {}: not a keel train checkpoint (state format '{}', expected '{}')", reader.dir(),
         s.value("format", ""), kTrainFormat);
  LoadedTrainState out;
  out.dir = reader.dir();
  out.extra = s;
  const std::size_t n = static_cast<std::size_t>(layout.total_floats);
  out.state.params.assign(n, 0.f);
  out.state.adam_m.assign(n, 0.f);
  out.state.adam_v.assign(n, 0.f);
  // one selection bias per MoE layer over its classes (the experts, plus the skip class)
  const std::size_t classes = static_cast<std::size_t>(cfg.experts + (cfg.router_skip_expert ? 1 : 0));
  out.state.router_bias.assign(static_cast<std::size_t>(model::moe_layer_count(cfg)), std::vector<float>(classes, 0.f));
  std::vector<ckpt::LoadRequest> reqs;
  for (const auto& p : layout.params) {
    reqs.push_back(request("model/" + p.name, shape_of(p), out.state.params.data() + p.offset));
    reqs.push_back(request("optim/exp_avg/" + p.name, shape_of(p), out.state.adam_m.data() + p.offset));
    reqs.push_back(request("optim/exp_avg_sq/" + p.name, shape_of(p), out.state.adam_v.data() + p.offset));
  }
  for (std::size_t i = 0; i < out.state.router_bias.size(); ++i)
    reqs.push_back(request(fmt::format("router/bias.{}", i),
                           {static_cast<std::int64_t>(out.state.router_bias[i].size())},
                           out.state.router_bias[i].data()));
  const ckpt::LoadStats st = reader.load(reqs);
  out.read_amplification = st.amplification();
  out.state.adamw_step = s.at("optimizer_step").get<std::int64_t>();
  return out;
}

bool is_ckpt_directory(const std::string& path) {
  namespace fs = std::filesystem;
  return fs::is_directory(path) &&
         (fs::exists(fs::path(path) / ckpt::kLatestFile) || fs::exists(fs::path(path) / ckpt::kMetadataFile));
}

}  // namespace keel::train
