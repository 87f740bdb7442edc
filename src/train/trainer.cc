#include "train/trainer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <unistd.h>

#include "ckpt/metadata.h"
#include "ckpt/store.h"
#include "common/error.h"
#include "common/fileio.h"
#include "common/host.h"
#include "common/mpi_session.h"
#include "common/watchdog.h"
#include "common/parallel_for.h"
#include "ops/kernel_settings.h"
#include "optim/clip.h"
#include "optim/schedule.h"
#include "train/config_changes.h"
#include "train/write_wait.h"

namespace keel::train {
namespace {

std::string num(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return fmt::format("{:.6g}", x);
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// Sums n values in place over the data-parallel group (nothing on one rank).
void sum_over(const parallel::Group& g, double* x, int n) {
  if (g.size == 1) return;
  PeerWait wait("MPI_Allreduce (step statistics)");
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_DOUBLE, MPI_SUM, g.comm), "MPI_Allreduce");
}
void sum_over(const parallel::Group& g, std::int64_t* x, int n) {
  if (g.size == 1) return;
  PeerWait wait("MPI_Allreduce (step statistics)");
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, x, n, MPI_INT64_T, MPI_SUM, g.comm), "MPI_Allreduce");
}

// kernels.* of the config: process-wide settings of the ops, the same for every backend.
void apply_kernel_options(const KernelOptions& k) {
  set_cpu_threads(k.cpu_threads);
  ops::set_moe_lanes(k.moe_lanes);
}

}  // namespace

Trainer::Trainer(TrainConfig config, const parallel::Mesh& mesh, bool quiet)
    : cfg_(std::move(config)), mesh_(mesh), quiet_(quiet), loss_guard_(cfg_.loss_spike_sigma, cfg_.loss_spike_window) {
  // The micro-batches split over the dp ranks; the cp ranks of each share theirs (each runs its
  // part of every sequence), so the batch's rank is the dp coordinate, not the data group's.
  const int dp = mesh_.shape().dp;
  if (cfg_.grad_accum % dp != 0)
    throw UsageError(fmt::format("{}: batch.grad_accum ({}) must be a multiple of the data-parallel degree ({}): each "
                                 "step's micro-batches are split evenly over the ranks",
                                 cfg_.path, cfg_.grad_accum, dp));
  local_accum_ = cfg_.grad_accum / dp;
  if (!cfg_.init_from.empty() && !is_ckpt_directory(cfg_.init_from))
    throw UsageError(fmt::format("{}: init_from {}: not a keel checkpoint (expected a checkpoint root with `latest`, or a "
                                 "step directory with metadata.json; `keel ckpt import` makes one from released weights)",
                                 cfg_.path, cfg_.init_from));
  validate_trainable(cfg_.model, cfg_.model_options);  // what the backends support, before touching data
  data_ = std::make_unique<data::DataPipeline>(cfg_.data);
  for (std::size_t i = 0; i < cfg_.data.prefixes.size(); ++i) {
    // every token id must fit the model's vocabulary: checked per batch below; here a quick size check
    if (data_->dataset(i).tokens() < cfg_.data.seq_length + 1)
      throw UsageError(fmt::format("dataset {} holds {} tokens, fewer than seq_length + 1 = {}", cfg_.data.prefixes[i],
                                   data_->dataset(i).tokens(), cfg_.data.seq_length + 1));
  }
  // Rank r takes micro-batch r of every dp consecutive ones: the global sample order and each
  // step's set of micro-batches do not depend on the number of ranks.
  loader_ = std::make_unique<data::BatchLoader>(data_->stream(), static_cast<std::uint64_t>(cfg_.micro_batch) * dp,
                                                mesh_.coord().dp, dp);
  if (!cfg_.eval_prefix.empty()) {
    eval_ds_ = std::make_unique<data::IndexedDataset>(cfg_.eval_prefix);
    if (eval_ds_->tokens() < cfg_.data.seq_length + 1)
      throw UsageError(fmt::format("eval.prefix {} holds {} tokens, fewer than seq_length + 1 = {}", cfg_.eval_prefix,
                                   eval_ds_->tokens(), cfg_.data.seq_length + 1));
    eval_sampler_ = std::make_unique<data::SequenceSampler>(*eval_ds_, cfg_.data.seq_length, cfg_.data.seed + 1);
  }
  // Before anything is written or allocated: no other run may be writing into these directories
  // (a second run on the same GPU would otherwise fail for want of the first one's memory).
  lock_run_dirs(/*create_checkpoint_dir=*/false);
  // The model last: the data checks above are cheap, the backend allocates gigabytes.
  const bool cuda = cfg_.device == "cuda" || (cfg_.device == "auto" && cuda_training_available());
  const OptimizerConfig optimizer(cfg_.adamw, cfg_.muon);
  apply_kernel_options(cfg_.kernels);
  backend_ = cuda ? make_cuda_backend(cfg_.model, cfg_.model_options, optimizer, mesh_, cfg_.data_parallel)
                  : make_cpu_backend(cfg_.model, cfg_.model_options, optimizer, mesh_, cfg_.data_parallel);
  if (cfg_.kernels.profile) backend_->enable_profile(kProfileWarmupSteps);
  // CPUs: about 2 cores of fp32 FMA, the CI machine's; set mfu_peak_flops for a real figure.
  if (!(cfg_.peak_flops > 0)) cfg_.peak_flops = cuda ? device_peak_bf16_flops(backend_->device()) : 1e11;
  // After the backend, whose sizes it checks in a moment: the scan reads eval.batches x
  // micro_batch samples, hours for a micro_batch no machine holds.
  if (eval_sampler_) check_eval_tokens();
  // Read before this run's log opens: a fresh run must not append to another run's metrics.
  std::error_code ec;
  const std::filesystem::path metrics = MetricsLog::jsonl_path_in(cfg_.output_dir);
  earlier_metrics_ = std::filesystem::is_regular_file(metrics, ec) && std::filesystem::file_size(metrics, ec) > 0;
  if (mesh_.rank() == 0) log_ = std::make_unique<MetricsLog>(cfg_.output_dir, cfg_.tensorboard);
  if (mesh_.rank() != 0) quiet_ = true;  // rank 0 speaks for the world
  const std::int64_t N = std::int64_t(cfg_.micro_batch) * cfg_.model_options.seq_length;
  inputs_.resize(N);
  targets_.resize(N);
}

