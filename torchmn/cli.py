"""The ``torchmn`` command: ``torchmn run -np N [options] COMMAND [ARGS...]``.

Subcommands are registered in ``SUBCOMMANDS``; ``doctor`` and ``tune`` (SPEC section 5) will join
``run`` there.

Example::

    $ torchmn run -np 4 python train.py
    $ torchmn run -np 2 --log-dir logs --output-ranks 0 -- python train.py --epochs 3
    $ python -m torchmn run -np 2 python -c "import os; print(os.environ['RANK'])"
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence, Set


def _ranks_list(text: str) -> Set[int]:
    try:
        ranks = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ranks such as 0,2, got {text!r}")
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"expected ranks >= 0 such as 0,2, got {text!r}")
    return ranks


def _add_run(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="start N ranks of a command on this machine",
        description="Start N ranks of COMMAND on this machine, with the rank prefixed to every output "
                    "line. When a rank fails, all others are stopped and the first failure is reported.",
        epilog="Each rank gets TORCHMN_RANK/SIZE/LOCAL_RANK/..., torchrun's RANK/WORLD_SIZE/LOCAL_RANK/"
               "MASTER_ADDR/MASTER_PORT (init_method='env://' works), and a CPU thread budget "
               "(OMP_NUM_THREADS etc.) unless OMP_NUM_THREADS is already set.")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, metavar="N",
                   help="number of ranks to start")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="rendezvous port (default: a free port chosen by the OS)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="also write each rank's output to DIR/rank.<r>.log, without prefixes")
    p.add_argument("--output-ranks", type=_ranks_list, default=None, metavar="R[,R...]",
                   help="show only these ranks' output on the console (log files get everything)")
    p.add_argument("--start-timeout", type=float, default=None, metavar="SECONDS",
                   help="accepted for horovodrun compatibility; not enforced yet")
    p.add_argument("--verbose", "-v", action="store_true", help="print what the launcher does")
    # Refused with a clear message rather than argparse's "unrecognized arguments".
    p.add_argument("-H", "--hosts", dest="hosts", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hostfile", dest="hostfile", default=None, help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]",
                   help="the program each rank runs ('--' before it is optional)")
    p.set_defaults(handler=_run, subparser=p)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torchmn.launch.runner import RunError, run

    if args.hosts is not None or args.hostfile is not None:
        parser.error("multi-host launching (-H/--hostfile) is not supported yet; start one "
                     "`torchmn run` per machine, or use srun/mpirun/torchrun for multi-node jobs.")
    try:
        return run(args.command, args.np, master_port=args.master_port, log_dir=args.log_dir,
                   output_ranks=args.output_ranks, start_timeout=args.start_timeout,
                   verbose=args.verbose)
    except RunError as e:
        sys.stderr.write(f"torchmn run: error: {e}\n")
        return e.exit_code


SUBCOMMANDS = (_add_run,)


def build_parser() -> argparse.ArgumentParser:
    """The ``torchmn`` argument parser, one subparser per subcommand.

    Example::

        >>> build_parser().parse_args(["run", "-np", "2", "python", "x.py"]).command
        ['python', 'x.py']
    """
    parser = argparse.ArgumentParser(prog="torchmn", description="Multi-node distributed training for PyTorch.")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``torchmn`` console script; returns (and, as a script, exits with) the exit code.

    Example::

        >>> main(["run", "-np", "2", "true"])
        0
    """
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.subcommand is None:
        parser.print_help(sys.stderr)
        return 2
    return args.handler(args, args.subparser)
