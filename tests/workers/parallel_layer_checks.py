"""Checks of the parallel layers (MultiNodeBatchNorm, SpatialParallelConv2d, ChannelParallelConv2d,
Column/RowParallelLinear), run on every rank of a real job (see tests/test_parallel_layers.py).

Every rank builds the dense layer with the same seed and the same data, computes the dense result
itself, and compares it with what the split layer computes, in float64.
Usage: python parallel_layer_checks.py CHECK [CHECK ...]   (or "all")
"""
import os
import sys
import time

import torch

import torchmn
import torchmn.functions
from torchmn.communicators import make_communicator
from torchmn.nn import (ChannelParallelConv2d, ColumnParallelLinear, MultiNodeBatchNorm1d, MultiNodeBatchNorm2d,
                        RowParallelLinear, SpatialParallelConv2d, create_mnbn_model)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import run_checks  # noqa: E402

EXACT = dict(rtol=0, atol=1e-10)
BN = dict(rtol=0, atol=1e-8)


def close(a, b, what, tol=EXACT):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} against {tuple(b.shape)}"
    assert torch.allclose(a, b, **tol), f"{what}: max difference {(a - b).abs().max().item()}"


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def solo():
    return make_communicator("naive", rank=0, size=1, group=None, obj_group=None, backend="gloo", node_key=0)


# ----------------------------------------------------------------------------- BatchNorm
def _local_sizes(size):
    return [3, 5, 8, 2][:size] if size <= 4 else [3] * size


def _bn_run(layer_for, comm, x_all, t_all, sizes, steps=2, average=True):
    """Train-mode forwards and backwards of a BN layer on this rank's part of the batch; returns
    (output part, averaged weight and bias gradients followed by the input's gradient part, the layer)."""
    start = sum(sizes[:comm.rank])
    x, t = x_all[start:start + sizes[comm.rank]], t_all[start:start + sizes[comm.rank]]
    bn = layer_for(comm)
    for _ in range(steps):
        bn.zero_grad()
        x = x.detach().requires_grad_(True)
        y = bn(x)
        # Each rank's loss is its samples' share of the global mean: their average is that mean.
        (comm.size * (y * t).sum() / (sum(sizes) * t_all[0].numel() / t_all.shape[1])).backward()
    grads = [p.grad.clone() for p in bn.parameters()]
    if average and comm.size > 1:
        grads = [comm.allreduce(g, op="mean") for g in grads]
    # The input's gradient: through the global statistics it depends on every rank's samples (scaled
    # as the loss is: by the rank count).
    return y.detach(), grads + [x.grad / comm.size], bn


def _four_way(comm, plain, multi, shape_rest):
    sizes = _local_sizes(comm.size)
    x, t = randn(sum(sizes), 4, *shape_rest, seed=1) * 3 + 1, randn(sum(sizes), 4, *shape_rest, seed=2)
    whole = [sum(sizes)]
    y1, g1, bn1 = _bn_run(lambda c: plain(4).double(), solo(), x, t, whole)
    _, g2, _ = _bn_run(lambda c: plain(4).double(), comm, x, t, sizes)
    y3, g3, bn3 = _bn_run(lambda c: multi(4, comm=c).double(), solo(), x, t, whole)
    y4, g4, bn4 = _bn_run(lambda c: multi(4, comm=c).double(), comm, x, t, sizes)
    start = sum(sizes[:comm.rank])
    mine = slice(start, start + sizes[comm.rank])
    close(y3, y1, "one process: MultiNodeBatchNorm against BatchNorm", BN)
    close(y4, y1[mine], "MultiNodeBatchNorm on ranks against BatchNorm on the whole batch", BN)
    g1, g1_x = g1[:-1], g1[-1][mine]
    g3, g3_x, g4, g4_x, g2 = g3[:-1], g3[-1][mine], g4[:-1], g4[-1], g2[:-1]
    for a, b, c in zip(g1, g3, g4):
        close(b, a, "one process: the gradients", BN)
        close(c, a, "averaged gradients on ranks against one process", BN)
    close(g3_x, g1_x, "one process: the input's gradient", BN)
    close(g4_x, g1_x, "the input's gradient on ranks against one process", BN)
    assert comm.size == 1 or any(not torch.allclose(a, b, **BN) for a, b in zip(g1, g2)), \
        "plain BatchNorm on ranks gave the global gradients: the check cannot tell"
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        close(getattr(bn4, name).double(), getattr(bn1, name).double(), f"{name}", BN)


