"""The communicator over real gloo, in real multi-process jobs started by torchmn run and torchrun."""
import datetime
import re
import subprocess
import sys
import time

import pytest
import torch

import torchmn
from jobs import WORKERS, assert_check_passed, check_job_output, clean_env, run_job
from ports import free_port
from torchmn.communicators.registry import resolve

CHECKS = WORKERS / "comm_checks.py"


CHECKS_ALL = ("ring", "collectives", "arange", "allgather_uneven", "bcast_data", "mean_grad", "objects", "topology",
              "split", "nested_split", "shard_primitives", "flat_in_flight", "mismatch", "cpu_under_nccl")
GRADIENT_CHECKS = ("mean_grad", "bcast_data", "flat_in_flight", "split", "nested_split", "shard_primitives",
                   "integer_mean_does_not_wrap", "calls_built_on_allgather_obj_are_told_apart", "root_must_be_an_int",
                   "zero_fill_must_agree", "failed_send_fails_the_receiver", "max_and_min_keep_nan",
                   "finalized_split_lets_go_of_its_groups", "bad_root_of_an_object_collective_raises_on_every_rank",
                   "allreduce_in_place_of_a_conjugate_view", "allgather_obj_gives_copies_whatever_the_size")


@pytest.mark.check_job("comm")
@pytest.mark.parametrize("check", CHECKS_ALL)
# Each launcher at 2 ranks; 4 ranks (oversubscribed) forked, as the launchers' start costs seconds a rank.
@pytest.mark.parametrize("np, launcher", [(2, "torchmn"), (2, "torchrun"), (4, "forked")])
def test_all_collectives(launcher, np, check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, checks, np=np, launcher=launcher, timeout=150,
                                                            check=False))
    assert_check_passed(proc, check)
    if check == "topology":
        assert f"TOPOLOGY size={np} inter_size=1 intra_size={np}" in proc.stdout


@pytest.mark.check_job("comm-algorithm", np=3)
@pytest.mark.parametrize("check", GRADIENT_CHECKS)
@pytest.mark.parametrize("name", ["naive", "flat", "two_dimensional"])  # ChainerMN's name for hierarchical
def test_gradient_algorithms(name, check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, ["--name", name, *checks], np=3, timeout=90,
                                                            check=False))
    assert_check_passed(proc, check)


CROSS_NODE = WORKERS / "cross_node_checks.py"
CROSS_NODE_CHECKS = ["doubling_matches_gloo", "auto_measures_alike_on_every_rank",
                     "a_new_rank_takes_the_first_ranks_measurement", "emulated_nodes_average_with_each_algorithm",
                     "emulated_nodes_shard_in_pieces", "emulated_nodes_split_and_finalize_keep_files_level",
                     "bad_choice_is_refused"]


@pytest.mark.check_job("cross-node")
@pytest.mark.parametrize("check", CROSS_NODE_CHECKS)
@pytest.mark.parametrize("np", [3, 4])  # 3: recursive doubling's fold of a rank count not a power of two
def test_cross_node_allreduce(np, check, request):
    """The allreduce across nodes: recursive doubling against gloo's ring, the size-based choice
    measured at set-up, and averages over emulated nodes with each algorithm."""
    proc = check_job_output(request, lambda checks: run_job(CROSS_NODE, checks, np=np, timeout=150, check=False))
    assert_check_passed(proc, check)


def test_bcast_obj_300mb():
    out = run_job(CHECKS, ["big_obj"], np=2, timeout=120, env={"BIG_OBJ_MB": "300"}).stdout
    assert "PASS big_obj" in out


def test_a_one_element_tensor_expanded_from_a_scalar_travels():
    """torch.ones(()).expand(1) counts as contiguous with stride 0 (a gradient of a sum looks so):
    it must travel as its one element."""
    comm = torchmn.create_communicator()
    x = torch.full((), 2.5).expand(1)
    assert comm.bcast(x).tolist() == [2.5]
    assert [t.tolist() for t in comm.allgather(x)] == [[2.5]]
    assert comm.allreduce(x).tolist() == [2.5]


