#!/usr/bin/env python3
"""keel against Hugging Face transformers' ZayaForCausalLM (models/zaya/modeling_zaya.py) on
tiny ZAYA1 models, fp32 on the CPU, from the same weights.

  hf_zaya_check.py forward KEEL SOURCE_ROOT WORKDIR   (issue 36 (a))
  hf_zaya_check.py train   KEEL SOURCE_ROOT WORKDIR   (issue 36 (b))

The weights start on the Hugging Face side: a randomly initialized ZayaForCausalLM of the model
of configs/train/zaya1-tiny.yaml (and, for `forward`, a second, 3-layer model with other conv
widths and more query heads per kv head), every 1-D parameter moved off its init (zero biases
and unit scales would hide a wrong term), the CCA temperatures set near 1 (Hugging Face inits
them to 0, which zeroes every key), the router's weights scaled up (so routing decisions are
not near-ties: the smallest margin between the best and second-best biased probability is
printed, 1e-4-ish against rounding differences of 1e-7), the experts' weights scaled up (so one
token routed elsewhere moves its log-probability by ~0.5, far past the tolerance), and the
balancing biases (`mlp.gate.balancing_biases`) set by a controller so that about a quarter of
the tokens of every layer pick the skip class (class num_experts) and the rest spread evenly
over the experts. save_pretrained
writes them; `keel ckpt import --names zaya1` reads them into a keel checkpoint, and `keel ckpt
export --names zaya1` of that checkpoint must load back into ZayaForCausalLM with no missing,
unexpected or mismatched keys, every tensor bit-identical (except the skip-class balancing
bias, which transformers' own from_pretrained resets to -1: checked in the file instead).

forward: `keel eval --device cpu --logprobs` (keel's fp32 reference forward, MoeTransformer)
against the Hugging Face forward on the same windows: mean cross-entropy within 1e-5 relative,
every token's log-probability within 1e-4; then greedy decoding, `keel generate --device cpu`
(prefill + cached decode) against a greedy loop over ZayaForCausalLM with its cache and against
`ZayaForCausalLM.generate`: the same tokens.

train: 5 steps of `keel train --device cpu` (init_from the imported checkpoint, the batches of
a dataset written here in order (data.shuffle false), AdamW at a constant lr of 3e-5 (larger
steps move the router so far that routing collapses onto one class within a step or two; 3e-5
still moves the loss 600 times the tolerance), clipping at 1.0 (active: gradient norms ~3), the
balancing biases fixed: router.bias_update_rate 0) against the same 5 steps of ZayaForCausalLM with
torch.optim.AdamW on keel's parameter groups (weight decay on every tensor of 2+ dims: matrices,
expert stacks, conv weights, the embedding; none on 1-D tensors) and
torch.nn.utils.clip_grad_norm_: per-step losses within 1e-5 relative, gradient norms within
1e-4, the per-layer routing counts of every step (every class, the skip class included; keel's
from router.log_counts in metrics.jsonl) identical, and keel's weights after the steps (exported)
within 1% of the update from the Hugging Face ones.

Exit 77 (CTest: skipped) when torch or transformers (with models/zaya) cannot be imported.
"""
import copy
import json
import os
import shutil
import struct
import subprocess
import sys

SKIP = 77
try:
    import numpy as np
    import torch
    import transformers
    from transformers import ZayaConfig, ZayaForCausalLM
    import yaml
    from safetensors.torch import load_file
except Exception as e:  # noqa: BLE001 - any import failure means "no reference here"
    print(f"hf_zaya_check: SKIP: torch / transformers with ZayaForCausalLM not importable ({type(e).__name__}: {e})")
    sys.exit(SKIP)

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

BYTE_VOCAB = 259  # keel's byte tokenizer: 256 bytes, <pad>, <s>, </s>; keel generate never picks an id past it
LOSS_RTOL = 1e-5
LOGPROB_ATOL = 1e-4
SKIP_SHARE = (0.15, 0.40)


def fail(msg):
    print(f"hf_zaya_check: FAIL: {msg}")
    sys.exit(1)


def note(msg):
    print(msg, flush=True)


