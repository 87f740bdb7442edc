#!/usr/bin/env python3
"""Opens the files `keel ckpt export --names zaya1 --dtype bf16` and `--names zaya1-alternating`
wrote for configs/train/zaya1-tiny.yaml with the real `safetensors` package (numpy framework)
and checks names, shapes and dtypes against Zyphra's modeling_zaya.py, plus config.json.
Usage: check_zaya_safetensors.py HF_DIR ALT_DIR (each holding model.safetensors and
config.json). Fails (exit 1) when the package is missing: scripts/setup.sh installs it."""
import json
import os
import sys

try:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file
except ImportError as e:
    sys.exit(f"check_zaya_safetensors: FAIL: the Python packages 'safetensors' and 'numpy' are needed ({e}); "
             "run scripts/setup.sh --deps-only or: python3 -m pip install safetensors numpy")


def fail(msg):
    sys.exit(f"check_zaya_safetensors: FAIL: {msg}")


# zaya1-tiny as configs/train/zaya1-tiny.yaml trains it: vocab 264, hidden 256, 2 layers,
# 4 query heads and 2 kv heads of 64, 4 experts (+ skip) of 256, router hidden 64.
V, D, L, Q, KV, C, E, F, R = 264, 256, 2, 256, 128, 384, 4, 256, 64


