#!/usr/bin/env bash
# Runs `keel bench comm` with --json/--csv/--plot on 2 CPU ranks and checks what it wrote:
# the JSON parses and carries the schema, environment, devices and every row; the CSV has a
# row per measured placement; each PNG is a real PNG.
set -euo pipefail
keel=$1; mpiexec=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
NCCL_DEBUG=WARN "$mpiexec" --oversubscribe -n 2 "$keel" bench comm --backend mpi --op all_reduce,all_gather \
  --ranks 2 --min 64 --max 4K --factor 4 -w 1 -n 3 \
  --json "$dir/r.json" --csv "$dir/r.csv" --plot "$dir/p.png" >"$dir/stdout"
python3 - "$dir" <<'PY'
import json, sys, os, glob
d = sys.argv[1]
doc = json.load(open(os.path.join(d, "r.json")))
assert doc["schema"] == "keel.bench.comm/1", doc["schema"]
assert doc["backend"] == "mpi" and doc["world_size"] == 2
assert doc["env"].get("NCCL_DEBUG") == "WARN", "NCCL_* variables must be recorded"
assert len(doc["devices"]) == 2 and {x["rank"] for x in doc["devices"]} == {0, 1}
assert "mpi" in doc["libraries"]
rows = doc["results"]
# 2 ops x 4 sizes (64, 256, 1K, 4K)
assert len(rows) == 8, len(rows)
for r in rows:
    for p in ("out_of_place", "in_place"):
        x = r[p]
        assert x["wrong"] == 0 and x["time_us"] > 0
        f = {"all_reduce": 2 * (r["ranks"] - 1) / r["ranks"], "all_gather": (r["ranks"] - 1) / r["ranks"]}[r["op"]]
        assert abs(x["busbw_gbps"] - x["algbw_gbps"] * f) < 1e-9 * max(1, x["algbw_gbps"])
        assert abs(x["algbw_gbps"] - r["size_bytes"] / (x["time_us"] * 1e3)) < 1e-6 * x["algbw_gbps"] + 1e-12
csv = open(os.path.join(d, "r.csv")).read().strip().splitlines()
assert csv[0].startswith("op,dtype,redop,ranks,group,groups,size_bytes")
assert len(csv) == 1 + 16, len(csv)
pngs = sorted(glob.glob(os.path.join(d, "p_*.png")))
assert len(pngs) == 4, pngs   # (all_reduce, all_gather) x (out, in)
for p in pngs:
    assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n", p
print("outputs ok")
PY
