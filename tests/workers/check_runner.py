"""The command line every worker script shares: pick checks by name, run them on every rank of
the job, print "PASS <check>" on rank 0 after each; and ``expect``, which the checks share.

    python comm_checks.py [--name flat] CHECK [CHECK ...]      ("all": every check but the excluded)
"""
import argparse
import inspect

import torchmn


def expect(error, fn):
    """Call ``fn``; return the ``error`` it raises, or fail the check if it raises none."""
    try:
        fn()
    except error as e:
        return e
    raise AssertionError(f"expected {error.__name__}")


def run_checks(namespace: dict, *, not_in_all=(), with_path=False) -> None:
    """Run the ``check_*`` functions of a worker module. ``not_in_all``: checks that "all" leaves
    out. ``with_path``: a ``--path`` option, passed to the checks that take a second argument."""
    checks = {name[len("check_"):]: f for name, f in namespace.items() if name.startswith("check_")}
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="auto", help="the communicator to create")
    if with_path:
        parser.add_argument("--path", default=None)
    parser.add_argument("checks", nargs="+", choices=[*checks, "all"])
    args = parser.parse_args()
    comm = torchmn.create_communicator(args.name)
    names = [n for n in checks if n not in not_in_all] if args.checks == ["all"] else args.checks
    for name in names:
        check = checks[name]
        if len(inspect.signature(check).parameters) > 1:
            check(comm, args.path)
        else:
            check(comm)
        if comm.rank == 0:
            print(f"PASS {name}", flush=True)
    comm.finalize()
