"""Hosts and slots for ``torchmn run -H`` and ``--hostfile``: parsing, and placing ranks on them.

``-H`` takes ``host:slots`` entries separated by commas (a bare ``host`` has 1 slot); a hostfile
has one host a line, as ``host slots=N`` (Open MPI's form), ``host:N`` or a bare ``host``, with
``#`` comments and blank lines. A host named twice gets the slots of both entries.

Example::

    >>> parse_hosts("node1:2,node2")
    [('node1', 2), ('node2', 1)]
    >>> assign_ranks([("node1", 2), ("node2", 2)], 3)
    [('node1', 2), ('node2', 1)]
"""
from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

from torchmn import network
from torchmn.errors import TorchmnError

Hosts = List[Tuple[str, int]]

# A name may not start with "-": it goes into ssh's command line, where it would read as an option.
_HOST_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.\-]*$|^\[[0-9A-Fa-f:.]+\]$")


class HostsError(TorchmnError, ValueError):
    """A ``-H`` value or hostfile that does not parse, or an ``-np`` that does not fit it."""


def _slots(text: str, where: str) -> int:
    if not re.fullmatch(r"[0-9]+", text):  # int() would also take "1_0", "+2" and other scripts' digits
        raise HostsError(f"{where}: slot count {text!r} is not an integer")
    slots = int(text)
    if slots < 1:
        raise HostsError(f"{where}: slot count must be at least 1, got {slots}")
    return slots


def _host(text: str, where: str) -> str:
    if not _HOST_RE.match(text):
        raise HostsError(f"{where}: {text!r} is not a host name or address")
    return text[1:-1] if text.startswith("[") else text


def _entry(text: str, where: str) -> Tuple[str, int]:
    """``host``, ``host:N``, or ``[v6 address]:N``."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise HostsError(f"{where}: {text!r} has '[' without ']'")
        host, rest = text[:end + 1], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise HostsError(f"{where}: expected ':SLOTS' after {host!r}, got {rest!r}")
        return _host(host, where), _slots(rest[1:], where) if rest else 1
    if text.count(":") > 1:
        raise HostsError(f"{where}: write an IPv6 address in brackets, e.g. [{text}] or [addr]:2")
    host, sep, slots = text.partition(":")
    return _host(host, where), _slots(slots, where) if sep else 1


def merge(hosts: Sequence[Tuple[str, int]]) -> Hosts:
    """Add up the slots of a host named more than once, keeping the order of first mention.

    Args:
        hosts: (host, slots) pairs.

    Returns:
        One pair per host.

    Example::

        >>> merge([("a", 1), ("b", 2), ("a", 3)])
        [('a', 4), ('b', 2)]
    """
    total: Dict[str, int] = {}
    for host, slots in hosts:
        total[host] = total.get(host, 0) + slots
    return list(total.items())


def parse_hosts(text: str) -> Hosts:
    """Parse a ``-H`` value: ``host:slots`` entries separated by commas; a bare host has 1 slot.

    Args:
        text: the value.

    Returns:
        (host, slots) pairs, a host named twice once with the slots of both.

    Raises:
        HostsError: the value does not parse.

    Example::

        >>> parse_hosts("10.0.0.1:4, 10.0.0.2:4")
        [('10.0.0.1', 4), ('10.0.0.2', 4)]
    """
    entries = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in entries):
        raise HostsError(f"-H {text!r}: expected host:slots entries separated by commas, "
                         f"e.g. -H node1:4,node2:4")
    return merge([_entry(part, f"-H {text!r}") for part in entries])


def parse_hostfile_text(text: str, name: str = "hostfile") -> Hosts:
    """Parse hostfile lines: ``host slots=N``, ``host:N`` or ``host``; ``#`` starts a comment.

    Open MPI's ``max_slots=N`` (or ``max-slots=N``) is accepted and ignored, and ``slots = N`` with
    spaces is read as ``slots=N``.

    Args:
        text: the hostfile's contents.
        name: the file's name, for errors (which also name the line).

    Returns:
        (host, slots) pairs, a host named twice once with the slots of both.

    Raises:
        HostsError: a line does not parse, or no host is named.

    Example::

        >>> parse_hostfile_text("# two nodes\\nnode1 slots=2\\n\\nnode2:3\\nnode3\\n")
        [('node1', 2), ('node2', 3), ('node3', 1)]
    """
    hosts: Hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        # Open MPI's reader also takes "slots = 4".
        line = re.sub(r"\s*=\s*", "=", raw.split("#", 1)[0].strip())
        if not line:
            continue
        where = f"{name} line {number} ({raw.strip()!r})"
        words = line.split()
        host, slots = _entry(words[0], where)
        slots_given = ":" in (words[0].rpartition("]")[2] if words[0].startswith("[") else words[0])
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if key == "slots" and sep:
                if slots_given:
                    raise HostsError(f"{where}: slots given twice; write 'host slots=N' or 'host:N'")
                slots = _slots(value, where)
                slots_given = True
            elif key in ("max_slots", "max-slots") and sep:
                _slots(value, where)
            else:
                raise HostsError(f"{where}: unexpected {word!r}; expected 'host slots=N', 'host:N' or 'host'")
        hosts.append((host, slots))
    if not hosts:
        raise HostsError(f"{name} names no hosts; write one 'host slots=N' line per host")
    return merge(hosts)


def parse_hostfile(path: str) -> Hosts:
    """Read and parse a hostfile (see ``parse_hostfile_text``).

    Args:
        path: the hostfile (``--hostfile``).

    Returns:
        (host, slots) pairs, a host named twice once with the slots of both.

    Raises:
        HostsError: the file cannot be read or does not parse (the error names the file and,
            for a line that does not parse, the line).

    Example::

        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".hosts", delete=False) as f:
        ...     _ = f.write("node1 slots=4\\nnode2 slots=4\\n")
        >>> parse_hostfile(f.name)
        [('node1', 4), ('node2', 4)]
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise HostsError(f"cannot read --hostfile {path!r}: {e.strerror}") from None
    # Bytes that are no UTF-8 (a comment in another encoding) read as U+FFFD: a comment is dropped
    # as any other, a host name holding one is refused naming its line.
    return parse_hostfile_text(data.decode("utf-8", errors="replace"), f"hostfile {path}")