Trainer::~Trainer() = default;

void Trainer::check_eval_tokens() const {
  // evaluate() reads the same samples every time: the first eval_batches x micro_batch ones.
  const std::int64_t L = static_cast<std::int64_t>(cfg_.data.seq_length);
  std::vector<std::uint32_t> row(L + 1);
  for (std::int64_t i = 0; i < cfg_.eval_batches * cfg_.micro_batch; ++i) {
    eval_sampler_->sample(static_cast<std::uint64_t>(i), row.data());
    for (const std::uint32_t t : row)
      if (t >= static_cast<std::uint64_t>(cfg_.model.vocab_size))
        throw UsageError(fmt::format("eval.prefix {}: eval sample {} holds token id {}, outside the model's vocabulary "
                                     "({}): tokenized with another tokenizer?",
                                     cfg_.eval_prefix, i, t, cfg_.model.vocab_size));
  }
}

void Trainer::lock_run_dirs(bool create_checkpoint_dir) {
  namespace fs = std::filesystem;
  std::string refused, notes;
  if (mesh_.rank() == 0) {
    const std::string who = lock_holder_line("keel train " + cfg_.path);
    auto take = [&](const char* key, const std::string& dir, std::shared_ptr<DirLock>& slot) {
      if (slot || !refused.empty()) return;
      const DirLock::Result r = DirLock::acquire(dir, who);
      if (!r.unsupported.empty()) {
        notes += fmt::format("warning: {} {}: cannot lock it ({}): a second run writing there at once would not be "
                             "stopped\n",
                             key, dir, r.unsupported);
        return;
      }
      if (!r.lock) {
        refused = fmt::format("{} {} is in use by another run: {} holds its lock {}; wait for that run to end (or stop "
                              "it), or train into another directory",
                              key, dir, r.holder.empty() ? "a process that is starting or ending (it has not written its name)" : r.holder,
                              (fs::path(dir) / DirLock::kFileName).string());
        return;
      }
      if (!r.stale.empty())
        notes += fmt::format("{} {}: the run that held its lock is gone ({}): taking the lock over\n", key, dir, r.stale);
      slot = r.lock;
    };
    // A directory that cannot be made is left to the checks that name it (MetricsLog, check_checkpoint_dir).
    std::error_code ec;
    fs::create_directories(cfg_.output_dir, ec);
    if (fs::is_directory(cfg_.output_dir, ec)) take("output_dir", cfg_.output_dir, output_lock_);
    if (create_checkpoint_dir) fs::create_directories(cfg_.checkpoint_dir, ec);
    if (fs::is_directory(cfg_.checkpoint_dir, ec)) take("checkpoint.dir", cfg_.checkpoint_dir, checkpoint_lock_);
  }
  if (mesh_.size() > 1) {
    PeerWait wait("MPI_Bcast (directory locks)");
    broadcast_string(refused, 0, mesh_.world());
  }
  if (!refused.empty()) throw UsageError(refused);
  if (mesh_.rank() == 0 && !quiet_ && !notes.empty()) std::printf("%s", notes.c_str());
}

int Trainer::poll_stop() {
  int sig = stop_requested_ ? stop_requested_() : 0;
  if (mesh_.size() > 1) {
    PeerWait wait("MPI_Allreduce (stop request)");
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, &sig, 1, MPI_INT, MPI_MAX, mesh_.world()), "MPI_Allreduce");
  }
  return sig;
}

void Trainer::check_checkpoint_dir() const {
  namespace fs = std::filesystem;
  const std::string& dir = cfg_.checkpoint_dir;
  // Found now, not at the first save after hours of training. (Error, not UsageError: on a
  // cluster one node's view of the directory can differ, and that rank must speak for itself.)
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    fail("checkpoint.dir {}: cannot create it: {}", dir, ec ? ec.message() : "a file of that name is in the way");
  const std::string why =
      why_no_new_file((fs::path(dir) / fmt::format(".keel-write-test.{}.{}", mesh_.data().rank, ::getpid())).string());
  if (!why.empty()) fail("checkpoint.dir {}: cannot write there: {}", dir, why);
  if (!resumed_) {
    // A fresh run must not write over the checkpoints of another (committed steps count without
    // a `latest` too: a crash between the first commit and its pointer leaves that).
    std::int64_t committed = -1;
    for (const auto& e : ckpt::list_steps(dir))
      if (e.committed) committed = e.step;
    if (is_ckpt_directory(dir) || committed >= 0) {
      std::string latest;
      try {
        latest = ckpt::latest_dir(dir);
      } catch (const Error&) {
      }
      throw UsageError(fmt::format("checkpoint.dir {} already holds checkpoints ({}): continue with --resume {}, or "
                                   "train into another directory",
                                   dir,
                                   latest.empty() ? fmt::format("up to step {}", committed)
                                                  : fmt::format("its `latest`: {}", latest),
                                   dir));
    }
    return;
  }
  // A resumed run writes only into its own lineage: the directory it resumed from, up to the
  // step it resumed at. Anything else would mix two runs' steps, and retention (by step
  // number) would then delete one run's checkpoints to keep the other's.
  std::int64_t newest = -1;
  for (const auto& e : ckpt::list_steps(dir))
    if (e.committed) newest = std::max(newest, e.step);
  if (newest < 0) return;
  const fs::path source = fs::path(resumed_from_).parent_path();
  if (!fs::equivalent(source, dir, ec))
    throw UsageError(fmt::format("checkpoint.dir {} holds another run's checkpoints (up to step {}) and this run "
                                 "resumed from {}: train into an empty checkpoint.dir, or into {}",
                                 dir, newest, resumed_from_, source.string()));
  if (newest > step_)
    throw UsageError(fmt::format("checkpoint.dir {} holds checkpoints up to step {}, after step {} this run resumed "
                                 "from: its saves would collide with them; to branch from step {}, resume with "
                                 "--set checkpoint.dir=<an empty directory>",
                                 dir, newest, step_, step_));
}

