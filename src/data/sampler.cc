#include "data/sampler.h"

#include <algorithm>
#include <numeric>

#include "common/error.h"
#include "common/fileio.h"

namespace keel::data {
namespace {

// Lemire's nearly divisionless unbiased draw in [0, range).
std::uint64_t bounded(std::uint64_t& state, std::uint64_t range) {
  std::uint64_t x = splitmix64(state);
  unsigned __int128 m = static_cast<unsigned __int128>(x) * range;
  std::uint64_t low = static_cast<std::uint64_t>(m);
  if (low < range) {
    const std::uint64_t threshold = (0 - range) % range;
    while (low < threshold) {
      x = splitmix64(state);
      m = static_cast<unsigned __int128>(x) * range;
      low = static_cast<std::uint64_t>(m);
    }
  }
  return static_cast<std::uint64_t>(m >> 64);
}

std::uint64_t stream_seed(std::uint64_t seed, std::uint64_t epoch, std::uint64_t which) {
  std::uint64_t s = seed ^ 0x6b65656c64617461ULL;  // "keeldata"
  std::uint64_t a = splitmix64(s);
  s = a ^ (epoch * 0x9E3779B97F4A7C15ULL) ^ (which << 56);
  return splitmix64(s);
}

std::uint64_t get_u64(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j.at(key).is_number_unsigned())
    fail("data state: missing or invalid '{}'", key);
  return j.at(key).get<std::uint64_t>();
}

}  // namespace

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

std::vector<std::uint64_t> seeded_permutation(std::uint64_t n, std::uint64_t seed) {
  std::vector<std::uint64_t> p(n);
  std::iota(p.begin(), p.end(), std::uint64_t{0});
  std::uint64_t state = seed;
  for (std::uint64_t i = n; i > 1; --i) std::swap(p[i - 1], p[bounded(state, i)]);
  return p;
}

SequenceSampler::SequenceSampler(const IndexedDataset& dataset, std::uint64_t seq_length, std::uint64_t seed,
                                 bool shuffle)
    : ds_(dataset), seq_length_(seq_length), seed_(seed), shuffle_(shuffle) {
  if (seq_length < 1) throw UsageError("seq_length must be at least 1");
  if (ds_.tokens() < seq_length + 1)
    fail("{}: {} tokens, fewer than one sample of seq_length + 1 = {}", ds_.prefix(), ds_.tokens(), seq_length + 1);
  per_epoch_ = (ds_.tokens() - 1) / seq_length;
}

std::shared_ptr<const SequenceSampler::Epoch> SequenceSampler::epoch(std::uint64_t e) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& c : cache_)
    if (c->number == e) return c;
  auto ep = std::make_shared<Epoch>();
  ep->number = e;
  const std::uint64_t n = ds_.sequences();
  if (shuffle_) {
    ep->order = seeded_permutation(n, stream_seed(seed_, e, 1));
    ep->perm = seeded_permutation(per_epoch_, stream_seed(seed_, e, 2));
  } else {
    ep->order.resize(n);
    std::iota(ep->order.begin(), ep->order.end(), std::uint64_t{0});
    ep->perm.resize(per_epoch_);
    std::iota(ep->perm.begin(), ep->perm.end(), std::uint64_t{0});
  }
  ep->starts.resize(n);
  std::uint64_t at = 0;
  for (std::uint64_t k = 0; k < n; ++k) {
    ep->starts[k] = at;
    at += ds_.length(ep->order[k]);
  }
  if (cache_.size() >= 2) cache_.erase(cache_.begin());
  cache_.push_back(ep);
  return ep;
}

void SequenceSampler::sample(std::uint64_t index, std::uint32_t* out) const {
  const auto ep = epoch(index / per_epoch_);
  std::uint64_t pos = ep->perm[index % per_epoch_] * seq_length_;  // stream offset of the first token
  std::uint64_t left = seq_length_ + 1;
  // The sequence holding `pos`: the last one starting at or before it (skipping empty ones).
  std::uint64_t k = static_cast<std::uint64_t>(std::upper_bound(ep->starts.begin(), ep->starts.end(), pos) -
                                               ep->starts.begin()) - 1;
  while (left > 0) {
    const std::uint64_t s = ep->order[k];
    const std::uint64_t off = pos - ep->starts[k];
    const std::uint64_t len = ds_.length(s);
    const std::uint64_t take = std::min<std::uint64_t>(left, len - off);
    ds_.read(s, off, take, out);
    out += take;
    left -= take;
    pos += take;
    ++k;
  }
}

std::vector<std::uint32_t> SequenceSampler::sample(std::uint64_t index) const {
  std::vector<std::uint32_t> out(seq_length_ + 1);
  sample(index, out.data());
  return out;
}

nlohmann::json SingleStream::state() const {
  const std::uint64_t n = sampler_.samples_per_epoch();
  return {{"kind", "single"},
          {"seed", sampler_.seed()},
          {"seq_length", sampler_.seq_length()},
          {"samples_per_epoch", n},
          {"consumed_samples", consumed_},
          {"epoch", consumed_ / n},
          {"index", consumed_ % n}};
}

void SingleStream::restore(const nlohmann::json& s) {
  if (!s.is_object() || s.value("kind", "") != "single")
    fail("data state: not the state of a single-dataset stream");
  const std::uint64_t seed = get_u64(s, "seed"), len = get_u64(s, "seq_length"), n = get_u64(s, "samples_per_epoch");
  if (seed != sampler_.seed() || len != sampler_.seq_length() || n != sampler_.samples_per_epoch())
    fail("data state: saved for seed {}, seq_length {}, {} samples per epoch; this run has seed {}, seq_length {}, "
         "{} samples per epoch",
         seed, len, n, sampler_.seed(), sampler_.seq_length(), sampler_.samples_per_epoch());
  const std::uint64_t consumed = get_u64(s, "consumed_samples");
  if (get_u64(s, "epoch") != consumed / n || get_u64(s, "index") != consumed % n)
    fail("data state: epoch and index do not match consumed_samples {}", consumed);
  consumed_ = consumed;
}

BatchLoader::BatchLoader(SampleStream& stream, std::uint64_t global_batch, int rank, int world)
    : stream_(stream), global_batch_(global_batch), rank_(rank), world_(world) {
  if (world < 1 || rank < 0 || rank >= world)
    throw UsageError(fmt::format("rank {} is outside a world of {} ranks", rank, world));
  if (global_batch < 1 || global_batch % static_cast<std::uint64_t>(world) != 0)
    throw UsageError(fmt::format("the global batch ({}) must be a positive multiple of the world size ({})",
                                 global_batch, world));
}

std::vector<std::uint32_t> BatchLoader::next_batch(std::vector<SampleRef>* refs) {
  const std::uint64_t row = row_tokens();
  std::vector<std::uint32_t> out(micro_rows() * row);
  if (refs) refs->clear();
  std::uint64_t filled = 0;
  for (std::uint64_t i = 0; i < global_batch_; ++i) {
    const SampleRef ref = stream_.next();
    if (i % static_cast<std::uint64_t>(world_) != static_cast<std::uint64_t>(rank_)) continue;
    stream_.read(ref, out.data() + filled * row);
    if (refs) refs->push_back(ref);
    ++filled;
  }
  return out;
}

void save_state(const std::string& path, const nlohmann::json& state) {
  write_file_atomically(path, state.dump(2) + "\n");
}

nlohmann::json load_state(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not a data state file ({})", path, e.what());
  }
}

}  // namespace keel::data
