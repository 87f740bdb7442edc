#!/usr/bin/env python3
"""One rank of the PyTorch data-parallel peer for bench/train_dp_scaling.py, run under torchrun:
DistributedDataParallel with ZeroRedundancyOptimizer (AdamW, fused), micro-batch 2 x 4096 tokens
per GPU per step, eager. --model bench: bench/train_vs_torch.py's MoE and step; --model zaya1:
bench/zaya_vs_torch.py's ZAYA1-shaped model and step (its selection-bias controller fed by the
loads summed over the ranks; --lr and --bias-rate as keel's runs). Rank 0 writes
{"tokens_per_s": <the group's>, "memory_gib": ..., ...} to --json."""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_vs_torch  # noqa: E402
import zaya_vs_torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the model's 8)")
    ap.add_argument("--model", choices=["bench", "zaya1"], default="bench")
    ap.add_argument("--lr", type=float, default=zaya_vs_torch.LR, help="learning rate (zaya1)")
    ap.add_argument("--bias-rate", type=float, default=zaya_vs_torch.BIAS_RATE, help="selection-bias rate (zaya1)")
    ap.add_argument("--forced-balance", action="store_true", help="token n -> expert n mod E (zaya1; keel's router.forced_balance)")
    a = ap.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    ddp = dist.get_world_size() > 1
    if a.model == "zaya1":
        d = dict(zaya_vs_torch.ZAYA8, layers=a.layers or zaya_vs_torch.ZAYA8["layers"])
        r = zaya_vs_torch.run_torch(d, a.steps, a.warmup, compiled=False, dev="cuda", ddp=ddp, lr=a.lr,
                                    bias_rate=a.bias_rate, forced=a.forced_balance)
        r["load_max"] = statistics.median(r["load_max"])  # over the timed steps, as keel's runs report it
        del r["ce"]
    else:
        d = dict(train_vs_torch.DIMS, layers=a.layers or train_vs_torch.DIMS["layers"])
        r = train_vs_torch.run_torch(d, a.steps, a.warmup, compiled=False, ddp=ddp)
    r["tokens_per_s"] *= dist.get_world_size()  # each rank trained its own micro-batch
    r["world"] = dist.get_world_size()
    if dist.get_rank() == 0:
        json.dump(r, open(a.json, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
