"""The launcher's console and log output: each rank's lines, prefixed, and the words of the summary.

One reader thread per rank passes its stdout and stderr on, in the order they arrive, piece by
piece (``RankOutput``): to the console, under one lock that keeps ranks' lines apart (``Console``),
and to the rank's log file. A piece is a whole line, or the start of one left waiting
(a progress bar, a prompt), shown once the rank pauses. The summary of a failed job quotes the
rank's last traceback (``extract_traceback``) and how it ended (``describe_exit``).
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import select
import selectors
import signal
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, AbstractSet, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

from torchmn.run.config import RunError
from torchmn.run.remote.protocol import STARTED_MARKER

if TYPE_CHECKING:
    from torchmn.run.processes.supervisor import Rank

# Lines of each rank's stderr kept for the failure summary.
TAIL_LINES = 200

_LINE_END = re.compile(rb"\r\n|\r|\n")

# Seconds the start of a line waits for its end before it is shown as it is (a progress bar, a
# prompt): long enough that a line written in two pieces (print's text, then its "\n") stays whole.
OPEN_LINE_S = 0.1


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


def failure_summary(failed: "Rank", ranks: Sequence["Rank"], reported: Optional[str],
                    earlier: Sequence["Rank"] = ()) -> str:
    """The launcher's report of a job that a failed rank ended: which rank, how, what else
    failed, and its last traceback.

    Args:
        failed: the first rank that failed.
        ranks: every rank of the job on this machine's side.
        reported: another node's failure, reported before this one (multi-task Slurm step).
        earlier: ranks that failed before ``failed`` while the job went on without them (an
            elastic job, which ``failed`` ended when nobody was left to go on).

    Returns:
        The report, one line or more: the failed rank, its host and how it ended, and how many
        running ranks were stopped; the ranks that had failed before it (``earlier``) and those that
        failed on their own later; the ranks that had
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
    if earlier:
        lines.append(f"torchmn run: rank(s) {', '.join(str(r.slot.rank) for r in earlier)} had failed before it, "
                     f"and the job had gone on without them.")
    also = [r.slot.rank for r in ranks if r is not failed and r not in earlier and not r.stopped_by_launcher
            and r.returncode != 0]
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
    try:
        with made_folder(log_dir, keep):
            if not os.access(log_dir, os.W_OK | os.X_OK):
                raise RunError(f"cannot write to --log-dir {log_dir!r}: permission denied. "
                               f"Pass a directory you can write to.")
    except OSError as e:
        raise RunError(f"cannot create --log-dir {log_dir!r}: {e.strerror}. "
                       f"Pass a directory you can write to.") from e


@contextlib.contextmanager
def made_folder(folder: str, keep: bool = True) -> Iterator[None]:
    """Make ``folder`` and its missing parents for the body of the ``with``, which checks it.

    Args:
        folder: the folder.
        keep: False: remove again, when the body ends, the folders made here (``--dry-run``, which
            checks as the real run does and leaves nothing behind).

    Returns:
        A context manager: the folder exists inside it.

    Raises:
        OSError: the folder cannot be made.

    Example::

        >>> with made_folder("/tmp/a/b", keep=False):
        ...     os.access("/tmp/a/b", os.W_OK)
        True
    """
    made, path = [], os.path.abspath(folder)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        made.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        yield
    finally:
        if not keep:
            for each in made:  # deepest first
                with contextlib.suppress(OSError):
                    os.rmdir(each)


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


