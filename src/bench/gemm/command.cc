#include "bench/gemm/command.h"

#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "bench/gemm/report.h"
#include "bench/gemm/runner.h"
#include "bench/gemm/tune_cache.h"
#include "common/error.h"
#include "device/cuda_devices.h"
#include "common/process.h"
#include "common/units.h"

namespace keel::bench {
namespace {

struct RawFlags {
  std::string backend = "auto", dtype, m, n, k, mnk, shapes, layout = "nn", model;
  std::optional<std::int64_t> tokens;  // optional: a given 0 is an error, not "not given"
  std::string tokens_flag = "--step-tokens";  // as given: the old --tokens still works
  ModelDims dims;
  bool forward_only = false;
  int warmup = 5, iters = 30, candidates = 16, tune_iters = 5, check_samples = 64, device = 0, threads = 0;
  std::string workspace = "32M", rotate, tune_cache, plot_x = "auto";
  bool no_tune = false, retune = false, no_check = false, quiet = false, corrupt = false;
  double peak_tflops = 0;
  std::uint64_t seed = 1;
  std::string json, csv, plot;
};

GemmOptions to_options(const RawFlags& f, const std::string& backend) {
  try {
    GemmOptions o;
    o.backend = backend;
    for (const auto& t : split_list(f.dtype)) o.dtypes.push_back(parse_gemm_type(t));
    const Layout layout = parse_layout(f.layout);
    const bool ranges = !f.m.empty() || !f.n.empty() || !f.k.empty();
    const bool model_mode = !f.model.empty() || any_given(f.dims) || f.tokens;
    const int modes = (ranges ? 1 : 0) + (!f.mnk.empty() ? 1 : 0) + (!f.shapes.empty() ? 1 : 0) + (model_mode ? 1 : 0);
    if (modes > 1) fail("choose one way to give shapes: --m/--n/--k, --mnk, --shapes, or a model (--model or dimension flags)");
    if (ranges) {
      if (f.m.empty() || f.n.empty() || f.k.empty()) fail("--m, --n and --k go together (each a value, list or start:stop:step)");
      o.shapes = shapes_from_ranges(parse_dim_spec(f.m, "--m"), parse_dim_spec(f.n, "--n"), parse_dim_spec(f.k, "--k"),
                                    layout);
      o.mode = "sweep";
    } else if (!f.shapes.empty()) {
      o.shapes = parse_shape_list(f.shapes, layout);
      o.mode = "list";
    } else if (model_mode) {
      if (!f.tokens) fail("a model's layer GEMMs need --step-tokens (tokens per step), a positive number");
      if (*f.tokens <= 0) fail("{} must be positive, got {}", f.tokens_flag, *f.tokens);
      if (!f.model.empty() && any_given(f.dims)) fail("give --model or dimension flags, not both");
      bool lm_head = true;
      model::ModelConfig config;
      if (!f.model.empty()) {
        config = model::load_model_config(f.model);
        o.model = f.model;
      } else {
        config = config_from_dims(f.dims, &lm_head);
        o.model = "flags";
      }
      o.shapes = shapes_from_model(config, *f.tokens, !f.forward_only);
      if (!lm_head) {
        std::erase_if(o.shapes, [](const GemmShape& s) { return s.name == "lm_head"; });
        o.notes.push_back("no --vocab: the LM head is left out");
      }
      o.tokens = *f.tokens;
      o.mode = "model";
    } else {
      // A square sweep fine enough to show the sawtooth, sized to the backend.
      o.shapes = square_shapes(parse_dim_spec(f.mnk.empty() ? (backend == "cpu" ? "128:1024:128" : "1024:8192:256")
                                                            : f.mnk,
                                              "--mnk"),
                               layout);
      o.mode = "sweep";
    }
    if (f.iters < 1) fail("--iters must be at least 1, got {}", f.iters);
    if (f.warmup < 0) fail("--warmup must not be negative, got {}", f.warmup);
    if (f.candidates < 1) fail("--candidates must be at least 1, got {}", f.candidates);
    if (f.tune_iters < 1) fail("--tune-iters must be at least 1, got {}", f.tune_iters);
    if (f.check_samples < 1) fail("--check-samples must be at least 1, got {}", f.check_samples);
    if (f.device < 0) fail("--device must not be negative, got {}", f.device);
    if (f.plot_x != "auto" && f.plot_x != "m" && f.plot_x != "n" && f.plot_x != "k" && f.plot_x != "gflop")
      fail("unknown --plot-x '{}' (choose auto, m, n, k or gflop)", f.plot_x);
    o.plan.warmup = f.warmup;
    o.plan.iters = f.iters;
    o.plan.candidates = f.no_tune ? 1 : f.candidates;
    o.plan.tune_iters = f.tune_iters;
    o.plan.workspace = parse_size(f.workspace, "--workspace");
    o.plan.rotate_bytes = f.rotate.empty() ? 0 : parse_size(f.rotate, "--rotate");
    o.plan.check = !f.no_check;
    o.plan.check_samples = f.check_samples;
    o.plan.seed = f.seed;
    o.plan.retune = f.retune;
    o.plan.corrupt = f.corrupt;
    o.plan.tune_cache = f.tune_cache == "none" ? "" : f.tune_cache.empty() ? default_tune_cache_path() : f.tune_cache;
    o.device = f.device;
    o.threads = f.threads;
    o.peak_tflops = f.peak_tflops;
    o.json_path = f.json;
    o.csv_path = f.csv;
    o.plot_path = f.plot;
    o.plot_x = f.plot_x;
    o.quiet = f.quiet;
    return o;
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
}

int run(const RawFlags& flags) {
  std::string chosen = flags.backend;
  if (chosen != "auto" && chosen != "cuda" && chosen != "cpu")
    throw UsageError(fmt::format("unknown --backend '{}' (choose auto, cuda or cpu)", chosen));
#if defined(KEEL_HAVE_CUDA)
  if (chosen == "auto") chosen = visible_cuda_devices() > 0 ? "cuda" : "cpu";
#else
  if (chosen == "auto") chosen = "cpu";
  if (chosen == "cuda") throw UsageError("this keel was built without CUDA: --backend cuda is unavailable");
#endif
  GemmOptions o = to_options(flags, chosen);
  std::unique_ptr<GemmBackend> backend;
#if defined(KEEL_HAVE_CUDA)
  if (chosen == "cuda") backend = make_cublaslt_backend(o.device, o.plan.tune_cache);
#endif
  if (chosen == "cpu") {
    if (o.device != 0) throw UsageError("--device needs --backend cuda");
    o.plan.tune_cache.clear();  // OpenBLAS has nothing to tune
    backend = make_openblas_backend(o.threads);
  }
  resolve_gemm_options(o, *backend);

  std::FILE* out = stdout;
  if (!o.quiet) print_gemm_header(*backend, o, out);
  GemmReport report = run_gemm_bench(*backend, o, [&](const GemmRow& r) {
    if (!o.quiet) print_gemm_row(r, out);
  });
  if (!o.quiet) print_gemm_summary(report, o, out);
  if (!o.json_path.empty()) write_gemm_json(report, o, o.json_path);
  if (!o.csv_path.empty()) write_gemm_csv(report, o.csv_path);
  if (!o.plot_path.empty())
    for (const auto& f : write_gemm_plots(report, o, o.plot_path))
      if (!o.quiet) std::fprintf(out, "# plot: %s\n", f.c_str());
  if (!o.quiet && !o.plan.tune_cache.empty() && o.plan.candidates > 1)
    std::fprintf(out, "# tuned algorithms cached in %s\n", o.plan.tune_cache.c_str());
  std::fflush(out);
  const std::uint64_t bad = gemm_failures(report);
  if (bad > 0) {
    report_error(fmt::format("{} GEMM check failures: outputs differ from the host reference", bad));
    return kExitCheckFailed;
  }
  return kExitOk;
}

}  // namespace

void add_gemm_command(CLI::App& bench) {
  auto f = std::make_shared<RawFlags>();
  CLI::App* cmd = bench.add_subcommand(
      "gemm",
      "GEMM kernel-sizing sweeps: TFLOP/s (median, operands rotated out of L2), % of peak, the chosen algorithm "
      "and tile, waves on this device's SMs and tile-quantization waste, for ranges of m/n/k, explicit shapes, or "
      "the GEMMs of one transformer/MoE layer. Autotunes cuBLASLt's top heuristic candidates and caches the winners. "
      "Every GEMM is checked on sampled outputs against a double-precision host reference.\n"
      "GPUs: --backend cuda (cuBLASLt: bf16, fp16, fp8, fp32, tf32); CPUs: --backend cpu (OpenBLAS fp32).");
  cmd->add_option("--backend", f->backend, "auto (cuda if a GPU is visible, else cpu), cuda or cpu")->capture_default_str();
  cmd->add_option("--dtype", f->dtype, "Comma list of bf16, fp16, fp8 (e4m3, scaled, bf16 out), fp32, tf32 (default: "
                                       "bf16 on GPUs, fp32 on CPUs)");
  auto* g_shapes = "Shapes (pick one way)";
  cmd->add_option("--m", f->m, "m: a value, a list (1024,2048) or start:stop:step; with --n and --k, every combination")
      ->group(g_shapes);
  cmd->add_option("--n", f->n, "n (output features)")->group(g_shapes);
  cmd->add_option("--k", f->k, "k (reduction)")->group(g_shapes);
  cmd->add_option("--mnk", f->mnk, "Square GEMMs m = n = k over a value, list or range (default 1024:8192:256 on GPUs, "
                                   "128:1024:128 on CPUs)")
      ->group(g_shapes);
  cmd->add_option("--shapes", f->shapes, "Explicit list MxNxK[xBATCH],... e.g. 8192x8192x8192,1024x4096x2048x16")
      ->group(g_shapes);
  cmd->add_option("--layout", f->layout, "Operands for --m/--n/--k, --mnk and --shapes: nn (torch.matmul), nt (X W^T), "
                                         "tn, tt")
      ->capture_default_str()
      ->group(g_shapes);
  auto* g_model = "Layer GEMMs of a model";
  cmd->add_option("--model", f->model, "Model YAML (configs/*.yaml, as keel size reads it)")->group(g_model);
  CLI::Option* step_tokens =
      cmd->add_option("--step-tokens", f->tokens, "Tokens per step (micro-batch x sequence)")->group(g_model);
  // The old spelling: --tokens meant three things in keel (README, "Flags across commands"); it still works.
  CLI::Option* old_tokens =
      cmd->add_option("--tokens", f->tokens, "Deprecated: --step-tokens")->group("");
  cmd->add_flag("--forward-only", f->forward_only, "Only forward GEMMs (default: also bwd_data and bwd_weight)")
      ->group(g_model);
  cmd->add_option("--hidden", f->dims.hidden, "Hidden size")->group(g_model);
  cmd->add_option("--heads", f->dims.heads, "Attention heads (default hidden / head-dim)")->group(g_model);
  cmd->add_option("--kv-heads", f->dims.kv_heads, "KV heads (default = heads)")->group(g_model);
  cmd->add_option("--head-dim", f->dims.head_dim, "Head dimension (default 128)")->group(g_model);
  cmd->add_option("--ffn", f->dims.ffn, "Dense SwiGLU MLP width")->group(g_model);
  cmd->add_option("--experts", f->dims.experts, "Routed experts")->group(g_model);
  cmd->add_option("--top-k", f->dims.top_k, "Experts per token (default 1)")->group(g_model);
  cmd->add_option("--expert-width", f->dims.expert_width, "Expert SwiGLU width (default --ffn)")->group(g_model);
  cmd->add_option("--router-width", f->dims.router_width, "Router hidden width (hidden -> width -> experts); "
                                                           "default a linear router")
      ->group(g_model);
  cmd->add_option("--vocab", f->dims.vocab, "Vocabulary (the LM head; left out when not given)")->group(g_model);
  cmd->add_option("-w,--warmup", f->warmup, "Untimed runs before timing")->capture_default_str();
  // No -n: newer CLI11 takes it for --n (a dimension).
  cmd->add_option("--iters", f->iters, "Timed runs per GEMM (the median is reported)")->capture_default_str();
  cmd->add_option("--candidates", f->candidates, "cuBLASLt heuristic candidates to time (the fastest is kept)")
      ->capture_default_str();
  cmd->add_option("--tune-iters", f->tune_iters, "Timed runs per candidate while tuning")->capture_default_str();
  cmd->add_flag("--no-tune", f->no_tune, "Take cuBLASLt's first heuristic choice (what a default PyTorch run uses)");
  cmd->add_option("--tune-cache", f->tune_cache,
                  "File of tuned algorithms to reuse and extend ('none' to disable; default "
                  "$KEEL_GEMM_TUNE_CACHE or ~/.cache/keel/gemm_tune.json)");
  cmd->add_flag("--retune", f->retune, "Ignore cached choices and tune again");
  cmd->add_option("--workspace", f->workspace, "cuBLASLt workspace (PyTorch uses 32M on Hopper)")->capture_default_str();
  cmd->add_option("--rotate", f->rotate, "Operand bytes to cycle through between reuses (default 4 x L2)");
  cmd->add_option("--device", f->device, "GPU")->capture_default_str();
  cmd->add_option("--threads", f->threads, "CPU backend: OpenBLAS threads (default: OpenBLAS's own)");
  cmd->add_option("--peak-tflops", f->peak_tflops, "Spec peak for %peak (default: the device's built-in profile)");
  cmd->add_flag("--no-check", f->no_check, "Skip checking results (they are checked by default)");
  cmd->add_option("--check-samples", f->check_samples, "Output elements checked per GEMM")->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of the random inputs")->capture_default_str();
  cmd->add_option("--json", f->json, "Write results as JSON (schema keel.bench.gemm/1)");
  cmd->add_option("--csv", f->csv, "Write results as CSV");
  cmd->add_option("--plot", f->plot, "Write a PNG of TFLOP/s against the swept dimension");
  cmd->add_option("--plot-x", f->plot_x, "x axis of --plot: auto, m, n, k or gflop")->capture_default_str();
  cmd->add_flag("-q,--quiet", f->quiet, "No table on stdout");
  cmd->add_flag("--inject-corrupt", f->corrupt, "Testing: damage one sampled output (exercises the checker)")->group("");
  cmd->callback([f, old_tokens, step_tokens] {
    if (old_tokens->count() > 0 && step_tokens->count() > 0)
      throw UsageError("bench gemm: --step-tokens and the old --tokens both given: give --step-tokens only");
    if (old_tokens->count() > 0) {
      warn_deprecated_flag("bench gemm", "--tokens", "--step-tokens", "tokens per training step");
      f->tokens_flag = "--tokens";
    }
    set_exit_code(run(*f));
  });
}

}  // namespace keel::bench
