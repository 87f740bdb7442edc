#!/usr/bin/env python3
"""One rank of the PyTorch tensor-parallel peer of bench/train_tp_vs_torch.py, run under torchrun.

The model and step: bench/train_vs_torch.py's MoE (--model bench) or bench/zaya_vs_torch.py's
ZAYA1-shaped model (--model zaya1), built by their build_torch_model (same math, same
initialization rule), each step `--accum` micro-batches of micro_batch x seq tokens, bf16 autocast
over fp32 parameters (fp32 without autocast on the CPU), global-norm clipping at 1.0, AdamW
(fused on GPUs) with the hyperparameters of those scripts; the ZAYA1 model's selection-bias
controller after each step, as in zaya_vs_torch.run_torch. Every rank of the job is one tensor
group (a 1-D DeviceMesh of the world); all ranks read the same tokens. World size 1 runs the
same model and step unparallelized (the one-device baseline of the same global batch).

Tensor parallelism through torch.distributed.tensor.parallel (parallelize_module), the
Megatron layout as torchtitan's llama / llama4 plans write it:
  bench:  embed RowwiseParallel (vocabulary rows; output all-reduced, or reduce-scattered over
          the sequence with --sp); attention PrepareModuleInput (one all-gather / one gradient
          reduction for q, k and v), wq / wk / wv ColwiseParallel, wo RowwiseParallel, the
          module's head counts divided by the degree (n_heads // tp, as torchtitan does; above
          the kv heads, as keel and Megatron do, wk / wv replicated, k and v computed whole with
          their gradients summed over the group, each rank's q heads reading their group's kv
          head: not run yet, written 2026-11-29 for T=4 on 4 GPUs); the
          router replicated (a plain module: every rank routes every token alike); the expert
          stacks tensor-sliced by ExpertTensorParallel below (torchtitan's TensorParallel for
          GroupedExperts: w_gate / w_up Shard(1), w_down Shard(2), the MoE output Partial and
          reduced once per layer by PrepareModuleInputOutput, the experts' input and gate
          gradients summed over the group); the tied LM head vocabulary-parallel on the
          embedding's shard (logits Shard(-1)) with loss_parallel() (the cross-entropy never
          gathers the logits); with --sp SequenceParallel on the norms (activations Shard(1)
          between blocks) and Shard(1) layouts on the block inputs and outputs.
  zaya1:  the same for the embedding / tied head and the experts (ZAYA1's MLP router, EDA and
          the selection bias replicated); CCA split by heads with CCATensorParallel below: its
          fused [q; k] projection and both convolutions hold each rank's q heads and k heads
          together (the rows are regrouped into per-rank blocks [q_r; k_r] before Shard(0):
          ColwiseParallel's contiguous row split of [q; k] would give the first rank 5 of the 8
          q heads and the second the other 3 and both k heads, splitting kv groups, whose q
          heads CCA averages into their key), w_v and the temperatures by kv heads, o_proj Shard(1), the module's local head
          counts and value shift set for the rank's heads. The residual scales and norms are
          replicated; with --sp they are replicated DTensors computing on Shard(1) DTensors (the
          residual stream between blocks is Shard(1)).
With --sp the replicated parameters that see only the rank's tokens (norms, residual scales)
get Partial DTensor gradients; they are summed over the group once per step, after the last
micro-batch, before clipping (as Megatron sums its sequence-parallel parameters' gradients).
Gradient clipping sums the squares of sharded gradients over the group once and counts the
replicated ones once (torch.nn.utils.clip_grad_norm_ refuses a mix of DTensor and plain
gradients: "aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor"); AdamW runs in separate
parameter groups for DTensor and plain parameters, for the same reason (fused and foreach alike).
Not parallelized by the plans: the routers (and ZAYA1's router MLP and EDA), norms and residual
scales, which Megatron and keel replicate too.

Rank 0 writes --json: tokens/s (median over the timed steps; the group's tokens, each token
counted once), peak memory per rank (max_memory_allocated, and reserved), per-step rows in the
format of keel's metrics.jsonl (step, ce, tokens_per_s, routing_busiest_share.i,
routing_skip_share.i) so that bench/routing_health.py's summary reads both.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_vs_torch  # noqa: E402
import zaya_vs_torch  # noqa: E402
from train_tp_vs_torch import dims  # noqa: E402  (the models' dimensions: the driver's)

# ---------------------------------------------------------------------------------------------
# Tensor-parallel pieces beyond the stock styles
# ---------------------------------------------------------------------------------------------

def _tp():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
    return DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor, ParallelStyle


def grad_summed(x, mesh):
    """Identity forward; backward sums the gradient over the group (all-reduce). For a replicated
    input that feeds a tensor-sliced computation (whose input gradient is a partial sum on each
    rank) and also replicated code (whose gradient is whole): torchtitan's experts do this."""
    DTensor, Partial, Replicate = _tp()[:3]
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


