"""The GPU layer from Python (needs a CUDA build of the package, torch with CUDA and a GPU;
skipped loudly otherwise): CUDA tensors in and out, the bits of `moeflow run --backend cuda`."""

import numpy as np
import pytest
from conftest import fixture, moeflow_run, relative_error, require_torch

import moeflow

# The command line's bound for GPU layers against transformers (bf16 GEMM inputs).
BF16_TOLERANCE = 2.5e-2


def require_gpu():
    torch = require_torch()
    if not moeflow.cuda_build or not torch.cuda.is_available():
        print("SKIPPED: no CUDA build of moeflow or no GPU")
        pytest.skip("no CUDA build of moeflow or no GPU")
    return torch


def test_cuda_tensors_in_and_out_match_moeflow_run(tmp_path):
    torch = require_gpu()
    d, layer_index, x, want = fixture("qwen3_moe")
    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index, device="cuda:0")
    assert layer.describe().startswith("cuda: one GPU")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        xt = torch.from_numpy(x).to("cuda:0")
        out = layer(xt)
    stream.synchronize()
    assert out.device == xt.device and out.dtype == torch.float32
    got = out.cpu().numpy()
    assert relative_error(got, want) <= BF16_TOLERANCE
    run = moeflow_run(tmp_path, d, layer_index, x, "--backend", "cuda")
    assert np.array_equal(got.view(np.uint32), run.view(np.uint32))
    assert np.array_equal(layer(x).view(np.uint32), run.view(np.uint32))


def test_cuda_tensors_stay_on_the_device_and_follow_the_current_stream():
    torch = require_gpu()
    d, layer_index, x, want = fixture("qwen3_moe")
    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index, device="cuda:0")
    host = layer(x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Work queued on the stream before the call: the layer must see its result.
        xt = torch.zeros(x.shape, dtype=torch.float32, device="cuda:0")
        xt.copy_(torch.from_numpy(x).to("cuda:0", non_blocking=True))
        out = layer(xt)
        doubled = out * 2
    stream.synchronize()
    assert np.array_equal(out.cpu().numpy().view(np.uint32), host.view(np.uint32))
    assert torch.equal(doubled, out * 2)
    half = layer(torch.from_numpy(x).to("cuda:0", dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16 and half.shape == out.shape
    # bfloat16 rows go in as they are: the float32 layer's output on the same values, rounded.
    widened = layer(torch.from_numpy(x).to("cuda:0", dtype=torch.bfloat16).float())
    assert torch.equal(half.view(torch.int16), widened.to(torch.bfloat16).view(torch.int16))
    with pytest.raises(ValueError, match="not contiguous"):
        layer(torch.from_numpy(x).to("cuda:0").t().contiguous().t())
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.zeros((3, layer.hidden_size + 1), device="cuda:0"))
