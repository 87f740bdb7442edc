#!/usr/bin/env python3
"""Weak scaling of keel train with data parallelism + ZeRO-1 on one node's GPUs.

The model and step are bench/train_vs_torch.py's (a 2.2B-parameter / 0.71B-active MoE, 8
layers, vocab 262,272 tied, sequence 4096, micro-batch 2 = 8K tokens per GPU per step, AdamW).
For each GPU count N (--gpus 1,2,4,8) keel trains under `mpirun -np N` with batch.grad_accum = N,
so every GPU processes the same 8K tokens per step as the 1-GPU run. Reports the group's
tokens/s (median over the timed steps after warm-up), per-GPU tokens/s, weak-scaling
efficiency = tokens/s(N) / (N x tokens/s(1)), and the step time exposed to communication,
estimated as step time(N) - step time(1) (the extra time a step takes with the collectives).

On random tokens the routers' state decides much of a step's time (a layer whose router sends
every token to the skip class runs no expert at all), and it differs from run to run, so the
1-GPU run can be faster or slower than the N-GPU runs for reasons that have nothing to do with
scaling. The "same-batch" columns therefore also compare each N-GPU run with one GPU training the
same global batch (batch.grad_accum = N on one GPU): the same samples in the same order (keel's
order does not depend on the world size), so about the same routing, and the same optimizer work
per token as ZeRO-1's 1/N share. "its max load" is that run's. --no-same-batch skips those runs.

keel's ZeRO-1 step overlaps its collectives with compute by default (docs/parallel.md);
--classic-gpus 2,4 also runs those GPU counts with parallel.zero1.overlap: false (the classic step: reduce-
scatter after backward, all-gather after the update) and prints them as extra rows, for the
before / after comparison in one run. --bf16-reduce-gpus 2,4 also runs those GPU counts with
parallel.grad_reduce: bf16 (gradients summed over the GPUs in bf16, half the bytes of the default
fp32; docs/parallel.md) as extra rows. --ep-gpus 2,4 also runs those GPU counts with expert
parallelism over every GPU (parallel.expert = N: each GPU holds E / N experts, tokens travel by
NCCL all-to-all; docs/parallel.md), as extra rows against the same 1-GPU base. On this random-
token stream the softmax router collapses within a few steps (one expert takes every token),
which costs data parallelism nothing but puts every token's expert compute on one GPU under
expert parallelism. To measure expert parallelism with the balanced routing a healthy run has,
--lr X lowers the learning rate (the collapse follows the first updates at 3e-4) and
--router-bias-rate R turns on keel's aux-loss-free bias balancing (router.bias_update_rate), in
every keel run of the invocation, base included; the table's last column shows the busiest
expert's load (1.0: balanced, 16: one expert takes every token).

--model zaya1 runs the same scaling on the ZAYA1-shaped model of bench/zaya_vs_torch.py instead
(the 8-layer cut of ZAYA1-8B: CCA attention, MLP router with EDA and the skip class, residual
scaling, 16 experts top-1, bias balancing at that script's rate; 8K tokens per GPU per step);
its peer is that script's PyTorch model under the same DDP + ZeRO-1 (below), with the keel runs'
learning rate and bias rate. With --muon (zaya1 only) every keel run uses ZAYA1's optimizer split,
Muon + AdamW (optimizer.muon): under ZeRO-1 each rank runs Newton-Schulz on the whole matrices of its
shard only (docs/optim.md), so a step's optimizer work shrinks with N and the efficiency column can
exceed 1; compare step times with the AdamW run instead. --muon implies --no-torch (torch has no
distributed Muon to set beside keel's). --set KEY=VALUE (repeatable) passes a config override to
every keel run (e.g. --set parallel.zero1.profile=true). NCCL_* variables reach every rank.

The peer, in the same run for each N right after keel: the same model and step in PyTorch
(eager) under torchrun with DistributedDataParallel (gradient all-reduce in buckets overlapped
with backward) and ZeroRedundancyOptimizer (ZeRO-1 AdamW), bench/train_dp_torch.py; --no-torch
skips it.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zaya_vs_torch  # noqa: E402
from train_vs_torch import DIMS, keel_config, write_dataset  # noqa: E402


EXTRA_SETS = []  # --set: config overrides for every keel run


def run(keel, out, d, steps, warmup, gpus, prefix, classic=False, timeout=900, ep=1, bias_rate=0.0, lr=None,
        muon=False, accum=None, bf16_reduce=False):
    accum = accum or gpus  # micro-batches per step over the whole group (batch.grad_accum)
    run_dir = os.path.join(out, f"dp{gpus}" + ("_classic" if classic else "") + (f"_ep{ep}" if ep > 1 else "") +
                           ("_bf16reduce" if bf16_reduce else "") + (f"_accum{accum}" if accum != gpus else ""))
    shutil.rmtree(run_dir, ignore_errors=True)  # keel train refuses another run's metrics and checkpoints
    os.makedirs(run_dir)
    path = os.path.join(run_dir, "train.yaml")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if d.get("attention") == "cca":  # the ZAYA1-shaped model: its own config (its lr and bias rate unless given)
        zb = bias_rate if bias_rate > 0 else zaya_vs_torch.BIAS_RATE
        text = zaya_vs_torch.keel_config(d, prefix, run_dir, steps, "cuda", lr=lr or zaya_vs_torch.LR, bias_rate=zb,
                                         muon=muon)
        assert "  grad_accum: 1\n" in text
        text = text.replace("  grad_accum: 1\n", f"  grad_accum: {accum}\n")
        metrics = os.path.join(run_dir, "run", "metrics.jsonl")
        bias_rate, lr = 0.0, None
    else:
        text = keel_config(d, prefix, run_dir, steps, grad_accum=accum)
    if ep > 1 or bf16_reduce:
        assert "\nparallel:" not in text
        text += "parallel:\n" + (f"  expert: {ep}\n" if ep > 1 else "") + ("  grad_reduce: bf16\n" if bf16_reduce else "")
    if lr is not None:
        assert "\n  lr: " in text
        text = "\n".join(f"  lr: {lr}" if line.startswith("  lr: ") else line for line in text.split("\n"))
    if bias_rate > 0:
        assert "\nrouter:\n" in text
        text = text.replace("\nrouter:\n", f"\nrouter:\n  bias_update_rate: {bias_rate}\n")
    open(path, "w").write(text)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    forward = []
    for k in sorted(env):
        if k.startswith("NCCL_"):
            forward += ["-x", k]
    sets = ["--set", "parallel.zero1.overlap=false"] if classic else []
    for s in EXTRA_SETS:
        sets += ["--set", s]
    cmd = ["mpirun", "--allow-run-as-root", "-np", str(gpus), "--bind-to", "none"] + forward + [keel, "train", path] + sets
    log = os.path.join(run_dir, "keel_train.log")
    with open(log, "w") as f:
        try:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            print(open(log).read()[-3000:])
            return {"error": f"timed out after {timeout} s"}
    if r.returncode != 0:
        print(open(log).read()[-3000:])
        return {"error": f"exit {r.returncode}"}
    rows = [json.loads(line) for line in open(metrics)]
    tps = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row and row.get("step", 0) > warmup]
    ce = [row["ce"] for row in rows if "ce" in row]
    mem = max(row.get("memory_mib", 0) for row in rows)
    # the busiest expert's load over the timed steps (1.0: balanced; E: one expert takes every token)
    load = [row["expert_load_max"] for row in rows if "expert_load_max" in row and row.get("step", 0) > warmup]
    return {"tokens_per_s": statistics.median(tps), "ce_first": ce[0], "ce_last": ce[-1], "memory_gib": mem / 1024,
            "load_max": statistics.median(load) if load else float("nan")}


def run_torch(out, steps, warmup, gpus, layers, model="bench", lr=None, bias_rate=0.0, forced=False):
    path = os.path.join(out, f"torch{gpus}.json")
    log = os.path.join(out, f"torch{gpus}.log")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_dp_torch.py")
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={gpus}", worker, "--json", path, "--steps", str(steps),
           "--warmup", str(warmup), "--layers", str(layers), "--model", model]
    if model == "zaya1":  # the keel runs' settings (zaya_vs_torch's defaults where not given)
        cmd += ["--lr", str(lr or zaya_vs_torch.LR), "--bias-rate", str(bias_rate or zaya_vs_torch.BIAS_RATE)]
        cmd += ["--forced-balance"] if forced else []
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=900,
                           env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
    if r.returncode != 0 or not os.path.exists(path):
        print(open(log).read()[-3000:])
        return {"error": f"exit {r.returncode}"}
    return json.load(open(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--out", default="out/bench_dp")
    ap.add_argument("--gpus", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the model's 8)")
    ap.add_argument("--model", choices=["bench", "zaya1"], default="bench")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--run-timeout", type=int, default=900, help="seconds per keel run")
    ap.add_argument("--classic-gpus", default="",
                    help="GPU counts to also run with the classic step (parallel.zero1.overlap: false)")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="a keel train config override for every keel run (repeatable)")
    ap.add_argument("--bf16-reduce-gpus", default="",
                    help="GPU counts to also run with parallel.grad_reduce: bf16 (gradients summed in bf16)")
    ap.add_argument("--ep-gpus", default="", help="GPU counts to also run with expert parallelism over all of them")
    ap.add_argument("--router-bias-rate", type=float, default=0.0,
                    help="router.bias_update_rate for every keel run (0: off, the peer's router)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate of every keel run (default: the peer's)")
    ap.add_argument("--muon", action="store_true", help="Muon + AdamW in every keel run (--model zaya1 only)")
    ap.add_argument("--no-same-batch", action="store_true",
                    help="skip the one-GPU runs of each N-GPU run's global batch (the 'same batch' columns)")
    ap.add_argument("--forced-balance", action="store_true",
                    help="benchmarking only (--model zaya1): token n -> expert n mod E in every run, keel's "
                         "(router.forced_balance) and the peer's, so no row times a collapsed router")
    a = ap.parse_args()
    EXTRA_SETS.extend(a.sets)
    if a.forced_balance:
        if a.model != "zaya1":
            ap.error("--forced-balance needs --model zaya1")
        EXTRA_SETS.append("router.forced_balance=true")
    if a.muon and a.model != "zaya1":
        ap.error("--muon needs --model zaya1")
    d = dict(zaya_vs_torch.ZAYA8 if a.model == "zaya1" else DIMS)
    if a.layers:
        d["layers"] = a.layers
    if a.muon:
        a.no_torch = True
    counts = [int(x) for x in a.gpus.split(",")]
    os.makedirs(a.out, exist_ok=True)
    prefix = os.path.join(a.out, "random")
    rows_needed = d["micro_batch"] * max(counts) * (a.steps + 4)
    rng = np.random.default_rng(0)
    write_dataset(prefix, rng.integers(0, d["vocab"], size=rows_needed * (d["seq"] + 1), dtype=np.uint64), d["seq"])
    classic = [int(x) for x in a.classic_gpus.split(",") if x]
    ep_counts = [int(x) for x in a.ep_gpus.split(",") if x]
    bf16_counts = [int(x) for x in a.bf16_reduce_gpus.split(",") if x]
    res, peer, res_classic, res_ep, res_bf16, same = {}, {}, {}, {}, {}, {}
    for n in counts:
        if n > 1 and not a.no_same_batch:
            same[n] = run(a.keel, a.out, d, a.steps, a.warmup, 1, prefix, timeout=a.run_timeout,
                          bias_rate=a.router_bias_rate, lr=a.lr, muon=a.muon, accum=n)
            print("keel 1 GPU, grad_accum", n, same[n], flush=True)
        res[n] = run(a.keel, a.out, d, a.steps, a.warmup, n, prefix, timeout=a.run_timeout, bias_rate=a.router_bias_rate,
                     lr=a.lr, muon=a.muon)
        print("keel", n, res[n], flush=True)
        if n in classic and n > 1:
            res_classic[n] = run(a.keel, a.out, d, a.steps, a.warmup, n, prefix, classic=True, timeout=a.run_timeout,
                                 bias_rate=a.router_bias_rate, lr=a.lr, muon=a.muon)
            print("keel classic", n, res_classic[n], flush=True)
        if n in bf16_counts and n > 1:
            res_bf16[n] = run(a.keel, a.out, d, a.steps, a.warmup, n, prefix, timeout=a.run_timeout,
                              bias_rate=a.router_bias_rate, lr=a.lr, muon=a.muon, bf16_reduce=True)
            print("keel bf16 reduce", n, res_bf16[n], flush=True)
        if n in ep_counts and n > 1:
            res_ep[n] = run(a.keel, a.out, d, a.steps, a.warmup, n, prefix, timeout=a.run_timeout, ep=n,
                            bias_rate=a.router_bias_rate, lr=a.lr, muon=a.muon)
            print("keel ep", n, res_ep[n], flush=True)
        if not a.no_torch:
            peer[n] = run_torch(a.out, a.steps, a.warmup, n, d["layers"], model=a.model, lr=a.lr,
                                bias_rate=a.router_bias_rate, forced=a.forced_balance)
            print("torch", n, peer[n], flush=True)
    tok_step = d["micro_batch"] * d["seq"]  # tokens per GPU per step
    bal = f", router bias balancing {a.router_bias_rate}" if a.router_bias_rate > 0 else ""
    bal += f", lr {a.lr}" if a.lr is not None else ""
    bal += ", forced-balance routing (busiest/fair 1.06 by construction, skip 0)" if a.forced_balance else ""
    model = ", ZAYA1-shaped model" if a.model == "zaya1" else ""
    model += ", Muon + AdamW" if a.muon else ""
    print(f"\n== keel train weak scaling, data parallel + ZeRO-1 (8K tokens per GPU per step{model}{bal}) ==")
    print(f"{'GPUs':>4} {'step':>8} {'tok/s':>10} {'tok/s/GPU':>10} {'step ms':>8} {'eff':>6} {'exposed comm ms':>16} "
          f"{'mem GiB':>8} {'max load':>8} {'same-batch eff':>14} {'exposed ms':>10} {'its max load':>12}")
    base = res.get(1, {}).get("tokens_per_s")
    rows = [(n, "overlap" if n > 1 else "-", res[n]) for n in counts]
    rows += [(n, "classic", res_classic[n]) for n in counts if n in res_classic]
    rows += [(n, "bf16 red", res_bf16[n]) for n in counts if n in res_bf16]
    rows += [(n, f"ep={n}", res_ep[n]) for n in counts if n in res_ep]
    for n, kind, r in rows:
        if "error" in r:
            print(f"{n:>4} {kind:>8} {r['error']}")
            continue
        step_ms = 1e3 * tok_step * n / r["tokens_per_s"]
        eff = r["tokens_per_s"] / (n * base) if base else float("nan")
        exposed = step_ms - 1e3 * tok_step / base if base else float("nan")
        # Against one GPU training the same global batch (grad_accum N): the same data, hence
        # about the same routing, and the same optimizer work per token as ZeRO-1's 1/N share.
        sb = same.get(n, {}).get("tokens_per_s") if n > 1 else base
        sb_load = same.get(n, {}).get("load_max", float("nan")) if n > 1 else res.get(1, {}).get("load_max", float("nan"))
        eff_sb = r["tokens_per_s"] / (n * sb) if sb else float("nan")
        exposed_sb = step_ms - 1e3 * tok_step / sb if sb else float("nan")
        print(f"{n:>4} {kind:>8} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / n:>10.0f} {step_ms:>8.1f} {eff:>6.3f} "
              f"{exposed:>16.1f} {r['memory_gib']:>8.1f} {r.get('load_max', float('nan')):>8.2f} {eff_sb:>14.3f} "
              f"{exposed_sb:>10.1f} {sb_load:>12.2f}")
    if peer:
        print("\n== PyTorch DDP + ZeroRedundancyOptimizer (eager), same model and tokens per GPU ==")
        print(f"{'GPUs':>4} {'tok/s':>10} {'tok/s/GPU':>10} {'eff':>6} {'mem GiB':>8} {'keel/torch':>10} {'max load':>8}")
        tbase = peer.get(1, {}).get("tokens_per_s")
        for n in counts:
            t = peer[n]
            if "error" in t:
                print(f"{n:>4} {t['error']}")
                continue
            eff = t["tokens_per_s"] / (n * tbase) if tbase else float("nan")
            ratio = res[n]["tokens_per_s"] / t["tokens_per_s"] if "tokens_per_s" in res[n] else float("nan")
            print(f"{n:>4} {t['tokens_per_s']:>10.0f} {t['tokens_per_s'] / n:>10.0f} {eff:>6.3f} {t['memory_gib']:>8.1f} "
                  f"{ratio:>10.2f} {t.get('load_max', float('nan')):>8.2f}")
    json.dump({"keel": res, "keel_classic": res_classic, "keel_ep": res_ep, "keel_bf16_reduce": res_bf16,
               "keel_one_gpu_same_batch": same, "torch": peer}, open(os.path.join(a.out, "scaling.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
