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
