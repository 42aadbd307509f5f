"""Ranks started by hand, or by a scheduler, with torch's ``env://`` variables."""
from __future__ import annotations

from typing import Mapping

from torchmn.environments.base import Environment, LaunchEnvironment
from torchmn.environments.variables import (LOCALHOST, check_place, first_present, master_addr, master_port,
                                            optional_int, read_int)
from torchmn.network import is_loopback


class EnvMethodEnvironment(Environment):
    """Started by hand, or by a scheduler, with torch's ``env://`` variables: ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and optionally ``LOCAL_RANK`` /
    ``LOCAL_WORLD_SIZE`` (Kubeflow's PyTorchJob sets the first four, one process per pod). The
    DeepSpeed launcher's ``LOCAL_SIZE`` and ``CROSS_RANK`` stand for the local size and the node.

    Checked after every launcher, so that a batch script that exports ``RANK`` for its own use
    changes nothing under srun or mpirun. Without ``LOCAL_*``, ranks whose rendezvous is a loopback
    address all share this host; otherwise each rank is taken to be alone on its host (the
    communicator still groups ranks by hostname). ``node_rank`` is ``CROSS_RANK``, else None.

    Example::

        >>> EnvMethodEnvironment.read({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        ...                      "MASTER_PORT": "29511"}).describe()
        'env: rank 1/2, local 1/2, node None, rendezvous 127.0.0.1:29511'
    """

    source = "env"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether torch's ``env://`` variables are set: ``RANK`` and ``WORLD_SIZE`` both.

        See ``Environment.detect``; ``detect_environment`` asks this class last, after every launcher.

        Args:
            env: the environment.

        Returns:
            True when both ``RANK`` and ``WORLD_SIZE`` are set (to anything; ``read`` checks them).

        Example::

            >>> EnvMethodEnvironment.detect({"RANK": "0", "WORLD_SIZE": "2"})
            True
            >>> EnvMethodEnvironment.detect({"RANK": "0"})
            False
        """
        return "RANK" in env and "WORLD_SIZE" in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """This process's place, from torch's ``env://`` variables; see ``Environment.read``.

        The local size is ``LOCAL_WORLD_SIZE``, else DeepSpeed's ``LOCAL_SIZE``. Without a local
        rank and size, a loopback ``MASTER_ADDR`` (or none) makes every rank local to this host
        (local rank = rank, of ``WORLD_SIZE``: also the size where only ``LOCAL_RANK`` is set); any
        other address makes this rank alone on its host (local rank 0 of 1). ``node_rank`` is
        DeepSpeed's ``CROSS_RANK``, else None.

        Args:
            env: the environment.

        Returns:
            The place, with ``source`` ``"env"``; the port is ``MASTER_PORT``, else None.

        Raises:
            ValueError: ``RANK`` or ``WORLD_SIZE`` (or ``LOCAL_RANK`` where a local size is set, or
                the local size where ``LOCAL_RANK`` is set and ``MASTER_ADDR`` is another host's) is
                missing or not an integer, the values do not fit together, or ``MASTER_PORT`` is not
                a port number.
            RuntimeError: ``MASTER_ADDR`` is not set and the ranks span several hosts.

        Example::

            >>> EnvMethodEnvironment.read({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
            ...                            "MASTER_PORT": "29500"}).describe()
            'env: rank 3/4, local 0/1, node None, rendezvous 10.0.0.1:29500'
        """
        fix = ("torch's env:// launch needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT on every process "
               "(LOCAL_RANK and LOCAL_WORLD_SIZE when several share a host); or start the job with torchrun "
               "or `torchmn run`")
        rank = read_int(env, "RANK", fix)
        size = read_int(env, "WORLD_SIZE", fix)
        local_size_name = first_present(env, ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"))
        one_host = is_loopback(env.get("MASTER_ADDR") or LOCALHOST, resolve=False)
        if local_size_name in env or ("LOCAL_RANK" in env and not one_host):
            local_rank, local_size = read_int(env, "LOCAL_RANK", fix), read_int(env, local_size_name, fix)
        elif one_host:  # every rank here: the local rank is the rank unless LOCAL_RANK says otherwise
            local_size = size
            local_rank = read_int(env, "LOCAL_RANK", fix) if "LOCAL_RANK" in env else rank
        else:
            local_rank, local_size = 0, 1
        check_place(env, ("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank),
                    (local_size_name if local_size_name in env else "WORLD_SIZE", local_size), fix)
        addr = master_addr(env, None, size, local_size, cls.source, fix)
        return LaunchEnvironment(rank, size, local_rank, local_size, optional_int(env, "CROSS_RANK", fix), addr,
                                 master_port(env, None), cls.source)
