"""This machine's network addresses: which names are this machine, which addresses are loopback,
an interface's address, and the address a route to another host leaves from.

Standard library only (psutil is imported inside the functions that need it): the launcher's
helper processes and every rank's launcher detection use it without torch.

Example::

    >>> is_loopback("127.0.0.1"), interface_of("127.0.0.1")
    (True, 'lo')
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Dict, Mapping, Optional

from torchmn.errors import TorchmnError

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


class NetworkError(TorchmnError, ValueError):
    """A network interface that does not exist on this machine, or has no address."""


def local_addresses() -> set:
    """The IP addresses of this machine's interfaces.

    Reads them with psutil, imported here rather than at the top of the module.

    Returns:
        The IPv4 and IPv6 addresses as strings (IPv6 ones without their ``%zone``), loopback ones
        included.

    Example::

        >>> "127.0.0.1" in local_addresses()
        True
    """
    import psutil

    found = set()
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                found.add(address.address.split("%", 1)[0])
    return found


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine: ``localhost``, its hostname, a loopback address, or an
    address of one of its interfaces (ranks there start without ssh).

    Args:
        host: a host name or address; a name is looked up.

    Returns:
        True for this machine.

    Example::

        >>> is_local("localhost"), is_local("127.0.0.1")
        (True, True)
    """
    if host in _LOOPBACK_NAMES or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return False
    if any(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in resolved):
        return True
    return bool(resolved & local_addresses())


def is_loopback(address: str, resolve: bool = True) -> bool:
    """Whether ``address`` names this machine's loopback interface.

    Args:
        address: a host name or an IP address.
        resolve: look the name up (``/etc/hosts``, DNS): ``127.0.1.1``, which Debian gives the
            machine's own hostname, counts; an address that cannot be looked up counts only as
            ``localhost`` or ``::1``. Without it, nothing is looked up (reading a rank's
            environment must not wait on DNS): only ``localhost`` and loopback IP addresses count.

    Returns:
        True for a loopback address.

    Example::

        >>> is_loopback("127.0.1.1"), is_loopback("10.1.2.3"), is_loopback("localhost", resolve=False)
        (True, False, True)
    """
    if not resolve:
        if address == "localhost":
            return True
        try:
            return ipaddress.ip_address(address).is_loopback
        except ValueError:
            return False
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError, UnicodeError):
        return address in ("localhost", "::1")


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (else its first IPv6 address).

    Args:
        name: the interface (``--network-interface``), e.g. ``eth0``.

    Returns:
        The address.

    Raises:
        NetworkError: there is no such interface, or it has no IP address.

    Example::

        >>> interface_address("lo")
        '127.0.0.1'
    """
    import psutil

    interfaces = psutil.net_if_addrs()
    if name not in interfaces:
        raise NetworkError(f"--network-interface {name!r}: no such interface on this machine; "
                         f"it has {', '.join(sorted(interfaces))}")
    addresses = interfaces[name]
    for family in (socket.AF_INET, socket.AF_INET6):
        for address in addresses:
            if address.family == family:
                return address.address.split("%", 1)[0]
    raise NetworkError(f"--network-interface {name!r} has no IP address")


def interface_of(address: str) -> Optional[str]:
    """The name of this machine's interface that holds ``address``.

    Args:
        address: an IP address.

    Returns:
        The interface's name, or None when none holds it.

    Example::

        >>> interface_of("127.0.0.1")
        'lo'
    """
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == address for a in addresses):
            return name
    return None


def loopback_sockets(env: Mapping[str, str]) -> Dict[str, str]:
    """The variables that keep gloo's and NCCL's sockets on the loopback interface, for a job whose
    ranks are all on this machine: otherwise gloo listens on the address of the machine's host name,
    which the network may reach, and its pair set-up authenticates nobody.

    Args:
        env: the environment the ranks get; a ``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` set
            there is kept.

    Returns:
        ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` where unset in ``env``, naming the loopback
        interface (none where this machine has no interface holding 127.0.0.1).

    Example::

        >>> loopback_sockets({"NCCL_SOCKET_IFNAME": "eth0"})
        {'GLOO_SOCKET_IFNAME': 'lo'}
    """
    loopback = interface_of("127.0.0.1")
    if loopback is None:
        return {}
    return {name: loopback for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in env}


def route_address(host: str, port: int = 22) -> Optional[str]:
    """The address this machine would use to reach ``host`` (no packet is sent).

    Args:
        host: the host.
        port: a port on it (only to pick the route).

    Returns:
        The local address, or None if the host cannot be looked up or reached.

    Example::

        >>> route_address("127.0.0.1")
        '127.0.0.1'
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None
