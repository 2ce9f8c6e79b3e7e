"""moeflow: a Mixture-of-Experts layer engine, on PyTorch and NumPy tensors.

- :class:`MoeLayer` runs one MoE block (router, dispatch, experts, combine), loaded from a
  Hugging Face checkpoint (:meth:`MoeLayer.from_pretrained`) or handed over as tensors
  (:meth:`MoeLayer.from_weights`); ``layer(hidden)`` maps ``[T, H]`` to ``[T, H]``.
- :class:`ExpertParallel` dispatches rows to the ranks holding their experts and combines the
  results, for experts you compute yourself.
- Under ``torchrun`` (or ``moeflow launch``) every process is one rank: the layer spreads its
  experts over the ranks (``ep``) and each rank passes its own tokens.

Errors are ``ValueError`` (bad input), ``RuntimeError`` and its subclasses
:class:`CommunicationError` (a rank failed, a deadline passed) and ``NotImplementedError``,
``OSError`` and ``MemoryError``, with the messages of the ``moeflow`` command line.
"""

from ._moeflow import CommunicationError, cuda_build
from .distributed import world
from .expert_parallel import ExpertParallel
from .layer import MoeLayer

__all__ = ["MoeLayer", "ExpertParallel", "CommunicationError", "world", "cuda_build"]
