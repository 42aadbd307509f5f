"""``torchmn info``: what a rank started here would find, in one report.

The launcher it detects and its place in the job (``torchmn.environments``), its CPU thread budget
and what the budget is based on (``torchmn.resources``), the ``torch.distributed`` backends, the
GPUs, the versions, the room in ``/dev/shm`` next to what torchmn's shared memory needs
(``torchmn.communicators.shm``), mpi4py, and the NUMA domains ``torchmn run --bind`` binds ranks to
(``torchmn.run.processes.binding``). Run it the way the job's ranks run
(``torchmn run -np 2 torchmn info``, ``srun -n 4 torchmn info``) to see each rank's view.

Importing this module does not import torch (the ``torchmn`` command imports it for every
subcommand); ``gather`` does, for the backends and GPUs.

Example::

    $ torchmn info
    $ torchmn info --json
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import sys
from typing import Any, Dict, Mapping, Optional

from torchmn import __version__, resources
from torchmn.environments import detect_environment
from torchmn.errors import TorchmnError
from torchmn.run.processes import binding

EXIT_BAD_ENVIRONMENT = 2
# Each launcher's ``source`` (``torchmn.environments``) in words.
LAUNCHER_NAMES = {
    "single": "none (a world of one process)",
    "torchmn": "torchmn run",
    "torchrun": "torchrun (torchelastic)",
    "openmpi": "Open MPI (mpirun)",
    "mpich": "MPICH or Intel MPI (mpiexec)",
    "slurm": "Slurm (srun)",
    "env": "torch's env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), set by hand or a scheduler",
}


class InfoError(TorchmnError, ValueError):
    """This process's environment cannot be read as a rank's: malformed launcher variables, a bad
    thread or shared-memory setting. The message says what and how to fix it."""


def package_version(name: str) -> Optional[str]:
    """An installed distribution's version, read from its metadata: nothing is imported.

    Args:
        name: the distribution, e.g. ``"torch"``.

    Returns:
        The version, or None where it is not installed.

    Example::

        >>> package_version("no-such-distribution-xyz") is None
        True
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_text() -> str:
    """What ``torchmn --version`` prints: torchmn's version, torch's and Python's, torch not imported.

    Returns:
        e.g. ``torchmn 0.1.0 (torch 2.13.0+cpu, Python 3.12.3)``.

    Example::

        >>> version_text().startswith("torchmn ")
        True
    """
    torch = package_version("torch")
    return (f"torchmn {__version__} ({'torch ' + torch if torch else 'torch not installed'}, "
            f"Python {platform.python_version()})")


def _launcher(env: Mapping[str, str]) -> Dict[str, Any]:
    try:
        place = detect_environment(env)
    except (ValueError, RuntimeError) as e:
        raise InfoError(f"the launcher's variables cannot be read: {e}") from None
    return {"source": place.source, "rank": place.rank, "size": place.size, "local_rank": place.local_rank,
            "local_size": place.local_size, "node_rank": place.node_rank, "master_addr": place.master_addr,
            "master_port": place.master_port, "describe": place.describe()}


