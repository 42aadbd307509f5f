"""torchmn.horovod: Horovod's PyTorch API, in real 2- and 3-rank jobs, checked as Horovod's own
test/parallel/test_torch.py checks it (one test id per check and rank count; the checks of one
rank count share one job, see tests/jobs.py)."""
import subprocess
import sys

import pytest

from jobs import REPO, WORKERS, assert_check_passed, check_job_output, clean_env, run_job

CHECKS = WORKERS / "horovod_checks.py"
ALL = ("allreduce_ops_and_dtypes", "allreduce_inplace", "allreduce_prescale_postscale", "allreduce_async_many",
       "poll", "async_ops_are_in_flight", "duplicate_name_refused", "named_collectives_in_another_order_refused",
       "grouped_allreduce", "allreduce_grad", "mismatched_shapes_raise", "unsupported_refused",
       "allgather_uneven", "allgather_grad", "broadcast_every_root", "broadcast_grad", "alltoall_uneven", "alltoall_padded_buffer",
       "reducescatter", "grouped_ops", "sparse_allreduce", "objects_and_barrier", "topology_queries",
       "timeline", "join_one_rank_early", "join_returns_the_last_to_join_without_collectives_between",
       "join_after_a_step_the_ranks_with_data_skipped",
       "optimizer_averages", "optimizer_replaced_for_a_new_phase", "optimizer_backward_passes_per_step",
       "optimizer_fp16_compression", "optimizer_synchronize_clip", "optimizer_sparse_as_dense", "optimizer_misuse_refused",
       "optimizer_sparse_gradients", "optimizer_parameter_names", "broadcast_optimizer_state_after_reload",
       "broadcast_optimizer_state_every_optimizer", "broadcast_optimizer_state_without_gradients",
       "join_refuses_what_it_cannot_mirror", "sync_batch_norm", "topology_queries_are_local",
       "alltoall_async_returns_received_splits", "synchronize_twice", "broadcast_parameters_of_parameters",
       "optimizer_unused_parameter_gets_zero_gradient", "optimizer_zero_grad_before_step_refused",
       "optimizer_set_backward_passes_per_step", "sync_batch_norm_copies_and_pickles", "optimizer_state_dict_hooks",
       "optimizer_step_skipped_after_synchronize", "same_name_in_two_kinds_of_collective",
       "timeline_of_rank_0_alone", "objects_travel_by_cloudpickle", "optimizer_load_state_dict_ends_the_step",
       "submodules_import_as_horovods")


@pytest.mark.check_job("horovod")
@pytest.mark.parametrize("check", ALL)
@pytest.mark.parametrize("np", [2, 3])
def test_horovod(np, check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, checks, np=np, timeout=300, check=False,
                                                            env={"TORCHMN_TIMEOUT": "60"}))
    assert_check_passed(proc, check)


@pytest.mark.check_job("horovod-sets")
@pytest.mark.parametrize("check", ["process_set_of_two", "optimizer_outside_its_process_set",
                                   "process_sets_added_and_removed_keep_files_level"])
def test_horovod_process_sets(check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, checks, np=3, timeout=120, check=False,
                                                            env={"TORCHMN_TIMEOUT": "60"}))
    assert_check_passed(proc, check)


INIT_WITH_RANKS = """
import json, sys, torch, torchmn.horovod as hvd
hvd.init(comm=[0, 2])
world = int(__import__("os").environ["RANK"])
# Every rank records a timeline: the members' parts are numbered as hvd.rank(), hvd rank 0 joins them.
hvd.start_timeline(sys.argv[1])
if world in (0, 2):
    assert (hvd.rank(), hvd.size()) == ({0: 0, 2: 1}[world], 2), (hvd.rank(), hvd.size())
    assert hvd.allreduce(torch.tensor([float(world)]), op=hvd.Sum, name="subset").item() == 2.0
    # A set's ranks are hvd.rank() numbers, registered or not.
    assert hvd.ProcessSet([1]).included() == (hvd.rank() == 1)
else:
    assert (hvd.rank(), hvd.size()) == (0, 1)
    assert not hvd.ProcessSet([0]).included()
written = hvd.stop_timeline()
if world == 0:
    events = json.load(open(written))["traceEvents"]
    assert sorted({e["pid"] for e in events if e.get("args", {}).get("tensor") == "subset"}) == [0, 1], events
print("PASS init_with_ranks", flush=True)
hvd.shutdown()
"""


