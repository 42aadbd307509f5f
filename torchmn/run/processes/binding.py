"""Binding ranks to CPUs: ``torchmn run --bind numa|core|none``.

On a node of several NUMA domains, a rank whose threads wander between domains reads its
memory across the interconnect, and ranks of one domain crowd each other's caches while another
domain idles. Binding keeps each rank on CPUs of its own:

- ``numa`` (the default): the ranks of a host are spread over its NUMA domains in blocks (ranks
  0..k-1 on the first domain, and so on; with fewer ranks than domains each rank gets whole
  domains). On a host of one domain nothing is bound.
- ``core``: each rank gets its own cores (a core's hardware threads stay together), all in one
  domain: the ranks are spread over the domains as with ``numa``, and each domain's cores shared
  out among its ranks; it needs at least one core per rank.
- ``none``: ranks run wherever the kernel puts them.

The process that starts a rank (the launcher for ranks on its own host, the watcher on another
host) binds it between fork and exec, so every thread the rank ever makes inherits the CPUs;
the rank's thread budget is then its CPUs divided among the ranks that share them. Only the
standard library is used here: the watcher imports this module, and must not import torch.
Linux only: elsewhere (no ``sched_setaffinity``) nothing is bound.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from torchmn.errors import TorchmnValueError

MODES = ("numa", "core", "none")
DEFAULT_MODE = "numa"
VARIABLE = "TORCHMN_BIND"  # the mode, in each rank's environment (the watcher reads it there)
SYS_ROOT = "/sys/devices/system"


@dataclasses.dataclass(frozen=True)
class Binding:
    """Where one rank runs.

    Attributes:
        cpus: the CPU numbers it is bound to.
        sharing: how many ranks of its host are bound to the same CPUs.
        where: the CPUs in words, for messages (``"NUMA node 1 (CPUs 8-15)"``).
    """

    cpus: tuple
    sharing: int
    where: str

    @property
    def threads(self) -> int:
        """The rank's thread budget: its CPUs divided among the ranks that share them (at least 1)."""
        return max(1, len(self.cpus) // self.sharing)


def parse_cpu_list(text: str) -> List[int]:
    """CPU numbers from the kernel's list form.

    Args:
        text: e.g. ``"0-3,8,10-11"`` (blank: none).

    Returns:
        The numbers, in order.

    Raises:
        ValueError: text that is not a CPU list.

    Example::

        >>> parse_cpu_list("0-2,8")
        [0, 1, 2, 8]
    """
    cpus: List[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def format_cpu_list(cpus: Sequence[int]) -> str:
    """The kernel's list form of CPU numbers.

    Args:
        cpus: CPU numbers.

    Returns:
        Runs of consecutive numbers joined by commas.

    Example::

        >>> format_cpu_list([0, 1, 2, 8])
        '0-2,8'
    """
    runs: List[List[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def numa_domains(allowed: Sequence[int], root: str = SYS_ROOT) -> List[List[int]]:
    """The CPUs of each NUMA domain that are among ``allowed``; domains with none left out.

    Args:
        allowed: the CPUs the starting process may use (its affinity).
        root: where the kernel's ``node`` and ``cpu`` folders are.

    Returns:
        One sorted CPU list per domain, in the domains' order; one list of every allowed CPU where
        the kernel shows no domains.

    Example::

        >>> numa_domains(sorted(os.sched_getaffinity(0)))     # a one-domain machine with 2 CPUs
        [[0, 1]]
    """
    mine = set(allowed)
    domains = []
    paths = glob.glob(os.path.join(root, "node", "node[0-9]*", "cpulist"))
    for path in sorted(paths, key=lambda p: int(re.findall(r"node(\d+)", p)[-1])):
        try:
            cpus = [c for c in parse_cpu_list(_read(path) or "") if c in mine]
        except ValueError:
            continue
        if cpus:
            domains.append(cpus)
    return domains or [sorted(mine)]


def physical_cores(cpus: Sequence[int], root: str = SYS_ROOT) -> List[List[int]]:
    """``cpus`` grouped by physical core (a core's hardware threads together), in order of each
    core's first CPU.

    Args:
        cpus: CPU numbers.
        root: where the kernel's ``cpu`` folder is.

    Returns:
        One list per core; a CPU whose siblings the kernel does not show is a core of its own.

    Example::

        >>> physical_cores([0, 1, 2, 3])   # 2 cores with 2 hardware threads each, numbered 0,2 and 1,3
        [[0, 2], [1, 3]]
    """
    wanted = set(cpus)
    cores: Dict[tuple, List[int]] = {}
    for cpu in sorted(wanted):
        text = _read(os.path.join(root, "cpu", f"cpu{cpu}", "topology", "thread_siblings_list"))
        try:
            siblings = tuple(c for c in parse_cpu_list(text) if c in wanted) if text else (cpu,)
        except ValueError:
            siblings = (cpu,)
        cores.setdefault(siblings or (cpu,), []).append(cpu)
    return list(cores.values())


def plan(mode: str, local_size: int, allowed: Sequence[int], root: str = SYS_ROOT) -> List[Optional[Binding]]:
    """Each local rank's binding on a host.

    Args:
        mode: one of :data:`MODES`.
        local_size: the ranks on the host.
        allowed: the CPUs the starting process may use.
        root: where the kernel's ``node`` and ``cpu`` folders are.

    Returns:
        One binding per local rank, or None for each where nothing is bound (``none``; ``numa`` on a
        host of one domain).

    Raises:
        ValueError: an unknown mode, or ``core`` with more ranks than cores (naming both and the
            fixes).

    Example::

        >>> [b.cpus for b in plan("core", 2, [0, 1])]
        [(0,), (1,)]
    """
    return list(_plan(mode, local_size, tuple(allowed), root))


@functools.lru_cache(maxsize=None)
def _plan(mode: str, local_size: int, allowed: tuple, root: str) -> tuple:
    # Once per host layout: the launcher asks for each rank's binding twice (its thread budget,
    # its start) and every answer reads the kernel's topology files.
    if mode not in MODES:
        raise TorchmnValueError(f"--bind {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none" or local_size < 1:
        return (None,) * max(local_size, 0)
    domains = numa_domains(allowed, root)
    if mode == "numa":
        if len(domains) < 2:
            return (None,) * local_size
        named = [(cpus, f"NUMA node {i} (CPUs {format_cpu_list(cpus)})") for i, cpus in enumerate(domains)]
        if local_size <= len(domains):  # whole domains each, in blocks
            return tuple(Binding(tuple(c for cpus, _ in block for c in cpus), 1, " and ".join(w for _, w in block))
                         for block in _share(named, local_size))
        homes = _homes(local_size, len(domains))
        return tuple(Binding(tuple(named[d][0]), homes.count(d), named[d][1]) for d in homes)
    per_domain = [physical_cores(cpus, root) for cpus in domains]
    cores = [core for domain in per_domain for core in domain]
    if local_size > len(cores):
        raise TorchmnValueError(
            f"--bind core: {local_size} ranks on this host, but the launcher may use {len(cores)} core(s) here "
            f"(CPUs {format_cpu_list(allowed)}): each rank needs a core of its own. Start at most {len(cores)} "
            f"ranks here, or use --bind numa (ranks share their NUMA node's cores) or --bind none")
    return tuple(Binding(cpus, 1, f"CPUs {format_cpu_list(cpus)}")
                 for cpus in _cores_by_domain(local_size, per_domain) or _in_blocks(local_size, cores))


def _share(items: list, ranks: int) -> List[list]:
    """``items`` handed out in order to ``ranks`` ranks (at least as many items), as evenly as they go."""
    return [items[r * len(items) // ranks:(r + 1) * len(items) // ranks] for r in range(ranks)]


def _homes(ranks: int, domains: int) -> List[int]:
    """The domain of each of ``ranks`` ranks (more ranks than domains), in blocks of ranks."""
    return [r * domains // ranks for r in range(ranks)]


def _cores_by_domain(local_size: int, per_domain: List[List[List[int]]]) -> List[tuple]:
    """Each rank's CPUs, its cores all in one domain: the ranks spread over the domains as with
    ``numa``, each domain's cores (``per_domain``) shared out among its ranks. Empty where a domain
    has fewer cores than ranks (domains cut unevenly by the affinity): then cores are handed out in
    blocks."""
    if local_size <= len(per_domain):  # whole domains each, in blocks
        return [tuple(c for domain in block for core in domain for c in core)
                for block in _share(per_domain, local_size)]
    homes = _homes(local_size, len(per_domain))
    if any(homes.count(d) > len(cores) for d, cores in enumerate(per_domain)):
        return []
    blocks = {d: iter(_in_blocks(homes.count(d), per_domain[d])) for d in set(homes)}
    return [next(blocks[d]) for d in homes]


def _in_blocks(ranks: int, cores: List[List[int]]) -> List[tuple]:
    """``cores`` handed out in order, as evenly as they go, one block of CPUs per rank."""
    return [tuple(c for core in block for c in core) for block in _share(cores, ranks)]


def allowed_cpus() -> List[int]:
    """The CPUs this process may run on (all the machine's where affinity is unknown).

    Returns:
        Sorted CPU numbers.

    Example::

        >>> allowed_cpus()
        [0, 1]
    """
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def for_rank(env: Mapping[str, str], root: str = SYS_ROOT) -> Optional[Binding]:
    """The binding of the rank whose environment is ``env``, on this host.

    Args:
        env: the rank's variables: the mode (``TORCHMN_BIND``, default :data:`DEFAULT_MODE`), its
            local rank and the ranks of its host (``TORCHMN_LOCAL_RANK``, ``TORCHMN_LOCAL_SIZE``).
        root: where the kernel's ``node`` and ``cpu`` folders are.

    Returns:
        The binding, or None where nothing is bound (also where this system cannot bind).

    Raises:
        ValueError: as :func:`plan`.

    Example::

        >>> for_rank({"TORCHMN_BIND": "core", "TORCHMN_LOCAL_RANK": "1", "TORCHMN_LOCAL_SIZE": "2"}).cpus
        (1,)
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    local_rank = int(env.get("TORCHMN_LOCAL_RANK", "0"))
    local_size = int(env.get("TORCHMN_LOCAL_SIZE", "1"))
    return plan(env.get(VARIABLE, DEFAULT_MODE), local_size, allowed_cpus(), root)[local_rank]


def bind_in_child(binding: Optional[Binding],
                  then: Optional[Callable[[], None]] = None) -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that binds the child to ``binding``'s CPUs, then calls ``then``.

    Args:
        binding: where the child runs (None: anywhere).
        then: another ``preexec_fn`` to run after it (the launcher's death signal), or None.

    Returns:
        The function, or ``then`` itself where there is nothing to bind.

    Example::

        >>> subprocess.Popen(["python", "train.py"], preexec_fn=bind_in_child(for_rank(env)))  # doctest: +SKIP
    """
    if binding is None:
        return then
    cpus = set(binding.cpus)

    def bind():
        os.sched_setaffinity(0, cpus)
        if then is not None:
            then()
    return bind
