"""Parsing helpers that every launcher's environment class shares.

Every ``read`` follows two rules: ``MASTER_ADDR`` / ``MASTER_PORT`` from the environment win over
anything derived, and a value that is not an integer or does not fit (rank >= size, ...) raises
ValueError naming the variable, its value and what to do (``fix``).
"""
from __future__ import annotations

import zlib
from typing import Mapping, Optional, Sequence, Tuple

from torchmn.environments.base import LaunchEnvironment
from torchmn.errors import TorchmnRuntimeError, TorchmnValueError

LOCALHOST = "127.0.0.1"

# The variable that carries torchmn run's job token to every rank (and to what the rank starts): the
# launcher's store admits only processes started with it (torchmn.run.store.auth).
JOB_TOKEN = "TORCHMN_JOB_TOKEN"

# torchrun's default port, used when a launcher gives nothing to derive one from.
DEFAULT_PORT = 29500

# Derived ports fall in [PORT_BASE, PORT_BASE + PORT_SPAN) = 20000-31999: above the common service
# ports and below Linux's ephemeral range (32768-60999), where an outgoing connection of any other
# program (gloo opens many) may hold the number and make the rendezvous fail with "address in use".
PORT_BASE = 20000
PORT_SPAN = 12000


def text_port(job_id: str) -> int:
    """A port derived from an opaque job id string: ``20000 + crc32(job_id) % 12000``.

    crc32 rather than ``hash()``, which Python salts per process, so every rank gets the same port.

    Args:
        job_id: the launcher's job id, the same on every rank of one job.

    Returns:
        A port in 20000-31999.

    Example::

        >>> text_port("2089418753")
        25854
    """
    return PORT_BASE + zlib.crc32(job_id.encode()) % PORT_SPAN


def read_int(env: Mapping[str, str], name: str, fix: str) -> int:
    """The integer in variable ``name``.

    Args:
        env: the environment.
        name: the variable.
        fix: what the user can do, appended to the error.

    Returns:
        The value.

    Raises:
        ValueError: the variable is not set, or not an integer.

    Example::

        >>> read_int({"RANK": " 3"}, "RANK", "set it")
        3
    """
    if name not in env:
        raise TorchmnValueError(f"{name} is not set; {fix}")
    value = env[name]
    try:
        return int(value.strip())
    except ValueError:
        raise TorchmnValueError(f"{name}={value!r} is not an integer; {fix}") from None


def optional_int(env: Mapping[str, str], name: str, fix: str) -> Optional[int]:
    """The integer in variable ``name``, for a variable a launcher may leave out.

    Args:
        env: the environment.
        name: the variable.
        fix: what the user can do, appended to the error.

    Returns:
        The value, or None when the variable is unset or blank.

    Raises:
        ValueError: the value is not an integer, or is negative.

    Example::

        >>> optional_int({"GROUP_RANK": ""}, "GROUP_RANK", "set it") is None
        True
    """
    if not env.get(name, "").strip():
        return None
    number = read_int(env, name, fix)
    if number < 0:
        raise TorchmnValueError(f"{name}={env[name]!r} is negative; {fix}")
    return number


def check_place(env: Mapping[str, str], rank: tuple, size: tuple, local_rank: tuple, local_size: tuple,
                fix: str) -> None:
    """Check that a rank, size, local rank and local size fit together.

    Args:
        env: the environment (errors show each variable's value as set).
        rank, size, local_rank, local_size: each a (variable name, value) pair.
        fix: what the user can do, appended to the error.

    Raises:
        ValueError: a size below 1, a rank outside its size, or more local ranks than ranks.

    Example::

        >>> check_place({}, ("RANK", 2), ("WORLD_SIZE", 2), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1), "fix it")
        Traceback (most recent call last):
        ValueError: RANK=2 is outside 0..1 given by WORLD_SIZE=2; fix it
    """
    def shown(item: tuple) -> str:
        name, value = item
        return f"{name}={env.get(name, value)!r}"

    if size[1] < 1:
        raise TorchmnValueError(f"{shown(size)} must be at least 1; {fix}")
    if local_size[1] < 1:
        raise TorchmnValueError(f"{shown(local_size)} must be at least 1; {fix}")
    if not 0 <= rank[1] < size[1]:
        raise TorchmnValueError(f"{shown(rank)} is outside 0..{size[1] - 1} given by {shown(size)}; {fix}")
    if not 0 <= local_rank[1] < local_size[1]:
        raise TorchmnValueError(f"{shown(local_rank)} is outside 0..{local_size[1] - 1} given by "
                                f"{shown(local_size)}; {fix}")
    if local_size[1] > size[1]:
        raise TorchmnValueError(f"{shown(local_size)} is larger than {shown(size)}; {fix}")


