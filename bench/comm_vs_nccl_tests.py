#!/usr/bin/env python3
"""keel bench comm beside NVIDIA nccl-tests, on the same GPUs in the same run.

Both run as one process driving n GPUs (nccl-tests -g n; keel with no launcher and
--ranks n), bf16, sum, the same sizes, warm-up and iterations, results checked by both.
Prints, per op and GPU count, keel's busbw over nccl-tests' at every size >= 64 MiB
(target: within 2%), and the small-message all-reduce latency in CUDA-graph mode against
nccl-tests -G. nccl-tests is fetched beside keel (.peer/nccl-tests), never committed.
"""
import argparse
import json
import os
import statistics
import time
import subprocess
import sys

OPS = {  # keel op -> nccl-tests binary
    "all_reduce": "all_reduce_perf",
    "all_gather": "all_gather_perf",
    "reduce_scatter": "reduce_scatter_perf",
    "broadcast": "broadcast_perf",
    "all_to_all": "alltoall_perf",
}


FAILED = []


def run(cmd, log, timeout=480):
    """Runs one benchmark command, appending its output to `log`; a failure or a hang is
    recorded and reported at the end instead of stopping the comparison."""
    print("+", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        f.write("+ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            ok = r.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
    if not ok:
        FAILED.append(" ".join(cmd))
        print(f"FAILED: {' '.join(cmd)} (see {log})", flush=True)
    return ok


def build_nccl_tests(src):
    if os.path.exists(os.path.join(src, "build", "all_reduce_perf")):
        return
    nproc = str(os.cpu_count() or 8)
    cmd = ["make", "-C", src, "-j", nproc, "MPI=0", "CUDA_HOME=/usr/local/cuda", "NCCL_HOME=/usr",
           "NVCC_GENCODE=-gencode=arch=compute_90,code=sm_90"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def nccl_rows(path):
    doc = json.load(open(path))
    return [(r["size"], r.get("out_of_place"), r.get("in_place")) for r in doc["results"]]


def keel_rows(path):
    doc = json.load(open(path))
    out = {}
    for r in doc["results"]:
        out[(r["op"], r["ranks"], r["size_bytes"])] = (r["out_of_place"], r["in_place"])
    wrong = doc["wrong_values"]
    return out, wrong


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", required=True)
    ap.add_argument("--nccl-tests", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", default=None, help="GPU counts, default 2,4,8 up to the GPUs present")
    ap.add_argument("--min", default="64M")
    ap.add_argument("--max", default="8G")
    ap.add_argument("--iters", default="20")
    ap.add_argument("--warmup", default="5")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--latency-only", action="store_true", help="only the small-message latency comparison")
    ap.add_argument("--latency-ops", default="all_reduce,all_gather,reduce_scatter,broadcast,all_to_all",
                    help="ops for the CUDA-graph latency comparison")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no new bandwidth run after this many seconds (0: no limit); points keep the "
                         "repeats they got")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each tool per point; the median is compared")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "comm_runs.log")
    open(log, "w").close()
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    gpus = sum(1 for line in listing.splitlines() if line.startswith("GPU"))
    ranks = [int(x) for x in (args.ranks or ",".join(str(n) for n in (2, 4, 8) if n <= gpus)).split(",")]
    ops = [] if args.latency_only else args.ops.split(",")
    build_nccl_tests(args.nccl_tests)
    bindir = os.path.join(args.nccl_tests, "build")
    common = ["-b", args.min, "-e", args.max, "-f", "2", "-w", args.warmup, "-n", args.iters]

    # Per (op, GPU count): keel then nccl-tests, back to back, `--repeat` times; each point's
    # busbw is the median over the repeats, so a single noisy run does not decide a ratio.
    samples = {"keel": {}, "nccl": {}}
    keel_wrong = 0
    started = time.monotonic()
    cut_short = False
    for rep in range(args.repeat):
        for op in ops:
            for n in ranks:
                if args.budget_s and time.monotonic() - started > args.budget_s:
                    cut_short = True
                    break
                def run_keel():
                    nonlocal keel_wrong
                    kj = os.path.join(args.out, f"keel_{op}_{n}_r{rep}.json")
                    plot = ["--plot", os.path.join(args.out, f"keel_{op}_{n}.png")] if rep == 0 else []
                    if run([args.keel, "bench", "comm", "--op", op, "--dtype", "bf16", "--ranks", str(n), *common,
                            "--timeout", "120", "--json", kj, *plot], log):
                        rows, wrong = keel_rows(kj)
                        keel_wrong += wrong
                        for (_, _, size), (oop, ip) in rows.items():
                            for place, r in (("out", oop), ("in", ip)):
                                if r:
                                    samples["keel"].setdefault((op, n, size, place), []).append(r["busbw_gbps"])

                def run_nccl():
                    nj = os.path.join(args.out, f"nccl_{op}_{n}_r{rep}.json")
                    if run([os.path.join(bindir, OPS[op]), "-g", str(n), "-d", "bfloat16", *common, "-c", "1", "-J",
                            nj], log):
                        for size, oop, ip in nccl_rows(nj):
                            for place, r in (("out", oop), ("in", ip)):
                                if r and (r.get("nwrong") is not None or place == "out"):
                                    samples["nccl"].setdefault((op, n, size, place), []).append(r["bus_bw"])

                # Alternate which tool goes first, so an order effect (clocks, caches) cancels.
                for tool in ((run_keel, run_nccl) if rep % 2 == 0 else (run_nccl, run_keel)):
                    tool()

    table = []
    worst = 9.9
    min_reps = args.repeat
    order = {op: i for i, op in enumerate(ops)}
    common_keys = sorted(samples["keel"].keys() & samples["nccl"].keys(),
                         key=lambda k: (order[k[0]], k[1], k[2], k[3] != "out"))
    for key in common_keys:
        reps = min(len(samples["keel"][key]), len(samples["nccl"][key]))
        kb = statistics.median(samples["keel"][key])
        nb = statistics.median(samples["nccl"][key])
        ratio = kb / nb if nb > 0 else float("nan")
        worst = min(worst, ratio)
        table.append((*key, kb, nb, ratio))
        min_reps = min(min_reps, reps)

    # Small-message latency: CUDA graph replay on every GPU for each op (8 B, or the smallest size
    # that splits over the ranks, up to 64 KiB), and the host loop for an 8 B all-reduce.
    nmax = max(ranks)
    lat_ops = args.latency_ops.split(",")
    lat = []
    for op in lat_ops:
        first = "8" if op in ("all_reduce", "broadcast") else str(2 * nmax)
        lat_keel = os.path.join(args.out, f"keel_latency_{op}.json")
        run([args.keel, "bench", "comm", "--op", op, "--dtype", "bf16", "--ranks", str(nmax), "-b", first,
             "-e", "64K", "-f", "2", "-w", "20", "-n", "20", "-G", "50", "--placement", "out", "--timeout", "30",
             "--json", lat_keel], log, timeout=120)
        lat_nccl = os.path.join(args.out, f"nccl_latency_{op}.json")
        run([os.path.join(bindir, OPS[op]), "-g", str(nmax), "-d", "bfloat16", "-b", first, "-e", "64K", "-f", "2",
             "-w", "20", "-n", "20", "-G", "50", "-c", "1", "-J", lat_nccl], log, timeout=120)
        kl = keel_rows(lat_keel)[0] if os.path.exists(lat_keel) else {}
        for size, n_oop, _ in (nccl_rows(lat_nccl) if os.path.exists(lat_nccl) else []):
            k = kl.get((op, nmax, size))
            if k and k[0] and n_oop:
                lat.append((op, size, k[0]["time_us"], n_oop["time"], k[0]["time_us"] / n_oop["time"]))
    lat_keel_host = os.path.join(args.out, "keel_latency_host.json")
    run([args.keel, "bench", "comm", "--op", "all_reduce", "--dtype", "bf16", "--ranks", str(nmax), "-b", "8",
         "-e", "8", "-w", "20", "-n", "100", "--placement", "out", "--timeout", "30", "--json", lat_keel_host], log,
        timeout=120)
    lat_nccl_host = os.path.join(args.out, "nccl_latency_host.json")
    run([os.path.join(bindir, "all_reduce_perf"), "-g", str(nmax), "-d", "bfloat16", "-b", "8", "-e", "8",
         "-w", "20", "-n", "100", "-c", "1", "-J", lat_nccl_host], log)
    kh = keel_rows(lat_keel_host)[0] if os.path.exists(lat_keel_host) else {}
    host8 = (kh[("all_reduce", nmax, 8)][0]["time_us"] if kh else float("nan"),
             nccl_rows(lat_nccl_host)[0][1]["time"] if os.path.exists(lat_nccl_host) else float("nan"))

    def gib(s):
        return f"{s / 2**30:g} GiB" if s >= 2**30 else f"{s / 2**20:g} MiB"

    print(f"\n== bench comm vs nccl-tests (busbw GB/s, bf16 sum, 1 process x n GPUs, median of {args.repeat} run(s) "
          "each, same machine)")
    if cut_short:
        print(f"(--budget-s {args.budget_s:g} reached: some points have only {min_reps} run(s) of each tool)")
    print(f"{'op':<15}{'n':>3} {'size':>9} {'place':>5} {'keel':>8} {'nccl-t':>8} {'ratio':>7}")
    for op, n, size, place, kb, nb, r in table:
        if size in (64 << 20, 1 << 30, 8 << 30) or r < 0.98:
            print(f"{op:<15}{n:>3} {gib(size):>9} {place:>5} {kb:8.1f} {nb:8.1f} {r:7.3f}")
    if table:
        ratios = [t[-1] for t in table]
        print(f"{len(table)} points >= {args.min}: median ratio {statistics.median(ratios):.3f}, worst {worst:.3f}, "
              f"{sum(1 for r in ratios if r < 0.98)} below 0.98 ({'meets' if worst >= 0.98 else 'MISSES'} the 2% target "
              f"at every point); keel wrong values: {keel_wrong}")
    print(f"\n== latency on {nmax} GPUs, CUDA graph (-G 50), us; ratio keel/nccl-tests (<= 1 is no worse)")
    print(f"{'op':<15}{'size':>8} {'keel':>8} {'nccl-t':>8} {'ratio':>7}")
    for op, size, k, nt, r in lat:
        if size in (8, 2 * nmax, 1024, 65536) or r > 1.0:
            print(f"{op:<15}{size:>8} {k:8.2f} {nt:8.2f} {r:7.3f}")
    for op in lat_ops:
        rs = [r for o, _, _, _, r in lat if o == op]
        if rs:
            print(f"{op}: {len(rs)} sizes, median ratio {statistics.median(rs):.3f}, worst {max(rs):.3f}")
    print(f"8 B all_reduce, host-timed loop (no graph): keel {host8[0]:.2f} us, nccl-tests {host8[1]:.2f} us")
    for f in FAILED:
        print(f"FAILED: {f}")
    json.dump({"busbw": table, "latency": lat, "host8": host8}, open(os.path.join(args.out, "comm_compare.json"), "w"))


if __name__ == "__main__":
    main()
