#!/usr/bin/env python3
"""keel bench mem / gemm against PyTorch on the same GPU, in one run.

    python3 bench/mem_gemm_vs_torch.py --keel build/keel --out out/ [--quick]

Memory: keel's copy, triad (SM kernels) and memcpy (copy engine) on 2 GiB fp32 arrays against
PyTorch's b.copy_(a) and torch.add(b, c, alpha=s, out=a), both counted the BabelStream way
(bytes read + bytes written over the best time), both timed with CUDA events.

GEMM: keel bench gemm runs the shape set (bf16 8192^3; the layer GEMMs of ZAYA1-8B at 16K tokens,
forward and both backward passes; the SwiGLU widths 10922 and 10944 at hidden 4096) and writes
JSON; then each keel row is timed again through torch.matmul (torch.bmm for batched expert GEMMs)
with the same shape, operand layout and dtype, the same rotation through operand sets larger than
L2, and the same timing (launches queued behind a sleep kernel, one CUDA event between runs,
median). The verdict is the median over rows of keel TFLOP/s / torch TFLOP/s.

Prints a table last, beginning with "== bench mem/gemm vs PyTorch", and writes
mem_gemm_vs_torch.json and .md to --out.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

SCALAR = 0.4  # BabelStream's


def log(msg):
    print(msg, flush=True)


def run_keel(cmd, log_path):
    log("$ " + " ".join(cmd))
    with open(log_path, "w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        f.write(p.stdout)
    tail = "\n".join(p.stdout.splitlines()[-25:])
    log(tail)
    if p.returncode != 0:
        raise SystemExit(f"keel exited {p.returncode}: see {log_path}")


# ---------------------------------------------------------------- memory
def torch_stream(array_bytes, iters, warmup):
    n = array_bytes // 4
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.rand(n, device="cuda", generator=g) * 0.5 + 0.5
    b = torch.rand(n, device="cuda", generator=g) * 0.5 + 0.5
    c = torch.rand(n, device="cuda", generator=g) * 0.5 + 0.5
    ops = {
        "copy": (lambda: b.copy_(a), 2),
        "triad": (lambda: torch.add(b, c, alpha=SCALAR, out=a), 3),
    }
    out = {}
    for name, (fn, arrays) in ops.items():
        for _ in range(warmup):
            fn()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        torch.cuda.synchronize()
        ev[0].record()
        for i in range(iters):
            fn()
            ev[i + 1].record()
        torch.cuda.synchronize()
        times = [ev[i].elapsed_time(ev[i + 1]) * 1e-3 for i in range(iters)]
        moved = arrays * n * 4
        out[name] = {"gbps": moved / min(times) / 1e9, "gbps_median": moved / statistics.median(times) / 1e9}
    # Check: triad's result against its definition (a = b + s*c with the current b and c).
    torch.add(b, c, alpha=SCALAR, out=a)
    err = (a - (b + SCALAR * c)).abs().max().item()
    assert err < 1e-5, f"torch triad wrong by {err}"
    del a, b, c
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- GEMM
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}


def torch_gemm(row, iters, warmup, l2_bytes):
    """Median TFLOP/s of torch.matmul on keel's row (same shape, layout, dtype, rotation)."""
    m, n, k, batch, layout, dtype = row["m"], row["n"], row["k"], row["batch"], row["layout"], row["dtype"]
    if dtype not in DTYPES:
        return None
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    dt = DTYPES[dtype]
    es = torch.finfo(dt).bits // 8
    set_bytes = (m * k + k * n + m * n) * batch * es
    sets = max(1, math.ceil(4 * l2_bytes / set_bytes))
    free, _ = torch.cuda.mem_get_info()
    sets = max(1, min(sets, int((free - (2 << 30)) // set_bytes)))
    a_shape = (k, m) if layout[0] == "t" else (m, k)
    b_shape = (n, k) if layout[1] == "t" else (k, n)
    if batch > 1:
        a_shape, b_shape = (batch,) + a_shape, (batch,) + b_shape
    operands = []
    for s in range(sets):
        g = torch.Generator(device="cuda").manual_seed(1000 + s)
        a = torch.rand(a_shape, device="cuda", generator=g, dtype=torch.float32).mul_(2).sub_(1).to(dt)
        b = torch.rand(b_shape, device="cuda", generator=g, dtype=torch.float32).mul_(2).sub_(1).to(dt)
        a = a.transpose(-1, -2) if layout[0] == "t" else a
        b = b.transpose(-1, -2) if layout[1] == "t" else b
        c = torch.empty((batch, m, n) if batch > 1 else (m, n), device="cuda", dtype=dt)
        operands.append((a, b, c))
    fn = (lambda a, b, c: torch.bmm(a, b, out=c)) if batch > 1 else (lambda a, b, c: torch.matmul(a, b, out=c))
    for i in range(max(warmup, 1)):
        fn(*operands[i % sets])
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda.synchronize()
    torch.cuda._sleep(int(min(iters * 200_000, 100_000_000)))  # hold the stream (~0.1 ms a run) while launches queue
    ev[0].record()
    for i in range(iters):
        fn(*operands[(i + warmup) % sets])
        ev[i + 1].record()
    torch.cuda.synchronize()
    times = sorted(ev[i].elapsed_time(ev[i + 1]) * 1e-3 for i in range(iters))
    # Spot-check one output against float64.
    a, b, c = operands[0]
    fn(a, b, c)
    i, j = m // 2, n // 3
    a0 = (a[0] if batch > 1 else a)[i].double()
    b0 = (b[0] if batch > 1 else b)[:, j].double()
    ref = float(a0 @ b0)
    got = float((c[0] if batch > 1 else c)[i, j])
    tol = 0.02 * abs(ref) + 1e-2 * math.sqrt(k)
    assert abs(got - ref) <= tol, f"torch {m}x{n}x{k} {dtype}: got {got}, expected {ref}"
    del operands
    torch.cuda.empty_cache()
    flops = 2.0 * m * n * k * batch
    return flops / statistics.median(times) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and iterations (smoke test)")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to PyTorch")
    prop = torch.cuda.get_device_properties(0)
    l2 = prop.L2_cache_size
    log(f"# {prop.name}, {prop.multi_processor_count} SMs, L2 {l2 >> 20} MiB; torch {torch.__version__}, "
        f"cuBLAS {torch.backends.cuda.preferred_blas_library()}")
    keel = os.path.abspath(args.keel)
    t0 = time.time()

    # ---- memory
    size = "256M" if args.quick else "2G"
    array_bytes = (256 << 20) if args.quick else (2 << 30)
    mem_rows = []
    try:  # a failure here must not cost the GEMM comparison
        mem_json = os.path.join(args.out, "keel_mem.json")
        run_keel([keel, "bench", "mem", "--backend", "cuda", "--op", "copy,triad,memcpy", "--dtype", "fp32", "-b", size,
                  "-e", size, "-n", "50", "--json", mem_json], os.path.join(args.out, "keel_mem.log"))
        keel_mem = {r["kernel"]: r for r in json.load(open(mem_json))["results"]}
        tmem = torch_stream(array_bytes, 50, 5)
        mem_rows = []
        for kname, tname in (("copy", "copy"), ("memcpy", "copy"), ("triad", "triad")):
            k, t = keel_mem[kname], tmem[tname]
            mem_rows.append({"keel": kname, "torch": "b.copy_(a)" if tname == "copy" else "torch.add(b, c, alpha=s, out=a)",
                             "keel_gbps": k["gbps"], "torch_gbps": t["gbps"], "keel_gbps_median": k["gbps_median"],
                             "torch_gbps_median": t["gbps_median"], "ratio": k["gbps"] / t["gbps"],
                             "launch": k.get("launch", "")})
    except (SystemExit, Exception) as e:  # noqa: BLE001
        log(f"memory comparison failed: {e}")

    # ---- GEMM
    gemm_rows = []
    cache = os.path.join(args.out, "gemm_tune.json")
    common = [keel, "bench", "gemm", "--backend", "cuda", "--dtype", "bf16", "--iters", str(args.iters),
              "--tune-cache", cache, "--retune"]
    sets = [("square", ["--shapes", "8192x8192x8192", "--layout", "nn"]),
            ("mlp_width", ["--shapes", "16384x10922x4096,16384x10944x4096,16384x4096x10922,16384x4096x10944",
                           "--layout", "nt"])]
    model = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "zaya1-8b.yaml")
    if args.quick:
        sets.append(("zaya1_layer", ["--model", model, "--step-tokens", "16384", "--forward-only"]))
    else:
        sets.append(("zaya1_layer", ["--model", model, "--step-tokens", "16384"]))
    for tag, extra in sets:
        path = os.path.join(args.out, f"keel_gemm_{tag}.json")
        run_keel(common + extra + ["--json", path], os.path.join(args.out, f"keel_gemm_{tag}.log"))
        for r in json.load(open(path))["results"]:
            if r.get("skipped"):
                continue
            tt = torch_gemm(r, args.iters, 5, l2)
            label = f"{r['name']} {r['pass']}".strip() or tag
            gemm_rows.append({"set": tag, "label": label, "m": r["m"], "n": r["n"], "k": r["k"], "batch": r["batch"],
                              "layout": r["layout"], "dtype": r["dtype"], "keel_tflops": r["tflops"],
                              "torch_tflops": tt, "ratio": r["tflops"] / tt if tt else None,
                              "algo": r["algo"]["description"], "tuned": f"{r['algo']['chosen_rank'] + 1}/{r['algo']['candidates']}",
                              "waves": r.get("waves"), "tile_waste": r.get("tile_waste")})

    ratios = [g["ratio"] for g in gemm_rows if g["ratio"]]
    median_ratio = statistics.median(ratios) if ratios else float("nan")
    doc = {"device": prop.name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
           "mem": mem_rows, "gemm": gemm_rows, "gemm_median_ratio": median_ratio, "seconds": time.time() - t0}
    json.dump(doc, open(os.path.join(args.out, "mem_gemm_vs_torch.json"), "w"), indent=2)

    lines = [f"== bench mem/gemm vs PyTorch ({prop.name}, torch {torch.__version__}, {doc['date']})",
             "memory (fp32, %s arrays; GB/s = bytes read + written / best time):" % size,
             f"  {'keel':8} {'torch':34} {'keel':>8} {'torch':>8} {'ratio':>6}   (median-time GB/s: keel / torch)"]
    for r in mem_rows:
        verdict = "ok" if r["ratio"] >= 0.97 else "BEHIND"
        lines.append(f"  {r['keel']:8} {r['torch']:34} {r['keel_gbps']:8.0f} {r['torch_gbps']:8.0f} {r['ratio']:6.3f}"
                     f"   ({r['keel_gbps_median']:.0f} / {r['torch_gbps_median']:.0f}) {verdict} {r['launch']}")
    lines.append("gemm (bf16 TFLOP/s, median of %d runs, operands rotated out of L2):" % args.iters)
    lines.append(f"  {'gemm':24} {'m':>6} {'n':>7} {'k':>6} {'b':>3} {'lay':3} {'keel':>7} {'torch':>7} {'ratio':>6}  tuned waves")
    for g in gemm_rows:
        waves = f"{g['waves']:.2f}" if g["waves"] is not None else "-"
        lines.append(f"  {g['label'][:24]:24} {g['m']:6d} {g['n']:7d} {g['k']:6d} {g['batch']:3d} {g['layout']:3} "
                     f"{g['keel_tflops']:7.1f} {g['torch_tflops'] or float('nan'):7.1f} {g['ratio'] or float('nan'):6.3f}"
                     f"  {g['tuned']:>5} {waves}")
    lines.append(f"  median ratio keel/torch over {len(ratios)} GEMMs: {median_ratio:.3f} "
                 f"({'>= 1.0 ok' if median_ratio >= 1.0 else 'BEHIND'})")
    lines.append(f"  ({time.time() - t0:.0f} s)")
    text = "\n".join(lines)
    open(os.path.join(args.out, "mem_gemm_vs_torch.md"), "w").write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