def run(cmd, **kw):
    note("$ " + " ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", **kw)
    if r.returncode != 0:
        fail(f"{cmd[0]} {cmd[1]} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r.stdout


# --- the model ------------------------------------------------------------------------------------

def keel_model(path):
    """The `model:` section of a train config, or a model YAML."""
    with open(path) as f:
        y = yaml.safe_load(f)
    return dict(y["model"] if "model" in y else y)


def zaya_config(m):
    """ZayaConfig of a keel model dict (the keys keel's hf_config() writes for --names zaya1)."""
    if m.get("attention") != "cca" or not m.get("router_skip_expert") or int(m.get("top_k", 0)) != 1:
        fail(f"model {m.get('name')} is not ZAYA1-shaped")
    return ZayaConfig(
        vocab_size=int(m["vocab_size"]), hidden_size=int(m["hidden"]), num_hidden_layers=int(m["layers"]),
        num_attention_heads=int(m["heads"]), num_key_value_heads=int(m["kv_heads"]), head_dim=int(m["head_dim"]),
        num_experts=int(m["experts"]), num_experts_per_tok=1, moe_intermediate_size=int(m["expert_hidden"]),
        router_hidden_size=int(m["router_hidden"]), cca_time0=int(m["cca_conv_width"]),
        cca_time1=int(m["cca_group_conv_width"]), rms_norm_eps=float(m["norm_eps"]),
        max_position_embeddings=int(m["max_seq_len"]), tie_word_embeddings=bool(m.get("tied_embeddings", True)),
        rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": float(m["rope_base"]),
                                    "partial_rotary_factor": float(m["rope_fraction"])}},
        # keel's models have no padding row: nn.Embedding(padding_idx=0) would keep token 0's
        # embedding gradient at zero, which keel does not (token 0 is the NUL byte here).
        pad_token_id=None, bos_token_id=None, eos_token_id=None)


def write_model_yaml(m, path):
    with open(path, "w") as f:
        yaml.safe_dump(m, f, sort_keys=False)


class Routing:
    """Forward hooks on every ZayaRouter: the class each token picked (argmax of softmax + the
    balancing biases, before the skip class is masked to expert 0) and its decision margin."""

    def __init__(self, model):
        self.choice, self.margin, self.probs = {}, {}, {}
        self.handles = []
        for l, layer in enumerate(model.model.layers):
            self.handles.append(layer.mlp.gate.register_forward_hook(self._hook(l)))

    def _hook(self, l):
        def hook(mod, args, out):
            logits = out[0].detach().float()
            p = torch.softmax(logits, -1)
            biased = p + mod.balancing_biases
            top2 = torch.topk(biased, 2, -1)
            # the router's own outputs: the skip class masked to expert 0 with gate 0
            choice, skip = top2.indices[:, 0], top2.indices[:, 0] == mod.num_experts
            idx, gate = out[2][:, 0], out[1][:, 0]
            if not (torch.equal(idx, choice.masked_fill(skip, 0)) and bool((gate[skip] == 0).all())):
                fail(f"layer {l}: the choices recomputed from the router logits are not ZayaRouter's own")
            self.probs.setdefault(l, []).append(p)
            self.choice.setdefault(l, []).append(top2.indices[:, 0])
            self.margin.setdefault(l, []).append(top2.values[:, 0] - top2.values[:, 1])
        return hook

    def counts(self, classes):
        return [torch.bincount(torch.cat(self.choice[l]), minlength=classes).tolist() for l in sorted(self.choice)]

    def min_margin(self):
        return min(float(torch.cat(v).min()) for v in self.margin.values())

    def close(self):
        for h in self.handles:
            h.remove()


def perturbed_model(cfg, seed, router_scale=8.0, expert_scale=4.0):
    """ZayaForCausalLM, random (Hugging Face's init, seeded), every 1-D tensor moved off its init."""
    torch.manual_seed(seed)
    model = ZayaForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("qk_norm.temp"):
                p.copy_(1.0 + 0.2 * r)  # Hugging Face inits 0 (keys all zero); keel trains from 1
            elif p.ndim == 1 and (name.endswith("bias") or name.endswith("_bias")):
                p.add_(0.05 * r)
            elif p.ndim == 1:  # norm weights, residual and EDA scales
                p.mul_(1.0 + 0.1 * r)
            if ".mlp.experts." in name:
                p.mul_(expert_scale)
            if ".mlp.gate." in name and name.endswith(".weight") and ".norm." not in name:
                p.mul_(router_scale)
    return model.eval()


