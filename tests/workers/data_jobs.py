"""One real job per rank count runs every check of data_checks.py; the test files share its output.

Starting ranks costs seconds each (every rank imports torch), so tests/test_datasets.py,
tests/test_iterators_evaluators.py and tests/test_extensions.py read the same run when pytest
collects them together, and start it themselves when run alone.
"""
import shutil
import tempfile

from jobs import WORKERS, run_job

LAUNCHER = "torchrun"  # the torchmn launcher has its own tests; these test the data utilities
_results: dict = {}


def all_checks_output(np: int) -> str:
    """The stdout of ``data_checks.py all`` on ``np`` ranks; raises (every time) if the job failed."""
    if np not in _results:
        tmp = tempfile.mkdtemp(prefix=f"torchmn-data-np{np}-")
        try:
            _results[np] = run_job(WORKERS / "data_checks.py", ["--tmp", tmp, "all"], np=np,
                                   launcher=LAUNCHER, timeout=120).stdout
        except Exception as e:
            _results[np] = e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(_results[np], Exception):
        raise _results[np]
    return _results[np]