std::string Trainer::checkpoint_path(std::int64_t step) const {
  return (std::filesystem::path(cfg_.checkpoint_dir) / ckpt::step_dir_name(step)).string();
}

StepStats Trainer::train_step() {
  TrainBackend& m = *backend_;
  const std::int64_t L = static_cast<std::int64_t>(cfg_.data.seq_length);
  const std::int64_t V = cfg_.model.vocab_size;
  StepStats s;
  s.step = step_ + 1;
  m.zero_grads();
  m.begin_step(local_accum_);
  // Every micro-batch's loss is a mean over its tokens; the step's is the mean over the
  // grad_accum micro-batches of all ranks (gradients are summed over ranks by the optimizer).
  const float scale = 1.0f / static_cast<float>(cfg_.grad_accum);
  // Fault injection (nan@S:rR, spike@S:rR:F): the first micro-batch's loss parts are NaN (times
  // F) on rank R and the other ranks of its tensor group (tp consecutive world ranks, whose
  // losses are one), after its backward: every rank runs the same collectives, and the checks
  // below stop them all.
  bool nan_injected = false;
  double spike = 1;
  if (!faults_.empty()) {
    // (TSP: its group, consecutive ranks that share the loss likewise)
    const int first = mesh_.rank() - model::weight_coord(mesh_.shape(), mesh_.coord()).tp;
    for (int r = first; r < first + model::weight_shape(mesh_.shape()).tp; ++r) {
      const bool nan = faults_.nan_at(s.step, r);
      const double f = faults_.loss_factor_at(s.step, r);
      if (!nan && f == 1) continue;
      nan_injected = nan_injected || nan;
      if (f != 1) spike = f;
      if (r == mesh_.rank()) {
        std::fflush(stdout);
        std::fprintf(stderr, "keel: fault injection: rank %d's loss is %s at step %lld\n", r,
                     nan ? "NaN" : fmt::format("multiplied by {:g}", f).c_str(), static_cast<long long>(s.step));
        std::fflush(stderr);
      }
    }
  }
  for (int a = 0; a < local_accum_; ++a) {
    const auto rows = loader_->next_batch();
    for (int b = 0; b < cfg_.micro_batch; ++b) {
      const std::uint32_t* row = rows.data() + b * (L + 1);
      for (std::int64_t t = 0; t <= L; ++t)
        if (row[t] >= V)
          throw Error(fmt::format("step {}: token id {} is outside the model's vocabulary ({}): a dataset tokenized "
                                  "with another tokenizer?",
                                  s.step, row[t], V));
      for (std::int64_t t = 0; t < L; ++t) {
        inputs_[b * L + t] = row[t];
        targets_[b * L + t] = static_cast<std::int32_t>(row[t + 1]);
      }
    }
    LossParts lp = m.forward(inputs_.data(), targets_.data());
    if (!std::isfinite(lp.total)) {  // reported below (on every rank alike), with no backward of it
      s.loss = lp.total, s.ce = lp.ce, s.aux = lp.aux, s.z = lp.z;
      break;
    }
    m.backward(scale);
    if (a == 0 && nan_injected) lp.total = lp.ce = lp.aux = lp.z = std::nan("");
    if (a == 0) lp.total *= spike, lp.ce *= spike, lp.aux *= spike, lp.z *= spike;
    s.loss += lp.total * scale;
    s.ce += lp.ce * scale;
    s.aux += lp.aux * scale;
    s.z += lp.z * scale;
  }
  // the same totals (and the same verdict) on every rank; the cp ranks of a micro-batch each
  // hold its whole loss
  double parts[4] = {s.loss, s.ce, s.aux, s.z};
  sum_over(mesh_.data(), parts, 4);
  const double cp = mesh_.shape().cp;
  s.loss = parts[0] / cp, s.ce = parts[1] / cp, s.aux = parts[2] / cp, s.z = parts[3] / cp;
  if (!std::isfinite(s.loss))
    throw NonFiniteStep(fmt::format("step {}: loss is {} (ce {}, aux {}, z {}): stopping", s.step, num(s.loss), num(s.ce),
                            num(s.aux), num(s.z)));
  if (loss_guard_.is_spike(s.loss)) throw NonFiniteStep(loss_guard_.spike_message(s.step, s.loss));
  s.lr = optim::lr_at(cfg_.schedule, step_);
  StepResult r;
  try {
    r = m.clip_and_step(cfg_.clip, s.lr);
  } catch (const optim::NonFiniteGradient& e) {
    throw NonFiniteStep(fmt::format("step {}: gradient norm is {}{}: stopping", s.step, num(e.norm()),
                            e.param().empty() ? "" : fmt::format(" (first non-finite gradient in '{}')", e.param())));
  }
  s.grad_norm = r.grad_norm;
  // The balancing controller sees the expert loads of the whole data-parallel group.
  if (mesh_.data().size > 1) {
    std::vector<std::int64_t> all;
    for (int i = 0; i < m.moe_layer_count(); ++i) {
      const auto l = m.load(i);
      all.insert(all.end(), l.begin(), l.end());
    }
    sum_over(mesh_.data(), all.data(), static_cast<int>(all.size()));
    std::size_t at = 0;
    for (int i = 0; i < m.moe_layer_count(); ++i) {
      const std::size_t n = m.load(i).size();
      m.set_load(i, std::vector<std::int64_t>(all.begin() + at, all.begin() + at + n));
      at += n;
    }
  }
  // expert load of this step (before the bias update resets the counters)
  s.load_min = 0, s.load_max = 0, s.busiest_share = 0, s.skip_share = 0;
  bool first = true;
  for (int i = 0; i < m.moe_layer_count(); ++i) {
    const auto load = m.load(i);
    if (cfg_.log_routing_counts) s.routing_counts.push_back(load);
    double mean = 0;
    for (auto c : load) mean += static_cast<double>(c);
    const double total = mean;
    mean /= static_cast<double>(load.size());
    const double busiest = total > 0 ? static_cast<double>(*std::max_element(load.begin(), load.end())) / total : 0;
    const double skip = total > 0 && cfg_.model.router_skip_expert ? static_cast<double>(load.back()) / total : 0;
    s.layer_busiest.push_back(busiest), s.layer_skip.push_back(skip);
    s.busiest_share = std::max(s.busiest_share, busiest);
    s.skip_share = std::max(s.skip_share, skip);
    for (auto c : load) {
      const double f = mean > 0 ? c / mean : 0;
      s.load_min = first ? f : std::min(s.load_min, f);
      s.load_max = first ? f : std::max(s.load_max, f);
      first = false;
    }
  }
  m.update_router_bias();
  loss_guard_.record(s.loss);
  ++step_;
  return s;
}

