#!/usr/bin/env python3
"""keel train's context parallelism on 2 GPUs (--degree C: on C): long sequences at the throughput of short ones.

Model: bench/zaya_vs_torch.py's ZAYA1-shaped model (the 8-layer cut of ZAYA1-8B: CCA 8/2 heads,
MLP router with EDA and the skip class, residual scaling, 16 experts top-1, selection-bias
balancing), random tokens, AdamW at lr 3e-5 (--lr), bf16 with fp32 master weights.

Configurations (same tokens per GPU per step, 16K):
  CP=2 32K   mpirun -np 2 keel train, parallel: {context: 2}: one sequence of 32,768 tokens per
             step split over both GPUs (zigzag, k/v all-gathered)
  DP=2 4K    parallel: {data: 2}: sequences of 4,096, 2 per micro-batch, 2 micro-batches per GPU
--degree C runs every C-rank row (CP, DP, the peer, --longest, --lasp) on C GPUs instead of 2 (then
each CP=C rank holds 32,768 / C tokens and DP=C trains the same tokens per GPU).
The target (issue 29): CP=2 at 32K within 5% of DP=2 at 4K in tokens/s per GPU. Attention's
FLOPs grow with the sequence, so MFU (one formula: keel's model FLOPs, attention included) is
printed beside tokens/s.

--hybrid: LASP-2H instead: layers 0-2 of every 4 are linear attention (RetNet decay; docs/train.md)
and layer 3 CCA, so under CP=2 the linear layers run LASP-2 (one all-gather of memory states) and
the CCA layers the k/v all-gather; MFU counts the linear layers' core as keel does (model.cc).

--longest: the longest sequence (of --lengths) that trains on 1 GPU and on 2 (CP=2), with and
without full recomputation, and its peak memory (keel's device arenas, rank 0).

--peer (--only-peer: those runs alone): PyTorch's context parallelism beside keel's, on the model
with GQA attention at the same widths (q 8 / kv 2 heads of 128; CCA's convolutions would need a
halo exchange that torch's context parallelism does not do): keel CP=2 at --seq and DP=2 at
--short, then bench/train_cp_torch.py under torchrun, the same two layouts
(torch.distributed.tensor.experimental.context_parallel: its load-balanced split and ring
attention, DistributedDataParallel over the group; DDP for the DP row). Printed: keel / torch at
CP=2, and each side's CP=2 / DP=2 tokens per GPU (what context parallelism costs each).
--forced-balance: every run routes token n to expert n mod E (router.forced_balance; the peer the
same), so no row times a collapsed router.

--lasp: LASP-2 against LASP-1 and the all-to-all (issue 31): every layer linear attention (RetNet
decay), CP=2 at each of --lengths, the memory states all-gathered once per layer (LASP-2,
context_mode allgather), passed rank to rank (LASP-1, context_mode ring: 2C - 1 sequential hops)
and the heads exchanged instead (DeepSpeed-Ulysses' schedule, context_mode alltoall: whole
sequences of half the heads per rank); the ratios of their tokens/s per length (target: LASP-2 at
least 1.15x LASP-1 at the longest).

Reported with every row: the routing (bench/routing_health.py: the busiest class over its fair
share, worst layer after warm-up, and the skip share). Writes OUT/train_cp.json, prints the
table last.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_tp_vs_torch as tpb  # noqa: E402
import zaya_vs_torch  # noqa: E402


def dims(a, seq, micro_batch, attention="cca"):
    d = dict(zaya_vs_torch.TINY if a.tiny else zaya_vs_torch.ZAYA8, seq=seq, micro_batch=micro_batch,
             attention=attention)
    if a.layers:
        d["layers"] = a.layers
    return d


def run(a, out, prefix, name, ranks, parallel, seq, micro_batch, accum, recompute="none", steps=None, warmup=None,
        attention="cca"):
    steps = a.steps if steps is None else steps
    warmup = a.warmup if warmup is None else warmup
    d = dims(a, seq, micro_batch, attention)
    run_dir = os.path.join(out, name.replace(" ", "_").replace("=", ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    text, metrics = tpb.keel_config("zaya1", d, prefix, run_dir, steps + warmup, a.device, accum, parallel, a.lr,
                                    a.bias_rate, a.forced_balance)
    text = text.replace("recompute: none\n", f"recompute: {recompute}\n")
    text = text.replace(f"  max_seq_len: {d['seq']}\n", f"  max_seq_len: {max(d['seq'], a.max_seq)}\n")
    cfg = os.path.join(run_dir, "train.yaml")
    open(cfg, "w").write(text)
    log = os.path.join(run_dir, "keel_train.log")
    t0 = time.time()
    err = tpb.launch_keel(a, cfg, ranks, log)
    if err:
        return {"error": f"keel train {err}: {tpb.last_line(log)}", "seq": seq, "gpus": ranks, "recompute": recompute}
    rows = [json.loads(line) for line in open(metrics) if '"loss"' in line]
    fpt = flops_per_token(d, a.hybrid, a.lasp)
    res = tpb.summarize_rows(rows, d["experts"] + 1, warmup, ranks, fpt, accum * micro_batch * seq)
    res.update(memory_gib=max(r.get("memory_mib", 0) for r in rows) / 1024, gpus=ranks, seq=seq, recompute=recompute,
               tokens_per_gpu_s=res["tokens_per_s"] / ranks, wall_s=time.time() - t0)
    return res


def run_torch(a, out, name, ranks, cp, seq, micro_batch, accum):
    """bench/train_cp_torch.py under torchrun: the GQA model, context parallelism (cp) or data
    parallelism over `ranks`; accum micro-batches per rank and step."""
    d = dims(a, seq, micro_batch, "gqa")
    run_dir = os.path.join(out, name.replace(" ", "_").replace("=", ""))
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    path, log = os.path.join(run_dir, "torch.json"), os.path.join(run_dir, "torch.log")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_cp_torch.py")
    cmd = [a.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", worker, "--json", path,
           "--device", a.device, "--seq", str(seq), "--micro-batch", str(micro_batch), "--accum", str(accum),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--lr", str(a.lr), "--bias-rate", str(a.bias_rate)]
    cmd += ["--cp"] if cp else []
    cmd += ["--tiny"] if a.tiny else []
    cmd += ["--forced-balance"] if a.forced_balance else []
    cmd += ["--layers", str(a.layers)] if a.layers else []
    t0 = time.time()
    err = tpb.run_cmd(cmd, log, a.run_timeout, tpb.run_env(a.device))
    if err is None and not os.path.exists(path):
        err = "exit 0 without its JSON"
    if err:
        text = open(log, errors="replace").read().splitlines()
        why = [line for line in text if line.startswith("[rank0]: ") and "Error" in line.split(":")[1]]
        return {"error": f"torch {err}: {(why[-1][9:] if why else tpb.last_line(log))[:300]}", "seq": seq, "gpus": ranks}
    res = json.load(open(path))
    s = tpb.summarize_rows(res["rows"], d["experts"] + 1, a.warmup, ranks, zaya_vs_torch.flops_per_token(d),
                           res["tokens_per_step"])
    s.update(memory_gib=res["memory_gib"] or 0.0, gpus=ranks, seq=seq, recompute="none",
             tokens_per_gpu_s=s["tokens_per_s"] / ranks, wall_s=time.time() - t0, torch=res["torch"])
    return s


def peer(a, prefix, results, per_gpu, mb, accum):
    """--peer: keel and PyTorch's context parallelism on the GQA model of the same widths, CP=C at
    --seq and DP=C at --short on the same tokens per GPU; returns the summary lines."""
    C = a.degree
    cp_k, cp_t = f"keel GQA CP={C} {a.seq}", f"torch GQA CP={C} {a.seq}"
    dp_k, dp_t = f"keel GQA DP={C} {a.short}", f"torch GQA DP={C} {a.short}"
    results[cp_k] = run(a, a.out, prefix, f"gqa_cp{C}", C, {"context": C}, a.seq, 1, 1, attention="gqa")
    results[cp_t] = run_torch(a, a.out, f"torch_gqa_cp{C}", C, True, a.seq, 1, 1)
    results[dp_k] = run(a, a.out, prefix, f"gqa_dp{C}", C, {"data": C}, a.short, mb, accum, attention="gqa")
    results[dp_t] = run_torch(a, a.out, f"torch_gqa_dp{C}", C, False, a.short, mb, accum // C)
    lines = []
    ok = lambda *ns: all("tokens_per_s" in results[n] for n in ns)  # noqa: E731
    if ok(cp_k, cp_t):
        k, t = results[cp_k], results[cp_t]
        lines.append(f"peer: keel / PyTorch context parallel (GQA, CP={C} at {a.seq}): "
                     f"{k['tokens_per_s'] / t['tokens_per_s']:.2f}x tokens/s, memory {k['memory_gib']:.2f} vs "
                     f"{t['memory_gib']:.2f} GiB per GPU")
    for side, c, p in (("keel", cp_k, dp_k), ("torch", cp_t, dp_t)):
        if ok(c, p):
            lines.append(f"{side} GQA: CP={C} at {a.seq} / DP={C} at {a.short} tokens/s per GPU = "
                         f"{results[c]['tokens_per_s'] / results[p]['tokens_per_s']:.3f} (MFU "
                         f"{100 * results[c]['mfu']:.1f}% vs {100 * results[p]['mfu']:.1f}%)")
    return lines


HYBRID = ["model.layer_attention=[linear, linear, linear, cca]", "model.linear_decay=retnet"]
LINEAR = ["model.attention=linear", "model.linear_decay=retnet"]


def flops_per_token(d, hybrid, all_linear=False):
    """zaya_vs_torch.flops_per_token, with --hybrid's linear layers (3 of every 4; --lasp: all)
    counted as keel's model_flops_per_micro_batch does: no convs, the core Hq (4 Dh^2 + 2 Dh
    min(256, seq)) x 3."""
    f = zaya_vs_torch.flops_per_token(d)
    if not hybrid and not all_linear:
        return f
    Dh, Hq, Hkv = d["head_dim"], d["heads"], d["kv_heads"]
    linear = d["layers"] if all_linear else d["layers"] * 3 // 4
    f -= linear * 6 * (Hq + Hkv) * Dh * (d["conv0"] + Dh * d["conv1"])
    f -= linear * 6 * d["seq"] * Hq * Dh
    return f + linear * 3 * Hq * (4 * Dh * Dh + 2 * Dh * min(256, d["seq"]))


def row(name, r):
    if "error" in r:
        return f"{name:26} {r.get('gpus', ''):>4} {r.get('seq', ''):>7}  {r['error']}"
    layers = " ".join(f"{x:.2f}" for x in r["busiest_per_layer"])
    return (f"{name:26} {r['gpus']:>4} {r['seq']:>7} {r['tokens_per_gpu_s']:11.0f} {100 * r['mfu']:5.1f}% "
            f"{r['memory_gib']:8.2f} {r['busiest_worst']:8.2f} {r['busiest_mean']:6.2f} {r['skip_mean']:5.2f}  {layers}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--out", default="out/bench_cp")
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the model's 8)")
    ap.add_argument("--seq", type=int, default=32768, help="the context-parallel sequence")
    ap.add_argument("--short", type=int, default=4096, help="the data-parallel sequence")
    ap.add_argument("--degree", type=int, default=2, help="the context-parallel degree C (GPUs of the C-rank rows)")
    ap.add_argument("--longest", action="store_true", help="also probe the longest sequence on 1 and C GPUs")
    ap.add_argument("--lengths", default="32768,65536,131072", help="--longest's sequence lengths")
    ap.add_argument("--longest-recompute", default="none,full",
                    help="--longest's recompute modes, a comma list of none, full (e.g. full alone at lengths "
                         "only full recompute can fit)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lr", type=float, default=3e-5,
                    help="learning rate (3e-5: the routers stay spread over the classes on random tokens; the model "
                         "script's 3e-4 collapses them onto one class within a few steps)")
    ap.add_argument("--bias-rate", type=float, default=zaya_vs_torch.BIAS_RATE, help="selection-bias rate")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (a check of this script, not a measurement)")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--run-timeout", type=int, default=900)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra keel --set, both configs")
    ap.add_argument("--hybrid", action="store_true", help="LASP-2H: 3 of every 4 layers linear attention")
    ap.add_argument("--modes", default="allgather",
                    help="context modes of the CP=2 run, a comma list of allgather, ring, alltoall (each timed; "
                         "the others' tokens/s against the all-gather's printed)")
    ap.add_argument("--peer", action="store_true",
                    help="also keel and PyTorch's context parallelism (bench/train_cp_torch.py under torchrun) on the "
                         "GQA model of the same widths: CP=2 at --seq and DP=2 at --short")
    ap.add_argument("--only-peer", action="store_true", help="--peer's four runs alone")
    ap.add_argument("--forced-balance", action="store_true",
                    help="benchmarking only: token n -> expert n mod E in every run (keel: router.forced_balance)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs the peer (torchrun)")
    ap.add_argument("--lasp", action="store_true",
                    help="LASP-2 against LASP-1 (ring) and the all-to-all at CP=2 over --lengths, every layer linear attention")
    a = ap.parse_args()
    if a.hybrid and a.lasp:
        sys.exit("--hybrid and --lasp: choose one (LASP-1's ring on GPUs needs every layer linear)")
    if a.hybrid:
        a.sets += HYBRID
    if a.lasp:
        a.sets += LINEAR
    lengths = [int(x) for x in a.lengths.split(",")]
    a.max_seq = max([a.seq, a.short] + lengths)
    os.makedirs(a.out, exist_ok=True)
    d = zaya_vs_torch.TINY if a.tiny else zaya_vs_torch.ZAYA8
    prefix = os.path.join(a.out, "tokens")
    rng = np.random.default_rng(0)
    nrows = max(64, 4 * (a.steps + a.warmup + 2))
    zaya_vs_torch.write_dataset(prefix, rng.integers(0, d["vocab"], size=(nrows, a.max_seq + 1), dtype=np.uint64))
    results = {}
    if a.lasp:
        return lasp(a, prefix, lengths, results)
    C = a.degree
    per_gpu = a.seq // C  # tokens per GPU per step of the CP run
    mb = 2 if per_gpu >= 2 * a.short else 1
    accum = max(1, per_gpu // (mb * a.short)) * C  # over the C GPUs
    cp_name, dp_name = f"CP={C} {a.seq}", f"DP={C} {a.short}"
    modes = a.modes.split(",")
    for m in modes:
        if m not in ("allgather", "ring", "alltoall"):
            sys.exit(f"--modes: '{m}' is not allgather, ring or alltoall")
    peer_lines = []
    if a.only_peer:
        modes = []
    for m in modes:
        name = cp_name if m == "allgather" else f"CP={C} {a.seq} {m}"
        results[name] = run(a, a.out, prefix, f"cp{C}" if m == "allgather" else f"cp{C}_{m}", C,
                            {"context": C, "context_mode": m}, a.seq, 1, 1)
    if not a.only_peer:
        results[dp_name] = run(a, a.out, prefix, f"dp{C}", C, {"data": C}, a.short, mb, accum)
    if a.peer or a.only_peer:
        peer_lines = peer(a, prefix, results, per_gpu, mb, accum)
    if a.longest:
        for rc in a.longest_recompute.split(","):
            if rc not in ("none", "full"):
                sys.exit(f"--longest-recompute: '{rc}' is not none or full")
            for gpus in (1, C):
                for L in lengths:
                    name = f"{f'CP={C}' if gpus == C else '1 GPU'} {L} recompute {rc}"
                    r = run(a, a.out, prefix, name, gpus, {"context": C} if gpus == C else {}, L, 1, 1, rc, steps=3,
                            warmup=2)
                    results[name] = r
                    if "error" in r:
                        break
    json.dump(results, open(os.path.join(a.out, "train_cp.json"), "w"), indent=1)
    model = "ZAYA1-shaped hybrid, 3 of 4 layers linear (LASP-2H)" if a.hybrid else "ZAYA1-shaped"
    lines = [f"== keel context parallelism ({'tiny, ' if a.tiny else ''}{model}, {a.device}); same tokens per GPU "
             f"per step ({per_gpu}); {a.steps} timed steps after {a.warmup}",
             f"{'config':26} {'GPUs':>4} {'seq':>7} {'tok/s/GPU':>11} {'MFU':>6} {'GiB/GPU':>8} {'busiest':>8} "
             f"{'(mean)':>6} {'skip':>5}  per-layer busiest/fair"]
    lines += [row(n, r) for n, r in results.items()]
    cp, dp = results.get(cp_name, {}), results.get(dp_name, {})
    for m in modes:
        other = results.get(f"CP={C} {a.seq} {m}", {})
        if m != "allgather" and "tokens_per_s" in other and "tokens_per_s" in cp:
            lines.append(f"CP={C} at {a.seq}: {m} / all-gather tokens/s = {other['tokens_per_s'] / cp['tokens_per_s']:.3f}")
    if "tokens_per_s" in cp and "tokens_per_s" in dp:
        ratio = cp["tokens_per_s"] / dp["tokens_per_s"]
        lines.append(f"target: CP={C} at {a.seq} / DP={C} at {a.short} tokens/s per GPU = {ratio:.3f} (>= 0.95: "
                     f"{'met' if ratio >= 0.95 else 'NOT met'}); MFU {100 * cp['mfu']:.1f}% vs {100 * dp['mfu']:.1f}%")
        # the most the ratio can be at equal MFU: the model FLOPs per token of each length
        f_long = flops_per_token(dims(a, a.seq, 1), a.hybrid, a.lasp)
        f_short = flops_per_token(dims(a, a.short, mb), a.hybrid, a.lasp)
        lines.append(f"at equal MFU the ratio is at most {f_short / f_long:.3f}: {f_long / 1e9:.3g} against "
                     f"{f_short / 1e9:.3g} GFLOP per token (attention's grow with the sequence); measured "
                     f"{ratio / (f_short / f_long):.3f} of that")
    lines += peer_lines
    lines.append("busiest: the busiest class over its fair share, worst MoE layer and step after warm-up (mean over "
                 "steps); skip: mean skip share; GiB/GPU: keel's device arenas, rank 0 (torch rows: "
                 "max_memory_allocated, the largest rank)")
    print("\n".join(lines))


def lasp(a, prefix, lengths, results):
    """--lasp: CP=C, LASP-2 and LASP-1 at each length; the table and their ratio last."""
    C = a.degree
    for L in lengths:
        for mode, label in (("allgather", "LASP-2"), ("ring", "LASP-1"), ("alltoall", "all-to-all")):
            results[f"CP={C} {L} {label}"] = run(a, a.out, prefix, f"cp{C}_{L}_{mode}", C,
                                                 {"context": C, "context_mode": mode}, L, 1, 1)
    json.dump(results, open(os.path.join(a.out, "train_cp.json"), "w"), indent=1)
    lines = [f"== keel context parallelism, LASP-2 vs LASP-1 and all-to-all ({'tiny, ' if a.tiny else ''}ZAYA1-shaped, every layer "
             f"linear attention, RetNet decay; {a.device}); one sequence per step over {C} ranks; {a.steps} timed steps "
             f"after {a.warmup}",
             f"{'config':26} {'GPUs':>4} {'seq':>7} {'tok/s/GPU':>11} {'MFU':>6} {'GiB/GPU':>8} {'busiest':>8} "
             f"{'(mean)':>6} {'skip':>5}  per-layer busiest/fair"]
    lines += [row(n, r) for n, r in results.items()]
    for L in lengths:
        two, one = results[f"CP={C} {L} LASP-2"], results[f"CP={C} {L} LASP-1"]
        if "tokens_per_s" in two and "tokens_per_s" in one:
            ratio = two["tokens_per_s"] / one["tokens_per_s"]
            target = f" (target at the longest, >= 1.15: {'met' if ratio >= 1.15 else 'NOT met'})" if L == lengths[-1] else ""
            lines.append(f"LASP-2 / LASP-1 at {L}: {ratio:.3f}{target}")
        a2a = results[f"CP={C} {L} all-to-all"]
        if "tokens_per_s" in two and "tokens_per_s" in a2a:
            lines.append(f"LASP-2 / all-to-all at {L}: {two['tokens_per_s'] / a2a['tokens_per_s']:.3f}")
    lines.append("busiest: the busiest class over its fair share, worst MoE layer and step after warm-up (mean over "
                 "steps); skip: mean skip share; GiB/GPU: keel's device arenas, rank 0")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
