"""Rank 0's rendezvous address and port, sent to the other ranks over MPI itself (mpi4py).

``mpirun -np 8 -H a:4,b:4 python train.py`` tells each rank its rank and size, but not where rank 0
runs. Where mpi4py is installed, rank 0 opens the job's store on a port its system picks, and one
MPI broadcast at set-up tells every rank the address and port, as Horovod and ChainerMN need no
address either. The communication itself then goes over gloo or NCCL, as everywhere else.

Only ``create_communicator`` comes here (``detect_environment`` merely checks that mpi4py is
installed, without importing it): importing ``mpi4py.MPI`` initialises MPI. What that costs:

* ``MPI_Init`` waits for every rank of the job to call it, without a timeout (that is MPI's own
  start-up exchange). A rank that exits before it makes mpirun end the job.
* MPI is finalized again right after the broadcast, when torchmn initialised it: its progress
  threads and network connections go, and DataLoader workers forked later raise no warning
  (Open MPI warns of a fork only while MPI is initialised, where its InfiniBand transport is in
  use). The ranks exit as plain processes; mpirun still sees their exit codes and ends the job
  when one fails. MPI cannot be initialised twice, so a script that uses mpi4py itself imports
  ``mpi4py.MPI`` before ``create_communicator``: torchmn then uses that MPI and leaves it
  initialised.
* torchmn asks for ``MPI_THREAD_FUNNELED`` (only the thread that initialised MPI calls it) unless
  ``MPI4PY_RC_THREAD_LEVEL`` says otherwise: mpi4py's default, ``MULTIPLE``, is not needed for one
  broadcast and makes some of Open MPI's transports warn or step aside.

Example (what ``create_communicator`` does on every rank)::

    >>> store, init_method = rendezvous_store(detect_environment(), datetime.timedelta(seconds=600))
    >>> init_method
    'tcp://10.1.0.11:43107'
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import Mapping, Optional, Tuple

from torchmn import network
from torchmn.environments.base import LaunchEnvironment
from torchmn.environments.mpi import MPI_HINT
from torchmn.errors import TorchmnError

# Seconds a rank tries to open a TCP connection to rank 0's store before saying it cannot reach
# it: rank 0 listens before it broadcasts, so a reachable store answers at once.
REACH_SECONDS = 10.0

_store = None  # the job's store (rank 0 hosts it), kept for a world set up again after finalize()
_target: Optional[Tuple[str, int]] = None  # its address and port
_worlds = 0  # worlds set up on it: each gets keys of its own


class MPIRendezvousError(TorchmnError, RuntimeError):
    """Rank 0's address could not be sent over MPI, or the rank could not use it; the message says
    which rank and host, and what to do."""


def rendezvous_store(env: LaunchEnvironment, timeout: datetime.timedelta):
    """The job's store, with rank 0's address and port sent over MPI (see the module's text).

    The first call broadcasts (every rank of the job must make it); later calls, for a world set
    up again after ``finalize()``, reuse the store under keys of their own.

    Args:
        env: this rank's place; ``master_port`` is the port rank 0 must use, None for any.
        timeout: how long a rank waits for the store (as torch's ``TCPStore``).

    Returns:
        ``(store, init_method)``: a store for ``torch.distributed.init_process_group`` and
        ``tcp://ADDR:PORT`` naming it, for messages.

    Raises:
        MPIRendezvousError: mpi4py cannot be imported or runs another MPI than the launcher's,
            rank 0 cannot open the store or find an address, or this rank cannot reach it.

    Example::

        >>> store, init_method = rendezvous_store(env, datetime.timedelta(seconds=600))
    """
    import torch.distributed as dist

    global _store, _target, _worlds
    if _store is None:
        _store, _target = _exchange(env, timeout)
    _worlds += 1
    host = f"[{_target[0]}]" if ":" in _target[0] else _target[0]  # IPv6
    return dist.PrefixStore(f"torchmn/mpi/world{_worlds}/", _store), f"tcp://{host}:{_target[1]}"


def offered_address(environ: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """The address rank 0 offers the other hosts, and why that one.

    In this order: the interface named by ``GLOO_SOCKET_IFNAME``, else by ``NCCL_SOCKET_IFNAME``
    (its first name or prefix; a ``^`` exclusion list names none); the interface of the default
    route; the address this host's name resolves to, when it is one of this host's and not
    loopback; the first address of an interface that is up (not loopback, not link-local).

    Args:
        environ: the environment (default: ``os.environ``).

    Returns:
        ``(address, reason)``, the reason in words for messages (``"eth0, the interface of the
        default route"``).

    Raises:
        MPIRendezvousError: a variable names no interface of this host, or no address is found.

    Example::

        >>> offered_address({"GLOO_SOCKET_IFNAME": "lo"})
        ('127.0.0.1', 'lo, named by GLOO_SOCKET_IFNAME')
    """
    environ = os.environ if environ is None else environ
    named = _named_interface(environ)
    if named is not None:
        interface, variable = named
        try:
            return network.interface_address(interface), f"{interface}, named by {variable}"
        except network.NetworkError:
            raise MPIRendezvousError(
                f"rank 0 on host {socket.gethostname()}: {variable} names {interface}, which has no IP address "
                f"here; set it on every rank to the interface that reaches the other hosts") from None
    interface = default_route_interface()
    if interface is not None:
        try:
            return network.interface_address(interface), f"{interface}, the interface of the default route"
        except network.NetworkError:
            pass  # an interface without an address: look further
    try:
        by_name = socket.gethostbyname(socket.gethostname())
    except OSError:
        by_name = None
    if by_name and not network.is_loopback(by_name, resolve=False) and by_name in network.local_addresses():
        return by_name, f"what the host name {socket.gethostname()!r} resolves to"
    found = _first_usable_address()
    if found is not None:
        return found
    raise MPIRendezvousError(
        f"rank 0 on host {socket.gethostname()} found no address that other hosts could reach it on: no "
        f"default route, its host name resolves to {by_name or 'nothing'}, and no interface other than "
        f"loopback has an address. Name the interface that reaches the other hosts on every rank "
        f"(`mpirun -x GLOO_SOCKET_IFNAME=eth0`), or export MASTER_ADDR and MASTER_PORT")


def default_route_interface() -> Optional[str]:
    """The interface of this host's IPv4 default route (the lowest metric), from /proc/net/route.

    Returns:
        Its name, or None without a default route (or without /proc).

    Example::

        >>> default_route_interface()
        'eth0'
    """
    try:
        with open("/proc/net/route") as f:
            rows = [line.split() for line in f.read().splitlines()[1:]]
    except OSError:
        return None
    routes = []
    for row in rows:
        # Iface Destination Gateway Flags RefCnt Use Metric Mask ...; flag 1 is RTF_UP.
        if len(row) >= 8 and row[1] == "00000000" and row[7] == "00000000" and int(row[3], 16) & 1:
            routes.append((int(row[6]), row[0]))
    return min(routes)[1] if routes else None


def _named_interface(environ: Mapping[str, str]) -> Optional[Tuple[str, str]]:
    """``(interface, variable)`` for the interface GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME names."""
    import psutil

    interfaces = psutil.net_if_addrs()
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = environ.get(variable, "").strip()
        if not value or value.startswith("^"):  # NCCL's "^name" lists interfaces not to use
            continue
        # gloo takes exact names; NCCL takes name prefixes, or exact names after "=".
        prefixes = variable == "NCCL_SOCKET_IFNAME" and not value.startswith("=")
        for wanted in (name.strip() for name in value.lstrip("=").split(",")):
            matches = sorted(name for name in interfaces if name == wanted or (prefixes and name.startswith(wanted)))
            if wanted and matches:
                return (wanted if wanted in matches else matches[0]), variable
        raise MPIRendezvousError(
            f"rank 0 on host {socket.gethostname()}: {variable}={value!r} names no interface of this host "
            f"(it has {', '.join(sorted(interfaces))}); set it on every rank to the interface that reaches "
            f"the other hosts, or unset it")
    return None


def _first_usable_address() -> Optional[Tuple[str, str]]:
    import ipaddress

    import psutil

    stats = psutil.net_if_stats()
    for family in (socket.AF_INET, socket.AF_INET6):
        for name, addresses in sorted(psutil.net_if_addrs().items()):
            if name in stats and not stats[name].isup:
                continue
            for address in addresses:
                if address.family != family:
                    continue
                ip = ipaddress.ip_address(address.address.split("%", 1)[0])
                if not (ip.is_loopback or ip.is_link_local):
                    return str(ip), f"{name}, the first interface with an address"
    return None


def _exchange(env: LaunchEnvironment, timeout: datetime.timedelta):
    """Rank 0 opens the store and broadcasts where it is; the others receive it and connect."""
    import torch.distributed as dist

    host = socket.gethostname()
    store = failure = None
    if env.rank == 0:
        # Opened before MPI starts, so that the broadcast carries the port the store really has:
        # no window in which another program could take a port found free.
        try:
            address, reason = offered_address()
            store = dist.TCPStore(address, env.master_port or 0, env.size, True, timeout=timeout,
                                  wait_for_workers=False, multi_tenant=True)
            message = {"host": host, "addr": address, "port": store.port, "reason": reason}
        except (RuntimeError, ValueError, OSError) as e:
            failure = e
            if env.master_port and "in use" in str(e).lower():
                failure = MPIRendezvousError(
                    f"rank 0 on host {host}: MASTER_PORT={env.master_port} is in use, by another job or "
                    f"program; export another free port, or unset MASTER_PORT and torchmn picks one")
            message = {"host": host, "error": str(failure)}
    message = _broadcast(env, message if env.rank == 0 else None)
    if failure is not None:
        raise failure if isinstance(failure, MPIRendezvousError) else MPIRendezvousError(
            f"rank 0 on host {host}: could not open the job's rendezvous store: {failure}") from failure
    if "error" in message:
        raise MPIRendezvousError(f"rank {env.rank} on host {host}: rank 0 (on host {message['host']}) could not "
                                 f"set up the job's rendezvous, so neither can this rank: {message['error']}")
    address, port = message["addr"], message["port"]
    if env.rank == 0:
        local = address
    else:
        local = _reach(env, message)
        store = dist.TCPStore(address, port, env.size, False, timeout=timeout, wait_for_workers=False)
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo would otherwise take the address of this host's name, often 127.0.1.1 on Debian:
        # the interface that reaches rank 0 reaches the other hosts too.
        interface = network.interface_of(local)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    return store, (address, port)


def _reach(env: LaunchEnvironment, message: dict) -> str:
    """Connect once to rank 0's store, to say at once when it cannot be reached (torch's client
    would retry for the whole timeout); returns this rank's address on that connection."""
    address, port = message["addr"], message["port"]
    try:
        with socket.create_connection((address, port), timeout=REACH_SECONDS) as connection:
            return connection.getsockname()[0].split("%", 1)[0]
    except OSError as e:
        raise MPIRendezvousError(
            f"rank {env.rank} on host {socket.gethostname()} cannot reach rank 0's rendezvous store at "
            f"{address}:{port} (rank 0 on host {message['host']} offered {message['reason']}): "
            f"{e.strerror or e}. Name the interface of rank 0's host that the other hosts reach on every rank "
            f"(`mpirun -x GLOO_SOCKET_IFNAME=eth0`), or export MASTER_ADDR and MASTER_PORT") from None


def _broadcast(env: LaunchEnvironment, message: Optional[dict]) -> dict:
    """Rank 0's ``message``, on every rank, through one MPI broadcast."""
    MPI, ours = _mpi(env)
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (env.rank, env.size):
        seen = (world.Get_rank(), world.Get_size())
        library = MPI.Get_library_version().strip().splitlines()[0].strip().rstrip(",")
        if ours:
            MPI.Finalize()
        raise MPIRendezvousError(
            f"rank {env.rank} of {env.size} ({env.source}) on host {socket.gethostname()}: mpi4py's MPI "
            f"({library}) sees this process as rank {seen[0]} of {seen[1]}, so mpi4py was built against another "
            f"MPI than the launcher that started the job ({env.source}). Build it against this one "
            f"(`MPI4PY_BUILD_MPICC=<this MPI's mpicc> pip install --no-binary mpi4py --force-reinstall mpi4py`), "
            f"or export MASTER_ADDR and MASTER_PORT to every rank")
    message = world.bcast(message, root=0)
    if ours:
        MPI.Finalize()
    return message


def _mpi(env: LaunchEnvironment):
    """mpi4py's MPI module, initialised, and whether torchmn initialised it (and so finalizes it)."""
    where = f"rank {env.rank} on host {socket.gethostname()}"
    module = sys.modules.get("mpi4py.MPI")
    if module is not None:
        if module.Is_initialized() and not module.Is_finalized():
            return module, False
        state = "already finalized" if module.Is_finalized() else "not initialised"
        raise MPIRendezvousError(
            f"{where}: the script imported mpi4py.MPI, but MPI is {state}, so rank 0's address cannot travel "
            f"over it; keep MPI initialised until create_communicator, or export MASTER_ADDR and MASTER_PORT")
    try:
        import mpi4py

        mpi4py.rc.initialize = True
        # Finalized right after the broadcast (see the module's text). A rank that fails before
        # that exits without MPI_Finalize, and mpirun ends the job, rather than MPI_Finalize at
        # exit waiting on ranks that may never get there.
        mpi4py.rc.finalize = False
        if "MPI4PY_RC_THREAD_LEVEL" not in os.environ:
            mpi4py.rc.thread_level = "funneled"
        from mpi4py import MPI  # initialises MPI
    except ImportError as e:
        raise MPIRendezvousError(f"{where}: mpi4py cannot be imported ({e}). {MPI_HINT}") from None
    return MPI, True
