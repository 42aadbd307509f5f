"""The ``torchmn`` command: ``torchmn run -np N [options] COMMAND [ARGS...]`` (horovodrun's flags too;
``--dry-run`` prints the plan, :mod:`torchmn.run.dry_run`), ``torchmn info`` (:mod:`torchmn.info`),
``torchmn doctor`` (:mod:`torchmn.doctor`), ``torchmn tune`` (:mod:`torchmn.tune`) and
``torchmn --version``.

Subcommands are registered in ``SUBCOMMANDS``. ``run`` parses its options into one
``torchmn.run.config.LaunchConfig`` and hands it to ``torchmn.run.launch.run``.

Example::

    $ torchmn run -np 4 python train.py
    $ torchmn run -np 8 -H node1:4,node2:4 python train.py
    $ torchmn run -np 8 --hostfile hosts -x NCCL_DEBUG=INFO python train.py
    $ torchmn run -np 2 --log-dir logs --output-ranks 0 -- python train.py --epochs 3
    $ torchmn run -np 2 --max-restarts 3 python train.py      # resumes from its checkpoint
    $ torchmn run --dry-run -np 8 -H node1:4,node2:4 python train.py   # the plan; nothing starts
    $ torchmn info                                             # what a rank started here would find
    $ torchmn run -np 2 torchmn info --json                    # each rank's view, one JSON line each
    $ torchmn --version
    $ python -m torchmn run -np 2 python -c "import os; print(os.environ['RANK'])"
    $ torchmn doctor -np 2 -- python train.py
    $ torchmn tune -np 2 --n-trials 20 -- python train.py
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence, Set

from torchmn.doctor.command import add_doctor
from torchmn.info import add_info, version_text
from torchmn.monitor.command import add_timeline
from torchmn.run import horovodrun_flags
from torchmn.run.processes import binding
from torchmn.tune.command import add_tune, join_option_params


def _ranks_list(text: str) -> Set[int]:
    try:
        ranks = {int(part) for part in text.split(",") if part.strip()}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ranks such as 0,2, got {text!r}") from e
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"expected ranks >= 0 such as 0,2, got {text!r}")
    return ranks


def _restart_codes(text: str):
    from torchmn.run.restarts import parse_restart_on

    try:
        return parse_restart_on(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--restart-on: ")) from e


def _node_count(text: str) -> int:
    """``--nnodes N``; torchrun's elastic ``MIN:MAX`` is answered with what torchmn does instead."""
    low, _, high = text.partition(":")
    try:
        counts = [int(low)] + ([int(high)] if high else [])
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if len(counts) == 2 and counts[0] != counts[1]:
        raise argparse.ArgumentTypeError(
            f"{text!r} is a range of nodes (torchrun's elastic form): one torchmn run per node runs a fixed number of "
            f"nodes. For an elastic job run a single torchmn run for all of them: torchmn run -np N --min-np M "
            f"--max-np K -H node1:4,node2:4 (or --host-discovery-script), see docs/elastic.md")
    return counts[0]


def _default_restart_delay() -> float:
    from torchmn.run.config import RESTART_DELAY

    return RESTART_DELAY


