#include "data/blend.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <set>

#include "common/error.h"
#include "common/units.h"
#include "common/fileio.h"
#include "common/yaml_checks.h"

namespace keel::data {
namespace {

constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();

[[noreturn]] void bad(const std::string& what, const YAML::Node& n, const std::string& message) {
  throw UsageError(fmt::format("{}: {}{}", what, message, yaml_line_suffix(n)));
}

void only_keys(const std::string& what, const YAML::Node& map, std::initializer_list<const char*> keys,
               const std::string& where) {
  for (const auto& kv : map) {
    const std::string k = kv.first.as<std::string>();
    bool ok = false;
    for (const char* allowed : keys) ok = ok || k == allowed;
    if (!ok) {
      std::string list;
      for (const char* allowed : keys) list += (list.empty() ? "" : ", ") + std::string(allowed);
      bad(what, kv.first, fmt::format("unknown key '{}'{} (allowed: {})", k, where, list));
    }
  }
}

template <typename T>
T scalar(const std::string& what, const YAML::Node& n, const std::string& key) {
  if (!n.IsScalar()) bad(what, n, fmt::format("'{}' must be a scalar", key));
  try {
    return n.as<T>();
  } catch (const YAML::Exception&) {
    bad(what, n, fmt::format("'{}' has an invalid value '{}'", key, n.Scalar()));
  }
}

std::uint64_t get_u64(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j.at(key).is_number_unsigned())
    fail("data state: missing or invalid '{}'", key);
  return j.at(key).get<std::uint64_t>();
}

}  // namespace

std::uint64_t parse_token_count(const std::string& text) {
  const double t = std::round(parse_decimal_count(text, "token count"));
  if (!(t >= 1) || t > 1.8e19) throw UsageError(fmt::format("token count '{}' must be a positive number", text));
  return static_cast<std::uint64_t>(t);
}

DataConfig parse_data_config(const std::string& text, const std::string& what, const std::string& base_dir) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw UsageError(fmt::format("{}: invalid YAML: {} (line {})", what, e.msg, e.mark.line + 1));
  }
  return parse_data_config(root, what, base_dir, /*default_phase=*/false);
}