def test_world_of_one_opens_no_port():
    """A plain `python script.py` is a world of one: every collective works and no socket is opened."""
    code = r"""
import psutil, torch, torchmn
comm = torchmn.create_communicator()
assert (comm.rank, comm.size, comm.intra_size, comm.inter_size) == (0, 1, 1, 1)
x = torch.arange(6.).reshape(2, 3).t()
assert torch.equal(comm.allreduce(x), x) and torch.equal(comm.bcast(x), x)
assert torch.equal(comm.allgather(x)[0], x) and torch.equal(comm.gather(x)[0], x)
assert torch.equal(comm.scatter([x]), x) and torch.equal(comm.alltoall([x])[0], x)
assert comm.bcast_obj({"a": 1}) == {"a": 1} and comm.allgather_obj(3) == [3] and comm.allreduce_obj(2) == 2
m = torch.nn.Linear(3, 2); m.weight.grad = torch.ones(2, 3)
comm.bcast_data(m); comm.multi_node_mean_grad(m); comm.barrier()
assert torch.equal(m.weight.grad, torch.ones(2, 3))
opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(m.parameters(), lr=1.0), comm)
m(torch.ones(1, 3)).sum().backward(); opt.step()
sockets = psutil.Process().net_connections(kind="inet")
assert not sockets, sockets
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr


def test_world_of_one_object_collectives_pickle_as_a_larger_world():
    """An object no other rank could receive fails in a plain `python script.py` too, with the
    message a larger world gives, not first at scale; allgather_obj hands back a copy there, as it
    does for a rank's own small object in a larger world."""
    comm = torchmn.create_communicator()  # a world of one here
    for name, call in (("bcast_obj", lambda o: comm.bcast_obj(o)), ("allgather_obj", lambda o: comm.allgather_obj(o)),
                       ("gather_obj", lambda o: comm.gather_obj(o)), ("allreduce_obj", lambda o: comm.allreduce_obj(o))):
        with pytest.raises(TypeError, match=rf"{name}: rank 0 on .* cannot pickle its object \(function\)"):
            call(lambda: 1)
    mine = {"a": [1]}
    assert comm.allgather_obj(mine) == [mine] and comm.allgather_obj(mine)[0] is not mine
    assert comm.bcast_obj(mine) is mine and comm.gather_obj(mine)[0] is mine
    comm.finalize()


def test_chainermns_mpi_comm_argument_is_refused_with_the_fix():
    """ChainerMN's create_communicator(name, mpi_comm): the second argument here is the backend."""
    with pytest.raises(TypeError, match=r"backend must be 'gloo' or 'nccl', not object; there is no mpi_comm argument"):
        torchmn.create_communicator("flat", object())


def test_unknown_name_is_refused():
    code = "import torchmn\ntry:\n    torchmn.create_communicator('fastest')\nexcept ValueError as e:\n    print(e)"
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert "unknown communicator 'fastest'" in proc.stdout and "flat" in proc.stdout, proc.stderr


@pytest.mark.parametrize("name, nearest", [("two_dimensional", "hierarchical"), ("single_node", "hierarchical"),
                                           ("non_cuda_aware", "hierarchical")])
def test_chainermn_names_are_the_nearest_algorithm(name, nearest):
    assert resolve(name, "gloo", 4).name == nearest
    assert resolve("pure_nccl", "nccl", 4).name == "flat"


def test_cpu_and_cuda_tensors_in_one_call_are_named():
    """CUDA tensors travel through NCCL and CPU tensors through gloo: a call whose ranks pass tensors
    of both kinds is refused by its call check on every rank, naming each rank's device."""
    from torchmn.communicators import _call_check, _wire

    rows = [_wire.header(_call_check.KIND["allreduce"], op=0, x=torch.ones(3))] * 2
    rows[1] = rows[1][:_wire.DEVICE] + [_wire.DEVICE_CODES["cuda"]]
    hdrs = torch.tensor(rows).unsqueeze(1)
    with pytest.raises(torchmn.CollectiveMismatchError, match=r"device differs: rank 0: cpu, rank 1: cuda "
                                                                r"\(move the tensors to comm.device on every rank"):
        _call_check.check_headers("allreduce", hdrs, None, same_shape=True, same_dtype=True, rank=0, hosts=None)
    assert _wire.device_type(rows[1]) == "cuda" and _wire.device_type(_wire.header(1)) is None


