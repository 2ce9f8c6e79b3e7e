"""Bad input is refused with the documented exceptions and the library's messages."""

import numpy as np
import pytest
from conftest import fixture

import moeflow


@pytest.fixture(scope="module")
def olmoe():
    d, layer_index, x, _ = fixture("olmoe")
    return moeflow.MoeLayer.from_pretrained(d, layer=layer_index), x


def test_bad_tensors_are_value_errors(olmoe):
    layer, x = olmoe
    with pytest.raises(ValueError, match="not contiguous"):
        layer(x[:, ::2])
    with pytest.raises(ValueError, match="not contiguous"):
        layer(np.asfortranarray(x))
    with pytest.raises(ValueError, match=r"expected shape \[T, 32\], got \[7, 16\]"):
        layer(np.ascontiguousarray(x[:, :16]))
    with pytest.raises(ValueError, match=r"expected shape \[T, 32\]"):
        layer(x.reshape(-1))
    with pytest.raises(ValueError, match="dtype float64 is not one moeflow takes"):
        layer(x.astype(np.float64))
    with pytest.raises(ValueError, match="dtype int32"):
        layer(x.astype(np.int32))
    bad = x.copy()
    bad[2, 3] = np.inf
    with pytest.raises(ValueError, match="non-finite value inf in hidden_states at index 67"):
        layer(bad)
    with pytest.raises(TypeError, match="expected a tensor that speaks DLPack"):
        layer([[0.0] * 32])


def test_bad_options_are_value_errors():
    d, layer_index, _, _ = fixture("olmoe")
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        moeflow.MoeLayer.from_pretrained(d, layer=layer_index, strategy="fastest")
    with pytest.raises(ValueError, match="layer 0 is not a MoE layer|MoE layers"):
        moeflow.MoeLayer.from_pretrained(d, layer=7)
    with pytest.raises(ValueError, match="ep=2 needs the ranks of a launched job"):
        moeflow.MoeLayer.from_pretrained(d, layer=layer_index, ep=2)
    with pytest.raises(ValueError, match="device 'tpu'"):
        moeflow.MoeLayer.from_pretrained(d, layer=layer_index, device="tpu")
    with pytest.raises(ValueError, match="unknown CUDA option 'warp_speed'"):
        moeflow.MoeLayer.from_pretrained(d, layer=layer_index, cuda={"warp_speed": "9"})
    with pytest.raises(ValueError, match="MOEFLOW_GEMM_STREAMS"):
        moeflow.MoeLayer.from_pretrained(d, layer=layer_index, cuda={"gemm_streams": 0})
    assert "cpu" in moeflow.MoeLayer.from_pretrained(d, layer=layer_index, cuda={"cuda_graphs": False}).describe()
    with pytest.raises(ValueError, match="timeout"):
        moeflow.MoeLayer.from_pretrained(d, layer=layer_index, timeout=0)
    with pytest.raises(ValueError, match="weights load as f32 or bf16"):
        moeflow.MoeLayer.from_pretrained(d, layer=layer_index, dtype="f16")


def test_missing_checkpoint_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        moeflow.MoeLayer.from_pretrained(tmp_path / "nowhere")


@pytest.mark.skipif(moeflow.cuda_build, reason="this build has CUDA")
def test_gpu_layer_without_cuda_build_is_not_implemented():
    d, layer_index, _, _ = fixture("olmoe")
    with pytest.raises(NotImplementedError, match="built without CUDA"):
        moeflow.MoeLayer.from_pretrained(d, layer=layer_index, device="cuda")


def test_from_weights_refuses_mismatched_weights():
    rng = np.random.default_rng(0)
    gate = rng.standard_normal((4, 8), dtype=np.float32)
    w13 = rng.standard_normal((4, 6, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="w2"):
        moeflow.MoeLayer.from_weights(gate, w13=w13, w2=rng.standard_normal((4, 8, 5), dtype=np.float32), top_k=2)
    with pytest.raises(ValueError, match="top-k 5"):
        moeflow.MoeLayer.from_weights(gate, w13=w13, w2=rng.standard_normal((4, 8, 3), dtype=np.float32), top_k=5)
    with pytest.raises(ValueError, match="layer configuration"):
        moeflow.MoeLayer.from_weights(gate, w13=w13, w2=rng.standard_normal((4, 8, 3), dtype=np.float32), top_k=2,
                                      router="coin_flip")


def test_communication_error_is_a_runtime_error():
    assert issubclass(moeflow.CommunicationError, RuntimeError)
