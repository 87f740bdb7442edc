#include "train/train_config.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <iterator>
#include <set>
#include <utility>

#include "ckpt/metadata.h"
#include "ckpt/store.h"
#include "common/error.h"
#include "common/fileio.h"
#include "common/yaml_checks.h"

namespace keel::train {
namespace {

struct Ctx {
  std::string what;
  std::set<std::string> overridden;
  // A key set (or created) by --set: it has no line in the file.
  bool from_set(const std::string& key) const {
    for (const auto& o : overridden)
      if (o == key || o.rfind(key + ".", 0) == 0) return true;
    return false;
  }
  std::string where(const std::string& key, const YAML::Node& n) const {
    return n.Mark().line < 0 && from_set(key) ? " (from --set)" : yaml_line_suffix(n);
  }
  [[noreturn]] void bad(const std::string& key, const YAML::Node& n, const std::string& msg) const {
    throw UsageError(fmt::format("{}: key '{}'{}: {}", what, key, where(key, n), msg));
  }
  void only(const YAML::Node& map, const std::string& prefix, std::initializer_list<const char*> allowed) const {
    if (!map.IsMap()) bad(prefix, map, "must be a mapping");
    for (const auto& kv : map) {
      const std::string k = kv.first.as<std::string>();
      bool ok = false;
      for (const char* a : allowed) ok = ok || k == a;
      if (!ok) {
        const std::string full = prefix.empty() ? k : prefix + "." + k;
        std::string list;
        for (const char* a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
        throw UsageError(fmt::format("{}: unknown key '{}'{} (known: {})", what, full, where(full, kv.first), list));
      }
    }
  }
  template <typename T>
  T get(const YAML::Node& n, const std::string& key, const char* type) const {
    if (!n.IsScalar()) bad(key, n, fmt::format("must be {}", type));
    try {
      return n.as<T>();
    } catch (const YAML::Exception&) {
      bad(key, n, fmt::format("must be {}, got '{}'", type, n.Scalar()));
    }
  }
};

// A copy of a parsed --set value with no source marks: errors about it then say "from --set"
// rather than "line 1" of a file it never was in.
YAML::Node without_marks(const YAML::Node& n) {
  YAML::Node out;
  if (n.IsScalar()) {
    out = n.Scalar();
  } else if (n.IsSequence()) {
    for (const auto& e : n) out.push_back(without_marks(e));
  } else if (n.IsMap()) {
    for (const auto& kv : n) out[kv.first.Scalar()] = without_marks(kv.second);
  }
  return out;
}

void apply_override(YAML::Node& root, const std::string& spec, Ctx& ctx) {
  const auto eq = spec.find('=');
  if (eq == std::string::npos || eq == 0)
    throw UsageError(fmt::format("--set '{}': expected key.sub=value", spec));
  const std::string key = spec.substr(0, eq), value = spec.substr(eq + 1);
  std::vector<std::string> parts;
  std::size_t b = 0;
  while (true) {
    const auto d = key.find('.', b);
    parts.push_back(key.substr(b, d == std::string::npos ? std::string::npos : d - b));
    if (d == std::string::npos) break;
    b = d + 1;
  }
  YAML::Node n = root;
  for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
    if (parts[i].empty()) throw UsageError(fmt::format("--set '{}': empty key component", spec));
    YAML::Node child = n[parts[i]];
    if (child && !child.IsMap() && !child.IsNull())
      throw UsageError(fmt::format("--set '{}': '{}' is not a mapping", spec, parts[i]));
    n.reset(child);
  }
  YAML::Node v;
  try {
    v = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    throw UsageError(fmt::format("--set '{}': value is not valid YAML", spec));
  }
  // bounded before without_marks copies it: a value of nested aliases would expand there
  const std::string from = fmt::format("{} (--set {})", ctx.what, key);
  reject_duplicate_keys(v, from);
  v = without_marks(v);
  check_yaml_document(v, from, key);
  n[parts.back()] = v;
  ctx.overridden.insert(key);
}

// `parallel.zero1`: the GPU ZeRO-1 step's switches (parallel/zero1_buckets.h).
void parse_zero1(const YAML::Node& z, const Ctx& ctx, parallel::Zero1OverlapOptions& o) {
  if (z.IsNull()) return;
  ctx.only(z, "parallel.zero1",
           {"overlap", "bucket_mib", "defer_embedding", "broadcast_bf16", "shard_masters", "group_reduces",
            "optimizer_stream", "profile"});
  const std::string pre = "parallel.zero1.";
  for (const auto& [k, f] : std::initializer_list<std::pair<const char*, bool*>>{
           {"overlap", &o.enabled},           {"broadcast_bf16", &o.broadcast_bf16}, {"shard_masters", &o.shard_masters},
           {"group_reduces", &o.group_reduces}, {"optimizer_stream", &o.optimizer_stream}, {"profile", &o.profile}})
    if (z[k]) *f = ctx.get<bool>(z[k], pre + k, "true or false");
  if (z["bucket_mib"]) {
    o.bucket_mib = ctx.get<double>(z["bucket_mib"], pre + "bucket_mib", "a number of MiB");
    if (!std::isfinite(o.bucket_mib) || o.bucket_mib <= 0)
      ctx.bad(pre + "bucket_mib", z["bucket_mib"], "must be a positive number of MiB");
  }
  if (const auto d = z["defer_embedding"]) {
    const auto v = ctx.get<std::string>(d, pre + "defer_embedding", "auto, true or false");
    if (v == "auto") o.defer_embedding = -1;
    else if (v == "true") o.defer_embedding = 1;
    else if (v == "false") o.defer_embedding = 0;
    else ctx.bad(pre + "defer_embedding", d, "must be auto, true or false");
  }
}

// `optimizer.muon`: a mapping (or null: the defaults, Muon off).
void parse_muon(const YAML::Node& m, const Ctx& ctx, MuonTrainOptions& out) {
  if (m.IsNull()) return;
  ctx.only(m, "optimizer.muon",
           {"enabled", "momentum", "nesterov", "ns_steps", "scale", "rms_target", "lr_scale", "weight_decay",
            "adamw_matrices"});
  const std::string pre = "optimizer.muon.";
  auto num = [&](const char* k, double* f) {
    if (m[k]) *f = ctx.get<double>(m[k], pre + k, "a number");
  };
  if (m["enabled"]) out.enabled = ctx.get<bool>(m["enabled"], pre + "enabled", "true or false");
  num("momentum", &out.config.momentum);
  if (m["nesterov"]) out.config.nesterov = ctx.get<bool>(m["nesterov"], pre + "nesterov", "true or false");
  if (m["ns_steps"]) out.config.ns_steps = ctx.get<int>(m["ns_steps"], pre + "ns_steps", "an integer");
  if (m["scale"]) {
    const auto v = ctx.get<std::string>(m["scale"], pre + "scale", "match_adamw, exact_rms, keller or none");
    try {
      out.config.scale = parse_muon_scale(v);
    } catch (const Error& e) {
      ctx.bad(pre + "scale", m["scale"], e.what());
    }
  }
  num("rms_target", &out.config.rms_target);
  num("lr_scale", &out.lr_scale);
  num("weight_decay", &out.config.weight_decay);
  if (m["adamw_matrices"])
    out.adamw_matrices = ctx.get<std::string>(m["adamw_matrices"], pre + "adamw_matrices", "a glob (\"*router*\")");
  // Name the offending key: validate() says what is wrong but not where.
  const std::pair<const char*, bool> checks[] = {
      {"momentum", std::isfinite(out.config.momentum) && out.config.momentum >= 0 && out.config.momentum < 1},
      {"ns_steps", out.config.ns_steps >= 1 && out.config.ns_steps <= 100},
      {"rms_target", std::isfinite(out.config.rms_target) && out.config.rms_target > 0},
      {"lr_scale", std::isfinite(out.lr_scale) && out.lr_scale >= 0},
      {"weight_decay", std::isfinite(out.config.weight_decay) && out.config.weight_decay >= 0},
  };
  static const char* const kWhy[] = {"must be in [0, 1)", "must be in [1, 100]", "must be > 0", "must be >= 0",
                                     "must be >= 0"};
  for (std::size_t i = 0; i < std::size(checks); ++i)
    if (!checks[i].second) {
      const YAML::Node n = m[checks[i].first] ? m[checks[i].first] : m;
      ctx.bad(pre + checks[i].first, n, kWhy[i]);
    }
  try {
    validate(out);
  } catch (const Error& e) {
    ctx.bad("optimizer.muon", m, e.what());
  }
}

// The `model:` of the train config the checkpoint `path` records (keel train's checkpoints, and
// keel ckpt import's since it reads the release's config.json), for a config that starts from
// it (init_from) and leaves `model:` out.
YAML::Node recorded_model(const std::string& path, const std::string& what) {
  const std::string missing = fmt::format("{}: missing key 'model' (init_from {}", what, path);
  std::string text;
  try {
    const ckpt::Metadata m = ckpt::read_metadata(ckpt::resolve_checkpoint(path));
    if (m.state.is_object() && m.state.contains("config") && m.state["config"].is_string())
      text = m.state["config"].get<std::string>();
  } catch (const Error& e) {
    throw UsageError(fmt::format("{}: {})", missing, e.what()));
  }
  YAML::Node model;
  try {
    if (!text.empty()) model = YAML::Load(text)["model"];
  } catch (const YAML::Exception&) {
  }
  if (!model || model.IsNull()) throw UsageError(fmt::format("{} records no model: name it with 'model:')", missing));
  return model;
}

}  // namespace

TrainConfig parse_train_config(const std::string& yaml_text, const std::string& what,
                               const std::vector<std::string>& overrides) {
  Ctx ctx{what, {}};
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw UsageError(fmt::format("{}: not valid YAML: {}", what, e.what()));
  }
  if (!root.IsMap()) throw UsageError(fmt::format("{}: a train config must be a YAML mapping of keys", what));
  check_yaml_document(root, what);
  for (const auto& o : overrides) apply_override(root, o, ctx);
  // again with the --set keys in place (a dataset name given by --set is a key)
  if (!overrides.empty()) check_yaml_document(root, what);