def expert_tensor_parallel(mesh_unused=None):
    """torchtitan's TensorParallel for GroupedExperts, on the stacked experts of both models:
    w_gate / w_up [E, F, D] Shard(1) (each expert's FFN columns), w_down [E, D, F] Shard(2); the
    module computes with the local shards and returns a partial sum (the enclosing MoE module's
    PrepareModuleOutput reduces it). The inputs named by `summed` (the token rows and the gates)
    get their gradients summed over the group: each rank's expert slice contributes part of them."""
    DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor, ParallelStyle = _tp()

    class ExpertTensorParallel(ParallelStyle):
        def __init__(self, summed):
            super().__init__()
            self.summed = summed

        @staticmethod
        def _partition(name, module, mesh):
            if name:
                return
            for pname, dim in (("w_gate", 1), ("w_up", 1), ("w_down", 2)):
                p = getattr(module, pname)
                module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(dim)])))

        def _apply(self, module, mesh):
            summed = self.summed

            def prepare(mod, inputs, mesh):
                return tuple(grad_summed(x, mesh) if i in summed else x for i, x in enumerate(inputs))

            return distribute_module(module, mesh, self._partition, prepare)

    return ExpertTensorParallel


def clip_grad_norm(params, max_norm, group):
    """Global-norm clipping over the tensor group: sharded DTensor gradients' squares summed over
    the group, replicated gradients (DTensor Replicate or plain) counted once; Partial gradients
    (replicated parameters computed on Shard(1) activations) are first summed over the group
    into their parameter's placement. Returns the norm."""
    DTensor, Partial, Replicate, Shard = _tp()[:4]
    sharded, replicated = [], []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):  # sequence-parallel norms and scales
                g = g.redistribute(placements=p.placements)
                p.grad = g
            (sharded if any(pl.is_shard() for pl in g.placements) else replicated).append(g.to_local())
        else:
            replicated.append(g)
    dev = (sharded + replicated)[0].device

    def sq(ts):
        if not ts:
            return torch.zeros((), device=dev)
        return torch.stack([n.float() for n in torch._foreach_norm(ts)]).pow(2).sum()

    s = sq(sharded)
    if group is not None:
        dist.all_reduce(s, group=group)
    total = (s + sq(replicated)).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(sharded + replicated, coef)
    return total


# ---------------------------------------------------------------------------------------------
# The plans
# ---------------------------------------------------------------------------------------------

