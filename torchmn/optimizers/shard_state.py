"""The sharded optimizer's ``state_dict``: whole, in the wrapped optimizer's format, from every
rank's shards; and a whole state cut back into this rank's shards."""
from __future__ import annotations

import torch

from torchmn.communicators import Communicator
from torchmn.errors import TorchmnRuntimeError, TorchmnValueError
from torchmn.optimizers.inner_optimizers import IMPLEMENTATION_FLAGS
from torchmn.optimizers.memory_order import elements, own_order, shaped
from torchmn.optimizers.shard_layout import ShardBucket

# State entries of those optimizers that are one value per parameter (a step count, a decay
# factor), not one value per element: copied as they are rather than split or gathered.
SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product"})



def indices(param_groups: list[dict]) -> dict:
    """Each parameter's index in torch's ``state_dict`` format, which numbers them across groups.

    Args:
        param_groups: the optimizer's parameter groups.

    Returns:
        ``{parameter: index}``: 0, 1, ... in group order; a parameter in several groups keeps its
        first index.

    Example::

        >>> opt = torch.optim.SGD([{"params": [weight]}, {"params": [bias]}], lr=0.1)
        >>> list(indices(opt.param_groups).values())
        [0, 1]
    """
    index, n = {}, 0
    for group in param_groups:
        for p in group["params"]:
            if p not in index:
                index[p] = n
                n += 1
    return index

def gather_state_dict(comm: Communicator, param_groups: list[dict], buckets: list) -> dict:
    """The whole optimizer state in torch's format, from every rank's shards (collective).

    Args:
        comm: the communicator; every rank calls this.
        param_groups: the wrapped optimizer's parameter groups.
        buckets: the shard buckets, each with its shard optimizer.

    Returns:
        What the unsharded optimizer's ``state_dict()`` would be.

    Raises:
        RuntimeError: the ranks hold different state layouts (they took different steps).

    Example::

        >>> sd = gather_state_dict(comm, optimizer.wrapped.param_groups, optimizer.buckets)   # every rank
    """
    local_keys = [[list(b.optimizer.state.get(sp, {})) for sp in b.shard_params] for b in buckets]
    if comm.size > 1 and any(k != local_keys for k in comm.allgather_obj(local_keys)):
        raise TorchmnRuntimeError("state_dict: ranks hold different optimizer state layouts; every rank "
                                  "must have taken the same steps")
    index = indices(param_groups)
    pending = []
    state = {}
    for b, keys in zip(buckets, local_keys):
        shard_states = [b.optimizer.state.get(sp, {}) for sp in b.shard_params]
        # Each entry's keys in the order the optimizer made them, as torch's own state_dict has
        # them; the gathered tensors fill their places below.
        entries = [dict.fromkeys(param_keys) for param_keys in keys]
        for key in dict.fromkeys(k for param_keys in keys for k in param_keys):
            holders = [i for i, s in enumerate(shard_states) if key in s]
            value = shard_states[holders[0]][key]
            if torch.is_tensor(value) and key not in SCALAR_STATE:
                # Every rank's slices of this entry, for all the bucket's parameters at once.
                send = torch.zeros(b.k, dtype=value.dtype, device=value.device)
                for i in holders:
                    send[b.block_offsets[i]:b.block_offsets[i] + b.ks[i]].copy_(shard_states[i][key].reshape(-1))
                full = torch.empty(comm.size * b.k, dtype=value.dtype, device=value.device)
                work = comm.allgather_flat(full, send, async_op=True)
                pending.append((work, full, b, entries, key, holders))
            else:
                for i in holders:
                    value = shard_states[i][key]
                    entries[i][key] = value.clone() if torch.is_tensor(value) else value
        for p, entry in zip(b.params, entries):
            if entry:
                state[index[p]] = entry
    for work, full, b, entries, key, holders in pending:
        work.wait()
        rows = full.view(comm.size, b.k)
        for i in holders:
            at, k, p = b.block_offsets[i], b.ks[i], b.params[i]
            entries[i][key] = shaped(rows[:, at:at + k].reshape(-1)[:p.numel()], p).clone()
    return torch_format(param_groups, state, index)


