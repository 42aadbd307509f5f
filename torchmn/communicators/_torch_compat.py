"""torch.distributed calls whose names differ between the torch releases torchmn supports.

Newer torch names the single-tensor gather and reduce-scatter ``all_gather_single`` and
``reduce_scatter_single`` and deprecates the older ``all_gather_into_tensor`` and
``reduce_scatter_tensor``; older torch (2.11 and before) has only the older names. Both take
``(output, input, group=..., async_op=...)``.
"""
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