  TrainConfig c;
  c.path = what;
  ctx.only(root, "", {"model", "recompute", "router", "ce_chunk", "data", "eval", "optimizer", "schedule", "batch",
                      "steps", "log_interval", "output_dir", "checkpoint", "tensorboard", "mfu_peak_flops", "seed",
                      "device", "parallel", "kernels", "init_from", "fault"});
  auto need = [&](const char* key) {
    if (!root[key]) throw UsageError(fmt::format("{}: missing key '{}'", what, key));
    return root[key];
  };
  // model: given, or the one the init_from checkpoint records, put inline (so that this run's
  // checkpoints record it too)
  if (!root["model"] && root["init_from"] && root["init_from"].IsScalar())
    root["model"] = recorded_model(root["init_from"].Scalar(), what);
  const YAML::Node mnode = need("model");
  try {
    if (mnode.IsScalar() || mnode.IsMap()) {
      c.model_source = mnode.IsScalar() ? mnode.as<std::string>() : "inline";
      c.model = model::model_of_train_config(mnode, what + ": model");
    } else {
      ctx.bad("model", mnode, "must be a model YAML path or a mapping of model keys");
    }
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(fmt::format("{}: model: {}", what, e.what()));
  }
  ModelOptions& mo = c.model_options;
  // keel train's router init: fan-in scaled (ModelOptions' 0 keeps init_std for code that builds
  // models directly; router.init_gain: 0 asks for that here).
  mo.router_init_gain = 1.0;
  // ZAYA1's MLP router: keel train's defaults are the settings measured to keep it balanced on
  // real text (docs/train.md, "Routing health" in docs/PERFORMANCE.md): proportional control
  // of the balancing biases at rate 0.05, and the routers at a fiftieth of the learning rate (at
  // the full rate the router sharpens faster than any controller follows, and collapses; at a
  // tenth it still drifts above 3x on a corpus it does not memorize). The router.* keys, where
  // given, win. The linear router keeps sign control, off, at full lr.
  if (c.model.router_mlp_layers > 0) {
    mo.balance_rule = ops::bias_controller::Rule::Proportional;
    mo.bias_update_rate = 0.05;
    mo.router_lr_scale = 0.02;
  }
  if (root["recompute"]) {
    try {
      mo.recompute = parse_recompute(ctx.get<std::string>(root["recompute"], "recompute", "none or full"));
    } catch (const UsageError& e) {
      ctx.bad("recompute", root["recompute"], e.what());
    }
  }
  if (const auto r = root["router"]) {
    ctx.only(r, "router",
             {"aux_loss_weight", "z_loss_weight", "bias_update_rate", "balance", "init_gain", "lr_scale", "renormalize",
              "log_counts", "forced_balance", "balance_kp", "balance_kd"});
    if (r["aux_loss_weight"]) {  // the model's router's: the MLP router's own weight when it has one
      const double w = ctx.get<double>(r["aux_loss_weight"], "router.aux_loss_weight", "a number");
      (c.model.router_mlp_layers > 0 ? mo.mlp_router_aux_weight : mo.aux_loss_weight) = w;
    }
    if (r["z_loss_weight"]) mo.z_loss_weight = ctx.get<double>(r["z_loss_weight"], "router.z_loss_weight", "a number");
    if (r["bias_update_rate"])
      mo.bias_update_rate = ctx.get<double>(r["bias_update_rate"], "router.bias_update_rate", "a number");
    if (r["balance"]) {
      const std::string rule = ctx.get<std::string>(r["balance"], "router.balance", "sign, proportional, pid or adam");
      if (rule == "sign") mo.balance_rule = ops::bias_controller::Rule::Sign;
      else if (rule == "proportional") mo.balance_rule = ops::bias_controller::Rule::Proportional;
      else if (rule == "pid") mo.balance_rule = ops::bias_controller::Rule::Pid;
      else if (rule == "adam") mo.balance_rule = ops::bias_controller::Rule::Adam;
      else ctx.bad("router.balance", r["balance"], fmt::format("unknown rule '{}' (sign, proportional, pid or adam)", rule));
    }
    for (const char* key : {"balance_kp", "balance_kd"}) {
      if (!r[key]) continue;
      const std::string name = fmt::format("router.{}", key);
      const double gain = ctx.get<double>(r[key], name, "a number");
      if (!(gain >= 0 && gain <= 100)) ctx.bad(name, r[key], "must be in [0, 100]");
      if (mo.balance_rule != ops::bias_controller::Rule::Pid)
        ctx.bad(name, r[key], "is the pid rule's gain: set router.balance: pid");
      (std::string(key) == "balance_kp" ? mo.balance_kp : mo.balance_kd) = gain;
    }
    if (r["init_gain"]) {
      mo.router_init_gain = ctx.get<double>(r["init_gain"], "router.init_gain", "a number");
      if (!(mo.router_init_gain >= 0 && mo.router_init_gain <= 100))
        ctx.bad("router.init_gain", r["init_gain"], "must be in [0, 100] (0: init_std, as the other matrices)");
    }
    if (r["lr_scale"]) {
      mo.router_lr_scale = ctx.get<double>(r["lr_scale"], "router.lr_scale", "a number");
      if (!(mo.router_lr_scale >= 0 && mo.router_lr_scale <= 1000))
        ctx.bad("router.lr_scale", r["lr_scale"], "must be in [0, 1000] (the routers' lr over the scheduled one)");
    }
    if (r["renormalize"]) mo.renormalize_gates = ctx.get<bool>(r["renormalize"], "router.renormalize", "true or false");
    if (r["forced_balance"])  // benchmarking only (ModelOptions::forced_balance)
      mo.forced_balance = ctx.get<bool>(r["forced_balance"], "router.forced_balance", "true or false");
    if (r["log_counts"]) c.log_routing_counts = ctx.get<bool>(r["log_counts"], "router.log_counts", "true or false");
    if (!(mo.aux_loss_weight >= 0) || !(mo.mlp_router_aux_weight >= 0) || !(mo.z_loss_weight >= 0) ||
        !(mo.bias_update_rate >= 0))
      ctx.bad("router", r, "weights and bias_update_rate must be >= 0");
  }
  if (root["ce_chunk"]) mo.ce_chunk = ctx.get<std::int64_t>(root["ce_chunk"], "ce_chunk", "an integer");
  if (mo.ce_chunk < 1) ctx.bad("ce_chunk", root["ce_chunk"], "must be >= 1");
  if (root["seed"]) c.seed = ctx.get<std::uint64_t>(root["seed"], "seed", "a non-negative integer");
  mo.init_seed = c.seed;
  if (root["init_from"]) {
    c.init_from = ctx.get<std::string>(root["init_from"], "init_from", "a keel checkpoint directory");
    if (c.init_from.empty()) ctx.bad("init_from", root["init_from"], "must name a keel checkpoint directory");
  }