def parallelize_bench(model, mesh, sp):
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)
    DTensor, Partial, Replicate, Shard = _tp()[:4]
    tp = mesh.size()
    between = Shard(1) if sp else Replicate()  # the residual stream's layout between blocks
    top = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "head": PrepareModuleInputOutput(input_layouts=(between, None), desired_input_layouts=(Replicate(), None),
                                         output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),),
                                         use_local_output=True),
    }
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    ETP = expert_tensor_parallel()
    distribute_module = _tp()[4]
    for layer in model.layers:
        a = layer.attn
        assert a.n_heads % tp == 0, "tensor degree must divide the query heads"
        # More ranks than kv heads (keel's rule, as Megatron replicates kv heads): wk, wv whole on
        # every rank (Replicate), k and v computed whole, their gradients summed over the group
        # (each rank's query heads use part of them), each rank's query heads reading their
        # group's kv head. The stock plan (torchtitan's) splits the kv heads and needs tp | kv.
        replicate_kv = a.n_kv_heads < tp
        if replicate_kv:
            group = a.n_heads // a.n_kv_heads  # query heads per kv head
            assert tp % a.n_kv_heads == 0, "tensor degree above the kv heads must be a multiple of them"
            a.n_heads = a.n_heads // tp
            a.kv_select = (mesh.get_local_rank() * a.n_heads // group, 1)
            a.kv_hook = lambda t, mesh=mesh: grad_summed(t, mesh)
            distribute_module(a.wk, mesh)  # parameters replicated
            distribute_module(a.wv, mesh)
        else:
            assert a.n_kv_heads % tp == 0, "tensor degree must divide the kv heads"
            a.n_heads, a.n_kv_heads = a.n_heads // tp, a.n_kv_heads // tp
        plan = {
            "attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=between),
            "moe": PrepareModuleInputOutput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                            use_local_input=True, output_layouts=(Partial(), None, None),
                                            desired_output_layouts=(between, None, None), use_local_output=True),
            "moe.experts": ETP(summed=(0, 1)),  # forward(h, gate, sel, counts)
        }
        if not replicate_kv:
            plan["attn.wk"], plan["attn.wv"] = ColwiseParallel(), ColwiseParallel()
        if sp:
            plan["n1"] = SequenceParallel()
            plan["n2"] = SequenceParallel()
        parallelize_module(layer, mesh, plan)
    return model


def cca_tensor_parallel():
    """ZAYA1's CCA split by heads over the group (a ParallelStyle on the CCA module).

    Weights: w_qk [C, D] = [q rows; k rows], conv0 (depthwise) and conv1 (grouped, one group
    per head) weights and biases have C = Q + KV channels in that order; rank r keeps its q heads
    and k heads together, [q_r; k_r] (regrouped, then Shard(0): the DTensor's global view is
    the rows in per-rank blocks; tp_unpermute restores the model's order). w_v [KV, D] and the
    temperatures [kv heads] Shard(0) (by kv heads), o_proj [D, Q] Shard(1). The module's local
    head counts and value shift are set for the rank's heads. Input: the replicated activations
    (all-gathered from Shard(1) with sequence parallelism), whose gradient is summed over the
    group (reduce-scattered back with sequence parallelism); output: the partial sums of o_proj,
    all-reduced (reduce-scattered over the sequence with sequence parallelism)."""
    DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor, ParallelStyle = _tp()

    class CCATensorParallel(ParallelStyle):
        def __init__(self, sp, use_local_output):
            super().__init__()
            self.sp, self.use_local_output = sp, use_local_output

        @staticmethod
        def _partition(name, m, mesh):
            if name:
                return
            tp, r = mesh.size(), mesh.get_local_rank()
            dh = m.w_v.shape[0] // m.nkv
            if m.nkv % tp:
                raise ValueError(f"CCA: the tensor degree {tp} must divide the kv heads ({m.nkv}): a kv group's "
                                 "query heads are averaged into its key")
            Q, KV = m.nq * dh, m.nkv * dh
            ql, kvl = Q // tp, KV // tp

            def regroup(t):  # [C, ...] -> rank r's [q_r; k_r]
                return torch.cat([t[r * ql:(r + 1) * ql], t[Q + r * kvl:Q + (r + 1) * kvl]], 0).contiguous()

            def unpermute(full):  # the global view (per-rank blocks) -> [q rows; k rows]
                blocks = full.split(ql + kvl, 0)
                return torch.cat([b[:ql] for b in blocks] + [b[ql:] for b in blocks], 0)

            m.tp_unpermute = {}
            for pname in ("w_qk", "conv0_w", "conv0_b", "conv1_w", "conv1_b"):
                local = regroup(getattr(m, pname).data)
                m.register_parameter(pname, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))
                m.tp_unpermute[pname] = unpermute
            for pname, dim in (("w_v", 0), ("temp", 0), ("wo", 1)):
                m.register_parameter(pname, nn.Parameter(distribute_tensor(getattr(m, pname).data, mesh, [Shard(dim)])))
            shift = m.v_shift_from  # value channels [shift, KV) take the previous token
            m.nq, m.nkv = m.nq // tp, m.nkv // tp
            m.v_shift_from = min(max(shift - r * kvl, 0), kvl)

        def _apply(self, module, mesh):
            sp, use_local = self.sp, self.use_local_output

            def prepare_in(mod, inputs, mesh):
                x = inputs[0]
                if sp:
                    if not isinstance(x, DTensor):
                        x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
                    x = x.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),))
                else:
                    x = grad_summed(x, mesh)
                return (x, *inputs[1:])

            def prepare_out(mod, out, mesh):
                out = DTensor.from_local(out, mesh, (Partial(),), run_check=False)
                out = out.redistribute(placements=(Shard(1) if sp else Replicate(),))
                return out.to_local() if use_local else out

            return distribute_module(module, mesh, self._partition, prepare_in, prepare_out)

    return CCATensorParallel


