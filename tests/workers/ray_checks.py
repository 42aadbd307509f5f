"""torchmn inside Ray Train's TorchTrainer, 2 CPU workers on this machine.

Usage: python ray_checks.py STORAGE

The three runs share one local Ray instance (starting one costs more than a run):
- recipe: examples/ray/train_mnist_ray.py as a script (it starts the instance), 2 epochs on 400
  images, checkpoints under STORAGE/recipe; prints the recipe's own "final:" and "checkpoint:" lines.
- adopt: each worker's communicator adopts Ray's process group, keeps Ray's thread setting, runs
  an allreduce, and on finalize() leaves the group to Ray; prints "ADOPTED <rank> <threads>" per worker.
- fail: worker 1 raises after the communicator's first collective, while worker 0 sleeps for 120 s;
  Ray (no retries) ends the run and the driver prints "RAY SAW <error> after <seconds since the raise>".

Ray Train picks the process group's port by binding port 0 and letting it go; torch binds it again
later, and on a machine busy with other jobs' connections another process can take it in between
(EADDRINUSE in Ray's set-up, before the training function runs; Ray does not retry it). A run that
fails so is started once more, and says so ("RETRY").
"""
import os
import runpy
import sys
import time
from pathlib import Path

import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

storage = os.path.abspath(sys.argv[1])


def train_loop(config):
    import torchmn

    assert dist.is_initialized(), "Ray sets up torch.distributed before the training function"
    comm = torchmn.create_communicator()
    total = comm.allreduce(torch.ones(1)).item()
    assert total == 2.0, total
    if config["mode"] == "fail" and comm.rank == 1:
        with open(config["raised"], "w") as f:  # when, for the driver's clock
            f.write(str(time.time()))
        raise RuntimeError("worker 1 fails on purpose")
    if config["mode"] == "fail":
        time.sleep(120)  # Ray ends this worker when the other fails
    threads = torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS")
    comm.finalize()
    assert dist.is_initialized(), "finalize() destroyed Ray's process group"
    ray.train.report({"adopted": 1, "rank": comm.rank, "threads": threads, "omp": omp})
    print(f"ADOPTED {comm.rank} {threads} {omp}", flush=True)


def port_race(error):
    """Whether a run failed in Ray's process-group set-up because its port was taken meanwhile."""
    return "EADDRINUSE" in str(error) or "Address already in use" in str(error)


def once_more_after_a_port_race(run):
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - Ray wraps the worker's error in its own types
        if not port_race(e):
            raise
        print(f"RETRY after Ray's port race: {str(e)[:300]}", flush=True)
        return run()


def fit(mode):
    trainer = TorchTrainer(train_loop, train_loop_config={"mode": mode, "raised": raised},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=storage, name=mode,
                                                failure_config=FailureConfig(max_failures=0)))
    return trainer.fit()


recipe = Path(__file__).resolve().parents[2] / "examples" / "ray" / "train_mnist_ray.py"
sys.argv = [str(recipe), "--workers", "2", "--epochs", "2", "--n-train", "400",
            "--storage", os.path.join(storage, "recipe")]


def run_recipe():
    if ray.is_initialized():  # the recipe starts its own instance
        ray.shutdown()
    runpy.run_path(str(recipe), run_name="__main__")


once_more_after_a_port_race(run_recipe)
assert ray.is_initialized(), "the recipe started the Ray instance the other runs share"
raised = os.path.join(storage, "raised")
print(f"RESULT {once_more_after_a_port_race(lambda: fit('adopt')).metrics}", flush=True)
try:
    once_more_after_a_port_race(lambda: fit("fail"))
    print("RAY SAW nothing: the failed run returned", flush=True)
except Exception as e:  # noqa: BLE001 - what Ray raises for a failed run
    with open(raised) as f:
        since = time.time() - float(f.read())
    print(f"RAY SAW {type(e).__name__} after {since:.0f} s: {e}", flush=True)