  // data: a keel data config; phases default to one phase of equal weights
  const YAML::Node d = need("data");
  if (!d.IsMap()) ctx.bad("data", d, "must be a mapping (datasets, seq_length, seed, shuffle, phases)");
  try {
    c.data = data::parse_data_config(d, what + " (data)", "", /*default_phase=*/true);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  // the models and kernels index positions with 32-bit ints
  if (c.data.seq_length > static_cast<std::uint64_t>(INT32_MAX))
    ctx.bad("data.seq_length", d["seq_length"], fmt::format("{} is larger than {}", c.data.seq_length, INT32_MAX));
  if (const auto e = root["eval"]) {
    ctx.only(e, "eval", {"prefix", "interval", "batches"});
    if (e["prefix"]) c.eval_prefix = ctx.get<std::string>(e["prefix"], "eval.prefix", "a dataset prefix");
    if (e["interval"]) c.eval_interval = ctx.get<std::int64_t>(e["interval"], "eval.interval", "an integer");
    if (e["batches"]) c.eval_batches = ctx.get<std::int64_t>(e["batches"], "eval.batches", "an integer");
    if (c.eval_interval < 0) ctx.bad("eval.interval", e["interval"], "must be >= 0");
    if (c.eval_batches < 1) ctx.bad("eval.batches", e["batches"], "must be >= 1");
  }
  // optimizer + schedule
  if (const auto o = root["optimizer"]) {
    ctx.only(o, "optimizer", {"lr", "min_lr", "beta1", "beta2", "eps", "weight_decay", "clip", "muon"});
    auto num = [&](const char* k, double* f) {
      if (o[k]) *f = ctx.get<double>(o[k], std::string("optimizer.") + k, "a number");
    };
    num("lr", &c.schedule.peak_lr);
    c.schedule.min_lr = c.schedule.peak_lr * 0.1;
    num("min_lr", &c.schedule.min_lr);
    num("beta1", &c.adamw.beta1);
    num("beta2", &c.adamw.beta2);
    num("eps", &c.adamw.eps);
    num("weight_decay", &c.adamw.weight_decay);
    num("clip", &c.clip);
    if (!std::isfinite(c.clip)) ctx.bad("optimizer.clip", o["clip"], "must be a finite number (<= 0: no clipping)");
    try {
      optim::validate(c.adamw);
    } catch (const Error& e) {
      ctx.bad("optimizer", o, e.what());
    }
    if (!(c.schedule.peak_lr > 0) || !std::isfinite(c.schedule.peak_lr)) ctx.bad("optimizer.lr", o["lr"], "must be > 0");
  }
  c.muon.config.weight_decay = c.adamw.weight_decay;  // RMS matching: Muon reuses AdamW's decay
  if (const auto o = root["optimizer"]; o && o["muon"]) parse_muon(o["muon"], ctx, c.muon);
  if (const auto s = root["schedule"]) {
    ctx.only(s, "schedule", {"kind", "warmup_steps", "decay_fraction", "decay_shape"});
    if (s["kind"]) {
      const auto v = ctx.get<std::string>(s["kind"], "schedule.kind", "a string");
      try {
        c.schedule.kind = optim::parse_schedule_kind(v);
      } catch (const Error& e) {
        ctx.bad("schedule.kind", s["kind"], e.what());
      }
    }
    if (s["decay_shape"]) {
      const auto v = ctx.get<std::string>(s["decay_shape"], "schedule.decay_shape", "a string");
      try {
        c.schedule.decay_shape = optim::parse_decay_shape(v);
      } catch (const Error& e) {
        ctx.bad("schedule.decay_shape", s["decay_shape"], e.what());
      }
    }
    if (s["warmup_steps"]) c.schedule.warmup_steps = ctx.get<std::int64_t>(s["warmup_steps"], "schedule.warmup_steps", "an integer");
    if (s["decay_fraction"]) c.schedule.decay_fraction = ctx.get<double>(s["decay_fraction"], "schedule.decay_fraction", "a number");
  }
  if (const auto b = root["batch"]) {
    ctx.only(b, "batch", {"micro_batch", "grad_accum"});
    if (b["micro_batch"]) c.micro_batch = ctx.get<int>(b["micro_batch"], "batch.micro_batch", "an integer");
    if (b["grad_accum"]) c.grad_accum = ctx.get<int>(b["grad_accum"], "batch.grad_accum", "an integer");
    if (c.micro_batch < 1) ctx.bad("batch.micro_batch", b["micro_batch"], "must be >= 1");
    if (c.grad_accum < 1) ctx.bad("batch.grad_accum", b["grad_accum"], "must be >= 1");
  }
  if (const auto p = root["parallel"]) {
    ctx.only(p, "parallel",
             {"data", "context", "context_mode", "tensor", "sequence", "tensor_overlap", "tsp", "tsp_tables", "expert",
              "grad_reduce", "zero1"});
    if (p["data"]) c.parallel_data = ctx.get<int>(p["data"], "parallel.data", "an integer");
    if (p["context"]) c.parallel_context = ctx.get<int>(p["context"], "parallel.context", "an integer");
    if (p["context_mode"]) {
      const auto m =
          ctx.get<std::string>(p["context_mode"], "parallel.context_mode", "allgather, ring, alltoall or auto");
      try {
        c.context_mode_auto = m == "auto";  // resolved below, once the layout is read
        if (!c.context_mode_auto) c.model_options.context_mode = parallel::parse_context_mode(m);
      } catch (const UsageError&) {
        ctx.bad("parallel.context_mode", p["context_mode"], "must be allgather, ring, alltoall or auto");
      }
    }
    if (p["tensor"]) c.parallel_tensor = ctx.get<int>(p["tensor"], "parallel.tensor", "an integer");
    if (p["sequence"])
      c.model_options.sequence_parallel = ctx.get<bool>(p["sequence"], "parallel.sequence", "true or false");
    if (p["tensor_overlap"])
      c.model_options.tensor_overlap = ctx.get<bool>(p["tensor_overlap"], "parallel.tensor_overlap", "true or false");
    if (p["tsp"]) c.parallel_tsp = ctx.get<int>(p["tsp"], "parallel.tsp", "an integer");
    if (p["tsp_tables"]) {
      const auto m = ctx.get<std::string>(p["tsp_tables"], "parallel.tsp_tables", "auto, sweep or gather");
      try {
        c.model_options.tsp_tables = parallel::parse_tsp_tables(m);
      } catch (const UsageError&) {
        ctx.bad("parallel.tsp_tables", p["tsp_tables"], "must be auto, sweep or gather");
      }
    }
    if (p["expert"]) c.parallel_expert = ctx.get<int>(p["expert"], "parallel.expert", "an integer");
    if (c.context_mode_auto)
      c.model_options.context_mode = parallel::auto_context_mode(
          model::attention_layer_count(c.model, model::AttentionKind::kLinear) > 0, c.parallel_tensor, c.parallel_tsp);
    if (p["grad_reduce"]) {
      const auto v = ctx.get<std::string>(p["grad_reduce"], "parallel.grad_reduce", "fp32 or bf16");
      if (v != "fp32" && v != "bf16") ctx.bad("parallel.grad_reduce", p["grad_reduce"], "must be fp32 or bf16");
      c.data_parallel.grad_reduce = v == "bf16" ? parallel::GradReduceDtype::kBf16 : parallel::GradReduceDtype::kFp32;
    }
    if (const auto z = p["zero1"]) parse_zero1(z, ctx, c.data_parallel.zero1);
    if (c.parallel_data < 0) ctx.bad("parallel.data", p["data"], "must be >= 1 (or 0: every rank)");
    if (c.parallel_expert < 1) ctx.bad("parallel.expert", p["expert"], "must be >= 1");
    if (c.parallel_tensor < 1) ctx.bad("parallel.tensor", p["tensor"], "must be >= 1");
    if (c.parallel_context < 1) ctx.bad("parallel.context", p["context"], "must be >= 1");
    if (c.parallel_tsp < 1) ctx.bad("parallel.tsp", p["tsp"], "must be >= 1");
    if (c.model_options.sequence_parallel && c.parallel_tensor < 2)
      ctx.bad("parallel.sequence", p["sequence"], "needs parallel.tensor above 1 (it splits the tokens over the tensor group)");
    if (c.model_options.tsp_tables != parallel::TspTables::kAuto && c.parallel_tsp < 2)
      ctx.bad("parallel.tsp_tables", p["tsp_tables"],
              "needs parallel.tsp above 1 (it chooses how TSP's vocabulary tables meet the tokens)");
  }
  if (const auto k = root["kernels"]) {
    ctx.only(k, "kernels", {"moe_lanes", "cpu_threads", "profile"});
    if (k["profile"]) c.kernels.profile = ctx.get<bool>(k["profile"], "kernels.profile", "true or false");
    if (k["moe_lanes"]) c.kernels.moe_lanes = ctx.get<int>(k["moe_lanes"], "kernels.moe_lanes", "an integer");
    if (c.kernels.moe_lanes < 1 || c.kernels.moe_lanes > 8) ctx.bad("kernels.moe_lanes", k["moe_lanes"], "must be 1 to 8");
    if (k["cpu_threads"]) c.kernels.cpu_threads = ctx.get<int>(k["cpu_threads"], "kernels.cpu_threads", "an integer");
    if (c.kernels.cpu_threads < 0)
      ctx.bad("kernels.cpu_threads", k["cpu_threads"], "must be >= 0 (0: every core)");
  }
  c.steps = ctx.get<std::int64_t>(need("steps"), "steps", "an integer");
  if (c.steps < 1) ctx.bad("steps", root["steps"], "must be >= 1");
  if (root["log_interval"]) c.log_interval = ctx.get<std::int64_t>(root["log_interval"], "log_interval", "an integer");
  if (c.log_interval < 1) ctx.bad("log_interval", root["log_interval"], "must be >= 1");
  if (root["output_dir"]) c.output_dir = ctx.get<std::string>(root["output_dir"], "output_dir", "a directory");
  c.checkpoint_dir = c.output_dir;
  if (const auto k = root["checkpoint"]) {
    ctx.only(k, "checkpoint", {"dir", "interval", "final", "keep_last", "keep_every", "flush_behind_mib"});
    if (k["flush_behind_mib"])
      c.checkpoint_flush_behind_mib = ctx.get<int>(k["flush_behind_mib"], "checkpoint.flush_behind_mib", "an integer");
    if (c.checkpoint_flush_behind_mib < 0)
      ctx.bad("checkpoint.flush_behind_mib", k["flush_behind_mib"], "must be >= 0 (0: off)");
    if (k["keep_last"]) c.checkpoint_keep_last = ctx.get<int>(k["keep_last"], "checkpoint.keep_last", "an integer");
    if (k["keep_every"]) c.checkpoint_keep_every = ctx.get<int>(k["keep_every"], "checkpoint.keep_every", "an integer");
    if (c.checkpoint_keep_last < 0) ctx.bad("checkpoint.keep_last", k["keep_last"], "must be >= 0");
    if (c.checkpoint_keep_every < 0) ctx.bad("checkpoint.keep_every", k["keep_every"], "must be >= 0");
    if (k["final"]) c.checkpoint_final = ctx.get<bool>(k["final"], "checkpoint.final", "true or false");
    if (k["dir"]) c.checkpoint_dir = ctx.get<std::string>(k["dir"], "checkpoint.dir", "a directory");
    if (k["interval"]) c.checkpoint_interval = ctx.get<std::int64_t>(k["interval"], "checkpoint.interval", "an integer");
    if (c.checkpoint_interval < 0) ctx.bad("checkpoint.interval", k["interval"], "must be >= 0");
  }
  if (const auto f = root["fault"]) {
    ctx.only(f, "fault", {"loss_spike_sigma", "loss_spike_window"});
    if (f["loss_spike_sigma"])
      c.loss_spike_sigma = ctx.get<double>(f["loss_spike_sigma"], "fault.loss_spike_sigma", "a number");
    if (!(c.loss_spike_sigma >= 0) || !std::isfinite(c.loss_spike_sigma))
      ctx.bad("fault.loss_spike_sigma", f["loss_spike_sigma"], "must be >= 0 (0: off)");
    if (f["loss_spike_window"])
      c.loss_spike_window = ctx.get<int>(f["loss_spike_window"], "fault.loss_spike_window", "an integer");
    if (c.loss_spike_window < 5) ctx.bad("fault.loss_spike_window", f["loss_spike_window"], "must be >= 5 (steps)");
  }
  if (root["tensorboard"]) c.tensorboard = ctx.get<bool>(root["tensorboard"], "tensorboard", "true or false");
  if (root["mfu_peak_flops"]) {
    c.peak_flops = ctx.get<double>(root["mfu_peak_flops"], "mfu_peak_flops", "a number");
    if (!(c.peak_flops > 0)) ctx.bad("mfu_peak_flops", root["mfu_peak_flops"], "must be > 0");
  }
  if (root["device"]) {
    c.device = ctx.get<std::string>(root["device"], "device", "auto, cpu or cuda");
    if (c.device != "auto" && c.device != "cpu" && c.device != "cuda")
      ctx.bad("device", root["device"], "must be auto, cpu or cuda");
  }

  c.schedule.total_steps = c.steps;
  try {
    optim::validate(c.schedule);
  } catch (const Error& e) {
    throw UsageError(fmt::format("{}: {}", what, e.what()));
  }
  mo.micro_batch = c.micro_batch;
  mo.seq_length = static_cast<int>(c.data.seq_length);
  if (c.model.max_seq_len > 0 && mo.seq_length > c.model.max_seq_len)
    throw UsageError(fmt::format("{}: data.seq_length {} exceeds the model's max_seq_len {}", what, mo.seq_length,
                                 c.model.max_seq_len));
  YAML::Emitter em;
  em << root;
  c.text = em.c_str();
  return c;
}

TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::string text;
  try {
    text = read_config_file(path);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  return parse_train_config(text, path, overrides);
}

}  // namespace keel::train
