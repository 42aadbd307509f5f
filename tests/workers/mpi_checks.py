"""Checks run inside every rank of an mpirun job across hosts without MASTER_ADDR, whose ranks
learn rank 0's address over MPI (mpi4py): see tests/test_mpi_hosts.py.

Usage: python mpi_checks.py CHECK [CHECK ...]   (or "all")
"""
import os
import socket
import sys

import torch

import torchmn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_runner import run_checks  # noqa: E402


def check_collectives(comm):
    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
    total = comm.allreduce(torch.tensor([float(comm.rank + 1)]))
    assert total.item() == comm.size * (comm.size + 1) / 2, total
    hosts = comm.allgather_obj(socket.gethostname())
    assert hosts == sorted(hosts) and len(set(hosts)) > 1, hosts  # ranks fill the hosts in order
    assert (comm.inter_size, comm.intra_size) == (len(set(hosts)), hosts.count(socket.gethostname())), hosts
    got = comm.bcast(torch.arange(6.0) * (comm.rank + 1), root=comm.size - 1)
    assert torch.equal(got, torch.arange(6.0) * comm.size), got
    if comm.rank == 0:
        print(f"TOPOLOGY size={comm.size} inter_size={comm.inter_size} intra_size={comm.intra_size}", flush=True)


def check_mpi_left_finalized(comm):
    # torchmn imported mpi4py.MPI (so importing it here initialises nothing) and finalized MPI
    # after the broadcast; gloo was told the interface that reaches rank 0.
    assert "mpi4py.MPI" in sys.modules
    from mpi4py import MPI

    assert MPI.Is_finalized()
    assert os.environ.get("GLOO_SOCKET_IFNAME") == "eth0", os.environ.get("GLOO_SOCKET_IFNAME")


def check_world_again(comm):
    # A world set up again after finalize(): MPI is gone, the first broadcast's store serves it.
    comm.finalize()
    again = torchmn.create_communicator()
    assert again.allreduce(torch.ones(2)).tolist() == [again.size] * 2
    assert again.allgather_obj(again.rank) == list(range(again.size))
    again.finalize()


if __name__ == "__main__":
    run_checks(globals())