def check_bn_four_way(comm):
    _four_way(comm, torch.nn.BatchNorm1d, MultiNodeBatchNorm1d, ())


def check_bn_four_way_images(comm):
    _four_way(comm, torch.nn.BatchNorm2d, MultiNodeBatchNorm2d, (3, 2))


def _against_one_process(comm, plain, multi, x, t, sizes, what):
    """The multi-node layer on the ranks' parts of (x, t) against the plain one on the whole batch:
    output, averaged gradients, the input's gradient and the running statistics."""
    y1, g1, bn1 = _bn_run(lambda c: plain(4).double(), solo(), x, t, [sum(sizes)])
    y4, g4, bn4 = _bn_run(lambda c: multi(4, comm=c).double(), comm, x, t, sizes)
    start = sum(sizes[:comm.rank])
    mine = slice(start, start + sizes[comm.rank])
    close(y4, y1[mine], f"the output {what}", BN)
    for a, b in zip(g4[:-1], g1[:-1]):
        close(a, b, f"averaged gradients {what}", BN)
    close(g4[-1], g1[-1][mine], f"the input's gradient {what}", BN)
    for name in ("running_mean", "running_var"):
        close(getattr(bn4, name), getattr(bn1, name), f"{name} {what}", BN)


def check_bn_rank_without_samples(comm):
    """The last rank holds no samples (an uneven split's tail): the others normalize with the
    global statistics of theirs, gradients as one process, and that rank gets an empty output and
    input gradient (its moments and sums count as nothing, not NaN, and torch's kernels, which
    divide by the count, are not called on it)."""
    sizes = _local_sizes(comm.size)[:-1] + [0] if comm.size > 1 else [4]
    x, t = randn(sum(sizes), 4, 3, 2, seed=5) * 3 + 1, randn(sum(sizes), 4, 3, 2, seed=6)
    _against_one_process(comm, torch.nn.BatchNorm2d, MultiNodeBatchNorm2d, x, t, sizes, "with a rank without samples")


def check_bn_constant_channel_and_single_sample(comm):
    """A channel constant on one rank (a dead ReLU's) and a rank holding one sample of (N, C): its
    variance is 0, which torch's kernel reports as invstd 0 (not inf); the global statistics,
    gradients and running statistics are still one process's."""
    sizes = [1] + _local_sizes(comm.size)[1:] if comm.size > 1 else [4]
    x, t = randn(sum(sizes), 4, seed=7) * 3 + 1, randn(sum(sizes), 4, seed=8)
    x[sizes[0]:sum(sizes[:2]), 1] = 2.5  # channel 1 constant on the second rank
    _against_one_process(comm, torch.nn.BatchNorm1d, MultiNodeBatchNorm1d, x, t, sizes,
                         "with a constant channel and a single sample")


def check_bn_large_mean_keeps_the_variance(comm):
    """Values far from 0 beside their spread (a million, give or take 1): the variance is not lost
    to cancellation in E[x^2] - E[x]^2 (which left it 1e-4 off); outputs, gradients and running
    statistics are one process's, to the last digits float64 holds of such values."""
    sizes = _local_sizes(comm.size)
    x, t = 1e6 + randn(sum(sizes), 4, seed=11), randn(sum(sizes), 4, seed=12)
    _against_one_process(comm, torch.nn.BatchNorm1d, MultiNodeBatchNorm1d, x, t, sizes, "with a large mean")


def _whole_batch_output(comm, bn, x_all, sizes):
    """This rank's output of ``bn`` on its part of ``x_all``, and BatchNorm's on the whole batch, there."""
    start = sum(sizes[:comm.rank])
    mine = slice(start, start + sizes[comm.rank])
    return bn(x_all[mine]), torch.nn.functional.batch_norm(x_all, None, None, training=True)[mine]


