"""Tensors in and out: what the Rust half reads in place, and results in the caller's kind."""

import sys


def _torch():
    return sys.modules.get("torch")


def host_input(x, device):
    """``x`` as the Rust half reads it (host memory, read in place), and a function that turns
    the result's buffer into the caller's kind of tensor on the caller's device.

    torch tensors that require grad are detached (moeflow computes no gradients). A CUDA torch
    tensor given to a CUDA layer is copied to the host on the current stream and the result
    copied back (see the README); given to a CPU layer it is refused.
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
