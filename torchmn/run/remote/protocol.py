"""What the launcher and a remote rank's watcher say to each other (``docs/design/launcher.md``).

The launcher's ssh client runs ``python -m WATCHER_MODULE -- COMMAND...`` on the remote host. The
launcher writes the job's token (``torchmn.run.store.auth.token_line``), then the ``-x`` variables
(:func:`exports_line`) as the first lines of the watcher's stdin: what other users of the hosts
must not read in ``ps``. The watcher prints ``STARTED_MARKER`` once the rank is about to start; the
launcher writes ``SIGNAL_LINE`` or ``RELAY_LINE`` lines to its stdin, and closes stdin to stop the
rank.

Example::

    >>> SIGNAL_LINE + b"2\\n"
    b'signal 2\\n'
"""

import base64
import json
from typing import Dict, Mapping, Optional

from torchmn.run.store.auth import read_line

# The watcher's module, run with ``python -m`` on the remote host (it does not import torch).
WATCHER_MODULE = "torchmn.run.remote.watcher"

# Printed by the watcher on stdout, alone on its line, once the rank is about to start: the
# launcher drops the line and counts the rank as started (see --start-timeout).
STARTED_MARKER = "@@torchmn-rank-started@@"

# What the launcher writes to a watcher's stdin to have a signal sent to the rank's process group
# (Ctrl-C reaches remote ranks as SIGINT, as it reaches local ones): "signal 2\n".
SIGNAL_LINE = b"signal "
# ... and to have a notification passed on to the rank, which keeps running (SIGUSR1/SIGUSR2, as a
# batch system sends them before the time limit): "relay 10\n".
RELAY_LINE = b"relay "

# How long the watcher waits, after SIGTERM, before it sends SIGKILL to what is left.
WATCHER_GRACE_SECONDS = 3.0

# Set on a remote rank's ssh command line where the -x variables follow the token on its stdin.
EXPORTS_ON_STDIN = "TORCHMN_EXPORTS_ON_STDIN"
# The longest exports line the watcher reads (the variables of one job: well under this).
_EXPORTS_LIMIT = 1 << 20


def exports_line(values: Mapping[str, str]) -> bytes:
    """The line that carries the ``-x`` variables to a remote rank's watcher (after the token).

    Args:
        values: the variables.

    Returns:
        ``exports <base64 of their JSON>``, newline included.

    Example::

        >>> exports_line({"A": "1"})
        b'exports eyJBIjogIjEifQ==\\n'
    """
    return b"exports " + base64.b64encode(json.dumps(dict(values)).encode()) + b"\n"


def read_exports_line(fd: int) -> Optional[Dict[str, str]]:
    """Read :func:`exports_line` from ``fd`` (the watcher's stdin), leaving what follows for the
    stdin reader (``torchmn.run.store.auth.read_line``).

    Args:
        fd: the file descriptor.

    Returns:
        The variables, or None when the stream ended first or the line is not an exports line.

    Example::

        >>> r, w = os.pipe(); _ = os.write(w, exports_line({"A": "1"})); read_exports_line(r)
        {'A': '1'}
    """
    line = read_line(fd, _EXPORTS_LIMIT)
    if line is None or not line.startswith(b"exports "):
        return None
    try:
        values = json.loads(base64.b64decode(line[len(b"exports "):-1]))
    except ValueError:
        return None
    return {str(k): str(v) for k, v in values.items()} if isinstance(values, dict) else None
