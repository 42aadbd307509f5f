"""torchmn inside Ray Train's TorchTrainer with 2 CPU workers on this machine (Ray from the
package index, in the `dev` extra): the recipe in examples/ray trains and checkpoints through
`ray.train`; the communicator adopts Ray's process group and leaves it to Ray, keeps Ray's thread
setting, and leaves a failed worker to Ray's failure handling."""
import os
import re
import subprocess
import sys

import pytest
from jobs import REPO, WORKERS, clean_env

TIMEOUT = 240


def _run(argv):
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.fail('Ray is missing: pip install "torchmn[ray]" (the dev requirements install it)')
    proc = subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_the_ray_recipe_trains_and_checkpoints(tmp_path):
    out = _run([sys.executable, str(REPO / "examples" / "ray" / "train_mnist_ray.py"), "--workers", "2",
                "--epochs", "2", "--n-train", "400", "--storage", str(tmp_path)])
    final = re.search(r"final: (\{.*\})", out)
    assert final, out
    assert "'epoch': 1" in final.group(1) and "'ranks': 2" in final.group(1), final.group(1)
    checkpoint = re.search(r"checkpoint: (\S+)", out).group(1)
    assert os.path.exists(os.path.join(checkpoint, "model.pt")), out


def test_torchmn_adopts_rays_process_group_and_leaves_it_to_ray(tmp_path):
    out = _run([sys.executable, str(WORKERS / "ray_checks.py"), "adopt", str(tmp_path)])
    rows = sorted(re.findall(r"ADOPTED (\d) (\d+) (\S+)", out))
    # Ray gives each 1-CPU worker OMP_NUM_THREADS=1; torchmn's budget keeps it.
    assert rows == [("0", "1", "1"), ("1", "1", "1")], out


def test_a_failed_worker_is_left_to_ray(tmp_path):
    out = _run([sys.executable, str(WORKERS / "ray_checks.py"), "fail", str(tmp_path)])
    saw = re.search(r"RAY SAW (\w+) after (\d+) s: (.*)", out, re.S)
    assert saw and "worker 1 fails on purpose" in saw.group(3), out
    assert int(saw.group(2)) < 60, out  # Ray ended the run, not the other worker's 120 s sleep