DataConfig parse_data_config(const YAML::Node& root, const std::string& what, const std::string& base_dir,
                             bool default_phase) {
  if (!root.IsMap()) throw UsageError(fmt::format("{}: a data config is a YAML mapping", what));
  check_yaml_document(root, what);
  only_keys(what, root, {"seq_length", "seed", "shuffle", "datasets", "phases"}, "");
  DataConfig c;
  if (!root["seq_length"]) throw UsageError(fmt::format("{}: missing 'seq_length'", what));
  const auto len = scalar<std::int64_t>(what, root["seq_length"], "seq_length");
  if (len < 1) bad(what, root["seq_length"], "'seq_length' must be at least 1");
  c.seq_length = static_cast<std::uint64_t>(len);
  if (root["seed"]) c.seed = scalar<std::uint64_t>(what, root["seed"], "seed");
  if (root["shuffle"]) c.shuffle = scalar<bool>(what, root["shuffle"], "shuffle");

  const YAML::Node ds = root["datasets"];
  if (!ds) throw UsageError(fmt::format("{}: missing 'datasets' (name: PREFIX)", what));
  if (!ds.IsMap() || ds.size() == 0) bad(what, ds, "'datasets' must map names to dataset prefixes");
  for (const auto& kv : ds) {
    const std::string name = kv.first.as<std::string>();
    const std::string prefix = scalar<std::string>(what, kv.second, "datasets." + name);
    if (prefix.empty()) bad(what, kv.second, fmt::format("dataset '{}' has an empty prefix", name));
    const std::filesystem::path p(prefix);
    c.names.push_back(name);
    c.prefixes.push_back(p.is_absolute() || base_dir.empty() ? prefix : (std::filesystem::path(base_dir) / p).string());
  }

  if (!root["phases"] && default_phase) {  // one phase that runs to the end, every dataset weighted alike
    PhaseConfig pc;
    pc.name = "phase1";
    pc.weights.assign(c.names.size(), 1.0 / static_cast<double>(c.names.size()));
    c.phases.push_back(std::move(pc));
    return c;
  }
  const YAML::Node phases = root["phases"];
  if (!phases) throw UsageError(fmt::format("{}: missing 'phases' (a list of {{tokens, weights}})", what));
  if (!phases.IsSequence() || phases.size() == 0) bad(what, phases, "'phases' must be a non-empty list");
  for (std::size_t i = 0; i < phases.size(); ++i) {
    const YAML::Node ph = phases[i];
    if (!ph.IsMap()) bad(what, ph, fmt::format("phase {} must be a mapping", i + 1));
    only_keys(what, ph, {"name", "tokens", "weights"}, fmt::format(" in phase {}", i + 1));
    PhaseConfig pc;
    pc.name = ph["name"] ? scalar<std::string>(what, ph["name"], "name") : fmt::format("phase{}", i + 1);
    const bool last = i + 1 == phases.size();
    if (ph["tokens"]) {
      const std::string t = scalar<std::string>(what, ph["tokens"], "tokens");
      try {
        pc.tokens = parse_token_count(t);
      } catch (const Error& e) {
        bad(what, ph["tokens"], fmt::format("phase '{}': {}", pc.name, e.what()));
      }
    } else if (!last) {
      bad(what, ph, fmt::format("phase '{}' needs 'tokens' (only the last phase runs to the end)", pc.name));
    }
    const YAML::Node w = ph["weights"];
    if (!w) bad(what, ph, fmt::format("phase '{}' needs 'weights'", pc.name));
    if (!w.IsMap()) bad(what, w, fmt::format("phase '{}': 'weights' must map dataset names to weights", pc.name));
    pc.weights.assign(c.names.size(), 0.0);
    double sum = 0;
    for (const auto& kv : w) {
      const std::string name = kv.first.as<std::string>();
      std::size_t d = 0;
      while (d < c.names.size() && c.names[d] != name) ++d;
      if (d == c.names.size())
        bad(what, kv.first, fmt::format("phase '{}' weighs unknown dataset '{}'", pc.name, name));
      const double v = scalar<double>(what, kv.second, "weights." + name);
      if (!(v >= 0) || !std::isfinite(v))
        bad(what, kv.second, fmt::format("phase '{}': weight of '{}' must be >= 0", pc.name, name));
      pc.weights[d] = v;
      sum += v;
    }
    if (!(sum > 0)) bad(what, w, fmt::format("phase '{}': the weights sum to 0", pc.name));
    for (double& v : pc.weights) v /= sum;
    c.phases.push_back(std::move(pc));
  }
  return c;
}