def _torch():
    """torch, imported; None where it is not installed."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch
    import torch.distributed

    return torch


def _count(value: Optional[str]) -> Optional[int]:
    """A thread-count variable's count (OpenMP's "4,2" counts 4); None where unset, empty or invalid."""
    try:
        count = int(value.split(",")[0]) if value else 0
    except ValueError:
        return None
    return count if count > 0 else None


def _threads(local_size: int, source: str, env: Mapping[str, str], torch) -> Dict[str, Any]:
    try:
        requested = resources.requested_threads(env)
    except ValueError as e:
        raise InfoError(str(e)) from None
    available = resources.cpu_count_available(env)
    omp = env.get("OMP_NUM_THREADS")
    by_launcher = sorted(filter(None, env.get(resources.TORCHMN_THREAD_VARIABLES, "").split(",")))
    users_omp = _count(omp) is not None and _count(omp) != requested
    if users_omp:
        budget = _count(omp)
        basis = f"OMP_NUM_THREADS={omp}, which you set, so torchmn leaves the thread pools alone"
    else:
        if torch is not None:
            # What create_communicator does, on a copy of the environment: the same number.
            try:
                budget = resources.apply_thread_budget(local_size, dict(env))
            except ValueError as e:
                raise InfoError(str(e)) from None
        else:
            budget = requested or resources.thread_budget(resources.ranks_sharing_cpus(local_size, env), env)
        if requested is not None:
            basis = (f"{resources.TORCHMN_NUM_THREADS}={requested}, set by torchmn run for its {local_size} "
                     f"rank(s) on this node" if resources.TORCHMN_NUM_THREADS in by_launcher else
                     f"{resources.TORCHMN_NUM_THREADS}={requested}, which you set")
        elif resources.ranks_sharing_cpus(local_size, env) > 1 or local_size == 1:
            basis = f"{available} CPU(s) available, shared by the {local_size} rank(s) on this node"
        else:
            basis = f"{available} CPU(s) available to this task alone (srun --cpus-per-task)"
    if source == "env" and "LOCAL_WORLD_SIZE" not in env:  # as create_communicator decides
        basis += "; without LOCAL_WORLD_SIZE the ranks on this node are a guess, counted again from the hosts' names"
    return {"budget": budget, "basis": basis, "cpus_available": available, "cpu_limits": resources.cpu_limits(env),
            "local_size": local_size, "OMP_NUM_THREADS": omp,
            resources.TORCHMN_NUM_THREADS: env.get(resources.TORCHMN_NUM_THREADS), "set_by_torchmn_run": by_launcher}


def _backends(torch) -> Dict[str, Optional[bool]]:
    if torch is None or not torch.distributed.is_available():
        return {"gloo": None, "nccl": None, "mpi": None}
    dist = torch.distributed
    return {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}


def _gpus(torch, env: Mapping[str, str]) -> Dict[str, Any]:
    if torch is None:
        return {"count": 0, "names": [], "cuda": None, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES")}
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"count": count, "names": [torch.cuda.get_device_name(i) for i in range(count)],
            "cuda": torch.version.cuda, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES")}


def _shm(local_size: int, torch) -> Dict[str, Any]:
    path = "/dev/shm"
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return {"path": path, "exists": False}
    out: Dict[str, Any] = {"path": path, "exists": True, "total": usage.total, "free": usage.free}
    if torch is None:
        return out
    from torchmn.communicators import shm

    slot = shm.requested_slot_bytes()  # checked by _check_settings
    segment = shm.NodeSegment.size_for(local_size, slot)
    out.update({"slot_bytes": slot, "segment_bytes": segment, "usable_bytes": shm.fits_in(usage.free),
                "fitting_slot_bytes": shm.fitting_slot_bytes(local_size, usage.free)})
    return out


def _check_settings(env: Mapping[str, str]) -> None:
    """Refuse a malformed TORCHMN_NUM_THREADS, TORCHMN_INTEROP_THREADS, TORCHMN_SHM_SLOT_MB or
    TORCHMN_BUCKET_CAP_MB before torch is imported, so that the error comes at once (a rank checks
    each of them, whatever else is set)."""
    try:
        resources.requested_threads(env)
        resources.requested_interop_threads(env)
        resources.shm_slot_mb_requested(env)
        resources.bucket_cap_mb_requested(env)
    except ValueError as e:
        raise InfoError(str(e)) from None


def _cross_node(env: Mapping[str, str], torch) -> Optional[str]:
    """The allreduce across nodes that ``TORCHMN_CROSS_NODE_ALGORITHM`` asks for (None without torch)."""
    if torch is None:
        return None
    from torchmn.communicators import cross_node
    try:
        return cross_node.requested(env)
    except ValueError as e:
        raise InfoError(str(e)) from None


def _mpi4py() -> Dict[str, Any]:
    installed = importlib.util.find_spec("mpi4py") is not None
    return {"installed": installed, "version": package_version("mpi4py") if installed else None}


def collect(env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Everything ``torchmn info`` reports, as a dict (what ``--json`` prints).

    Imports torch where it is installed (the backends, GPUs and shared-memory sizes need it), and
    applies the thread budget to this process as ``create_communicator`` would
    (``torchmn.resources.apply_thread_budget``), so that the number reported is the one a rank
    gets, also under ``srun --cpus-per-task``: call it in a process of its own, as ``torchmn info``
    does. Connects to nothing.

    Args:
        env: the environment (default: ``os.environ``).

    Returns:
        ``versions``, ``host``, ``launcher`` (source, rank, size, local_rank, local_size,
        node_rank, master_addr, master_port, describe), ``threads`` (budget, basis,
        cpus_available, cpu_limits, ...), ``backends`` (gloo, nccl, mpi: True/False, None without
        torch), ``gpus`` (count, names, cuda), ``shm`` (total, free, what the collectives'
        segment needs), ``cross_node`` (the allreduce across nodes asked for: auto, ring or
        doubling), ``mpi4py`` and ``numa`` (the CPUs of each NUMA domain this process may use).

    Raises:
        InfoError: the launcher's variables, ``TORCHMN_NUM_THREADS``, ``TORCHMN_SHM_SLOT_MB`` or
            ``TORCHMN_CROSS_NODE_ALGORITHM`` are malformed.

    Example::

        >>> collect({})["launcher"]["source"]
        'single'
    """
    env = dict(os.environ if env is None else env)
    launcher = _launcher(env)
    _check_settings(env)
    torch = _torch()
    return {
        "versions": {"torchmn": __version__, "torch": package_version("torch"),
                     "python": platform.python_version()},
        "host": socket.gethostname(),
        "launcher": launcher,
        "threads": _threads(launcher["local_size"], launcher["source"], env, torch),
        "backends": _backends(torch),
        "gpus": _gpus(torch, env),
        "shm": _shm(launcher["local_size"], torch),
        "cross_node": _cross_node(env, torch),
        "mpi4py": _mpi4py(),
        "numa": binding.numa_domains(binding.allowed_cpus()),
    }


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _yes(value: Optional[bool]) -> str:
    return "unknown (no torch)" if value is None else ("yes" if value else "no")