class _Splitter:
    """Cuts one pipe's bytes into pieces that end with "\\n", "\\r\\n" or a lone "\\r" (progress bars
    such as tqdm redraw their line with "\\r"), so each piece is passed on as soon as it is written;
    the start of a line is let go as it is once it has waited ``OPEN_LINE_S`` for its end.

    Each chunk is searched once, so a very long line costs time in proportion to its length.
    """

    def __init__(self):
        self.pending: List[bytes] = []   # the start of a line, not yet passed on
        self.since = 0.0                 # when its first bytes arrived
        # The last piece passed on had no line end (after the last flush: the rank left its last
        # line open).
        self.line_open = False

    def feed(self, chunk: bytes, now: float) -> List[bytes]:
        """The pieces ``chunk`` completes."""
        pieces = []
        if self.pending and self.pending[-1].endswith(b"\r"):  # a line end of its own, or half of "\r\n"
            if chunk.startswith(b"\n"):
                self.pending.append(b"\n")
                chunk = chunk[1:]
            pieces.append(self._take())
        start = 0
        for end in _LINE_END.finditer(chunk):
            if end.group() == b"\r" and end.end() == len(chunk):
                break  # maybe the first half of "\r\n": wait for the next chunk
            self.pending.append(chunk[start:end.end()])
            pieces.append(self._take())
            start = end.end()
        if start < len(chunk):
            if not self.pending:
                self.since = now
            self.pending.append(chunk[start:])
        return pieces

    def due(self) -> Optional[float]:
        """When the start of a line waiting here is to be let go as it is; None when none waits."""
        return self.since + OPEN_LINE_S if self.pending else None

    def flush(self) -> List[bytes]:
        """The start of a line waiting here, as a piece of its own (nothing when none waits)."""
        return [self._take()] if self.pending else []

    def _take(self) -> bytes:
        piece = b"".join(self.pending)
        self.pending = []
        self.line_open = not piece.endswith((b"\n", b"\r"))
        return piece


