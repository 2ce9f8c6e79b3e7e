"""ExpertParallel: dispatch and combine for experts you compute yourself."""

from . import _moeflow
from ._tensors import _torch, cuda_device, result_like, staged
from .distributed import resolve


class ExpertParallel:
    """The dispatch and combine of a layout, in the shape of DeepEP's ``Buffer``::

        ep = moeflow.ExpertParallel(num_experts=64, hidden=2048)   # ep: WORLD_SIZE under torchrun
        handle, rows, counts = ep.dispatch(hidden, topk_ids, topk_weights)
        expert_out = my_experts(rows, counts, ep.local_experts)     # rows grouped by local expert
        out = ep.combine(expert_out, handle)

    ``dispatch`` sends each of this rank's tokens ``hidden [T, H]`` (float32) to the ranks
    holding its experts ``topk_ids [T, k]`` and returns the rows this rank received, grouped by
    local expert: ``rows [N, H]``, ``counts [L]`` (int64; ``local_experts`` names the ``L``
    experts). ``combine`` takes ``expert_out [N, H]`` (float32, unweighted, in ``rows``'s order)
    and returns ``[T, H]``: each token's expert outputs weighted by ``topk_weights`` and summed
    in slot order, exactly as :class:`~moeflow.MoeLayer` does. Both are collective: every rank
    calls them, with its own tokens (possibly none).

    CUDA torch tensors are staged through host memory: ``dispatch`` copies ``hidden``,
    ``topk_ids`` and ``topk_weights`` to the host (which waits for torch's current stream), the
    exchange runs between the ranks' processes over TCP, and ``rows`` and ``counts`` come back
    on ``hidden``'s GPU; ``combine`` does the same with ``expert_out`` and returns the result on
    its GPU. The values are those of host tensors, bit for bit; it is not the device-resident
    exchange that :class:`~moeflow.MoeLayer` runs on GPUs.

    Options: ``ep``, ``tp``, ``strategy`` (``local``, ``allgather``, ``multicast``,
    ``all2allv``), ``placement``, ``redundant``, ``sequence_parallel``, ``timeout``, as for
    :meth:`~moeflow.MoeLayer.from_pretrained`.
    """

    def __init__(self, num_experts, hidden, ep=None, **options):
        ep, world = resolve(ep, "cpu", options.get("timeout", 60.0))
        self._ep = _moeflow.ExpertParallel(int(num_experts), int(hidden), _moeflow.Options(ep=ep, **options), world)

    def dispatch(self, hidden, topk_ids, topk_weights):
        """``(handle, rows [N, H], counts [L])``: see the class."""
        device = cuda_device(hidden)
        if device is not None:
            hidden, topk_ids, topk_weights = (staged(t) for t in (hidden, topk_ids, topk_weights))
            handle, rows, counts = self._ep.dispatch(hidden, topk_ids, topk_weights)
            torch = _torch()
            return handle, torch.from_dlpack(rows).to(device), torch.from_dlpack(counts).to(device)
        handle, rows, counts = self._ep.dispatch(staged(hidden), staged(topk_ids), staged(topk_weights))
        like = result_like(hidden)
        return handle, like(rows), like(counts)

    def combine(self, expert_out, handle):
        """``[T, H]``: see the class. Each handle combines once."""
        device = cuda_device(expert_out)
        if device is not None:
            return _torch().from_dlpack(self._ep.combine(staged(expert_out), handle)).to(device)
        return result_like(expert_out)(self._ep.combine(expert_out, handle))

    @property
    def local_experts(self):
        """The expert ids this rank holds, in the order ``counts`` lists them."""
        return self._ep.local_experts

    @property
    def strategy(self):
        """The dispatch strategy's name."""
        return self._ep.strategy
