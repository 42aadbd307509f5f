"""The job's processes on this machine: starting the ranks, and ending them and all they started.

Local ranks, and the ssh clients of remote ones, lead process groups of their own; the kernel
sends each SIGTERM if the launcher dies (``die_with_launcher``), the guardian ends what is left
(``start_guardian``), and teardown finds what a rank detached from its group (``Supervisor``).
How the pieces fit is in ``docs/design/launcher.md``.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set

from torchmn.run.config import RunError
from torchmn.run.plan import JOB_ID, Slot
from torchmn.run.processes import binding, guardian, tree
from torchmn.run.processes.groups import (PR_SET_PDEATHSIG, become_subreaper, prctl, rank_group_alive,
                                           signal_rank_group)
from torchmn.run.processes.output import Console, RankOutput, open_log
from torchmn.run.remote.protocol import RELAY_LINE, SIGNAL_LINE, WATCHER_GRACE_SECONDS


def die_with_launcher() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that has the kernel send the child SIGTERM when the launcher dies, even by
    SIGKILL (which the launcher cannot forward), so that no rank outlives it.

    libc is looked up here, in the launcher: the child only makes the one call, as little as
    possible between fork and exec. The death signal follows the thread that started the child,
    so children must be started from the launcher's main thread.

    The child exits at once (status 1) when the launcher has already died by the time it runs.

    Returns:
        The function, or None where Linux's ``prctl(PR_SET_PDEATHSIG)`` is not there.

    Example::

        >>> subprocess.Popen(["python", "train.py"], preexec_fn=die_with_launcher(),   # doctest: +SKIP
        ...                  start_new_session=True)
    """
    call = prctl()
    if call is None:
        return None
    launcher = os.getpid()

    def set_death_signal():
        call(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the call: no signal would come
            os._exit(1)
    return set_death_signal


def start_guardian(job_id: str, grace: float) -> Optional[subprocess.Popen]:
    """Start the process that ends the job's local processes if this launcher dies without ending
    them (see :mod:`torchmn.run.processes.guardian`).

    The guardian runs ``python -m torchmn.run.processes.guardian TORCHMN_JOB_ID <job_id> <grace>``
    in a session of its own, its stdout and stderr discarded.

    Args:
        job_id: the job's ``JOB_ID`` value, which every local rank and its children carry.
        grace: seconds between SIGTERM and SIGKILL.

    Returns:
        The guardian, whose stdin the launcher holds; None where it could not start, or on a system
        without Linux's ``prctl`` (the kernel's death signal to each rank still applies where there
        is one).

    Example::

        >>> guardian_process = start_guardian("node1-4120-1718000000000000000", grace=3.0)   # doctest: +SKIP
        >>> guardian_process.stdin.write(b"done\\n"); guardian_process.stdin.close()   # doctest: +SKIP
    """
    if prctl() is None:  # not Linux: no /proc to find the job's processes in
        return None
    # The guardian starts with the signals it ignores blocked (a signal mask survives fork and exec),
    # so one that arrives while its interpreter starts waits for it instead of ending it.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, guardian.IGNORED)
    try:
        return subprocess.Popen([sys.executable, "-m", guardian.__name__, JOB_ID, job_id, str(grace)],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    except OSError:
        return None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def tell_watcher(process: subprocess.Popen, sig: int, line: bytes = SIGNAL_LINE) -> None:
    """Have a remote rank's watcher send ``sig`` to the rank.

    Writes ``line`` and the signal's number on the ssh client's stdin (``relay 10`` for SIGUSR1
    relayed). Does nothing when the client has no stdin, and ignores a stdin that is already
    closed or broken.

    Args:
        process: the rank's ssh client, whose stdin reaches the watcher.
        sig: the signal number.
        line: ``SIGNAL_LINE`` (the rank is being stopped) or ``RELAY_LINE`` (a notification).

    Example::

        >>> tell_watcher(rank.process, signal.SIGUSR1, RELAY_LINE)   # doctest: +SKIP
    """
    if process.stdin is not None:
        try:
            process.stdin.write(line + b"%d\n" % sig)
            process.stdin.flush()
        except (OSError, ValueError):
            pass


def close_stdin(process: subprocess.Popen) -> None:
    """Close a child's stdin, if it has one: for a remote rank, the watcher then stops the rank.

    An error closing it is ignored.

    Args:
        process: the child.

    Example::

        >>> close_stdin(rank.process)   # doctest: +SKIP
    """
    if process.stdin is not None:
        try:
            process.stdin.close()
        except OSError:
            pass


def _children() -> Set[int]:
    import psutil

    try:
        return {child.pid for child in psutil.Process().children()}
    except psutil.Error:
        return set()


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Rank:
    """One started rank: its process (for a remote rank, its ssh client) and its output.

    Attributes:
        slot: the rank's place.
        process: the process started.
        is_remote: it runs on another host, through ssh and the watcher.
        pgid: its process group (it leads a group of its own).
        returncode: how it ended, once it has.
        stopped_by_launcher: it was still running when the launcher stopped the job.
        output: its output readers (see ``RankOutput``).
    """

    def __init__(self, slot: Slot, process: subprocess.Popen, console: Console, log, is_remote: bool = False):
        """Keep the rank's process and start reading its output (see ``RankOutput``).

        Args:
            slot: the rank's place.
            process: the process started, in a session of its own (its pid is its process group),
                with its stdout and stderr piped.
            console: where its output is shown.
            log: its log file (binary, open for writing), or None.
            is_remote: it runs on another host, through ssh and the watcher; it counts as started
                only once the watcher says so.

        Example::

            >>> rank = Rank(slot, process, Console(None), None)   # doctest: +SKIP
        """
        self.slot = slot
        self.process = process
        self.is_remote = is_remote
        self.pgid = process.pid  # start_new_session=True makes the rank the leader of its own group
        self.returncode: Optional[int] = None
        self.stopped_by_launcher = False
        self.output = RankOutput(slot.rank, process.stdout, process.stderr, console, log, wait_for_marker=is_remote)

    @property
    def started(self) -> bool:
        """Whether the rank started: at once for a local rank, at its watcher's marker for a remote one."""
        return self.output.started


class Supervisor:
    """Starts the job's ranks on this machine's side and ends them, and everything they started.

    Args:
        job_id: the job's ``JOB_ID`` value.
        grace: seconds between the first signal and SIGKILL.

    Attributes:
        ranks: the ranks started, in rank order.
        death_signal: the ``preexec_fn`` of every child (see ``die_with_launcher``); the supervisor
            must be made in the thread that starts the ranks.
        guardian: the guardian process, once started.
    """

    def __init__(self, job_id: str, grace: float):
        self.job_id = job_id
        self.grace = grace
        self.ranks: List[Rank] = []
        self.guardian: Optional[subprocess.Popen] = None
        self.death_signal = die_with_launcher()
        self.descendants: Dict[int, object] = {}
        self.adopts_orphans = False
        self.own_children: Set[int] = set()

    def prepare(self) -> None:
        """Get ready to start ranks; call once, before the first.

        Makes this process a subreaper where Linux allows, so that processes a rank detaches and
        leaves behind are adopted by the launcher (and found at teardown) rather than by init; and
        notes the children this process already has, which are never reaped here.

        Example::

            >>> procs = Supervisor("node1-4120-1718000000000000000", grace=3.0)
            >>> procs.prepare()
        """
        # Processes a rank detached (setsid, a daemon) and left behind when it exited come to the
        # launcher instead of init, so that teardown finds them however fast their rank ended.
        self.adopts_orphans = become_subreaper()
        # Children the process calling run() has of its own (and ours, the guardian): never
        # reaped here, so that their Popen objects keep their exit codes.
        self.own_children = _children()

    def start_guardian(self) -> None:
        """Start the guardian (see ``start_guardian``) for the ranks about to start here.

        Sets ``guardian``, None where it could not start; ``close`` tells it the job ended.

        Example::

            >>> procs.prepare(); procs.start_guardian()   # doctest: +SKIP
        """
        self.guardian = start_guardian(self.job_id, self.grace)
        if self.guardian is not None:
            self.own_children.add(self.guardian.pid)

    def start_rank(self, slot: Slot, argv: Sequence[str], env: Mapping[str, str], is_remote: bool,
                   log_path: Optional[str], console: Console,
                   on_exit: Callable[[Rank, int], None], log_header: Optional[str] = None) -> Rank:
        """Start one rank in a process group of its own, on this machine bound to its CPUs
        (``TORCHMN_BIND`` in ``env``; see :mod:`.binding`).

        Args:
            slot: the rank's place.
            argv, env: what to run, and its environment (for a remote rank: the ssh client).
            is_remote: the rank runs on another host; its stdin stays open, since closing it tells
                the watcher there to stop the rank.
            log_path: the rank's log file, or None.
            console: where its output is shown.
            on_exit: called from another thread with the rank and its return code when it exits.
            log_header: where given, the log file keeps what it holds (an earlier start's output)
                and gets this line, then the rank's output (see ``open_log``).

        Returns:
            The rank, also added to ``ranks``.

        Raises:
            RunError: the log file cannot be written, or the program cannot be started (exit code
                127 when it is not found, else 126).

        Example::

            >>> def on_exit(rank, code):
            ...     print(rank.slot.rank, "exited with", code)
            >>> rank = procs.start_rank(slot, ["python", "train.py"], env, False, None,  # doctest: +SKIP
            ...                         Console(None), on_exit)
        """
        # Opened first: a log that cannot be written must not leave a started rank behind.
        log = open_log(log_path, slot.rank, log_header)
        try:
            process = subprocess.Popen(list(argv), env=dict(env),
                                       stdin=subprocess.PIPE if is_remote else subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                       preexec_fn=binding.bind_in_child(None if is_remote else binding.for_rank(env),
                                                                        self.death_signal))
        except OSError as e:
            if log is not None:
                log.close()
            code = 127 if e.errno == errno.ENOENT else 126
            raise RunError(f"rank {slot.rank} on host {slot.host} could not start {argv[0]!r}: "
                           f"{e.strerror}. Check the command and its permissions.", exit_code=code) from e
        rank = Rank(slot, process, console, log, is_remote=is_remote)
        self.ranks.append(rank)
        threading.Thread(target=lambda: on_exit(rank, rank.process.wait()), daemon=True).start()
        return rank

    def running(self) -> List[Rank]:
        """The ranks still running.

        Returns:
            The ranks whose exit has not been handled yet (``returncode`` still None), in rank
            order.

        Example::

            >>> [rank.slot.rank for rank in procs.running()]   # doctest: +SKIP
            [0, 2, 3]
        """
        return [r for r in self.ranks if r.returncode is None]

    def relay(self, sig: int) -> int:
        """Pass a notification signal on to every running rank, which keeps running.

        Args:
            sig: the signal (SIGUSR1, SIGUSR2).

        A local rank's process group gets the signal itself; a remote rank gets it through its
        watcher, once the watcher has started.

        Returns:
            How many ranks are running.

        Example::

            >>> procs.relay(signal.SIGUSR1)   # doctest: +SKIP
            4
        """
        for rank in self.running():
            if not rank.is_remote:
                signal_rank_group(rank.process, sig, JOB_ID, self.job_id)
            elif rank.started:
                tell_watcher(rank.process, sig, RELAY_LINE)
        return len(self.running())

    def remember_descendants(self) -> None:
        """Note every process a rank started, so that teardown can find grandchildren that left the
        rank's process group (setsid, daemons). Called every 0.5 s and when teardown starts: such a
        process is found only if it was seen while its rank was still alive.

        As a subreaper, the launcher also notes the orphans it adopted that carry this job's
        ``JOB_ID``, and reaps adopted orphans that have ended (never its own other children).

        Example::

            >>> procs.remember_descendants()   # doctest: +SKIP
        """
        import psutil

        children = tree.look()  # one look for every rank: see torchmn.run.processes.tree
        for rank in self.ranks:
            if rank.returncode is not None:
                continue
            for pid in tree.descendants(rank.process.pid, children):
                if pid not in self.descendants:
                    try:
                        self.descendants[pid] = psutil.Process(pid)
                    except psutil.Error:
                        continue
        if self.adopts_orphans:
            ranks = {rank.process.pid for rank in self.ranks}
            for pid in children(os.getpid()):
                if pid in ranks:
                    continue
                try:  # only this job's: the launcher may run inside a process with children of its own
                    child = self.descendants.get(pid) or psutil.Process(pid)
                    if child.status() == psutil.STATUS_ZOMBIE:
                        if child.pid not in self.own_children:
                            # An orphan that ended: as init would, reap it, also one noted above while
                            # its parent still ran.
                            os.waitpid(child.pid, os.WNOHANG)
                            self.descendants.pop(child.pid, None)
                    elif child.pid not in self.descendants and child.environ().get(JOB_ID) == self.job_id:
                        self.descendants[child.pid] = child
                except (psutil.Error, ChildProcessError):
                    continue

    def anything_left(self) -> bool:
        """Whether anything of the job still runs here.

        Returns:
            True while a rank, a member of a rank's process group, or a noted descendant runs.

        Example::

            >>> procs.stop(signal.SIGTERM)   # doctest: +SKIP
            >>> while procs.anything_left():   # doctest: +SKIP
            ...     time.sleep(0.05)
        """
        if self.running():
            return True
        for rank in self.ranks:
            if rank_group_alive(rank.process, JOB_ID, self.job_id):
                return True
        return any(_alive(child) for child in self.descendants.values())

    def stop(self, first_signal: int, only: Optional[Sequence[Rank]] = None) -> None:
        """Send ``first_signal`` to every rank: to each local rank's process group, through the
        watcher to each remote rank. Ranks still running are marked ``stopped_by_launcher``.

        A remote rank whose watcher has not started yet has only its ssh client, which gets
        SIGTERM. Every remote rank's stdin is closed, which tells its watcher to stop the rank.

        Args:
            first_signal: the signal.
            only: these ranks alone (an elastic job's workers it no longer needs); None for all.

        Example::

            >>> procs.stop(signal.SIGINT)   # doctest: +SKIP
        """
        for rank in self.ranks if only is None else only:
            # An exit not handled yet may still have come before the stop (two ranks failing at once).
            if rank.returncode is None and rank.process.poll() is None:
                rank.stopped_by_launcher = True
            if rank.is_remote:
                if rank.started:  # the watcher sends the rank our signal, then stops it, then ssh exits
                    tell_watcher(rank.process, first_signal)
                close_stdin(rank.process)
                if not rank.started:  # no watcher yet: only the ssh client to stop
                    signal_rank_group(rank.process, signal.SIGTERM, JOB_ID, self.job_id)
            else:
                signal_rank_group(rank.process, first_signal, JOB_ID, self.job_id)

    def grace_after_stop(self) -> float:
        """How long to wait after ``stop`` before ``kill_all``.

        Returns:
            The grace period in seconds, plus, with remote ranks, the watchers' own grace period
            and time for ssh to report back.

        Example::

            >>> Supervisor("node1-4120-1718000000000000000", grace=3.0).grace_after_stop()
            3.0
        """
        return self.grace + (WATCHER_GRACE_SECONDS + 2.0 if any(r.is_remote for r in self.ranks) else 0.0)

    def kill_all(self) -> None:
        """SIGKILL to every rank's process group and every noted descendant; wait for the ranks.

        Notes the descendants once more first, and sets each rank's ``returncode``.

        Example::

            >>> procs.kill_all()   # doctest: +SKIP
        """
        import psutil

        self.remember_descendants()
        for rank in self.ranks:
            signal_rank_group(rank.process, signal.SIGKILL, JOB_ID, self.job_id)
        for child in self.descendants.values():
            try:
                child.kill()  # psutil checks the pid still names the same process
            except psutil.Error:
                continue
        for rank in self.ranks:
            rank.process.wait()
            rank.returncode = rank.process.returncode
            close_stdin(rank.process)

    def close(self) -> None:
        """Tell the guardian the ranks are done with, so that it exits doing nothing.

        Writes ``DONE`` and closes the guardian's stdin, then waits up to 5 s for it to exit.
        Does nothing when no guardian runs.

        Example::

            >>> procs.kill_all(); procs.close()   # doctest: +SKIP
        """
        if self.guardian is not None:
            try:
                self.guardian.stdin.write(guardian.DONE)
                self.guardian.stdin.close()
                self.guardian.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self.guardian = None
