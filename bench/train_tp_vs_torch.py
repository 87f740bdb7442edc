#!/usr/bin/env python3
"""keel train's tensor parallelism against PyTorch's tensor-parallel API, on 2 GPUs, in one run.

Models: bench/train_vs_torch.py's MoE ("bench": 2.2 B parameters, GQA 16/2 heads, 16 experts
top-1, softmax router with aux and z losses, vocabulary 262,272 tied) and bench/zaya_vs_torch.py's
ZAYA1-shaped model ("zaya1": the 8-layer cut of ZAYA1-8B: CCA 8/2 heads, MLP router with EDA and
the skip class, residual scaling, 16 experts top-1, selection-bias balancing), sequence 4096,
micro-batch 2, and every configuration trains the same global batch per step: --accum (2)
micro-batches, 16K tokens (tensor parallelism: both micro-batches over both GPUs; data and expert
parallelism: one per GPU). AdamW, clipping at 1.0, each model's learning rate (--lr overrides
both sides), bf16 with fp32 master weights.

Configurations per model, keel first, then the peer, in the same invocation:
  keel T=2        mpirun -np 2 keel train, parallel: {tensor: 2}
  keel T=2+SP     parallel: {tensor: 2, sequence: true}
  keel T=2+SP serial  the same with tensor_overlap: false (backward's input re-gathers on the
                  compute stream, not beside the block before: what the overlap saves)
  keel T2xDP2, keel T2xDP2 classic  (4 GPUs; only when --configs names keel-tp-dp,
                  keel-tp-dp-classic) T=2+SP with 2 data ranks: the overlapped ZeRO-1 step
                  (AdamW) against parallel.zero1.overlap: false, the same global batch
  keel T=4, keel T=4+SP, torch TP=4, torch TP=4+SP  (4 GPUs; only when --configs names keel-tp4,
                  keel-tp4-sp, torch-tp4, torch-tp4-sp) the same at tensor degree 4, above both
                  models' 2 kv heads: keel holds them (and CCA's projections) whole on every
                  rank, as Megatron replicates kv heads; the peer does the same for the bench
                  model's GQA (bench/train_tp_torch.py) and refuses it for ZAYA1's CCA (its
                  head split needs the degree to divide the kv heads)
  keel DP=2       parallel: {data: 2} (ZeRO-1, overlapped)
  keel EP=2       parallel: {expert: 2} (8 experts per GPU, data parallel over both)
  torch TP=2      bench/train_tp_torch.py under torchrun: torch.distributed.tensor.parallel
                  (parallelize_module on a 1-D DeviceMesh: ColwiseParallel / RowwiseParallel /
                  PrepareModuleInput(Output), experts tensor-sliced as torchtitan does,
                  vocabulary-parallel tied head with loss_parallel), eager
  torch TP=2+SP   the same with SequenceParallel norms and Shard(1) activations between blocks
  keel / torch 1 GPU (reference rows; --no-one-gpu skips them): the same global batch on one
                  GPU, for the exposed-time column.
bench/train_tp_torch.py's docstring has the peer's plan piece by piece, including how ZAYA1's
CCA is split (ColwiseParallel cannot split its fused [q; k] projection by heads; a custom
ParallelStyle regroups the rows per rank) and what the API costs beside Megatron's layout (the
expert inputs' gradients are all-reduced, then sliced, under sequence parallelism, where
Megatron reduce-scatters: torchtitan's choice, kept).

Reported per configuration: tokens/s (median over the timed steps after --warmup; the global
batch's tokens, each counted once), MFU (one formula for both sides: the model script's
flops_per_token x tokens/s over GPUs x 989 TFLOP/s), peak memory per GPU (keel: its device
arenas on rank 0, from metrics.jsonl; PyTorch: max_memory_allocated, the largest rank),
routing (bench/routing_health.py's summary of the per-step rows, from keel's metrics.jsonl and
the peer's rows in the same format: the busiest class over its fair share, worst MoE layer
and step after warm-up and the mean over steps of the worst layer, per-layer worst; the skip
share's mean, 0 for the bench model, which has no skip class), and keel / PyTorch tokens/s
and memory for the matched tensor-parallel configurations (target: >= 1.5x tokens/s, memory no
higher).

Exposed communication: keel prints no communication timings for tensor parallelism (its
parallel.zero1.profile covers the ZeRO-1 step only), nor does the peer; the column "over ideal
ms" is the same-batch estimate of bench/train_dp_scaling.py: step time minus half the one-GPU
step time of the same framework and global batch. It counts the exposed communication plus
everything else the split costs (the replicated routers and norms, narrower GEMMs), so it is an
upper bound on the exposed communication; N/A without the one-GPU rows.

--tiny --device cpu: toy dimensions on CPU ranks (keel's CPU reference under mpirun
--oversubscribe, the peer on gloo), a few steps: a check of this script, the configs and the
peer, not a measurement. Writes OUT/train_tp_vs_torch.json and prints the table last.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import routing_health  # noqa: E402
import train_vs_torch  # noqa: E402
import zaya_vs_torch  # noqa: E402

PEAK = train_vs_torch.PEAK
KEEL_CONFIGS = {  # name -> (ranks, parallel section)
    "keel T=2": (2, {"tensor": 2, "sequence": "false"}),
    "keel T=2+SP": (2, {"tensor": 2, "sequence": "true"}),
    "keel T=2+SP serial": (2, {"tensor": 2, "sequence": "true", "tensor_overlap": "false"}),
    "keel T=4": (4, {"tensor": 4, "sequence": "false"}),
    "keel T=4+SP": (4, {"tensor": 4, "sequence": "true"}),
    "keel T2xDP2": (4, {"tensor": 2, "sequence": "true"}),
    "keel T2xDP2 classic": (4, {"tensor": 2, "sequence": "true", "zero1": "{overlap: false}"}),
    "keel DP=2": (2, {"data": 2}),
    "keel EP=2": (2, {"expert": 2}),
    "keel 1 GPU": (1, {}),
}
TORCH_CONFIGS = {  # name -> (ranks, sequence parallel)
    "torch TP=2": (2, False),
    "torch TP=2+SP": (2, True),
    "torch TP=4": (4, False),
    "torch TP=4+SP": (4, True),
    "torch 1 GPU": (1, False),
}
FOUR_GPUS = ("keel-tp-dp", "keel-tp-dp-classic", "keel-tp4", "keel-tp4-sp", "torch-tp4", "torch-tp4-sp")  # not default
MATCHED = {"keel T=2": "torch TP=2", "keel T=2+SP": "torch TP=2+SP", "keel T=4": "torch TP=4",
           "keel T=4+SP": "torch TP=4+SP", "keel 1 GPU": "torch 1 GPU"}
KEYS = {"keel-tp": "keel T=2", "keel-tp-sp": "keel T=2+SP", "keel-tp-sp-serial": "keel T=2+SP serial",
        "keel-dp": "keel DP=2", "keel-ep": "keel EP=2", "keel-tp-dp": "keel T2xDP2",
        "keel-tp-dp-classic": "keel T2xDP2 classic", "keel-tp4": "keel T=4", "keel-tp4-sp": "keel T=4+SP",
        "torch-tp4": "torch TP=4", "torch-tp4-sp": "torch TP=4+SP",
        "keel-1gpu": "keel 1 GPU", "torch-tp": "torch TP=2", "torch-tp-sp": "torch TP=2+SP", "torch-1gpu": "torch 1 GPU"}


class Interrupted(Exception):
    pass


def on_signal(signum, frame):  # timeout(1) and the like: stop, clean up, print what ran
    raise Interrupted(f"signal {signum}")


def run_cmd(cmd, log, timeout, env):
    """Runs cmd (its own process group) with stdout and stderr to log; on timeout or interruption
    the group gets SIGTERM (mpirun and torchrun stop their ranks), then SIGKILL. Returns None or
    an error string; re-raises Interrupted."""
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
            return None if rc == 0 else f"exit {rc}"
        except (subprocess.TimeoutExpired, Interrupted) as e:
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    pass
            if isinstance(e, Interrupted):
                raise
            return f"timed out after {timeout} s"


# --tiny: the bench model at toy sizes (bench/zaya_vs_torch.py has its own TINY); the peer
# (train_tp_torch.py) reads the same dimensions from here
TINY_BENCH = dict(vocab=512, hidden=128, heads=4, kv_heads=2, head_dim=32, experts=4, expert_hidden=128, top_k=1,
                  layers=2, seq=64, micro_batch=2)


def dims(model, tiny, layers=None):
    if model == "zaya1":
        d = dict(zaya_vs_torch.TINY if tiny else zaya_vs_torch.ZAYA8)
    else:
        d = dict(TINY_BENCH if tiny else train_vs_torch.DIMS)
    if layers:
        d["layers"] = layers
    return d


def flops_per_token(model, d):
    return (zaya_vs_torch if model == "zaya1" else train_vs_torch).flops_per_token(d)


def keel_config(model, d, prefix, run_dir, steps, device, accum, parallel, lr, bias_rate, forced=False):
    """The model script's keel config at `accum` micro-batches per step, on `device`, with a
    parallel section; returns (text, metrics path)."""
    if model == "zaya1":
        text = zaya_vs_torch.keel_config(d, prefix, run_dir, steps, device, lr=lr or zaya_vs_torch.LR,
                                         bias_rate=bias_rate, forced=forced)
        assert "  grad_accum: 1\n" in text
        text = text.replace("  grad_accum: 1\n", f"  grad_accum: {accum}\n")
        metrics = os.path.join(run_dir, "run", "metrics.jsonl")
    else:
        text = train_vs_torch.keel_config(d, prefix, run_dir, steps, grad_accum=accum, forced=forced)
        assert text.startswith("device: cuda\n")
        text = f"device: {device}\n" + text[len("device: cuda\n"):]
        if lr is not None:
            assert "\n  lr: " in text
            text = "\n".join(f"  lr: {lr}" if line.startswith("  lr: ") else line for line in text.split("\n"))
        metrics = os.path.join(run_dir, "metrics.jsonl")
    if parallel:
        assert "\nparallel:" not in text
        text += "parallel:\n" + "".join(f"  {k}: {v}\n" for k, v in parallel.items())
    return text, metrics


def run_env(device):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if device == "cpu":  # ranks share the host's cores: one thread each
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env


def launch_keel(a, cfg_path, ranks, log):
    """keel train on `ranks` processes: mpirun for 2+ (one GPU per rank on a GPU machine; CPU
    ranks, oversubscribed, with --device cpu), the binary itself for one."""
    cmd = [a.keel, "train", cfg_path]
    for s in a.sets:
        cmd += ["--set", s]
    env = run_env(a.device)
    if ranks > 1:
        mpi = [a.mpirun, "--allow-run-as-root", "-np", str(ranks), "--bind-to", "none"]
        if a.device == "cpu":
            mpi.append("--oversubscribe")
        for k in sorted(env):
            if k.startswith("NCCL_") or k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
                mpi += ["-x", k]
        cmd = mpi + cmd
    return run_cmd(cmd, log, a.run_timeout, env)


def last_line(log):
    lines = [line for line in open(log).read().splitlines() if line.strip()]
    errs = [line for line in lines if "error" in line.lower()]
    return (errs or lines or ["(no output)"])[-1][:300]


def summarize_rows(rows, classes, warmup, gpus, fpt, tokens_per_step):
    """tokens/s and routing of per-step rows (keel's metrics.jsonl format)."""
    rows = [dict(r) for r in rows]
    for r in rows:
        if "mfu" not in r:
            r["mfu"] = r["tokens_per_s"] * fpt / (gpus * PEAK)
        for k in [k for k in r if k.startswith("routing_busiest_share.")]:  # no skip class: share 0
            r.setdefault("routing_skip_share." + k.split(".", 1)[1], 0.0)
    timed = [r for r in rows if r["step"] > warmup]
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    rh = routing_health.summarize(rows, classes, warmup)
    return {"tokens_per_s": tps, "step_ms": 1e3 * tokens_per_step / tps, "mfu": tps * fpt / (gpus * PEAK),
            "busiest_worst": rh["worst_busiest_over_fair_after"], "busiest_mean": rh["mean_busiest_over_fair_after"],
            "busiest_per_layer": rh["per_layer_worst_after"], "skip_mean": rh["mean_skip_share_after"],
            "ce_first": rows[0]["ce"], "ce_last": rows[-1]["ce"], "steps": len(rows)}


def run_keel(a, model, d, out, prefix, name, ranks, parallel, fpt, classes):
    run_dir = os.path.join(out, name.replace(" ", "_").replace("=", "").replace("+", "_"))
    shutil.rmtree(run_dir, ignore_errors=True)  # keel train refuses another run's metrics
    os.makedirs(run_dir)
    text, metrics = keel_config(model, d, prefix, run_dir, a.steps + a.warmup, a.device, a.accum, parallel, a.lr,
                                a.bias_rate, a.forced_balance)
    cfg = os.path.join(run_dir, "train.yaml")
    open(cfg, "w").write(text)
    log = os.path.join(run_dir, "keel_train.log")
    t0 = time.time()
    err = launch_keel(a, cfg, ranks, log)
    if err:
        print(open(log).read()[-3000:])
        return {"error": f"keel train {err}: {last_line(log)}"}
    rows = [json.loads(line) for line in open(metrics) if '"loss"' in line]
    tokens_per_step = a.accum * d["micro_batch"] * d["seq"]
    res = summarize_rows(rows, classes, a.warmup, ranks, fpt, tokens_per_step)
    timed = [r for r in rows if r["step"] > a.warmup]
    res.update(memory_gib=max(r.get("memory_mib", 0) for r in rows) / 1024, gpus=ranks,
               keel_mfu=statistics.median(r["mfu"] for r in timed), wall_s=time.time() - t0,
               ce=[r["ce"] for r in rows])
    return res


def run_torch(a, model, d, out, name, ranks, sp, fpt, classes):
    run_dir = os.path.join(out, name.replace(" ", "_").replace("=", "").replace("+", "_"))
    os.makedirs(run_dir, exist_ok=True)
    path, log = os.path.join(run_dir, "torch.json"), os.path.join(run_dir, "torch.log")
    if os.path.exists(path):
        os.remove(path)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_tp_torch.py")
    cmd = [a.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", worker,
           "--json", path, "--model", model, "--device", a.device, "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--accum", str(a.accum), "--bias-rate", str(a.bias_rate)]
    cmd += ["--tiny"] if a.tiny else []
    cmd += ["--forced-balance"] if a.forced_balance else []
    cmd += ["--sp"] if sp else []
    cmd += ["--layers", str(a.layers)] if a.layers else []
    cmd += ["--lr", str(a.lr)] if a.lr is not None else []
    t0 = time.time()
    err = run_cmd(cmd, log, a.run_timeout, run_env(a.device))
    if err is None and not os.path.exists(path):
        err = "exit 0 without its JSON"
    if err:
        print(open(log).read()[-3000:])
        return {"error": f"torch {err}: {last_line(log)}"}
    w = json.load(open(path))
    res = summarize_rows(w["rows"], classes, a.warmup, ranks, fpt, w["tokens_per_step"])
    res.update(tokens_per_s=w["tokens_per_s"], step_ms=w["step_ms"], mfu=w["tokens_per_s"] * fpt / (ranks * PEAK),
               memory_gib=w["memory_gib"], memory_gib_per_rank=w["memory_gib_per_rank"],
               memory_reserved_gib=w["memory_reserved_gib"], gpus=ranks, params_per_rank=w["params_per_rank"],
               build_s=w["build_s"], wall_s=time.time() - t0, ce=w["ce"], grad_norm=[r["grad_norm"] for r in w["rows"]])
    return res


def gib(x):
    return f"{x:8.2f}" if x is not None else f"{'n/a':>8}"


def fmt_table(results, a, dev_name, torch_ver):
    lines = []
    T = "/".join(sorted({n.split("=")[1][0] for m in results.values() for n in m["runs"] if "T=" in n or "TP=" in n}))
    lines.append(f"== keel TP vs PyTorch TP (tensor degree {T or 2}; each row's GPUs in its column) -- {dev_name}, torch {torch_ver}; "
                 f"{a.accum} micro-batches of micro_batch x seq per step, {a.steps} timed steps after {a.warmup}")
    head = (f"{'model':6} {'config':19} {'GPUs':>4} {'tok/s':>9} {'MFU':>6} {'GiB/GPU':>8} {'over ideal ms':>13} "
            f"{'busiest/fair':>12} {'(mean)':>6} {'skip':>5} {'keel/torch':>10} {'mem k/t':>7}  per-layer busiest/fair")
    lines.append(head)
    for model, m in results.items():
        runs = m["runs"]
        one = {"keel": runs.get("keel 1 GPU", {}), "torch": runs.get("torch 1 GPU", {})}
        order = [n for n in list(KEEL_CONFIGS) + list(TORCH_CONFIGS) if n in runs and "1 GPU" not in n]
        order += [n for n in ("keel 1 GPU", "torch 1 GPU") if n in runs]
        for name in order:
            r = runs[name]
            label = name + (" (ref)" if "1 GPU" in name else "")
            if "error" in r:
                lines.append(f"{model:6} {label:19} {'':>4} {r['error']}")
                continue
            base = one[name.split()[0]]
            if r["gpus"] > 1 and "step_ms" in base:
                over = f"{r['step_ms'] - base['step_ms'] / r['gpus']:13.1f}"
            else:
                over = f"{'-' if r['gpus'] == 1 else 'N/A':>13}"
            peer = runs.get(MATCHED.get(name, ""), {})
            if "tokens_per_s" in peer:
                ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:10.2f}"
                mem = f"{r['memory_gib'] / peer['memory_gib']:7.2f}" if peer["memory_gib"] else f"{'n/a':>7}"
            else:
                ratio, mem = f"{'':>10}", f"{'':>7}"
            per_layer = " ".join(f"{x:.2f}" for x in r["busiest_per_layer"])
            lines.append(f"{model:6} {label:19} {r['gpus']:>4} {r['tokens_per_s']:9.0f} {100 * r['mfu']:5.1f}% "
                         f"{gib(r['memory_gib'])} {over} {r['busiest_worst']:12.2f} {r['busiest_mean']:6.2f} "
                         f"{r['skip_mean']:5.2f} {ratio} {mem}  {per_layer}")
    lines.append("tok/s: the group's (global batch, each token once); MFU per GPU, one formula for both sides; GiB/GPU: "
                 "keel's device arenas on rank 0, PyTorch's max_memory_allocated on its largest rank; over ideal ms: "
                 "step time - (one-GPU step of the same framework and batch) / GPUs, an upper bound on the exposed "
                 "communication (N/A without the one-GPU rows); busiest/fair: the busiest class over its fair share, "
                 "worst MoE layer and step after warm-up (mean over steps of the worst layer), per layer its worst; "
                 "skip: mean share routed to the skip class; keel/torch and mem k/t: against the matched PyTorch row.")
    for model, m in results.items():
        on, off = m["runs"].get("keel T=2+SP", {}), m["runs"].get("keel T=2+SP serial", {})
        if "tokens_per_s" in on and "tokens_per_s" in off:
            lines.append(f"{model} keel T=2+SP, backward's input re-gathers beside the block before vs on the compute "
                         f"stream: {on['tokens_per_s'] / off['tokens_per_s']:.3f}x tokens/s"
                         + (" (CPU ranks: the switch changes nothing there; run to run noise)" if a.device == "cpu" else ""))
        on, off = m["runs"].get("keel T2xDP2", {}), m["runs"].get("keel T2xDP2 classic", {})
        if "tokens_per_s" in on and "tokens_per_s" in off:
            lines.append(f"{model} keel T=2+SP x DP=2, the overlapped ZeRO-1 step vs the classic one: "
                         f"{on['tokens_per_s'] / off['tokens_per_s']:.3f}x tokens/s"
                         + (" (CPU ranks: no overlap there; run to run noise)" if a.device == "cpu" else ""))
        for k, t in (("keel T=2", "torch TP=2"), ("keel T=2+SP", "torch TP=2+SP"), ("keel T=4", "torch TP=4"),
                     ("keel T=4+SP", "torch TP=4+SP")):
            kr, tr = m["runs"].get(k, {}), m["runs"].get(t, {})
            if "tokens_per_s" in kr and "tokens_per_s" in tr:
                ratio = kr["tokens_per_s"] / tr["tokens_per_s"]
                if tr["memory_gib"] is None:  # CPU ranks: no device memory to compare
                    lines.append(f"target {model} {k} vs {t}: {ratio:.2f}x tokens/s (>= 1.5); memory not measured "
                                 "on CPU ranks: not judged")
                    continue
                mem_ok = kr["memory_gib"] <= tr["memory_gib"]
                ok = ratio >= 1.5 and mem_ok
                lines.append(f"target {model} {k} vs {t}: {ratio:.2f}x tokens/s (>= 1.5), memory {kr['memory_gib']:.2f} "
                             f"vs {tr['memory_gib']:.2f} GiB per GPU ({'no higher' if mem_ok else 'HIGHER'}): "
                             f"{'met' if ok else 'NOT met'}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--out", default="out/bench_tp")
    ap.add_argument("--models", default="bench,zaya1", help="comma list of bench, zaya1")
    ap.add_argument("--configs", default=",".join(k for k in KEYS if k not in FOUR_GPUS),
                    help=f"comma list of the configurations to run, of {', '.join(f'{k} ({v})' for k, v in KEYS.items())}")
    ap.add_argument("--no-one-gpu", action="store_true", help="skip the one-GPU reference rows (no exposed-time column)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step (the global batch of every config)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the model's)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate of both sides (default: each model script's)")
    ap.add_argument("--bias-rate", type=float, default=zaya_vs_torch.BIAS_RATE,
                    help="zaya1's selection-bias rate, both sides")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: keel's CPU ranks and the peer on gloo (a check of the script, with --tiny)")
    ap.add_argument("--forced-balance", action="store_true",
                    help="benchmarking only: token n of each step's tokens -> expert n mod E on both sides "
                         "(keel: router.forced_balance), so every row times balanced experts")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions (with --device cpu: runs in seconds)")
    ap.add_argument("--run-timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs the peer (torch.distributed.run)")
    ap.add_argument("--set", action="append", default=[], dest="sets", help="a keel train override for every keel run")
    a = ap.parse_args()
    if a.steps + a.warmup < 5 or a.steps < 1:
        ap.error("--steps + --warmup must be at least 5 (the routing summary reads steps 5 and later)")
    keys = [c.strip() for c in a.configs.split(",") if c.strip()]
    unknown = [c for c in keys if c not in KEYS]
    if unknown:
        ap.error(f"unknown configurations {unknown}; known: {', '.join(KEYS)}")
    configs = [KEYS[c] for c in keys]
    if a.no_one_gpu:
        configs = [c for c in configs if "1 GPU" not in c]
    if a.no_torch:
        configs = [c for c in configs if c not in TORCH_CONFIGS]
    os.makedirs(a.out, exist_ok=True)
    json_path = os.path.join(a.out, "train_tp_vs_torch.json")
    results = {}

    dev_name, torch_ver = a.device, "?"
    try:
        import torch
        torch_ver = torch.__version__
        if a.device == "cuda" and torch.cuda.is_available():
            dev_name = torch.cuda.get_device_name(0)
    except Exception:  # the peer reports its own errors
        pass

    def save():
        json.dump({"device": dev_name, "torch": torch_ver, "args": vars(a), "peak_flops": PEAK, "models": results},
                  open(json_path, "w"), indent=1)

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if any(m not in ("bench", "zaya1") for m in models):
        ap.error("--models: a comma list of bench, zaya1")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for model in models:
            run_model(a, model, configs, results, save)
    except Interrupted as e:
        print(f"interrupted ({e}): the table holds the runs that finished", flush=True)
    print()
    for line in fmt_table(results, a, dev_name, torch_ver):
        print(line)
    print(f"(JSON: {json_path})", flush=True)


