#include "size/command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>

#include "common/error.h"
#include "common/fileio.h"
#include "common/process.h"
#include "common/units.h"
#include "size/report.h"

namespace keel::size {
namespace {

struct RawFlags {
  std::string config, hardware = "h100", layout, tokens, recompute = "none", optimizer = "adamw",
              grad_reduce = "fp32";
  std::string tokens_flag = "--train-tokens";  // as given: the old --tokens still works
  std::string decode_batch = "1,8,32,128", json, plot, moe_budget = "active", moe_experts = "8,16,32,64",
              moe_top_k = "1,2,4";
  // Left out: a default that depends on the layout or the config. Optional, so a given 0 is
  // told apart from "not given" and rejected.
  std::optional<int> gpus, micro_batches;
  std::optional<std::int64_t> seq;
  int micro_batch = 1;
  std::int64_t ce_chunk = 8192;
  double mfu = 0.4;
  bool moe_study = false, gemms = false, quiet = false, sequence_parallel = true;
  std::string context_mode = "allgather";
  std::string tsp_tables = "auto";
};

// A flag that may be left out but, when given, must be at least 1.
template <typename T>
void require_positive(const std::optional<T>& value, const char* flag) {
  if (value && *value < 1) throw UsageError(fmt::format("{} must be at least 1 (got {})", flag, *value));
}

// 4 x pp keeps the pipeline bubble near 20% (capped where 4 x pp would not fit an int).
int default_micro_batches(int pp) {
  return pp > 1 ? static_cast<int>(std::min<std::int64_t>(4LL * pp, std::numeric_limits<int>::max())) : 1;
}

std::vector<int> int_list(const std::string& text, const char* what) {
  try {
    return parse_int_list(text, what);
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

int run(const RawFlags& f) {
  Setup s;
  s.model = model::load_model_config(f.config);
  s.hardware = hw::load_hardware(f.hardware);
  require_positive(f.gpus, "--gpus");
  s.layout = parse_layout(f.layout, f.gpus.value_or(0));
  check_layout(s.layout, s.model);
  s.sequence_parallel = f.sequence_parallel;
  if (f.context_mode == "auto") {  // keel train's parallel.context_mode: auto
    s.context_mode = parallel::auto_context_mode(
        model::attention_layer_count(s.model, model::AttentionKind::kLinear) > 0, s.layout.tp, s.layout.tsp);
  } else {
    try {
      s.context_mode = parallel::parse_context_mode(f.context_mode);
    } catch (const UsageError&) {
      throw UsageError(fmt::format("--context-mode: unknown context mode '{}' (allgather, ring, alltoall or auto)",
                                   f.context_mode));
    }
  }
  if (s.layout.tsp > 1 && s.context_mode == parallel::ContextMode::kAllToAll)
    throw UsageError("--context-mode alltoall is context parallelism's; under tsp keel train takes allgather or ring");
  try {
    s.tsp_tables = parallel::parse_tsp_tables(f.tsp_tables);
  } catch (const UsageError&) {
    throw UsageError(fmt::format("--tsp-tables: '{}' (must be auto, sweep or gather)", f.tsp_tables));
  }
  require_positive(f.seq, "--seq");
  s.seq = f.seq ? *f.seq : s.model.max_seq_len > 0 ? s.model.max_seq_len : 4096;
  if (s.seq % (s.layout.cp * s.layout.tsp) != 0)
    throw UsageError(fmt::format("--seq {} does not split over cp*tsp = {}", s.seq, s.layout.cp * s.layout.tsp));
  if (f.micro_batch < 1) throw UsageError(fmt::format("--micro-batch must be at least 1 (got {})", f.micro_batch));
  s.micro_batch = f.micro_batch;
  require_positive(f.micro_batches, "--micro-batches");
  s.micro_batches = f.micro_batches ? *f.micro_batches : default_micro_batches(s.layout.pp);
  s.recompute = model::parse_recompute(f.recompute);
  if (f.ce_chunk < 1) throw UsageError(fmt::format("--ce-chunk must be at least 1 (got {})", f.ce_chunk));
  s.ce_chunk = f.ce_chunk;
  if (f.optimizer == "adamw") s.optimizer = Optimizer::kAdamW;
  else if (f.optimizer == "muon") s.optimizer = Optimizer::kMuon;
  else throw UsageError(fmt::format("unknown --optimizer '{}' (choose adamw or muon)", f.optimizer));
  if (f.grad_reduce != "fp32" && f.grad_reduce != "bf16")
    throw UsageError(fmt::format("unknown --grad-reduce '{}' (choose fp32 or bf16)", f.grad_reduce));
  s.grad_reduce_bf16 = f.grad_reduce == "bf16";
  if (!(f.mfu > 0 && f.mfu <= 1)) throw UsageError(fmt::format("--mfu must be in (0, 1] (got {})", f.mfu));
  s.mfu = f.mfu;
  if (!f.tokens.empty()) s.tokens = parse_decimal_count(f.tokens, f.tokens_flag);
  s.decode_batches = int_list(f.decode_batch, "--decode-batch");

  std::unique_ptr<MoeStudyOptions> moe;
  if (f.moe_study) {
    moe = std::make_unique<MoeStudyOptions>();
    moe->budget = f.moe_budget;
    moe->experts = int_list(f.moe_experts, "--moe-experts");
    moe->top_k = int_list(f.moe_top_k, "--moe-top-k");
  } else if (!f.plot.empty()) {
    throw UsageError("--plot draws the MoE width study: add --moe-study");
  }

  const SizeReport r = build_report(f.config, s, moe.get());
  if (!f.quiet) print_report(r, stdout, f.gemms);
  if (!f.json.empty()) {
    write_file_atomically(f.json, report_json(r).dump(2) + "\n");
    if (!f.quiet) std::printf("# json: %s\n", f.json.c_str());
  }
  if (!f.plot.empty()) {
    plot_moe_study(s, *r.moe, f.plot);
    if (!f.quiet) std::printf("# plot: %s\n", f.plot.c_str());
  }
  return kExitOk;
}

}  // namespace

void add_command(CLI::App& app) {
  auto f = std::make_shared<RawFlags>();
  CLI::App* cmd = app.add_subcommand(
      "size",
      "What a model costs and how to shape it for the hardware: parameters, FLOPs per token, memory per GPU for a "
      "parallel layout, time to train, sizing rules for every GEMM, and an MoE width study.");
  cmd->add_option("config", f->config, "Model YAML (configs/*.yaml)")->required();
  cmd->add_option("--hardware", f->hardware,
                  "Built-in profile (h100, h200, b200, a100, mi300x, mi325x) and/or keel bench JSON files, comma "
                  "separated (e.g. h200,gemm.json,mem.json)")
      ->capture_default_str();
  cmd->add_option("--layout", f->layout,
                  "Parallel layout, e.g. tp=2,pp=4,ep=8,cp=1,tsp=1,zero=1 (dp from --gpus when left out; ep folds into dp*cp)");
  cmd->add_flag("--sequence-parallel,!--no-sequence-parallel", f->sequence_parallel,
                "With tp above 1: Megatron sequence parallelism (keel train's parallel.sequence), the residual stream, "
                "norms and routers on 1/tp of the tokens (the default); --no-sequence-parallel keeps every token's on "
                "each tensor rank");
  cmd->add_option("--context-mode", f->context_mode,
                  "With cp above 1: allgather (every rank's k, v gathered), ring (k, v blocks passed around), "
                  "alltoall (heads by all-to-all) or auto (keel train's choice), as keel train's "
                  "parallel.context_mode: sets the context-parallel buffers; with tsp above 1 allgather or ring")
      ->capture_default_str();
  cmd->add_option("--tsp-tables", f->tsp_tables,
                  "With tsp above 1: sweep (the vocabulary tables' rows travel), gather (the tokens do) or auto "
                  "(keel train's choice: gather when the micro-batch has at most as many tokens as the vocabulary "
                  "has rows), as keel train's parallel.tsp_tables: sets the gather buffers")
      ->capture_default_str();
  cmd->add_option("--gpus", f->gpus, "GPUs in the run (default: the layout's product)");
  CLI::Option* train_tokens =
      cmd->add_option("--train-tokens", f->tokens, "Tokens to train (14T, 500B, 2.5e12): prints the time to train");
  // The old spelling: --tokens meant three things in keel (README, "Flags across commands"); it still works.
  CLI::Option* old_tokens =
      cmd->add_option("--tokens", f->tokens, "Deprecated: --train-tokens")->group("");
  cmd->add_option("--seq", f->seq, "Sequence length (default: the config's max_seq_len, else 4096)");
  cmd->add_option("--micro-batch", f->micro_batch, "Sequences per micro-batch per data-parallel rank")
      ->capture_default_str();
  cmd->add_option("--micro-batches", f->micro_batches,
                  "Micro-batches per step per pipeline (sets the bubble; default 4 x pp when pp > 1)");
  cmd->add_option("--recompute", f->recompute, "none, selective or full")->capture_default_str();
  cmd->add_option("--ce-chunk", f->ce_chunk,
                  "Vocabulary columns per cross-entropy chunk when the logits exceed an eighth of the GPU (as "
                  "keel train's ce_chunk)")
      ->capture_default_str();
  cmd->add_option("--optimizer", f->optimizer, "adamw or muon (Muon on 2-D matrices, AdamW on the rest)")
      ->capture_default_str();
  cmd->add_option("--grad-reduce", f->grad_reduce,
                  "fp32 or bf16: the element type gradients are summed in over data-parallel ranks (keel train's "
                  "parallel.grad_reduce; bf16 adds its reduce scratch)")
      ->capture_default_str();
  cmd->add_option("--mfu", f->mfu, "Assumed MFU for the time-to-train estimate")->capture_default_str();
  cmd->add_option("--decode-batch", f->decode_batch, "Decode batch sizes for the inference estimate")
      ->capture_default_str();
  cmd->add_flag("--moe-study", f->moe_study, "Add the MoE width study (experts x top-k x width at a fixed budget)");
  cmd->add_option("--moe-budget", f->moe_budget, "active (top_k x width fixed) or total (experts x width fixed)")
      ->capture_default_str();
  cmd->add_option("--moe-experts", f->moe_experts, "Expert counts for the study")->capture_default_str();
  cmd->add_option("--moe-top-k", f->moe_top_k, "top-k values for the study")->capture_default_str();
  cmd->add_option("--plot", f->plot, "PNG of the MoE study: decode latency against batch per candidate");
  cmd->add_flag("--gemms", f->gemms, "List every predicted GEMM of the step");
  cmd->add_option("--json", f->json, "Write everything as JSON (schema keel.size/1)");
  cmd->add_flag("-q,--quiet", f->quiet, "No report on stdout");
  cmd->callback([f, old_tokens, train_tokens] {
    if (old_tokens->count() > 0 && train_tokens->count() > 0)
      throw UsageError("size: --train-tokens and the old --tokens both given: give --train-tokens only");
    if (old_tokens->count() > 0) {
      warn_deprecated_flag("size", "--tokens", "--train-tokens", "tokens to train");
      f->tokens_flag = "--tokens";
    }
    set_exit_code(run(*f));
  });
}

}  // namespace keel::size