// The step line's routing: each MoE layer's busiest class over its fair share (1 / classes,
// skip included) and skip share, or for more than 8 MoE layers the worst layer's.
static std::string routing_text(const StepStats& s, int classes, bool skip) {
  if (s.layer_busiest.empty()) return "";
  std::string out = " | busiest/fair";
  if (s.layer_busiest.size() <= 8) {
    for (double b : s.layer_busiest) out += fmt::format(" {:.2f}", b * classes);
  } else {
    const auto worst = std::max_element(s.layer_busiest.begin(), s.layer_busiest.end()) - s.layer_busiest.begin();
    out += fmt::format(" {:.2f} (layer {} of {})", s.layer_busiest[worst] * classes, worst, s.layer_busiest.size());
  }
  if (skip) {
    const auto [lo, hi] = std::minmax_element(s.layer_skip.begin(), s.layer_skip.end());
    out += fmt::format(" skip {:.2f}-{:.2f}", *lo, *hi);
  }
  return out;
}

void Trainer::log_step(const StepStats& s, double seconds, std::int64_t tokens) {
  const double tps = seconds > 0 ? tokens / seconds : 0;
  const double flops = backend_->flops_per_micro_batch() * cfg_.grad_accum;
  const double steps_done = static_cast<double>(tokens) /
                            (double(cfg_.micro_batch) * cfg_.model_options.seq_length * cfg_.grad_accum);
  // per device: the group's FLOPs over the group's peak
  const double mfu = seconds > 0 ? flops * steps_done / seconds / (cfg_.peak_flops * mesh_.size()) : 0;
  const double mem = mib(backend_->memory_bytes());
  if (!quiet_)
    std::printf("step %6lld/%lld | loss %.4f (ce %.4f aux %.3f z %.3f) | lr %.3e | grad norm %.3f | %.0f tok/s | "
                "MFU %.2f%% | mem %.1f MiB | expert load %.2f-%.2f%s\n",
                static_cast<long long>(s.step), static_cast<long long>(cfg_.steps), s.loss, s.ce, s.aux, s.z, s.lr,
                s.grad_norm, tps, 100 * mfu, mem, s.load_min, s.load_max,
                routing_text(s, cfg_.model.experts + (cfg_.model.router_skip_expert ? 1 : 0), cfg_.model.router_skip_expert).c_str());
  std::fflush(stdout);
  if (!log_) return;
  std::vector<std::pair<std::string, double>> values = {
      {"loss", s.loss},
      {"ce", s.ce},
      {"aux", s.aux},
      {"z", s.z},
      {"lr", s.lr},
      {"grad_norm", s.grad_norm},
      {"tokens_per_s", tps},
      {"mfu", mfu},
      {"memory_mib", mem},
      {"expert_load_min", s.load_min},
      {"expert_load_max", s.load_max},
      {"routing_busiest_share", s.busiest_share},
      {"routing_skip_share", s.skip_share}};
  for (std::size_t i = 0; i < s.layer_busiest.size(); ++i) {  // per MoE layer
    values.emplace_back(fmt::format("routing_busiest_share.{}", i), s.layer_busiest[i]);
    if (cfg_.model.router_skip_expert) values.emplace_back(fmt::format("routing_skip_share.{}", i), s.layer_skip[i]);
  }
  log_->scalars(s.step, values);
  if (!s.routing_counts.empty()) log_->table(s.step, "routing_counts", s.routing_counts);
}

