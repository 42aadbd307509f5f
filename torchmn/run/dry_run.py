"""``torchmn run --dry-run``: the plan of a job, printed, and nothing started.

The plan is the real launcher's: ``Restarts.make_start(0)`` builds the first start's ``Job`` (with
every check a real run makes before it starts anything, and the same slots), ``Job.check_command``
looks the command up, and each rank's variables and command line come from
``Job.rank_environment`` and ``Job.rank_argv``, the methods ``Job.start`` starts the ranks with,
so the dry run cannot drift from a real run. It opens no rendezvous store, contacts no host (host
names are looked up, as a real run does, only to tell this machine's names from others') and
starts no guardian. In a Slurm step of several tasks, the step's token is derived as a real run
derives it, which makes the user's key file on first use.

What only the start chooses (the port the OS picks, the job's id, the address the remote hosts
see and gloo's interface for it) is shown as ``<chosen at start>``; secrets (the job's token,
variables named like ``*_TOKEN``, ``*SECRET*``, ``*PASSWORD*``, ``*API_KEY``) as ``<secret>``.

Example::

    $ torchmn run --dry-run -np 2 python train.py
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from typing import Dict, List, Mapping, Optional, TextIO

from torchmn import network
from torchmn.run.config import NO_LIMIT, LaunchConfig
from torchmn.run.elastic import ElasticJob
from torchmn.run.job import Job
from torchmn.run.plan import JOB_ID, Slot
from torchmn.run.processes import binding
from torchmn.run.processes.output import prepare_log_dir
from torchmn.run.remote.protocol import EXPORTS_ON_STDIN
from torchmn.run.remote.ssh import split_exports
from torchmn.run.restarts import TORCHMN_RESTART_COUNT, Restarts
from torchmn.run.store.auth import TOKEN_ENV, TOKEN_ON_STDIN
from torchmn.run.store.rendezvous import check_signing

SECRET = "<secret>"
AT_START = "<chosen at start>"
# Names whose values are secrets: never printed. TORCHMN_JOB_TOKEN_ON_STDIN only says "1".
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|API_?KEY|ACCESS_KEY|PRIVATE_KEY|AUTH", re.IGNORECASE)
_NOT_SECRET = frozenset({TOKEN_ON_STDIN, EXPORTS_ON_STDIN})


def is_secret(name: str) -> bool:
    """Whether a variable's value must not be shown: the job's token, and names that look secret.

    Args:
        name: the variable's name.

    Returns:
        True where the dry run shows ``<secret>`` instead of the value.

    Example::

        >>> is_secret("TORCHMN_JOB_TOKEN"), is_secret("WANDB_API_KEY"), is_secret("TORCHMN_RANK")
        (True, True, False)
    """
    return name == TOKEN_ENV or (name not in _NOT_SECRET and bool(_SECRET_NAME.search(name)))


def _masked(env: Mapping[str, str]) -> Dict[str, str]:
    return {name: SECRET if is_secret(name) else value for name, value in env.items()}


def _ranks(slots: List[Slot]) -> str:
    first, last = slots[0].rank, slots[-1].rank
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _hosts_section(job: Job) -> List[str]:
    by_host: Dict[str, List[Slot]] = {}
    for slot in job.slots:
        by_host.setdefault(slot.host, []).append(slot)
    lines = []
    if job.nodes is not None:
        step = job.nodes.step
        what = (f"Slurm step of {step.tasks} torchmn run tasks, one per node; this is task {step.task}"
                if step.kind == "Slurm task" else
                f"{step.tasks} nodes, each running torchmn run; this is node {step.task}")
        lines.append(f"{what} on {step.hosts[step.task]}, which starts its node's ranks (the other "
                     f"{step.kind}s start theirs):")
    elif job.hosts is None:
        lines.append(f"hosts: this machine only ({job.host}), {_ranks(job.slots)}")
        return lines
    else:
        lines.append(f"hosts ({_plural(len(job.hosts), 'host')}, {_plural(sum(n for _, n in job.hosts), 'slot')}; "
                     f"ranks fill the slots in order):")
    given = dict(job.hosts) if job.hosts is not None else {h: len(s) for h, s in by_host.items()}
    width = max(len(h) for h in given)
    for host, slots_given in given.items():
        slots = by_host.get(host, [])
        remote = job.is_remote(slots[0]) if slots else not network.is_local(host)
        where = ("another host: its ranks start over ssh (not contacted now; a real run first checks every "
                 "host over ssh)" if remote and slots else "another host" if remote else "this machine")
        ranks = _ranks(slots) if slots else "no rank"
        lines.append(f"  {host:<{width}}  {_plural(slots_given, 'slot')}, {ranks}: {where}")
    return lines


def _rendezvous_section(job: Job, known_addr: Optional[str]) -> List[str]:
    config = job.config
    if known_addr is None:
        addr = (f"{AT_START} (the address of this machine that the remote hosts see it connect from; "
                f"--network-interface IFACE picks one instead)")
    else:
        addr = known_addr
    port = str(job.master_port) if job.master_port is not None else f"{AT_START} (a free port the OS picks)"
    host = (f"{job.nodes.step.kind} 0 on {job.nodes.step.hosts[0]}" if job.nodes is not None else "this launcher")
    lines = [f"rendezvous: {host} hosts the store, behind a gate that admits only the job's processes (by the "
             f"job's token, {SECRET})",
             f"  MASTER_ADDR={addr}",
             f"  MASTER_PORT={port}"]
    if job.nodes is None or job.nodes.step.task == 0:
        warning = check_signing(config.allow_unsigned_store)
        lines.append("  the store's own port: " + (
            "closed to all but the gate and other hosts' relays (TCP MD5 signatures)" if warning is None else
            "on 127.0.0.1, OPEN to every program of this machine (no TCP MD5 signatures in this kernel; "
            "--allow-unsigned-store)"))
    if config.max_restarts:
        lines.append(f"restarts: up to {config.max_restarts} after a failed rank, each a new job; this is start 0 "
                     f"({TORCHMN_RESTART_COUNT}=0)")
    else:
        lines.append(f"restarts: none (--max-restarts 0); {TORCHMN_RESTART_COUNT}=0")
    if config.log_dir is not None:
        prepare_log_dir(config.log_dir, keep=False)  # the real run's errors, and nothing left behind
        lines.append(f"log files: {os.path.join(config.log_dir, 'rank.<r>.log')} (the directory is made at start)")
    if config.output_ranks is not None:
        lines.append(f"console shows: {', '.join(f'rank {r}' for r in sorted(config.output_ranks))}")
    return lines


def _rank_section(job: Job, slot: Slot, launcher_env: Mapping[str, str], port: str) -> List[str]:
    remote = job.is_remote(slot)
    env = job.rank_environment(slot, port)
    if not remote:
        # A value known only once the job starts: the real run's id has its launcher's pid and time.
        env[JOB_ID] = AT_START
        if job.remote_hosts and "GLOO_SOCKET_IFNAME" not in env and job.master_addr == AT_START:
            # local_env names the interface of MASTER_ADDR, which the host checks choose.
            env["GLOO_SOCKET_IFNAME"] = f"{AT_START} (the interface of MASTER_ADDR)"
    relayed = not remote and job.nodes is not None and job.nodes.step.task != 0
    if relayed:
        # The real run gives these ranks their node's relay to the store of node 0 (open_store).
        env["MASTER_ADDR"] = "127.0.0.1"
        env["MASTER_PORT"] = (f"{AT_START} (this node's relay to the store of {job.nodes.step.kind} 0 at "
                              f"{job.master_addr}:{port})")
    shown = _masked(env)
    argv = job.rank_argv(slot, shown)
    where = f"{slot.host}, over ssh" if remote else f"{slot.host}, this machine"
    lines = [f"rank {slot.rank}: host {where}; local rank {slot.local_rank} of {slot.local_size}, "
             f"node {slot.node_rank} of {slot.node_count}",
             f"  command: {' '.join(shlex.quote(a) for a in argv)}",
             f"  CPUs (--bind {job.config.bind}): {_cpus(job, slot, env)}"]
    if remote:
        lines.append("  environment (set on the ssh command line, on top of the login's own):")
        names = sorted(shown)
    else:
        lines.append("  environment (added to the launcher's, or changed):")
        names = sorted(n for n in shown if launcher_env.get(n) != env[n] or n in job.exports)
    lines += [f"    {name}={shown[name]}" for name in names]
    if remote and env.get(EXPORTS_ON_STDIN):
        sent = _masked(split_exports(job.exports)[1])
        lines.append("  -x variables (written to the watcher's stdin, never on a command line):")
        lines += [f"    {name}={sent[name]}" for name in sorted(sent)]
    if remote:
        lines.append(f"  added on {slot.host} by the watcher that runs the rank: {TOKEN_ENV}={SECRET} (read from "
                     f"its stdin, never on a command line); the thread budget (OMP_NUM_THREADS etc.: {slot.host}'s "
                     f"CPUs divided among its {slot.local_size} rank(s), unless OMP_NUM_THREADS is set); "
                     f"GLOO_SOCKET_IFNAME (the interface that reaches the launcher), unless set; and "
                     f"MASTER_ADDR=127.0.0.1 MASTER_PORT=<chosen at start>, the watcher's relay to the store on "
                     f"{slot.host}'s loopback, in place of the ones above (which the relay connects to)")
    return lines


def _cpus(job: Job, slot: Slot, env: Mapping[str, str]) -> str:
    """Where the rank runs: its CPUs on this machine; on another host, what the watcher there binds."""
    if job.is_remote(slot):
        return f"bound by the watcher on {slot.host}, from its CPUs" if job.config.bind != "none" else "any"
    bound = binding.for_rank(env)
    if bound is None:
        return "any (nothing to bind)"
    return bound.where + ("" if bound.sharing == 1 else f", shared by {bound.sharing} ranks")


def describe_plan(config: LaunchConfig, env: Optional[Mapping[str, str]] = None) -> str:
    """The plan of ``torchmn run`` for ``config``, as ``--dry-run`` prints it; nothing is started.

    Args:
        config: what to run, and how.
        env: the launcher's environment (default: ``os.environ``).

    Returns:
        The text: the hosts and their slots, the rendezvous, and for each rank its place, its
        command line (for a remote rank the ssh command line) and the variables torchmn sets,
        secrets shown as ``<secret>`` and what only the start chooses as ``<chosen at start>``.

    Raises:
        RunError: the job cannot run as asked, the same error a real run gives (also a command
            not found, exit code 127).

    Example::

        >>> print(describe_plan(LaunchConfig(["python", "train.py"], np=2)))   # doctest: +ELLIPSIS
        torchmn run --dry-run: 2 ranks of `python train.py`; nothing was started...
    """
    launcher_env = dict(os.environ if env is None else env)
    job = Restarts(config, launcher_env, ElasticJob if config.elastic else Job).make_start(0)
    job.check_command()
    job.check_timeline(keep=False)
    known_addr = job.known_master_addr()
    job.master_addr = known_addr or AT_START
    port = str(job.master_port) if job.master_port is not None else AT_START
    count = _plural(len(job.slots), "rank") if job.nodes is None else \
        f"{len(job.slots)} of the {job.slots[0].size} ranks (this node's)"
    lines = [f"torchmn run --dry-run: {count} of "
             f"`{' '.join(shlex.quote(a) for a in config.command)}`; nothing was started and no host "
             f"contacted. Secrets show as {SECRET}, values the start chooses as {AT_START}.", ""]
    if config.elastic:
        grows = "no limit" if config.max_np == NO_LIMIT else config.max_np
        lines += [f"elastic: goes on while at least {config.min_np} ranks live (below that for more than "
                  f"{config.elastic_timeout:g} s: ends), grows to {grows}"
                  + (f" on the hosts {config.host_discovery_script} prints" if config.host_discovery_script else
                     " in the known hosts' slots") + "; ranks below are its first workers", ""]
    lines += _hosts_section(job)
    lines += _rendezvous_section(job, known_addr)
    for slot in job.slots:
        lines.append("")
        lines += _rank_section(job, slot, launcher_env, port)
    return "\n".join(lines)


def dry_run(config: LaunchConfig, env: Optional[Mapping[str, str]] = None, out: Optional[TextIO] = None) -> int:
    """Print the plan of ``torchmn run`` for ``config`` (see ``describe``) and start nothing.

    Args:
        config: what to run, and how.
        env: the launcher's environment (default: ``os.environ``).
        out: where to print (default: ``sys.stdout``).

    Returns:
        0.

    Raises:
        RunError: the job cannot run as asked (the same error, and ``exit_code``, as a real run).

    Example::

        >>> dry_run(LaunchConfig(["python", "train.py"], np=2))   # doctest: +SKIP
        0
    """
    text = describe_plan(config, env)
    (out or sys.stdout).write(text + "\n")
    return 0
