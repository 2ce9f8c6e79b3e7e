"""MoeLayer: one MoE block, from a checkpoint or from tensors."""

import json

from . import _moeflow
from ._tensors import cuda_forward, current_stream, host_input, shape, weight
from .distributed import resolve

_OPTION_DOC = """
        Layout and run options (the command line's flags of the same names):

        - ``ep``: expert-parallel ranks (default: the launched job's ``WORLD_SIZE``, else 1);
          every rank runs this call and then calls the layer with its own tokens.
        - ``tp``: tensor-parallel ranks per group (consecutive ranks hold the same tokens).
        - ``strategy``: ``local``, ``allgather``, ``allgather-logits``, ``multicast``,
          ``all2allv`` or ``lowlatency`` (default: local on one rank, all2allv otherwise).
        - ``placement``: ``contiguous``, ``round-robin`` or a JSON file; ``redundant``: expert
          ids given a replica; ``dual_batch``; ``max_tokens_per_rank`` (lowlatency capacity);
          ``sequence_parallel``.
        - ``quant``: ``none``, ``int8``, ``fp8``, ``fp8-block``, ``mxfp8``;
          ``defer_input_quant``; ``bf16_matmul``: ``auto``, ``widen``, ``dot``.
        - ``deterministic``: GPU outputs bit-identical whatever the layout (CPU ones always are).
        - ``timeout``: deadline of every collective and of :meth:`MoeLayer.synchronize`, seconds; ``allow_nonfinite``;
          ``chunk_size``; ``cuda``: a dict of GPU options (``expert_gemm``, ``cuda_graphs``,
          ... as the ``MOEFLOW_*`` variables, lower case without the prefix).
"""


def _options(ep, device, options):
    if "cuda" in options:
        options["cuda"] = {k: str(int(v)) if isinstance(v, bool) else str(v) for k, v in options["cuda"].items()}
    timeout = options.get("timeout", 60.0)
    ep, world = resolve(ep, device, timeout)
    return _moeflow.Options(ep=ep, **options), world