def check_bn_recovers_after_a_batch_with_nan(comm):
    """A batch holding NaN or inf in one channel (an overflowing mixed-precision step, which the
    scaler then skips): its output is NaN there, as torch's, and the next batches are normalized as
    one process would, with and without running statistics (the next sums do not start from it)."""
    sizes = _local_sizes(comm.size)
    for bad in (float("nan"), float("inf")):
        for track in (True, False):
            bn = MultiNodeBatchNorm1d(4, comm=comm, track_running_stats=track).double()
            x = randn(sum(sizes), 4, seed=13) + 5
            x[0, 0] = bad
            y, _ = _whole_batch_output(comm, bn, x, sizes)
            assert torch.isfinite(y[:, 1:]).all(), "the channels without NaN or inf"
            for step in range(3):
                y, want = _whole_batch_output(comm, bn, randn(sum(sizes), 4, seed=14 + step) + 5, sizes)
                close(y, want, f"batch {step + 1} after one holding {bad} (track_running_stats={track})", BN)


def check_bn_global_batch_of_one_refused(comm):
    """One value per channel over every rank's batch: torch's BatchNorm refuses it in training, and
    so does every rank alike (each knows the global count), before any running statistic changes."""
    bn = MultiNodeBatchNorm1d(4, comm=comm).double()
    x = randn(1 if comm.rank == 0 else 0, 4)
    try:
        bn(x)
    except ValueError as e:
        assert isinstance(e, torchmn.TorchmnError) and "more than 1 value per channel" in str(e) and "model.eval()" in str(e), e
    else:
        raise AssertionError("a global batch of one sample was normalized")
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_var, torch.ones(4, dtype=torch.float64))


def check_bn_empty_global_batch_keeps_statistics(comm):
    """Every rank's batch empty: as torch's BatchNorm, an empty output, running statistics kept
    (not NaN), num_batches_tracked counted, and a backward that runs."""
    one = torch.nn.BatchNorm2d(4).double()
    bn = MultiNodeBatchNorm2d(4, comm=comm).double()
    x = randn(0, 4, 3, 2).requires_grad_(True)
    y = bn(x)
    one(randn(0, 4, 3, 2))
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape, (tuple(y.shape), tuple(x.grad.shape))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        close(getattr(bn, name).double(), getattr(one, name).double(), f"{name} after an empty global batch")


def check_bn_cumulative_average(comm):
    """momentum=None: the running statistics are the cumulative average, as one process keeps."""
    sizes = _local_sizes(comm.size)
    x, t = randn(sum(sizes), 4, seed=3), randn(sum(sizes), 4, seed=4)
    _, _, one = _bn_run(lambda c: torch.nn.BatchNorm1d(4, momentum=None).double(), solo(), x, t, [sum(sizes)], 3)
    _, _, many = _bn_run(lambda c: MultiNodeBatchNorm1d(4, momentum=None, comm=c).double(), comm, x, t, sizes, 3)
    close(many.running_mean, one.running_mean, "cumulative running_mean", BN)
    close(many.running_var, one.running_var, "cumulative running_var", BN)


def check_bn_eval_makes_no_collective(comm):
    """In eval mode only rank 0 runs the layer: a collective would wait for the others (and time out)."""
    bn = MultiNodeBatchNorm1d(4, comm=comm).double()
    bn(randn(6, 4))  # training: statistics, and the agreement on the arguments
    bn.eval()
    if comm.rank == 0:
        calls = comm.call_log.calls
        for _ in range(3):
            bn(randn(5, 4))
        assert comm.call_log.calls == calls, "eval mode made a collective"
    comm.barrier()


def check_bn_channel_mismatch_refused(comm):
    if comm.size < 2:
        return
    c = 4 if comm.rank else 5
    bn = MultiNodeBatchNorm1d(4, comm=comm).double()
    bn.num_features = c  # as if the model were built differently on rank 0
    try:
        bn(randn(3, c))
    except torchmn.CollectiveMismatchError as e:
        assert "rank 0" in str(e) and "rank 1" in str(e), e
    else:
        raise AssertionError("no error")


def check_bn_wrong_input_refused_on_every_rank(comm):
    """One rank's input has the wrong channels: its own error there, the others told at once, and
    the next batch, right everywhere, normalizes as usual (the ranks' collectives still in step)."""
    bn = MultiNodeBatchNorm1d(4, comm=comm).double()
    for bad in (randn(3, 5), randn(3, 4, 2, 2)):
        try:
            bn(bad if comm.rank == 0 else randn(3, 4))
        except torchmn.CollectiveMismatchError as e:
            assert comm.rank != 0 and "another rank refused its own input" in str(e), e
        except ValueError as e:
            assert comm.rank == 0 and ("expected 4 channels" in str(e) or "2D or 3D" in str(e)), e
        else:
            raise AssertionError("no error")
    x = randn(3, 4, seed=comm.rank)
    whole = torch.cat(comm.allgather(x))
    close(bn(x), torch.nn.functional.batch_norm(whole, None, None, training=True)[3 * comm.rank:3 * comm.rank + 3],
          "the next batch after a refused one")


