"""Where the ranks meet: the rendezvous store the launcher hosts, and the address it is reached on."""
from __future__ import annotations

import socket
from typing import Optional, Sequence

from torchmn.launch import hosts as hostlib
from torchmn.launch.config import RunError
from torchmn.launch.ssh import HostCheck


def start_store(host: str, port: Optional[int], port_origin: Optional[str] = None):
    """Host the rendezvous ``TCPStore``, as torchrun does: every rank is a client of it.

    Args:
        host: the address to name in errors (the store listens on every interface).
        port: the port; None lets the OS pick a free one, so there is no race for it.
        port_origin: where a given port came from, for the error when it is taken (default:
            ``--master-port``).

    Returns:
        The store (``torch.distributed.TCPStore``); dropping the last reference closes it.

    Raises:
        RunError: the port is taken, or the store cannot start.

    Example::

        >>> store = start_store("127.0.0.1", None); store.port > 0
        True
    """
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port or 0, is_master=True, wait_for_workers=False)
    except RuntimeError as e:
        text = str(e)
        if port and ("EADDRINUSE" in text or "in use" in text.lower()):
            if port_origin:
                raise RunError(f"port {port} ({port_origin}) is already in use on this machine. "
                               f"Choose another: set MASTER_PORT, or pass --master-port.")
            raise RunError(f"port {port} is already in use on this machine (--master-port {port}). "
                           f"Pick another port, or leave --master-port out so torchmn picks a free one.")
        raise RunError(f"could not start the rendezvous store on {host}:{port or 0}: {text}")


def interface_address(name: str) -> str:
    """The address of this machine's interface ``name`` (``--network-interface``).

    Args:
        name: the interface, e.g. ``eth0``.

    Returns:
        Its IPv4 address, else its first IPv6 address.

    Raises:
        RunError: there is no such interface, or it has no address.

    Example::

        >>> interface_address("lo")
        '127.0.0.1'
    """
    try:
        return hostlib.interface_address(name)
    except hostlib.HostsError as e:
        raise RunError(str(e))


def address_for_hosts(checks: Sequence[HostCheck], remote_hosts: Sequence[str], ssh_port: Optional[int]) -> str:
    """The address of this machine that the other hosts reach the store on.

    The address the first host saw the ssh connection come from, when it is one of this machine's;
    else the address this machine routes to the first host from; else its fully qualified name.

    Args:
        checks: what checking the remote hosts found, in the order of ``remote_hosts``.
        remote_hosts: the other hosts.
        ssh_port: the hosts' ssh port (None: 22), to find the route.

    Returns:
        The rendezvous address.

    Raises:
        RunError: the only address found is a loopback address, which the other hosts would take
            for themselves (behind an ssh tunnel or ProxyJump, they log in from this machine's
            loopback).
    """
    local = hostlib.local_addresses()
    seen = checks[0].client_address
    if seen and seen in local and not seen.startswith("127."):
        address = seen
    else:
        address = hostlib.route_address(remote_hosts[0], ssh_port or 22) or socket.getfqdn()
    if hostlib.is_loopback(address):
        raise RunError(f"cannot tell which address of this machine the hosts {', '.join(remote_hosts)} "
                       f"reach it on (found only {address}, a loopback address); name the "
                       f"network with --network-interface (e.g. eth0)")
    return address