def master_addr(env: Mapping[str, str], derived: Optional[str], size: int, local_size: int,
                source: str, hint: str, spanning_addr: Optional[str] = None) -> str:
    """Where rank 0 runs: ``MASTER_ADDR``, else ``derived``, else 127.0.0.1 when every rank is local,
    else ``spanning_addr``.

    Args:
        env: the environment.
        derived: what the launcher's own variables say, if anything.
        size, local_size: the ranks of the job, and of this node.
        source: the launcher's name, for the error.
        hint: how to tell torchmn the address, for the error.
        spanning_addr: what stands for the address when the ranks span several nodes and nothing
            says it (MPI with mpi4py: ``MPI_RENDEZVOUS``), if anything.

    Returns:
        The rendezvous address.

    Raises:
        RuntimeError: nothing says where rank 0 runs, the ranks span several nodes and no
            ``spanning_addr`` is given.

    Example::

        >>> master_addr({}, None, 2, 2, "mpich", "export MASTER_ADDR")
        '127.0.0.1'
    """
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if derived:
        return derived
    if local_size == size:
        return LOCALHOST
    if spanning_addr:
        return spanning_addr
    raise TorchmnRuntimeError(f"MASTER_ADDR is not set and the {size} ranks ({source}) span several nodes, so "
                              f"torchmn cannot tell where rank 0 runs; {hint}")


def master_port(env: Mapping[str, str], derived: Optional[int]) -> Optional[int]:
    """The rendezvous port: ``MASTER_PORT``, else ``derived``.

    Args:
        env: the environment.
        derived: what the launcher's own variables give, if anything.

    Returns:
        The port, or None when neither gives one.

    Raises:
        ValueError: ``MASTER_PORT`` is not a port number.

    Example::

        >>> master_port({"MASTER_PORT": "29511"}, 24074), master_port({}, 24074)
        (29511, 24074)
    """
    value = env.get("MASTER_PORT", "").strip()
    if not value:
        return derived
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise TorchmnValueError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number (1-65535); "
                                f"unset it or set it to a free TCP port")
    return port


def first_present(env: Mapping[str, str], names: Sequence[str]) -> str:
    """Which of several names of one variable is set.

    Args:
        env: the environment.
        names: the names, the main one first.

    Returns:
        The first of ``names`` that is set, else the first name (so errors name the main variable).

    Example::

        >>> first_present({"SLURM_JOBID": "7"}, ("SLURM_JOB_ID", "SLURM_JOBID"))
        'SLURM_JOBID'
    """
    return next((name for name in names if env.get(name)), names[0])


def read_ranks(env: Mapping[str, str], source: str, names: Tuple[str, str, str, str], fix: str, hint: str,
               node_rank_name: Optional[str] = None, derived_port: Optional[int] = None,
               spanning_addr: Optional[str] = None) -> LaunchEnvironment:
    """Read a launcher that names rank, size, local rank and local size in four variables.

    Args:
        env: the environment.
        source: the launcher's name (``LaunchEnvironment.source``).
        names: the variables of rank, size, local rank and local size, in that order.
        fix: what the user can do about a bad value.
        hint: how to tell torchmn the rendezvous address when nothing says it.
        node_rank_name: the variable of the node index, if the launcher sets one.
        derived_port: the port when ``MASTER_PORT`` is not set.
        spanning_addr: the address when the ranks span several nodes and ``MASTER_ADDR`` is not
            set (see ``master_addr``); None: that is an error.

    Returns:
        This process's place in the job.

    Raises:
        ValueError: a variable is missing, malformed or does not fit the others.
        RuntimeError: the rendezvous address cannot be known.

    Example::

        >>> read_ranks({"R": "1", "S": "2", "LR": "1", "LS": "2"}, "x", ("R", "S", "LR", "LS"), "", "").describe()
        'x: rank 1/2, local 1/2, node None, rendezvous 127.0.0.1:None'
    """
    rank, size, local_rank, local_size = (read_int(env, name, fix) for name in names)
    node_rank = optional_int(env, node_rank_name, fix) if node_rank_name else None
    check_place(env, (names[0], rank), (names[1], size), (names[2], local_rank), (names[3], local_size), fix)
    addr = master_addr(env, None, size, local_size, source, hint, spanning_addr)
    return LaunchEnvironment(rank, size, local_rank, local_size, node_rank, addr,
                             master_port(env, derived_port), source)
