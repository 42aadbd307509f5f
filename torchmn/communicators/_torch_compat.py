"""Where torchmn meets torch.distributed's details: calls whose names differ between the torch
releases torchmn supports, and torch's bookkeeping after a failed set-up.

Newer torch names the single-tensor gather and reduce-scatter ``all_gather_single`` and
``reduce_scatter_single`` and deprecates the older ``all_gather_into_tensor`` and
``reduce_scatter_tensor``; older torch (2.11 and before) has only the older names. Both take
``(output, input, group=..., async_op=...)``.
"""
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def forget_unmade_world() -> None:
    """Undo what a failed ``init_process_group`` left behind in torch's bookkeeping.

    torch names groups made without a name by a counter (the name is part of their store keys) and
    sets it back to 0 when the world is destroyed. A world whose set-up failed is never made, so
    never destroyed: its count stays, and this process's next world would look for keys its peers
    never write (an elastic rank that gave up one generation's set-up would hang in the next).

    Example::

        >>> forget_unmade_world()    # after init_process_group raised
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and world is not None and hasattr(world, "group_count"):
        world.group_count = 0