def _shm_lines(shm: Dict[str, Any], local_size: int) -> list:
    if not shm["exists"]:
        return [f"{shm['path']} does not exist, so the ranks of a node talk over TCP (slower)"]
    lines = [f"{_size(shm['total'])}, {_size(shm['free'])} free"]
    if "segment_bytes" not in shm:
        return lines + ["what torchmn needs there is not known without torch"]
    slots = f"slots of {_size(shm['slot_bytes'])} each (TORCHMN_SHM_SLOT_MB)"
    optimizer = "each optimizer that shares memory, about (ranks + 1) x the model's size"
    if local_size < 2:
        return lines + [f"not used by one rank alone on a node; with N ranks on a node, their collectives take "
                        f"N + 1 {slots} and {optimizer}; torchmn takes at most half the free room"]
    fit = shm["fitting_slot_bytes"]
    if fit >= shm["slot_bytes"]:
        verdict = "enough"
    elif fit > 0:
        verdict = f"too little for full slots, so slots of {_size(fit)} (larger tensors go in more pieces)"
    else:
        verdict = ("too little, so the ranks of a node talk over TCP (slower); give /dev/shm more room "
                   "(docker run --shm-size=1g)")
    return lines + [f"collectives of the {local_size} ranks on this node take {_size(shm['segment_bytes'])} "
                    f"({local_size + 1} {slots}), at most half the free room: {verdict}; and {optimizer}"]


_CROSS_NODE_TEXT = {
    "auto": "allreduce by recursive doubling up to the size measured at set-up, gloo's ring above "
            "(TORCHMN_CROSS_NODE_ALGORITHM=ring|doubling fixes it; rank 0 logs the choice at INFO)",
    "ring": "allreduce by gloo's ring at every size (TORCHMN_CROSS_NODE_ALGORITHM=ring)",
    "doubling": "allreduce by recursive doubling at every size (TORCHMN_CROSS_NODE_ALGORITHM=doubling)",
}


def _numa_line(domains: list) -> str:
    cpus = " | ".join(binding.format_cpu_list(d) for d in domains)
    if len(domains) < 2:
        return f"1 domain (CPUs {cpus}): torchmn run binds no rank here (--bind numa)"
    return f"{len(domains)} domains (CPUs {cpus}): torchmn run spreads each host's ranks over them (--bind numa)"


