"""What the launcher and a remote rank's watcher say to each other (``docs/design/launcher.md``).

The launcher's ssh client runs ``python -m WATCHER_MODULE -- COMMAND...`` on the remote host. The
watcher prints ``STARTED_MARKER`` once the rank is about to start; the launcher writes
``SIGNAL_LINE`` or ``RELAY_LINE`` lines to its stdin, and closes stdin to stop the rank.

Example::

    >>> SIGNAL_LINE + b"2\\n"
    b'signal 2\\n'
"""

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
