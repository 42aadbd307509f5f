"""The examples, end to end on small data: single process, 2 ranks, the ppe loop, --data-dir, model
parallelism, the Horovod idiom, tuning.

The README's main job runs under ``torchmn run`` as the README gives it, and so do the tests of a
launcher's part (SIGTERM to ``torchmn run``, horovodrun's flags); the others fork their ranks
(``jobs.run_job``), which starts them in milliseconds instead of seconds of importing torch.
"""
import gzip
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from jobs import REPO, clean_env, run_job, run_one_process

# The examples' own dependencies (the "examples" extra): missing ones fail the tests, not skip them.
import mlxtend  # noqa: E402,F401
import pytorch_pfn_extras  # noqa: E402,F401
import tqdm  # noqa: E402,F401

MNIST = REPO / "examples" / "mnist"
SMALL = ["--n-train", "400", "--epochs", "2"]
# A run takes 5-15 s on an idle 2-core machine (mostly importing torch); the margin is for busy CI.
JOB_TIMEOUT = 100
# The examples trained to an accuracy (several epochs over the whole subset) took up to 80 s beside
# the full suite on a slow day.
TRAIN_TIMEOUT = 240
LOG_KEYS = {"epoch", "main/loss", "validation/main/loss", "validation/main/accuracy", "elapsed_time"}