class Opened:
    """A file read through safetensors' numpy API: names, dtypes and shapes of every tensor (from
    get_slice, which also covers BF16, a dtype plain numpy lacks) and the values of the F32 ones."""

    def __init__(self, d):
        self.path = os.path.join(d, "model.safetensors")
        self.info, self.f32 = {}, {}
        try:
            with safe_open(self.path, framework="np") as f:
                self.meta = f.metadata() or {}
                for name in f.keys():
                    sl = f.get_slice(name)
                    self.info[name] = (sl.get_dtype(), tuple(sl.get_shape()))
                    if sl.get_dtype() == "F32":
                        self.f32[name] = f.get_tensor(name)
        except Exception as e:  # the package's own header validation
            fail(f"safetensors cannot open {self.path}: {e}")
        if self.meta.get("format") != "pt":
            fail(f"{self.path}: __metadata__ format is {self.meta.get('format')!r}, transformers needs 'pt'")
        if set(self.info) == set(self.f32):  # an all-F32 file also loads whole with load_file
            if set(load_file(self.path)) != set(self.info):
                fail(f"{self.path}: load_file and safe_open disagree on the tensor names")
        with open(os.path.join(d, "config.json")) as f:
            self.config = json.load(f)

    def expect(self, name, shape, dtype):
        if name not in self.info:
            fail(f"{self.path}: no tensor {name!r}")
        got_dtype, got_shape = self.info[name]
        if got_shape != shape:
            fail(f"{self.path}: {name} has shape {got_shape}, expected {shape}")
        if got_dtype != dtype:
            fail(f"{self.path}: {name} has dtype {got_dtype}, expected {dtype}")

    def bf16(self, name):
        """The values of a BF16 tensor as float32, from the file's bytes (numpy has no bfloat16)."""
        with open(self.path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            begin, end = header[name]["data_offsets"]
            f.seek(8 + n + begin)
            bits = np.frombuffer(f.read(end - begin), dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(header[name]["shape"])


def check_hf(d):
    t = Opened(d)
    path, config, bf16 = t.path, t.config, "BF16"
    t.expect("model.embed_tokens.weight", (V, D), bf16)
    if "lm_head.weight" in t.info:
        fail(f"{path}: lm_head.weight written although the embeddings are tied")
    t.expect("model.input_hidden_states_scale", (D,), bf16)
    for l in range(L):
        p = f"model.layers.{l}."
        t.expect(p + "input_layernorm.weight", (D,), bf16)
        t.expect(p + "self_attn.qkv_proj.q_proj.weight", (Q, D), bf16)
        t.expect(p + "self_attn.qkv_proj.k_proj.weight", (KV, D), bf16)
        t.expect(p + "self_attn.qkv_proj.v_proj_current.weight", (KV // 2, D), bf16)
        t.expect(p + "self_attn.qkv_proj.v_proj_delayed.weight", (KV // 2, D), bf16)
        t.expect(p + "self_attn.qkv_proj.conv_qk_depthwise.weight", (C, 1, 2), bf16)
        t.expect(p + "self_attn.qkv_proj.conv_qk_grouped.weight", (C, 64, 2), bf16)
        t.expect(p + "self_attn.qk_norm.temp", (2,), bf16)
        t.expect(p + "self_attn.o_proj.weight", (D, Q), bf16)
        t.expect(p + "post_attention_residual_scale.residual_bias", (D,), bf16)
        t.expect(p + "post_mlp_residual_scale.hidden_states_scale", (D,), bf16)
        t.expect(p + "mlp.gate.down_proj.bias", (R,), bf16)
        t.expect(p + "mlp.gate.router_mlp.fc2.weight", (R, R), bf16)
        t.expect(p + "mlp.gate.router_mlp.out_proj.weight", (E + 1, R), bf16)
        t.expect(p + "mlp.gate.balancing_biases", (E + 1,), "F32")
        t.expect(p + "mlp.experts.gate_up_proj", (E, 2 * F, D), bf16)
        t.expect(p + "mlp.experts.down_proj", (E, D, F), bf16)
        if (p + "mlp.gate.router_states_scale" in t.info) != (l > 0):
            fail(f"{path}: router_states_scale must exist on every layer but the first (layer {l})")
    t.expect("model.norm.weight", (D,), bf16)
    if len(t.info) != 67:
        fail(f"{path}: {len(t.info)} tensors, expected 67")
    for name, (dtype, _) in t.info.items():
        v = t.bf16(name) if dtype == "BF16" else t.f32[name]
        if not np.all(np.isfinite(v)):
            fail(f"{path}: {name} has non-finite values")
    norm = t.bf16("model.layers.0.input_layernorm.weight")
    if not (0.5 < float(np.mean(norm)) < 1.5):
        fail(f"{path}: input_layernorm.weight mean {np.mean(norm)}, expected about 1")
    want = {"model_type": "zaya", "architectures": ["ZayaForCausalLM"], "num_hidden_layers": L, "hidden_size": D,
            "vocab_size": V, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": E,
            "moe_intermediate_size": F, "router_hidden_size": R, "num_experts_per_tok": 1,
            "num_query_groups": 2, "zaya_mlp_expansion": R, "ffn_hidden_size": 2 * F,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16", "layer_types": ["hybrid"] * L}
    for k, v in want.items():
        if config.get(k) != v:
            fail(f"{d}/config.json: {k} is {config.get(k)!r}, expected {v!r}")
    if config["rope_parameters"]["hybrid"]["partial_rotary_factor"] != 0.5:
        fail(f"{d}/config.json: rope_parameters.hybrid.partial_rotary_factor is not 0.5")
    return t


def check_alternating(d, hf):
    t = Opened(d)
    path, config, f32 = t.path, t.config, "F32"
    t.expect("model.layers.0.res_scale.hidden_states_scale", (D,), f32)
    if "model.layers.0.res_scale.residual_scale" in t.info:
        fail(f"{path}: stage 0 has a residual scale (it scales the embedding only)")
    for l in range(L):
        a, m = f"model.layers.{2 * l}.", f"model.layers.{2 * l + 1}."
        t.expect(a + "self_attn.qkv.linear_q.weight", (Q, D), f32)
        t.expect(a + "self_attn.qkv.val_proj2.weight", (KV // 2, D), f32)
        t.expect(a + "self_attn.qkv.conv_qk.1.weight", (C, 64, 2), f32)
        t.expect(a + "self_attn.qkv.temp", (2,), f32)
        t.expect(m + "zaya_block.router.rmsnorm_eda.weight", (R,), f32)
        t.expect(m + "zaya_block.router.router_mlp.4.weight", (E + 1, R), f32)
        for e in range(E):
            x = f"{m}zaya_block.experts.local_experts.{e}."
            t.expect(x + "linear_fc1.weight", (2 * F, D), f32)
            t.expect(x + "linear_fc2.weight", (D, F), f32)
    t.expect("model.res_scale.residual_bias", (D,), f32)
    t.expect("model.final_norm.weight", (D,), f32)
    if len(t.info) != 79:
        fail(f"{path}: {len(t.info)} tensors, expected 79")
    # Same checkpoint, two layouts: expert 2 of layer 1 is [gate; up] rows of the stacked tensor,
    # and the bf16 file is the fp32 one rounded (to within bf16's half ulp).
    stacked = hf.bf16("model.layers.1.mlp.experts.gate_up_proj")[2]
    fc1 = t.f32["model.layers.3.zaya_block.experts.local_experts.2.linear_fc1.weight"]
    if not np.allclose(stacked, fc1, rtol=2 ** -8, atol=0):
        fail(f"{path}: linear_fc1 of expert 2 (layer 3) differs from gate_up_proj[2] of layer 1 beyond bf16 rounding")
    bias_hf = hf.f32["model.layers.1.mlp.gate.balancing_biases"]
    bias_alt = t.f32["model.layers.3.zaya_block.router.balancing_biases"]
    if not np.array_equal(bias_hf, bias_alt):
        fail(f"{path}: balancing biases differ between the layouts (both are fp32)")
    # the legacy config derives the head width as hidden_size / num_attention_heads and counts
    # CCA query heads in cca_num_q_heads
    if config.get("num_hidden_layers") != 2 * L or config.get("ffn_hidden_size") != 2 * F or \
            config.get("zaya_use_mod") is not True or config.get("num_attention_heads") * 64 != D or \
            config.get("cca_num_q_heads") != 4 or config.get("num_query_groups") != 2:
        fail(f"{d}/config.json: alternating-layer keys wrong: {config}")


def main():
    if len(sys.argv) != 3:
        fail("usage: check_zaya_safetensors.py HF_DIR ALT_DIR")
    hf = check_hf(sys.argv[1])
    check_alternating(sys.argv[2], hf)
    print(f"check_zaya_safetensors: OK: safetensors read {sys.argv[1]}/model.safetensors (67 tensors, bf16, "
          f"zaya1 names) and {sys.argv[2]}/model.safetensors (79 tensors, fp32, alternating-layer names)")


if __name__ == "__main__":
    main()
