"""Run Horovod's own PyTorch tests against torchmn.horovod, each test in a job of its own.

    python tests/horovod_upstream.py PATH/test_torch.py [--np 2] [--parallel N] [-k WORDS] [--timeout 180]

``PATH/test_torch.py`` is a copy of Horovod's ``test/parallel/test_torch.py`` (Horovod's code stays
with its user: this repository does not carry it). Each of its tests runs in its own
``torchmn run -np N`` job, as a Horovod user's CI runs them with ``horovodrun``: ``horovod.torch`` is
``torchmn.horovod`` there, Horovod's ``test/utils/common.py`` helpers are provided, and the ranks
see Horovod's ``HOROVOD_RANK`` / ``HOROVOD_SIZE`` variables (its Gloo mode). ``--parallel`` jobs
run at once (default: as many as the cores allow at ``--np`` ranks each).

Prints one line per test, ``pass``, ``skip`` (with the reason) or ``fail`` (with the rank and the
error), then the counts; exits 0 when every test passed or was skipped.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
import types
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- inside each rank
def _common_module() -> types.ModuleType:
    """The helpers of Horovod's test/utils/common.py that its test files import."""
    common = types.ModuleType("common")

    def mpi_env_rank_and_size():
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])

    def skip_or_fail_gpu_test(test, message):
        if os.environ.get("HOROVOD_TEST_GPU"):
            test.fail(message)
        test.skipTest(message)

    @contextlib.contextmanager
    def temppath():
        fd, path = tempfile.mkstemp()
        os.close(fd)
        os.remove(path)
        try:
            yield path
        finally:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)

    @contextlib.contextmanager
    def tempdir():
        path = tempfile.mkdtemp()
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    common.mpi_env_rank_and_size = mpi_env_rank_and_size
    common.skip_or_fail_gpu_test = skip_or_fail_gpu_test
    common.temppath = temppath
    common.tempdir = tempdir
    return common


def _as_horovod() -> None:
    """Make ``import horovod.torch as hvd`` give torchmn.horovod, in Horovod's Gloo mode."""
    import torchmn.horovod

    for ours, theirs in (("RANK", "HOROVOD_RANK"), ("WORLD_SIZE", "HOROVOD_SIZE"), ("LOCAL_RANK", "HOROVOD_LOCAL_RANK"),
                         ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE")):
        os.environ.setdefault(theirs, os.environ.get(ours, "0" if "RANK" in ours else "1"))
    horovod = types.ModuleType("horovod")
    horovod.__path__ = []
    horovod.torch = torchmn.horovod
    sys.modules.update({"horovod": horovod, "horovod.torch": torchmn.horovod,
                        "horovod.torch.mpi_ops": torchmn.horovod, "common": _common_module()})


def _outcome(result: unittest.TestResult) -> dict:
    if result.errors or result.failures:
        _, text = (result.errors or result.failures)[0]
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return {"outcome": "fail", "reason": lines[-1] if lines else "failed", "traceback": text}
    if result.skipped:
        return {"outcome": "skip", "reason": result.skipped[0][1]}
    return {"outcome": "pass", "reason": ""}


def run_one(path: str, test: str, out: str) -> int:
    """On each rank of a job: run ``Class.test_name`` of the file at ``path``, write this rank's
    outcome to ``out/<rank>.json``; exit code 1 when it failed (so the launcher stops the others)."""
    _as_horovod()
    rank = os.environ["HOROVOD_RANK"]
    try:
        sys.path.insert(0, str(Path(path).resolve().parent))
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        result = unittest.TestResult()
        unittest.defaultTestLoader.loadTestsFromName(test, module).run(result)
        outcome = _outcome(result)
    except BaseException:  # noqa: BLE001 (the file itself did not load: reported as the test's failure)
        text = traceback.format_exc()
        outcome = {"outcome": "fail", "reason": text.strip().splitlines()[-1], "traceback": text}
    Path(out, f"{rank}.json.tmp").write_text(json.dumps(outcome))
    os.replace(Path(out, f"{rank}.json.tmp"), Path(out, f"{rank}.json"))  # whole, or not there
    sys.stdout.flush()
    return 1 if outcome["outcome"] == "fail" else 0


# ----------------------------------------------------------------------------- the driver
def list_tests(path: str) -> list[str]:
    """``Class.test_name`` of every test method of every TestCase class in the file, in file order."""
    tree = ast.parse(Path(path).read_text(), filename=path)
    tests = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any("TestCase" in ast.unparse(b) for b in node.bases):
            tests += [f"{node.name}.{f.name}" for f in node.body
                      if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    return tests


def run_test(path: str, test: str, np: int, timeout: float) -> dict:
    """Run one test in its own ``torchmn run -np`` job; its outcome over the ranks."""
    out = tempfile.mkdtemp(prefix="horovod-upstream-")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TORCHMN_TIMEOUT=os.environ.get("TORCHMN_TIMEOUT", "30"))
    argv = [sys.executable, "-m", "torchmn", "run", "-np", str(np), sys.executable, __file__, "--one", path, test, out]
    # A session of its own, so that a job past its timeout is stopped with every rank it started.
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code, tail = proc.returncode, output.strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        code, tail = None, [f"the job did not end within {timeout:.0f} s"]
    ranks = {int(p.stem): json.loads(p.read_text()) for p in Path(out).glob("*.json")}
    shutil.rmtree(out, ignore_errors=True)
    failed = sorted(r for r, o in ranks.items() if o["outcome"] == "fail")
    if failed:
        return {"outcome": "fail", "reason": f"rank {failed[0]}: {ranks[failed[0]]['reason']}"}
    if len(ranks) < np or code != 0:
        missing = sorted(set(range(np)) - set(ranks))
        what = f"rank(s) {missing} gave no result" if missing else "every rank passed, but the job did not end well"
        return {"outcome": "fail", "reason": f"{what} (exit code {code}): {' | '.join(tail)}"}
    skipped = [o for o in ranks.values() if o["outcome"] == "skip"]
    if skipped:
        return {"outcome": "skip", "reason": skipped[0]["reason"]}
    return {"outcome": "pass", "reason": ""}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a copy of Horovod's test/parallel/test_torch.py")
    parser.add_argument("--np", type=int, default=2, help="ranks per test (default 2)")
    parser.add_argument("--parallel", type=int, default=None, help="jobs at once (default: cores // np, at least 1)")
    parser.add_argument("-k", default="", help="run only the tests whose name contains these words")
    parser.add_argument("--timeout", type=float, default=180, help="seconds a test's job may take (default 180)")
    args = parser.parse_args(argv)
    tests = [t for t in list_tests(args.path) if all(w in t for w in args.k.split())]
    if not tests:
        print(f"no tests in {args.path} match {args.k!r}", file=sys.stderr)
        return 2
    parallel = args.parallel or max(1, (os.cpu_count() or 1) // args.np)
    width = max(len(t) for t in tests)
    counts = {"pass": 0, "skip": 0, "fail": 0}
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        futures = {pool.submit(run_test, args.path, t, args.np, args.timeout): t for t in tests}
        results = {}
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
    for t in tests:
        r = results[t]
        counts[r["outcome"]] += 1
        print(f"{t:<{width}}  {r['outcome']:<4}  {r['reason']}".rstrip(), flush=True)
    print(f"{counts['pass']} passed, {counts['skip']} skipped, {counts['fail']} failed "
          f"({len(tests)} tests, {args.np} ranks each)")
    return 0 if counts["fail"] == 0 else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        sys.exit(run_one(*sys.argv[2:5]))
    sys.exit(main())