std::vector<StepStats> Trainer::run(std::int64_t until, bool checkpoint_at_stop) {
  if (until < 0) until = cfg_.steps;
  until = std::min(until, cfg_.steps);
  const std::int64_t start = step_;
  const bool stops_early = checkpoint_at_stop && until < cfg_.steps && until > start;
  const bool saves = until > start && (cfg_.checkpoint_final || cfg_.checkpoint_interval > 0 || stops_early);
  // Checked before any work: where this run writes, and that it writes over nothing of another run's.
  if (!started_) {
    if (saves) {
      lock_run_dirs(/*create_checkpoint_dir=*/true);
      check_checkpoint_dir();
    }
    int earlier = earlier_metrics_ && !resumed_ && !restarted_;
    if (mesh_.size() > 1) {
      PeerWait wait("MPI_Bcast (start-up check)");
      mpi_check(MPI_Bcast(&earlier, 1, MPI_INT, 0, mesh_.world()), "MPI_Bcast");
    }
    if (earlier)
      throw UsageError(fmt::format("output_dir {} already holds another run's metrics.jsonl: continue that run with "
                                   "--resume {}, or train into another directory",
                                   cfg_.output_dir, cfg_.checkpoint_dir));
    started_ = true;
  }
  if (step_ == 0 && !resumed_ && !initialized_ && !cfg_.init_from.empty()) init_from_weights(cfg_.init_from);
  if (saves) make_checkpointer();
  std::vector<StepStats> out;
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  std::int64_t tokens = 0;
  const std::int64_t step_tokens = std::int64_t(cfg_.micro_batch) * cfg_.model_options.seq_length * cfg_.grad_accum;
  if (!quiet_ && step_ == 0)
    std::printf("keel train: model '%s' (%lld parameters, %d layers, %d MoE) on %s%s, %lld steps of %lld tokens, "
                "recompute %s%s\n",
                cfg_.model.name.c_str(), static_cast<long long>(backend_->param_count()), cfg_.model.layers,
                backend_->moe_layer_count(), backend_->device().c_str(),
                parallel_text().c_str(),
                static_cast<long long>(cfg_.steps), static_cast<long long>(step_tokens),
                to_string(cfg_.model_options.recompute),
                cfg_.model_options.forced_balance ? ", routing forced-balance (benchmark only)" : "");
  if (!quiet_ && step_ == 0) std::printf("%s\n", memory_report(*backend_).c_str());
  if (!heartbeat_started_) {  // after start-up (and resume), before the first step
    heartbeat_started_ = true;
    heartbeat("start", 0);
  }
  while (step_ < until) {
    // A stop request (SIGINT / SIGTERM) of any rank stops every rank here, at the same step.
    if (stop_requested_) {
      if (const int sig = poll_stop(); sig != 0) {
        stopped_by_ = sig;
        break;
      }
    }
    progress(fmt::format("step {}", step_ + 1));
    const auto step_start = clock::now();
    const double waited_before = peer_wait_seconds();
    // Under fault injection the previous step's heartbeat is on file before a fault can end the
    // process, as keel run's drills expect (a real crash may leave it one step behind).
    if (heartbeat_writer_ && !faults_.empty()) heartbeat_writer_->flush();
    faults_.before_step(step_ + 1, mesh_.rank());  // fault injection: kill, exit, hang, slow
    if (std::find(skip_steps_.begin(), skip_steps_.end(), step_ + 1) != skip_steps_.end()) {
      // --skip-step: this step's micro-batches, drawn as train_step() would and dropped
      for (int a = 0; a < local_accum_; ++a) loader_->next_batch();
      if (!quiet_) std::printf("keel train: skipping the data of step %lld\n", static_cast<long long>(step_ + 1));
    }
    const nlohmann::json data_at = loader_->state();  // the data position before this step's batches
    StepStats s;
    try {
      s = train_step();
    } catch (const NonFiniteStep&) {
      // A non-finite loss or gradient norm stops every rank alike before any update: the state
      // of step_ is still good. Saved here (with the data position before this step), a restart
      // that skips this step's data (--skip-step, keel run) loses only this step.
      if (saves) {
        loader_->restore(data_at);
        progress(fmt::format("the checkpoint of step {} (before the non-finite step)", step_));
        save_checkpoint();
        finish_checkpoint();
      }
      throw;
    }
    tokens += step_tokens;
    out.push_back(s);
    if (s.step % cfg_.log_interval == 0 || s.step == 1 || s.step == cfg_.steps) {
      const double sec = std::chrono::duration<double>(clock::now() - t0).count();
      log_step(s, sec, tokens);
      t0 = clock::now();
      tokens = 0;
    }
    const bool last = step_ == cfg_.steps;
    if (eval_sampler_ && ((cfg_.eval_interval > 0 && step_ % cfg_.eval_interval == 0) || last)) {
      progress(fmt::format("eval at step {}", step_));
      const double e = evaluate();
      if (!quiet_) std::printf("eval   %6lld | loss %.4f\n", static_cast<long long>(step_), e);
      if (log_) log_->scalars(step_, {{"eval_loss", e}});
    }
    if ((cfg_.checkpoint_interval > 0 && step_ % cfg_.checkpoint_interval == 0) || (last && cfg_.checkpoint_final)) {
      progress(fmt::format("the checkpoint of step {}", step_));
      save_checkpoint();
    } else {
      commit_when_written();
    }
    const double step_seconds = std::chrono::duration<double>(clock::now() - step_start).count();
    const double waited = peer_wait_seconds() - waited_before;
    // keel run's GPU straggler check: the device's own speed, timed after the step (heartbeats only)
    const double device = !beating() ? 0.0
                                                 : backend_->device_canary_seconds(faults_.canary_repeats_at(step_, mesh_.rank()));
    heartbeat("step", step_seconds, waited, device);
    std::fflush(stdout);
  }
  // Stopped before the schedule's end (--stop-after, or a signal in a run that saves
  // checkpoints): resumable from here (unless just saved; a signal before any step saves nothing).
  if (stops_early || (stopped_by_ != 0 && saves && step_ > start)) {
    progress(fmt::format("the checkpoint of step {}", step_));
    save_checkpoint();
  }
  progress("committing the last checkpoint");
  finish_checkpoint();  // a run ends with its last checkpoint committed
  if (log_) log_->flush();
  heartbeat("done", last_step_seconds_);
  return out;
}

