"""Which process of this machine holds one end of a TCP connection, and whether it belongs to the job.

A ``TCPStore`` client cannot present a secret (torch has no hook for one), but on Linux the
kernel tells who it is: sock_diag (as ``ss`` asks it; else ``/proc/net/tcp*``) maps the
connection to its socket's inode and owner, ``/proc/PID/fd`` maps the inode to the processes
that hold it, and ``/proc/PID/environ`` holds the environment each was started with. A process started with the
job's token (a rank, or anything a rank started) belongs to the job. Both are read through one
open ``/proc/PID`` directory, which stays bound to that process: if it ends in between and its
pid goes to another process, the second read fails instead of reading the newcomer's. Reading
another user's ``/proc/PID/fd`` or ``environ`` needs that user's rights or root's, so a process of
another user cannot be vouched for by a launcher that does not run as root, and is refused either
way unless it was started with the token.

Standard library only: the watcher loads this module on hosts where torch must not be imported.
"""
from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import os
import socket
import struct
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

from torchmn.run.store.auth import TOKEN_ENV

Address = Tuple[str, int]


@dataclasses.dataclass
class Peer:
    """What this machine knows of one end of a connection.

    Attributes:
        found: the connection is this machine's (in this network namespace).
        uid: the socket owner's user id, when found.
        pids: the processes that hold the socket, as far as this process may look.
        member: one of them was started with the job's token, or is one of ``own_pids``.
    """

    found: bool = False
    uid: Optional[int] = None
    pids: Tuple[int, ...] = ()
    member: bool = False

    def describe(self) -> str:
        """Who it is, for a log line: "process 812 (nc) of user alice", or what is known.

        Returns:
            The words: "not a connection of this machine" when not ``found``; the user alone when
            no process holds it any more (it closed the connection) or the holding processes
            cannot be seen; else up to three processes (pid and name) and their user.

        Example::

            >>> Peer().describe()
            'not a connection of this machine'
            >>> Peer(found=True, uid=0).describe()      # as a user other than root
            'a process of user root (its files cannot be read from here)'
        """
        if not self.found:
            return "not a connection of this machine"
        user = _user_name(self.uid)
        if not self.pids:
            if self.uid == os.getuid() or os.geteuid() == 0:  # its processes are readable: none holds it now
                return f"a process of user {user} that closed the connection before it could be identified"
            return f"a process of user {user} (its files cannot be read from here)"
        return ", ".join(f"process {pid} ({_process_name(pid)})" for pid in self.pids[:3]) + f" of user {user}"


def _user_name(uid: Optional[int]) -> str:
    if uid is None:
        return "?"
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


# Linux's sock_diag netlink interface (linux/sock_diag.h, linux/inet_diag.h), as `ss` uses it.
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2


def _families(address: Address) -> List[Tuple[int, bytes]]:
    """(family, 16 address bytes) for each way the kernel may hold ``address``: an IPv4 address
    also as IPv4-mapped, for a dual-stack socket."""
    ip = ipaddress.ip_address(address[0].split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        return [(socket.AF_INET, ip.packed.ljust(16, b"\0")),
                (socket.AF_INET6, bytes(10) + b"\xff\xff" + ip.packed)]
    return [(socket.AF_INET6, ip.packed)]


def _ask_kernel(local: Address, remote: Address) -> Optional[Tuple[int, int]]:
    """One exact lookup through sock_diag: microseconds, where reading ``/proc/net/tcp`` takes
    milliseconds on a machine with many connections (the kernel walks its whole table)."""
    remotes = dict(_families(remote))
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as link:
        link.settimeout(2)
        for family, source in _families(local):
            # inet_diag_req_v2: family, protocol, extensions, pad, states (all); then the
            # inet_diag_sockid: ports and addresses in network order, interface, no cookie.
            request = (struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
                       + struct.pack("!HH", int(local[1]), int(remote[1])) + source + remotes[family]
                       + struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF))
            link.send(struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
                      + request)
            answer = link.recv(65536)
            if len(answer) < 16 + 72 or struct.unpack_from("=H", answer, 4)[0] == NLMSG_ERROR:
                continue  # not a socket of that family (ENOENT)
            # inet_diag_msg: family, state, timer, retrans, the sockid (48 bytes), expires,
            # rqueue, wqueue, uid, inode.
            uid, inode = struct.unpack_from("=II", answer, 16 + 64)
            if inode:
                return inode, uid
    return None


def _read_tables(local: Address, remote: Address) -> Optional[Tuple[int, int]]:
    """The same lookup in ``/proc/net/tcp*``, where sock_diag is not there."""
    remotes = {family: packed for family, packed in _families(remote)}
    for family, packed in _families(local):
        table = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
        size = 4 if family == socket.AF_INET else 16

        def text(raw: bytes, port: int) -> str:
            # 32-bit words in the kernel's byte order, then the port.
            words = (struct.unpack("=I", raw[i:i + 4])[0] for i in range(0, size, 4))
            return "".join(f"{word:08X}" for word in words) + f":{port:04X}"
        try:
            with open(table) as f:
                content = f.read()
        except OSError:
            continue
        needle = f" {text(packed, int(local[1]))} {text(remotes[family], int(remote[1]))} "
        start = content.find(needle)
        while start >= 0:
            end = content.find("\n", start)
            fields = content[start:end if end >= 0 else len(content)].split()
            if len(fields) >= 9 and fields[8] != "0":  # inode 0: a connection in TIME_WAIT
                return int(fields[8]), int(fields[6])
            start = content.find(needle, start + 1)
    return None