class Console:
    """Writes the ranks' output to the launcher's stdout/stderr under one lock, each line with its
    rank's prefix, so ranks' lines never run into each other.

    A rank may leave its line open (a progress bar, a prompt): the rest of it follows without a
    second prefix, a "\\r" redraws it with its prefix, and another rank's line first ends it.

    Args:
        output_ranks: the ranks whose lines are shown; None for all.
    """

    def __init__(self, output_ranks: Optional[AbstractSet[int]]):
        self.lock = threading.Lock()
        self.output_ranks = output_ranks
        self.lost: set = set()   # streams that failed: written no more
        # While the monitor's live table holds the terminal, whole lines go above it through this
        # (it returns False when it did not take the line).
        self.above: Optional[Callable[[str], bool]] = None
        # The line the cursor is on, when a rank left it open: (rank, stream, at its start, after
        # a "\r"), else None.
        self.open: Optional[Tuple[int, object, bool]] = None
        self.unfinished: Dict[Tuple[int, bool], bytes] = {}   # line starts held back from `above`

    def write(self, rank: int, piece: bytes, to_stderr: bool) -> None:
        """Show a piece of a rank's output, with its ``[rank]`` prefix where it starts a line.

        A piece of a rank not in ``output_ranks`` is dropped, and so is every piece to a stream
        that failed once (a closed pipe, a full disk): the job goes on.

        Args:
            rank: the rank.
            piece: a line with its end (``\\n``, ``\\r\\n`` or ``\\r``), or the start or the rest
                of one.
            to_stderr: it came from the rank's stderr.

        Example::

            >>> Console(None).write(1, b"epoch 0: loss 0.25\\n", to_stderr=False)   # doctest: +SKIP
            [1] epoch 0: loss 0.25
        """
        if self.output_ranks is not None and rank not in self.output_ranks:
            return
        stream = sys.stderr if to_stderr else sys.stdout
        with self.lock:
            if stream is None or stream in self.lost:
                return
            if self.above is not None:
                # The table is redrawn below the output: only whole lines can go above it.
                key = (rank, to_stderr)
                piece = self.unfinished.pop(key, b"") + piece
                if piece.endswith(b"\r"):
                    return  # a progress bar's redraw: its last state comes with its line end
                if not piece.endswith(b"\n"):
                    self.unfinished[key] = piece
                    return
                self._end_open_line(None)
                if self.above((b"[%d] " % rank + piece).decode("utf-8", "replace")):
                    return
            continues = self.open is not None and self.open[:2] == (rank, stream) and not self.open[2]
            if piece == b"\r" and not continues:
                return  # a "\r" at the start of a rank's line moves nothing
            self._end_open_line((rank, stream))
            data = piece if continues else b"[%d] " % rank + piece
            if piece.endswith(b"\n"):
                self.open = None
            else:
                self.open = (rank, stream, piece.endswith(b"\r"))
            self._write(stream, data)

    def end_line(self, rank: int, to_stderr: bool) -> None:
        """End the line a rank left without an end when its output ended (nothing where another
        rank's line, or a launcher message, has ended it already).

        Args:
            rank: the rank.
            to_stderr: its stderr's line (else its stdout's).

        Example::

            >>> console.end_line(0, to_stderr=False)   # doctest: +SKIP
        """
        if self.output_ranks is not None and rank not in self.output_ranks:
            return
        stream = sys.stderr if to_stderr else sys.stdout
        with self.lock:
            unfinished = self.unfinished.pop((rank, to_stderr), None)
            if unfinished is not None and self.above is not None and \
                    self.above((b"[%d] " % rank + unfinished + b"\n").decode("utf-8", "replace")):
                return
            if unfinished is not None:  # the table went away meanwhile: the line goes out as it is
                self._end_open_line(None)
                self.open = None
                self._write(stream, b"[%d] " % rank + unfinished + b"\n")
            elif self.open is not None and self.open[:2] == (rank, stream):
                self.open = None
                self._write(stream, b"\n")

    def _end_open_line(self, keep: Optional[Tuple[int, object]]) -> None:
        """End the line a rank left open, unless it is ``keep``'s (rank, stream)."""
        if self.open is not None and self.open[:2] != keep:
            open_stream, self.open = self.open[1], None
            if open_stream not in self.lost:
                self._write(open_stream, b"\n")

    def _write(self, stream, data: bytes) -> None:
        try:
            _write_whole(stream, data)
        except (OSError, ValueError):
            # The reader went away (`torchmn run ... | head`), the disk is full, the stream was
            # closed: the job goes on, and its log files stay whole, so the rest of this stream
            # goes nowhere. (Stopping to read the rank's pipe would block the rank.)
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
            self._end_open_line(None)
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
    """A started rank's output: its stdout and stderr, read by one thread of their own in the order
    they arrive, go to the console and its log file; the last ``TAIL_LINES`` stderr lines are kept
    for the summary.

    Args:
        rank: the rank, for the console prefix.
        stdout, stderr: the rank's pipes.
        console: where its output is shown.
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
        # Since when the reader has been waiting on the pipes; None while it passes output on.
        self.waiting_since: Optional[float] = None
        self.console = console
        self.pipes = (stdout, stderr)
        self._stderr_line = b""   # the start of a stderr line, for the tail
        self._log_open: Optional[bool] = None   # the stream (is_stderr) whose line the log has open
        self.broken = False   # passing output on failed: the pipes are only drained
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        # selectors, not select.select: a launcher run from a program holding many files gets pipe
        # descriptors above select's limit of 1024.
        selector = selectors.DefaultSelector()
        for pipe, is_stderr in zip(self.pipes, (False, True)):
            selector.register(pipe.fileno(), selectors.EVENT_READ, (pipe, _Splitter(), is_stderr))
        try:
            while selector.get_map():
                self._read_once(selector)
        finally:
            selector.close()
            for pipe in self.pipes:
                pipe.close()
            if self.log is not None:
                self.log.close()

    def _read_once(self, selector: selectors.BaseSelector) -> None:
        """Wait for output (or for a line's start to be due), and pass on what came."""
        reading = [key.data for key in selector.get_map().values()]
        # The watcher's marker comes whole: stdout's start is never let go before it.
        due = [s.due() for _, s, is_stderr in reading if (is_stderr or self.started) and s.due() is not None]
        self.waiting_since = time.monotonic()
        events = selector.select(max(0.0, min(due) - self.waiting_since) if due else None)
        self.waiting_since = None
        now = time.monotonic()
        for key, _ in events:
            pipe, splitter, is_stderr = key.data
            try:
                chunk = os.read(key.fd, 65536)
            except OSError:
                chunk = b""
            if chunk:
                self._pass_on(splitter.feed(chunk, now), is_stderr)
                continue
            # Closed at once: a process the rank left behind may hold the other pipe, and finish()
            # must see this one ended.
            selector.unregister(key.fd)
            pipe.close()
            self._pass_on(splitter.flush(), is_stderr)
            if splitter.line_open:
                self._end_line(is_stderr)
        for _, splitter, is_stderr in reading:
            if (is_stderr or self.started) and splitter.due() is not None and splitter.due() <= now:
                self._pass_on(splitter.flush(), is_stderr)

    def _pass_on(self, pieces: List[bytes], is_stderr: bool) -> None:
        """Pieces of one stream to the tail, the log and the console. Whatever goes wrong here, the
        pipes are still read to their end: a rank whose pipe fills up would block."""
        marker = STARTED_MARKER.encode() + b"\n"
        for piece in pieces:
            if not is_stderr and not self.started and piece == marker:
                self.started = True
                continue
            if self.broken:
                continue
            try:
                if is_stderr:
                    self._keep_in_tail(piece)
                self._log(piece, is_stderr)
                self.console.write(self.rank, piece, is_stderr)
            except Exception as e:  # noqa: BLE001 - a fault here must not stop the reading
                self.broken = True
                self.console.message(f"torchmn run: rank {self.rank}'s output can no longer be passed on "
                                     f"({type(e).__name__}: {e}); the rest of it is dropped, and the job goes on")

    def _log(self, piece: bytes, is_stderr: bool) -> None:
        """Write a piece to the log, a stdout line and a stderr line never on one line of it."""
        if self.log is None:
            return
        try:
            if self._log_open is not None and self._log_open != is_stderr:
                self.log.write(b"\n")
            self.log.write(piece)
            self.log.flush()
        except (OSError, ValueError) as e:  # a full disk, a file removed from under it
            log, self.log = self.log, None
            with contextlib.suppress(OSError, ValueError):
                log.close()
            self.console.message(f"torchmn run: rank {self.rank}'s log file can no longer be written "
                                 f"({getattr(e, 'strerror', None) or e}); its output goes on to the console only")
            return
        self._log_open = None if piece.endswith(b"\n") else is_stderr

    def _end_line(self, is_stderr: bool) -> None:
        """The stream ended in the middle of a line: end it in the tail, the log and the console."""
        if is_stderr and self._stderr_line:
            self.tail.append(self._stderr_line.decode("utf-8", "replace"))
            self._stderr_line = b""
        if self.log is not None and self._log_open == is_stderr:
            self._log(b"\n", is_stderr)
        if not self.broken:
            self.console.end_line(self.rank, is_stderr)

    def _keep_in_tail(self, piece: bytes) -> None:
        """Whole stderr lines go to the tail; progress-bar redraws stay out of it."""
        if piece.endswith(b"\r"):
            self._stderr_line = b""
        elif piece.endswith(b"\n"):
            self.tail.append((self._stderr_line + piece).decode("utf-8", "replace").rstrip("\r\n"))
            self._stderr_line = b""
        elif len(self._stderr_line) < 65536:
            self._stderr_line += piece

    def finish(self, idle: float) -> None:
        """Wait for the rest of the rank's output, for as long as it keeps coming (a slow console
        takes what it takes: a reader blocked writing to it is not idle), but no longer than
        ``idle`` seconds of the reader waiting on silent pipes: a process the rank left behind may
        hold them open.

        The log file is closed once both pipes have ended.

        Args:
            idle: seconds of silence after which the reader is given up on.

        Example::

            >>> process.wait(); output.finish(idle=2.0)   # doctest: +SKIP
        """
        join_unless_idle(self.reader, lambda: self.waiting_since, idle,
                         lambda: any(readable(pipe) for pipe in self.pipes))


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
