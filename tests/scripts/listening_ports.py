"""A torchmn job that prints, per rank, every address its process came to listen on once the
communicator has run a collective (the store on rank 0, gloo's pairs on every rank). Sockets the
process was started with are left out: MPICH's process manager hands every rank one of its own."""
import os

import psutil


def listening():
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


inherited = listening()

import torch  # noqa: E402

import torchmn  # noqa: E402

comm = torchmn.create_communicator()
comm.allreduce(torch.ones(1))
# One write, so that two ranks' lines do not interleave where a launcher passes output on unprefixed.
os.write(1, f"LISTENING {comm.rank} {sorted({ip for ip, _ in listening() - inherited})}\n".encode())
comm.barrier()
