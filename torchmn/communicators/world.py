"""Bringing up ``torch.distributed`` for a communicator, from what the launcher told us."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import math
import os
import socket
import time
import urllib.parse
from typing import Optional

import torch
import torch.distributed as dist

from torchmn import network
from torchmn.communicators._torch_compat import forget_unmade_world
from torchmn.elastic import protocol
from torchmn.elastic import setup_store
from torchmn.environments import LaunchEnvironment, mpi_rendezvous
from torchmn.environments import job_label
from torchmn.environments.mpi import MPI_RENDEZVOUS
from torchmn.environments.variables import JOB_TOKEN, LOCALHOST
from torchmn.errors import TorchmnRuntimeError, TorchmnValueError

_timeout: Optional[datetime.timedelta] = None  # the world's, once set up or adopted
_worlds = 0  # default process groups this process set up (a world again after finalize)
_job_store_client: Optional["dist.Store"] = None  # the store of the world set up last, unprefixed
_setup_store: Optional["dist.Store"] = None  # an elastic generation's world's store (_watched_by_the_launcher)
_world_pid: Optional[int] = None  # the process that set up the world: a process forked from it did not


def _hold_groups_in_child() -> None:
    """In a process forked from a rank (a helper it starts with ``os.fork``), hold the process
    groups to the end: they are the rank's, and their threads did not come along, so destroying one
    here (at this process's exit, when the last reference goes) would wait for ever for them, and
    the rank waiting for this process with it."""
    world = getattr(dist.distributed_c10d, "_world", None) if dist.is_available() else None
    for group in list(getattr(world, "pg_map", {})):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never released: no destructor runs here


os.register_at_fork(after_in_child=_hold_groups_in_child)


def default_timeout() -> datetime.timedelta:
    """How long a collective waits for the other ranks: ``TORCHMN_TIMEOUT`` (seconds), else 600 s.

    Returns:
        The timeout as a ``datetime.timedelta``.

    Raises:
        ValueError: ``TORCHMN_TIMEOUT`` is not a positive, finite number.

    Example::

        >>> os.environ["TORCHMN_TIMEOUT"] = "30"
        >>> default_timeout()
        datetime.timedelta(seconds=30)
    """
    value = os.environ.get("TORCHMN_TIMEOUT")
    if value is None:
        return datetime.timedelta(seconds=600)
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise TorchmnValueError(f"TORCHMN_TIMEOUT={value!r} is not a positive number of seconds (how long a collective "
                                f"waits for the other ranks); set it to, say, 600, or unset it")
    return datetime.timedelta(seconds=seconds)


def collective_timeout_s() -> float:
    """Seconds a collective may wait for the other ranks (also inside shared memory).

    Returns:
        The world's timeout once it is set up or adopted, else :func:`default_timeout`'s.

    Example::

        >>> deadline = time.monotonic() + collective_timeout_s()
    """
    return (_timeout or default_timeout()).total_seconds()


def adopt_world(timeout: Optional[datetime.timedelta]) -> None:
    """For a default process group that already exists (the script's own, or an earlier
    communicator's): collectives, shared-memory ones included, wait for ``timeout`` when given
    (applied to the group too), else for the group's own timeout.

    Args:
        timeout: how long collectives wait; None keeps the group's own.

    Example::

        >>> dist.init_process_group("gloo")  # the script's own world
        >>> adopt_world(None)
    """
    global _timeout
    group = dist.group.WORLD
    if timeout is not None:
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is not None:
            set_timeout(timeout, group)
        _timeout = timeout
        return
    try:
        _timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        _timeout = _timeout or default_timeout()


def default_backend() -> str:
    """The backend a communicator uses when none is named: NCCL where CUDA is available, else gloo.

    Returns:
        ``"nccl"`` or ``"gloo"``.

    Example::

        >>> default_backend()  # on a machine without GPUs
        'gloo'
    """
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_world(env: LaunchEnvironment, backend: str, timeout: Optional[datetime.timedelta],
               init_method: Optional[str]) -> None:
    """Initialise the default process group for ``env`` and tear it down at interpreter exit.

    The teardown matters: a gloo process that exits with its group alive sometimes aborts at
    exit (``terminate called without an active exception``), failing jobs that succeeded.

    Args:
        env: the launch environment detected for this rank.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: how long collectives wait; None for :func:`default_timeout`.
        init_method: a ``torch.distributed`` init method; None to meet where the launcher says.

    Raises:
        RuntimeError: the rendezvous failed (naming the ranks that never arrived where known), no
            rendezvous port is known, its host does not resolve, or a ``file://`` rendezvous file
            is left over from an earlier job.
        ValueError: a bad ``TORCHMN_TIMEOUT``.

    Example::

        >>> init_world(detect_environment(), default_backend(), None, None)
    """
    global _timeout, _worlds
    _timeout = timeout or default_timeout()
    _worlds += 1
    store = arrivals = None
    one_machine = env.size > 1 and env.local_size == env.size
    if one_machine and init_method is None:
        # Every rank here: gloo and NCCL's sockets stay off the network (see network.loopback_sockets).
        os.environ.update(network.loopback_sockets(os.environ))
    if init_method is None:
        if env.source in ("torchmn", "torchrun"):
            # Their launcher hosts the store (TORCHELASTIC_USE_AGENT_STORE) and set MASTER_*.
            init_method = "env://"
            store = arrivals = _mark_arrival(_launchers_store(_timeout), env.rank)
            if store is not None:
                # The launcher's store outlives a world: one set up again after finalize() (or after
                # the script's own), or by a restarted torchrun attempt, would otherwise meet the keys
                # of a group torch named alike, and wait on its addresses. Each gets keys of its own,
                # as torch's own env:// gives each torchrun attempt.
                store = dist.PrefixStore(_world_prefix(), _watched_by_the_launcher(store))
        elif env.master_addr == MPI_RENDEZVOUS:
            # mpirun across nodes without MASTER_ADDR: rank 0's address travels over MPI (mpi4py).
            store, init_method = mpi_rendezvous.rendezvous_store(env, _timeout)
            store = arrivals = _mark_arrival(store, env.rank)
        else:
            if env.master_port is None:
                raise TorchmnRuntimeError(f"{env.source}: no rendezvous port known for {env.size} ranks; "
                                          f"export MASTER_PORT (and MASTER_ADDR) on every rank")
            # Every rank here and no address asked for: the store listens on loopback alone.
            address = LOCALHOST if one_machine and not os.environ.get("MASTER_ADDR") else env.master_addr
            if address != LOCALHOST:
                _check_resolves(env)
            host = f"[{address}]" if ":" in address else address  # IPv6
            init_method = f"tcp://{host}:{env.master_port}"
            store = arrivals = _job_store(env, address, _timeout)
            # Rank 0's store server outlives a world in this process (multi_tenant): a world set up
            # again after finalize() would meet the first one's addresses, and pair with ranks gone.
            store = dist.PrefixStore(f"torchmn/world{_worlds}/", store)
    global _job_store_client
    _job_store_client = arrivals
    if init_method.startswith("file://"):
        _refuse_stale_file(init_method[len("file://"):], env)
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % max(1, torch.cuda.device_count()))
    try:
        with _own_store_for(init_method):
            own_keys = isinstance(store, dist.PrefixStore) or init_method.startswith("tcp://")
            where = {"store": store} if store is not None and own_keys else {"init_method": init_method}
            set_up = _set_up_timeout(_timeout)
            dist.init_process_group(backend, rank=env.rank, world_size=env.size, timeout=set_up, **where)
            if set_up != _timeout:
                dist.distributed_c10d._set_pg_timeout(_timeout, dist.group.WORLD)
            if arrivals is not None:
                # gloo's set-up above meets every rank; NCCL's meets none (it connects at its first
                # collective), so a rank that never came would surface in a later group's timeout,
                # unnamed. Every rank's arrival, awaited here, names it now under either backend.
                watched = _setup_store if env.source in ("torchmn", "torchrun") else None
                (watched or arrivals).wait([_arrived_key(r) for r in range(env.size)], _timeout)
    except Exception as e:
        if dist.is_initialized():  # NCCL's world was made, but a rank never came
            dist.destroy_process_group()
        forget_unmade_world()
        missing = _never_arrived(arrivals, env.size)
        if missing:
            hint = (f"Rank(s) {', '.join(map(str, missing))} never reached create_communicator (not started, "
                    f"exited, or busy before it): see their output.")
        elif env.source == "torchmn" and JOB_TOKEN not in os.environ:
            # The launcher's store admits only processes started with the job's token.
            hint = (f"This process was started without {JOB_TOKEN}, which torchmn run gives every rank, so the "
                    f"job's store refused it: pass the rank's environment on to what it starts (env -i, sudo or "
                    f"a wrapper that clears the environment drop it; a container needs -e {JOB_TOKEN}).")
        else:
            hint = ("Check that every rank was started, that the rendezvous host is reachable from this one, and "
                    "that the port is free and not firewalled (MASTER_ADDR / MASTER_PORT override it).")
        raise TorchmnRuntimeError(f"rank {env.rank}/{env.size} could not join the job's rendezvous at {init_method} "
                                  f"({env.source} launch): {e}. {hint}") from e
    global _world_pid
    _world_pid = os.getpid()
    atexit.register(shutdown_world)


def new_group(ranks: Optional[list] = None, **options) -> "dist.ProcessGroup":
    """``torch.distributed.new_group`` for a communicator's group: its collectives wait as long as
    the world's (torch would give a new group its own default, 30 minutes on gloo, whatever
    ``create_communicator(timeout=...)`` said).

    Args:
        ranks: the group's world ranks; None for all of them.
        **options: ``backend``, ``use_local_synchronization``, as ``torch.distributed.new_group`` takes them.

    Returns:
        The group (``GroupMember.NON_GROUP_MEMBER`` on a rank outside it, as torch returns).

    Example::

        >>> leaders = new_group([0, 4], backend="gloo", use_local_synchronization=True)
    """
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    set_up = _set_up_timeout(timeout)
    group = dist.new_group(ranks, timeout=set_up, **options)
    if set_up != timeout and group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    return group


def _set_up_timeout(timeout: datetime.timedelta) -> datetime.timedelta:
    """How long setting up a group may take: ``timeout``, but at most ``setup_store.SETUP_TIMEOUT_S``
    in an elastic generation. There gloo connects to each member at the address it left in the
    store, retrying inside C++ for the group's whole timeout: a member that left the set-up (for a
    newer generation, or dead) would hold the others there, deaf to the launcher's next generation.
    The group gets ``timeout`` once it is set up."""
    if _setup_store is None or not hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        return timeout
    return min(timeout, datetime.timedelta(seconds=setup_store.SETUP_TIMEOUT_S))


def _watched_by_the_launcher(store: "dist.TCPStore") -> "dist.Store":
    """``store``; for an elastic generation's world, watched by :mod:`torchmn.elastic.setup_store`
    (kept for the world's life: its groups' set-ups wait there), so that its waits end when the
    launcher moves on."""
    global _setup_store
    generation = _elastic_generation()
    _setup_store = None if generation is None else setup_store.watched(store, generation)
    return store if _setup_store is None else _setup_store


def job_store() -> Optional["dist.Store"]:
    """The job's rendezvous store as this rank reaches it, for what travels beside the collectives
    (the monitor's figures): the launcher's (torchmn run, torchrun), rank 0's (Slurm, MPI), or the
    store of a world the script or its framework set up; None for a world of one started without a
    launcher.

    Returns:
        A store client; keys written there are the job's, shared by every rank.

    Example::

        >>> job_store().set("torchmn/example", "hello")   # doctest: +SKIP
    """
    if _job_store_client is None:
        # A world set up by the script or its framework, or none (a world of one): under torchmn
        # run or torchrun, the launcher's store (where the launcher looks); else the store that
        # world was made with.
        client = _launchers_store(_timeout or default_timeout())
        if client is None and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
        return client
    return _job_store_client


def _never_arrived(store: Optional["dist.TCPStore"], size: int) -> list:
    """The ranks that never marked their arrival in the job's store (see _mark_arrival)."""
    if store is None:
        return []
    try:
        return [r for r in range(size) if not store.check([_arrived_key(r)])]
    except RuntimeError:  # the store went with rank 0, or with the launcher
        return []


_JOB_KEY = "torchmn/job"


def _world_prefix() -> str:
    """Where this world keeps its keys in the launcher's store, apart from every other world's.

    torchrun keeps its store across restarts of the workers, and a world set up again after
    finalize() would meet the first one's keys: each attempt and each world of this process gets
    its own. An elastic job's ranks count their worlds differently (a rank that joined later has
    set up fewer), so there each generation has its own, the same on every member.
    """
    generation = _elastic_generation()
    if generation is not None:
        return protocol.store_prefix(generation)
    return f"torchmn/world{_worlds}/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _elastic_generation() -> Optional[int]:
    """The elastic generation this rank's place belongs to; None outside an elastic job (or in a
    worker that has not joined one yet)."""
    value = os.environ.get(protocol.GENERATION_VARIABLE) if protocol.enabled(os.environ) else None
    return None if value is None else int(value)


def _arrived_key(rank: int) -> str:
    return f"{_world_prefix()}arrived/{rank}"


def _mark_arrival(store: Optional["dist.TCPStore"], rank: int) -> Optional["dist.TCPStore"]:
    """Say in the job's store that ``rank`` reached set-up, so that a set-up timeout on another
    rank can name the ranks that never did (torch's own message only quotes a store key)."""
    if store is not None:
        store.set(_arrived_key(rank), "")
    return store


def launcher_store(timeout: Optional[datetime.timedelta] = None) -> Optional["dist.TCPStore"]:
    """A client of the store that ``torchmn run`` or torchrun hosts, unprefixed: what the launcher
    itself reads (an elastic job's membership, the monitor's figures).

    Args:
        timeout: how long its calls wait for a key; None for the world's timeout.

    Returns:
        The client, or None where no launcher hosts a store (Slurm, MPI, by hand) or it cannot be
        reached.

    Example::

        >>> launcher_store().check(["torchmn/elastic/generation"])   # doctest: +SKIP
        True
    """
    return _launchers_store(timeout or _timeout or default_timeout())


def _launchers_store(timeout: datetime.timedelta) -> Optional["dist.TCPStore"]:
    """A client of the store that torchmn run or torchrun hosts (MASTER_ADDR:MASTER_PORT), or None
    where it cannot be reached now: init_process_group then reports that its own way."""
    if os.environ.get(_AGENT_STORE) != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timeout)
    except (KeyError, ValueError, RuntimeError):
        return None