void Trainer::heartbeat(const char* phase, double step_seconds, double wait_seconds, double device_seconds) {
  if (!beating()) return;
  if (std::strcmp(phase, "step") == 0) last_step_seconds_ = step_seconds;
  HeartbeatRecord& r = beat_;
  if (r.host.empty()) {  // the rank's identity, once
    r.rank = mesh_.rank(), r.world = mesh_.size(), r.pid = static_cast<std::int64_t>(::getpid());
    r.host = host_name(), r.gpu = backend_->device_id();
  }
  r.phase = phase, r.step = step_;
  r.step_seconds = step_seconds, r.wait_seconds = wait_seconds, r.device_seconds = device_seconds;
  r.time = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string why, flag;  // the first failure and the flag it is about
  if (heartbeat_udp_) {  // first, and from here: a file write held by the file system holds no datagram
    // (a full socket buffer drops this beat, by design: the next one replaces it)
    if (!heartbeat_udp_->send(heartbeat_json(r, heartbeat_tag_)) && errno != EAGAIN && errno != EWOULDBLOCK &&
        errno != ENOBUFS)
      why = std::strerror(errno), flag = "--heartbeat-udp";
  }
  if (!heartbeat_dir_.empty()) {
    if (!heartbeat_writer_)
      heartbeat_writer_ = std::make_unique<HeartbeatWriter>(heartbeat_file_writer(heartbeat_dir_, mesh_.rank()));
    heartbeat_writer_->post(heartbeat_json(r) + "\n");
    if (std::strcmp(phase, "done") == 0) heartbeat_writer_->flush();  // keel run reads it once the process is gone
    if (std::string file_why = heartbeat_writer_->take_error(); !file_why.empty())
      why = std::move(file_why), flag = "--heartbeat " + heartbeat_dir_;
  }
  if (why.empty() || heartbeat_warned_) return;
  heartbeat_warned_ = true;
  std::fprintf(stderr, "keel: warning: %s%s: %s; training goes on (this warning once)\n",
               mesh_.size() > 1 ? fmt::format("[rank {}] ", mesh_.rank()).c_str() : "", flag.c_str(), why.c_str());
  std::fflush(stderr);
}

void Trainer::progress(const std::string& what) {
  if (dog_ && dog_seconds_ > 0) dog_->arm(what, dog_seconds_);
}

double Trainer::evaluate() {
  if (!eval_sampler_) fail("evaluate: no eval.prefix configured");
  const std::int64_t L = static_cast<std::int64_t>(cfg_.data.seq_length);
  std::vector<std::uint32_t> row(L + 1);
  double sum = 0;
  // micro-batch b on the dp rank b % dp (its cp ranks share it); the mean over all of them on
  // every rank
  for (std::int64_t b = mesh_.coord().dp; b < cfg_.eval_batches; b += mesh_.shape().dp) {
    for (int r = 0; r < cfg_.micro_batch; ++r) {
      eval_sampler_->sample(static_cast<std::uint64_t>(b * cfg_.micro_batch + r), row.data());
      for (std::int64_t t = 0; t < L; ++t) {  // token ids checked at start-up (check_eval_tokens)
        inputs_[r * L + t] = row[t];
        targets_[r * L + t] = static_cast<std::int32_t>(row[t + 1]);
      }
    }
    sum += backend_->forward(inputs_.data(), targets_.data()).ce;
  }
  backend_->reset_load();
  sum_over(mesh_.data(), &sum, 1);
  return sum / static_cast<double>(cfg_.eval_batches) / mesh_.shape().cp;
}

void Trainer::make_checkpointer() {
  if (ckpt_) return;
  TrainCheckpointOptions o;
  o.keep_last = cfg_.checkpoint_keep_last;
  o.keep_every = cfg_.checkpoint_keep_every;
  o.flush_behind_bytes = static_cast<std::uint64_t>(cfg_.checkpoint_flush_behind_mib) << 20;
  o.context_parallel = mesh_.shape().cp;
  o.tsp = mesh_.shape().tsp;
  o.fail_with_enospc_at = [this](std::int64_t step) {  // fault injection: diskfull@S:rR
    const bool full = faults_.disk_full_at(step, mesh_.rank());
    if (full)
      std::fprintf(stderr, "keel: fault injection: rank %d finds the disk full saving step %lld\n", mesh_.rank(),
                   static_cast<long long>(step));
    return full;
  };
  o.write_delay_ms_at = [this](std::int64_t step) {  // fault injection: slowsave@S:rR:MS
    const std::int64_t ms = faults_.save_delay_ms_at(step, mesh_.rank());
    if (ms > 0)
      std::fprintf(stderr, "keel: fault injection: rank %d's writes of the checkpoint of step %lld take at least %lld ms\n",
                   mesh_.rank(), static_cast<long long>(step), static_cast<long long>(ms));
    return ms;
  };
  ckpt_ = std::make_unique<TrainCheckpointer>(cfg_.checkpoint_dir, o, mesh_.world());
  // the staging buffers now, not in the first save's stall (pinned gigabytes take seconds)
  ckpt_->reserve(backend_->checkpoint_view(), backend_->layout());
}

void Trainer::save_checkpoint() {
  // Saved already (by this process, or the checkpoint this run resumed from): nothing to add.
  std::error_code ec;
  const auto metadata = std::filesystem::path(checkpoint_path(step_)) / "metadata.json";
  if (saved_step_ == step_ || std::filesystem::exists(metadata, ec)) return;
  make_checkpointer();
  const auto t0 = std::chrono::steady_clock::now();
  // save() would first complete the previous save anyway; done here to report it apart.
  finish_checkpoint();
  const double previous = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // this rank's shard where it lives (GPU memory on the CUDA backend: copied once, into pinned staging)
  const CheckpointView view = backend_->checkpoint_view();
  nlohmann::json extra;
  extra["model"] = cfg_.model.name;
  extra["sampler"] = loader_->state();
  extra["rng"] = {{"init_seed", cfg_.seed}};  // the loop draws no random numbers beyond the sampler's
  extra["config"] = cfg_.text;
  extra["device"] = backend_->device();
  extra["data_parallel"] = mesh_.shape().dp;
  extra["context_parallel"] = mesh_.shape().cp;
  extra["expert_parallel"] = mesh_.expert().size;
  if (loss_guard_.enabled()) extra["loss_window"] = loss_guard_.window();  // restored by resume()
  const double staging = ckpt_->save(step_, view, backend_->layout(), extra);
  saved_step_ = step_;
  const double stall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (log_) log_->scalars(step_, {{"checkpoint_stall_s", stall}, {"checkpoint_staging_s", staging}});
  if (!quiet_)
    std::printf("checkpoint step %lld: training stalled %.3f s (%.3f s staging the state, %.3f s completing the previous "
                "save); writing in the background\n",
                static_cast<long long>(step_), stall, staging, previous);
}

