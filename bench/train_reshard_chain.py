#!/usr/bin/env python3
"""Resharding resume on GPUs: keel train through a chain of layouts against one uninterrupted run.

A 9-step run of a small MoE (8 experts, top-2, 4 layers, hidden 512, Muon, constant lr; the
same global batch of 4 micro-batches at every world size) on a learnable stream (one random
256-token phrase repeated, so the loss falls fast and a resume that lost or misplaced any
state shows) is trained as
  steps 1-3 on N GPUs with expert parallelism over all of them (parallel.expert = N),
  steps 4-6 on N/2 GPUs with parallel.expert = N/2 (or --mid-ep K: every expert on N/2/K
  GPUs, the issue's 8 GPUs EP 8 -> 4 GPUs EP 2 -> 1 is --gpus 8 --mid-ep 2),
  steps 7-9 on one GPU,
each stage resuming from the previous stage's checkpoint (resharded at load: other world size,
other expert degree, other ZeRO-1 shards). The reference trains the same 9 steps on one GPU
without stopping. The chain's losses at steps 4-9 must match the reference's within --rtol
(GPU runs are not bit for bit: the embedding backward adds with atomics). Prints a table and
exits non-zero on a mismatch or a failed stage.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_vs_torch import write_dataset  # noqa: E402

VOCAB, SEQ, MICRO = 32000, 1024, 2


def config(prefix, out, steps, ep):
    return f"""device: cuda
model:
  name: chain-moe
  vocab_size: {VOCAB}
  hidden: 512
  layers: 4
  attention: gqa
  heads: 4
  kv_heads: 2
  head_dim: 128
  experts: 8
  top_k: 2
  expert_hidden: 512
  max_seq_len: {SEQ}
data:
  datasets: {{train: {prefix}}}
  seq_length: {SEQ}
  seed: 1
optimizer:
  lr: 1e-3
  muon:
    enabled: true
schedule:
  kind: constant
batch:
  micro_batch: {MICRO}
  grad_accum: 4
steps: {steps}
log_interval: 1
output_dir: {out}
parallel:
  expert: {ep}
"""


def train(keel, out, name, gpus, ep, steps, prefix, resume=None):
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)  # keel train refuses another run's metrics and checkpoints
    os.makedirs(run_dir)
    path = os.path.join(run_dir, "train.yaml")
    open(path, "w").write(config(prefix, run_dir, steps, ep))
    cmd = ["mpirun", "--allow-run-as-root", "-np", str(gpus), "--bind-to", "none", "-x", "NCCL_NVLS_ENABLE",
           keel, "train", path] + (["--resume", resume] if resume else [])
    log = os.path.join(run_dir, "train.log")
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=300,
                           env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
    if r.returncode != 0:
        print(open(log).read()[-3000:])
        sys.exit(f"{name}: keel train exited {r.returncode}")
    losses = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        row = json.loads(line)
        if "loss" in row and "step" in row:
            losses[row["step"]] = row["loss"]
    resumed = [line.strip() for line in open(log) if "resumed from" in line]
    return run_dir, losses, resumed[0] if resumed else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--out", default="out/reshard_chain")
    ap.add_argument("--gpus", type=int, default=4, help="GPUs of the first stage (even)")
    ap.add_argument("--mid-ep", type=int, default=0, help="expert-parallel degree of the middle stage (default N/2)")
    ap.add_argument("--rtol", type=float, default=5e-3)
    a = ap.parse_args()
    if a.gpus < 2 or a.gpus % 2 or 8 % a.gpus:
        sys.exit("--gpus must be 2, 4 or 8 (it and its half divide the 8 experts)")
    os.makedirs(a.out, exist_ok=True)
    prefix = os.path.join(a.out, "random")
    rng = np.random.default_rng(0)
    n = MICRO * 4 * 12 * (SEQ + 1)
    phrase = rng.integers(0, 1000, size=256, dtype=np.uint64)
    write_dataset(prefix, np.resize(phrase, n), SEQ)
    _, ref, _ = train(a.keel, a.out, "reference", 1, 1, 9, prefix)
    half = a.gpus // 2
    mid = a.mid_ep or half
    if half % mid or 8 % mid:
        sys.exit(f"--mid-ep {mid} must divide {half} GPUs and the 8 experts")
    d1, l1, _ = train(a.keel, a.out, f"stage1_{a.gpus}gpu_ep{a.gpus}", a.gpus, a.gpus, 3, prefix)
    d2, l2, r2 = train(a.keel, a.out, f"stage2_{half}gpu_ep{mid}", half, mid, 6, prefix, resume=d1)
    _, l3, r3 = train(a.keel, a.out, "stage3_1gpu", 1, 1, 9, prefix, resume=d2)
    print(f"\n== keel train resharding chain: {a.gpus} GPUs EP {a.gpus} -> {half} GPU(s) EP {mid} -> 1 GPU ==")
    print(f"  stage 2: {r2}\n  stage 3: {r3}")
    print(f"{'step':>4} {'layout':>16} {'chain loss':>11} {'uninterrupted':>13} {'rel diff':>9}")
    worst = 0.0
    for step in range(1, 10):
        if step <= 3:
            got, layout = l1.get(step), f"{a.gpus} GPUs, EP {a.gpus}"
        elif step <= 6:
            got, layout = l2.get(step), f"{half} GPU{'s' if half > 1 else ''}, EP {mid}"
        else:
            got, layout = l3.get(step), "1 GPU"
        want = ref.get(step)
        if got is None or want is None:
            sys.exit(f"step {step}: no loss logged")
        rel = abs(got - want) / abs(want)
        worst = max(worst, rel)
        print(f"{step:>4} {layout:>16} {got:>11.5f} {want:>13.5f} {rel:>9.2e}")
    ok = worst <= a.rtol
    print(f"chain {'matches' if ok else 'DIFFERS FROM'} the uninterrupted run: worst relative loss difference "
          f"{worst:.2e} (tolerance {a.rtol:.0e})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