def run_model(a, model, configs, results, save):
    """Every configuration of one model, keel then the peer."""
    d = dims(model, a.tiny, a.layers)
    fpt = flops_per_token(model, d)
    classes = d["experts"] + (1 if model == "zaya1" else 0)
    out = os.path.join(a.out, model)
    os.makedirs(out, exist_ok=True)
    prefix = os.path.join(out, "random")
    rng = np.random.default_rng(0)
    nrows = a.accum * d["micro_batch"] * (a.steps + a.warmup + 4)
    if model == "zaya1":
        zaya_vs_torch.write_dataset(prefix, rng.integers(0, d["vocab"], size=(nrows, d["seq"] + 1), dtype=np.uint64))
    else:
        train_vs_torch.write_dataset(prefix, rng.integers(0, d["vocab"], size=nrows * (d["seq"] + 1),
                                                          dtype=np.uint64), d["seq"])
    results[model] = {"dims": d, "flops_per_token": fpt, "tokens_per_step": a.accum * d["micro_batch"] * d["seq"],
                      "runs": {}}
    for name in configs:
        t0 = time.time()
        if name in KEEL_CONFIGS:
            ranks, parallel = KEEL_CONFIGS[name]
            r = run_keel(a, model, d, out, prefix, name, ranks, parallel, fpt, classes)
        else:
            ranks, sp = TORCH_CONFIGS[name]
            r = run_torch(a, model, d, out, name, ranks, sp, fpt, classes)
        results[model]["runs"][name] = r
        brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                 if k not in ("ce", "grad_norm", "busiest_per_layer", "memory_gib_per_rank")}
        print(f"{model} {name}: {json.dumps(brief)} ({time.time() - t0:.0f} s)", flush=True)
        save()


if __name__ == "__main__":
    main()
