#!/usr/bin/env python3
"""keel's checkpoints against PyTorch's torch.distributed.checkpoint (DCP) on the same training
state, in one run on the same GPUs and disk.

keel: `keel train` on the benchmark MoE of bench/train_vs_torch.py (data parallel + ZeRO-1 over G
GPUs) saves one checkpoint mid-run; its stall and background write rate come from keel's log.
Then `keel train --resume` loads it at G ranks and, resharded, at G/2 (time, rate and read
amplification from keel's log).

PyTorch: a state of the same size -- parameters, AdamW exp_avg and exp_avg_sq, fp32, each a 1-D
DTensor of the model's parameter count sharded over G ranks (Shard(0)), random values on the
GPUs -- saved with dcp.save (synchronous: the training stall is the whole save) and
dcp.async_save (the stall is until it returns, or until its staging completes), both with two
writer threads per rank as keel uses; then dcp.load at G ranks and at G/2 (DCP reshards on
load), checked against the saved sums.

Both write to --out on the same disk, one after the other; loads read what was just written (the
page cache may hold it: both sides alike).

  python3 bench/ckpt_vs_dcp.py --keel build-gpu/keel --out /tmp/ckbench --gpus 4

--layers L sizes the model (32 layers: 7.3 B parameters, 88 GB per checkpoint with AdamW); --ep
runs keel with expert parallelism over all GPUs of each launch (parallel.expert = G for the save
and the load, G/2 for the resharded load), which is what lets a model of that size train on
fewer GPUs than 8. The checkpoint holds the same tensors either way (whole [E, ...] expert
tensors), so DCP's side does not change.

At 8 GPUs and 32 layers the whole comparison can outlast one 10-minute device call, so it splits
in two: `--part keel` runs keel's side and writes keel_result.json under --out; `--part dcp
--keel-result FILE` (that file, from the first call) runs DCP's side on the same parameter count
and prints the table. Each phase's wall time is printed as it ends.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- PyTorch worker (under torchrun)

def torch_worker(a):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mesh = init_device_mesh("cuda", (world,))
    if a.numel % world:
        raise SystemExit(f"numel {a.numel} does not split over {world} ranks")
    n_local = a.numel // world
    names = ("param", "exp_avg", "exp_avg_sq")

    def state(fill):
        g = torch.Generator(device="cuda").manual_seed(1234 + rank)
        out = {}
        for i, k in enumerate(names):
            t = torch.empty(n_local, device="cuda", dtype=torch.float32)
            if fill:
                t.normal_(generator=g).mul_(1.0 + i)
            out[k] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
        return out

    def sums(s):
        v = torch.stack([s[k].to_local().double().sum() for k in names])
        dist.all_reduce(v)
        return [float(x) for x in v]

    def writer(path):
        return dcp.FileSystemWriter(path, thread_count=2)

    result = {"world": world, "bytes": 3 * 4 * a.numel}
    if a.mode == "save":
        s = state(True)
        result["sums"] = sums(s)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(s, storage_writer=writer(os.path.join(a.dir, "sync")))
        dist.barrier()
        result["sync_save_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = dcp.async_save(s, storage_writer=writer(os.path.join(a.dir, "async")))
        if hasattr(r, "staging_completion"):  # AsyncSaveResponse: training may go on once staged
            r.staging_completion.result()
            fut = r.upload_completion
        else:
            fut = r
        result["async_stall_s"] = time.perf_counter() - t0
        fut.result()
        dist.barrier()
        result["async_total_s"] = time.perf_counter() - t0
    else:
        s = state(False)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(s, checkpoint_id=os.path.join(a.dir, "sync"))
        torch.cuda.synchronize()
        dist.barrier()
        result["load_s"] = time.perf_counter() - t0
        result["sums"] = sums(s)
    if rank == 0:
        json.dump(result, open(a.result, "w"))
    dist.destroy_process_group()


# ---------------------------------------------------------------- the run

def sh(cmd, log, timeout, env=None):
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    text = open(log).read()
    if r.returncode != 0:
        print(text[-3000:])
        raise SystemExit(f"failed (exit {r.returncode}): {' '.join(cmd)}")
    return text


def run_keel(a, d, g, half, env, phase):
    """keel's side: train 14 steps saving at step 10 (written while steps 11-14 run), then resume
    from it at g ranks and at half. Returns (measurements, parameter count)."""
    import numpy as np
    from train_vs_torch import keel_config, write_dataset

    ep = (lambda n: ["--set", f"parallel.expert={n}"]) if a.ep else (lambda n: [])
    prefix = os.path.join(a.out, "tokens")
    rng = np.random.default_rng(1)
    rows = d["micro_batch"] * g * 16  # every sample of the 14 steps distinct
    write_dataset(prefix, rng.integers(0, d["vocab"], size=rows * (d["seq"] + 1), dtype=np.uint64), d["seq"])
    run_dir = os.path.join(a.out, "keel")
    os.makedirs(run_dir)
    cfg = os.path.join(run_dir, "train.yaml")
    open(cfg, "w").write(keel_config(d, prefix, run_dir, 14, grad_accum=g))
    mpirun = ["mpirun", "--allow-run-as-root", "--bind-to", "none", "-x", "NCCL_NVLS_ENABLE"]

    text = sh(mpirun + ["-np", str(g), a.keel, "train", cfg, "--set", "checkpoint.interval=10"] + ep(g),
              os.path.join(a.out, "keel_save.log"), a.timeout, env)
    numel = int(re.search(r"\((\d+) parameters", text).group(1))
    m = re.search(r"checkpoint step 10: training stalled ([0-9.]+) s \(([0-9.]+) s staging", text)
    keel = {"stall_s": float(m.group(1)), "staging_s": float(m.group(2))}
    m = re.search(r"saved \S+step_00000010 \(([0-9.]+) MiB in \d+ files, ([0-9.]+) GB/s\)", text)
    keel["bytes"], keel["write_gbps"] = float(m.group(1)) * 1048576, float(m.group(2))
    phase("keel save")
    for n, key in ((g, "load"), (half, "reshard")):
        text = sh(mpirun + ["-np", str(n), a.keel, "train", cfg, "--set", "steps=10", "--resume",
                            os.path.join(run_dir, "step_00000010")] + ep(n),
                  os.path.join(a.out, f"keel_{key}.log"), a.timeout, env)
        m = re.search(r"\(read ([0-9.]+) GiB in ([0-9.]+) s, ([0-9.]+) GB/s, read amplification ([0-9.]+)\)", text)
        keel[key] = {"s": float(m.group(2)), "gbps": float(m.group(3)), "amplification": float(m.group(4))}
        phase(f"keel {key}")
    shutil.rmtree(run_dir)
    return keel, numel


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keel", default="build-gpu/keel")
    p.add_argument("--out", help="directory on the disk under test (emptied; required)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--layers", type=int, default=None, help="model layers (default: the bench model's 8)")
    p.add_argument("--ep", action="store_true", help="keel runs with expert parallelism over every GPU")
    p.add_argument("--part", choices=["all", "keel", "dcp"], default="all",
                   help="run both sides (default), only keel's (writes keel_result.json), or only DCP's")
    p.add_argument("--keel-result", help="keel_result.json of an earlier --part keel run (needed by --part dcp)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["save", "load"], help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return torch_worker(a)
    if not a.out:
        p.error("--out is required")
    if a.part == "dcp" and not a.keel_result:
        p.error("--part dcp needs --keel-result (the keel_result.json of a --part keel run)")
    if a.keel_result:
        if a.part != "dcp":
            p.error("--keel-result goes with --part dcp")
        try:
            earlier = json.load(open(a.keel_result))
            if earlier.get("schema") != "keel.ckpt_vs_dcp.keel/1":
                raise ValueError("not a keel_result.json of this script")
            if earlier["gpus"] != a.gpus:
                raise ValueError(f"it was measured at {earlier['gpus']} GPUs, this run has {a.gpus}")
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--keel-result {a.keel_result}: {e}")
    from train_vs_torch import DIMS

    g, half = a.gpus, max(1, a.gpus // 2)
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    d = dict(DIMS)
    if a.layers:
        d["layers"] = a.layers
    t0 = time.time()

    def phase(name):
        print(f"  {name}: done at {time.time() - t0:.0f} s", flush=True)

    if a.part == "dcp":
        keel, numel = earlier["keel"], earlier["numel"]
        d["layers"], a.ep = earlier["layers"], earlier["keel_ep"]
    else:
        keel, numel = run_keel(a, d, g, half, env, phase)
        if a.part == "keel":
            json.dump({"schema": "keel.ckpt_vs_dcp.keel/1", "keel": keel, "numel": numel, "gpus": g,
                       "layers": d["layers"], "keel_ep": a.ep},
                      open(os.path.join(a.out, "keel_result.json"), "w"))
            print(f"\n== keel checkpoints, keel's side: {numel / 1e9:.2f} B parameters, {g} GPUs: stall "
                  f"{keel['stall_s']:.3f} s, write {keel['write_gbps']:.2f} GB/s, load {keel['load']['s']:.2f} s, "
                  f"resharded load {g} -> {half} {keel['reshard']['s']:.2f} s (for --part dcp: "
                  f"{a.out}/keel_result.json)")
            return

    # PyTorch DCP on a state of the same size
    if numel % (g * half):
        numel += g * half - numel % (g * half)
    tdir = os.path.join(a.out, "dcp")
    os.makedirs(tdir)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    me = [os.path.abspath(__file__), "--worker", "--numel", str(numel), "--dir", tdir]
    res = os.path.join(a.out, "dcp_save.json")
    sh(torchrun + [f"--nproc_per_node={g}"] + me + ["--mode", "save", "--result", res],
       os.path.join(a.out, "dcp_save.log"), a.timeout, env)
    dcp = json.load(open(res))
    phase("DCP save, sync and async")
    for n, key in ((g, "load"), (half, "reshard")):
        res = os.path.join(a.out, f"dcp_{key}.json")
        sh(torchrun + [f"--nproc_per_node={n}"] + me + ["--mode", "load", "--result", res],
           os.path.join(a.out, f"dcp_{key}.log"), a.timeout, env)
        got = json.load(open(res))
        ok = all(abs(x - y) <= 1e-6 * max(1.0, abs(y)) for x, y in zip(got["sums"], dcp["sums"]))
        dcp[key] = {"s": got["load_s"], "gbps": dcp["bytes"] / got["load_s"] / 1e9, "ok": ok}
        phase(f"DCP {key}")

    gb = dcp["bytes"] / 1e9
    rows = [
        ("stall per save, async (s)", f"{keel['stall_s']:.3f}", f"{dcp['async_stall_s']:.3f}",
         f"{dcp['async_stall_s'] / keel['stall_s']:.1f}x"),
        ("stall per save, sync DCP (s)", f"{keel['stall_s']:.3f}", f"{dcp['sync_save_s']:.3f}",
         f"{dcp['sync_save_s'] / keel['stall_s']:.1f}x"),
        ("save throughput (GB/s)", f"{keel['write_gbps']:.2f}", f"{gb / dcp['sync_save_s']:.2f} sync, "
         f"{gb / dcp['async_total_s']:.2f} async", f"{keel['write_gbps'] / (gb / dcp['sync_save_s']):.2f}x"),
        (f"load at {g} ranks (s, GB/s)", f"{keel['load']['s']:.2f}, {keel['load']['gbps']:.2f}",
         f"{dcp['load']['s']:.2f}, {dcp['load']['gbps']:.2f}", f"{dcp['load']['s'] / keel['load']['s']:.2f}x"),
        (f"resharded load {g} -> {half} (s, GB/s)", f"{keel['reshard']['s']:.2f}, {keel['reshard']['gbps']:.2f}",
         f"{dcp['reshard']['s']:.2f}, {dcp['reshard']['gbps']:.2f}",
         f"{dcp['reshard']['s'] / keel['reshard']['s']:.2f}x"),
        ("read amplification", f"{keel['load']['amplification']:.3f} / {keel['reshard']['amplification']:.3f}",
         "not reported", ""),
    ]
    print(f"\n== keel checkpoints vs torch.distributed.checkpoint: {numel / 1e9:.2f} B parameters + AdamW "
          f"(fp32), {gb:.1f} GB per checkpoint, {g} GPUs{' (keel: expert parallel over all)' if a.ep else ''} ==")
    print(f"{'':34s} {'keel':>18s} {'DCP':>26s} {'keel better by':>15s}")
    for r in rows:
        print(f"{r[0]:34s} {r[1]:>18s} {r[2]:>26s} {r[3]:>15s}")
    print(f"DCP loads match the saved sums: {dcp['load']['ok']} at {g} ranks, {dcp['reshard']['ok']} at {half}")
    json.dump({"keel": keel, "dcp": dcp, "numel": numel, "gpus": g, "layers": d["layers"], "keel_ep": a.ep},
              open(os.path.join(a.out, "result.json"), "w"))


if __name__ == "__main__":
    main()