def check_bn_deep_copy_shares_the_communicator(comm):
    """An EMA of a model with multi-node BatchNorm (copy.deepcopy) normalizes over the job too; the
    layer is a torch _BatchNorm; a communicator refuses pickling with what to save instead."""
    import copy
    import pickle
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), MultiNodeBatchNorm1d(4, comm=comm)).double()
    ema = copy.deepcopy(model)
    assert ema[1].comm is comm and ema[1].weight is not model[1].weight, "the copy shares comm only"
    assert isinstance(ema[1], torch.nn.modules.batchnorm._BatchNorm), type(ema[1]).__mro__
    x = randn(3 + comm.rank, 3, seed=comm.rank)
    close(ema(x), model(x), "the copy's output")
    try:
        pickle.dumps(model)
    except TypeError as e:
        assert "cannot be pickled" in str(e) and "state_dict()" in str(e), e
    else:
        raise AssertionError("a model holding a communicator pickled")


def check_create_mnbn_model(comm):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.bn = torch.nn.BatchNorm2d(4)
            self.tail = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))

    model = torch.nn.Sequential(Block(), torch.nn.Sequential(torch.nn.SyncBatchNorm(6)), torch.nn.BatchNorm3d(2))
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
    for k, m in enumerate(bns):
        m.running_mean.fill_(k + 1.0)
        m.num_batches_tracked.fill_(7)
    model[0].bn.weight.requires_grad_(False)
    model.eval()
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in bns]
    model = create_mnbn_model(model, comm)
    replaced = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
    assert all(type(m).__name__.startswith("MultiNodeBatchNorm") for m in replaced), [type(m) for m in replaced]
    assert [type(m).__name__ for m in replaced] == ["MultiNodeBatchNorm2d", "MultiNodeBatchNorm1d",
                                                    "MultiNodeBatchNorm", "MultiNodeBatchNorm3d"]
    for m, state in zip(replaced, states):
        for k, v in state.items():
            assert torch.equal(m.state_dict()[k], v), k
        assert not m.training
    assert not model[0].bn.weight.requires_grad


