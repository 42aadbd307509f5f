"""horovodrun's command-line flags in ``torchmn run``: each is taken as torchmn's own, mapped to
what does the same here, accepted with a note where it tunes something torchmn does otherwise, or
refused with what to use instead. None is silently misread.

``-np``, ``-H``, ``--hostfile``, ``--start-timeout``, ``--network-interface`` and ``--verbose`` are
``torchmn run``'s own; ``-p`` / ``-i`` are its ``--ssh-port`` / ``--ssh-identity-file``.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Tuple

# flag: (how many values it takes, as horovodrun's; what it becomes: an environment variable to set,
# "note", or "refuse"; why).
# Environment variables are set for every rank (local and remote), as `-x NAME=VALUE` would.
FLAGS: Dict[str, Tuple[int, str, str]] = {
    "--gloo": (0, "note", "torchmn's ranks always talk through torch.distributed (gloo on CPU, NCCL on GPU)"),
    "--timeline-filename": (1, "env:HOROVOD_TIMELINE", "torchmn.horovod writes its timeline there, as Horovod"),
    "--timeline-mark-cycles": (0, "note", "torchmn's timeline has no cycle markers"),
    "--fusion-threshold-mb": (1, "env:HOROVOD_FUSION_THRESHOLD_MB",
                              "the DistributedOptimizer's gradient buckets take this size"),
    "--gloo-timeout-seconds": (1, "env:TORCHMN_TIMEOUT", "how long a collective waits for the other ranks"),
    "--nics": (1, "network_interface", "the interface the rendezvous address is taken from"),
    "--output-filename": (1, "log_dir", "each rank's output goes to DIR/rank.<r>.log"),
    "--cycle-time-ms": (1, "note", "torchmn sends gradient buckets from backward hooks, with no cycle"),
    "--cache-capacity": (1, "note", "torchmn negotiates no tensors, so there is no response cache"),
    "--disable-cache": (0, "note", "torchmn negotiates no tensors, so there is no response cache"),
    "--hierarchical-allreduce": (0, "note", "torchmn's default on CPU already reduces inside each node first "
                                                "(shared memory), then between nodes"),
    "--hierarchical-allgather": (0, "note", "torchmn's allgather is one collective"),
    "--autotune": (0, "note", "torchmn's search for such settings is `torchmn tune -np N -- COMMAND`"),
    "--autotune-log-file": (1, "note", "`torchmn tune --storage URL` keeps its trials"),
    "--no-stall-check": (0, "note", "torchmn names the ranks missing from a collective at its timeout "
                                        "(TORCHMN_TIMEOUT, or --gloo-timeout-seconds)"),
    "--stall-check-warning-time-seconds": (1, "note", "see --no-stall-check"),
    "--stall-check-shutdown-time-seconds": (1, "note", "see --no-stall-check"),
    "--num-nccl-streams": (1, "note", "NCCL's streams are torch's"),
    "--thread-affinity": (1, "note", "torchmn gives each rank a CPU thread budget instead"),
    "--tcp": (0, "note", "torchmn always uses TCP between hosts"),
    "--mpi": (0, "refuse", "to run under MPI, start the ranks with mpirun itself: `mpirun -np N python "
                               "train.py` (torchmn detects Open MPI and MPICH)"),
    "--mpi-args": (1, "refuse", "start the ranks with mpirun itself and pass its arguments there"),
    "--jsrun": (0, "refuse", "start the ranks with jsrun itself"),
    "--binding-args": (1, "refuse", "torchmn run binds ranks itself: --bind numa|core|none (see docs/cpu.md)"),
    "--config-file": (1, "refuse", "pass the settings as flags (torchmn run reads no YAML config)"),
    "--slots-per-host": (1, "refuse", "give slots with -H host:N or a --hostfile"),
    "--blacklist-cooldown-range": (2, "note", "torchmn run waits 10 s before starting a new worker on a host "
                                                 "where one failed before joining"),
}
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def add_to(parser: argparse.ArgumentParser) -> None:
    """Add horovodrun's flags to ``torchmn run``'s parser (hidden from its help but ``--log-level``).

    Adds ``--log-level`` and ``--check-build`` / ``-cb`` with their help, and every flag of
    ``FLAGS`` hidden, each stored as ``horovodrun_<flag>`` (its value, a list of its values where it
    takes several, or True for a flag without one; None when not given), for ``translate`` to read.

    Args:
        parser: the ``run`` subcommand's parser.

    Example::

        >>> parser = argparse.ArgumentParser(prog="torchmn run")
        >>> add_to(parser)
        >>> parser.parse_args(["--fusion-threshold-mb", "32"]).horovodrun_fusion_threshold_mb
        '32'
    """
    group = parser.add_argument_group("horovodrun's flags")
    group.add_argument("--log-level", choices=LOG_LEVELS, type=str.upper, default=None,
                       help="as horovodrun's: TRACE, DEBUG and INFO make the launcher verbose")
    group.add_argument("--check-build", "-cb", action="store_true",
                       help="print what torchmn.horovod supports (horovodrun's --check-build) and exit")
    for flag, (values, _, _) in FLAGS.items():
        kwargs = dict(dest="horovodrun_" + flag[2:].replace("-", "_"), default=None, help=argparse.SUPPRESS)
        if values == 1:
            group.add_argument(flag, metavar="VALUE", **kwargs)
        elif values:
            group.add_argument(flag, nargs=values, metavar="VALUE", **kwargs)
        else:
            group.add_argument(flag, action="store_const", const=True, **kwargs)


def translate(args: argparse.Namespace) -> Tuple[List[str], Optional[str]]:
    """What horovodrun's flags on the command line mean here.

    Sets ``args.verbose``, ``args.network_interface`` and ``args.log_dir`` where a flag maps to them
    and adds ``-x`` exports for the ones that become variables.

    Args:
        args: the parsed ``torchmn run`` arguments.

    Returns:
        ``(notes, refusal)``: a line for each flag accepted with a note, and the message refusing
        the first flag that has no counterpart here, or that was given together with ``torchmn
        run``'s own option for the same setting (None when there is no such flag). Flags after a
        refused one are not looked at.

    Example::

        >>> from torchmn.cli import build_parser
        >>> args = build_parser().parse_args(["run", "-np", "2", "--fusion-threshold-mb", "32", "--autotune",
        ...                                   "python", "train.py"])
        >>> translate(args)
        (['torchmn run: note: --autotune has no effect: torchmn's search for such settings is `torchmn tune -np N -- COMMAND`'], None)
        >>> args.exports
        ['HOROVOD_FUSION_THRESHOLD_MB=32']
    """
    notes: List[str] = []
    if args.log_level in ("TRACE", "DEBUG", "INFO"):
        args.verbose = True
    for flag, (_, becomes, why) in FLAGS.items():
        value = getattr(args, "horovodrun_" + flag[2:].replace("-", "_"))
        if value is None:
            continue
        if becomes == "refuse":
            return notes, f"{flag} is horovodrun's and has no counterpart here: {why}"
        if becomes == "note":
            notes.append(f"torchmn run: note: {flag} has no effect: {why}")
        elif becomes.startswith("env:"):
            args.exports.append(f"{becomes[4:]}={value}")
        elif getattr(args, becomes) is None:
            setattr(args, becomes, value)
        else:
            return notes, f"{flag} and torchmn run's own option for the same thing were both given; keep one"
    return notes, None


def build_report() -> str:
    """What horovodrun's ``--check-build`` prints, for torchmn.horovod.

    Imports torch (the only function of this module that does): it asks torch.distributed
    whether NCCL is available.

    Returns:
        Lines naming the frameworks, controllers and tensor operations, each marked ``[X]`` where
        torchmn.horovod has it: PyTorch, Gloo, and NCCL where torch has it; the others ``[ ]``.

    Example::

        >>> print(build_report())     # doctest: +ELLIPSIS
        torchmn.horovod, on torch.distributed:
        Available Frameworks:
            [ ] TensorFlow
            [X] PyTorch
        ...
    """
    import torch.distributed as dist

    mark = {True: "[X]", False: "[ ]"}
    nccl = dist.is_available() and dist.is_nccl_available()
    return "\n".join([
        "torchmn.horovod, on torch.distributed:",
        "Available Frameworks:", f"    {mark[False]} TensorFlow", f"    {mark[True]} PyTorch", f"    {mark[False]} MXNet",
        "Available Controllers:", f"    {mark[False]} MPI", f"    {mark[True]} Gloo",
        "Available Tensor Operations:", f"    {mark[nccl]} NCCL", f"    {mark[False]} DDL", f"    {mark[False]} CCL",
        f"    {mark[False]} MPI", f"    {mark[True]} Gloo"])
