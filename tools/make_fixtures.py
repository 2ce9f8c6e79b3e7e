#!/usr/bin/env python3
"""Builds the conformance fixtures under fixtures/: tiny random Hugging Face MoE models of every
supported family, saved with `save_pretrained`, and the float32 output of one MoE block on random
hidden states, computed by `transformers` itself.

Not run by CI. Needs torch and transformers from PyPI:
    pip install torch transformers safetensors
    python3 tools/make_fixtures.py            # rewrites fixtures/

Each fixture directory holds the checkpoint (config.json + safetensors, sharded for mixtral),
input.safetensors (`hidden_states` [T, H]), expected.safetensors (`hidden_states` [T, H], the
block's output) and meta.json (the layer). Two variants store quantized weights the way the
released checkpoints do: gpt_oss_mxfp4 (MXFP4 blocks and e8m0 scales) and deepseek_v3_fp8 (fp8
e4m3 with weight_scale_inv per block); their expected output comes from the same model with the
dequantized weights, loaded back through transformers. deepseek_v3_fp8_128 stores a wider
DeepSeek-V3 (hidden 256, experts 128 wide, 128 tokens) in the released checkpoints' own 128 ×
128 blocks, the shapes the GPU's fp8 GEMM takes. `--only NAME,...` writes just those fixtures.
"""
import argparse
import json
import os
import re
import shutil
import tempfile

import torch
import transformers as tf
from safetensors.torch import load_file, save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")
TOKENS = 7
SMALL = dict(vocab_size=32, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def deepseek_attention():
    return dict(q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8)


FAMILIES = {
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, 1,
                dict(hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, 1,
                  dict(hidden_size=32, intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       num_hidden_layers=2, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[0])),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, 0,
                  dict(hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)),
    "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM, 1,
              dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, 1,
                    dict(hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3, n_routed_experts=8,
                         n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="group_limited_greedy",
                         n_group=4, topk_group=2, routed_scaling_factor=2.0, norm_topk_prob=False, **deepseek_attention())),
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, 2,
                    dict(hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3, n_routed_experts=8,
                         n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, norm_topk_prob=True, **deepseek_attention())),
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, 1,
                dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                     head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
}


def randomize(model, gen):
    """Weights large enough that routing and activations are not trivial."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:
                fan_in = p.shape[-1] if p.dim() >= 2 else 1
                scale = 2.0 / fan_in ** 0.5 if p.dim() >= 2 else 0.2
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.rand(b.shape, generator=gen) * 0.2 - 0.1)


def block_output(model, layer, x):
    block = model.model.layers[layer].mlp
    with torch.no_grad():
        out = block(x.unsqueeze(0))
    if isinstance(out, tuple):
        out = out[0]
    return out.reshape(x.shape).float()


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(w):
    """w [E, out, in] -> blocks [E, out, in/32, 16] u8, scales [E, out, in/32] u8, dequantized w."""
    e, o, i = w.shape
    g = w.reshape(e, o, i // 32, 32)
    amax = g.abs().amax(-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1).to(torch.uint8)
    deq = (FP4[codes.long()] * torch.pow(2.0, exp).unsqueeze(-1)).reshape(e, o, i)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous(), deq


def fp8_quantize(w, block):
    """w [n, k] -> fp8 e4m3 weight, weight_scale_inv [ceil(n/b), ceil(k/b)], dequantized w."""
    n, k = w.shape
    bn, bk = -(-n // block), -(-k // block)
    scale = torch.zeros(bn, bk)
    for a in range(bn):
        for c in range(bk):
            scale[a, c] = w[a * block:(a + 1) * block, c * block:(c + 1) * block].abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def save_fixture(name, directory, layer, x, expected):
    save_file({"hidden_states": x.contiguous()}, os.path.join(directory, "input.safetensors"))
    save_file({"hidden_states": expected.contiguous()}, os.path.join(directory, "expected.safetensors"))
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump({"layer": layer, "tokens": x.shape[0], "family": name}, f, indent=2)
    for extra in ["generation_config.json"]:
        p = os.path.join(directory, extra)
        if os.path.exists(p):
            os.remove(p)


def reload_expected(config_cls_model, src_dir, state, layer, x):
    """The block output of the model whose Hub-format weights are `state`."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(src_dir, "config.json"), tmp)
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        model = config_cls_model.from_pretrained(tmp, torch_dtype=torch.float32)
        return block_output(model.eval(), layer, x)


