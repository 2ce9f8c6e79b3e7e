"""Expert parallelism under torchrun itself (`python -m torch.distributed.run --nproc-per-node
2`), whose agent holds MASTER_PORT: CPU ranks (needs torch) and GPU ranks (needs a CUDA build,
2 GPUs of compute capability 9.0 for deterministic mode; skipped loudly otherwise), each rank
on its own tokens, the outputs equal to one rank's (one GPU's) bit for bit."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import fixture, require_torch
from test_expert_parallel_ranks import free_port

import moeflow

HERE = pathlib.Path(__file__).resolve().parent
LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOEFLOW_JOB", "MOEFLOW_BIND")


def torchrun(tmp_path, *args):
    """ep_rank.py ARGS on 2 ranks under torchrun; the ranks' outputs, in rank order."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH}
    env["PYTHONPATH"] = str(HERE)
    out = tmp_path / "rank{rank}.npy"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(HERE / "ep_rank.py"),
           args[0], args[1], str(out), *args[2:]]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    return [np.load(tmp_path / f"rank{r}.npy") for r in range(2)]


def test_cpu_ranks_under_torchrun_equal_one_rank(tmp_path):
    require_torch()
    d, layer_index, x, _ = fixture("qwen2_moe")
    got = np.concatenate(torchrun(tmp_path, "layer", "qwen2_moe"))
    want = moeflow.MoeLayer.from_pretrained(d, layer=layer_index)(x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_gpu_ranks_under_torchrun_equal_one_gpu(tmp_path):
    torch = require_torch()
    if not moeflow.cuda_build or torch.cuda.device_count() < 2:
        print("SKIPPED: expert parallelism on GPUs needs a CUDA build of moeflow and 2 GPUs")
        pytest.skip("no CUDA build of moeflow or fewer than 2 GPUs")
    if any(torch.cuda.get_device_capability(i) != (9, 0) for i in range(2)):
        print("SKIPPED: deterministic mode (bit-identical layouts) needs GPUs of compute capability 9.0")
        pytest.skip("not Hopper GPUs")
    d, layer_index, x, _ = fixture("qwen2_moe")
    got = np.concatenate(torchrun(tmp_path, "layer", "qwen2_moe", "cuda"))
    one = moeflow.MoeLayer.from_pretrained(d, layer=layer_index, device="cuda:0", deterministic=True)
    want = one(torch.from_numpy(x).to("cuda:0")).cpu().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
