"""CUDA tensors on one GPU without waiting for it (needs a CUDA build of the package, torch
with CUDA and a Hopper GPU; skipped loudly otherwise): `layer(x)` captured by
`torch.cuda.graph` replays with new inputs to the bits of direct calls, a call returns before
the GPU reaches it, non-finite values surface later, and layers that read the host refuse a
capture cleanly."""

import time

import numpy as np
import pytest
from conftest import fixture, require_torch

import moeflow


def hopper_layer(gemm="hopper"):
    """(torch, the qwen3_moe fixture's layer on cuda:0 with expert_gemm `gemm`, its input)."""
    torch = require_torch()
    if not moeflow.cuda_build or not torch.cuda.is_available():
        print("SKIPPED: no CUDA build of moeflow or no GPU")
        pytest.skip("no CUDA build of moeflow or no GPU")
    if torch.cuda.get_device_capability(0) != (9, 0):
        print("SKIPPED: the Hopper grouped GEMM (which reads the expert sizes on the device) needs a 9.0 GPU")
        pytest.skip("not a Hopper GPU")
    d, layer_index, x, _ = fixture("qwen3_moe")
    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index, device="cuda:0", cuda={"expert_gemm": gemm})
    return torch, layer, x


def bits(t):
    return t.detach().cpu().numpy().view(np.uint32)


def test_a_captured_layer_replays_new_inputs_to_the_bits_of_direct_calls():
    torch, layer, x = hopper_layer()
    static_x = torch.from_numpy(x).to("cuda:0")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up torch.cuda.graph asks for
        for _ in range(2):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    gen = torch.Generator().manual_seed(0)
    seen = []
    for scale in (1.0, 0.5, 3.0):
        new = torch.randn(x.shape, generator=gen) * scale
        static_x.copy_(new.to("cuda:0"))
        graph.replay()
        torch.cuda.synchronize()
        direct = layer(new.to("cuda:0"))
        torch.cuda.synchronize()
        assert np.array_equal(bits(static_out), bits(direct)), f"scale {scale}: replay against a direct call"
        assert np.array_equal(bits(static_out), layer(new.numpy()).view(np.uint32)), "against the host path"
        seen.append(bits(static_out).copy())
    assert not np.array_equal(seen[0], seen[1]), "the replays computed the new inputs"
    layer.synchronize()


def test_a_call_returns_before_the_gpu_reaches_it():
    torch, layer, x = hopper_layer()
    xt = torch.from_numpy(x).to("cuda:0")
    layer(xt)  # the first call of a batch size captures the layer's own graph, and waits
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued before the call
    start = time.perf_counter()
    out = layer(xt)
    returned = time.perf_counter() - start
    pending = not stream.query()
    torch.cuda.synchronize()
    assert pending, "the call waited for the GPU"
    assert returned < 0.2, f"the call took {returned:.3f} s"
    assert np.array_equal(bits(out), layer(x).view(np.uint32))


def test_nonfinite_values_surface_at_the_next_call_or_synchronize():
    torch, layer, x = hopper_layer()
    xt = torch.from_numpy(x).to("cuda:0")
    layer(xt)
    layer.synchronize()
    bad = xt.clone()
    bad[1, 3] = float("nan")
    layer(bad)  # returns without looking at its input
    with pytest.raises(ValueError, match="earlier call"):
        layer.synchronize()
    layer.synchronize()  # reported once
    layer(bad)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="earlier call"):
        layer(xt)
    out = layer(xt)
    layer.synchronize()
    assert np.array_equal(bits(out), layer(x).view(np.uint32))


def test_capture_needs_a_warm_up_and_layers_reading_the_host_refuse_it():
    torch, layer, x = hopper_layer()
    xt = torch.from_numpy(x).to("cuda:0")
    with pytest.raises(NotImplementedError, match="outside the capture first"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer(xt)
    torch.cuda.synchronize()
    _, cublas, _ = hopper_layer(gemm="cublas")
    cublas(xt)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(NotImplementedError, match="cuBLAS"):
        with torch.cuda.graph(graph):
            doubled = xt * 2
            cublas(xt)
    graph.replay()  # the capture ended cleanly, with what came before the refused call
    torch.cuda.synchronize()
    assert torch.equal(doubled, xt * 2)
    assert np.array_equal(bits(cublas(xt)), cublas(x).view(np.uint32))