def fp8_variant(model_cls, out, layer, x, block, name):
    """The checkpoint at `out` with its experts' and shared experts' weights in fp8 e4m3 blocks of
    `block`, as fixture `name`, against the model with the dequantized weights."""
    state = load_file(os.path.join(out, "model.safetensors"))
    quant, deq = dict(state), dict(state)
    for key in list(state):
        if re.fullmatch(r".*mlp\.(experts\.\d+|shared_experts)\.(gate|up|down)_proj\.weight", key):
            q, scale, w = fp8_quantize(state[key].float(), block)
            quant[key], quant[key + "_scale_inv"] = q, scale
            deq[key] = w
    qdir = os.path.join(ROOT, name)
    shutil.rmtree(qdir, ignore_errors=True)
    os.makedirs(qdir)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(qdir, "config.json"), "w") as f:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
        json.dump(cfg, f, indent=2)
    save_file(quant, os.path.join(qdir, "model.safetensors"), metadata={"format": "pt"})
    save_fixture(name, qdir, layer, x, reload_expected(model_cls, out, deq, layer, x))
    print(f"{name} written")


def deepseek_v3_fp8_128():
    """A wider DeepSeek-V3 with 128 × 128 fp8 blocks; only the fp8 checkpoint is kept."""
    gen = torch.Generator().manual_seed(128)
    kwargs = dict(hidden_size=256, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=2,
                  n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, **deepseek_attention())
    config = tf.DeepseekV3Config(**SMALL, **kwargs)
    model = tf.DeepseekV3ForCausalLM(config).float().eval()
    randomize(model, gen)
    x = torch.randn(128, config.hidden_size, generator=gen)
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        fp8_variant(tf.DeepseekV3ForCausalLM, out, 1, x, 128, "deepseek_v3_fp8_128")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated fixtures to write (default: all)")
    only = [n for n in ap.parse_args().only.split(",") if n]
    wanted = lambda n: not only or n in only
    torch.manual_seed(0)
    for name, (config_cls, model_cls, layer, kwargs) in FAMILIES.items():
        if not (wanted(name) or (name == "gpt_oss" and wanted("gpt_oss_mxfp4"))
                or (name == "deepseek_v3" and wanted("deepseek_v3_fp8"))):
            continue
        gen = torch.Generator().manual_seed(len(name))
        config = config_cls(**SMALL, **kwargs)
        model = model_cls(config).float().eval()
        randomize(model, gen)
        x = torch.randn(TOKENS, config.hidden_size, generator=gen)
        expected = block_output(model, layer, x)
        out = os.path.join(ROOT, name)
        shutil.rmtree(out, ignore_errors=True)
        shard = "40KB" if name == "mixtral" else "50MB"
        model.save_pretrained(out, max_shard_size=shard)
        save_fixture(name, out, layer, x, expected)
        print(f"{name}: layer {layer}, |out| max {expected.abs().max():.3f}")

        if name == "gpt_oss":
            state = load_file(os.path.join(out, "model.safetensors"))
            quant, deq = dict(state), dict(state)
            for key in list(state):
                m = re.fullmatch(r"(.*mlp\.experts\.(gate_up_proj|down_proj))", key)
                if not m:
                    continue
                blocks, scales, w = mxfp4_quantize(state[key].transpose(1, 2).float())
                del quant[key]
                quant[key + "_blocks"], quant[key + "_scales"] = blocks, scales
                deq[key] = w.transpose(1, 2).contiguous()
            qdir = os.path.join(ROOT, "gpt_oss_mxfp4")
            shutil.rmtree(qdir, ignore_errors=True)
            os.makedirs(qdir)
            shutil.copy(os.path.join(out, "config.json"), qdir)
            save_file(quant, os.path.join(qdir, "model.safetensors"), metadata={"format": "pt"})
            save_fixture("gpt_oss_mxfp4", qdir, layer, x, reload_expected(model_cls, out, deq, layer, x))
            print("gpt_oss_mxfp4 written")

        if name == "deepseek_v3":
            fp8_variant(model_cls, out, layer, x, 8, "deepseek_v3_fp8")
    if wanted("deepseek_v3_fp8_128"):
        deepseek_v3_fp8_128()


if __name__ == "__main__":
    main()
