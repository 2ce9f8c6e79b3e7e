"""This process's rank in a job started by torchrun (or ``moeflow launch``).

The launcher's variables are read here, once, and handed to the Rust half as typed values:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (and moeflow's
``MOEFLOW_JOB``, ``MOEFLOW_BIND``).
"""

import os

from ._moeflow import World

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOEFLOW_JOB", "MOEFLOW_BIND")

_worlds = {}


def launched():
    """Whether this process is a rank of a launched job (``RANK`` or ``WORLD_SIZE`` is set)."""
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ


def world(gpu=False, timeout=60.0):
    """The ranks of this launched job, connected (over TCP, or NCCL with ``gpu``), or ``None``
    when this process was not launched as a rank. Joined once per process and kind: every layer
    and :class:`~moeflow.ExpertParallel` of the process builds its own groups from it, so all
    ranks must build them in the same order. ``MASTER_ADDR:MASTER_PORT`` is rank 0's
    rendezvous; the first call waits at most ``timeout`` seconds for every rank.
    """
    if not launched():
        return None
    key = bool(gpu)
    if key not in _worlds:
        vars = {k: os.environ[k] for k in LAUNCH_VARIABLES if k in os.environ}
        _worlds[key] = World(vars, gpu=key, timeout=float(timeout))
    return _worlds[key]


def resolve(ep, device, timeout):
    """``(ep, world)`` for a layer: ``ep`` defaults to the job's world size (1 when not
    launched); a world is joined when ``ep`` is above 1."""
    if ep is None:
        ep = int(os.environ.get("WORLD_SIZE", "1")) if launched() else 1
    if ep == 1:
        return 1, None
    w = world(gpu=str(device).startswith("cuda"), timeout=timeout)
    return ep, w
