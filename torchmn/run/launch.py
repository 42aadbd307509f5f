"""``run(config)``: a ``torchmn run`` job from start to teardown, restarted or elastic as asked.

The command line builds one ``LaunchConfig`` and calls this; it runs the job's starts through
``Restarts`` (``restarts.py``), each a ``Job`` (``job.py``), or an ``ElasticJob`` (``elastic.py``)
for ``--min-np``/``--max-np``.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Mapping, Optional

from torchmn.run.config import LaunchConfig
from torchmn.run.elastic import ElasticJob
from torchmn.run.job import FORWARDED_SIGNALS, RELAYED_SIGNALS, Job
from torchmn.run.restarts import Restarts


def run(config: LaunchConfig, env: Optional[Mapping[str, str]] = None) -> int:
    """Run a job as ``torchmn run`` would, from start to teardown, and again after a failure as
    ``config.max_restarts`` allows (see ``torchmn.run.restarts``).

    In the main thread, SIGINT, SIGTERM and SIGHUP (forwarded to the ranks, which are then
    stopped, and no restart follows) and SIGUSR1, SIGUSR2 (passed on) are handled for the job's
    length; a SIGHUP this process was started ignoring (``nohup``) stays ignored.

    Args:
        config: what to run, and how.
        env: the launcher's environment, which the ranks inherit (default: ``os.environ``).

    Returns:
        The exit code ``torchmn run`` would exit with (see ``Job.watch`` and ``Restarts.run``).

    Raises:
        RunError: the job cannot be run as asked; any rank already started has been stopped.

    Example::

        >>> run(LaunchConfig(["python", "-c", "import os; print(os.environ['RANK'])"], np=2, output_ranks={0}))
        [0] 0
        0
    """
    restarts = Restarts(config, os.environ if env is None else env, ElasticJob if config.elastic else Job)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main_thread:
        # Installed before the first rank starts, so a Ctrl-C during start-up still tears down. A
        # SIGHUP this process was started ignoring stays ignored, for it and its ranks: `nohup
        # torchmn run ...` outlives its terminal. (An ignored SIGINT is handled all the same: a
        # script's background job starts with it ignored, and a `kill -INT` from there means stop.)
        for sig in FORWARDED_SIGNALS + RELAYED_SIGNALS:
            if not (sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN):
                previous[sig] = signal.signal(sig, restarts.on_signal)
    try:
        return restarts.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
