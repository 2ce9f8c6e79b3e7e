"""One rank of the expert-parallel tests (started by test_expert_parallel_ranks.py with the
torchrun variables set, or by torchrun in test_torchrun.py): runs the fixture's block, or
dispatch/combine, on this rank's share of the tokens and saves the result as OUT (.npy;
``{rank}`` in it becomes the rank).

    python ep_rank.py MODE FIXTURE OUT [DEVICE]     # MODE: layer, dispatch or fail

DEVICE ``cuda`` runs the layer on LOCAL_RANK's GPU, in deterministic mode, on CUDA tensors.
"""

import sys

import numpy as np
from conftest import fixture

import moeflow

mode, name = sys.argv[1], sys.argv[2]
device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
d, layer_index, x, _ = fixture(name)
w = moeflow.world(gpu=device.startswith("cuda"))
out_path = sys.argv[3].format(rank=w.rank)
half = (x.shape[0] + 1) // 2
mine = x[:half] if w.rank == 0 else x[half:]

if mode == "layer" and device.startswith("cuda"):
    import torch

    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index, placement="round-robin", timeout=60,
                                             device=device, deterministic=True)
    assert f"EP {w.size}" in layer.describe(), layer.describe()
    assert layer.device == f"cuda:{w.local_rank}", layer.device
    torch.cuda.set_device(w.local_rank)
    out = layer(torch.from_numpy(mine).to(layer.device))
    assert out.device == torch.device(layer.device), out.device
    np.save(out_path, out.cpu().numpy())
elif mode == "layer":
    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index, placement="round-robin", timeout=20,
                                             device=device)
    assert f"EP {w.size}" in layer.describe(), layer.describe()
    np.save(out_path, layer(mine))
elif mode == "dispatch":
    from test_dispatch_combine import experts, olmoe_weights, route

    gate, w13, w2, _, _ = olmoe_weights()
    ids, weights = route(gate, mine, 2)
    ep = moeflow.ExpertParallel(num_experts=8, hidden=32, timeout=20)
    handle, rows, counts = ep.dispatch(mine, ids, weights)
    assert len(counts) == len(ep.local_experts) == 4
    np.save(out_path, ep.combine(experts(rows, counts, ep.local_experts, w13, w2), handle))
elif mode == "fail":
    layer = moeflow.MoeLayer.from_pretrained(d, layer=layer_index, timeout=20)
    if w.rank == 1:
        mine = mine[:, :5]  # a bad batch: this rank fails, and so must the other one, at once
    try:
        layer(mine)
    except moeflow.CommunicationError as e:
        print(f"CommunicationError: {e}")
        sys.exit(3)
    except ValueError as e:
        print(f"ValueError: {e}")
        sys.exit(2)