def replicate_params(module, names, mesh):
    """Plain parameters -> replicated DTensors (identical on every rank): computed on Shard(1)
    activations, their gradients are partial sums that DTensor sums over the group."""
    DTensor, Partial, Replicate = _tp()[:3]
    for name in names:
        p = getattr(module, name, None)
        if p is not None:
            module.register_parameter(name, nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False)))


def parallelize_zaya(model, mesh, sp):
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, RowwiseParallel, parallelize_module
    DTensor, Partial, Replicate, Shard = _tp()[:4]
    between = Shard(1) if sp else Replicate()
    # With sequence parallelism the residual streams stay DTensors (Shard(1)) between blocks, so
    # that the residual scales and norms run on DTensors; without it they are plain tensors.
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=between, use_local_output=not sp),
        "head": PrepareModuleInputOutput(input_layouts=(between, None), desired_input_layouts=(Replicate(), None),
                                         output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),),
                                         use_local_output=True),
    })
    CCA, ETP = cca_tensor_parallel(), expert_tensor_parallel()
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "cca": CCA(sp, use_local_output=not sp),
            "moe": PrepareModuleInputOutput(input_layouts=(between, None, None),
                                            desired_input_layouts=(Replicate(), None, None), use_local_input=True,
                                            output_layouts=(Partial(), None, None),
                                            desired_output_layouts=(between, None, None), use_local_output=not sp),
            "moe.experts": ETP(summed=(0, 1)),  # forward(x, gate, idx)
        })
        if sp:
            replicate_params(layer, ("attn_norm", "mlp_norm"), mesh)
            for rs in (layer.res_attn, layer.res_mlp):
                replicate_params(rs, ("h_scale", "h_bias", "r_scale", "r_bias"), mesh)
    if sp:
        replicate_params(model, ("final_norm",), mesh)
        replicate_params(model.final_res, ("h_scale", "h_bias", "r_scale", "r_bias"), mesh)
    return model


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

def start_rank(cuda):
    """This torchrun rank's device (its LOCAL_RANK's GPU, or the CPU with one thread) and process
    group (NCCL or gloo); returns (device, world size, rank)."""
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dev, dist.get_world_size(), dist.get_rank()


def accumulate(micro_batch, accum):
    """accum calls of micro_batch() -> (ce, per-layer class counts); returns their ce's and the
    counts summed ([L, classes] int64)."""
    ces, total = [], None
    for _ in range(accum):
        ce, counts = micro_batch()
        ces.append(ce)
        c = torch.stack([x.to(torch.int64) for x in counts])
        total = c if total is None else total + c
    return ces, total


