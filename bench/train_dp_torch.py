#!/usr/bin/env python3
"""One rank of the PyTorch data-parallel peer for bench/train_dp_scaling.py, run under torchrun:
bench/train_vs_torch.py's MoE and step (eager) under DistributedDataParallel with
ZeroRedundancyOptimizer (AdamW, fused), micro-batch 2 x 4096 tokens per GPU per step. Rank 0
writes {"tokens_per_s": <the group's>, "memory_gib": ..., ...} to --json."""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_vs_torch import DIMS, run_torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=DIMS["layers"])
    a = ap.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    r = run_torch(dict(DIMS, layers=a.layers), a.steps, a.warmup, compiled=False, ddp=dist.get_world_size() > 1)
    r["tokens_per_s"] *= dist.get_world_size()  # each rank trained its own micro-batch
    r["world"] = dist.get_world_size()
    if dist.get_rank() == 0:
        json.dump(r, open(a.json, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
