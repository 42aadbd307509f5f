"""The launcher's console and log output: each rank's lines, prefixed, and the words of the summary.

Two reader threads per rank pass its output on line by line (``RankOutput``), to the console under
one lock (``Console``) and to the rank's log file; the summary of a failed job quotes the rank's
last traceback (``extract_traceback``) and how it ended (``describe_exit``).
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import select
import signal
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, AbstractSet, Callable, Deque, Dict, Iterator, List, Optional, Sequence

from torchmn.run.config import RunError
from torchmn.run.remote.protocol import STARTED_MARKER

if TYPE_CHECKING:
    from torchmn.run.processes.supervisor import Rank

# Lines of each rank's stderr kept for the failure summary.
TAIL_LINES = 200

_LINE_END = re.compile(rb"\r\n|\r|\n")


def extract_traceback(lines: Sequence[str]) -> List[str]:
    """The last Python traceback in ``lines``, from its "Traceback (most recent call last):" header
    to the end.

    Args:
        lines: a rank's last stderr lines.

    Returns:
        The traceback's lines; the last 20 lines when there is none.

    Example::

        >>> extract_traceback(["x", "Traceback (most recent call last):", '  File "a.py"', "E: b"])
        ['Traceback (most recent call last):', '  File "a.py"', 'E: b']
    """
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last):"):
            return list(lines[i:])
    return list(lines[-20:])


def describe_exit(returncode: int) -> str:
    """Plain words for a Popen return code.

    Args:
        returncode: the code (-N for a process killed by signal N).

    Returns:
        ``failed with exit code N`` or ``was killed by signal NAME (exit code 128+N)``.

    Example::

        >>> describe_exit(-9)
        'was killed by signal SIGKILL (exit code 137)'
    """
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by signal {name} (exit code {128 - returncode})"
    return f"failed with exit code {returncode}"


def exit_code_of(returncode: int) -> int:
    """A shell-style exit code.

    Args:
        returncode: a Popen return code (-N for a process killed by signal N).

    Returns:
        ``returncode``, or 128+N for a process killed by signal N.

    Example::

        >>> exit_code_of(-15), exit_code_of(3)
        (143, 3)
    """
    return 128 - returncode if returncode < 0 else returncode


def failure_summary(failed: "Rank", ranks: Sequence["Rank"], reported: Optional[str]) -> str:
    """The launcher's report of a job that a failed rank ended: which rank, how, what else
    failed, and its last traceback.

    Args:
        failed: the first rank that failed.
        ranks: every rank of the job on this machine's side.
        reported: another node's failure, reported before this one (multi-task Slurm step).

    Returns:
        The report, one line or more: the failed rank, its host and how it ended, and how many
        running ranks were stopped; the ranks that failed on their own later; the ranks that had
        ended with exit code 0 before (a cause where the failed rank waited for them); ``reported``; a
        note where exit code 255 may be ssh's own or SIGKILL the out-of-memory killer's; and the
        rank's last traceback (else its last 20 stderr lines).

    Example::

        >>> print(failure_summary(job.first_failure, job.ranks, None))   # doctest: +SKIP
        torchmn run: rank 1 (host node1) failed with exit code 1; stopped the other 1 running rank(s).
        ----- rank 1 stderr -----
        Traceback (most recent call last):
          File "train.py", line 12, in <module>
        ValueError: bad batch
        ------------------------------
    """
    code = failed.returncode
    stopped = sum(1 for r in ranks if r.stopped_by_launcher)
    lines = [f"torchmn run: rank {failed.slot.rank} (host {failed.slot.host}) {describe_exit(code)}"
             + (f"; stopped the other {stopped} running rank(s)." if stopped else ".")]
    also = [r.slot.rank for r in ranks if r is not failed and not r.stopped_by_launcher and r.returncode != 0]
    if also:
        lines.append(f"torchmn run: rank(s) {', '.join(map(str, also))} also failed on their own, later.")
    done = [r.slot.rank for r in ranks if r is not failed and r.returncode == 0 and not r.stopped_by_launcher]
    if done:
        lines.append(f"torchmn run: rank(s) {', '.join(map(str, done))} had ended with exit code 0 before: if rank "
                     f"{failed.slot.rank} was waiting for them in a collective, that is the cause (every rank must "
                     f"make the same collectives; a rank that leaves early breaks the others' next one).")
    if reported:
        lines.append(f"torchmn run: before that, on another node, {reported}.")
    if failed.is_remote and code == 255:
        lines.append(f"torchmn run: exit code 255 is also ssh's own: unless the rank's output above shows "
                     f"it exiting with 255 itself, the connection to host {failed.slot.host} failed or was lost.")
    if code == -signal.SIGKILL or (failed.is_remote and code == 128 + signal.SIGKILL):
        lines.append("torchmn run: SIGKILL often comes from the out-of-memory killer "
                     "(check `dmesg` or the job's memory limit).")
    tail = extract_traceback(list(failed.output.tail))
    if tail:
        lines.append(f"----- rank {failed.slot.rank} stderr -----")
        lines.extend(tail)
        lines.append("-" * 30)
    return "\n".join(lines)


def prepare_log_dir(log_dir: str, keep: bool = True) -> None:
    """Create ``--log-dir`` if needed and check that it can be written to.

    Args:
        log_dir: the directory.
        keep: False: remove again the folders this call made (``--dry-run``, which checks as the
            real run does and leaves nothing behind).

    Raises:
        RunError: it cannot be created or written to.

    Example::

        >>> import tempfile
        >>> prepare_log_dir(os.path.join(tempfile.mkdtemp(), "logs"))
    """
    made, path = [], os.path.abspath(log_dir)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        made.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(log_dir, exist_ok=True)
        if not os.access(log_dir, os.W_OK | os.X_OK):
            raise RunError(f"cannot write to --log-dir {log_dir!r}: permission denied. "
                           f"Pass a directory you can write to.")
    except OSError as e:
        raise RunError(f"cannot create --log-dir {log_dir!r}: {e.strerror}. "
                       f"Pass a directory you can write to.") from e
    finally:
        if not keep:
            for folder in made:  # deepest first
                with contextlib.suppress(OSError):
                    os.rmdir(folder)


def open_log(path: Optional[str], rank: int, header: Optional[str] = None) -> Optional[IO[bytes]]:
    """Open a rank's log file for writing.

    Args:
        path: the file, or None for no log.
        rank: the rank, for the error.
        header: a line to add to the file's end, after which the rank's output is added (a
            restart's: the earlier starts' output stays); None: the file starts empty.

    Returns:
        The binary file, or None when ``path`` is None.

    Raises:
        RunError: the file cannot be written.

    Example::

        >>> open_log(None, 0) is None
        True
        >>> log = open_log("logs/rank.0.log", 0)   # doctest: +SKIP
    """
    try:
        if not path:
            return None
        log = open(path, "wb" if header is None else "ab")
        if header is not None:
            log.write(f"{header}\n".encode())
            log.flush()
        return log
    except OSError as e:
        raise RunError(f"cannot write rank {rank}'s log file {path}: {e.strerror}. Choose another "
                       f"--log-dir, or make that path a writable file.") from e


def _lines(pipe: IO[bytes]) -> Iterator[bytes]:
    """The pipe's output in pieces that end with "\\n", "\\r\\n" or a lone "\\r" (progress bars such as
    tqdm redraw their line with "\\r"), so each piece gets its rank prefix as soon as it is written.
    Each chunk read is searched once, so a very long line costs time in proportion to its length."""
    pending: List[bytes] = []   # the start of a line still being written
    while True:
        chunk = pipe.read1(65536)
        if not chunk:
            break
        if pending and pending[-1].endswith(b"\r") and not chunk.startswith(b"\n"):
            yield b"".join(pending)  # that "\r" was a line end of its own
            pending = []
        start = 0
        for end in _LINE_END.finditer(chunk):
            if end.group() == b"\r" and end.end() == len(chunk):
                break  # maybe the first half of "\r\n": wait for the next chunk
            pending.append(chunk[start:end.end()])
            yield b"".join(pending)
            pending = []
            start = end.end()
        if start < len(chunk):
            pending.append(chunk[start:])
    if pending:
        yield b"".join(pending)


class Console:
    """Writes whole lines to the launcher's stdout/stderr under one lock, so lines never interleave.

    Args:
        output_ranks: the ranks whose lines are shown; None for all.
    """

    def __init__(self, output_ranks: Optional[AbstractSet[int]]):
        self.lock = threading.Lock()
        self.output_ranks = output_ranks
        self.lost: set = set()   # streams that failed: written no more
        # While the monitor's live table holds the terminal, lines go above it through this
        # (it returns False when it did not take the line).
        self.above: Optional[Callable[[str], bool]] = None

    def write(self, rank: int, line: bytes, to_stderr: bool) -> None:
        """Show one line of a rank's output, with its ``[rank]`` prefix.

        A line of a rank not in ``output_ranks`` is dropped, and so is every line to a stream that
        failed once (a closed pipe, a full disk): the job goes on.

        Args:
            rank: the rank.
            line: the line, with its end (``\\n``, ``\\r\\n`` or ``\\r``).
            to_stderr: it came from the rank's stderr.

        Example::

            >>> Console(None).write(1, b"epoch 0: loss 0.25\\n", to_stderr=False)   # doctest: +SKIP
            [1] epoch 0: loss 0.25
        """
        if self.output_ranks is not None and rank not in self.output_ranks:
            return
        stream = sys.stderr if to_stderr else sys.stdout
        # A bare "\r" (a progress bar clearing its line) only moves the cursor: no prefix for it.
        data = line if line == b"\r" else b"[%d] " % rank + line
        with self.lock:
            if stream is None or stream in self.lost:
                return
            above = self.above
            if above is not None and above(data.decode("utf-8", "replace")):
                return
            try:
                _write_whole(stream, data)
            except (OSError, ValueError):
                # The reader went away (`torchmn run ... | head`), the disk is full, the stream was
                # closed: the job goes on, and its log files stay whole, so the rest of this
                # stream goes nowhere. (Stopping to read the rank's pipe would block the rank.)
                self._lose(stream)

    def message(self, text: str) -> None:
        """Show one of the launcher's own messages on stderr (after flushing stdout).

        A newline is added when ``text`` does not end with one.

        Args:
            text: the message, one line or more.

        Example::

            >>> Console(None).message("torchmn run: received SIGINT; stopping the job")   # doctest: +SKIP
            torchmn run: received SIGINT; stopping the job
        """
        with self.lock:
            for stream, data in ((sys.stdout, None), (sys.stderr, text if text.endswith("\n") else text + "\n")):
                if stream is None or stream in self.lost:
                    continue
                try:
                    _write_whole(stream, data.encode() if data is not None else b"")
                except (OSError, ValueError):
                    self._lose(stream)

    def _lose(self, stream) -> None:
        self.lost.add(stream)
        _discard(stream)


def _write_whole(stream, data: bytes) -> None:
    """Write ``data`` to ``stream``, all of it, after what the stream holds already.

    A console whose descriptor is non-blocking (some CI runners and Node-based parents leave it so)
    refuses a write while its reader lags (``BlockingIOError``): wait for room, as a blocking one
    would, rather than take it for a reader that went away and drop the rest of the output.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (io.UnsupportedOperation)
        stream.write(data.decode("utf-8", "replace"))
        stream.flush()
        return
    while True:
        try:
            stream.flush()
            break
        except BlockingIOError:
            select.select([], [fd], [])
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            select.select([], [fd], [])