void Trainer::commit_when_written() {
  // Commit as soon as every rank's writes are on disk rather than at the next save: a rank
  // that dies or hangs before then (no destructor runs) would otherwise leave that checkpoint
  // uncommitted, losing two intervals of work instead of one. One small all-reduce per step,
  // only while a save is in flight (every rank saves at the same steps).
  if (!ckpt_ || !ckpt_->in_flight()) return;
  int done = ckpt_->writes_done() ? 1 : 0;
  if (mesh_.size() > 1) {
    PeerWait wait("MPI_Allreduce (checkpoint writes done)");
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, &done, 1, MPI_INT, MPI_MIN, mesh_.world()), "MPI_Allreduce");
  }
  if (done) {
    progress(fmt::format("committing the checkpoint after step {}", step_));
    finish_checkpoint();
  }
}

void Trainer::finish_checkpoint() {
  if (!ckpt_) return;
  // Under keel run, wait for the writes with heartbeats while they move (train/write_wait.h):
  // a blocked rank would otherwise look hung. Every rank reaches this point alike (a save in
  // flight on one is in flight on all), so the poll's all-reduce pairs up.
  if (beating() && ckpt_->in_flight()) {
    const auto poll = [&] {
      long long v[2] = {ckpt_->writes_done() ? 0 : 1, static_cast<long long>(ckpt_->bytes_written())};
      if (mesh_.size() > 1) {
        PeerWait wait("MPI_Allreduce (checkpoint writes)");
        mpi_check(MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_LONG_LONG, MPI_SUM, mesh_.world()), "MPI_Allreduce");
      }
      return WriteProgress{v[0] == 0, static_cast<std::int64_t>(v[1])};
    };
    wait_for_writes(poll, [&] { heartbeat("save", 0.0); }, 0.2);
  }
  const auto stats = ckpt_->finish();
  if (!stats) return;
  if (log_) log_->scalars(stats->step, {{"checkpoint_write_gbps", stats->write_gbps()}});
  if (!quiet_)
    std::printf("saved %s (%.1f MiB in %d files, %.2f GB/s)\n", stats->dir.c_str(), stats->bytes / 1048576.0,
                stats->files, stats->write_gbps());
}

void Trainer::init_from_weights(const std::string& path) {
  LoadedWeights got;
  try {
    // TSP holds tensor-parallel blocks (model::weight_shape)
    got = load_model_weights(path, cfg_.model, mesh_.expert().size, mesh_.expert().rank,
                             model::weight_shape(mesh_.shape()).tp, model::weight_coord(mesh_.shape(), mesh_.coord()).tp);
  } catch (const Error& e) {
    throw Error(fmt::format("init_from {}: {}", path, e.what()));
  }
  // Fresh optimizer state for this rank's shard, step 0: a new run that starts from these weights.
  TrainState st = std::move(got.state);
  const StateSlice slice = backend_->state_slice();
  st.shard_begin = slice.shard_begin, st.shard_end = slice.shard_end;
  st.expert_begin = slice.expert_begin, st.expert_end = slice.expert_end;
  st.adam_m.assign(static_cast<std::size_t>(slice.moments()), 0.f);
  st.adam_v.assign(st.adam_m.size(), 0.f);
  st.adamw_step = 0;
  // Without the release's balancing biases, keep the backend's initial ones (0, and -1 for the
  // skip class) rather than zeros.
  if (!got.router_bias) st.router_bias = model::initial_router_biases(cfg_.model);
  backend_->set_state(st);
  initialized_ = true;
  if (quiet_) return;
  std::printf("initialized from checkpoint %s (%s)%s\n", got.dir.c_str(), got.description.c_str(),
              got.router_bias ? "" : "; no balancing biases in it: router biases start at their defaults");
  // Another RoPE or window than the weights were trained with is allowed (a context extension
  // changes them), but said.
  if (const std::string changes = recorded_model_changes(got.dir, cfg_.model); !changes.empty())
    std::printf("init_from %s: this config's model differs from the one the checkpoint records: %s\n", path.c_str(),
                changes.c_str());
}

