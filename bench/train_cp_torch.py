#!/usr/bin/env python3
"""One rank of the PyTorch context-parallel peer of bench/train_cp.py --peer, run under torchrun.

The model: bench/zaya_vs_torch.py's ZAYA1-shaped model with GQA attention at the same widths
(--attention gqa: q, k, v and o projections, partial RoPE, causal scaled_dot_product_attention;
CCA's convolutions need a halo exchange that PyTorch's context parallelism does not do), the MLP
router with EDA and the skip class, 16 experts top-1 (a loop over experts, as Hugging Face's MoE
models run them), bf16 autocast over fp32 parameters, AdamW (fused), global-norm clipping at 1.0,
the selection-bias controller fed by the loads summed over the ranks.

Layouts (every rank of the job):
  --cp   context parallelism over the world: torch.distributed.tensor.experimental.context_parallel
         on a 1-D DeviceMesh; each micro-batch's tokens, targets and positions are the buffers it
         shards over the sequence (its load-balanced causal split: rank r holds chunks r and
         2C-1-r, as keel's zigzag), the SDPA calls inside run its ring attention (k/v passed
         rank to rank: set_rotate_method "allgather" for the all-gather variant, --rotate); the
         parameters replicated, their gradients averaged over the group by DistributedDataParallel
         (each rank's loss is the mean over its tokens, the same count on every rank).
  (none) data parallelism: DistributedDataParallel over the world, each rank its own sequences.
World size 1 runs the same model and step on one device.

Tokens: uniform random ids from a seeded generator (the same on every rank of a CP group; a rank's
own under data parallelism). Rank 0 writes --json: tokens/s (median over the timed steps; the
job's tokens each counted once), peak memory per rank, and per-step rows in keel's metrics.jsonl
format (step, ce, tokens_per_s, routing_busiest_share.i, routing_skip_share.i) for
bench/routing_health.py.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_tp_torch  # noqa: E402
import zaya_vs_torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--tiny", action="store_true", help="toy dimensions")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--attention", choices=["gqa", "cca"], default="gqa",
                    help="gqa (the peer's); cca runs only without --cp")
    ap.add_argument("--cp", action="store_true", help="context parallelism over the world (else data parallelism)")
    ap.add_argument("--rotate", choices=["alltoall", "allgather"], default="alltoall",
                    help="context parallelism's k/v exchange (torch's set_rotate_method): alltoall = the ring")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (per rank)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--bias-rate", type=float, default=zaya_vs_torch.BIAS_RATE)
    ap.add_argument("--forced-balance", action="store_true",
                    help="benchmarking only: token n -> expert n mod E (keel's router.forced_balance)")
    ap.add_argument("--data-seed", type=int, default=1)
    a = ap.parse_args()
    if a.cp and a.attention != "gqa":
        sys.exit("--cp: PyTorch's context parallelism shards scaled_dot_product_attention; CCA's convolutions "
                 "would need a halo exchange it does not do (--attention gqa)")

    cuda = a.device == "cuda"
    dev, world, rank = train_tp_torch.start_rank(cuda)
    d = dict(zaya_vs_torch.TINY if a.tiny else zaya_vs_torch.ZAYA8, attention=a.attention, seq=a.seq,
             micro_batch=a.micro_batch)
    if a.layers:
        d["layers"] = a.layers
    B, T, V, E = a.micro_batch, a.seq, d["vocab"], d["experts"]
    classes = E + 1
    if a.cp and T % (2 * world):
        sys.exit(f"--cp: the sequence ({T}) must divide into 2 x {world} chunks (the load-balanced split)")

    torch.manual_seed(0)
    t_build = time.time()
    with torch.device(dev):
        model = zaya_vs_torch.build_torch_model(d, dev, torch.bfloat16 if cuda else torch.float32, a.forced_balance)
    nparams = sum(p.numel() for p in model.parameters())
    # the same initial weights on every rank (DDP broadcasts them too; explicit for the buffers)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, 0)
    from torch.nn.parallel import DistributedDataParallel
    # (a class no token picks leaves its expert without a gradient: DDP must look for those,
    # unless forced balance feeds every expert)
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if cuda else None, broadcast_buffers=False,
                                  find_unused_parameters=not a.forced_balance)
    mesh, cp_ctx = None, None
    if a.cp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method
        mesh = init_device_mesh(a.device, (world,), mesh_dim_names=("cp",))
        set_rotate_method(a.rotate)
        cp_ctx = context_parallel

    params = list(model.parameters())
    wd = lambda p: zaya_vs_torch.WD if p.dim() >= 2 else 0.0  # noqa: E731  (keel's Optimizer rule)
    groups = {}
    for p in params:
        groups.setdefault(wd(p), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": w} for w, ps in groups.items()], lr=a.lr,
                            betas=zaya_vs_torch.BETAS, eps=zaya_vs_torch.ADAM_EPS,
                            **({"fused": True} if cuda else {"foreach": False}))
    # a CP group reads the same tokens; data-parallel ranks their own
    gen = torch.Generator(device=dev).manual_seed(a.data_seed + (0 if a.cp else rank))

    def micro_batch():
        tokens = torch.randint(0, V, (B, T), device=dev, generator=gen)
        targets = torch.randint(0, V, (B, T), device=dev, generator=gen)
        positions = torch.arange(T, device=dev)
        if cp_ctx is None:
            with torch.autocast(a.device, dtype=torch.bfloat16, enabled=cuda):
                ce, counts = ddp(tokens, targets)
            (ce / a.accum).backward()
            return ce.detach(), counts
        # the buffers are sharded in place over the sequence for the block (tokens' and targets'
        # dimension 1, the positions' 0) and, being in no_restore_buffers, left so
        with cp_ctx(mesh, buffers=[tokens, targets, positions], buffer_seq_dims=[1, 1, 0],
                    no_restore_buffers={tokens, targets, positions}):
            with torch.autocast(a.device, dtype=torch.bfloat16, enabled=cuda):
                ce, counts = ddp(tokens, targets, positions)
            (ce / a.accum).backward()
        return ce.detach(), counts

    def step():
        ces, total = train_tp_torch.accumulate(micro_batch, a.accum)
        norm = torch.nn.utils.clip_grad_norm_(params, zaya_vs_torch.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)  # the loads of every rank's tokens (each token counted once)
        zaya_vs_torch.update_selection_bias(torch, model, list(total.unbind(0)), a.bias_rate)
        ce = torch.stack(ces).mean()
        dist.all_reduce(ce)
        return ce / world, total, norm

    tokens_per_step = a.accum * B * T * (1 if a.cp else world)
    t0 = time.time()
    rows, times = train_tp_torch.timed_steps(step, a.steps, a.warmup, tokens_per_step, classes, True, rank == 0, cuda)
    mem = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")], device=dev)
    mems = [torch.zeros_like(mem) for _ in range(world)]
    dist.all_gather(mems, mem)
    if rank == 0:
        res = {"tokens_per_s": tokens_per_step / statistics.median(times), "step_ms": 1e3 * statistics.median(times),
               "memory_gib": max(m[0].item() for m in mems) if cuda else None, "world": world, "cp": a.cp,
               "rotate": a.rotate if a.cp else None, "dims": d, "accum": a.accum, "tokens_per_step": tokens_per_step,
               "classes": classes, "params": nparams, "build_s": t0 - t_build, "run_s": time.time() - t0,
               "rows": rows, "ce": [r["ce"] for r in rows], "torch": torch.__version__}
        json.dump(res, open(a.json, "w"), indent=1)
    del ddp  # (DDP's reducer before the process group: gloo's threads may abort the exit otherwise)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
