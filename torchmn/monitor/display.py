"""The monitor's table: one row per rank (steps/s, step time median and p95, share of the step
spent waiting, busy time, CPU, memory, GPU), refreshed in place on a terminal (``rich.live``) or
printed every :data:`REPORT_S` seconds into a log, and the summary at the end (``summary.describe``).

``torchmn run --monitor`` shows it on the launcher's terminal; under srun, mpirun and torchrun with
``TORCHMN_MONITOR=1``, rank 0 shows it on its stderr. Either reads the ranks' figures from the
job's store (``publisher.key``)."""
from __future__ import annotations

import io
import json
import sys
import threading
import time
from typing import Callable, Dict, Optional, TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from torchmn.monitor import publisher, summary

REFRESH_S = 2.0
FINAL_TITLE = "torchmn monitor: the job's end"
# Without a terminal (a log file, a pipe) the table is printed whole, this often.
REPORT_S = 10.0


def read_store(store, size: int) -> Dict[int, dict]:
    """Every rank's latest figures in the job's store.

    Args:
        store: the job's store (a ``torch.distributed`` store client).
        size: the number of ranks.

    Returns:
        The figures by rank, for the ranks that sent some; empty where the store is gone.

    Example::

        >>> read_store(world.job_store(), comm.size)   # doctest: +SKIP
        {0: {'steps': 120, 'step_ms': 31.5, ...}, 1: {...}}
    """
    out = {}
    try:
        for r in range(size):
            k = publisher.key(r)
            if store.check([k]):
                out[r] = json.loads(store.get(k))
    except Exception:  # noqa: BLE001 - the store went with the job's end
        return out
    return out


def table(snapshots: Dict[int, dict], size: int, title: str = "torchmn monitor") -> Table:
    """The per-rank table of ``snapshots``.

    Args:
        snapshots: each rank's latest figures (``Publisher.snapshot``).
        size: the number of ranks (ranks without figures show dashes).
        title: the table's title.

    Returns:
        A ``rich.table.Table``.

    Example::

        >>> Console().print(table({0: {"steps": 10, "step_ms": 31.5}}, 2))   # doctest: +SKIP
    """
    t = Table(title=title, title_justify="left")
    for name in ("rank", "host", "steps", "steps/s", "step ms", "p95 ms", "busy ms", "waiting", "CPU %",
                 "RSS MB", "GPU %", "now"):
        t.add_column(name, justify="left" if name in ("host", "now") else "right", no_wrap=name == "now")
    for r in range(size):
        s = snapshots.get(r, {})
        t.add_row(str(r), s.get("host", "-"), _n(s.get("steps"), "{:d}"), _n(s.get("steps_per_s"), "{:.1f}"),
                  _n(s.get("step_ms"), "{:.1f}"), _n(s.get("step_p95_ms"), "{:.1f}"), _n(s.get("busy_ms"), "{:.1f}"),
                  _n(s.get("wait_share"), "{:.0%}"), _n(s.get("cpu_percent"), "{:.0f}"),
                  _n(s.get("rss_mb"), "{:.0f}"), _n(s.get("gpu_percent"), "{:.0f}"), now(s))
    return t


# A rank whose step has lasted this long, and this many times its median step, is shown as held up.
HELD_S = 2.0
HELD_RATIO = 5.0


def now(snapshot: dict) -> str:
    """What a rank is at, where its current step has lasted far longer than its steps do: waiting
    for the others in a collective, or busy (its own work: the one the others wait for).

    Args:
        snapshot: a rank's figures.

    Returns:
        ``"busy 35 s"`` or ``"waiting 35 s"`` for a held-up step; ``"-"`` otherwise, and for a
        rank that ended.

    Example::

        >>> now({"since_step_s": 35.0, "waiting_now_s": None, "step_ms": 12.0})
        'busy 35 s'
    """
    since = snapshot.get("since_step_s")
    usual = (snapshot.get("step_ms") or 0.0) / 1e3
    if snapshot.get("final") or since is None or since < max(HELD_S, HELD_RATIO * usual):
        return "-"
    return f"{'waiting' if snapshot.get('waiting_now_s') is not None else 'busy'} {since:.0f} s"