def test_horovod_init_with_a_list_of_ranks(tmp_path):
    script = tmp_path / "init_ranks.py"
    script.write_text(INIT_WITH_RANKS)
    proc = run_job(script, [str(tmp_path / "timeline.json")], np=3, timeout=120, check=False,
                   env={"TORCHMN_TIMEOUT": "60"})
    assert proc.returncode == 0 and proc.stdout.count("PASS init_with_ranks") == 3, proc.stdout + proc.stderr


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=60)


UNEVEN_NODES = """
import os
rank = int(os.environ["RANK"])
node, local, local_size = [(0, 0, 1), (1, 0, 2), (1, 1, 2)][rank]  # node 0 runs 1 rank, node 1 runs 2
os.environ.update(TORCHELASTIC_RUN_ID="uneven", GROUP_RANK=str(node), LOCAL_RANK=str(local),
                  LOCAL_WORLD_SIZE=str(local_size))  # as torchrun would set them
import torchmn.horovod as hvd
hvd.init()
print("CROSS", hvd.rank(), hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous(), flush=True)
"""


def test_horovod_cross_rank_counts_the_nodes_holding_the_local_rank(tmp_path):
    """As Horovod's: a rank's cross communicator holds the ranks of its local rank, one per node
    that runs one, so on nodes of 1 and 2 ranks, local rank 1 has cross rank 0 of 1 (not node 1
    of 2), as horovodrun's HOROVOD_CROSS_RANK/_SIZE say too."""
    from torchmn.run.plan import place_env, plan_slots

    script = tmp_path / "uneven_nodes.py"
    script.write_text(UNEVEN_NODES)
    out = run_job(script, [], np=3, timeout=90).stdout
    cross = sorted(line.split("CROSS ", 1)[1] for line in out.splitlines() if "CROSS " in line)
    assert cross == ["0 0 2 False", "1 1 2 False", "2 0 1 False"], out
    envs = [place_env(slot) for slot in plan_slots([("a", 1), ("b", 2)])]
    assert [(e["HOROVOD_CROSS_RANK"], e["HOROVOD_CROSS_SIZE"]) for e in envs] == [("0", "2"), ("1", "2"), ("0", "1")]


