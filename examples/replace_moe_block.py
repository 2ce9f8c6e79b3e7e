"""Replaces the MoE blocks of a transformers model with moeflow's layer and checks the logits.

    python examples/replace_moe_block.py                 # the tiny OLMoE fixture, on CPU
    python examples/replace_moe_block.py --model DIR --device cuda

Each MoE block hands its tensors to `moeflow.MoeLayer.from_weights` (no files read); the model
then runs with moeflow computing every MoE block, and its logits are compared with the
model's own. Needs torch and transformers.
"""

import argparse
import pathlib

import torch
import transformers

import moeflow


class MoeflowBlock(torch.nn.Module):
    """A drop-in for an OLMoE / Qwen3-MoE sparse MoE block: `[B, S, H]` → `[B, S, H]`."""

    def __init__(self, block, device):
        super().__init__()
        self.layer = moeflow.MoeLayer.from_weights(
            block.gate.weight, w13=block.experts.gate_up_proj, w2=block.experts.down_proj,
            top_k=block.gate.top_k, router="softmax", renormalize=bool(block.gate.norm_topk_prob), device=device)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        return self.layer(hidden_states.reshape(-1, shape[-1]).contiguous()).reshape(shape)


def main():
    here = pathlib.Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(here.parent / "fixtures" / "olmoe"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(a.device).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(a.device)
    with torch.no_grad():
        want = model(ids).logits
        replaced = 0
        for decoder_layer in model.model.layers:
            if hasattr(decoder_layer.mlp, "experts"):
                decoder_layer.mlp = MoeflowBlock(decoder_layer.mlp, a.device)
                replaced += 1
        got = model(ids).logits
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"{replaced} MoE blocks replaced by moeflow ({decoder_layer.mlp.layer.describe()})")
    print(f"logits [{', '.join(map(str, got.shape))}]: max relative difference {err:.2e}")
    tolerance = 1e-4 if a.device == "cpu" else 3e-2
    if err > tolerance:
        raise SystemExit(f"logits differ by more than {tolerance:g}")
    print("logits match")


if __name__ == "__main__":
    main()
