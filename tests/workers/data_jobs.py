"""The jobs that run data_checks.py: one per rank count, shared by tests/test_datasets.py,
tests/test_iterators_evaluators.py and tests/test_extensions.py (each test reads its own check's
line; see tests/jobs.py). The ranks are forked: the launchers have tests of their own."""
import shutil
import tempfile

from jobs import WORKERS, check_job_output, run_job


def data_check_output(request, np: int):
    """The job of data checks on ``np`` ranks that this test's check runs in (its test is marked
    ``@pytest.mark.check_job("data", ...)``)."""
    def run(checks):
        tmp = tempfile.mkdtemp(prefix=f"torchmn-data-np{np}-")
        try:
            return run_job(WORKERS / "data_checks.py", ["--tmp", tmp, *checks], np=np, timeout=120, check=False)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return check_job_output(request, run)