def load_data_module():
    spec = importlib.util.spec_from_file_location("mnist_example_data", MNIST / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_single(args):
    """Run the single-process script; fail with its output if it fails."""
    proc = run_one_process(MNIST / "train_mnist_single.py", args, timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    return proc


def check_log(path, epochs):
    log = json.loads(path.read_text())
    assert [entry["epoch"] for entry in log] == list(range(1, epochs + 1))
    for entry in log:
        assert LOG_KEYS <= set(entry), entry
        assert all(isinstance(entry[k], (int, float)) for k in LOG_KEYS), entry
    elapsed = [entry["elapsed_time"] for entry in log]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    return log


def write_idx(path, array):
    """Write ``array`` (uint8) as an IDX file, gzipped when ``path`` ends in .gz."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def idx_dir(tmp_path):
    """Tiny fake MNIST: 300 training and 100 test images; the training files gzipped, t10k not."""
    rng = np.random.default_rng(0)
    d = tmp_path / "mnist"
    d.mkdir()
    for split, n, suffix in (("train", 300, ".gz"), ("t10k", 100, "")):
        write_idx(d / f"{split}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28)))
        write_idx(d / f"{split}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, n))
    return d


@pytest.mark.timeout(JOB_TIMEOUT + 20)
def test_single_process(tmp_path):
    log_path = tmp_path / "log.json"
    run_single([*SMALL, "--log", str(log_path)])
    log = check_log(log_path, 2)
    assert log[-1]["validation/main/accuracy"] > 0.3


@pytest.mark.timeout(JOB_TIMEOUT + 20)
def test_two_ranks(tmp_path):
    log_path = tmp_path / "log.json"
    proc = run_job(MNIST / "train_mnist.py", [*SMALL, "--log", str(log_path)], np=2, launcher="torchmn",
                   timeout=JOB_TIMEOUT)
    log = check_log(log_path, 2)
    assert log[-1]["validation/main/accuracy"] > 0.3
    assert "epoch   2" in proc.stdout  # printed once, by rank 0
    assert proc.stdout.count("epoch   2") == 1
    # --device auto on a machine without GPUs: the CPU, said once, with the reason.
    assert (proc.stdout + proc.stderr).count("torchmn: --device auto: training on the CPU: ") == 1


@pytest.mark.parametrize("args,words", [(["--data-dir", "/nonexistent/mnist"], "--data-dir: /nonexistent/mnist is not a "
                                                                                "directory"),
                                        (["--n-train", "0"], "--n-train: 0 is not at least 1"),
                                        (["--batch-size", "x"], "--batch-size: 'x' is not a whole number"),
                                        (["--epochs", "0"], "--epochs: 0 is not at least 1")])
def test_bad_example_argument_is_one_line_and_status_2(args, words):
    proc = subprocess.run([sys.executable, str(MNIST / "train_mnist_single.py"), *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and words in proc.stderr.splitlines()[-1] and "Traceback" not in proc.stderr, \
        proc.stderr


def test_sharded_state_with_powersgd_is_one_line_and_status_2():
    proc = subprocess.run([sys.executable, str(MNIST / "train_mnist.py"), "--shard-state", "--compression", "powersgd"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "do not go together" in proc.stderr.splitlines()[-1], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(JOB_TIMEOUT + 20)
@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
@pytest.mark.parametrize("script", ["train_mnist.py", "train_mnist_single.py", "train_mnist_elastic.py"])
def test_device_cuda_without_cuda_is_one_line_and_status_2(script):
    proc = run_one_process(MNIST / script, ["--device", "cuda", "--n-train", "100", "--epochs", "1"],
                           timeout=JOB_TIMEOUT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --device cuda: "), \
        (proc.returncode, proc.stderr)
    assert "--device cpu" in lines[0]


@pytest.mark.timeout(3 * JOB_TIMEOUT + 20)
def test_two_ranks_resume_from_checkpoint(tmp_path):
    """Stopped after epoch 1 and started again with the same --checkpoint, the example continues at
    epoch 2 and logs what an uninterrupted run logs (the losses to the last bit)."""
    def run(epochs, log, checkpoint=None):
        extra = ["--checkpoint", str(checkpoint)] if checkpoint else []
        proc = run_job(MNIST / "train_mnist.py", ["--n-train", "400", "--epochs", str(epochs), "--log", str(log),
                                                  *extra], np=2, timeout=JOB_TIMEOUT)
        return [{k: v for k, v in e.items() if k != "elapsed_time"} for e in json.loads(log.read_text())], proc

    whole, _ = run(2, tmp_path / "whole.json")
    run(1, tmp_path / "first.json", tmp_path / "ckpt")
    resumed, proc = run(2, tmp_path / "resumed.json", tmp_path / "ckpt")
    assert "epoch   1" not in proc.stdout and "epoch   2" in proc.stdout, proc.stdout[-2000:]
    assert resumed == whole


@pytest.mark.timeout(JOB_TIMEOUT + 20)
def test_ppe_two_ranks(tmp_path):
    out = tmp_path / "ppe"
    run_job(MNIST / "train_mnist_ppe.py", [*SMALL, "--out", str(out), "--device", "cpu"], np=2, timeout=JOB_TIMEOUT)
    log = json.loads((out / "log").read_text())
    assert [entry["epoch"] for entry in log] == [1, 2]
    for entry in log:
        assert {"main/loss", "validation/main/loss", "validation/main/accuracy", "elapsed_time"} <= set(entry)
    assert log[-1]["validation/main/accuracy"] > 0.3


def test_bundled_data_split():
    data = load_data_module()
    train, val = data.load_mnist(n_train=4000)
    assert (len(train), len(val)) == (4000, 1000)
    x, y = train[0]
    assert x.shape == (784,) and str(x.dtype) == "torch.float32" and 0 <= float(x.min()) <= float(x.max()) <= 1
    assert isinstance(y, int)
    assert {label for _, label in val} == set(range(10))  # the digit-sorted file is shuffled first
    # The held-out set is fixed: training on fewer images validates on the same 1000.
    small, same_val = data.load_mnist(n_train=1000)
    assert (len(small), len(same_val)) == (1000, 1000)
    assert all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(val, same_val))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(small, train[:1000]))
    for bad in (0, 4001):
        with pytest.raises(ValueError, match="between 1 and 4000 .* held out"):
            data.load_mnist(n_train=bad)


def test_data_dir_files(idx_dir):
    data = load_data_module()
    train, val = data.load_mnist(data_dir=str(idx_dir))
    assert (len(train), len(val)) == (300, 100)
    train, _ = data.load_mnist(n_train=120, data_dir=str(idx_dir))
    assert len(train) == 120
    raw = data.read_idx(idx_dir / "train-images-idx3-ubyte.gz")
    assert raw.shape == (300, 28, 28)
    assert np.allclose(train[5][0].numpy(), raw[5].reshape(-1) / 255.0)
    for bad in (0, -5, 301):
        with pytest.raises(ValueError, match="--n-train must be between 1 and 300"):
            data.load_mnist(n_train=bad, data_dir=str(idx_dir))
    (idx_dir / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        data.load_mnist(data_dir=str(idx_dir))
    whole = (idx_dir / "t10k-images-idx3-ubyte").read_bytes()
    (idx_dir / "t10k-images-idx3-ubyte").write_bytes(whole[:-16])
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte is damaged or truncated"):
        data.read_idx(idx_dir / "t10k-images-idx3-ubyte")
    # Cut inside the header, or a gzip stream cut short: the same message, naming the file.
    for cut in (3, 10):
        (idx_dir / "t10k-images-idx3-ubyte").write_bytes(whole[:cut])
        with pytest.raises(ValueError, match="t10k-images-idx3-ubyte is damaged or truncated.*download it again"):
            data.read_idx(idx_dir / "t10k-images-idx3-ubyte")
    gz = idx_dir / "train-labels-idx1-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:-20])
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte.gz is damaged or truncated.*download it again"):
        data.read_idx(gz)


@pytest.mark.timeout(JOB_TIMEOUT + 20)
def test_ppe_batchnorm_part_smaller_than_a_batch(tmp_path):
    """--batchnorm drops incomplete batches; a part with none left is a clear error, not ppe's."""
    proc = run_job(MNIST / "train_mnist_ppe.py", ["--n-train", "101", "--epochs", "1", "--batchnorm", "--out",
                                                  str(tmp_path / "ppe")], np=2, timeout=JOB_TIMEOUT,
                   check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "51 samples, fewer than --batch-size 100" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.timeout(JOB_TIMEOUT + 20)
def test_data_dir_end_to_end(idx_dir, tmp_path):
    log_path = tmp_path / "log.json"
    run_single(["--data-dir", str(idx_dir), "--epochs", "1", "--log", str(log_path)])
    log = check_log(log_path, 1)
    assert 0 <= log[0]["validation/main/accuracy"] <= 1


PREEMPTIBLE = REPO / "examples" / "slurm" / "train_preemptible.py"


@pytest.mark.timeout(4 * JOB_TIMEOUT + 20)  # four jobs, each within JOB_TIMEOUT
def test_preemptible_checkpoints_on_sigterm_and_resumes(tmp_path):
    """SIGTERM (Slurm's preemption, scancel) to `torchmn run`: the ranks save the checkpoint before they
    stop, and the next run resumes from it to the same weights as an uninterrupted run. A second run
    asked for fewer steps leaves the checkpoint as it is."""
    import signal
    import time

    script = [sys.executable, "-m", "torchmn", "run", "-np", "2", sys.executable, str(PREEMPTIBLE), "--steps", "200",
              "--print-every", "10"]

    def checkpoint(name):
        return ["--checkpoint", str(tmp_path / name), "--out", str(tmp_path / f"{name}.pt")]

    def run(args):  # the runs after the first are the script's part alone: forked ranks
        return run_job(PREEMPTIBLE, ["--steps", "200", "--print-every", "10", *args], np=2, timeout=JOB_TIMEOUT,
                       check=False)

    first = subprocess.Popen(script + ["--sleep", "0.02", *checkpoint("cut")], cwd=REPO,
                             env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + JOB_TIMEOUT
        while "step 40 " not in seen and time.monotonic() < deadline:
            seen += first.stdout.readline()
        first.send_signal(signal.SIGTERM)
        seen += first.communicate(timeout=JOB_TIMEOUT)[0]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert "signal received (SIGTERM): checkpoint saved at step" in seen, seen
    assert not (tmp_path / "cut.pt").exists(), seen  # stopped before the end
    resumed = run(checkpoint("cut"))
    assert "resumed from step" in resumed.stdout and "done: 200 steps" in resumed.stdout, resumed.stdout + resumed.stderr
    whole = run(checkpoint("whole"))
    assert whole.returncode == 0, whole.stderr
    cut, full = torch.load(tmp_path / "cut.pt"), torch.load(tmp_path / "whole.pt")
    assert all(torch.equal(cut[k], full[k]) for k in full), (cut, full)
    weights = (tmp_path / "whole.pt").read_bytes()
    fewer = run(["--steps", "100", *checkpoint("whole")])
    assert "nothing to do: the checkpoint is at step 200, --steps is 100" in fewer.stdout, fewer.stdout
    assert (tmp_path / "whole.pt").read_bytes() == weights
    assert (tmp_path / "whole" / "step_00000200" / "COMPLETE").exists()  # the newest step is still 200


PIPELINE = REPO / "examples" / "model_parallel" / "pipeline_mnist.py"


def _accuracies(out):
    return [float(line.split("val accuracy")[1].split()[0]) for line in out.splitlines() if "val accuracy" in line]


@pytest.mark.timeout(TRAIN_TIMEOUT + 20)
def test_pipeline_example_reaches_one_process_accuracy():
    """2 stages, 4 micro-batches, 4,000 training images: 4 epochs reach what one process does in 4
    (about 0.93; 0.94-0.95 after 10)."""
    proc = run_job(PIPELINE, ["--epochs", "4"], np=2, timeout=TRAIN_TIMEOUT)
    accuracies = _accuracies(proc.stdout)
    assert len(accuracies) == 4 and accuracies[-1] >= 0.92, proc.stdout[-2000:]
    assert "peak activation memory of stage 1" in proc.stdout


def test_pipeline_example_with_data_parallel_replicas():
    """4 ranks: 2 stages x 2 replicas, each stage's replicas averaging their gradients."""
    proc = run_job(PIPELINE, ["--n-train", "800", "--epochs", "3", "--schedule", "gpipe"], np=4, timeout=JOB_TIMEOUT)
    accuracies = _accuracies(proc.stdout)
    assert len(accuracies) == 3 and accuracies[-1] >= 0.7, proc.stdout[-2000:]
    assert "2 replica(s)" in proc.stdout


@pytest.mark.timeout(TRAIN_TIMEOUT + 20)
def test_spatial_cnn_example_reaches_one_process_accuracy():
    """Every image split by rows over 2 ranks (spatial convolutions, multi-node BatchNorm): about 0.95
    after 3 epochs, as one process (0.96 after the default 6)."""
    proc = run_job(REPO / "examples" / "model_parallel" / "spatial_cnn.py", ["--epochs", "3"], np=2,
                   timeout=TRAIN_TIMEOUT)
    accuracies = _accuracies(proc.stdout)
    assert len(accuracies) == 3 and accuracies[-1] >= 0.945, proc.stdout[-2000:]


HOROVOD_MNIST = REPO / "examples" / "horovod" / "pytorch_mnist.py"


@pytest.mark.timeout(3 * TRAIN_TIMEOUT + 20)
def test_horovod_example_runs_under_horovodrun_flags_to_one_process_accuracy(tmp_path):
    """The Horovod-idiom script, as `horovodrun -np 2 -H localhost:2 python ...` would start it: the
    accuracy of one process in 4 epochs (about 0.93; 0.94 after the default 10), checkpoints on rank 0
    only, and a resumed run that goes on from the newest one (broadcast_parameters and
    broadcast_optimizer_state after rank 0 loads it)."""
    one = run_one_process(HOROVOD_MNIST, ["--epochs", "4"], timeout=TRAIN_TIMEOUT)
    assert one.returncode == 0, one.stderr
    argv = [sys.executable, "-m", "torchmn", "run", "-np", "2", "-H", "localhost:2", sys.executable,
            str(HOROVOD_MNIST), "--epochs", "4", "--fp16-allreduce", "--checkpoint-dir", str(tmp_path)]
    two = subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TRAIN_TIMEOUT)
    assert two.returncode == 0, two.stderr[-3000:]
    single, both = _accuracies(one.stdout), _accuracies(two.stdout)
    assert len(single) == len(both) == 4, two.stdout
    assert both[-1] >= 0.9 and both[-1] >= single[-1] - 0.02, (single, both)
    assert all(line.startswith("[0] ") for line in two.stdout.splitlines() if "val accuracy" in line)
    assert sorted(os.listdir(tmp_path)) == sorted(f"checkpoint-{e}.pt" for e in range(1, 5))
    resumed = run_job(HOROVOD_MNIST, ["--fp16-allreduce", "--checkpoint-dir", str(tmp_path), "--epochs", "5"], np=2,
                      timeout=TRAIN_TIMEOUT, check=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    epochs = [line.split()[2] for line in resumed.stdout.splitlines() if "val accuracy" in line]
    assert epochs == ["5"] and _accuracies(resumed.stdout)[-1] >= 0.9, resumed.stdout


@pytest.mark.timeout(2 * JOB_TIMEOUT + 20)
def test_tune_example_two_ranks_per_trial(tmp_path):
    """examples/tune/tune_mnist.py: 2 ranks run each trial; the study (a sqlite file) resumes."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = ["--n-train", "400", "--epochs", "1", "--n-trials", "2", "--storage", storage]
    first = run_job(REPO / "examples" / "tune" / "tune_mnist.py", args, np=2, timeout=JOB_TIMEOUT)
    assert first.stdout.count("complete accuracy") == 2 and "best: accuracy" in first.stdout, first.stdout
    again = run_job(REPO / "examples" / "tune" / "tune_mnist.py", args, np=2, timeout=JOB_TIMEOUT)
    assert again.stdout.count("complete accuracy") == 4, again.stdout