void Trainer::resume(const std::string& path_in) {
  namespace fs = std::filesystem;
  std::string path = path_in;
  std::error_code ec;
  // A root: its newest committed step. That is `latest`, unless the pointer lags behind a newer
  // commit (the disk filled, or the process died, between the commit and the pointer update) or
  // is missing or damaged: then the newest committed step, said here (the next save moves `latest`).
  std::string redirected;
  if (fs::is_directory(path, ec) && !fs::exists(fs::path(path) / ckpt::kMetadataFile, ec)) {
    std::string newest;
    std::int64_t newest_step = -1;
    for (const auto& e : ckpt::list_steps(path))
      if (e.committed) newest = e.dir, newest_step = e.step;
    if (!newest.empty()) {
      std::string latest, why;
      try {
        latest = ckpt::latest_dir(path);
      } catch (const Error& e) {
        why = e.what();
      }
      if (latest != newest) {
        if (!why.empty())
          redirected = fmt::format("its `latest` is unreadable ({})", why);
        else if (latest.empty())
          redirected = "it has no `latest` pointer";
        else
          redirected = fmt::format("its `latest` names {}, but step {} is committed {}", fs::path(latest).filename().string(),
                                   newest_step,
                                   fs::exists(fs::path(latest) / ckpt::kMetadataFile, ec)
                                       ? "and newer (the pointer was not updated after that commit: a full disk, or a "
                                         "crash in between)"
                                       : "(and the step `latest` names is not)");
        path = newest;
      }
    }
  }
  if (!is_ckpt_directory(path)) {
    // This config's own directory with nothing committed yet: a run that stopped before its first
    // save (or a job script that always passes --resume, at its first start). It continues from
    // step 0 into the same directories, its metrics appended to the same log.
    auto same = [&](const std::string& a, const std::string& b) {
      return fs::weakly_canonical(fs::absolute(a, ec), ec) == fs::weakly_canonical(fs::absolute(b, ec), ec);
    };
    const bool own = same(path, cfg_.checkpoint_dir) || same(path, cfg_.output_dir);
    bool ckpt_dir_holds = is_ckpt_directory(cfg_.checkpoint_dir);
    for (const auto& e : ckpt::list_steps(cfg_.checkpoint_dir)) ckpt_dir_holds = ckpt_dir_holds || e.committed;
    if (own && !ckpt_dir_holds && (!fs::exists(path, ec) || fs::is_directory(path, ec))) {
      restarted_ = true;
      if (!quiet_)
        std::printf("--resume %s: no checkpoint was committed there yet (the run stopped before its first save): "
                    "starting at step 0\n",
                    path.c_str());
      return;
    }
    if (own && ckpt_dir_holds)
      throw UsageError(fmt::format("--resume {}: not a keel checkpoint; this config's checkpoints are in its "
                                   "checkpoint.dir: --resume {}",
                                   path, cfg_.checkpoint_dir));
    throw UsageError(fmt::format("--resume {}: not a keel checkpoint (expected a checkpoint.dir root with `latest`, or a "
                                 "step_NNNNNNNN directory with metadata.json)",
                                 path));
  }
  LoadedTrainState got;
  try {
    got = load_train_checkpoint(path, cfg_.model, backend_->state_slice());
  } catch (const Error& e) {
    // Another model is refused (by its tensors); the keys that made it another are worth naming.
    std::string model_changes;
    try {
      const ckpt::Metadata m = ckpt::read_metadata(ckpt::resolve_checkpoint(path));
      if (m.state.is_object() && m.state.contains("config") && m.state["config"].is_string())
        model_changes = config_changes(m.state["config"].get<std::string>(), cfg_.text, "model.");
    } catch (const std::exception&) {
    }
    throw Error(fmt::format("--resume {}: {}{}", path_in, e.what(),
                            model_changes.empty() ? "" : fmt::format(" (the model keys changed: {})", model_changes)));
  }
  backend_->set_state(got.state);
  // The sampler's position, as save_checkpoint() writes it: a state without it (or a damaged one)
  // is named, never the JSON library's message.
  const std::string metadata = (fs::path(got.dir) / ckpt::kMetadataFile).string();
  if (!got.extra.contains("sampler") || !got.extra["sampler"].is_object())
    throw Error(fmt::format("checkpoint {}: state 'sampler' is {} (expected the data sampler's position, an object "
                            "keel train saves with every checkpoint): the metadata is damaged",
                            metadata, got.extra.contains("sampler") ? got.extra["sampler"].dump() : "missing"));
  try {
    loader_->restore(got.extra["sampler"]);
  } catch (const Error& e) {
    throw Error(fmt::format("checkpoint {}: state 'sampler': {}", metadata, e.what()));
  } catch (const std::exception&) {
    throw Error(fmt::format("checkpoint {}: state 'sampler' is damaged (a member is missing or of the wrong type; "
                            "expected the data sampler's position as keel train saves it)",
                            metadata));
  }
  if (loss_guard_.enabled() && got.extra.contains("loss_window")) {  // else the guard waits W steps again
    const nlohmann::json& w = got.extra["loss_window"];
    if (!w.is_array() || !std::all_of(w.begin(), w.end(), [](const nlohmann::json& x) { return x.is_number(); }))
      throw Error(fmt::format("checkpoint {}: state 'loss_window' is {} (expected the loss-spike guard's window, an "
                              "array of losses): the metadata is damaged", metadata, w.dump()));
    loss_guard_.restore(w.get<std::vector<double>>());
  }
  step_ = got.step;
  resumed_ = true;
  resumed_from_ = got.dir;
  // the group's read: bytes summed, the slowest rank's time; amplification over the group
  double io[3] = {static_cast<double>(got.bytes_read), got.bytes_read / std::max(got.read_amplification, 1e-12),
                  got.read_seconds};
  sum_over(mesh_.data(), io, 2);
  if (mesh_.data().size > 1) {
    PeerWait wait("MPI_Allreduce (resume statistics)");
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, &io[2], 1, MPI_DOUBLE, MPI_MAX, mesh_.data().comm), "MPI_Allreduce");
  }
  if (quiet_) return;
  if (!redirected.empty())
    std::printf("--resume %s: %s: resuming from its newest committed step, %s\n", path_in.c_str(), redirected.c_str(),
                got.dir.c_str());
  std::printf("resumed from %s at step %lld (read %.2f GiB in %.2f s, %.2f GB/s, read amplification %.3f)\n",
              got.dir.c_str(), static_cast<long long>(step_), io[0] / 1073741824.0, io[2],
              io[2] > 0 ? io[0] / io[2] / 1e9 : 0.0, io[1] > 0 ? io[0] / io[1] : 1.0);
  // What this run changes (lr, schedule, batch, optimizer, ...): said, not silently taken.
  if (got.extra.contains("config") && got.extra["config"].is_string()) {
    const std::string changes = config_changes(got.extra["config"].get<std::string>(), cfg_.text, "");
    if (!changes.empty()) std::printf("resumed with config changes (checkpoint -> now): %s\n", changes.c_str());
  }
}

}  // namespace keel::train
