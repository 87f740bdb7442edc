#!/usr/bin/env python3
"""Per-rank memory of keel train's two-rank layouts on CPU ranks: TSP=2 against TP=2, TP=2+SP,
CP=2 and DP=2, as sequences grow (issue 30's comparison, the memory half, on the CPU).

Model: a dense decoder of the TSP paper's 7B proportions scaled to a CPU (hidden --hidden,
heads of 128, FFN x4, --layers layers, vocabulary 32,000), one sequence per micro-batch, AdamW.
For each layout and sequence length it starts `mpirun -np 2 keel train` (device: cpu) on random
tokens, reads rank 0's start-up memory line (keel's arenas: parameters, gradients, optimizer
state, activations and scratch, TSP's shard buffers; sized before the first step) and stops the
run: no step is timed, so nothing here is a throughput figure. Writes OUT/tsp_memory.json and
prints the table last.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_vs_torch import write_dataset  # noqa: E402

LAYOUTS = {
    "TSP=2": "  tsp: 2\n",
    "TP=2": "  tensor: 2\n",
    "TP=2+SP": "  tensor: 2\n  sequence: true\n",
    "CP=2": "  context: 2\n",
    "DP=2": "",  # parallel.data: 2 is written by config()
}


def config(a, prefix, out, seq, layout):
    accum = 2 if layout == "DP=2" else 1
    return f"""device: cpu
model:
  name: dense-7b-shape
  vocab_size: 32000
  hidden: {a.hidden}
  layers: {a.layers}
  attention: mha
  heads: {a.hidden // 128}
  kv_heads: {a.hidden // 128}
  head_dim: 128
  ffn_hidden: {4 * a.hidden}
  max_seq_len: {seq}
data:
  datasets: {{train: {prefix}}}
  seq_length: {seq}
parallel:
  data: {2 if layout == "DP=2" else 1}
{LAYOUTS[layout]}batch:
  micro_batch: 1
  grad_accum: {accum}
optimizer:
  lr: 0.0001
steps: 1
output_dir: {out}
checkpoint: {{final: false}}
"""


def gib(text):
    return float(text.split()[0])


def measure(a, prefix, seq, layout):
    run_dir = os.path.join(a.out, f"{layout.replace('=', '').replace('+', '_')}_{seq}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cfg = os.path.join(run_dir, "train.yaml")
    open(cfg, "w").write(config(a, prefix, os.path.join(run_dir, "run"), seq, layout))
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.Popen([a.mpirun, "--oversubscribe", "--bind-to", "none", "-n", "2", a.keel, "train", cfg],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    line, seen = None, []
    for out in p.stdout:
        seen.append(out)
        if out.startswith("memory on this rank:"):
            line = out.strip()
            break
    p.kill()
    p.wait()
    if not line:
        return {"error": "".join(seen[-5:]).strip()}
    total, parts = line.split(" = ", 1)
    row = {"total_gib": gib(total.split(": ")[1])}
    for part in parts.split(" + "):
        m = re.match(r"(.+) ([0-9.]+ GiB)$", part)
        if m:
            row[m.group(1)] = gib(m.group(2))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--out", default="out/bench_tsp_memory")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden width (heads of 128; the 7B's is 4096)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--mpirun", default="mpirun")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",")]
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    prefix = os.path.join(a.out, "random")
    rng = np.random.default_rng(0)
    write_dataset(prefix, rng.integers(0, 32000, size=4 * (max(lengths) + 1), dtype=np.uint64), max(lengths))
    results = {}
    for seq in lengths:
        for layout in layouts:
            results[f"{layout} {seq}"] = r = measure(a, prefix, seq, layout)
            print(f"{layout:8s} {seq:6d}: {r}", flush=True)
    json.dump(results, open(os.path.join(a.out, "tsp_memory.json"), "w"), indent=1)
    print(f"\n== keel train per-rank memory on 2 CPU ranks (GiB, rank 0's arenas, fp32): dense h={a.hidden}, "
          f"{a.layers} layers, FFN x4, vocab 32000, one sequence per micro-batch")
    print(f"{'layout':8s} " + " ".join(f"{s:>8d}" for s in lengths) + "   (at the longest: params / grads / optim / acts / shards)")
    for layout in layouts:
        cells, last = [], {}
        for seq in lengths:
            r = results[f"{layout} {seq}"]
            cells.append(f"{r['total_gib']:8.2f}" if "total_gib" in r else f"{'error':>8s}")
            last = r
        detail = " / ".join(f"{last.get(k, 0):.2f}" for k in
                            ("parameters", "gradients", "optimizer state", "activations and scratch", "tsp shards"))
        print(f"{layout:8s} " + " ".join(cells) + "   " + detail)
    lowest = {seq: min((results[f"{l} {seq}"].get("total_gib", 1e9), l) for l in layouts)[1] for seq in lengths}
    print("lowest: " + ", ".join(f"{seq}: {l}" for seq, l in lowest.items()))


if __name__ == "__main__":
    main()