def torch_format(param_groups: list[dict], state: dict, index: dict) -> dict:
    """An optimizer's ``state_dict`` as torch's ``Optimizer.state_dict()`` lays it out.

    Args:
        param_groups: the optimizer's parameter groups.
        state: each parameter's whole state, by its index.
        index: each parameter's index (:func:`indices`).

    Returns:
        ``{"state": ..., "param_groups": ...}``, the state in index order and each group with
        its parameters as indices.

    Example::

        >>> torch_format(opt.param_groups, {0: {"step": torch.tensor(1.0)}}, indices(opt.param_groups))
    """
    groups = []
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [index[p] for p in group["params"]]
        groups.append(packed)
    return {"state": dict(sorted(state.items())), "param_groups": groups}

def load_state_dict(state_dict: dict, param_groups: list[dict], inner: dict) -> None:
    """Load a whole state in torch's format into this rank's shard optimizers (no communication).

    Args:
        state_dict: from :func:`gather_state_dict` on any rank count, or a plain torch optimizer.
        param_groups: the wrapped optimizer's parameter groups (their hyperparameters are loaded).
        inner: the shard buckets by ``(group index, kind)``, each list sharing one shard optimizer.

    Raises:
        ValueError: the groups or a state entry do not fit the optimizer's parameters.

    Example::

        >>> load_state_dict(torch.load("opt.pt"), optimizer.wrapped.param_groups, optimizer.shard_groups)
    """
    saved_groups = state_dict["param_groups"]
    groups = param_groups
    if len(saved_groups) != len(groups):
        raise TorchmnValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
                                f"has {len(groups)}")
    for g, sg in zip(groups, saved_groups):
        if len(sg["params"]) != len(g["params"]):
            raise TorchmnValueError(f"loaded state dict has a group of {len(sg['params'])} parameters where "
                                    f"the optimizer has {len(g['params'])}")
    saved_index = {}
    for g, sg in zip(groups, saved_groups):
        for p, i in zip(g["params"], sg["params"]):
            saved_index[p] = i
        for key, value in sg.items():
            if key != "params":
                g[key] = value
    saved_state = state_dict["state"]
    for (group, _), buckets in inner.items():
        inner = buckets[0].optimizer
        shard_states, n = {}, 0
        for b in buckets:
            for i, p in enumerate(b.params):
                saved = saved_state.get(saved_index[p])
                if saved:
                    shard_states[n] = slice_of_state(b, i, saved)
                n += 1
        inner_group = {k: v for k, v in groups[group].items() if k != "params"}
        inner_group.update({k: inner.param_groups[0][k] for k in IMPLEMENTATION_FLAGS
                            if k in inner.param_groups[0]})
        inner.state.clear()
        # The inner optimizer's own loader casts dtypes and devices the way torch does.
        inner.load_state_dict({"state": shard_states, "param_groups": [{**inner_group, "params": list(range(n))}]})

def slice_of_state(b: ShardBucket, i: int, saved: dict) -> dict:
    """This rank's slice of parameter ``i`` of bucket ``b``'s state, cut from its whole state.

    Args:
        b: the shard bucket.
        i: the parameter's index in the bucket.
        saved: the parameter's whole state (``state_dict()["state"][index]``).

    Returns:
        The state of this rank's shard parameter (scalar entries, such as step counts, copied).

    Raises:
        ValueError: a tensor entry does not have the parameter's number of elements.

    Example::

        >>> saved = {"step": torch.tensor(3.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}
        >>> slice_of_state(bucket, 0, saved)["exp_avg"]      # rank 1 of 3: elements 2:4, k = 2
        tensor([1., 1.])
    """
    p, (lo, hi) = b.params[i], b.slices[i]
    mine = {}
    for key, value in saved.items():
        if torch.is_tensor(value) and key not in SCALAR_STATE:
            if value.numel() != p.numel():
                raise TorchmnValueError(f"loaded state {key!r} has {value.numel()} elements for a parameter of "
                                        f"shape {tuple(p.shape)}")
            mine[key] = torch.zeros(b.ks[i], dtype=value.dtype, device=b.flat.device)  # the padding: 0
            mine[key][:hi - lo].copy_(elements(value, p)[lo:hi])
        else:
            # A copy: Adam counts its step in place, which must not touch the caller's dict.
            mine[key] = value.clone() if torch.is_tensor(value) else value
    return mine


