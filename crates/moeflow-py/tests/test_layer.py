"""MoeLayer on the fixture models: transformers' outputs, `moeflow run`'s bits, from_weights."""

import numpy as np
import pytest
from conftest import FAMILIES, TOLERANCE, fixture, moeflow_run, relative_error, require_torch

import moeflow


@pytest.mark.parametrize("name", FAMILIES)
def test_from_pretrained_matches_transformers_and_moeflow_run(name, tmp_path):
    d, layer_index, x, want = fixture(name)
    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index)
    assert layer.describe().startswith("cpu: modular layer, local, EP 1")
    got = layer(x)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == x.shape
    assert relative_error(got, want) <= TOLERANCE, name
    run = moeflow_run(tmp_path, d, layer_index, x)
    assert np.array_equal(got.view(np.uint32), run.view(np.uint32)), f"{name}: differs from moeflow run"


def test_options_reach_the_layer_as_on_the_command_line(tmp_path):
    d, layer_index, x, _ = fixture("qwen2_moe")
    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index, dtype="bf16", quant="fp8-block", chunk_size=3)
    run = moeflow_run(tmp_path, d, layer_index, x, "--dtype", "bf16", "--quant", "fp8-block", "--chunk-size", "3")
    assert np.array_equal(layer(x).view(np.uint32), run.view(np.uint32))
    assert layer.config["hidden"] == x.shape[1] and layer.hidden_size == x.shape[1]
    assert layer.device == "cpu"


def test_numpy_input_is_read_in_place_and_output_handed_over():
    d, layer_index, x, _ = fixture("olmoe")
    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index)
    assert moeflow._moeflow.dlpack_data_ptr(x) == x.ctypes.data
    buf = layer._layer.forward(x)
    first, second = np.from_dlpack(buf), np.from_dlpack(buf)
    assert first.ctypes.data == buf.data_ptr == second.ctypes.data
    first[0, 0] = 1234.5
    assert second[0, 0] == 1234.5


def test_empty_batch_gives_empty_output():
    d, layer_index, x, _ = fixture("mixtral")
    out = moeflow.MoeLayer.from_pretrained(d, layer=layer_index)(x[:0])
    assert out.shape == (0, x.shape[1])


def test_torch_tensors_in_and_out():
    torch = require_torch()
    d, layer_index, x, _ = fixture("olmoe")
    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index)
    want = layer(x)
    xt = torch.from_numpy(x.copy()).requires_grad_(True)
    assert moeflow._moeflow.dlpack_data_ptr(xt.detach()) == xt.data_ptr()
    out = layer(xt)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and not out.requires_grad
    assert np.array_equal(out.numpy(), want)
    half = layer(xt.detach().bfloat16())
    assert half.dtype == torch.bfloat16
    assert relative_error(half.float().numpy(), want) < 2e-2
    f16 = layer(xt.detach().half())
    assert f16.dtype == torch.float16 and relative_error(f16.float().numpy(), want) < 5e-3


def test_from_weights_of_the_transformers_block_matches_from_pretrained():
    torch = require_torch()
    transformers = pytest.importorskip("transformers")
    d, layer_index, x, want = fixture("olmoe")
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    block = model.model.layers[layer_index].mlp
    layer = moeflow.MoeLayer.from_weights(
        block.gate.weight, w13=block.experts.gate_up_proj, w2=block.experts.down_proj, top_k=block.gate.top_k,
        router="softmax", renormalize=bool(block.gate.norm_topk_prob))
    got = layer(torch.from_numpy(x))
    pretrained = moeflow.MoeLayer.from_pretrained(d, layer=layer_index)(x)
    assert np.array_equal(got.numpy(), pretrained)
    with torch.no_grad():
        theirs = block(torch.from_numpy(x)[None])[0].numpy()
    assert relative_error(got.numpy(), theirs) <= TOLERANCE
    assert relative_error(got.numpy(), want) <= TOLERANCE


def test_from_weights_per_expert_lists_and_shared_expert_from_numpy():
    from safetensors.numpy import load_file

    d, layer_index, x, want = fixture("qwen2_moe")
    w = {}
    for f in d.glob("*.safetensors"):
        if f.name.startswith("model"):
            w.update(load_file(f))
    p = f"model.layers.{layer_index}.mlp."
    experts = range(w[p + "gate.weight"].shape[0])
    s = p + "shared_expert."
    layer = moeflow.MoeLayer.from_weights(
        w[p + "gate.weight"],
        gate_proj=[w[f"{p}experts.{e}.gate_proj.weight"] for e in experts],
        up_proj=[w[f"{p}experts.{e}.up_proj.weight"] for e in experts],
        down_proj=[w[f"{p}experts.{e}.down_proj.weight"] for e in experts],
        shared_w13=np.concatenate([w[s + "gate_proj.weight"], w[s + "up_proj.weight"]]),
        shared_w2=w[s + "down_proj.weight"], shared_gate=w[p + "shared_expert_gate.weight"],
        top_k=moeflow.MoeLayer.from_pretrained(d, layer=layer_index).config["top_k"],
        renormalize=moeflow.MoeLayer.from_pretrained(d, layer=layer_index).config["router"]["renormalize"])
    pretrained = moeflow.MoeLayer.from_pretrained(d, layer=layer_index)
    assert layer.config == pretrained.config
    assert np.array_equal(layer(x), pretrained(x))
    assert relative_error(layer(x), want) <= TOLERANCE