def test_a_mismatch_names_the_collectives_and_where_the_ranks_run():
    """Ranks in different collectives: the message names the collectives only (their roots and ops
    follow from them), and where every rank runs, runs of ranks on one host together."""
    from torchmn.communicators import _call_check, _wire

    allreduce = _wire.header(_call_check.KIND["allreduce"], op=0, x=torch.ones(3))
    alltoall = _wire.header(_call_check.KIND["alltoall"], x=torch.ones(3))
    hdrs = torch.tensor([allreduce, allreduce, alltoall]).unsqueeze(1)
    with pytest.raises(torchmn.CollectiveMismatchError) as e:
        _call_check.check_headers("allreduce", hdrs, None, same_shape=True, same_dtype=True, rank=0,
                                  hosts=["a", "a", "b"])
    assert "(collective differs: rank 0: allreduce, rank 1: allreduce, rank 2: alltoall), ranks 0-1 on a, " \
           "rank 2 on b; every rank must make the same call" in str(e.value) and "op differs" not in str(e.value), e.value


@pytest.mark.parametrize("views, nodes, shared", [
    ([(None, 1, None)] * 2, [[0, 1]], "ranks 0, 1 (local ranks 0, 1 on h0) would drive GPU 0 together"),
    ([(None, 2, None)] * 2, [[0, 1]], None),                       # a GPU each
    ([("0", 1, None), ("1", 1, None)], [[0, 1]], None),           # Slurm's --gpus-per-task
    ([("3", 1, None), ("3", 1, None)], [[0, 1]], "would drive GPU 3 together"),
    ([(None, 1, "h0"), (None, 1, "h1")], [[0, 1]], None),         # two NCCL hosts (tests/gpu)
    ([(None, 1, None)] * 2, [[0], [1]], None),                     # one rank on each of two nodes
    ([(None, 2, None)] * 3, [[0, 1, 2]], "ranks 0, 2 (local ranks 0, 2 on h0) would drive GPU 0"),
    ([(None, 0, None)] * 2, [[0, 1]], None),                       # no GPU: nothing to share
])
def test_ranks_that_would_share_a_gpu_are_named(views, nodes, shared):
    from torchmn.communicators.gpu_sharing import shared_gpu

    said = shared_gpu(views, nodes, ["h0"] * len(views))
    if shared is None:
        assert said is None, said
    else:
        assert shared in said and "CUDA_VISIBLE_DEVICES" in said and "--device cpu" in said, said


def test_pure_nccl_without_gpus_is_refused_with_the_fix():
    code = "import torchmn\ntry:\n    torchmn.create_communicator('pure_nccl')\nexcept ValueError as e:\n    print(e)"
    # No GPU visible, also on a machine that has some.
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env({"CUDA_VISIBLE_DEVICES": ""}),
                          capture_output=True, text=True, timeout=60)
    assert "'pure_nccl' averages through NCCL, which needs a GPU per rank" in proc.stdout, proc.stdout + proc.stderr
    assert "this job's backend is gloo" in proc.stdout and "create_communicator() ('auto'" in proc.stdout


ALLREDUCE_GRAD_DTYPE = """
import numpy, torch, torchmn
for dtype, expected in [("float16", "fp16"), (torch.float16, "fp16"), (numpy.float16, "fp16"), (numpy.dtype("float16"), "fp16"),
                        ("bfloat16", "bf16"), (torch.bfloat16, "bf16"), (None, None), ("float32", None), (numpy.float32, None)]:
    comm = torchmn.create_communicator(allreduce_grad_dtype=dtype)
    assert comm.compression == expected, (dtype, comm.compression)
model = torch.nn.Linear(3, 2)
opt = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          torchmn.create_communicator(allreduce_grad_dtype="float16"))
print("OPTIMIZER", type(opt).__name__, opt.compression)
try:
    torchmn.create_communicator(allreduce_grad_dtype="int8")
except ValueError as e:
    print("REFUSED", e)
"""


