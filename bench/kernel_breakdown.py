#!/usr/bin/env python3
"""Where a command's GPU time goes, kernel by kernel, through Nsight Compute.

    python3 bench/kernel_breakdown.py [--top N] [--match REGEX] [--by-grid] -- build-gpu/keel train run.yaml

Runs the command under `ncu` measuring only gpu__time_duration per kernel launch (one replay
pass), then prints the kernels grouped by name: launches, total and mean time, share of the
total. Kernels run serialized under ncu, so the times are each kernel alone on the GPU (no
overlap between streams): a breakdown, not a step time.

ncu's defaults would lock the GPU clocks to base (`--clock-control base`); this script passes
`--clock-control none` so the clocks are left as the machine has them.
"""
import argparse
import collections
import csv
import io
import re
import shutil
import subprocess
import sys


def short_name(demangled):
    """`void keel::ops::cuda::rmsnorm::<unnamed>::forward_kernel<1>(const float *, ...)` (ncu's
    spelling of an anonymous namespace; `(anonymous namespace)` elsewhere) -> `rmsnorm::forward_kernel<1>`:
    the namespace tells apart kernels of one name in several ops."""
    name = demangled
    depth = 0
    for i, c in enumerate(name):  # cut the parameter list: the first '(' outside template brackets
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0 and not name.startswith("(anonymous", i):
            name = name[:i]
            break
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    for prefix in ("keel::ops::cuda::", "keel::train::", "keel::"):
        name = name.replace(prefix, "")
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    ap.add_argument("--top", type=int, default=40, help="kernels to print (by total time)")
    ap.add_argument("--match", default="", help="only kernels whose name matches this regex")
    ap.add_argument("--csv", help="also write the grouped table here")
    ap.add_argument("--by-grid", action="store_true",
                    help="group by kernel name and grid size (tells apart launches of one kernel at different sizes)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to profile")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        sys.exit("kernel_breakdown: no command given (put it after --)")
    metrics = "gpu__time_duration.sum" + (",launch__grid_size" if a.by_grid else "")
    prof = [a.ncu, "--clock-control", "none", "--metrics", metrics, "--csv",
            "--print-units", "base", "--print-kernel-base", "demangled"]
    r = subprocess.run(prof + cmd, capture_output=True, text=True)
    text = r.stdout
    start = text.find('"ID"')
    if r.returncode != 0 or start < 0:
        sys.stderr.write(text[-3000:] + r.stderr[-3000:])
        sys.exit(f"kernel_breakdown: ncu exited {r.returncode} with no kernel table")
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    pattern = re.compile(a.match) if a.match else None
    launches = collections.defaultdict(dict)  # launch ID -> {metric: value}, plus its name
    for row in rows:
        launch = launches[row["ID"]]
        launch["name"] = short_name(row["Kernel Name"])
        launch[row.get("Metric Name")] = float(row["Metric Value"].replace(",", ""))
    groups = collections.defaultdict(lambda: [0, 0.0])
    for launch in launches.values():
        name = launch["name"]
        if "gpu__time_duration.sum" not in launch or (pattern and not pattern.search(name)):
            continue
        if a.by_grid:
            name = f"[{int(launch.get('launch__grid_size', 0))}] {name}"
        g = groups[name]
        g[0] += 1
        g[1] += launch["gpu__time_duration.sum"] * 1e-3  # ns -> us
    total = sum(g[1] for g in groups.values())
    order = sorted(groups.items(), key=lambda kv: -kv[1][1])
    print(f"{'kernel':72s} {'launches':>8s} {'total us':>11s} {'mean us':>10s} {'share':>7s}")
    for name, (n, us) in order[:a.top]:
        print(f"{name[:72]:72s} {n:8d} {us:11.1f} {us / n:10.2f} {100 * us / total:6.1f}%")
    print(f"{'all ' + str(len(groups)) + ' kernels':72s} {sum(g[0] for g in groups.values()):8d} {total:11.1f}")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kernel", "launches", "total_us", "mean_us"])
            for name, (n, us) in order:
                w.writerow([name, n, f"{us:.3f}", f"{us / n:.3f}"])


if __name__ == "__main__":
    main()