def socket_of(local: Address, remote: Address) -> Optional[Tuple[int, int]]:
    """The socket of this machine whose local end is ``local`` and whose far end is ``remote``.

    Args:
        local: (address, port) of the end held here.
        remote: (address, port) of the other end.

    Returns:
        (inode, owner uid), or None when no such connection is this machine's (in this network
        namespace).

    Example::

        >>> socket_of(("192.0.2.1", 1), ("192.0.2.2", 2)) is None
        True
    """
    try:
        return _ask_kernel(local, remote)
    except OSError:
        return _read_tables(local, remote)


class ProcessDir:
    """One process's ``/proc/PID`` directory, held open: every read through it is of that process,
    even once its pid is reused (the reads then fail).

    Args:
        pid: the process.

    Raises:
        OSError: the process is gone, or ``/proc/PID`` cannot be opened.

    Example::

        >>> with ProcessDir(os.getpid()) as me:
        ...     me.started_with("no such token")
        False
    """

    def __init__(self, pid: int):
        self.pid = pid
        self.fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def __enter__(self) -> "ProcessDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the directory. Safe to call more than once.

        Example::

            >>> ProcessDir(os.getpid()).close()
        """
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def holds(self, target: str) -> bool:
        """Whether one of the process's file descriptors is ``target``.

        Args:
            target: the descriptor as ``readlink`` shows it, e.g. ``socket:[1234]``.

        Returns:
            The answer; False where the descriptors cannot be read (another user's, or the
            process is gone).

        Example::

            >>> with ProcessDir(os.getpid()) as me:
            ...     me.holds("socket:[0]")
            False
        """
        try:
            fds = os.open("fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return False
        try:
            for name in os.listdir(fds):
                try:
                    if os.readlink(name, dir_fd=fds) == target:
                        return True
                except OSError:
                    continue
            return False
        except OSError:
            return False
        finally:
            os.close(fds)

    def started_with(self, token: str) -> bool:
        """Whether the process was started with ``TORCHMN_JOB_TOKEN`` equal to ``token``.

        Args:
            token: the job's token.

        Returns:
            The answer; False where the environment cannot be read (another user's, or the
            process is gone).

        Example::

            >>> with ProcessDir(os.getpid()) as me:
            ...     me.started_with("no such token")
            False
        """
        try:
            fd = os.open("environ", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return False
        try:
            with os.fdopen(fd, "rb") as f:
                environ = f.read()
        except OSError:
            return False
        prefix = TOKEN_ENV.encode() + b"="
        want = token.encode()
        return any(hmac.compare_digest(item[len(prefix):], want)
                   for item in environ.split(b"\0") if item.startswith(prefix))


def holders(inode: int, uid: Optional[int], first: Iterable[int] = ()) -> Iterator[ProcessDir]:
    """The processes that hold socket ``inode``, looking at ``first`` before the others and only
    at processes of user ``uid``, which a socket's owner nearly always is.

    Args:
        inode: the socket's inode (see ``socket_of``).
        uid: its owner (None: any user).
        first: likely holders (the job's ranks), looked at first.

    Yields:
        Each holder's ``ProcessDir``, open until the next one is asked for (so that what is read
        of it next is of the same process).

    Example::

        >>> [p.pid for p in holders(1, None, first=[os.getpid()])]
        []
    """
    target = f"socket:[{inode}]"
    seen = set()

    def candidates() -> Iterator[int]:
        yield from first
        try:
            entries = list(os.scandir("/proc"))
        except OSError:
            return
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                if uid is not None and entry.stat().st_uid != uid:
                    continue
            except OSError:
                continue
            yield int(entry.name)

    for pid in candidates():
        if pid in seen:
            continue
        seen.add(pid)
        try:
            process = ProcessDir(pid)
        except OSError:
            continue
        with process:
            if process.holds(target):
                yield process


def holder_of(local: Address, remote: Address) -> Peer:
    """Who holds the end ``local`` of the connection between ``local`` and ``remote``, whatever job
    it belongs to: for a log line (``Peer.describe``); ``member`` is False.

    Args:
        local: (address, port) of the end to name.
        remote: (address, port) of the other end.

    Returns:
        A ``Peer``.

    Example::

        >>> holder_of(("192.0.2.1", 1), ("192.0.2.2", 2)).describe()
        'not a connection of this machine'
    """
    found = socket_of(local, remote)
    if found is None:
        return Peer()
    inode, uid = found
    return Peer(True, uid, tuple(process.pid for process in holders(inode, uid)), False)


def identify(local: Address, remote: Address, token: str, first: Sequence[int] = (),
             own_pids: Sequence[int] = ()) -> Peer:
    """Who holds the end ``local`` of the connection between ``local`` and ``remote``, and whether
    it belongs to the job.

    Args:
        local: (address, port) of the end to identify, as the other end sees it.
        remote: (address, port) of the other end.
        token: the job's token.
        first: processes likely to hold it, looked at first.
        own_pids: processes that belong to the job whatever their environment (the launcher or
            watcher asking).

    Returns:
        A ``Peer``.

    Example::

        >>> identify(("192.0.2.1", 1), ("192.0.2.2", 2), "t").found
        False
    """
    found = socket_of(local, remote)
    if found is None:
        return Peer()
    inode, uid = found
    pids = []
    for process in holders(inode, uid, first=list(own_pids) + list(first)):
        pids.append(process.pid)
        if process.pid in own_pids or process.started_with(token):
            return Peer(True, uid, tuple(pids), True)
    return Peer(True, uid, tuple(pids), False)
