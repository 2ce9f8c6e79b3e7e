"""ExpertParallel on one rank: dispatch groups rows by expert, combine reduces them."""

import numpy as np
import pytest
from conftest import fixture, relative_error

import moeflow


def olmoe_weights():
    from safetensors.numpy import load_file

    d, layer_index, x, want = fixture("olmoe")
    w = load_file(d / "model.safetensors")
    p = f"model.layers.{layer_index}.mlp."
    e = range(w[p + "gate.weight"].shape[0])
    w13 = np.stack([np.concatenate([w[f"{p}experts.{i}.gate_proj.weight"], w[f"{p}experts.{i}.up_proj.weight"]])
                    for i in e])
    w2 = np.stack([w[f"{p}experts.{i}.down_proj.weight"] for i in e])
    return w[p + "gate.weight"], w13, w2, x, want


def route(gate, x, k):
    logits = x.astype(np.float64) @ gate.T.astype(np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    return ids.astype(np.int64), np.take_along_axis(p, ids, 1).astype(np.float32)


def experts(rows, counts, local, w13, w2):
    out, start = np.zeros_like(rows), 0
    for e, c in zip(local, counts):
        r = rows[start:start + c].astype(np.float64)
        gu = r @ w13[e].T.astype(np.float64)
        g, u = np.split(gu, 2, axis=1)
        out[start:start + c] = (g / (1 + np.exp(-g)) * u) @ w2[e].T.astype(np.float64)
        start += c
    return out


def test_dispatch_groups_by_expert_and_combine_gives_the_layer():
    gate, w13, w2, x, want = olmoe_weights()
    ids, weights = route(gate, x, 2)
    ep = moeflow.ExpertParallel(num_experts=8, hidden=32)
    assert ep.strategy == "local" and ep.local_experts == list(range(8))
    handle, rows, counts = ep.dispatch(x, ids, weights)
    assert counts.dtype == np.int64 and counts.sum() == rows.shape[0] == x.shape[0] * 2
    assert list(counts) == [int((ids == e).sum()) for e in range(8)]
    start = 0
    for e, c in enumerate(counts):
        tokens = sorted(np.nonzero((ids == e).any(1))[0])
        assert np.array_equal(rows[start:start + c], x[tokens])
        start += c
    out = ep.combine(experts(rows, counts, ep.local_experts, w13, w2), handle)
    assert out.shape == x.shape and relative_error(out, want) <= 1e-5
    with pytest.raises(ValueError, match="combined already"):
        ep.combine(np.zeros_like(rows), handle)


def test_dispatch_refuses_bad_routing():
    _, _, _, x, _ = olmoe_weights()
    ep = moeflow.ExpertParallel(num_experts=8, hidden=32)
    ids = np.zeros((7, 2), np.int64)
    w = np.ones((7, 2), np.float32)
    with pytest.raises(ValueError, match="expert id 9 out of range"):
        ep.dispatch(x, ids + 9, w)
    with pytest.raises(ValueError, match=r"topk_weights \[7, 3\]"):
        ep.dispatch(x, ids, np.ones((7, 3), np.float32))
    with pytest.raises(ValueError, match="expected float32"):
        ep.dispatch(x, ids, w.astype(np.float16))
    handle, rows, _ = ep.dispatch(x, ids, w)
    with pytest.raises(ValueError, match=r"expected shape \[14, 32\]"):
        ep.combine(rows[:3], handle)
    with pytest.raises(ValueError, match="lowlatency"):
        moeflow.ExpertParallel(num_experts=8, hidden=32, strategy="lowlatency")


def test_cuda_tensors_are_staged_through_the_host_to_the_same_bits():
    from conftest import require_torch

    torch = require_torch()
    if not torch.cuda.is_available():
        print("SKIPPED: no GPU for CUDA tensors")
        pytest.skip("no GPU")
    gate, w13, w2, x, _ = olmoe_weights()
    ids, weights = route(gate, x, 2)
    ep = moeflow.ExpertParallel(num_experts=8, hidden=32)
    handle, rows, counts = ep.dispatch(x, ids, weights)
    want = ep.combine(experts(rows, counts, ep.local_experts, w13, w2), handle)
    gpu = [torch.from_numpy(a).to("cuda:0") for a in (x, ids, weights)]
    handle, rows_d, counts_d = ep.dispatch(*gpu)
    assert rows_d.device == counts_d.device == gpu[0].device and counts_d.dtype == torch.int64
    assert np.array_equal(rows_d.cpu().numpy(), rows) and np.array_equal(counts_d.cpu().numpy(), counts)
    expert_out = torch.from_numpy(experts(rows, counts, ep.local_experts, w13, w2)).to("cuda:0")
    out = ep.combine(expert_out, handle)
    assert out.device == gpu[0].device
    assert np.array_equal(out.cpu().numpy().view(np.uint32), want.view(np.uint32))