def test_horovod_calls_before_init_raise_horovods_message():
    proc = _python("import torch, torchmn.horovod as hvd\n"
                   "for f in (hvd.rank, hvd.size, hvd.local_rank, lambda: hvd.allreduce(torch.ones(1)),\n"
                   "          lambda: hvd.broadcast_parameters({}, 0)):\n"
                   "    try:\n        f()\n    except ValueError as e:\n        print(e)\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines == ["Horovod has not been initialized; use hvd.init()."] * 5, proc.stdout


def test_horovod_elastic_names_run_in_a_plain_job():
    """hvd.elastic outside an elastic job: run() syncs and calls the function once, commit() keeps the
    values, and a TorchState over hvd.DistributedOptimizer restores what was committed."""
    proc = _python("import torch, torchmn.horovod as hvd\nhvd.init()\n"
                   "model = torch.nn.Linear(2, 1)\n"
                   "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))\n"
                   "state = hvd.elastic.TorchState(model, opt, epoch=3)\n"
                   "objects = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, seen=[])\n"
                   "@hvd.elastic.run\n"
                   "def train(state):\n"
                   "    state.epoch += 1\n"
                   "    state.commit()\n"
                   "    state.epoch = 99\n"
                   "    with torch.no_grad():\n"
                   "        model.weight.zero_()\n"
                   "    state.restore()\n"
                   "    return state.epoch, bool(model.weight.abs().sum() > 0)\n"
                   "print(train(state), issubclass(hvd.elastic.HostsUpdatedInterrupt, RuntimeError),\n"
                   "      hvd.elastic.HorovodInternalError is hvd.HorovodInternalError)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "(4, True) True True"


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
hvd.init()
model = torch.nn.Linear(2, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
caught("adasum", NotImplementedError, lambda: hvd.allreduce(torch.ones(1), op=hvd.Adasum))
caught("unknown handle", ValueError, lambda: hvd.synchronize(12345))
caught("pickled optimizer", TypeError, lambda: pickle.dumps(opt))
model(torch.ones(1, 2)).sum().backward()
caught("second backward", AssertionError, lambda: model(torch.ones(1, 2)).sum().backward())
"""


def test_horovod_errors_are_torchmn_errors_with_horovods_builtin_base():
    proc = _python(ERRORS)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{what} True" for what in (
        "before init", "mpi4py communicator", "adasum", "unknown handle", "pickled optimizer",
        "second backward")], proc.stdout


UPSTREAM_STYLE = '''
import os, sys, unittest
import torch
import horovod.torch as hvd
sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, 'utils'))
from common import mpi_env_rank_and_size, skip_or_fail_gpu_test, temppath


class TorchTests(unittest.TestCase):
    def tearDown(self):
        if hvd.is_initialized() and int(os.getenv('HOROVOD_RANK', -1)) != -1:
            hvd.barrier()
            hvd.shutdown()

    def test_rank_and_allreduce(self):
        mpi_rank, mpi_size = mpi_env_rank_and_size()
        hvd.init()
        assert (mpi_rank, mpi_size) == (hvd.rank(), hvd.size())
        with temppath() as path:
            assert not os.path.exists(path)
        assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [hvd.size()] * 3

    def test_gpu_required(self):
        skip_or_fail_gpu_test(self, "No GPUs available")

    def test_rank_1_fails(self):
        hvd.init()
        assert hvd.rank() != 1, "rank 1 fails on purpose"
'''


def test_upstream_runner_reports_each_test(tmp_path):
    """tests/horovod_upstream.py runs a file written as Horovod's test_torch.py, each test in its own
    torchmn run job, and reports pass, skip (with the reason) and fail (with the rank and error)."""
    path = tmp_path / "parallel" / "test_torch.py"
    path.parent.mkdir()
    path.write_text(UPSTREAM_STYLE)
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "horovod_upstream.py"), str(path), "--np", "2",
                           "--parallel", "2", "--timeout", "100"], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert any(line.split()[:2] == ["TorchTests.test_rank_and_allreduce", "pass"] for line in lines), proc.stdout
    assert any(line.split()[:2] == ["TorchTests.test_gpu_required", "skip"] and "No GPUs available" in line
               for line in lines), proc.stdout
    assert any(line.split()[:2] == ["TorchTests.test_rank_1_fails", "fail"] and "rank 1: AssertionError: rank 1 fails"
               in line for line in lines), proc.stdout
    assert lines[-1] == "1 passed, 1 skipped, 1 failed (3 tests, 2 ranks each)", proc.stdout


LONELY = """
import sys, time, torch, torchmn, torchmn.horovod as hvd
hvd.init()
if hvd.rank() == 0:
    h = hvd.allgather_async(torch.ones(2), name="lonely")
    started = time.monotonic()
    try:
        hvd.synchronize(h)
    except torchmn.CollectiveTimeoutError as e:
        print(f"NAMED after {time.monotonic() - started:.0f} s: {e}", flush=True)
else:
    time.sleep(6)   # never starts it
hvd.shutdown()
print("ENDED", flush=True)
"""


def test_a_rank_that_never_starts_a_background_collective_is_named(tmp_path):
    """A tensor collective runs on a background thread, and its error comes back to the caller:
    after TORCHMN_TIMEOUT, synchronize() names the rank that never started it, and both ranks end."""
    script = tmp_path / "lonely.py"
    script.write_text(LONELY)
    proc = run_job(script, [], np=2, timeout=60, check=False, env={"TORCHMN_TIMEOUT": "3"})
    assert proc.returncode == 0 and proc.stdout.count("ENDED") == 2, proc.stdout + proc.stderr
    named = [line for line in proc.stdout.splitlines() if "NAMED" in line]
    assert len(named) == 1 and "rank 1 (" in named[0] and "never called it" in named[0], proc.stdout
    # 3 s, then up to watch.GRACE_S for the other rank to say where it is (6 s on an idle machine): far from
    # the 600 s default either way, with room for a loaded machine.
    assert int(named[0].split("after ")[1].split(" s")[0]) < 30, named[0]


LOST_PEER = """
import sys, torch, torchmn.horovod as hvd
from torchmn.elastic.reset import recoverable
hvd.init()
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
hvd.allreduce(torch.ones(2))
if hvd.rank() == 1:
    sys.exit(0)   # leaves without a word
for what, call in [("allreduce", lambda: hvd.allreduce(torch.ones(3))),
                   ("allgather_async", lambda: hvd.synchronize(hvd.allgather_async(torch.ones(3)))),
                   ("broadcast_object", lambda: hvd.broadcast_object(1, 0)),
                   ("barrier", hvd.barrier),
                   ("backward", lambda: model(torch.ones(1, 4)).sum().backward()),
                   ("step", opt.step)]:
    try:
        call()
        print("NOT RAISED", what, flush=True)
    except hvd.HorovodInternalError as e:
        print("RAISED", what, type(e).__name__, "recoverable" if recoverable(e) else "not recoverable", flush=True)
"""


def test_horovod_lost_peer_raises_horovod_internal_error(tmp_path):
    """A peer that left: every kind of call raises what Horovod raises then, HorovodInternalError
    (a script's ``except hvd.HorovodInternalError`` catches it), which is torchmn's lost-peer error
    too (an elastic run recovers from it)."""
    script = tmp_path / "lost_peer.py"
    script.write_text(LOST_PEER)
    proc = run_job(script, [], np=2, timeout=90, check=False, env={"TORCHMN_TIMEOUT": "10"})
    lines = [line.split("] ", 1)[1] for line in proc.stdout.splitlines() if "RAISED" in line]
    assert lines == [f"RAISED {what} HorovodPeerLostError recoverable" for what in (
        "allreduce", "allgather_async", "broadcast_object", "barrier", "backward", "step")], proc.stdout + proc.stderr


def test_horovod_failed_rank_error_keeps_what_torchmn_says_of_it():
    """A rank that failed: the error is Horovod's HorovodInternalError and still torchmn's
    RankFailedError, naming the failed rank (``failure``) with the same message."""
    from torchmn.communicators import CollectiveTimeoutError, RankFailedError
    from torchmn.communicators.failure import Failure
    from torchmn.horovod.errors import HorovodInternalError, as_horovods

    failure = Failure(rank=1, host="node1", pid=4242, error="ValueError: boom")
    error = as_horovods(RankFailedError("allreduce stopped on rank 0 (node0): rank 1 failed", failure=failure))
    assert isinstance(error, HorovodInternalError) and isinstance(error, RankFailedError)
    assert error.failure is failure and str(error) == "allreduce stopped on rank 0 (node0): rank 1 failed"
    timeout = as_horovods(CollectiveTimeoutError("rank 1 never called it"))
    assert isinstance(timeout, HorovodInternalError) and isinstance(timeout, CollectiveTimeoutError)
    assert as_horovods(RuntimeError("[pair.cc:534] Connection closed by peer")).__class__.__name__ == "HorovodPeerLostError"
    bad = ValueError("bad batch")
    assert as_horovods(bad) is bad