def assign_ranks(hosts: Sequence[Tuple[str, int]], np: int) -> Hosts:
    """Place ``np`` ranks on ``hosts``, filling each host's slots in order; hosts left without a
    rank are dropped.

    Args:
        hosts: (host, slots) pairs.
        np: the number of ranks.

    Returns:
        (host, ranks on it) pairs.

    Raises:
        HostsError: more ranks than slots.

    Example::

        >>> assign_ranks([("a", 2), ("b", 2)], 2)
        [('a', 2)]
    """
    total = sum(slots for _, slots in hosts)
    if np > total:
        listed = ", ".join(f"{h}:{s}" for h, s in hosts)
        raise HostsError(f"-np {np} is larger than the {total} slots given ({listed}); lower -np or "
                         f"give more slots (host:N in -H, 'host slots=N' in a hostfile)")
    placed: Hosts = []
    left = np
    for host, slots in hosts:
        if left == 0:
            break
        placed.append((host, min(slots, left)))
        left -= placed[-1][1]
    return placed


def merge_local_aliases(hosts: Sequence[Tuple[str, int]]) -> Hosts:
    """One node for every name of this machine (``localhost``, ``127.0.0.1``, its hostname): under
    the first such name given, with their slots added up, as Open MPI does. Otherwise ranks there
    would count as separate nodes, each given the whole machine's threads and the same local rank.

    Args:
        hosts: (host, slots) pairs.

    Returns:
        The pairs, this machine's names merged into one.

    Example::

        >>> merge_local_aliases([("localhost", 1), ("127.0.0.1", 1)])
        [('localhost', 2)]
    """
    here = [network.is_local(h) for h, _ in hosts]  # each name looked up once: it may ask DNS
    local = next((h for (h, _), mine in zip(hosts, here) if mine), None)
    return merge([(local if mine else h, n) for (h, n), mine in zip(hosts, here)])