def _discard(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null (as Python's docs advise on SIGPIPE), so that
    later writes, and the flush at exit, neither fail nor block."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class RankOutput:
    """A started rank's output: its stdout and stderr, read by two threads of their own, go to the
    console and its log file; the last ``TAIL_LINES`` stderr lines are kept for the summary.

    Args:
        rank: the rank, for the console prefix.
        stdout, stderr: the rank's pipes.
        console: where lines are shown.
        log: the rank's log file, or None; closed once the output has ended.
        wait_for_marker: the rank is remote: it counts as started (``started``) once its watcher
            prints ``STARTED_MARKER``, a line that is dropped.
    """

    def __init__(self, rank: int, stdout: IO[bytes], stderr: IO[bytes], console: Console,
                 log: Optional[IO[bytes]], wait_for_marker: bool = False):
        self.rank = rank
        self.started = not wait_for_marker
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.log = log
        self.waiting_since: Dict[int, Optional[float]] = {}   # per reader thread: see _timed
        self.log_lock = threading.Lock()
        self.console = console
        self.pipes = (stdout, stderr)
        self.readers = [
            threading.Thread(target=self._read, args=(stdout, False), daemon=True),
            threading.Thread(target=self._read, args=(stderr, True), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, pipe: IO[bytes], is_stderr: bool) -> None:
        marker = STARTED_MARKER.encode() + b"\n"
        for line in self._timed(_lines(pipe)):
            if not is_stderr and not self.started and line == marker:
                self.started = True
                continue
            if not line.endswith((b"\n", b"\r")):
                line += b"\n"
            if is_stderr and line.endswith(b"\n"):  # progress-bar redraws stay out of the summary
                self.tail.append(line.decode("utf-8", "replace").rstrip("\r\n"))
            if self.log is not None:
                with self.log_lock:
                    self.log.write(line)
                    self.log.flush()
            self.console.write(self.rank, line, is_stderr)
        pipe.close()

    def _timed(self, lines: Iterator[bytes]) -> Iterator[bytes]:
        """``lines``, noting when a reader starts waiting on the pipe (None while it writes out)."""
        while True:
            self.waiting_since[threading.get_ident()] = time.monotonic()
            line = next(lines, None)
            self.waiting_since[threading.get_ident()] = None
            if line is None:
                return
            yield line

    def finish(self, idle: float) -> None:
        """Wait for the rest of the rank's output, for as long as it keeps coming (a slow console
        takes what it takes: a reader blocked writing to it is not idle), but no longer than
        ``idle`` seconds of a reader waiting on a silent pipe: a process the rank left behind may
        hold its pipes open.

        The log file is closed once both readers have ended.

        Args:
            idle: seconds of silence after which a reader is given up on.

        Example::

            >>> process.wait(); output.finish(idle=2.0)   # doctest: +SKIP
        """
        for reader, pipe in zip(self.readers, self.pipes):
            join_unless_idle(reader, lambda reader=reader: self.waiting_since.get(reader.ident), idle,
                             lambda pipe=pipe: readable(pipe))
        if self.log is not None and not any(r.is_alive() for r in self.readers):
            self.log.close()


def join_unless_idle(thread: threading.Thread, waiting_since: Callable[[], Optional[float]],
                     idle: float, ready: Callable[[], bool] = lambda: False) -> None:
    """Wait for ``thread``, a reader of a pipe, to end, however long it spends passing output on
    (to a slow or paused console), but give up once it has waited ``idle`` seconds on a silent
    pipe: something left behind holds the pipe open.

    Args:
        thread: the reader thread.
        waiting_since: returns when the reader started waiting on its pipe, or None while it is
            writing out what it read.
        idle: seconds of waiting on a silent pipe after which to give up.
        ready: whether the pipe has something to read (bytes, or its end): then it is not silent,
            however long the reader has been at it (a long line; a machine too busy to run it).

    Example::

        >>> t = threading.Thread(target=time.sleep, args=(0.1,)); t.start()
        >>> join_unless_idle(t, lambda: None, 1.0); t.is_alive()
        False
    """
    while thread.is_alive():
        thread.join(0.05)
        since = waiting_since()
        if since is not None and time.monotonic() - since >= idle and not ready():
            return


def readable(pipe) -> bool:
    """Whether reading ``pipe`` (a file object or a descriptor) would not block: it holds bytes,
    or every writer has closed it; False once it is closed here.

    Args:
        pipe: the pipe's read end.

    Returns:
        The answer.

    Example::

        >>> r, w = os.pipe(); readable(r), os.write(w, b"x") and readable(r)
        (False, True)
    """
    try:
        return bool(select.select([pipe], [], [], 0)[0])
    except (OSError, ValueError):
        return False