def local_part(comm: Communicator, param_groups: list[dict], buckets: list) -> dict:
    """This rank's part of the optimizer state: its slice of every per-element entry (no communication).

    Args:
        comm: the communicator (for the rank count the part records).
        param_groups: the wrapped optimizer's parameter groups.
        buckets: the shard buckets, each with its shard optimizer.

    Returns:
        ``{"size", "param_groups", "state": {index: {key: value}}, "slices": {index: (lo, hi)},
        "strides": {index: strides}}``: per-element tensors hold elements ``lo:hi`` of the
        parameter in its memory order, which ``strides`` gives where it is not the default one
        (a ``channels_last`` convolution). Parameters without state yet are left out.

    Example::

        >>> part = local_part(comm, optimizer.wrapped.param_groups, optimizer.buckets)
        >>> part["size"], part["slices"][0]          # rank 1 of 2, a first parameter of 10 elements
        (2, (5, 10))
    """
    index = indices(param_groups)
    state, slices, strides = {}, {}, {}
    for b in buckets:
        for i, (p, sp) in enumerate(zip(b.params, b.shard_params)):
            entry = b.optimizer.state.get(sp)
            if not entry:
                continue
            lo, hi = b.slices[i]
            state[index[p]] = {key: (value[:hi - lo].clone() if torch.is_tensor(value) and key not in SCALAR_STATE
                                     else value.clone() if torch.is_tensor(value) else value)
                               for key, value in entry.items()}
            slices[index[p]] = (lo, hi)
            if own_order(p) is not None:
                strides[index[p]] = own_order(p)
    part = torch_format(param_groups, state, index)
    part.update(size=comm.size, slices=slices, strides=strides)
    return part


def merge_parts(parts: list[dict], param_groups: list[dict]) -> dict:
    """The whole state in torch's format, from the parts every rank of a job wrote (any rank count).

    Args:
        parts: :func:`local_part` of every rank of the job that saved, in rank order.
        param_groups: the parameter groups of the optimizer that will load it (for the shapes).

    Returns:
        What the unsharded optimizer's ``state_dict()`` would be.

    Raises:
        ValueError: the parts are not one job's (their rank counts differ, a part is missing), or
            do not cover a parameter of this optimizer.

    Example::

        >>> whole = merge_parts([torch.load(f"opt_rank{r}.pt") for r in range(2)], optimizer.wrapped.param_groups)
        >>> optimizer.load_state_dict(whole)
    """
    sizes = {part["size"] for part in parts}
    if sizes != {len(parts)}:
        raise TorchmnValueError(f"optimizer state: {len(parts)} parts, written by jobs of {sorted(sizes)} ranks; "
                                f"a checkpoint needs the parts of every rank of one job")
    params = [p for group in param_groups for p in group["params"]]
    state = {}
    for index in sorted({i for part in parts for i in part["state"]}):
        if index >= len(params):
            raise TorchmnValueError(f"optimizer state: the checkpoint has state for parameter {index}, the optimizer "
                                    f"has {len(params)} parameters")
        p = params[index]
        entry, covered = {}, 0
        for part in parts:
            if index not in part["state"]:
                continue
            lo, hi = part["slices"][index]
            for key, value in part["state"][index].items():
                if torch.is_tensor(value) and key not in SCALAR_STATE:
                    if key not in entry:
                        entry[key] = torch.zeros(p.numel(), dtype=value.dtype)
                    if hi > p.numel():
                        raise TorchmnValueError(
                            f"optimizer state {key!r} of parameter {index} reaches element {hi}; the "
                            f"parameter has shape {tuple(p.shape)}")
                    entry[key][lo:hi].copy_(value.reshape(-1)[:hi - lo])
                else:
                    entry.setdefault(key, value)
            covered += hi - lo
        if covered != p.numel():
            raise TorchmnValueError(
                f"optimizer state of parameter {index} covers {covered} of its {p.numel()} elements "
                f"(shape {tuple(p.shape)}): the checkpoint is of another model")
        # The parts' element order: the saving parameter's memory order (the default where they
        # name none), whatever the loading parameter's is.
        saved = parts[0].get("strides", {}).get(index)

        def whole(value):
            return value.as_strided(p.shape, saved) if saved else value.view(p.shape)
        state[index] = {key: whole(value) if torch.is_tensor(value) and value.numel() == p.numel()
                        and key not in SCALAR_STATE else value for key, value in entry.items()}
    return {"state": state, "param_groups": parts[0]["param_groups"]}