def _loopback_listener(port: int) -> Optional[int]:
    """A listening socket on 127.0.0.1:``port`` for rank 0's store, as a file descriptor that the
    store takes over (torch's own would listen on every interface); None where the port is taken
    here already (a world set up again in this process reuses its store: multi_tenant)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOCALHOST, port))
        listener.listen(1024)
    except OSError:
        listener.close()
        return None
    return listener.detach()


def _job_store(env: LaunchEnvironment, address: str, timeout: datetime.timedelta) -> "dist.TCPStore":
    """The rendezvous store at a port derived from the launcher's job id (Slurm, MPI), hosted by
    rank 0, which writes which job it is, at ``address`` (127.0.0.1: listening there alone). Two
    jobs can derive the same port; the second's rank 0 then cannot listen on it, and its other
    ranks would join the first job's store and wait there for the whole timeout: they compare the
    job instead, and stop at once."""
    # Words that differ between two jobs of one launcher, as far as it tells.
    job = job_label(os.environ, env.source) or f"a job of {env.size} ranks ({env.source})"
    hosting = env.rank == 0
    listen_fd = _loopback_listener(env.master_port) if hosting and address == LOCALHOST else None
    try:
        store = dist.TCPStore(address, env.master_port, env.size, hosting, timeout=timeout,
                              wait_for_workers=False, multi_tenant=True, master_listen_fd=listen_fd)
    except RuntimeError as e:
        if listen_fd is not None:
            os.close(listen_fd)
        if env.rank == 0 and "in use" in str(e).lower():
            raise TorchmnRuntimeError(
                f"rank 0 of {job} on {socket.gethostname()}: the rendezvous port {env.master_port} "
                f"is in use, by another job or program; export MASTER_PORT=<a free port> on every "
                f"rank") from None
        if env.rank == 0:
            raise TorchmnRuntimeError(f"rank 0 of {job} on {socket.gethostname()}: could not open the rendezvous store "
                                      f"on port {env.master_port}: {e}") from e
        raise TorchmnRuntimeError(f"rank {env.rank} of {job} on {socket.gethostname()}: rank 0 never opened the "
                                  f"rendezvous store at {address}:{env.master_port} within "
                                  f"{timeout.total_seconds():.0f} s. Check rank 0's output: did it start, or fail before "
                                  f"create_communicator? Is {address} its host, reachable from here? (torch: "
                                  f"{str(e).splitlines()[0]})") from None
    if env.rank == 0:
        store.set(_JOB_KEY, job)
        return _mark_arrival(store, 0)
    try:
        store.wait([_JOB_KEY])
    except RuntimeError as e:
        raise TorchmnRuntimeError(
            f"rank {env.rank} of {job}: the rendezvous store at {address}:{env.master_port} "
            f"never said which job it serves ({e}); if rank 0 did start, the port belongs to "
            f"another program: export MASTER_PORT=<a free port> on every rank") from None
    owner = store.get(_JOB_KEY).decode()
    if owner != job:
        raise TorchmnRuntimeError(
            f"rank {env.rank} of {job}: the rendezvous store at {address}:{env.master_port} "
            f"belongs to {owner} (the two jobs derived the same port); export "
            f"MASTER_PORT=<a free port> on every rank")
    return _mark_arrival(store, env.rank)


def _check_resolves(env: LaunchEnvironment) -> None:
    """Say at once that the rendezvous host has no address here, instead of waiting out the
    timeout behind torch's retries."""
    try:
        socket.getaddrinfo(env.master_addr, env.master_port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise TorchmnRuntimeError(
            f"rank {env.rank}/{env.size} on {socket.gethostname()}: the rendezvous host {env.master_addr!r} "
            f"({env.source} launch) does not resolve here ({e.strerror}); set MASTER_ADDR on every rank to an "
            f"address or name this host can resolve (on Slurm: node names that differ from their NodeAddr "
            f"need one)") from None


@contextlib.contextmanager
def _own_store_for(init_method: str):
    """Let rank 0 host the store of a tcp:// rendezvous the script chose. torchrun and torchmn run
    set TORCHELASTIC_USE_AGENT_STORE, which makes every rank a client of the launcher's store; at
    another address nobody would host one, and every rank would wait out the timeout."""
    agent = os.environ.get(_AGENT_STORE)
    if agent is None or not init_method.startswith("tcp://") or _is_launchers_store(init_method):
        yield
        return
    del os.environ[_AGENT_STORE]
    try:
        yield
    finally:
        os.environ[_AGENT_STORE] = agent


_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def _is_launchers_store(init_method: str) -> bool:
    address = urllib.parse.urlsplit(init_method)
    try:
        port = address.port
    except ValueError:
        return False
    return (address.hostname, str(port)) == (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))


