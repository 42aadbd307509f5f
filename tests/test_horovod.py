"""torchmn.horovod: Horovod's PyTorch API, in real 2- and 3-rank jobs, checked as Horovod's own
test/parallel/test_torch.py checks it (one test id per check and rank count; the checks of one
rank count share one job, see tests/jobs.py)."""
import subprocess
import sys

import pytest

from jobs import REPO, WORKERS, assert_check_passed, check_job_output, clean_env, run_job

CHECKS = WORKERS / "horovod_checks.py"
ALL = ("allreduce_ops_and_dtypes", "allreduce_inplace", "allreduce_prescale_postscale", "allreduce_async_many",
       "poll", "grouped_allreduce", "allreduce_grad", "mismatched_shapes_raise", "unsupported_refused",
       "allgather_uneven", "allgather_grad", "broadcast_every_root", "broadcast_grad", "alltoall_uneven",
       "reducescatter", "grouped_ops", "sparse_allreduce", "objects_and_barrier", "topology_queries",
       "timeline", "join_one_rank_early", "optimizer_averages", "optimizer_backward_passes_per_step",
       "optimizer_fp16_compression", "optimizer_synchronize_clip", "optimizer_sparse_as_dense", "optimizer_misuse_refused",
       "optimizer_sparse_gradients", "optimizer_parameter_names", "broadcast_optimizer_state_after_reload",
       "broadcast_optimizer_state_every_optimizer", "broadcast_optimizer_state_without_gradients",
       "join_refuses_what_it_cannot_mirror", "sync_batch_norm")


@pytest.mark.check_job("horovod")
@pytest.mark.parametrize("check", ALL)
@pytest.mark.parametrize("np", [2, 3])
def test_horovod(np, check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, checks, np=np, timeout=300, check=False,
                                                            env={"TORCHMN_TIMEOUT": "60"}))
    assert_check_passed(proc, check)


@pytest.mark.check_job("horovod-sets")
@pytest.mark.parametrize("check", ["process_set_of_two", "optimizer_outside_its_process_set"])
def test_horovod_process_sets(check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, checks, np=3, timeout=120, check=False,
                                                            env={"TORCHMN_TIMEOUT": "60"}))
    assert_check_passed(proc, check)


INIT_WITH_RANKS = """
import torch, torchmn.horovod as hvd
hvd.init(comm=[0, 2])
world = int(__import__("os").environ["RANK"])
if world in (0, 2):
    assert (hvd.rank(), hvd.size()) == ({0: 0, 2: 1}[world], 2), (hvd.rank(), hvd.size())
    assert hvd.allreduce(torch.tensor([float(world)]), op=hvd.Sum).item() == 2.0
else:
    assert (hvd.rank(), hvd.size()) == (0, 1)
print("PASS init_with_ranks", flush=True)
hvd.shutdown()
"""


def test_horovod_init_with_a_list_of_ranks(tmp_path):
    script = tmp_path / "init_ranks.py"
    script.write_text(INIT_WITH_RANKS)
    proc = run_job(script, [], np=3, timeout=120, check=False, env={"TORCHMN_TIMEOUT": "60"})
    assert proc.returncode == 0 and proc.stdout.count("PASS init_with_ranks") == 3, proc.stdout + proc.stderr


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=60)


def test_horovod_calls_before_init_raise_horovods_message():
    proc = _python("import torch, torchmn.horovod as hvd\n"
                   "for f in (hvd.rank, hvd.size, hvd.local_rank, lambda: hvd.allreduce(torch.ones(1)),\n"
                   "          lambda: hvd.broadcast_parameters({}, 0)):\n"
                   "    try:\n        f()\n    except ValueError as e:\n        print(e)\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == ["Horovod has not been initialized; use hvd.init()."] * 5, proc.stdout


def test_horovod_elastic_says_what_to_use_instead():
    proc = _python("import torchmn.horovod as hvd\nhvd.elastic.run\n")
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "does not implement hvd.elastic" in proc.stderr
    assert "examples/slurm/" in proc.stderr


def test_horovod_world_of_one_runs_as_plain_process():
    proc = _python("import torch, torchmn.horovod as hvd\nhvd.init()\n"
                   "print(hvd.rank(), hvd.size(), hvd.allreduce(torch.ones(2)).tolist(),\n"
                   "      hvd.allgather(torch.ones(1)).tolist(), hvd.join())\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "0 1 [1.0, 1.0] [1.0] 0"


ERRORS = """
import pickle, torch, torchmn, torchmn.horovod as hvd

def caught(what, builtin, fn):
    try:
        fn()
    except builtin as e:
        print(what, isinstance(e, torchmn.TorchmnError))
        return
    print(what, "not raised")

caught("before init", ValueError, hvd.rank)
caught("mpi4py communicator", NotImplementedError, lambda: hvd.init(comm=object()))
caught("elastic", ImportError, lambda: hvd.elastic)
hvd.init()
model = torch.nn.Linear(2, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
caught("adasum", NotImplementedError, lambda: hvd.allreduce(torch.ones(1), op=hvd.Adasum))
caught("unknown handle", ValueError, lambda: hvd.synchronize(12345))
caught("pickled optimizer", TypeError, lambda: pickle.dumps(opt))
model(torch.ones(1, 2)).sum().backward()
caught("second backward", AssertionError, lambda: model(torch.ones(1, 2)).sum().backward())
emb = torch.nn.Embedding(3, 2, sparse=True)
hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
caught("sparse gradient", RuntimeError, lambda: emb(torch.tensor([0])).sum().backward())
"""


def test_horovod_errors_are_torchmn_errors_with_horovods_builtin_base():
    proc = _python(ERRORS)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{what} True" for what in (
        "before init", "mpi4py communicator", "elastic", "adasum", "unknown handle", "pickled optimizer",
        "second backward", "sparse gradient")], proc.stdout
