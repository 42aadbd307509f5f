"""torchmn.lightning: a Lightning Trainer with TorchmnStrategy in real multi-process jobs, against
Lightning's own DDPStrategy in the same job (see tests/workers/lightning_checks.py)."""

import pytest

from jobs import WORKERS, assert_check_passed, check_job_output, run_job, run_one_process

CHECKS = WORKERS / "lightning_checks.py"
ALL = ("matches_lightnings_ddp", "collectives_go_through_the_communicator",
       "devices_that_differ_from_the_launcher_are_refused", "bad_compression_refused_at_once",
       "sync_batchnorm_on_the_cpu")


@pytest.mark.timeout(240)  # the first test runs the whole job
@pytest.mark.check_job("lightning")
@pytest.mark.parametrize("check", ALL)
def test_lightning_strategy(check, request):
    proc = check_job_output(request, lambda checks: run_job(CHECKS, list(checks), np=2, timeout=240,
                                                            env={"TORCHMN_TIMEOUT": "60"}, check=False))
    assert_check_passed(proc, check)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["plain python", "np 1"])
def test_lightning_strategy_in_a_world_of_one(how):
    """`python train.py` alone, or one rank under a launcher: Lightning's DDP needs a process group
    even alone, which the strategy makes without opening a port."""
    proc = run_one_process(CHECKS, ["world_of_one"], timeout=150) if how == "plain python" else \
        run_job(CHECKS, ["world_of_one"], np=1, timeout=150, check=False)
    assert proc.returncode == 0 and "PASS world_of_one" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_node_rank_under_mpi_is_the_communicators_node(monkeypatch):
    """MPI names no nodes: `mpirun --map-by node` puts rank 1 of 2 x 2 on the second node, which
    rank // local size does not tell; the communicator (ranks grouped by host) does."""
    import types

    from torchmn.lightning import TorchmnEnvironment

    for name, value in {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    env = TorchmnEnvironment()
    assert (env.global_rank(), env.local_rank(), env.node_rank()) == (1, 0, 0)  # the launcher's guess
    env.learn_nodes(types.SimpleNamespace(inter_rank=1))  # what create_communicator found
    assert env.node_rank() == 1


@pytest.mark.parametrize("argument", ["ddp_comm_hook", "ddp_comm_wrapper", "ddp_comm_state"])
def test_strategy_refuses_ddp_hook_arguments_it_would_ignore(argument):
    """DDPStrategy's hook arguments would be dropped silently (the strategy registers torchmn's
    hook): refused at once, naming compression= instead."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

    from torchmn.lightning import TorchmnStrategy

    with pytest.raises(ValueError, match=f"compression=.* instead of {argument}="):
        TorchmnStrategy(**{argument: fp16_compress_wrapper})