def _add_run(subparsers) -> None:
    # No abbreviations: the command's own options (--log, --out) must never be taken, or refused
    # as ambiguous, for the launcher's (--log-dir, --output-ranks).
    p = subparsers.add_parser(
        "run", allow_abbrev=False, help="start N ranks of a command, on this machine or over ssh on several",
        description="Start N ranks of COMMAND on this machine, or on the hosts of -H/--hostfile over ssh, "
                    "with the rank prefixed to every output line. When a rank fails, all others are "
                    "stopped and the first failure is reported.",
        epilog="Each rank gets TORCHMN_RANK/SIZE/LOCAL_RANK/..., torchrun's RANK/WORLD_SIZE/LOCAL_RANK/"
               "MASTER_ADDR/MASTER_PORT (init_method='env://' works), and a CPU thread budget "
               "(OMP_NUM_THREADS etc.) unless OMP_NUM_THREADS is already set.")
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=None, metavar="N",
                   help="number of ranks to start (required)")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="rendezvous port (default: a free port chosen by the OS)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="also write each rank's output to DIR/rank.<r>.log, without prefixes")
    p.add_argument("--output-ranks", type=_ranks_list, default=None, metavar="R[,R...]",
                   help="show only these ranks' output on the console (log files get everything)")
    p.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long checking the hosts, and starting each remote rank, may take "
                        "(default 60)")
    p.add_argument("--allow-unsigned-store", action="store_true",
                   help="on a kernel without TCP MD5 signatures (CONFIG_TCP_MD5SIG), start anyway, with the "
                        "rendezvous store's own port open to every program of this machine, which could take "
                        "over the job: only where no other user runs programs (see docs/security.md)")
    p.add_argument("--verbose", "-v", action="store_true", help="print what the launcher does")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (hosts and slots; each rank's place, command line and variables, "
                        "secrets hidden) and exit without starting anything or contacting any host; the "
                        "options are checked as for a real run")
    p.add_argument("--bind", choices=binding.MODES, default=binding.DEFAULT_MODE,
                   help="bind each host's ranks to its CPUs: numa (default) spreads them over the host's NUMA "
                        "nodes in blocks (nothing is bound on a host of one node), core gives each rank cores of "
                        "its own, none leaves them to the kernel; a rank's thread budget is its share of its "
                        "CPUs (see docs/cpu.md)")
    seeing = p.add_argument_group("seeing the job (see docs/monitor.md)")
    seeing.add_argument("--monitor", action="store_true",
                        help="a live table of every rank's steps/s, step time, waiting share, CPU and memory, "
                             "and at the end which rank is slowest and which wait for it")
    seeing.add_argument("--timeline", default=None, metavar="FILE",
                        help="write every rank's phases (forward+backward, averaging, update, collectives) to FILE, "
                             "a Chrome trace / Perfetto JSON; draw it with: torchmn timeline FILE --png OUT")
    restarts = p.add_argument_group("restarts (each start is a new job; the ranks see TORCHMN_RESTART_COUNT)")
    restarts.add_argument("--max-restarts", type=int, default=0, metavar="K",
                          help="when a rank fails, stop the job and start every rank again, up to K times "
                               "(default 0); SIGINT/SIGTERM to the launcher still end the job")
    restarts.add_argument("--restart-on", type=_restart_codes, default=None, metavar="CODE|SIGNAL[,...]",
                          help="restart only when the first failed rank ended with one of these exit codes "
                               "or signals, e.g. 1,137,SIGKILL (a signal N counts as exit code 128+N; "
                               "default: any failure)")
    restarts.add_argument("--restart-delay", type=float, default=None, metavar="SECONDS",
                          help="wait this long before a restart (default %g)" % _default_restart_delay())
    elastic = p.add_argument_group("elastic jobs (ranks leave and join while the job runs; see docs/elastic.md)")
    elastic.add_argument("--min-np", type=int, default=None, metavar="M",
                         help="go on while at least M ranks live: when a rank dies, the others continue from their "
                              "last commit (default -np, with --max-np or a discovery script)")
    elastic.add_argument("--max-np", type=int, default=None, metavar="N",
                         help="start new ranks where there is room, up to N (default -np; no limit with "
                              "--host-discovery-script)")
    elastic.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                         help="a program printing the hosts that may run ranks now, one 'host:slots' per line; "
                              "run every second")
    elastic.add_argument("--elastic-timeout", type=float, default=None, metavar="SECONDS",
                         help="end the job when fewer than --min-np ranks live for this long (default 600)")
    elastic.add_argument("--reset-limit", type=int, default=None, metavar="K",
                         help="end the job at the K+1-th reset (ranks joining or leaving): a rank that fails again "
                              "and again otherwise keeps the job resetting (default: no limit)")
    hosts = p.add_argument_group("several hosts (ranks on other hosts start over ssh)")
    where = hosts.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", dest="hosts", default=None, metavar="HOST:N[,HOST:N...]",
                       help="hosts and their slots, e.g. node1:4,node2:4 (a bare host has 1 slot); "
                            "ranks fill the slots in order")
    where.add_argument("-hostfile", "--hostfile", dest="hostfile", default=None, metavar="FILE",
                       help="a file of 'host slots=N' lines (also 'host:N' or 'host'; # comments)")
    hosts.add_argument("-x", dest="exports", action="append", default=[], metavar="NAME[=VALUE]",
                       help="set this variable for every rank, on this host and the others, like mpirun -x "
                            "(repeatable; NAME alone passes this shell's value); PATH, PYTHONPATH, VIRTUAL_ENV "
                            "and TORCHMN_*/NCCL_*/GLOO_* always reach the other hosts")
    hosts.add_argument("--ssh-port", "-p", type=int, default=None, metavar="PORT", help="ssh port of the hosts")
    hosts.add_argument("--ssh-identity-file", "-i", default=None, metavar="FILE",
                       help="ssh private key to log in with")
    hosts.add_argument("--ssh-command", default=None, metavar="COMMAND",
                       help="the ssh client command (default: %r)" % _default_ssh())
    hosts.add_argument("--network-interface", default=None, metavar="IFACE",
                       help="use this interface's address for the rendezvous (default: the address the "
                            "first remote host sees the launcher connect from)")
    nodes = p.add_argument_group(
        "one launcher per node (each node runs its own torchmn run; without these, Kubeflow's PyTorchJob, "
        "SkyPilot and SageMaker are read from their variables)")
    nodes.add_argument("--nnodes", type=_node_count, default=None, metavar="N", help="the number of nodes")
    nodes.add_argument("--node-rank", type=int, default=None, metavar="R",
                       help="this node's index, 0 to N-1; node 0 hosts the rendezvous")
    nodes.add_argument("--master-addr", default=None, metavar="ADDR",
                       help="node 0's address, the same on every node (with --master-port, default 29500)")
    horovodrun_flags.add_to(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]",
                   help="the program each rank runs ('--' before it is optional)")
    p.set_defaults(handler=_run, subparser=p)


