"""Expert parallelism over 2 processes started as torchrun starts them (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT): the ranks' outputs equal one rank's bit for bit."""

import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
from conftest import fixture, relative_error

import moeflow

HERE = pathlib.Path(__file__).resolve().parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode, name, tmp_path, ranks=2):
    """Runs ep_rank.py as `ranks` processes; returns (exit codes, outputs, each rank's text)."""
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(HERE))
        cmd = [sys.executable, str(HERE / "ep_rank.py"), mode, name, str(tmp_path / f"rank{r}.npy")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    texts = [p.communicate(timeout=120)[0] for p in procs]
    codes = [p.returncode for p in procs]
    outs = [np.load(tmp_path / f"rank{r}.npy") if codes[r] == 0 else None for r in range(ranks)]
    return codes, outs, texts


def test_layer_over_two_ranks_equals_one_rank(tmp_path):
    d, layer_index, x, _ = fixture("qwen2_moe")
    codes, outs, texts = launch("layer", "qwen2_moe", tmp_path)
    assert codes == [0, 0], texts
    want = moeflow.MoeLayer.from_pretrained(d, layer=layer_index)(x)
    got = np.concatenate(outs)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_dispatch_combine_over_two_ranks(tmp_path):
    _, _, x, want = fixture("olmoe")
    codes, outs, texts = launch("dispatch", "olmoe", tmp_path)
    assert codes == [0, 0], texts
    assert relative_error(np.concatenate(outs), want) <= 1e-5


def test_a_failing_rank_fails_the_other_at_once(tmp_path):
    start = time.monotonic()
    codes, _, texts = launch("fail", "olmoe", tmp_path)
    assert codes == [3, 2], texts
    # Rank 0 names rank 1: with its reason when the abort arrives before rank 1 exits, else as lost.
    assert "rank 1" in texts[0] and "not contiguous" in texts[1], texts
    assert time.monotonic() - start < 15, "the healthy rank waited for its deadline"
