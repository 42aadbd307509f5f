"""Bringing up ``torch.distributed`` for a communicator, from what the launcher told us."""
from __future__ import annotations

import atexit
import datetime
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from torchmn.launch import LaunchEnvironment

DEFAULT_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("TORCHMN_TIMEOUT", 600)))
_timeout = DEFAULT_TIMEOUT  # the world's, once init_world set it up


def collective_timeout_s() -> float:
    """Seconds a collective may wait for the other ranks (also inside shared memory)."""
    return _timeout.total_seconds()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_world(env: LaunchEnvironment, backend: str, timeout: Optional[datetime.timedelta],
               init_method: Optional[str]) -> None:
    """Initialise the default process group for ``env`` and tear it down at interpreter exit.

    The teardown matters: a gloo process that exits with its group alive sometimes aborts at
    exit (``terminate called without an active exception``), failing jobs that succeeded.
    """
    if init_method is None:
        if env.source in ("torchmn", "torchrun"):
            # Their launcher hosts the store (TORCHELASTIC_USE_AGENT_STORE) and set MASTER_*.
            init_method = "env://"
        else:
            if env.master_port is None:
                raise RuntimeError(f"{env.source}: no rendezvous port known for {env.size} ranks; "
                                   f"export MASTER_PORT (and MASTER_ADDR) on every rank")
            init_method = f"tcp://{env.master_addr}:{env.master_port}"
    if init_method.startswith("file://"):
        _refuse_stale_file(init_method[len("file://"):], env)
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % max(1, torch.cuda.device_count()))
    global _timeout
    _timeout = timeout or DEFAULT_TIMEOUT
    try:
        dist.init_process_group(backend, init_method=init_method, rank=env.rank, world_size=env.size,
                                timeout=_timeout)
    except Exception as e:
        raise RuntimeError(
            f"rank {env.rank}/{env.size} could not join the job's rendezvous at {init_method} "
            f"({env.source} launch): {e}. Check that every rank was started, that the rendezvous host "
            f"is reachable from this one, and that the port is free and not firewalled "
            f"(MASTER_ADDR / MASTER_PORT override it).") from e
    atexit.register(shutdown_world)


def _refuse_stale_file(path: str, env: LaunchEnvironment) -> None:
    """Refuse a ``file://`` rendezvous file left by an earlier job (one that crashed, so torch
    never deleted it): joining it would pair this job's ranks with dead ones, or hang.

    Stale means: it already counts ``size`` users (a live job has at most ``size - 1`` before this
    rank joins), or it already holds this rank's own address, which only this rank writes.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    users, mine = 0, False
    for key, value in _file_store_entries(data):
        if key == b"refcount/":
            users = int(value or b"0")
        elif key.startswith(b"/default_pg/") and key.endswith(b"/%d" % env.rank):
            mine = True
    if users >= env.size or mine:
        raise RuntimeError(
            f"rank {env.rank}: the rendezvous file {path} is left over from an earlier job "
            f"({'it already holds this rank' if mine else f'{users} ranks already joined it'}); "
            f"delete it (rm {path}) or give this job a new file:// path")


def _file_store_entries(data: bytes):
    """(key, value) pairs of torch's FileStore log: 32-bit little-endian lengths, then bytes."""
    i = 0
    while i + 4 <= len(data):
        n = int.from_bytes(data[i:i + 4], "little")
        key, i = data[i + 4:i + 4 + n], i + 4 + n
        if i + 4 > len(data):
            return
        m = int.from_bytes(data[i:i + 4], "little")
        if i + 4 + m > len(data):
            return  # an entry still being written
        yield key, data[i + 4:i + 4 + m]
        i += 4 + m


def shutdown_world() -> None:
    """Destroy the default process group, once gloo's worker threads have let go of their work.

    A gloo worker thread drops each finished collective a moment after the caller has moved on;
    if that tensor's last reference was Python's, dropping it needs the GIL, and a thread that
    asks for the GIL while the interpreter is finalizing aborts the whole process ("terminate
    called without an active exception", seen in about 1 of 20 two-rank jobs). Sleeping releases
    the GIL and lets those threads finish first.
    """
    if dist.is_initialized():
        time.sleep(0.2)  # generous: on a loaded machine that thread may wait for a core
        dist.destroy_process_group()
