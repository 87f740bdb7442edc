#!/usr/bin/env python3
"""keel's step kernels against PyTorch's on the same shapes, on one GPU (issue 33's kernel table).

    python3 bench/kernels_vs_torch.py --keel build-gpu/keel [--json OUT.json] [--iters 20]

keel's side is `keel bench kernels --json` (src/bench/kernels/command.h); each kernel is timed
alone, forward and backward separately, median of --iters CUDA-event timings after warm-up, on
random bf16 inputs (normal; routing balanced: every expert the same rows). PyTorch's side:
  attention  torch.nn.functional.scaled_dot_product_attention(is_causal=True) under each of its
             backends (flash, cuDNN, memory-efficient), GQA through enable_gqa, or with the kv
             heads expanded where a backend refuses it; the fastest backend is the peer, each
             printed;
  experts    torch._grouped_mm (one launch per GEMM over all experts, offsets on the device):
             gate, up, silu(gate) * up, down; backward through autograd (weight gradients in
             bf16, where keel writes fp32); eager and under torch.compile, the faster is the peer;
  ce         logits = h @ W^T in bf16, F.cross_entropy on them in fp32, under torch.compile
             (Inductor fuses the softmax passes; the [N, V] logits are materialized).
TFLOP/s on both sides are the same model FLOPs: attention 4 B H D T(T+1)/2 forward and 2.5x
that backward; experts 6 N D F forward, twice that backward; ce 2 N D V forward, twice that
backward. The ratio is torch_ms / keel_ms: above 1, keel is faster.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def timed(fn, iters, warmup, prep=None):
    """Median ms of fn() over iters runs, CUDA events around it; prep() runs untimed before each."""
    import torch
    for _ in range(warmup):
        args = prep() if prep else None
        fn(args)
    ms = []
    for _ in range(iters):
        args = prep() if prep else None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(args)
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    ms.sort()
    return ms[len(ms) // 2]


def fwd_bwd_times(forward, inputs, grad_out, iters, warmup):
    """forward() -> output with autograd history; returns (forward ms, backward ms). The backward
    returns the inputs' gradients (torch.autograd.grad: nothing accumulates into .grad)."""
    import torch
    f = timed(lambda _: forward(), iters, warmup)
    b = timed(lambda out: torch.autograd.grad(out, inputs, grad_out), iters, warmup, prep=forward)
    return f, b


def torch_attention(B, T, hq, hkv, D, iters, warmup):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, T, hq, D, device="cuda", generator=g).bfloat16().transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, hkv, D, device="cuda", generator=g).bfloat16().transpose(1, 2).requires_grad_()
    v = torch.randn(B, T, hkv, D, device="cuda", generator=g).bfloat16().transpose(1, 2).requires_grad_()
    dout = torch.randn(B, hq, T, D, device="cuda", generator=g).bfloat16()
    results = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for expand in (False, True):
            if expand and hq == hkv:
                continue

            def forward(backend=backend, expand=expand):
                with sdpa_kernel(backend):
                    if expand:
                        r = hq // hkv
                        return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1),
                                                              is_causal=True)
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
            try:
                f, b = fwd_bwd_times(forward, (q, k, v), dout, iters, warmup)
            except RuntimeError as e:
                results[name + (" (kv expanded)" if expand else "")] = str(e).splitlines()[0][:80]
                continue
            results[name + (" (kv expanded)" if expand else "")] = (f, b)
            break
    return results


