"""examples/replace_moe_block.py: a transformers model with moeflow's MoE blocks gives the
model's logits."""

import subprocess
import sys

import pytest
from conftest import FIXTURES, REPO, require_torch


@pytest.mark.parametrize("name", ["olmoe", "qwen3_moe"])
def test_replacing_the_moe_blocks_keeps_the_logits(name):
    require_torch()
    pytest.importorskip("transformers")
    res = subprocess.run([sys.executable, str(REPO / "examples/replace_moe_block.py"), "--model",
                          str(FIXTURES / name)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 MoE blocks replaced by moeflow" in res.stdout and "logits match" in res.stdout, res.stdout
