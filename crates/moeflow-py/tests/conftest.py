"""Shared pieces of the package's tests: the fixture models and the `moeflow` binary."""

import json
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

REPO = pathlib.Path(__file__).resolve().parents[3]
FIXTURES = REPO / "fixtures"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "meta.json").exists())

# The command line's bound against transformers' output (crates/moeflow-cli/tests/cli.rs).
TOLERANCE = 1e-5


def fixture(name):
    """`(model_dir, layer, input [T, H], transformers' output [T, H])` of fixture `name`."""
    d = FIXTURES / name
    layer = json.loads((d / "meta.json").read_text())["layer"]
    x = load_file(d / "input.safetensors")["hidden_states"]
    want = load_file(d / "expected.safetensors")["hidden_states"]
    return d, layer, x, want


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


def moeflow_binary():
    """The `moeflow` command line: $MOEFLOW_BIN, else the workspace's release or debug build."""
    for p in [os.environ.get("MOEFLOW_BIN"), REPO / "target/release/moeflow", REPO / "target/debug/moeflow",
              shutil.which("moeflow")]:
        if p and pathlib.Path(p).exists():
            return str(p)
    return None


def moeflow_run(tmp_path, model_dir, layer, x, *args):
    """`moeflow run` on `x`; its output [T, H] f32."""
    binary = moeflow_binary()
    if binary is None:
        pytest.fail("no moeflow binary: build it (cargo build --release -p moeflow-cli) or set MOEFLOW_BIN")
    src, dst = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({"hidden_states": np.ascontiguousarray(x)}, src)
    cmd = [binary, "run", "--model", str(model_dir), "--layer", str(layer), "--input", str(src),
           "--output", str(dst), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return load_file(dst)["hidden_states"]


def require_torch():
    """torch, or a loud skip when it is not installed."""
    try:
        import torch
    except ImportError:
        print("SKIPPED: torch is not installed (pip install torch)")
        pytest.skip("torch is not installed")
    return torch
