#include "ckpt/command.h"

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "ckpt/comm.h"
#include "ckpt/demo.h"
#include "ckpt/layout.h"
#include "ckpt/reader.h"
#include "ckpt/safetensors.h"
#include "ckpt/store.h"
#include "ckpt/tools.h"
#include "ckpt/writer.h"
#include "ckpt/zaya_names.h"
#include "common/error.h"
#include "common/mpi_session.h"
#include "common/process.h"
#include "common/units.h"
#include "common/watchdog.h"
#include "model/config.h"

namespace keel::ckpt {
namespace {

struct Flags {
  std::string root, path, out, layout, model, to, format = "safetensors";
  std::string names, dtype;  // export/import: released parameter names (zaya1, ...), export dtype
  std::string token_ids;     // export --names: PAD,BOS,EOS for config.json
  std::int64_t step = 1, import_step = 0;  // import_step counts only when --step was given
  int saves = 1, every = 1, threads = 2, keep_last = 0, keep_every = 0;
  int flush_behind_mib = 256;  // demo-save: SaveOptions::flush_behind_bytes in MiB
  double probe_ms = 0;         // demo-save: a step loop's small writes every this many ms (0: none)
  double timeout = kDefaultTimeoutSeconds;  // keel's --timeout (common/watchdog.h)
  bool verify_checksums = false, all = false, shards = false, force = false;
  int die_rank = -1, enospc_rank = -1;
  std::int64_t die_after = 0, inject_step = -1;
};

template <typename F>
auto usage(F f) {
  try {
    return f();
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

// --model of export/import --names: a model YAML, or a keel train YAML (its `model:`, a path or
// the keys inline), so the config a checkpoint was trained with can be passed as is.
model::ModelConfig load_model_for_names(const std::string& path) {
  return usage([&] {
    return model::load_model_or_train_config(path);
  });
}

double max_over_ranks(double v) {
  double m = v;
  mpi_check(MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce");
  return m;
}

int run_demo_save_ranks(const Flags& f);

// demo-save --probe-ms: while a save's background writes run, what a training step loop does on
// the same disk every M ms: a heartbeat through a .tmp file and a rename, and a metrics line
// appended. The latency of each such pair says how long a save can hold a rank's step loop (a
// journaling file system holds small writes while it flushes gigabytes); compare
// --flush-behind-mib 0 with the default (docs/PERFORMANCE.md).
class SmallWriteProbe {
 public:
  SmallWriteProbe(const std::string& root, int rank)
      : beat_((std::filesystem::path(root) / fmt::format(".probe-rank-{}.json", rank)).string()),
        metrics_((std::filesystem::path(root) / fmt::format(".probe-rank-{}.jsonl", rank)).string()) {}
  ~SmallWriteProbe() {
    std::error_code ec;
    std::filesystem::remove(beat_, ec);
    std::filesystem::remove(metrics_, ec);
  }
  void run(const Saver& saver, double every_ms) {
    while (!saver.writes_done()) {
      const auto t0 = std::chrono::steady_clock::now();
      write_file(beat_ + ".tmp", fmt::format("{{\"n\": {}}}\n", seconds_.size()), "w");
      std::filesystem::rename(beat_ + ".tmp", beat_);
      write_file(metrics_, fmt::format("{{\"n\": {}, \"pad\": \"{:0>200}\"}}\n", seconds_.size(), 0), "a");
      seconds_.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(every_ms));
    }
  }
  void report(double every_ms, bool root) {
    std::vector<double> s = seconds_;
    std::sort(s.begin(), s.end());
    double sum = 0;
    for (double x : s) sum += x;
    const auto at = [&](double q) { return s.empty() ? 0.0 : 1e3 * s[std::min(s.size() - 1, std::size_t(q * s.size()))]; };
    if (root)  // rank 0's own probe
      fmt::print("probe (rank 0, a heartbeat rename + a metrics append every {} ms while writing): {} pairs, median "
                 "{:.2f} ms, p99 {:.2f} ms, max {:.2f} ms, {:.2f} s in all\n",
                 every_ms, s.size(), at(0.5), at(0.99), s.empty() ? 0.0 : 1e3 * s.back(), sum);
  }

 private:
  static void write_file(const std::string& path, const std::string& text, const char* mode) {
    std::FILE* f = std::fopen(path.c_str(), mode);
    if (!f) fail("--probe-ms: cannot write {}: {}", path, std::strerror(errno));
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }
  std::string beat_, metrics_;
  std::vector<double> seconds_;
};

// keel's --timeout, as every command takes it: seconds >= 0; 0 or inf (or from 1e9) is no
// deadline, which the watchdog takes as it is.
void check_timeout(double seconds) { check_timeout_flag(seconds); }

// demo-save's steps: the first at least 0 and the last one representable, so every save gets a
// step directory that listings and `latest` can name.
void check_demo_steps(const Flags& f) {
  if (f.step < 0) throw UsageError(fmt::format("--step must be at least 0, got {}", f.step));
  std::int64_t span = 0, last = 0;
  if (__builtin_mul_overflow(static_cast<std::int64_t>(f.saves - 1), static_cast<std::int64_t>(f.every), &span) ||
      __builtin_add_overflow(f.step, span, &last))
    throw UsageError(fmt::format("--step {} + (--saves {} - 1) x --every {} overflows a step number", f.step, f.saves,
                                 f.every));
}

// The save protocol gives every rank the same verdict: one rank prints it.
int run_demo_save(const Flags& f) {
  try {
    return run_demo_save_ranks(f);
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

int run_demo_save_ranks(const Flags& f) {
  const DemoConfig cfg = usage([&] { return parse_demo_config(f.model); });
  if (f.saves < 1 || f.every < 1 || f.threads < 1) throw UsageError("--saves, --every and --threads must be at least 1");
  if (f.keep_last < 0 || f.keep_every < 0) throw UsageError("--keep-last and --keep-every must be at least 0");
  if (f.flush_behind_mib < 0) throw UsageError(fmt::format("--flush-behind-mib {}: must be >= 0 (0: off)", f.flush_behind_mib));
  if (!(f.probe_ms >= 0) || f.probe_ms > 60000)
    throw UsageError(fmt::format("--probe-ms {}: must be 0 (off) to 60000", f.probe_ms));
  check_demo_steps(f);
  check_timeout(f.timeout);
  MpiSession mpi;
  const mesh::Shape mesh = usage([&] { return parse_mesh(f.layout, mpi.size()); });
  Watchdog dog;
  WatchdogScope scope(dog, "keel ckpt demo-save", f.timeout);
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  SaveOptions so;
  so.threads = f.threads;
  so.keep_last = f.keep_last;
  so.keep_every = f.keep_every;
  so.flush_behind_bytes = static_cast<std::uint64_t>(f.flush_behind_mib) << 20;
  const std::int64_t last = f.step + static_cast<std::int64_t>(f.saves - 1) * f.every;
  const std::int64_t inject_at = f.inject_step >= 0 ? f.inject_step : last;
  const bool root = mpi.rank() == 0;
  if (root)
    fmt::print("# keel ckpt demo-save  |  {} ranks  |  layout {}  |  model {}\n", mpi.size(), mesh.str(),
               cfg.to_json().dump());
  Saver saver(*comm, f.root, so);
  SmallWriteProbe probe(f.root, mpi.rank());
  auto report = [&](const SaveStats& st) {
    const double stall = max_over_ranks(st.stall_s), blocked = max_over_ranks(st.blocked_s);
    if (root)
      fmt::print("saved step {}: stall {:.2f} ms (slowest rank), wrote {} in {} files in {:.1f} ms ({:.2f} GB/s) in "
                 "the background, wait blocked {:.1f} ms, commit {:.1f} ms -> {}{}\n",
                 st.step, stall * 1e3, format_size(st.bytes), st.files, st.write_s * 1e3, st.write_gbps(), blocked * 1e3,
                 st.commit_s * 1e3, st.dir,
                 st.removed.empty() ? "" : fmt::format(" (retention removed {})", st.removed.size()));
    std::fflush(stdout);
  };
  for (int i = 0; i < f.saves; ++i) {
    const std::int64_t step = f.step + static_cast<std::int64_t>(i) * f.every;
    // The "training step": the state for this step is computed (generated) while the previous
    // save is still being written in the background.
    DemoShards state = demo_state(cfg, mesh, mpi.rank(), step);
    nlohmann::json global = {{"data_loader", {{"epoch", 0}, {"samples_seen", step * 1024}}},
                             {"config", cfg.to_json()},
                             {"layout", mesh.str()},
                             {"kind", "keel ckpt demo"}};
    if (saver.in_flight()) {
      if (auto st = saver.wait()) report(*st);
    }
    // A save hit by injected faults runs through its own Saver (same protocol on every rank).
    Saver* s = &saver;
    std::unique_ptr<Saver> injected;
    if (step == inject_at && (f.die_rank >= 0 || f.enospc_rank >= 0)) {
      SaveOptions faulty = so;
      if (mpi.rank() == f.die_rank) faulty.die_after_bytes = f.die_after;
      if (mpi.rank() == f.enospc_rank) faulty.fail_with_enospc = true;
      injected = std::make_unique<Saver>(*comm, f.root, faulty);
      s = injected.get();
    }
    s->save(step, state.shards, global, demo_rank_state(mpi.rank(), step), mesh.str());
    // The buffers may be reused at once: save() copied them (the staging copy is the stall).
    state = DemoShards();
    if (f.probe_ms > 0) probe.run(*s, f.probe_ms);
    if (injected) {
      if (auto st = injected->wait()) report(*st);
    }
  }
  if (auto st = saver.wait()) report(*st);
  if (f.probe_ms > 0) probe.report(f.probe_ms, root);
  return kExitOk;
}

// The demo model a checkpoint's state names, or one line saying what the checkpoint is instead
// (a keel train checkpoint's `config` is its YAML text: reading it as demo sizes failed with
// nlohmann's "[json.exception.type_error.304] cannot use at() with string").
DemoConfig demo_config_of(const Metadata& m, const std::string& dir) {
  const nlohmann::json& st = m.state;
  if (st.is_object() && st.contains("format") && st["format"].is_string() &&
      st["format"].get<std::string>().rfind("keel.train", 0) == 0)
    fail("{}: a keel train checkpoint ({}), not a demo one: demo-load checks what keel ckpt demo-save wrote; "
         "use keel ckpt inspect or keel ckpt verify for this one",
         dir, st["format"].get<std::string>());
  if (!st.is_object() || !st.contains("config")) fail("{}: not a demo checkpoint (its state has no demo config)", dir);
  const nlohmann::json& c = st["config"];
  for (const char* key : {"layers", "hidden", "vocab", "experts", "ffn"})
    if (!c.is_object() || !c.contains(key) || !c[key].is_number_integer() || c[key].get<std::int64_t>() < 1 ||
        c[key].get<std::int64_t>() > INT32_MAX)
      fail("{}: not a demo checkpoint (its state's config has no positive integer '{}'; demo-save writes layers, "
           "hidden, vocab, experts and ffn)",
           dir, key);
  return DemoConfig::from_json(c);
}

int run_demo_load(const Flags& f) {
  if (f.threads < 1) throw UsageError("--threads must be at least 1");
  check_timeout(f.timeout);
  MpiSession mpi;
  const mesh::Shape mesh = usage([&] { return parse_mesh(f.layout, mpi.size()); });
  Watchdog dog;
  WatchdogScope scope(dog, "keel ckpt demo-load", f.timeout);
  // Rank-local work: an error on one rank must not leave the others waiting in a collective,
  // so every rank agrees on the outcome before anyone leaves.
  std::unique_ptr<Reader> reader;
  LoadStats st;
  std::string first, error;
  std::int64_t wrong = 0;
  try {
    reader = std::make_unique<Reader>(f.path);
    const Metadata& m = reader->metadata();
    const DemoConfig cfg = demo_config_of(m, reader->dir());
    DemoTarget target = demo_target(cfg, mesh, mpi.rank());
    LoadOptions lo;
    lo.threads = f.threads;
    lo.verify_checksums = f.verify_checksums;
    st = reader->load(target.requests, lo);
    wrong = demo_verify(target, m.step, &first);
  } catch (const std::exception& e) {
    error = e.what();
  }
  int failed = error.empty() ? 0 : 1, failed_ranks = 0;
  mpi_check(MPI_Allreduce(&failed, &failed_ranks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
  // Every rank leaves the same way (so all of them finalize MPI): the failing ones say why.
  if (failed) report_error(error);
  if (failed_ranks)
    throw UsageError(fmt::format("the load failed on {} of {} rank(s); nothing was loaded", failed_ranks, mpi.size()));
  const Metadata& m = reader->metadata();
  double local[4] = {static_cast<double>(st.bytes_needed), static_cast<double>(st.bytes_read),
                     static_cast<double>(st.reads), static_cast<double>(wrong)};
  double sum[4];
  mpi_check(MPI_Allreduce(local, sum, 4, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
  const double secs = max_over_ranks(st.seconds);
  if (wrong) report_error(fmt::format("{} elements differ from what was saved; first: {}", wrong, first));
  if (mpi.rank() == 0) {
    fmt::print("# keel ckpt demo-load  |  {} ranks  |  layout {}\n", mpi.size(), mesh.str());
    fmt::print("loaded step {} (saved by {} ranks in layout {}) from {}\n", m.step, m.world, m.layout, reader->dir());
    fmt::print("  {} needed, {} read: read amplification {:.3f}, {} reads, {:.1f} ms, {:.2f} GB/s{}\n",
               format_size(static_cast<std::uint64_t>(sum[0])), format_size(static_cast<std::uint64_t>(sum[1])),
               sum[0] > 0 ? sum[1] / sum[0] : 1.0, static_cast<std::uint64_t>(sum[2]), secs * 1e3,
               secs > 0 ? sum[1] / secs / 1e9 : 0.0, f.verify_checksums ? " (whole shards read to verify checksums)" : "");
    if (sum[3] == 0) fmt::print("  every element bit-identical to what was saved\n");
    else fmt::print("  {} elements WRONG\n", static_cast<std::int64_t>(sum[3]));
  }
  std::fflush(stdout);
  return sum[3] == 0 ? kExitOk : kExitCheckFailed;
}

}  // namespace

void add_command(CLI::App& app) {
  auto f = std::make_shared<Flags>();
  CLI::App* ckpt = app.add_subcommand(
      "ckpt",
      "Checkpoints: parallelism-agnostic sharded saves (async, deduplicated, atomic commit) and loads into any layout");
  ckpt->require_subcommand(1);

  CLI::App* save = ckpt->add_subcommand(
      "demo-save", "Save a synthetic sharded MoE training state (deterministic contents) under MPI, asynchronously");
  save->add_option("root", f->root, "Checkpoint root directory")->required();
  save->add_option("--layout", f->layout, "Mesh: pp=,dp=,cp=,tsp=,tp=,ep=,zero=0|1 (dp fills the world when omitted; ep folds into dp*cp)");
  save->add_option("--model", f->model, "Sizes: layers=,hidden=,vocab=,experts=,ffn= (default 2,64,1003,6,80)");
  save->add_option("--step", f->step, "First step saved")->capture_default_str();
  save->add_option("--saves", f->saves, "Number of saves (each overlaps the next step's work)")->capture_default_str();
  save->add_option("--every", f->every, "Steps between saves")->capture_default_str();
  save->add_option("--threads", f->threads, "Writer threads (= data files) per rank")->capture_default_str();
  save->add_option("--keep-last", f->keep_last, "Retention: keep the newest K checkpoints (0 = all)");
  save->add_option("--keep-every", f->keep_every, "Retention: also keep every step divisible by M");
  save->add_option("--timeout", f->timeout, "Seconds before a hung save is an error (exit 124); 0 or inf: no deadline")->capture_default_str();
  save->add_option("--flush-behind-mib", f->flush_behind_mib,
                   "Write-behind window per data file, MiB (0: off, one fsync at the end)")->capture_default_str();
  save->add_option("--probe-ms", f->probe_ms,
                   "While writing, time a heartbeat rename + a metrics append every this many ms (0: off)")->capture_default_str();
  save->add_option("--inject-die-rank", f->die_rank, "Testing: this rank _exit()s mid-save")->group("");
  save->add_option("--inject-die-after", f->die_after, "Testing: ... after writing this many bytes")->group("");
  save->add_option("--inject-enospc-rank", f->enospc_rank, "Testing: this rank's writes fail with ENOSPC")->group("");
  save->add_option("--inject-step", f->inject_step, "Testing: the save the faults hit (default: the last)")->group("");
  save->callback([f] { set_exit_code(run_demo_save(*f)); });

  CLI::App* load = ckpt->add_subcommand(
      "demo-load", "Load a demo checkpoint into this world's layout under MPI and check every element bit for bit");
  load->add_option("path", f->path, "Checkpoint directory or root (follows `latest`)")->required();
  load->add_option("--layout", f->layout, "Target mesh (as demo-save)");
  load->add_option("--threads", f->threads, "Reader threads per rank")->capture_default_str();
  load->add_flag("--verify-checksums", f->verify_checksums, "Read every touched shard whole to check its CRC32C");
  load->add_option("--timeout", f->timeout, "Seconds before a hung load is an error (exit 124); 0 or inf: no deadline")->capture_default_str();
  load->callback([f] { set_exit_code(run_demo_load(*f)); });

  CLI::App* insp = ckpt->add_subcommand("inspect", "Steps, layout, state, files and the tensor tree of a checkpoint");
  insp->add_option("path", f->path, "Checkpoint directory or root")->required();
  insp->add_flag("--shards", f->shards, "List every stored shard (box, file, byte range, CRC32C)");
  insp->callback([f] {
    inspect(f->path, stdout, f->shards);
    set_exit_code(kExitOk);
  });

  CLI::App* ver = ckpt->add_subcommand(
      "verify", "Check every shard's CRC32C and that every element of every tensor is stored exactly once (exit 2 if not)");
  ver->add_option("path", f->path, "Checkpoint directory or root (verifies `latest`, lists incomplete saves)")->required();
  ver->add_flag("--all", f->all, "Verify every committed step under the root");
  ver->callback([f] {
    const int problems = verify(f->path, f->all, stdout);
    std::fflush(stdout);
    if (problems) report_error(fmt::format("{}: {} problem(s) found", f->path, problems));
    set_exit_code(problems ? kExitCheckFailed : kExitOk);
  });

  CLI::App* re = ckpt->add_subcommand("reshard", "Rewrite a checkpoint in another layout (offline, one process)");
  re->add_option("src", f->path, "Source checkpoint directory or root")->required();
  re->add_option("dst", f->out, "Destination root")->required();
  re->add_option("--to", f->to, "Target mesh, e.g. pp=2,tp=2,dp=2,zero=1")->required();
  re->add_option("--threads", f->threads, "I/O threads")->capture_default_str();
  re->callback([f] {
    usage([&] { return parse_mesh(f->to); });
    const ReshardStats st = reshard(f->path, f->out, f->to, f->threads);
    fmt::print("resharded to {} -> {}: {} written, read amplification {:.3f}, {:.1f} ms\n", parse_mesh(f->to).str(),
               st.dir, format_size(st.bytes), st.amplification, st.seconds * 1e3);
    set_exit_code(kExitOk);
  });

  CLI::App* ex = ckpt->add_subcommand("export", "Write a checkpoint's tensors whole into one file (Hugging Face safetensors)");
  ex->add_option("src", f->path, "Checkpoint directory or root")->required();
  ex->add_option("out", f->out, "Output file (with --names: a name not ending in .safetensors is a directory for model.safetensors)")->required();
  ex->add_option("--format", f->format, "safetensors")->capture_default_str();
  ex->add_option("--names", f->names,
                 "Write a keel train checkpoint's model under released names: zaya1 (Zyphra's transformers, "
                 "branch zaya1) or zaya1-alternating (the original alternating-layer layout); writes config.json "
                 "beside the file");
  ex->add_option("--model", f->model, "With --names: the model config (a model YAML, or the keel train YAML) the checkpoint holds");
  ex->add_option("--dtype", f->dtype, "With --names: fp32 (default) or bf16");
  ex->add_option("--token-ids", f->token_ids,
                 "With --names: the tokenizer's PAD,BOS,EOS ids for config.json, each an id or none (default: the "
                 "release's 0,2,106 for its 262,272-token vocabulary, else none,none,none)");
  ex->add_option("--threads", f->threads, "Reader threads")->capture_default_str();
  ex->add_flag("--force", f->force,
               "Replace an existing output file (never a file of the checkpoint being exported or its root)");
  ex->callback([f] {
    if (f->format != "safetensors") throw UsageError(fmt::format("unknown --format '{}' (safetensors)", f->format));
    if (f->names.empty()) {
      if (!f->model.empty() || !f->dtype.empty() || !f->token_ids.empty())
        throw UsageError("--model, --dtype and --token-ids need --names");
      const auto st = export_safetensors(f->path, f->out, f->threads, f->force);
      fmt::print("exported step {}: {} tensors, {} -> {}\n", st.step, st.tensors, format_size(st.bytes), st.path);
      set_exit_code(kExitOk);
      return;
    }
    const auto names = zaya::parse_names(f->names);
    if (f->model.empty()) throw UsageError("--names needs --model CONFIG.yaml (the model the checkpoint holds)");
    const auto dtype = zaya::parse_export_dtype(f->dtype.empty() ? "fp32" : f->dtype);
    const auto cfg = load_model_for_names(f->model);
    const auto ids = f->token_ids.empty() ? model::released::default_token_ids(cfg)
                                          : model::released::parse_token_ids(f->token_ids, cfg.vocab_size);
    const auto st = zaya::export_zaya_safetensors(f->path, f->out, cfg, names, dtype, f->threads, ids, f->force);
    fmt::print("exported step {} of model '{}' under {} names: {} tensors ({}), {} -> {} (+ {})\n", st.step, cfg.name,
               zaya::to_string(names), st.tensors, elem_name(dtype), format_size(st.bytes), st.path, st.config);
    if (!ids.pad && !ids.bos && !ids.eos)
      fmt::print("config.json names no pad/bos/eos token ids (--token-ids PAD,BOS,EOS gives the tokenizer's)\n");
    set_exit_code(kExitOk);
  });

  CLI::App* im = ckpt->add_subcommand("import", "Make a checkpoint from a Hugging Face safetensors file");
  im->add_option("in", f->path, "Input .safetensors file (with --names also a directory of a sharded release)")
      ->required();
  im->add_option("dst", f->out, "Destination root")->required();
  im->add_option("--format", f->format, "safetensors")->capture_default_str();
  CLI::Option* import_step =
      im->add_option("--step", f->import_step, "Step to record (default: the file's keel.step, else 0)");
  im->add_option("--names", f->names,
                 "Read released weights (zaya1 or zaya1-alternating names) into keel's model/<param> tensors");
  im->add_option("--model", f->model,
                 "With --names: the model config (a model YAML, or a keel train YAML) to import into; needed only "
                 "without a config.json beside the weights, which it must otherwise agree with");
  im->add_option("--threads", f->threads, "Writer threads")->capture_default_str();
  im->callback([f, import_step] {
    if (f->format != "safetensors") throw UsageError(fmt::format("unknown --format '{}' (safetensors)", f->format));
    // "Not given" is its own state, so no value a user can type means "use the file's step".
    std::optional<std::int64_t> step;
    if (import_step->count() > 0) {
      if (f->import_step < 0) throw UsageError(fmt::format("--step must be at least 0, got {}", f->import_step));
      step = f->import_step;
    }
    if (f->names.empty()) {
      if (!f->model.empty()) throw UsageError("--model needs --names");
      const auto st = import_safetensors(f->path, f->out, step, f->threads);
      fmt::print("imported {} tensors, {} as step {} -> {}\n", st.tensors, format_size(st.bytes), st.step, st.path);
      set_exit_code(kExitOk);
      return;
    }
    const auto names = zaya::parse_names(f->names);
    // The model: the release's config.json, --model, or both (agreeing).
    std::optional<model::ModelConfig> given;
    if (!f->model.empty()) given = load_model_for_names(f->model);
    const auto cfg = usage([&] { return zaya::release_model(f->path, names, given, f->model); });
    const std::string json = zaya::release_config_path(f->path);
    const std::string from = json.empty() ? f->model : f->model.empty() ? json : json + " and --model " + f->model;
    const auto st = zaya::import_zaya_safetensors(f->path, f->out, cfg, names, step, f->threads, from);
    fmt::print("imported {} weights into model '{}': {} keel tensors, {} as step {} -> {} (model from {})\n",
               zaya::to_string(names), cfg.name, st.tensors, format_size(st.bytes), st.step, st.path, from);
    set_exit_code(kExitOk);
  });
}

}  // namespace keel::ckpt