def calibrate_routing(model, batches, share=0.25, iters=400, candidates=400):
    """Sets the balancing biases, layer by layer (a layer's choices change the next ones' inputs),
    as keel's controller would with targets: `share` of the tokens of `batches` to the skip class
    (class num_experts), the rest spread evenly over the experts. A layer's router probabilities
    do not depend on its own biases, so each layer is one forward and a proportional controller
    with a decaying step on the recorded probabilities."""
    E = model.config.num_experts
    for l, layer in enumerate(model.model.layers):
        rt = Routing(model)
        with torch.no_grad():
            for x in batches:
                model(input_ids=x)
        p = torch.cat(rt.probs[l]).double()
        rt.close()
        target = torch.full((E + 1,), (1.0 - share) / E, dtype=torch.float64)
        target[E] = share
        b = torch.zeros(E + 1, dtype=torch.float64)
        step = 0.5 * float((p.max(-1).values - p.min(-1).values).mean())
        for it in range(iters):
            f = torch.bincount(torch.argmax(p + b, -1), minlength=E + 1).double() / p.shape[0]
            b -= step / (1.0 + it / 25.0) * (f - target)
        # The controller leaves a boundary on some token (a tie): among small random moves of the
        # biases that keep every class near its target, take the one whose closest decision is
        # the least close.
        g = torch.Generator().manual_seed(l)
        cand = b + 0.02 * step * (2 * torch.rand(candidates, E + 1, generator=g, dtype=torch.float64) - 1)
        cand[0] = b
        best, best_margin = b, -1.0
        pf = p.float()
        for c in cand:
            top2 = torch.topk(pf + c.float(), 2, -1)
            f = torch.bincount(top2.indices[:, 0], minlength=E + 1).double() / p.shape[0]
            if float((f - target).abs().max()) > 0.05:
                continue
            m = float((top2.values[:, 0] - top2.values[:, 1]).min())
            if m > best_margin:
                best, best_margin = c, m
        with torch.no_grad():
            layer.mlp.gate.balancing_biases.copy_(best.float())


def skip_shares(counts):
    return [c[-1] / sum(c) for c in counts]


# --- files ----------------------------------------------------------------------------------------

