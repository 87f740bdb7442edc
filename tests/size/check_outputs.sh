#!/usr/bin/env bash
# keel size --json/--plot: the JSON parses back with the numbers the report printed, the
# PNG is a PNG, and a measured `keel bench` profile changes the prediction.
set -eu
keel=$1; cfg=$2
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
"$keel" size "$cfg/zaya1-8b.yaml" --seq 4096 --hardware mi300x --gpus 1024 --train-tokens 12T --micro-batch 4 \
  --moe-study --moe-experts 8,16,32 --moe-top-k 1,2 --json "$dir/size.json" --plot "$dir/moe.png" > "$dir/out.txt"
head -c 8 "$dir/moe.png" | od -An -c | grep -q 'P   N   G' || { echo "moe.png is not a PNG"; exit 1; }
cat > "$dir/gemm.json" <<'JSON'
{"schema": "keel.bench.gemm/1", "devices": [{"name": "AMD Instinct MI300X", "sm_count": 304}],
 "results": [{"m": 16384, "n": 4096, "k": 2048, "dtype": "bf16", "tflops": 300.0},
             {"m": 1024, "n": 4096, "k": 2048, "batch": 16, "dtype": "bf16", "tflops": 250.0},
             {"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "tflops": 600.0}]}
JSON
cat > "$dir/mem.json" <<'JSON'
{"schema": "keel.bench.mem/1", "devices": [{"name": "AMD Instinct MI300X"}],
 "results": [{"kernel": "copy", "bytes": 1073741824, "gbps": 4150.0}, {"kernel": "triad", "bytes": 1073741824, "gbps": 4100.0}]}
JSON
"$keel" size "$cfg/zaya1-8b.yaml" --seq 4096 --hardware "$dir/gemm.json,$dir/mem.json" --gpus 1024 --train-tokens 12T --micro-batch 4 \
  --json "$dir/measured.json" > "$dir/measured.txt"
grep -q "measured GEMM profile" "$dir/measured.txt" || { echo "no GEMM profile in the report"; exit 1; }
python3 - "$dir/size.json" "$dir/measured.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["schema"] == "keel.size/1", j["schema"]
p = j["params"]
assert 8.25e9 <= p["total_non_embedding"] < 8.35e9, p
assert abs(p["active_non_embedding"] - 760e6) < 7.6e6, p
assert sum(c["total"] for c in p["components"]) == p["total"]
f = j["flops"]
assert abs(f["training"] - 8.75e9) < 0.01e9, f["training"]
assert abs(f["training"] - 3 * f["forward"]) < 1
m = j["memory"]
assert abs(sum(i["bytes"] for i in m["items"]) - m["total_bytes"]) < 1
assert m["fits"] is True
t = j["training"]
# 12T tokens x FLOPs/token / (1024 GPUs x 1307.4 TFLOP/s x 40%)
want = 12e12 * f["training"] / (1024 * 1307.4e12 * 0.4)
assert abs(t["seconds_at_mfu"] - want) < 1e-6 * want, (t["seconds_at_mfu"], want)
assert j["moe_study"]["rows"] and any(r["current"] for r in j["moe_study"]["rows"])
assert j["inference"]["kv_bytes_per_token"] == 40 * 512 * 2
names = {g["name"] for g in j["step"]["gemms"]}
assert {"q", "k", "v", "attn_out", "router_down", "expert_up_gate", "expert_down", "lm_head"} <= names, names
meas = json.load(open(sys.argv[2]))
assert meas["hardware"]["measured_hbm_tbps"] == 4.15
assert meas["hardware"]["gemm_profile_shapes"] == 3
assert meas["step"]["predicted_mfu"] != j["step"]["predicted_mfu"]
assert any(g["source"].startswith("profile") for g in meas["step"]["gemms"])
print("ok")
PY