def format_text(info: Mapping[str, Any]) -> str:
    """``torchmn info``'s text report of what ``gather`` returned.

    Args:
        info: ``collect()``'s dict.

    Returns:
        One line per topic.

    Example::

        >>> print(format_text(collect({})))    # doctest: +SKIP
        torchmn:    0.1.0 (torch 2.13.0+cpu, Python 3.12.3) on vm
        launcher:   none (a world of one process)
        ...
    """
    v, launcher, threads, gpus = info["versions"], info["launcher"], info["threads"], info["gpus"]
    torch = f"torch {v['torch']}" if v["torch"] else "torch not installed"
    source = launcher["source"]
    limits = threads["cpu_limits"]
    if gpus["count"]:
        gpu_line = f"{gpus['count']}: {', '.join(gpus['names'])} (CUDA {gpus['cuda']})"
    else:
        gpu_line = "none" + (f" (torch built with CUDA {gpus['cuda']}, but no GPU is visible)" if gpus["cuda"]
                             else " (torch built without CUDA)" if v["torch"] else "")
    mpi = info["mpi4py"]
    shm_lines = _shm_lines(info["shm"], launcher["local_size"])
    rows = [
        ("torchmn", f"{v['torchmn']} ({torch}, Python {v['python']}) on {info['host']}"),
        ("launcher", f"{LAUNCHER_NAMES.get(source, source)}" + ("" if source == "single" else f" (source {source!r})")),
        ("place", f"rank {launcher['rank']} of {launcher['size']}, local rank {launcher['local_rank']} of "
                  f"{launcher['local_size']}, " + (f"node {launcher['node_rank']}" if launcher["node_rank"] is not None
                                           else "node not named by the launcher (grouped by host name)")),
        ("rendezvous", "none needed (a world of one process opens no port)" if source == "single" else
         f"{launcher['master_addr']}:{launcher['master_port']}" if launcher["master_port"] is not None else
         f"{launcher['master_addr']}, no port: set MASTER_PORT (the same on every rank), which torch's env:// "
         f"needs"),
        ("threads", f"{threads['budget']} per rank ({threads['basis']})"),
        ("CPUs", f"{threads['cpus_available']} available (affinity {limits['affinity']}, cgroup limit "
                 f"{limits['cgroup'] or 'none'}, Slurm {limits['slurm'] or 'none'})"),
        ("backends", f"gloo {_yes(info['backends']['gloo'])}, nccl {_yes(info['backends']['nccl'])}, "
                     f"mpi {_yes(info['backends']['mpi'])}"),
        ("GPUs", gpu_line),
        ("/dev/shm", shm_lines[0]),
        *(("", line) for line in shm_lines[1:]),
        ("cross-node", _CROSS_NODE_TEXT.get(info["cross_node"], "unknown (torch not installed)")),
        ("mpi4py", mpi["version"] if mpi["installed"] else "not installed"),
        ("NUMA", _numa_line(info["numa"])),
    ]
    lines = [f"{label + ':' if label else '':<12}{text}" for label, text in rows]
    return "\n".join(lines)


def add_info(subparsers) -> None:
    """Register ``torchmn info`` on the ``torchmn`` command's subparsers.

    The subcommand takes ``--json`` and calls ``run_info`` (its ``handler``).

    Args:
        subparsers: what ``argparse.ArgumentParser.add_subparsers`` returned.

    Example::

        >>> import argparse
        >>> parser = argparse.ArgumentParser(prog="torchmn")
        >>> add_info(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["info", "--json"]).json
        True
    """
    p = subparsers.add_parser(
        "info", allow_abbrev=False, help="what a rank started here would find: launcher, place, threads, GPUs",
        description="Report what a rank started here would find: the launcher it detects and its rank, size, "
                    "local rank, local size, node and rendezvous; its CPU thread budget and what that is based "
                    "on; the torch.distributed backends; the GPUs; the room in /dev/shm against what torchmn's "
                    "shared memory needs; the versions of torchmn, torch and mpi4py. Nothing is connected to.",
        epilog="Run it as the job's ranks run to see each rank's view: torchmn run -np 2 torchmn info, "
               "srun -n 4 torchmn info, mpirun -np 2 torchmn info. Exit status: 0, or 2 where the launcher's "
               "variables (or TORCHMN_NUM_THREADS, TORCHMN_SHM_SLOT_MB) are malformed.")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on one line (under torchmn run: one line per rank)")
    p.set_defaults(handler=run_info, subparser=p)


def run_info(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The handler of ``torchmn info``.

    Args:
        args: the parsed options (``json``).
        parser: the subcommand's parser.

    Returns:
        0, or ``EXIT_BAD_ENVIRONMENT`` (2) with the error on stderr where this process's environment
        cannot be read (see ``InfoError``).

    Example::

        >>> from torchmn.cli import main
        >>> main(["info"])   # doctest: +SKIP
        0
    """
    try:
        info = collect()
    except InfoError as e:
        sys.stderr.write(f"torchmn info: error: {e}\n")
        return EXIT_BAD_ENVIRONMENT
    sys.stdout.write((json.dumps(info) if args.json else format_text(info)) + "\n")
    return 0