DataConfig load_data_config(const std::string& path) {
  std::string text;
  try {
    text = read_config_file(path);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  return parse_data_config(text, path, std::filesystem::path(path).parent_path().string());
}

BlendStream::BlendStream(std::vector<const SequenceSampler*> samplers, std::vector<PhaseConfig> phases)
    : samplers_(std::move(samplers)), phases_(std::move(phases)) {
  if (samplers_.empty()) fail("a blend needs at least one dataset");
  if (phases_.empty()) fail("a blend needs at least one phase");
  seq_length_ = samplers_[0]->seq_length();
  for (const auto* s : samplers_)
    if (s->seq_length() != seq_length_) fail("every dataset of a blend needs the same seq_length");
  std::uint64_t cum = 0;
  for (std::size_t p = 0; p < phases_.size(); ++p) {
    if (phases_[p].weights.size() != samplers_.size()) fail("phase {}: one weight per dataset", p + 1);
    if (p + 1 == phases_.size() || phases_[p].tokens == 0) {
      phase_end_.push_back(kNever);
    } else {
      cum += phases_[p].tokens;
      phase_end_.push_back((cum + seq_length_ - 1) / seq_length_);
    }
  }
  counts_.assign(samplers_.size(), 0);
  drawn_.assign(samplers_.size(), 0);
}

SampleRef BlendStream::next() {
  while (consumed_ >= phase_end_[phase_]) {
    ++phase_;
    in_phase_ = 0;
    std::fill(counts_.begin(), counts_.end(), 0);
  }
  const auto& w = phases_[phase_].weights;
  std::size_t best = 0;
  double best_err = -std::numeric_limits<double>::infinity();
  for (std::size_t d = 0; d < w.size(); ++d) {
    if (w[d] <= 0) continue;
    const double err = w[d] * static_cast<double>(in_phase_ + 1) - static_cast<double>(counts_[d]);
    if (err > best_err) {
      best_err = err;
      best = d;
    }
  }
  ++counts_[best];
  ++in_phase_;
  ++consumed_;
  return {static_cast<std::uint32_t>(best), drawn_[best]++};
}

nlohmann::json BlendStream::state() const {
  return {{"kind", "blend"},
          {"seed", samplers_[0]->seed()},
          {"seq_length", seq_length_},
          {"datasets", samplers_.size()},
          {"consumed_samples", consumed_},
          {"phase", phase_},
          {"phase_samples", in_phase_},
          {"phase_counts", counts_},
          {"drawn", drawn_},
          {"samples_per_epoch", samples_per_epoch()}};
}

std::vector<std::uint64_t> BlendStream::samples_per_epoch() const {
  std::vector<std::uint64_t> n;
  for (const auto* s : samplers_) n.push_back(s->samples_per_epoch());
  return n;
}

void BlendStream::restore(const nlohmann::json& s) {
  if (!s.is_object() || s.value("kind", "") != "blend") fail("data state: not the state of a blended stream");
  const std::uint64_t seed = get_u64(s, "seed"), len = get_u64(s, "seq_length"), n = get_u64(s, "datasets");
  if (seed != samplers_[0]->seed() || len != seq_length_ || n != samplers_.size())
    fail("data state: saved for seed {}, seq_length {}, {} datasets; this run has seed {}, seq_length {}, {} datasets",
         seed, len, n, samplers_[0]->seed(), seq_length_, samplers_.size());
  // Each dataset's size: another dataset under the same name would continue at a position
  // that means nothing in it. (States saved before the sizes were recorded skip this check.)
  if (s.contains("samples_per_epoch")) {
    const auto& saved = s.at("samples_per_epoch");
    const auto now = samples_per_epoch();
    if (!saved.is_array() || saved.size() != n) fail("data state: one 'samples_per_epoch' per dataset expected");
    for (std::size_t d = 0; d < n; ++d)
      if (!saved[d].is_number_unsigned() || saved[d].get<std::uint64_t>() != now[d])
        fail("data state: dataset {} had {} samples of seq_length {} when saved; this run's has {}: the dataset "
             "changed",
             d + 1, saved[d].dump(), seq_length_, now[d]);
  }
  const std::uint64_t phase = get_u64(s, "phase");
  if (phase >= phases_.size()) fail("data state: phase {} but the config has {}", phase + 1, phases_.size());
  auto counts = s.at("phase_counts").get<std::vector<std::uint64_t>>();
  auto drawn = s.at("drawn").get<std::vector<std::uint64_t>>();
  if (counts.size() != n || drawn.size() != n) fail("data state: one count per dataset expected");
  const std::uint64_t consumed = get_u64(s, "consumed_samples"), in_phase = get_u64(s, "phase_samples");
  std::uint64_t sum = 0;
  for (std::uint64_t c : counts) sum += c;
  if (sum != in_phase) fail("data state: phase_counts sum to {}, not phase_samples {}", sum, in_phase);
  if (consumed != phase_start(phase) + in_phase)
    fail("data state: consumed_samples {} does not match phase {} of this config", consumed, phase + 1);
  consumed_ = consumed;
  phase_ = phase;
  in_phase_ = in_phase;
  counts_ = std::move(counts);
  drawn_ = std::move(drawn);
}

DataPipeline::DataPipeline(const DataConfig& config) : config_(config) {
  std::vector<const SequenceSampler*> samplers;
  for (std::size_t i = 0; i < config_.prefixes.size(); ++i) {
    datasets_.push_back(std::make_unique<IndexedDataset>(config_.prefixes[i]));
    samplers_.push_back(
        std::make_unique<SequenceSampler>(*datasets_.back(), config_.seq_length, config_.seed + i, config_.shuffle));
    samplers.push_back(samplers_.back().get());
  }
  stream_ = std::make_unique<BlendStream>(std::move(samplers), config_.phases);
}

}  // namespace keel::data