def timed_steps(step, steps, warmup, tokens_per_step, classes, skip_class, verbose, cuda):
    """Runs warmup + steps calls of step() -> (ce, per-layer class counts [L, classes], grad
    norm); returns (rows in keel's metrics.jsonl format, the timed steps' seconds). The peak
    memory counters restart after the warm-up; skip_class: the last class is the skip class."""
    rows, times = [], []
    for i in range(warmup + steps):
        if i == warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ts = time.perf_counter()
        ce, counts, norm = step()
        ce = ce.item()  # syncs: the step is done
        dt = time.perf_counter() - ts
        if i >= warmup:
            times.append(dt)
        c = counts.double()
        share = (c.max(1).values / c.sum(1).clamp(min=1)).tolist()
        row = {"step": i + 1, "ce": ce, "grad_norm": norm.item(), "step_s": dt, "tokens_per_s": tokens_per_step / dt}
        for l, s in enumerate(share):
            row[f"routing_busiest_share.{l}"] = s
            if skip_class:
                row[f"routing_skip_share.{l}"] = (c[l, -1] / c[l].sum().clamp(min=1)).item()
        rows.append(row)
        if verbose:
            print(f"step {i + 1}: ce {ce:.4f}, {dt * 1e3:.1f} ms, busiest/fair "
                  f"{' '.join(f'{s * classes:.2f}' for s in share)}", flush=True)
    return rows, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", choices=["bench", "zaya1"], default="bench")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--forced-balance", action="store_true",
                    help="benchmarking only: token n -> expert n mod E (keel's router.forced_balance)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: the model script's)")
    ap.add_argument("--bias-rate", type=float, default=zaya_vs_torch.BIAS_RATE, help="selection-bias rate (zaya1)")
    ap.add_argument("--data-seed", type=int, default=1)
    ap.add_argument("--data", choices=["random", "pattern"], default="random",
                    help="random: uniform tokens and targets (the benchmark's); pattern: target = a fixed function of "
                         "the token (learnable: the loss falls; for checks)")
    ap.add_argument("--save-params", default=None,
                    help="(checks) rank 0 saves every parameter, whole, in the unparallelized layout, to this .pt")
    a = ap.parse_args()

    cuda = a.device == "cuda"
    dev, world, rank = start_rank(cuda)
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(a.device, (world,), mesh_dim_names=("tp",))
    d = dims(a.model, a.tiny, a.layers)
    B, T, V = d["micro_batch"], d["seq"], d["vocab"]
    if a.sp and (B * T) % world:
        sys.exit("sequence parallelism needs the tokens to divide by the tensor degree")

    torch.manual_seed(0)  # the same initialization on every rank
    t_build = time.time()
    # Built on the device (the model scripts build on the host, then move: slow at 2.2 B
    # parameters); their initialization redraws every matrix on the device either way (the same
    # distributions; the bench model's numbers differ from train_vs_torch's run, whose
    # construction does not draw from the device's RNG first).
    with torch.device(dev):
        if a.model == "zaya1":
            model = zaya_vs_torch.build_torch_model(d, dev, torch.bfloat16 if cuda else torch.float32, a.forced_balance)
            lr = a.lr or zaya_vs_torch.LR
            classes = d["experts"] + 1
        else:
            model = train_vs_torch.build_torch_model(d, dev, a.forced_balance)
            lr = a.lr or train_vs_torch.LR
            classes = d["experts"]
    nparams_full = sum(p.numel() for p in model.parameters())
    if mesh is not None:  # every rank starts from rank 0's weights (the styles shard or replicate them)
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, 0)
        (parallelize_zaya if a.model == "zaya1" else parallelize_bench)(model, mesh, a.sp)
    DTensor = _tp()[0]
    local = lambda p: p.to_local() if isinstance(p, DTensor) else p  # noqa: E731
    nparams_local = sum(local(p).numel() for p in model.parameters())
    if cuda:
        torch.cuda.empty_cache()

    # AdamW as in the model's script; DTensor and plain parameters in separate groups (a fused
    # or foreach step takes one kind per call).
    params = list(model.parameters())
    if a.model == "zaya1":
        wd = lambda p: zaya_vs_torch.WD if p.dim() >= 2 else 0.0  # noqa: E731  (Optimizer's rule)
        betas, eps = zaya_vs_torch.BETAS, zaya_vs_torch.ADAM_EPS
    else:
        wd = lambda p: train_vs_torch.WD  # noqa: E731
        betas, eps = (0.9, 0.95), 1e-8
    groups = {}
    for p in params:
        groups.setdefault((isinstance(p, DTensor), wd(p)), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": w} for (_, w), ps in groups.items()], lr=lr, betas=betas,
                            eps=eps, **({"fused": True} if cuda else {"foreach": False}))
    clip = zaya_vs_torch.CLIP if a.model == "zaya1" else train_vs_torch.CLIP
    group = mesh.get_group() if mesh is not None else None
    if mesh is not None:
        from torch.distributed.tensor.parallel import loss_parallel
    else:
        import contextlib
        loss_parallel = contextlib.nullcontext
    gen = torch.Generator(device=dev).manual_seed(a.data_seed)  # the same tokens on every rank

    def micro_batch():
        tokens = torch.randint(0, V, (B, T), device=dev, generator=gen)
        targets = torch.randint(0, V, (B, T), device=dev, generator=gen)
        if a.data == "pattern":
            targets = (tokens * 31 + 7) % V
        with loss_parallel():
            with torch.autocast(a.device, dtype=torch.bfloat16, enabled=cuda):
                out = model(tokens, targets)
            if a.model == "zaya1":
                ce, counts = out
                loss = ce
            else:
                loss, ce = out
                counts = [layer.moe.last_counts for layer in model.layers]
            (loss / a.accum).backward()
        return ce.detach(), counts

    def step():
        ces, total = accumulate(micro_batch, a.accum)
        norm = clip_grad_norm(params, clip, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if a.model == "zaya1":  # counts are the whole group's on every rank (replicated router)
            zaya_vs_torch.update_selection_bias(torch, model, list(total.unbind(0)), a.bias_rate)
        return torch.stack(ces).mean(), total, norm

    tokens_per_step = a.accum * B * T
    t0 = time.time()
    rows, times = timed_steps(step, a.steps, a.warmup, tokens_per_step, classes, a.model == "zaya1", rank == 0, cuda)
    mem = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
                        torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan")], device=dev)
    mems = [torch.zeros_like(mem) for _ in range(world)]
    dist.all_gather(mems, mem)
    if rank == 0:
        res = {"tokens_per_s": tokens_per_step / statistics.median(times), "step_ms": 1e3 * statistics.median(times),
               "memory_gib": max(m[0].item() for m in mems) if cuda else None,  # None: not measured on CPU
               "memory_gib_per_rank": [m[0].item() for m in mems] if cuda else None,
               "memory_reserved_gib": max(m[1].item() for m in mems) if cuda else None, "world": world, "tp": world, "sp": a.sp,
               "model": a.model, "dims": d, "accum": a.accum, "tokens_per_step": tokens_per_step, "classes": classes,
               "params": nparams_full, "params_per_rank": nparams_local, "build_s": t0 - t_build,
               "run_s": time.time() - t0, "rows": rows, "ce": [r["ce"] for r in rows], "torch": torch.__version__}
        json.dump(res, open(a.json, "w"), indent=1)
    if a.save_params:
        full = {}
        for name, p in model.named_parameters():
            t = p.full_tensor() if isinstance(p, DTensor) else p
            owner, _, pname = name.rpartition(".")
            undo = getattr(model.get_submodule(owner), "tp_unpermute", {}).get(pname)
            full[name] = (undo(t) if undo else t).detach().float().cpu()
        if rank == 0:
            torch.save(full, a.save_params)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