def _default_ssh() -> str:
    from torchmn.run.remote.ssh import DEFAULT_SSH_COMMAND

    return DEFAULT_SSH_COMMAND


def _platforms_ranks_per_node() -> Optional[int]:
    """The ranks per node a platform asks for where ``-np`` is left out (one GPU each on SageMaker
    and SkyPilot, Kubeflow's ``PET_NPROC_PER_NODE``), said on stderr; None elsewhere."""
    from torchmn.environments.platforms import PlatformError, detect_platform
    try:
        place = detect_platform(os.environ)
    except PlatformError:  # the job reports it, with the rest of its checks
        return None
    if place is None or place.nproc_per_node is None:
        return None
    sys.stderr.write(f"torchmn run: -np {place.nproc_per_node} (ranks per node) from {place.source}'s variables\n")
    return place.nproc_per_node


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torchmn import resources
    from torchmn.run.remote import hostfile
    from torchmn.run.config import LaunchConfig, RunError
    from torchmn.run.launch import run
    from torchmn.run.remote.ssh import SshOptions

    if args.check_build:
        print(horovodrun_flags.build_report())
        return 0
    if args.np is None:
        args.np = _platforms_ranks_per_node()
    if args.np is None:
        parser.error("the following arguments are required: -np/--num-proc")
    notes, refusal = horovodrun_flags.translate(args)
    for note in notes:
        sys.stderr.write(note + "\n")
    if refusal is not None:
        sys.stderr.write(f"torchmn run: error: {refusal}\n")
        return 2
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        parser.error(f"--ssh-port must be between 1 and 65535, got {args.ssh_port}")
    try:
        resources.requested_threads()  # a bad TORCHMN_NUM_THREADS stops the job before any rank starts
        hosts = None
        if args.hosts is not None:
            hosts = hostfile.parse_hosts(args.hosts)
        elif args.hostfile is not None:
            hosts = hostfile.parse_hostfile(args.hostfile)
    except ValueError as e:  # HostsError is one
        sys.stderr.write(f"torchmn run: error: {e}\n")
        return 2
    ssh = SshOptions(command=args.ssh_command or _default_ssh(), port=args.ssh_port,
                     identity_file=args.ssh_identity_file)
    try:
        config = LaunchConfig(args.command, args.np, master_port=args.master_port, log_dir=args.log_dir,
                              output_ranks=args.output_ranks, start_timeout=args.start_timeout,
                              verbose=args.verbose, hosts=hosts, ssh=ssh, exports=args.exports,
                              network_interface=args.network_interface, max_restarts=args.max_restarts,
                              restart_on=args.restart_on, allow_unsigned_store=args.allow_unsigned_store,
                              nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                              monitor=args.monitor, min_np=args.min_np, max_np=args.max_np,
                              host_discovery_script=args.host_discovery_script, reset_limit=args.reset_limit,
                              bind=args.bind,
                              **({} if args.elastic_timeout is None else {"elastic_timeout": args.elastic_timeout}),
                              timeline=os.path.abspath(args.timeline) if args.timeline else None,
                              restart_delay=_default_restart_delay() if args.restart_delay is None
                              else args.restart_delay)
        if args.max_restarts == 0 and (args.restart_on is not None or args.restart_delay is not None):
            sys.stderr.write("torchmn run: note: --restart-on and --restart-delay do nothing without "
                             "--max-restarts K\n")
        if config.min_np is None and (args.elastic_timeout is not None or args.reset_limit is not None):
            sys.stderr.write("torchmn run: note: --elastic-timeout and --reset-limit do nothing without --min-np N "
                             "(an elastic job)\n")
        if args.dry_run:
            from torchmn.run.dry_run import dry_run

            return dry_run(config)
        return run(config)
    except RunError as e:
        sys.stderr.write(f"torchmn run: error: {e}\n")
        return e.exit_code


class _VersionAction(argparse.Action):
    """``--version``: the text is made only when asked (it reads torch's installed metadata)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(version_text() + "\n")
        parser.exit()


SUBCOMMANDS = (_add_run, add_info, add_doctor, add_tune, add_timeline)


def build_parser() -> argparse.ArgumentParser:
    """The ``torchmn`` argument parser, one subparser per subcommand.

    Returns:
        The parser; each subcommand's namespace has ``handler`` and ``subparser``.

    Example::

        >>> build_parser().parse_args(["run", "-np", "2", "python", "x.py"]).command
        ['python', 'x.py']
    """
    parser = argparse.ArgumentParser(prog="torchmn", description="Multi-node distributed training for PyTorch.",
                                     epilog="Start with `torchmn info` (what a rank started here would find) "
                                            "and `torchmn run --help`.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of torchmn, torch and Python, and exit")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``torchmn`` console script.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code (the console script exits with it).

    Example::

        >>> main(["run", "-np", "2", "true"])
        0
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tune"]:
        argv = ["tune"] + join_option_params(argv[1:])
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # told with the subcommand's usage ("torchmn run: error: ..."), not the top level's
        (args.subparser if args.subcommand else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.subcommand is None:
        parser.print_help(sys.stderr)
        return 2
    return args.handler(args, args.subparser)