def torch_experts(N, D, Fw, E, iters, warmup):
    import torch
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(2)
    xs = torch.randn(N, D, device="cuda", generator=g).bfloat16().requires_grad_()
    wg = (torch.randn(E, Fw, D, device="cuda", generator=g) * D ** -0.5).bfloat16().requires_grad_()
    wu = (torch.randn(E, Fw, D, device="cuda", generator=g) * D ** -0.5).bfloat16().requires_grad_()
    wd = (torch.randn(E, D, Fw, device="cuda", generator=g) * Fw ** -0.5).bfloat16().requires_grad_()
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (N // E)
    dys = torch.randn(N, D, device="cuda", generator=g).bfloat16()

    def experts(xs, wg, wu, wd, offs):
        hg = torch._grouped_mm(xs, wg.transpose(-2, -1), offs=offs)
        hu = torch._grouped_mm(xs, wu.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(F.silu(hg) * hu, wd.transpose(-2, -1), offs=offs)

    out = {}
    for name, fn in (("grouped_mm eager", experts), ("grouped_mm compiled", torch.compile(experts))):
        try:
            out[name] = fwd_bwd_times(lambda fn=fn: fn(xs, wg, wu, wd, offs), (xs, wg, wu, wd), dys, iters, warmup)
        except Exception as e:  # noqa: BLE001 (a peer that cannot run is reported, not fatal)
            out[name] = str(e).splitlines()[0][:80]
    return out


def torch_ce(N, D, V, iters, warmup):
    import torch
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(N, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, D, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)

    def loss(h, w, t):
        return F.cross_entropy((h @ w.t()).float(), t)

    out = {}
    for name, fn in (("compiled", torch.compile(loss)),):
        one = torch.ones((), device="cuda")
        try:
            torch.cuda.reset_peak_memory_stats()
            out[name] = fwd_bwd_times(lambda fn=fn: fn(h, w, t), (h, w), one, iters, warmup)
            out[name + " peak GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
        except Exception as e:  # noqa: BLE001
            out[name] = str(e).splitlines()[0][:80]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keel", default="build-gpu/keel")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", default="16:16,16:2,8:2")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=262272)
    ap.add_argument("--json", help="also write keel's and torch's rows here")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "keel.json")
        cmd = [a.keel, "bench", "kernels", "--batch", str(a.batch), "--seq", str(a.seq), "--heads",
               *a.heads.split(","), "--head-dim", str(a.head_dim), "--tokens", str(a.tokens), "--dim", str(a.dim),
               "--ffn", str(a.ffn), "--experts", str(a.experts), "--vocab", str(a.vocab), "--iters", str(a.iters),
               "--warmup", str(a.warmup), "--json", path]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        keel = json.load(open(path))["rows"]

    import torch
    heads = [tuple(int(x) for x in h.split(":")) for h in a.heads.split(",")]
    peers = {}
    for hq, hkv in heads:
        peers[("attention", hq, hkv)] = torch_attention(a.batch, a.seq, hq, hkv, a.head_dim, a.iters, a.warmup)
        torch.cuda.empty_cache()
    peers["experts"] = torch_experts(a.tokens, a.dim, a.ffn, a.experts, a.iters, a.warmup)
    torch.cuda.empty_cache()
    peers["ce"] = torch_ce(a.tokens, a.dim, a.vocab, a.iters, a.warmup)

    rows = []
    att = [r for r in keel if r["kernel"] == "attention"]
    for r, (hq, hkv) in zip(att, heads):
        rows.append((r, peers[("attention", hq, hkv)]))
    rows += [(r, peers["experts"]) for r in keel if r["kernel"] == "experts"]
    rows += [(r, peers["ce"]) for r in keel if r["kernel"] == "ce"]

    print(f"\n== keel kernels vs PyTorch {torch.__version__} ({torch.cuda.get_device_name()}); ms and TFLOP/s, "
          f"ratio = torch_ms / keel_ms (above 1: keel faster)")
    for r, peer in rows:
        print(f"-- {r['kernel']}: {r['shape']}")
        print(f"   {'keel':<28} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.0f} TF   bwd {r['bwd_ms']:8.3f} ms "
              f"{r['bwd_tflops']:6.0f} TF")
        for name, val in peer.items():
            if name.endswith("GiB"):
                print(f"   {'torch ' + name:<28} {val:.1f}")
                continue
            if isinstance(val, str):
                print(f"   {'torch ' + name:<28} could not run: {val}")
                continue
            f, b = val
            print(f"   {'torch ' + name:<28} fwd {f:8.3f} ms {r['fwd_flop'] / f * 1e-9:6.0f} TF   bwd {b:8.3f} ms "
                  f"{r['bwd_flop'] / b * 1e-9:6.0f} TF   ratio fwd {f / r['fwd_ms']:.2f} bwd {b / r['bwd_ms']:.2f}")
    if a.json:
        out = {"keel": keel, "torch": {str(k): v for k, v in peers.items()}, "device": torch.cuda.get_device_name(),
               "torch_version": torch.__version__}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