def _n(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def as_text(snapshots: Dict[int, dict], size: int, width: int = 120, title: str = "torchmn monitor") -> str:
    """The table as plain text, for logs.

    Args:
        snapshots: each rank's figures.
        size: the number of ranks.
        width: the line width to fit.
        title: the table's title.

    Returns:
        The table's lines, joined, without colours.

    Example::

        >>> print(as_text({0: {"steps": 10}}, 1))   # doctest: +SKIP
    """
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(table(snapshots, size, title))
    return buffer.getvalue().rstrip("\n")


class Display:
    """Shows the table while the job runs, on a thread of its own, and the summary at the end.

    Args:
        read: returns every rank's latest figures (``read_store`` bound to the store).
        size: the number of ranks.
        show: writes one message (the launcher's console, or a rank's stderr) where there is no
            terminal to refresh in place.
        stream: the terminal, if it is one (the live table goes there), else None.

    Example::

        >>> display = Display(lambda: read_store(store, 4), 4, print, None)
        >>> display.start(); ...; display.finish()
    """

    def __init__(self, read: Callable[[], Dict[int, dict]], size: int, show: Callable[[str], None],
                 stream: Optional[TextIO] = None):
        self.read, self.size, self.show = read, size, show
        self.live = None
        if stream is not None and stream.isatty():
            self.live = Live(table({}, size), console=Console(file=stream), refresh_per_second=1 / REFRESH_S,
                             auto_refresh=False, transient=False)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="torchmn-monitor-display", daemon=True)

    def start(self) -> None:
        """Start refreshing.

        Example::

            >>> display.start()
        """
        if self.live is not None:
            self.live.start()
        self.thread.start()

    def print_above(self, text: str) -> bool:
        """Print ``text`` above the live table (a rank's output line).

        Args:
            text: the line, with its end.

        Returns:
            False where there is no live table (the caller writes the line itself).

        Example::

            >>> console.above = display.print_above
        """
        live = self.live
        if live is None or self.stopped.is_set():
            return False
        live.console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        return True

    def _loop(self) -> None:
        last_report = time.monotonic()
        while not self.stopped.wait(REFRESH_S):
            snapshots = self.read()
            if self.live is not None:
                self.live.update(table(snapshots, self.size), refresh=True)
            elif time.monotonic() - last_report >= REPORT_S and snapshots:
                last_report = time.monotonic()
                self.show(as_text(snapshots, self.size))

    def finish(self, wait_final_s: float = 0.0) -> None:
        """Stop refreshing and show the last table and the summary.

        Args:
            wait_final_s: how long to wait for every rank's final figures (sent as each ends).

        Example::

            >>> display.finish(wait_final_s=4.0)
        """
        self.stopped.set()
        self.thread.join(timeout=2 * REFRESH_S)
        deadline = time.monotonic() + wait_final_s
        snapshots = self.read()
        while time.monotonic() < deadline and not all(s.get("final") for s in snapshots.values()):
            time.sleep(0.1)
            snapshots = self.read()
        words = "\n".join(f"torchmn monitor: {line}" for line in summary.describe(snapshots))
        if self.live is not None:
            self.live.update(table(snapshots, self.size, FINAL_TITLE), refresh=True)
            self.live.stop()
            self.show(words)
        else:
            self.show(as_text(snapshots, self.size, title=FINAL_TITLE) + "\n" + words)


def show_on_stderr(text: str) -> None:
    """Write one message to this process's stderr (rank 0's display under other launchers).

    Args:
        text: the message; a newline is added where it has none.

    Example::

        >>> show_on_stderr("torchmn monitor: ...")   # doctest: +SKIP
    """
    sys.stderr.write(text if text.endswith("\n") else text + "\n")
    sys.stderr.flush()