def write_dataset(prefix, stream):
    """A Megatron indexed dataset (keel's uint32 extension, dtype code 9): one document."""
    stream = np.ascontiguousarray(stream, dtype=np.uint32)
    n = stream.size
    with open(prefix + ".bin", "wb") as f:
        f.write(stream.tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", 9))
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<Q", 2))
        f.write(np.array([n], dtype=np.int32).tobytes())
        f.write(np.array([0], dtype=np.int64).tobytes())
        f.write(np.array([0, 1], dtype=np.int64).tobytes())


def windows_of(stream, L, count):
    """keel's windows of L + 1 tokens at stride L (eval --data in order; train with shuffle: false)."""
    return torch.stack([torch.as_tensor(stream[j * L: j * L + L + 1], dtype=torch.long) for j in range(count)])


def hf_to_keel(model, m, work, tag, keel):
    """save_pretrained -> keel ckpt import --names zaya1; then keel ckpt export --names zaya1 of the
    import must load into ZayaForCausalLM cleanly and bit-identically."""
    hf_dir, kdir, exp = (os.path.join(work, f"{tag}-{s}") for s in ("hf", "keel", "export"))
    yml = os.path.join(work, f"{tag}.yaml")
    for d in (hf_dir, kdir, exp):
        shutil.rmtree(d, ignore_errors=True)
    write_model_yaml(m, yml)
    model.save_pretrained(hf_dir)
    run([keel, "ckpt", "import", hf_dir, kdir, "--format", "safetensors", "--names", "zaya1", "--model", yml])
    run([keel, "ckpt", "export", kdir, exp, "--format", "safetensors", "--names", "zaya1", "--model", yml])
    back, info = ZayaForCausalLM.from_pretrained(exp, output_loading_info=True, dtype=torch.float32)
    bad = {k: sorted(v) for k, v in info.items() if v}
    if bad:
        fail(f"keel's --names zaya1 export does not load cleanly into ZayaForCausalLM: {bad}")
    if back.lm_head.weight.data_ptr() != back.model.embed_tokens.weight.data_ptr():
        fail("the exported model's lm_head is not tied to its embedding")
    mine, theirs, written = model.state_dict(), back.state_dict(), load_file(os.path.join(exp, "model.safetensors"))
    if set(mine) != set(theirs):
        fail(f"state_dict keys differ: {sorted(set(mine) ^ set(theirs))}")
    if set(written) != set(mine) - {"lm_head.weight"}:
        fail(f"keel's export holds other tensors than save_pretrained's: {sorted(set(written) ^ set(mine))}")
    for k in written:
        if not torch.equal(mine[k], written[k]):
            fail(f"{k}: keel's import + export changed the tensor (max diff {(mine[k] - written[k]).abs().max():.3g})")
    reset = []
    for k in mine:
        if torch.equal(mine[k], theirs[k]):
            continue
        # transformers 5.24's from_pretrained runs ZayaPreTrainedModel._init_weights after loading,
        # and its unguarded `balancing_biases[-1] = -1.0` overwrites the loaded skip-class bias
        # (the other classes' survive: init.zeros_ skips loaded tensors). Nothing keel can write
        # avoids it; the file holds the right value (checked above).
        if k.endswith("balancing_biases") and torch.equal(mine[k][:-1], theirs[k][:-1]) and float(theirs[k][-1]) == -1.0:
            reset.append(k)
            continue
        fail(f"{k}: ZayaForCausalLM.from_pretrained of keel's export differs from the saved model")
    if reset:
        note(f"{tag}: note: ZayaForCausalLM.from_pretrained reset the skip-class balancing bias to -1 in {len(reset)} "
             f"layers (transformers' _init_weights after loading); the exported file holds keel's values")
    note(f"{tag}: HF save_pretrained -> keel ckpt import -> keel ckpt export -> ZayaForCausalLM.from_pretrained: "
         f"{len(mine)} tensors, no missing/unexpected/mismatched keys, all bit-identical")
    return kdir, yml


def rel(a, b):
    return abs(a - b) / abs(b)


# --- (a) forward and greedy decoding --------------------------------------------------------------

def check_forward(keel, m, work, tag, seed, L=64, windows=8, micro=4, new_tokens=40):
    cfg = zaya_config(m)
    V = cfg.vocab_size
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, BYTE_VOCAB, size=windows * L + 1)
    data = windows_of(stream, L, windows)
    model = perturbed_model(cfg, seed)
    calibrate_routing(model, [data[:, :L]])
    kdir, yml = hf_to_keel(model, m, work, tag, keel)

    # Hugging Face forward on the windows, routing recorded
    rt = Routing(model)
    with torch.no_grad():
        logits = model(input_ids=data[:, :L]).logits.float()
    lp_hf = torch.log_softmax(logits, -1).gather(-1, data[:, 1:, None])[..., 0]
    ce_hf = float(-lp_hf.double().mean())
    counts = rt.counts(cfg.num_experts + 1)
    margin = rt.min_margin()
    rt.close()
    shares = skip_shares(counts)
    note(f"{tag}: routing per layer (classes 0..{cfg.num_experts - 1}, skip last): {counts}; skip share "
         + ", ".join(f"{s:.1%}" for s in shares) + f"; smallest decision margin {margin:.2e}")
    for l, s in enumerate(shares):
        if not SKIP_SHARE[0] <= s <= SKIP_SHARE[1]:
            fail(f"{tag}: layer {l} sends {s:.1%} of the tokens to the skip class, outside {SKIP_SHARE}")

    # keel's fp32 reference forward
    prefix = os.path.join(work, f"{tag}-data")
    write_dataset(prefix, stream)
    lp_path = os.path.join(work, f"{tag}-lp.tsv")
    out = run([keel, "eval", kdir, "--model", yml, "--data", prefix, "--seq-length", str(L), "--micro-batch",
               str(micro), "--device", "cpu", "--logprobs", lp_path])
    ce_line = [x for x in out.splitlines() if x.startswith("eval: ")]
    if not ce_line:
        fail(f"keel eval printed no CE line:\n{out}")
    ce_keel = float(ce_line[-1].split("mean CE ")[1].split(",")[0])
    rows = np.loadtxt(lp_path, comments="#", delimiter="\t", ndmin=2)
    if rows.shape[0] != windows * L:
        fail(f"keel eval --logprobs wrote {rows.shape[0]} rows, expected {windows * L}")
    lp_keel = torch.zeros(windows, L, dtype=torch.float64)
    for w, pos, tgt, lp in rows:
        if int(tgt) != int(data[int(w), int(pos)]):
            fail(f"keel eval's target at window {int(w)} position {int(pos)} is {int(tgt)}, "
                 f"the data's {int(data[int(w), int(pos)])}")
        lp_keel[int(w), int(pos) - 1] = lp
    ce_keel_rows = float(-lp_keel.mean())
    tok_diff = float((lp_keel - lp_hf.double()).abs().max())
    # the same model in float64 (the eager experts loop: grouped_mm has no float64), for scale
    model64 = copy.deepcopy(model).double()
    model64.set_experts_implementation("eager")
    with torch.no_grad():
        lp64 = torch.log_softmax(model64(input_ids=data[:, :L]).logits, -1).gather(-1, data[:, 1:, None])[..., 0]
    ce64 = float(-lp64.mean())
    del model64
    note(f"{tag}: mean CE over {windows * L} tokens: keel {ce_keel:.6f} (from its per-token rows {ce_keel_rows:.7f}), "
         f"transformers {ce_hf:.7f}: relative difference {rel(ce_keel_rows, ce_hf):.2e}; "
         f"largest per-token log-prob difference {tok_diff:.2e} (keel prints 6 decimals); against transformers "
         f"in float64 ({ce64:.7f}): keel {rel(ce_keel_rows, ce64):.2e}, transformers fp32 {rel(ce_hf, ce64):.2e}")
    if rel(ce_keel_rows, ce_hf) > LOSS_RTOL or rel(ce_keel, ce_hf) > LOSS_RTOL:
        fail(f"{tag}: keel's CE {ce_keel_rows:.7f} vs transformers' {ce_hf:.7f}: beyond {LOSS_RTOL} relative")
    if tok_diff > LOGPROB_ATOL:
        w, t = divmod(int((lp_keel - lp_hf.double()).abs().argmax()), L)
        fail(f"{tag}: window {w} position {t + 1}: keel log-prob {lp_keel[w, t]:.6f}, transformers {lp_hf[w, t]:.6f}")

    # greedy decoding: keel generate (prefill + cache) vs Hugging Face's cache, token by token
    prompt = "Once upon a time"
    ids = list(prompt.encode())
    out = run([keel, "generate", kdir, "--model", yml, "--prompt", prompt, "--max-new-tokens", str(new_tokens),
               "--ignore-eos", "--device", "cpu", "--print-ids"])
    id_line = [x for x in out.splitlines() if x.startswith("ids: ")]
    if len(id_line) != 1:
        fail(f"keel generate --print-ids printed no ids line:\n{out}")
    keel_ids = [int(x) for x in id_line[0][5:].split()]
    if keel_ids[:len(ids)] != ids:
        fail(f"keel generate's prompt ids {keel_ids[:len(ids)]} are not the prompt's bytes {ids}")
    keel_new = keel_ids[len(ids):]

    rt = Routing(model)
    gaps = []
    with torch.no_grad():
        x = torch.tensor([ids])
        o = model(input_ids=x, use_cache=True)
        cache, loop_new = o.cache, []
        for _ in range(new_tokens):
            last = o.logits[0, -1, :BYTE_VOCAB].float()
            top2 = torch.topk(last, 2).values
            gaps.append(float(top2[0] - top2[1]))
            nxt = int(torch.argmax(last))
            loop_new.append(nxt)
            o = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
            cache = o.cache
    decode_counts = rt.counts(cfg.num_experts + 1)
    rt.close()
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                             suppress_tokens=list(range(BYTE_VOCAB, V)), pad_token_id=BYTE_VOCAB - 3)
    gen_new = gen[0, len(ids):].tolist()
    skipped = sum(c[-1] for c in decode_counts)
    note(f"{tag}: greedy, {new_tokens} new tokens after a {len(ids)}-token prompt: keel generate {keel_new}; "
         f"smallest top-1/top-2 logit gap along the way {min(gaps):.2e}; skip-class picks in the prefill and decode steps "
         f"{skipped} of {sum(sum(c) for c in decode_counts)}")
    if loop_new != gen_new:
        fail(f"{tag}: transformers' own greedy loop {loop_new} and generate() {gen_new} disagree")
    if keel_new != loop_new:
        i = next(i for i, (a, b) in enumerate(zip(keel_new, loop_new)) if a != b)
        fail(f"{tag}: greedy decoding parts at new token {i}: keel {keel_new[i]}, transformers {loop_new[i]} "
             f"(keel {keel_new}, transformers {loop_new})")
    note(f"{tag}: greedy decoding agrees token for token with transformers (cache loop and generate())")