def check_create_mnbn_model_converts_subclasses(comm):
    """A model's own BatchNorm class is converted too (as torch's convert_sync_batchnorm does), a
    multi-node layer is left as it is, and a lazy one not yet built is refused with what to do."""
    class OwnBatchNorm(torch.nn.BatchNorm2d):
        pass
    mine = OwnBatchNorm(3).double()
    mine.running_mean.fill_(2.0)
    multi = MultiNodeBatchNorm1d(3, comm=comm)
    model = create_mnbn_model(torch.nn.Sequential(mine, multi), comm)
    assert type(model[0]).__name__ == "MultiNodeBatchNorm2d", type(model[0])
    assert torch.equal(model[0].running_mean, torch.full((3,), 2.0, dtype=torch.float64)) and model[1] is multi
    x = randn(2 + comm.rank, 3, 2, 2, seed=comm.rank)
    total = comm.allreduce(torch.stack([x.sum((0, 2, 3)), torch.full((3,), float(x.numel() // 3))]))
    model[0].train()(x)
    close(model[0].running_mean, 0.9 * 2.0 + 0.1 * total[0] / total[1], "running mean over the job")
    try:
        create_mnbn_model(torch.nn.LazyBatchNorm2d(), comm)
    except ValueError as e:
        assert "run one forward pass first" in str(e), e
    else:
        raise AssertionError("a lazy BatchNorm without its size was converted")


# ----------------------------------------------------------------------------- spatial convolution
ROW_SPLITS = {1: [13], 2: [12, 1], 3: [6, 1, 6], 4: [6, 1, 1, 5]}  # of 13 rows: one rank with a single row
COLUMN_SPLITS = {1: [11], 2: [10, 1]}  # of 11 columns


SPATIAL = [dict(kernel_size=k) for k in (1, 3, 5, 7)] + [
    dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2), dict(kernel_size=5, stride=2, padding=2),
    dict(kernel_size=3, dilation=2, padding=2), dict(kernel_size=3, padding="same"),
    dict(kernel_size=4, padding="same", dilation=2), dict(kernel_size=3, padding=1, groups=2),
    dict(kernel_size=(3, 5), stride=(2, 1), padding=(1, 2), groups=2)]


def _spatial_case(comm, kw, split="h", heights=None, widths=None, seed=0, after=lambda y: y):
    grid_rows, grid_cols = (comm.size, 1) if split == "h" else \
        next((comm.size // c, c) for c in range(int(comm.size ** 0.5), 0, -1) if comm.size % c == 0)
    heights = heights or ROW_SPLITS[grid_rows]
    widths = widths or COLUMN_SPLITS[grid_cols]
    x = randn(2, 4, sum(heights), sum(widths), seed=seed)
    torch.manual_seed(seed)
    layer = SpatialParallelConv2d(4, 6, comm=comm, split=split, **kw).double()
    torch.manual_seed(seed)
    dense = torch.nn.Conv2d(4, 6, **kw).double()
    i, j = divmod(comm.rank, grid_cols)
    r0, c0 = sum(heights[:i]), sum(widths[:j])
    block = x[:, :, r0:r0 + heights[i], c0:c0 + widths[j]].clone().requires_grad_()
    y = after(layer(block))
    xd = x.clone().requires_grad_()
    yd = after(dense(xd))
    g = randn(*yd.shape, seed=seed + 100)
    yd.backward(g)
    # Where this rank's output block sits: the blocks of the other ranks of its block row and column.
    shapes = [tuple(s.tolist()) for s in comm.allgather(torch.tensor(list(y.shape)))]
    out_r0 = sum(shapes[k * grid_cols][2] for k in range(i))
    out_c0 = sum(shapes[k][3] for k in range(j))
    mine = (slice(None), slice(None), slice(out_r0, out_r0 + y.shape[2]), slice(out_c0, out_c0 + y.shape[3]))
    what = f"{kw} split={split} heights={heights} widths={widths}"
    close(y, yd[mine], f"output, {what}")
    y.backward(g[mine])
    close(block.grad, xd.grad[:, :, r0:r0 + heights[i], c0:c0 + widths[j]], f"input gradient, {what}")
    close(comm.allreduce(layer.weight.grad), dense.weight.grad, f"weight gradient summed over ranks, {what}")
    close(comm.allreduce(layer.bias.grad), dense.bias.grad, f"bias gradient summed over ranks, {what}")


def check_spatial_conv(comm):
    for k, kw in enumerate(SPATIAL):
        _spatial_case(comm, kw, seed=k)


def check_spatial_conv_width_split(comm):
    for k, kw in enumerate(SPATIAL[::2]):
        _spatial_case(comm, kw, split="hw", seed=k)


def check_spatial_conv_empty_blocks(comm):
    """A rank holding no rows, and blocks that own no output row."""
    if comm.size < 2:
        return
    heights = [0] + [13 - (comm.size - 2)] + [1] * (comm.size - 2)
    _spatial_case(comm, dict(kernel_size=3, padding=1), heights=heights)
    _spatial_case(comm, dict(kernel_size=2, stride=2), heights=[3] + [1] * (comm.size - 2) + [13 - 3 - (comm.size - 2)])


def check_spatial_conv_then_inplace_relu(comm):
    """The output takes an in-place change, as any layer's does (ReLU(inplace=True) next)."""
    _spatial_case(comm, dict(kernel_size=3, padding=1), after=torch.nn.ReLU(inplace=True))
    if comm.size >= 2:
        heights = [0] + [13 - (comm.size - 2)] + [1] * (comm.size - 2)
        _spatial_case(comm, dict(kernel_size=3, padding=1), heights=heights, after=torch.nn.ReLU(inplace=True))


def check_spatial_conv_refuses_misfit_blocks(comm):
    if comm.size < 2:
        return
    layer = SpatialParallelConv2d(4, 6, 3, comm=comm).double()
    batch = 3 if comm.rank == 1 else 2
    try:
        layer(randn(batch, 4, 5, 7))
    except torchmn.CollectiveMismatchError as e:
        assert "rank 1: (3, 4, 5, 7)" in str(e) and "rank 0: (2, 4, 5, 7)" in str(e), e
    else:
        raise AssertionError("no error")


# ----------------------------------------------------------------------------- tensor parallel
def check_channel_conv(comm):
    x = randn(2, 6, 7, 5, seed=5)
    for kw in (dict(), dict(gather_output=False), dict(input_is_parallel=True), dict(padding_mode="reflect")):
        torch.manual_seed(1)
        layer = ChannelParallelConv2d(6, 5, 3, padding=1, comm=comm, **{k: v for k, v in kw.items()
                                                                          if k != "padding_mode"},
                                      padding_mode=kw.get("padding_mode", "zeros")).double()
        torch.manual_seed(1)
        dense = torch.nn.Conv2d(6, 5, 3, padding=1, padding_mode=kw.get("padding_mode", "zeros")).double()
        c_in = layer.in_sizes
        lo = sum(c_in[:comm.rank])
        xd = x.clone().requires_grad_()
        yd = dense(xd)
        g = randn(*yd.shape, seed=6)
        (yd * g).sum().backward()
        xi = (x[:, lo:lo + c_in[comm.rank]] if kw.get("input_is_parallel") else x).clone().requires_grad_()
        y = layer(xi)
        o_lo = sum(layer.out_sizes[:comm.rank])
        if kw.get("gather_output", True):
            close(y, yd, f"channel-parallel output {kw}")
            (y * g).sum().backward()
        else:
            close(y, yd[:, o_lo:o_lo + layer.out_sizes[comm.rank]], f"channel-parallel output slice {kw}")
            # Each rank's loss covers its slice; the input's gradient is summed over the ranks in backward.
            (y * g[:, o_lo:o_lo + y.shape[1]]).sum().backward()
        close(layer.weight.grad, dense.weight.grad[o_lo:o_lo + layer.out_sizes[comm.rank]], f"weight gradient {kw}")
        expected = xd.grad[:, lo:lo + c_in[comm.rank]] if kw.get("input_is_parallel") else xd.grad
        close(xi.grad, expected, f"input gradient {kw}")
        state = layer.dense_state_dict()
        close(state["weight"], dense.weight, "dense_state_dict")
        fresh = ChannelParallelConv2d(6, 5, 3, padding=1, comm=comm).double()
        fresh.load_dense_state_dict(dense.state_dict())
        close(fresh.weight, layer.weight, "load_dense_state_dict")


def check_channel_conv_grouped(comm):
    """ChainerMN's variant: the block-diagonal convolution (groups=size) where channels divide evenly."""
    x = randn(2, 2 * comm.size, 6, 6, seed=7)
    torch.manual_seed(2)
    layer = ChannelParallelConv2d(2 * comm.size, 3 * comm.size, 3, comm=comm, grouped=True).double()
    dense = torch.nn.Conv2d(2 * comm.size, 3 * comm.size, 3, groups=comm.size).double()
    blocks = layer.dense_state_dict()
    with torch.no_grad():
        for r in range(comm.size):
            dense.weight[3 * r:3 * r + 3] = blocks["weight"][3 * r:3 * r + 3, 2 * r:2 * r + 2]
        dense.bias.copy_(blocks["bias"])
    close(layer(x), dense(x), "grouped channel-parallel output")


def check_channel_conv_unbatched(comm):
    """An unbatched (C, H, W) input, which torch.nn.Conv2d takes: the dense layer's output, with every
    split (whole or sliced input, gathered or sliced output, grouped), uneven ones included; another
    number of dimensions is refused on every rank."""
    x = randn(2 * comm.size, 5, 5, seed=11)
    for out_channels, kw in ((5, {}), (5, {"gather_output": False}), (5, {"input_is_parallel": True}),
                             (3 * comm.size, {"grouped": True})):
        torch.manual_seed(4)
        layer = ChannelParallelConv2d(2 * comm.size, out_channels, 3, padding=1, comm=comm, **kw).double()
        dense = torch.nn.Conv2d(2 * comm.size, out_channels, 3, padding=1,
                                groups=comm.size if kw.get("grouped") else 1).double()
        blocks = layer.dense_state_dict()
        with torch.no_grad():
            if kw.get("grouped"):
                for r in range(comm.size):
                    dense.weight[3 * r:3 * r + 3] = blocks["weight"][3 * r:3 * r + 3, 2 * r:2 * r + 2]
            else:
                dense.weight.copy_(blocks["weight"])
            dense.bias.copy_(blocks["bias"])
        lo, o_lo = sum(layer.in_sizes[:comm.rank]), sum(layer.out_sizes[:comm.rank])
        y = layer(x[lo:lo + layer.in_sizes[comm.rank]] if kw.get("input_is_parallel") else x)
        want = dense(x)
        if kw.get("gather_output") is False:
            want = want[o_lo:o_lo + layer.out_sizes[comm.rank]]
        assert y.shape == want.shape, (kw, tuple(y.shape), tuple(want.shape))
        close(y, want, f"unbatched channel-parallel output {kw}")
    layer = ChannelParallelConv2d(2 * comm.size, 5, 3, comm=comm)
    layer(torch.randn(1, 2 * comm.size, 5, 5))  # agrees on the arguments
    try:
        layer(torch.randn(2 * comm.size, 5))
    except ValueError as e:
        assert "(N, C, H, W) or (C, H, W)" in str(e), e
    else:
        raise AssertionError("a 2-D input was convolved")


def check_column_row_mlp(comm):
    """Column -> ReLU -> Row: the dense MLP's output and gradients; one allreduce forward, one backward."""
    x = randn(3, 8, seed=8)
    torch.manual_seed(3)
    up = ColumnParallelLinear(8, 4 * comm.size + 1, comm=comm, gather_output=False).double()
    down = RowParallelLinear(4 * comm.size + 1, 5, comm=comm, input_is_parallel=True).double()
    torch.manual_seed(3)
    dense_up, dense_down = torch.nn.Linear(8, 4 * comm.size + 1).double(), torch.nn.Linear(4 * comm.size + 1, 5).double()
    xi, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    down(torch.relu(up(xi)))  # the first forward agrees on the layers' arguments
    calls = comm.call_log.calls
    y = down(torch.relu(up(xi)))
    forward_calls = comm.call_log.calls - calls
    yd = dense_down(torch.relu(dense_up(xd)))
    close(y, yd, "Column -> Row output")
    g = randn(*y.shape, seed=9)
    for p in list(up.parameters()) + list(down.parameters()):
        p.grad = None
    xi.grad = None
    calls = comm.call_log.calls
    (y * g).sum().backward()
    backward_calls = comm.call_log.calls - calls
    (yd * g).sum().backward()
    if comm.size > 1:
        assert (forward_calls, backward_calls) == (1, 1), (forward_calls, backward_calls)
    rows = up.out_sizes if hasattr(up, "out_sizes") else up.sizes
    lo = sum(rows[:comm.rank])
    close(up.weight.grad, dense_up.weight.grad[lo:lo + rows[comm.rank]], "column weight gradient")
    close(down.weight.grad, dense_down.weight.grad[:, lo:lo + rows[comm.rank]], "row weight gradient")
    close(down.bias.grad, dense_down.bias.grad, "row bias gradient")
    close(xi.grad, xd.grad, "input gradient")
    for layer, dense in ((up, dense_up), (down, dense_down)):
        state = layer.dense_state_dict()
        close(state["weight"], dense.weight, "dense_state_dict weight")
        close(state["bias"], dense.bias, "dense_state_dict bias")


def check_column_and_row_alone(comm):
    x = randn(4, 6, seed=10)
    torch.manual_seed(4)
    col = ColumnParallelLinear(6, 2 * comm.size, comm=comm).double()
    torch.manual_seed(4)
    dense = torch.nn.Linear(6, 2 * comm.size).double()
    close(col(x), dense(x), "ColumnParallelLinear(gather_output=True)")
    torch.manual_seed(5)
    row = RowParallelLinear(6, 3, comm=comm).double()
    torch.manual_seed(5)
    dense = torch.nn.Linear(6, 3).double()
    xi, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    close(row(xi), dense(xd), "RowParallelLinear(input_is_parallel=False)")
    row(xi).sum().backward()
    dense(xd).sum().backward()
    close(xi.grad, xd.grad, "RowParallelLinear input gradient")


def check_dense_state_dict_loads_as_it_is(comm):
    """A dense model's state_dict loads into its sliced counterpart with load_state_dict (each rank
    takes its slice), also nested in a model; the layer's own (sliced) state_dict still loads."""
    torch.manual_seed(3)
    dense = torch.nn.Sequential(torch.nn.Linear(6, 2 * comm.size + 1), torch.nn.Linear(2 * comm.size + 1, 4),
                                torch.nn.Conv2d(3, comm.size + 2, 3), torch.nn.Conv2d(comm.size, comm.size, 3)).double()
    torch.manual_seed(4)  # other initial weights than the dense model's
    sliced = torch.nn.Sequential(ColumnParallelLinear(6, 2 * comm.size + 1, comm=comm),
                                 RowParallelLinear(2 * comm.size + 1, 4, comm=comm),
                                 ChannelParallelConv2d(3, comm.size + 2, 3, comm=comm),
                                 ChannelParallelConv2d(comm.size, comm.size, 3, comm=comm, grouped=True)).double()
    sliced.load_state_dict(dense.state_dict())
    for i in range(4):
        want = dense[i].state_dict()
        if i == 3:  # the grouped layer keeps the diagonal blocks: compare those
            r = comm.rank
            want = {"weight": want["weight"][r:r + 1, r:r + 1], "bias": want["bias"][r:r + 1]}
            got = sliced[i].state_dict()
        else:
            got = sliced[i].dense_state_dict()
        for k in want:
            close(got[k], want[k], f"layer {i} {k}")
    own = {k: v.clone() for k, v in sliced.state_dict().items()}
    sliced.load_state_dict(own)
    for k, v in sliced.state_dict().items():
        assert torch.equal(v, own[k]), k


def check_arguments_refused(comm):
    if comm.size < 2:
        return
    layer = ColumnParallelLinear(6, 4 if comm.rank else 6, comm=comm)
    try:
        layer(torch.randn(2, 6))
    except torchmn.CollectiveMismatchError as e:
        assert "rank 0: (6, 6" in str(e) and "rank 1: (6, 4" in str(e), e
    else:
        raise AssertionError("no error")
    # A whole input of the wrong width: refused on every rank alike, before any collective (a rank's
    # slice of it would not fit its weight, on one rank only).
    for layer in (ColumnParallelLinear(7, 8, comm=comm), RowParallelLinear(7, 3, comm=comm)):
        try:
            layer(torch.randn(2, 6))
        except ValueError as e:
            assert "expected an input of 7 features, got shape (2, 6)" in str(e), e
        else:
            raise AssertionError("no error")
    # Batches of different sizes: the gathered output cannot be joined; every rank is told which.
    layer = ColumnParallelLinear(6, 4, comm=comm)
    try:
        layer(torch.randn(3 if comm.rank == 1 else 2, 6))
    except torchmn.CollectiveMismatchError as e:
        assert "rank 0: (2, " in str(e) and "rank 1: (3, " in str(e) and "same input" in str(e), e
    else:
        raise AssertionError("no error")


def check_input_refused_on_one_rank_is_named_on_every_rank(comm):
    """An input only rank 1 gets wrong: its own error there at once, and every other rank, in the
    layer's collective, is told that rank 1 refused its arguments instead of waiting for it until
    the timeout (60 s here)."""
    if comm.size < 2:
        return
    bad = comm.rank == 1
    cases = [
        ("functions.alltoall", lambda: torchmn.functions.alltoall(comm, [torch.ones(2)] * (comm.size + bad))),
        ("functions.scatter", lambda: torchmn.functions.scatter(comm, [torch.ones(2)] * (comm.size + bad), root=1)),
        ("RowParallelLinear", lambda: RowParallelLinear(2 * comm.size, 3, comm=comm, input_is_parallel=True)(
            torch.randn(2, 2 + bad))),
        ("ColumnParallelLinear", lambda: ColumnParallelLinear(4, 2 * comm.size, comm=comm, gather_output=True)(
            torch.randn(2, 4 + bad))),
        ("SpatialParallelConv2d", lambda: SpatialParallelConv2d(2, 2, 3, padding=1, comm=comm)(
            torch.randn(1, 2, 3) if bad else torch.randn(1, 2, 3, 3))),
    ]
    for what, call in cases:
        started = time.monotonic()
        try:
            call()
        except torchmn.communicators.RemoteRankError as e:
            assert not bad and "rank 1" in str(e), f"{what}: {e}"
        except ValueError as e:
            assert bad, f"{what}: {e}"
        else:
            raise AssertionError(f"{what}: no error on rank {comm.rank}")
        assert time.monotonic() - started < 20, f"{what}: rank {comm.rank} waited {time.monotonic() - started:.0f} s"


if __name__ == "__main__":
    run_checks(globals())