def test_allreduce_grad_dtype_is_the_optimizers_default_compression():
    """ChainerMN's create_communicator(allreduce_grad_dtype=...) in its spellings; an optimizer built
    on that communicator compresses by default; a dtype gradients cannot travel in is refused."""
    proc = subprocess.run([sys.executable, "-c", ALLREDUCE_GRAD_DTYPE], env=clean_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "OPTIMIZER MultiNodeOptimizer fp16" in proc.stdout, proc.stdout
    assert "REFUSED allreduce_grad_dtype='int8': gradients can travel as float16 or bfloat16" in proc.stdout


@pytest.mark.parametrize("timeout, error", [("5", TypeError), (0, ValueError), (datetime.timedelta(0), ValueError),
                                            (True, TypeError)])
def test_bad_timeout_is_refused_before_anything_starts(timeout, error):
    with pytest.raises(error, match="timeout must be"):
        torchmn.create_communicator(timeout=timeout)


def test_torchmn_timeout_variable_is_checked(monkeypatch):
    from torchmn.communicators import world
    for bad in ("abc", "5s", "0", "-3", "inf"):
        monkeypatch.setenv("TORCHMN_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"TORCHMN_TIMEOUT='{bad}' is not a positive number of seconds"):
            world.default_timeout()
    monkeypatch.setenv("TORCHMN_TIMEOUT", "7.5")
    assert world.default_timeout() == datetime.timedelta(seconds=7.5)


def test_tcp_init_method_under_a_launcher(tmp_path):
    """init_method='tcp://...' chosen by the script works under torchmn run and torchrun, whose
    agent-store variable would otherwise make rank 0 a client of a store nobody hosts."""
    port = free_port()
    script = tmp_path / "job.py"
    script.write_text("import sys, torch, torchmn\n"
                      f"comm = torchmn.create_communicator(init_method='tcp://127.0.0.1:{port}', timeout=20)\n"
                      "sys.stdout.write(f'SUM {int(comm.allreduce(torch.ones(1)).item())}\\n')  # one write\n"
                      "sys.stdout.flush()\n"
                      "comm.finalize()\n")
    for launcher in ("torchmn", "torchrun"):
        out = run_job(script, [], np=2, launcher=launcher, timeout=60).stdout
        assert out.count("SUM 2") == 2, (launcher, out)


@pytest.mark.parametrize("launcher", ["torchmn", "torchrun"])
def test_a_rank_that_never_joins_is_named_under_a_launcher(tmp_path, launcher):
    """Rank 1 exits 0 before create_communicator (the launcher lets the others run): rank 0's
    set-up timeout names rank 1, through the launcher's own store, not just torch's store key."""
    script = tmp_path / "absent.py"
    script.write_text("import os, sys, torchmn\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit(0)\n"
                      "try:\n"
                      "    torchmn.create_communicator(timeout=5)\n"
                      "except RuntimeError as e:\n"
                      "    sys.stdout.write(f'RAISED {e}\\n')\n")
    out = run_job(script, [], np=2, launcher=launcher, timeout=60).stdout
    assert "Rank(s) 1 never reached create_communicator" in out, out


def test_timeout_applies_to_a_process_group_the_script_made(tmp_path):
    """create_communicator(timeout=...) over the script's own process group: shared-memory waits
    use it too (they used the 600 s default)."""
    script = tmp_path / "job.py"
    script.write_text(
        "import datetime, os, time, torch, torch.distributed as dist, torchmn\n"
        "dist.init_process_group('gloo', init_method='env://', timeout=datetime.timedelta(seconds=60))\n"
        "comm = torchmn.create_communicator('hierarchical', timeout=3)\n"
        "comm.allreduce(torch.ones(3))\n"
        "if comm.rank == 1:\n"
        "    time.sleep(15)\n"
        "    os._exit(0)\n"
        "start = time.monotonic()\n"
        "try:\n"
        "    comm.allreduce(torch.ones(3))\n"
        "except torchmn.CollectiveTimeoutError as e:\n"
        "    print(f'RAISED after {time.monotonic() - start:.0f} s', flush=True)\n"
        "os._exit(0)\n")
    out = run_job(script, [], np=2, timeout=60).stdout
    match = re.search(r"RAISED after (\d+) s", out)
    # 3 s, then up to watch.GRACE_S for the other rank to say where it is (6 s on an idle machine,
    # 10 s under four test workers on 2 cores): far from the group's own 60 s either way.
    assert match and int(match.group(1)) < 30, out


def test_stale_file_rendezvous_is_refused(tmp_path):
    """A file:// rendezvous left by a crashed job is refused with a clear message, not joined."""
    path = tmp_path / "rendezvous"
    code = ("import os, sys, torch, torchmn\n"
            f"comm = torchmn.create_communicator(init_method='file://{path}')\n"
            "comm.allreduce(torch.ones(1))\n"
            "if sys.argv[1] == 'crash':\n"
            "    os._exit(0)\n"
            "comm.finalize()\n")
    script = tmp_path / "job.py"
    script.write_text(code)
    run_job(script, ["crash"], np=2, timeout=60)
    assert path.exists()  # a job that dies leaves its file behind
    proc = run_job(script, ["clean"], np=2, timeout=60, check=False)
    assert proc.returncode != 0
    assert "left over from an earlier job" in proc.stderr and f"rm {path}" in proc.stderr, proc.stderr
    path.unlink()
    run_job(script, ["clean"], np=2, timeout=60)


@pytest.mark.parametrize("name,where", [("flat", "collective"), ("naive", "optimizer"), ("naive", "split"),
                                        ("hierarchical", "collective"), ("hierarchical", "optimizer")])
def test_a_rank_that_stops_calling_collectives_is_named(name, where, tmp_path):
    """Within the timeout, the waiting ranks raise an error naming the rank that never came
    (through torch.distributed: from the rendezvous store; inside a node: from shared memory), in
    a communicator split off the world too (its groups wait as long as the world's)."""
    out = run_job(WORKERS / "hang_jobs.py", [name, where], np=3, timeout=60,
                  env={"HANG_DONE_DIR": str(tmp_path)}).stdout
    named = [line for line in out.splitlines() if "NAMED" in line]
    assert len(named) == 2, out  # ranks 0 and 2
    for line in named:
        waited = float(re.search(r"NAMED after ([0-9.]+) s", line).group(1))
        assert waited < 15, line  # the 5 s timeout and a grace period, well before the sleeper's 20 s
        if name == "hierarchical":
            assert "rank 1 (node 0" in line and "did not arrive within 5 s" in line, line
        else:
            assert "rank 1 (" in line and "never called it within the timeout" in line and "Waiting for them: rank(s) 0, 2" in line, line


@pytest.mark.parametrize("name", ["naive", "flat", "hierarchical"])
def test_ranks_in_different_collectives_are_named(name):
    """Rank 0 in a barrier, the others in an allreduce: every rank raises at once, naming what each
    called (the barrier is a call check of its own; over TCP on naive and flat, through shared
    memory on hierarchical)."""
    out = run_job(WORKERS / "hang_jobs.py", [name, "kinds", "-1"], np=3, timeout=60).stdout
    named = sorted(line for line in out.splitlines() if "NAMED" in line)
    assert len(named) == 3, out
    for line in named:
        assert "collective differs: rank 0: barrier, rank 1: allreduce, rank 2: allreduce" in line, line


def test_a_finalized_communicator_refuses_collectives():
    comm = torchmn.create_communicator()  # a world of one here
    comm.finalize()
    for call in (lambda: comm.allreduce(torch.ones(1)), lambda: comm.bcast_obj(1), comm.barrier):
        with pytest.raises(RuntimeError, match="on a communicator that was finalized"):
            call()


def test_a_split_finalized_after_its_world_is_left_alone(tmp_path):
    """A split communicator finalized only after the world it was split from was finalized and a
    new one set up: its groups belong to the world left, so they are dropped (not kept for the new
    world's splits), and the new world splits as usual."""
    script = tmp_path / "job.py"
    script.write_text("import torch, torchmn\n"
                      "comm = torchmn.create_communicator()\n"
                      "sub = comm.split(color=comm.rank % 2, key=comm.rank)\n"
                      "comm.finalize()\n"
                      "again = torchmn.create_communicator()\n"
                      "sub.finalize()\n"
                      "half = again.split(color=again.rank % 2, key=again.rank)\n"
                      "assert half.allreduce(torch.ones(1)).item() == half.size\n"
                      "print('SPLIT AGAIN', flush=True)\n")
    assert run_job(script, [], np=2, timeout=60).stdout.count("SPLIT AGAIN") == 2


def test_ranks_asking_for_different_algorithms_are_told_at_once(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import sys, torchmn\n"
                      "name = sys.argv[1 + int(__import__('os').environ['RANK'])]\n"
                      "try:\n"
                      "    torchmn.create_communicator(name, timeout=30)\n"
                      "except torchmn.CollectiveMismatchError as e:\n"
                      "    sys.stdout.write(f'MISMATCH {e}\\n')\n")
    for names in (["naive", "flat"], ["hierarchical", "flat"]):
        start = time.monotonic()
        out = run_job(script, names, np=2, timeout=60).stdout
        assert out.count("MISMATCH") == 2 and f"rank 0: {names[0]!r}, rank 1: {names[1]!r}" in out, out
        assert time.monotonic() - start < 20, out


def test_a_recv_that_times_out_names_the_sender(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import sys, time, torch, torchmn\n"
                      "comm = torchmn.create_communicator('flat', timeout=3)\n"
                      "comm.allreduce(torch.ones(1))\n"
                      "if comm.rank == 1:\n"
                      "    time.sleep(8)\n"
                      "else:\n"
                      "    for recv in (lambda: comm.recv(1), lambda: comm.recv_obj(source=1, tag=5)):\n"
                      "        try:\n"
                      "            recv()\n"
                      "        except torchmn.CollectiveTimeoutError as e:\n"
                      "            sys.stdout.write(f'NAMED {e}\\n')\n")
    out = run_job(script, [], np=2, timeout=60).stdout
    assert "NAMED recv from rank 1 (" in out and "did not make the matching send with the same tag" in out, out
    assert "NAMED recv_obj from rank 1 (" in out and "matching send_obj" in out, out


AGAIN = """
import faulthandler, torch, torchmn
faulthandler.dump_traceback_later(40, exit=True)  # a hang fails at once, with the stacks
for attempt in range(4):
    comm = torchmn.create_communicator("flat", timeout=20)
    assert comm.allreduce(torch.ones(2)).tolist() == [comm.size] * 2
    assert comm.allgather_obj(attempt) == [attempt] * comm.size
    comm.finalize()
print("AGAIN OK", flush=True)
"""


@pytest.mark.parametrize("launcher", ["torchmn", "torchrun"])
def test_a_new_world_after_finalize(launcher, tmp_path):
    """finalize(), then create_communicator() again, as the error on a finalized communicator advises:
    under a launcher that hosts the store, the new world must not meet the first one's keys there
    (which would hang it)."""
    script = tmp_path / "again.py"
    script.write_text(AGAIN)
    out = run_job(script, [], np=2, launcher=launcher, timeout=90).stdout
    assert out.count("AGAIN OK") == 2, out


@pytest.mark.parametrize("launcher", ["torchmn", "forked"])
def test_a_second_world_names_the_rank_that_never_came(launcher, tmp_path):
    """After finalize(), rank 1 leaves and rank 0 sets up a world again: its error names rank 1 only
    (the first world's keys and arrivals in the job's store, the launcher's or rank 0's own, must not
    count, nor hide rank 0's own)."""
    script = tmp_path / "second.py"
    # The first world waits as long as a loaded machine needs to start both ranks; the second
    # world's short wait is the one that expires.
    script.write_text("import sys, torchmn\n"
                      "comm = torchmn.create_communicator(timeout=120)\n"
                      "rank = comm.rank\n"
                      "comm.finalize()\n"
                      "if rank == 1:\n"
                      "    sys.exit(0)\n"
                      "try:\n"
                      "    torchmn.create_communicator(timeout=5)\n"
                      "except RuntimeError as e:\n"
                      "    print('RAISED', e, flush=True)\n")
    out = run_job(script, [], np=2, launcher=launcher, timeout=60).stdout
    assert "Rank(s) 1 never reached create_communicator" in out, out


COLLECTIVES = ("bcast", "gather", "allgather", "scatter", "alltoall", "allreduce", "allreduce_", "bcast_obj",
               "gather_obj", "allgather_obj", "scatter_obj", "allreduce_obj", "barrier", "split", "bcast_data",
               "bcast_tensors", "multi_node_mean_grad", "allreduce_flat", "reduce_scatter_flat", "allgather_flat")
POINT_TO_POINT = ("send", "recv", "send_obj", "recv_obj")


@pytest.mark.parametrize("algorithm", ["naive", "flat", "hierarchical"])
def test_every_collective_of_every_algorithm_is_watched(algorithm):
    """Each collective is numbered and its lost peers named (watch.py), also where an algorithm
    overrides it: the decorators are written at each definition, so a forgotten one fails here."""
    from torchmn.communicators.registry import ALGORITHMS

    cls = ALGORITHMS[algorithm]
    unwatched = [name for name in COLLECTIVES + POINT_TO_POINT if not getattr(getattr(cls, name), "watched", False)]
    assert not unwatched, f"{cls.__name__}: not decorated with watch.collective / watch.point_to_point: {unwatched}"
