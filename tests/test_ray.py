"""torchmn inside Ray Train's TorchTrainer with 2 CPU workers on this machine (Ray from the
package index, in the `dev` extra): the recipe in examples/ray trains and checkpoints through
`ray.train`; the communicator adopts Ray's process group and leaves it to Ray, keeps Ray's thread
setting, and leaves a failed worker to Ray's failure handling.

A local Ray instance (a dozen processes) takes longer to start on a loaded 2-core machine than a
run: the recipe and the checks run in one instance (tests/workers/ray_checks.py), on one worker
(tests/conftest.py), with more than the suite's default limit. Ray lowers its workers' priority
(nice 15), which beside the rest of the suite starves them for minutes: the tests keep them at
the suite's priority."""
import os
import re
import subprocess
import sys

import pytest
from jobs import REPO, WORKERS, clean_env

# The whole instance and the three runs took 230 s beside the quick run and more than 300 s beside the
# full suite on a slow day of a 2-core machine.
TIMEOUT = 600
pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def _run(argv):
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.fail('Ray is missing: pip install -e ".[ray]" (the dev requirements install it)')
    try:
        proc = subprocess.run(argv, cwd=REPO, env={**clean_env(), "RAY_worker_niceness": "0"},
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        pytest.fail(f"{argv[1]} did not end within {TIMEOUT} s; its output:\n{out[-6000:]}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """The output of ray_checks.py: the recipe, the adopt run, then the fail run, in one Ray instance."""
    return _run([sys.executable, str(WORKERS / "ray_checks.py"), str(tmp_path_factory.mktemp("ray"))])


def test_the_ray_recipe_trains_and_checkpoints(checks):
    out = checks
    final = re.search(r"final: (\{.*\})", out)
    assert final, out
    assert "'epoch': 1" in final.group(1) and "'ranks': 2" in final.group(1), final.group(1)
    checkpoint = re.search(r"checkpoint: (\S+)", out).group(1)
    assert os.path.exists(os.path.join(checkpoint, "model.pt")), out


def test_torchmn_adopts_rays_process_group_and_leaves_it_to_ray(checks):
    rows = sorted(re.findall(r"ADOPTED (\d) (\d+) (\S+)", checks))
    # Ray gives each 1-CPU worker OMP_NUM_THREADS=1; torchmn's budget keeps it.
    assert rows == [("0", "1", "1"), ("1", "1", "1")], checks


def test_a_failed_worker_is_left_to_ray(checks):
    saw = re.search(r"RAY SAW (\w+) after (\d+) s: (.*)", checks, re.S)
    assert saw and "worker 1 fails on purpose" in saw.group(3), checks
    assert int(saw.group(2)) < 60, checks  # Ray ended the run, not the other worker's 120 s sleep
