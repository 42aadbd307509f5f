"""Emulated nodes on one machine: network namespaces with their own cores and a shaped link.

    python bench/multinode/nodes.py --nodes 2 --link 1gbit -- python bench/multinode/probe.py
    python bench/multinode/nodes.py --nodes 2 --link 100mbit --ranks-per-node 2 -- python train.py

Each node is a network namespace with its own address, hostname and sshd on a private bridge
(``tests/cluster/netns.py``, what the multi-host tests use), pinned to cores of its own (the
machine's cores split evenly: on 2 cores, 2 nodes x 1 core; on 16, 4 nodes x 4), and its link
shaped with ``tc``'s token bucket (``tbf``) both ways to a named profile. ``--`` starts the command
on every node through ``torchmn run -H`` over ssh, ``--ranks-per-node`` ranks each, and prints its
output; afterwards, also when interrupted, every namespace, qdisc and process the harness made is
gone. The kernel here has no ``netem``, so the latency is the namespaces' own (tens of
microseconds), not a datacenter's.

Needs root and ``ip``, ``tc`` (iproute2), ``unshare``, ``mount``, ``sshd``; a missing one is named,
with the package that has it, before anything is made.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from cluster.netns import ClusterError, NetnsCluster, missing_prerequisites  # noqa: E402

# Link profiles: tbf rates, as tc spells them, and in bytes per second.
PROFILES = {"100mbit": 100e6 / 8, "1gbit": 1e9 / 8, "10gbit": 10e9 / 8}


class EmulatedNodes:
    """``count`` emulated nodes with ``cpus_per_node`` cores each and links shaped to ``profile``.

    Example::

        >>> with EmulatedNodes(2, "1gbit") as nodes:
        ...     subprocess.run(nodes.torchmn_run(1, ["python", "probe.py"]))
    """

    def __init__(self, count: int, profile: Optional[str], cpus_per_node: Optional[int] = None):
        if profile is not None and profile not in PROFILES:
            raise ValueError(f"unknown link profile {profile!r}; choose one of {', '.join(PROFILES)}")
        cpus = sorted(os.sched_getaffinity(0))
        per_node = cpus_per_node or max(1, len(cpus) // count)
        if per_node * count > len(cpus):
            raise ValueError(f"{count} nodes x {per_node} cores need {per_node * count} cores; this machine "
                             f"gives {len(cpus)}")
        self.count, self.profile = count, profile
        self.cores = [cpus[k * per_node:(k + 1) * per_node] for k in range(count)]
        self.names = [f"node{k + 1}" for k in range(count)]
        self.cluster = NetnsCluster(self.names)

    @property
    def rate(self) -> Optional[float]:
        """The link's bytes per second, None for an unshaped link."""
        return PROFILES.get(self.profile)

    def __enter__(self) -> "EmulatedNodes":
        problems = missing_prerequisites() + ([] if shutil.which("tc") else ["tc (apt-get install iproute2)"])
        if os.geteuid() != 0:
            problems.append("root (network namespaces and tc need it: run with sudo)")
        if problems:
            raise ClusterError("cannot emulate nodes here: missing " + "; ".join(problems))
        # A SIGTERM ends the with-block like Ctrl-C, so that the teardown runs.
        self._previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self.cluster.start()
            for name, cores in zip(self.names, self.cores):
                # Every process started over ssh on the node descends from its sshd: pinning sshd
                # pins them (and torchmn's thread budget reads the same affinity).
                os.sched_setaffinity(self.cluster.sshd[name].pid, cores)
                if self.rate is not None:
                    self._shape(name)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        # A second SIGTERM or Ctrl-C (a wrapper such as timeout passes its own on) must not cut the
        # teardown short, which would leave namespaces behind: ignored until it is done.
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self.cluster.stop()  # the links go with the namespaces, and their qdiscs with them
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, self._previous)

    def _shape(self, name: str) -> None:
        """A token bucket both ways on the node's link: its eth0 (out) and the bridge's end (in)."""
        rate = self.rate
        # Bursts of 4 ms of the rate, at least 128 KB: veths hand tbf 64 KB segments at once.
        burst = max(128 << 10, int(rate / 250))
        spec = ["root", "tbf", "rate", self.profile, "burst", str(burst), "latency", "100ms"]
        ns = self.cluster.namespaces[self.names.index(name)]
        for prefix in (["ip", "netns", "exec", ns], []):
            device = "eth0" if prefix else self.cluster.outer_link(name)
            subprocess.run(prefix + ["tc", "qdisc", "add", "dev", device] + spec, check=True,
                           capture_output=True, timeout=20)

    def torchmn_run(self, ranks_per_node: int, argv: List[str], extra: List[str] = (),
                    nodes: Optional[int] = None) -> List[str]:
        """The ``torchmn run`` command that starts ``argv`` with ``ranks_per_node`` ranks on every node
        (or on the first ``nodes``).

        Args:
            ranks_per_node: ranks on each node.
            argv: the command each rank runs.
            extra: more ``torchmn run`` options.
            nodes: how many of the nodes, from the first (None: all).

        Returns:
            The command line, to run on this machine (outside the namespaces), with :func:`job_env`.
        """
        names = self.names[:nodes]
        hosts = ",".join(f"{self.cluster.address(n)}:{ranks_per_node}" for n in names)
        return ([sys.executable, "-m", "torchmn", "run", "-np", str(ranks_per_node * len(names)), "-H", hosts,
                 *self.cluster.launcher_options(), *extra] + list(argv))


def job_env() -> dict:
    """This process's environment with the repository first on ``PYTHONPATH``, for the jobs the
    benchmarks start (their ranks import this checkout's torchmn, installed or not)."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--link", choices=[*PROFILES, "none"], default="1gbit")
    parser.add_argument("--cpus-per-node", type=int, default=None, help="default: the machine's cores split evenly")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every rank runs")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    try:
        with EmulatedNodes(args.nodes, None if args.link == "none" else args.link, args.cpus_per_node) as nodes:
            print(f"{args.nodes} nodes, cores {nodes.cores}, link {args.link}", file=sys.stderr, flush=True)
            return subprocess.run(nodes.torchmn_run(args.ranks_per_node, command), cwd=REPO, env=job_env()).returncode
    except ClusterError as e:
        print(f"nodes.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
