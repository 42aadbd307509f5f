"""Which GPU each rank would drive through NCCL, and what to say where ranks of a node would share
one (NCCL refuses that with "Duplicate GPU detected", after the job has started).

The ranks compare what they see at set-up (:func:`view`, in the topology exchange the communicator
makes anyway); CUDA is not touched, which would give every rank a context on a GPU that a CPU model
never uses. Ranks with distinct ``NCCL_HOSTID`` s count as separate hosts, as NCCL counts them.
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def view() -> tuple[Optional[str], int, Optional[str]]:
    """What this rank sees: ``(CUDA_VISIBLE_DEVICES, visible GPU count, NCCL_HOSTID)``.

    Returns:
        The triple, to exchange with the other ranks.

    Example::

        >>> view()          # 8 GPUs, nothing hidden
        (None, 8, None)
    """
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(), os.environ.get("NCCL_HOSTID")


def shared_gpu(views: list, node_ranks: list[list[int]], hosts: list[str]) -> Optional[str]:
    """What to say where ranks of one node would drive one GPU, or None; the same on every rank.

    Local rank ``i`` drives visible GPU ``i % count`` (``Communicator.device``); two ranks of one
    node (and one ``NCCL_HOSTID``) on the same physical GPU are a conflict.

    Args:
        views: every rank's :func:`view`, in rank order.
        node_ranks: the ranks of each node, in local rank order.
        hosts: every rank's host name.

    Returns:
        A sentence naming the ranks, the GPU and the fixes, or None.

    Example::

        >>> shared_gpu([(None, 1, None)] * 2, [[0, 1]], ["h", "h"])[:40]
        'ranks 0, 1 (local ranks 0, 1 on h) would'
    """
    users: dict = {}
    for n, node in enumerate(node_ranks):
        for i, r in enumerate(node):
            visible, count, hostid = views[r]
            if not count:
                continue
            index = i % count
            ids = visible.split(",") if visible else None
            physical = ids[index] if ids and index < len(ids) else str(index)
            users.setdefault((n, hostid, physical), []).append((i, r))
    shared = [(key, ranks) for key, ranks in users.items() if len(ranks) > 1]
    if not shared:
        return None
    (node, _, gpu), ranks = shared[0]
    count = views[ranks[0][1]][1]
    return (f"ranks {', '.join(str(r) for _, r in ranks)} (local ranks {', '.join(str(i) for i, _ in ranks)} "
            f"on {hosts[ranks[0][1]]}) would drive GPU {gpu} together through NCCL, which needs a GPU of its own "
            f"for every rank, and that node has {len(node_ranks[node])} ranks for {count} visible GPU(s). Start at "
            f"most {count} rank(s) per node (torchmn run -np {count}, srun --ntasks-per-node={count} "
            f"--gres=gpu:{count}), give each rank its own GPU (CUDA_VISIBLE_DEVICES), or keep the model and "
            f"tensors on the CPU (--device cpu in the examples), which CPU ranks on this machine do through "
            f"shared memory")
