"""This process's rank in a job started by torchrun (or ``moeflow launch``).

The launcher's variables are read here, once, and handed to the Rust half as typed values:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (and moeflow's
``MOEFLOW_JOB``, ``MOEFLOW_BIND``). Under torchrun (``TORCHELASTIC_USE_AGENT_STORE``), whose
agent listens on ``MASTER_PORT`` itself, rank 0 listens on a free port that it publishes
through the agent's store.
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
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            vars["MASTER_PORT"] = str(_port_beside_torchrun_store(vars, key, float(timeout)))
        _worlds[key] = World(vars, gpu=key, timeout=float(timeout))
    return _worlds[key]


def _port_beside_torchrun_store(vars, gpu, timeout):
    """The port rank 0 listens on for moeflow's rendezvous under torchrun, whose agent holds
    ``MASTER_PORT`` itself (its TCPStore): rank 0 takes a free port of ``MASTER_ADDR`` and
    publishes it in that store; the other ranks read it there (waiting up to ``timeout``)."""
    import datetime
    import socket

    from torch.distributed import TCPStore

    addr, rank = vars.get("MASTER_ADDR", "127.0.0.1"), int(vars["RANK"])
    store = TCPStore(addr, int(vars["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    name = f"moeflow/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{restart}/{'gpu' if gpu else 'cpu'}/port"
    if rank == 0:
        with socket.socket() as s:
            s.bind((vars.get("MOEFLOW_BIND", addr), 0))
            port = s.getsockname()[1]
        store.set(name, str(port))
        return port
    return int(store.get(name))


def resolve(ep, device, timeout):
    """``(ep, world)`` for a layer: ``ep`` defaults to the job's world size (1 when not
    launched); a world is joined when ``ep`` is above 1."""
    if ep is None:
        ep = int(os.environ.get("WORLD_SIZE", "1")) if launched() else 1
    if ep == 1:
        return 1, None
    w = world(gpu=str(device).startswith("cuda"), timeout=timeout)
    return ep, w