class MoeLayer:
    """One MoE block on this rank: ``layer(hidden)`` maps ``hidden [T, H]`` to ``[T, H]``.

    ``hidden`` is any tensor that speaks DLPack (``torch.Tensor``, ``numpy.ndarray``, ...),
    float32, bfloat16 or float16, contiguous (a non-contiguous tensor is refused, not copied).
    The result is the same kind of tensor, dtype and device. float32 rows are read in place and
    the result's memory is handed over without a copy; bfloat16 and float16 rows are widened
    to float32 (the layer computes in float32) and the result rounded back. The GIL is
    released while the layer computes. No gradients: the result does not require grad.

    CUDA torch tensors given to a ``device="cuda"`` layer stay on the device, ordered on
    torch's current stream. On one GPU, where the layer's run reads nothing on the host (its
    expert GEMMs read the expert sizes on the device: the Hopper grouped GEMM, compute
    capability 9.0, ``cuda={"expert_gemm": "hopper"}`` at every batch size), the call returns
    without waiting for the GPU, and ``torch.cuda.graph`` can capture it: call the layer once
    on the captured batch size first (the warm-up torch asks for), keep the layer alive as long
    as the graph, and order replays and direct calls (one stream, as torch does). Such a call's
    non-finite inputs or outputs, and device errors, are raised by a later call once its work
    has finished, or by :meth:`synchronize`. The first call of each batch size waits (the
    layer captures its own graph). Elsewhere (cuBLAS expert GEMMs, expert-parallel ranks,
    which exchange counts through the host) the call waits for the GPU and a capture is
    refused with ``NotImplementedError`` saying why.
    """

    def __init__(self, layer):
        self._layer = layer

    @classmethod
    def from_pretrained(cls, model_dir, layer=None, device="cpu", dtype="f32", quant="none", strategy=None,
                        deterministic=False, ep=None, **options):
        """Loads decoder layer ``layer``'s MoE block (default: the first MoE layer) of the Hugging
        Face checkpoint in ``model_dir`` as ``moeflow run`` does (mixtral, qwen2_moe, qwen3_moe,
        olmoe, deepseek_v2, deepseek_v3, gpt_oss; only that block is read). ``device``:
        ``"cpu"``, ``"cuda"`` (``LOCAL_RANK``'s GPU under a launcher, else GPU 0) or
        ``"cuda:N"``; ``dtype``: the expert weights' dtype, ``"f32"`` or ``"bf16"``.
        """
        opts, world = _options(ep, device, dict(options, quant=quant, strategy=strategy,
                                                deterministic=deterministic))
        return cls(_moeflow.Layer.from_pretrained(str(model_dir), layer, dtype, device, opts, world))

    @classmethod
    def from_weights(cls, gate, *, top_k, w13=None, w2=None, gate_proj=None, up_proj=None, down_proj=None,
                     router="softmax", renormalize=False, activation="silu", gate_bias=None,
                     correction_bias=None, b13=None, b2=None, shared_w13=None, shared_w2=None, shared_gate=None,
                     apply_router_weight_on_input=False, device="cpu", ep=None, **options):
        """A layer from the tensors a model already holds (copied, in their dtype):

        - ``gate [E, H]``: the router; ``top_k``.
        - Routed experts: ``w13 [E, 2I, H]`` (gate projection rows, then up projection rows)
          and ``w2 [E, H, I]``, or per-expert lists ``gate_proj``, ``up_proj`` (``[I, H]``) and
          ``down_proj`` (``[H, I]``); optional biases ``b13 [E, 2I]``, ``b2 [E, H]``.
        - ``router``: ``"softmax"`` (renormalised when ``renormalize``), ``"top_k_softmax"``
          (GPT-OSS), or a dict such as ``{"kind": "sigmoid_grouped", "n_group": 8,
          "topk_group": 4, "renormalize": True, "scaling": 2.5}`` (DeepSeek-V3; also
          ``softmax_grouped``); ``gate_bias [E]`` added to the logits; ``correction_bias [E]``
          (DeepSeek-V3's selection bias).
        - ``activation``: ``"silu"``, ``"gelu_erf"``, ``"gelu_tanh"`` or
          ``{"kind": "swiglu_oai", "alpha": 1.702, "limit": 7.0}``.
        - Shared expert: ``shared_w13 [2Is, H]``, ``shared_w2 [H, Is]``, optional per-token
          sigmoid gate ``shared_gate [H]`` (Qwen2-MoE).
        """
        weights = {"gate": gate, "w13": w13, "w2": w2, "gate_bias": gate_bias, "correction_bias": correction_bias,
                   "b13": b13, "b2": b2, "shared_w13": shared_w13, "shared_w2": shared_w2,
                   "shared_gate": shared_gate}
        weights = {k: weight(v) for k, v in weights.items() if v is not None}
        for name, value in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if value is not None:
                weights[name] = [weight(v) for v in value]
        num_experts, hidden = shape(weights["gate"])
        if "w2" in weights:
            inter = shape(weights["w2"])[-1]
        elif "down_proj" in weights:
            inter = shape(weights["down_proj"][0])[-1]
        else:
            raise ValueError("weights: give 'w13' and 'w2', or 'gate_proj', 'up_proj' and 'down_proj'")
        if isinstance(router, str):
            router = {"kind": router, "renormalize": renormalize} if router == "softmax" else {"kind": router}
        if isinstance(activation, str):
            activation = {"kind": activation}
        config = {"hidden": hidden, "inter": inter, "num_experts": num_experts, "top_k": int(top_k),
                  "router": router, "activation": activation,
                  "apply_router_weight_on_input": bool(apply_router_weight_on_input), "shared": None}
        if "shared_w2" in weights:
            config["shared"] = {"inter": shape(weights["shared_w2"])[-1], "gated": "shared_gate" in weights}
        opts, world = _options(ep, device, options)
        return cls(_moeflow.Layer.from_weights(json.dumps(config), weights, device, opts, world))

    def __call__(self, hidden):
        """``hidden [T, H]`` → ``[T, H]``: see the class."""
        return self.forward(hidden)

    def forward(self, hidden):
        """``hidden [T, H]`` → ``[T, H]``: see the class."""
        out = cuda_forward(self._layer, hidden)
        if out is not None:
            return out
        x, result = host_input(hidden, self._layer.device)
        return result(self._layer.forward(x))

    def synchronize(self):
        """Waits (up to the layer's ``timeout``) for the layer's calls on CUDA tensors and the
        work on torch's current stream, then raises what those calls found: ``ValueError`` for
        a non-finite input, ``RuntimeError`` for a non-finite output or a device error,
        ``CommunicationError`` when the deadline passes. Nothing to do on a CPU layer."""
        if self._layer.device.startswith("cuda"):
            self._layer.synchronize(current_stream(self._layer.device))

    def describe(self):
        """One line naming the backend, the path the library chose and why, and the layout."""
        return self._layer.describe()

    @property
    def config(self):
        """The block's configuration (shapes, router, activation, shared expert) as a dict."""
        return json.loads(self._layer.config_json())

    @property
    def hidden_size(self):
        """H."""
        return self._layer.hidden

    @property
    def device(self):
        """``"cpu"`` or ``"cuda:N"``."""
        return self._layer.device

    def __repr__(self):
        return f"MoeLayer({self.describe()})"


MoeLayer.from_pretrained.__func__.__doc__ += _OPTION_DOC
MoeLayer.from_weights.__func__.__doc__ += _OPTION_DOC
