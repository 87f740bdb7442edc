#!/usr/bin/env python3
"""keel's chunked linear attention kernels against flash-linear-attention's, on one GPU.

    python3 bench/linear_attention_vs_fla.py --keel build-gpu/keel [--seq 8192,32768,65536] [--fla-wheels .whl]

Both sides run causal linear attention at the same shapes, batch B, H heads of d (MHA: fla's
kernels have one key/value head per query head), random bf16 q, k, v (q and k scaled by
1/sqrt(d)), in the forms a LASP-2 layer uses:
  - no decay:  keel `bench linattn` against fla.ops.linear_attn.chunk_linear_attn(scale=1,
               normalize=False): o_t = q_t sum_{i<=t} k_i^T v_i;
  - decay:     keel `bench linattn --decay` (RetNet's gamma_h = 1 - 2^(-5-h)) against
               fla.ops.retention.chunk_retention(scale=1), the same decays.
Each is timed alone, forward and forward + backward (fla through autograd with a random
upstream gradient), median of --iters runs after warm-up, CUDA events. The table prints keel's
and fla's milliseconds and fla_ms / keel_ms (above 1: keel is faster).

flash-linear-attention's kernels are Triton; fla-core and einops travel as wheels (--fla-wheels,
installed with pip --no-deps into a temporary directory when `import fla` fails).
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile


def ensure_fla(wheels):
    try:
        import fla  # noqa: F401
        return
    except ImportError:
        pass
    files = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not files:
        sys.exit(f"linear_attention_vs_fla: flash-linear-attention is not installed and no wheels in {wheels}")
    target = tempfile.mkdtemp(prefix="fla_")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target] + files,
                   check=True)
    sys.path.insert(0, target)


def time_fla(fn, q, k, v, dout, iters, warmup):
    import torch

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        o = fn(qq, kk, vv)
        o.backward(dout)

    out = []
    for body in (fwd, fwd_bwd):
        for _ in range(warmup):
            body()
        ms = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            body()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        ms.sort()
        out.append(ms[len(ms) // 2])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keel", default="build-gpu/keel")
    ap.add_argument("--seq", default="8192,32768,65536")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fla-wheels", default=".whl")
    a = ap.parse_args()
    seqs = [int(s) for s in a.seq.split(",")]

    ensure_fla(a.fla_wheels)
    import torch
    from fla.ops.linear_attn import chunk_linear_attn
    from fla.ops.retention import chunk_retention

    rows = []
    for decay in (False, True):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [a.keel, "bench", "linattn", "--seq", *map(str, seqs), "--batch", str(a.batch), "--heads",
                   str(a.heads), "--kv-heads", str(a.heads), "--head-dim", str(a.head_dim), "--iters", str(a.iters),
                   "--warmup", str(a.warmup), "--json", f.name] + (["--decay"] if decay else [])
            subprocess.run(cmd, check=True)
            keel = {r["seq"]: r for r in json.load(open(f.name))["rows"]}
        if decay:
            fn = lambda q, k, v: chunk_retention(q, k, v, scale=1.0)[0]  # noqa: E731
        else:
            fn = lambda q, k, v: chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0]  # noqa: E731
        for T in seqs:
            g = torch.Generator(device="cuda").manual_seed(T)
            shape = (a.batch, T, a.heads, a.head_dim)
            s = a.head_dim ** -0.5
            q = (torch.randn(shape, device="cuda", generator=g) * s).bfloat16()
            k = (torch.randn(shape, device="cuda", generator=g) * s).bfloat16()
            v = torch.randn(shape, device="cuda", generator=g).bfloat16()
            dout = torch.randn(shape, device="cuda", generator=g).bfloat16()
            fla_fwd, fla_fb = time_fla(fn, q, k, v, dout, a.iters, a.warmup)
            kr = keel[T]
            rows.append((decay, T, kr["fwd_ms"], fla_fwd, kr["fwd_bwd_ms"], fla_fb))
            del q, k, v, dout
            torch.cuda.empty_cache()

    print(f"\n== keel linear attention vs flash-linear-attention ({torch.cuda.get_device_name()}, batch {a.batch}, "
          f"{a.heads} heads of {a.head_dim}, bf16; fla_ms / keel_ms, above 1: keel faster)")
    print(f"{'form':>9} {'seq':>8} {'keel fwd':>10} {'fla fwd':>10} {'ratio':>7} {'keel f+b':>10} {'fla f+b':>10} "
          f"{'ratio':>7}")
    for decay, T, kf, ff, kb, fb in rows:
        print(f"{'retnet' if decay else 'no decay':>9} {T:>8} {kf:>10.3f} {ff:>10.3f} {ff / kf:>7.2f} {kb:>10.3f} "
              f"{fb:>10.3f} {fb / kb:>7.2f}")


if __name__ == "__main__":
    main()