def _refuse_stale_file(path: str, env: LaunchEnvironment) -> None:
    """Refuse a ``file://`` rendezvous file left by an earlier job (one that crashed, so torch
    never deleted it): joining it would pair this job's ranks with dead ones, or hang.

    Stale means: it already counts ``size`` users (a live job has at most ``size - 1`` before this
    rank joins), or it already holds this rank's own address, which only this rank writes.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    users, mine = 0, False
    for key, value in _file_store_entries(data):
        if key == b"refcount/":
            users = int(value or b"0")
        elif key.startswith(b"/default_pg/") and key.endswith(b"/%d" % env.rank):
            mine = True
    if users >= env.size or mine:
        raise TorchmnRuntimeError(
            f"rank {env.rank}: the rendezvous file {path} is left over from an earlier job "
            f"({'it already holds this rank' if mine else f'{users} ranks already joined it'}); "
            f"delete it (rm {path}) or give this job a new file:// path")


def _file_store_entries(data: bytes):
    """(key, value) pairs of torch's FileStore log: 32-bit little-endian lengths, then bytes."""
    i = 0
    while i + 4 <= len(data):
        n = int.from_bytes(data[i:i + 4], "little")
        key, i = data[i + 4:i + 4 + n], i + 4 + n
        if i + 4 > len(data):
            return
        m = int.from_bytes(data[i:i + 4], "little")
        if i + 4 + m > len(data):
            return  # an entry still being written
        yield key, data[i + 4:i + 4 + m]
        i += 4 + m


def shutdown_world() -> None:
    """Destroy the default process group, once gloo's worker threads have let go of their work.

    A gloo worker thread drops each finished collective a moment after the caller has moved on;
    if that tensor's last reference was Python's, dropping it needs the GIL, and a thread that
    asks for the GIL while the interpreter is finalizing aborts the whole process ("terminate
    called without an active exception", seen in about 1 of 20 two-rank jobs). Sleeping releases
    the GIL and lets those threads finish first.

    Example::

        >>> init_world(detect_environment(), "gloo", None, None)
        >>> shutdown_world()
    """
    if dist.is_initialized() and os.getpid() == _world_pid:  # not in a process forked from the rank
        time.sleep(0.2)  # generous: on a loaded machine that thread may wait for a core
        dist.destroy_process_group()