# --- (b) training steps ---------------------------------------------------------------------------

def adamw_groups(model):
    """keel's AdamW groups (src/train/param_rules.cc, muon off): decay on every tensor of 2+ dims
    (embedding, conv weights, matrices, expert stacks), none on 1-D ones (norms, biases, scales,
    temperatures). The tied LM head is the embedding."""
    decay, plain = [], []
    for _, p in model.named_parameters():
        (decay if p.ndim >= 2 else plain).append(p)
    return decay, plain


def check_train(keel, m, work, tag, seed, steps=5, L=32, micro=4, lr=3e-5, wd=0.1, betas=(0.9, 0.95), eps=1e-8,
                clip=1.0):
    cfg = zaya_config(m)
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, BYTE_VOCAB, size=steps * micro * L + 1)
    data = windows_of(stream, L, steps * micro)
    batches = [data[s * micro:(s + 1) * micro] for s in range(steps)]
    model = perturbed_model(cfg, seed)
    calibrate_routing(model, [b[:, :L] for b in batches])
    kdir, yml = hf_to_keel(model, m, work, tag, keel)

    prefix = os.path.join(work, f"{tag}-data")
    write_dataset(prefix, stream)
    run_dir = os.path.join(work, f"{tag}-run")
    shutil.rmtree(run_dir, ignore_errors=True)
    tcfg = {
        "device": "cpu", "model": m, "recompute": "none",
        "router": {"aux_loss_weight": 0.0, "z_loss_weight": 0.0, "bias_update_rate": 0.0, "lr_scale": 1.0,
                   "log_counts": True},
        "data": {"datasets": {"train": prefix}, "seq_length": L, "seed": 1, "shuffle": False},
        "optimizer": {"lr": lr, "min_lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps, "weight_decay": wd,
                      "clip": clip, "muon": {"enabled": False}},
        "schedule": {"kind": "constant", "warmup_steps": 0},
        "batch": {"micro_batch": micro, "grad_accum": 1},
        "steps": steps, "log_interval": 1, "output_dir": run_dir,
        "checkpoint": {"interval": 0, "final": True, "dir": os.path.join(run_dir, "ckpt")},
        "init_from": kdir, "seed": 1,
    }
    tpath = os.path.join(work, f"{tag}-train.yaml")
    with open(tpath, "w") as f:
        yaml.safe_dump(tcfg, f, sort_keys=False)
    run([keel, "train", tpath])
    keel_loss, keel_norm, keel_counts = {}, {}, {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if "loss" in j:
                keel_loss[j["step"]], keel_norm[j["step"]] = j["loss"], j["grad_norm"]
            if "routing_counts" in j:
                keel_counts[j["step"]] = j["routing_counts"]

    # the same steps in transformers
    init = {k: v.clone() for k, v in model.state_dict().items()}
    decay, plain = adamw_groups(model)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": plain, "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=eps, foreach=False)
    worst, worst_norm, margin, first = 0.0, 0.0, float("inf"), None
    for s, b in enumerate(batches, start=1):
        model.train()
        rt = Routing(model)
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=b[:, :L]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), b[:, 1:].reshape(-1))
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        loss = float(loss.detach())
        counts = rt.counts(cfg.num_experts + 1)
        margin = min(margin, rt.min_margin())
        rt.close()
        first = first or skip_shares(counts)
        if s not in keel_loss or s not in keel_counts:
            fail(f"{tag}: keel's metrics.jsonl has no loss or routing_counts for step {s}")
        r, rn = rel(keel_loss[s], loss), rel(keel_norm[s], norm)
        worst, worst_norm = max(worst, r), max(worst_norm, rn)
        note(f"{tag}: step {s}: loss keel {keel_loss[s]:.8f}, transformers {loss:.8f} (relative {r:.2e}); "
             f"gradient norm before clipping keel {keel_norm[s]:.6f}, transformers {norm:.6f} (relative {rn:.2e}); "
             f"routing keel {keel_counts[s]}, transformers {counts}, skip share "
             + ", ".join(f"{x:.1%}" for x in skip_shares(counts)))
        if r > LOSS_RTOL:
            fail(f"{tag}: step {s}: loss beyond {LOSS_RTOL} relative")
        if rn > 1e-4:
            fail(f"{tag}: step {s}: gradient norm beyond 1e-4 relative")
        if norm <= clip:
            fail(f"{tag}: step {s}: gradient norm {norm:.3f} under the clip {clip}: clipping would go untested")
        if keel_counts[s] != counts:
            fail(f"{tag}: step {s}: per-layer routing counts differ")
    for l, x in enumerate(first):
        if not SKIP_SHARE[0] <= x <= SKIP_SHARE[1]:
            fail(f"{tag}: step 1: layer {l} sends {x:.1%} of the tokens to the skip class, outside {SKIP_SHARE}")
    # The updates must matter far beyond the tolerance: the last batch's loss under the initial
    # weights against its loss after steps - 1 updates.
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(init)
    with torch.no_grad():
        b = batches[-1]
        untrained = float(torch.nn.functional.cross_entropy(
            model(input_ids=b[:, :L]).logits.float().reshape(-1, cfg.vocab_size), b[:, 1:].reshape(-1)))
    model.load_state_dict(trained)
    moved = rel(keel_loss[steps], untrained)
    note(f"{tag}: the last batch's loss with the initial weights {untrained:.8f}, after {steps - 1} steps "
         f"{keel_loss[steps]:.8f}: the updates move it by {moved:.2e} relative")
    if moved < 100 * LOSS_RTOL:
        fail(f"{tag}: the updates move the loss by only {moved:.2e}: the comparison would not see a wrong update")

    # keel's weights after the steps against transformers'
    exp = os.path.join(work, f"{tag}-final")
    shutil.rmtree(exp, ignore_errors=True)
    run([keel, "ckpt", "export", os.path.join(run_dir, "ckpt"), exp, "--format", "safetensors", "--names", "zaya1",
         "--model", yml])
    # the file, not from_pretrained (which resets the skip-class balancing bias: hf_to_keel)
    mine, theirs = model.state_dict(), load_file(os.path.join(exp, "model.safetensors"))
    theirs["lm_head.weight"] = theirs["model.embed_tokens.weight"]
    # per tensor: the largest difference over the largest change the steps made
    worst_w, worst_name = 0.0, ""
    for k in mine:
        change = float((mine[k] - init[k]).abs().max())
        if change == 0:
            if not torch.equal(mine[k], theirs[k]):
                fail(f"{tag}: {k}: transformers left it unchanged, keel did not")
            continue
        d = float((mine[k] - theirs[k]).abs().max()) / change
        if d > worst_w:
            worst_w, worst_name = d, k
    note(f"{tag}: {steps} steps: worst loss difference {worst:.2e} relative, gradient norm {worst_norm:.2e}; "
         f"routing identical at every step "
         f"(smallest decision margin {margin:.2e}); weights after the steps: the largest difference is "
         f"{worst_w:.2e} of the largest change the steps made to that tensor ({worst_name})")
    if worst_w > 1e-2:
        fail(f"{tag}: keel's trained weights part from transformers' ({worst_name}: {worst_w:.2e})")


def main():
    if len(sys.argv) != 5 or sys.argv[1] not in ("forward", "train"):
        sys.exit(__doc__)
    mode, keel, root, work = sys.argv[1:]
    keel = os.path.abspath(keel)
    os.makedirs(work, exist_ok=True)
    note(f"transformers {transformers.__version__}, torch {torch.__version__}; experts implementation: "
         f"the default of ZayaForCausalLM")
    tiny = keel_model(os.path.join(root, "configs", "train", "zaya1-tiny.yaml"))
    if mode == "forward":
        check_forward(keel, tiny, work, "zaya1-tiny", seed=1)
        # 3 layers (the EDA chain over two hops), 8 query heads on 2 kv heads, conv widths 3 and 4
        wide = dict(tiny, name="zaya1-tiny-3l", layers=3, heads=8, cca_q_dim=512, cca_conv_width=3,
                    cca_group_conv_width=4)
        check_forward(keel, wide, work, "zaya1-tiny-3l", seed=2)
    else:
        check_train(keel, tiny, work, "zaya1-tiny-train", seed=3)
    note(f"hf_zaya_check {mode}: PASS")


if __name__ == "__main__":
    main()
