"""Tensors in and out: what the Rust half reads in place, and results in the caller's kind."""

import sys


def _torch():
    return sys.modules.get("torch")


def host_input(x, device):
    """``x`` as the Rust half reads it (host memory, read in place), and a function that turns
    the result's buffer into the caller's kind of tensor on the caller's device.

    torch tensors that require grad are detached (moeflow computes no gradients). CUDA torch
    tensors go through :func:`cuda_forward` instead; given to a CPU layer they are refused.
    """
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.requires_grad:
            x = x.detach()
        if x.device.type == "cpu":
            return x, torch.from_dlpack
        if x.device.type == "cuda" and device.startswith("cuda"):
            target = x.device
            return x.cpu(), lambda buf: torch.from_dlpack(buf).to(target)
        raise ValueError(f"hidden is on {x.device}, but this layer runs on {device}")
    return x, result_like(x)


def cuda_forward(layer, x):
    """The layer on a CUDA torch tensor ``x`` on the layer's own GPU, in device memory on
    torch's current stream, without a copy through the host (float32 and bfloat16 rows are read
    where they are, a bfloat16 result being the float32 one rounded; other dtypes are converted
    on the device and the result converted back); ``None`` for any other input, which goes
    through :func:`host_input`. Where the layer's run stays on the device the call returns
    without waiting for the GPU (and can be captured into a CUDA graph); torch's stream order
    keeps ``x`` and the result safe to use and free."""
    torch = _torch()
    if torch is None or not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        return None
    if not layer.device.startswith("cuda"):
        raise ValueError(f"hidden is on {x.device}, but this layer runs on {layer.device}")
    if f"cuda:{x.device.index}" != layer.device:
        raise ValueError(f"hidden is on {x.device}, but this layer runs on {layer.device}")
    if x.dim() != 2 or x.shape[1] != layer.hidden:
        raise ValueError(f"hidden_states: expected shape [T, {layer.hidden}], got {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("hidden is not contiguous (call .contiguous() first)")
    rows = x.detach()
    stream = current_stream(x.device)
    if rows.dtype == torch.bfloat16:
        out = torch.empty_like(rows)
        layer.forward_device_bf16(rows.data_ptr(), out.data_ptr(), rows.shape[0], stream)
        return out
    if rows.dtype != torch.float32:
        rows = rows.float()
    out = torch.empty_like(rows)
    layer.forward_device(rows.data_ptr(), out.data_ptr(), rows.shape[0], stream)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def cuda_device(x):
    """``x``'s device when it is a CUDA torch tensor, else ``None``."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cuda":
        return x.device
    return None


def staged(x):
    """``x`` in host memory: a CUDA torch tensor copied there (waiting for torch's current
    stream), detached; anything else as it is."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach()
        return x.cpu() if x.device.type == "cuda" else x
    return x


def current_stream(device):
    """torch's current raw CUDA stream on ``device`` (``"cuda:N"``)."""
    return _torch().cuda.current_stream(device).cuda_stream


def result_like(x):
    """The function that turns a result buffer into ``x``'s kind of array (no copy)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.ndarray):
        return numpy.from_dlpack
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return torch.from_dlpack
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is not None:
        return namespace().from_dlpack
    return lambda buf: buf


def weight(t):
    """A weight tensor as the Rust half copies it: detached, on the host, contiguous."""
    torch = _torch()
    if torch is not None and isinstance(t, torch.Tensor):
        return t.detach().cpu().contiguous()
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(t, numpy.ndarray):
        return numpy.ascontiguousarray(t)
    return t


def shape(t):
    """``t``'s shape as a tuple of ints."""
    return tuple(int(d) for d in t.shape)
