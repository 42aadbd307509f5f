"""The ways PyTorch's guides start ranks without a launcher of ours, as examples/by_hand/ writes
them: torch.multiprocessing.spawn, `python -m torch.distributed.launch` (which passes
`--local-rank`), and one process per rank with an explicit `tcp://` rendezvous, rank and size.
(Hand-set `env://` variables: tests/test_environments.py.)"""
import os
import re
import subprocess
import sys

import pytest
from jobs import REPO, clean_env
from ports import free_port

import torchmn

EXAMPLES = REPO / "examples" / "by_hand"
TIMEOUT = 120


def _run(argv):
    proc = subprocess.run(argv, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_mp_spawn_recipe():
    out = _run([sys.executable, str(EXAMPLES / "spawn.py"), "--nprocs", "2"])
    lines = sorted(re.findall(r"rank (\d)/2 \(local (\d)/2\): sum 3", out))
    assert lines == [("0", "0"), ("1", "1")], out


def test_torch_distributed_launch_recipe():
    out = _run([sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "2",
                str(EXAMPLES / "launch_local_rank.py")])
    lines = sorted(re.findall(r"rank (\d)/2 \(--local-rank (\d)\): sum 3", out))
    assert lines == [("0", "0"), ("1", "1")], out


def test_tcp_init_method_with_rank_and_size():
    """One process per rank, started by hand: the ranks find they share this host (from the host
    names), and the thread budget divides its cores between them."""
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(EXAMPLES / "tcp_init.py"), "--init-method", address,
                               "--rank", str(r), "--size", "2"], cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out + err
        outs.append(out)
    budget = max(1, len(os.sched_getaffinity(0)) // 2)
    for r, out in enumerate(outs):
        assert f"rank {r}/2 (local {r}/2, threads {budget}): sum 3" in out, out


@pytest.mark.parametrize("kwargs, words", [
    ({"rank": 0}, "rank and size go together, with init_method"),
    ({"rank": 2, "size": 2, "init_method": "tcp://127.0.0.1:1"}, "rank=2 is outside 0..1 (size=2)"),
    ({"rank": 0, "size": 2}, "rank and size go together, with init_method"),
], ids=["rank_alone", "rank_outside", "no_init_method"])
def test_explicit_rank_and_size_are_checked(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        torchmn.create_communicator(**kwargs)
