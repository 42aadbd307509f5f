"""torchmn run's console and log output (torchmn.run.processes.output), over real pipes."""
import io
import os
import sys
import time

import pytest

from torchmn.run.processes.output import OPEN_LINE_S, Console, RankOutput


class Pipes:
    """A rank's stdout and stderr as two real pipes, read by a RankOutput."""

    def __init__(self, console, rank=0, log=None):
        out_r, self.out = os.pipe()
        err_r, self.err = os.pipe()
        self.output = RankOutput(rank, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"),
                                 console, log)

    def close(self):
        os.close(self.out)
        os.close(self.err)
        self.output.finish(idle=5.0)


class Shown:
    """What the console wrote to the launcher's stdout and stderr, kept whole (pytest's fd capture
    empties its file as it reads it, and loses what a reader thread writes meanwhile)."""

    def __init__(self, monkeypatch):
        self.stdout, self.stderr = io.StringIO(), io.StringIO()   # no fileno(): written with write()
        self.monkeypatch = monkeypatch

    def console(self):
        """A Console writing here. (Set in the test itself: pytest puts its own capture back on
        sys.stdout and sys.stderr between a fixture's set-up and the test.)"""
        self.monkeypatch.setattr(sys, "stdout", self.stdout)
        self.monkeypatch.setattr(sys, "stderr", self.stderr)
        return Console(None)

    @property
    def out(self):
        return self.stdout.getvalue()

    @property
    def err(self):
        return self.stderr.getvalue()


@pytest.fixture
def shown(monkeypatch):
    return Shown(monkeypatch)


def wait_for(shown, text, within=5.0):
    """Wait until the console has shown ``text`` (on either stream), else fail."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if text in shown.out or text in shown.err:
            return
        time.sleep(0.02)
    pytest.fail(f"{text!r} not shown within {within} s: {shown.out!r}, {shown.err!r}")


def test_a_line_left_open_is_shown_while_the_rank_waits(shown):
    """A progress bar or a prompt without its line end is shown once the rank pauses, and the rest
    of its line follows without a second prefix."""
    pipes = Pipes(shown.console())
    os.write(pipes.err, b"epoch 1: 50%")
    wait_for(shown, "[0] epoch 1: 50%", within=OPEN_LINE_S + 5)
    os.write(pipes.err, b" done\n")
    pipes.close()
    assert shown.err == "[0] epoch 1: 50% done\n"


def test_a_redraw_is_shown_as_it_happens_with_its_prefix(shown):
    """tqdm's "\\r<bar>" redraws: each is shown while the rank waits, not one redraw late."""
    pipes = Pipes(shown.console())
    os.write(pipes.err, b"\r 10%|#")
    wait_for(shown, "[0]  10%|#")
    os.write(pipes.err, b"\r 20%|##")
    wait_for(shown, "[0]  20%|##")
    os.write(pipes.err, b"\r100%|###\n")
    pipes.close()
    assert shown.err == "[0]  10%|#\r[0]  20%|##\r[0] 100%|###\n"


def test_a_line_written_in_two_pieces_stays_whole(shown):
    """print("x") under PYTHONUNBUFFERED writes "x", then "\\n": a line of another rank written
    between the two does not cut it."""
    console = shown.console()
    zero, one = Pipes(console, rank=0), Pipes(console, rank=1)
    os.write(zero.out, b"loss 0.25")
    os.write(one.out, b"ready\n")
    os.write(zero.out, b"\n")
    zero.close()
    one.close()
    assert sorted(shown.out.splitlines()) == ["[0] loss 0.25", "[1] ready"]


@pytest.mark.parametrize("rest,then", [(b" ok\n", "[0]  ok\n"), (b"", "")],
                         ids=["its_rest_on_a_line_of_its_own", "no_second_end_when_it_ends"])
def test_another_rank_s_line_ends_an_open_one(shown, rest, then):
    """Rank 1's line never runs on from rank 0's open one: rank 0's rest comes on a line of its own,
    and rank 0's output ending there adds no empty "[0] " line."""
    console = shown.console()
    zero, one = Pipes(console, rank=0), Pipes(console, rank=1)
    os.write(zero.out, b"downloading...")
    wait_for(shown, "[0] downloading...")
    os.write(one.out, b"ready\n")
    wait_for(shown, "[1] ready")
    if rest:
        os.write(zero.out, rest)
    zero.close()
    one.close()
    assert shown.out == "[0] downloading...\n[1] ready\n" + then


def test_a_line_left_open_at_the_end_gets_its_line_end(shown, tmp_path):
    log = open(tmp_path / "rank.0.log", "wb")
    pipes = Pipes(shown.console(), log=log)
    os.write(pipes.out, b"no newline")
    pipes.close()
    assert shown.out == "[0] no newline\n"
    assert (tmp_path / "rank.0.log").read_bytes() == b"no newline\n"


def test_stdout_and_stderr_keep_their_order_in_the_log(shown, tmp_path):
    """One reader takes both pipes, so the log holds a rank's lines in the order it wrote them
    (each written once the one before was read)."""
    log = open(tmp_path / "rank.0.log", "wb")
    pipes = Pipes(shown.console(), log=log)
    for i in range(40):
        os.write(pipes.err if i % 2 else pipes.out, b"line %d\n" % i)
        wait_for(shown, "[0] line %d\n" % i)
    pipes.close()
    assert (tmp_path / "rank.0.log").read_bytes() == b"".join(b"line %d\n" % i for i in range(40))


def test_the_failure_summary_tail_holds_whole_stderr_lines_only():
    pipes = Pipes(Console(set()))
    for piece in (b"Traceback (most recent", b" call last):\n", b"\r 50%", b"\r", b"ValueError: bad\n"):
        os.write(pipes.err, piece)
        time.sleep(OPEN_LINE_S * 2)
    pipes.close()
    assert list(pipes.output.tail) == ["Traceback (most recent call last):", "ValueError: bad"]


def test_only_whole_lines_go_above_the_live_table(shown):
    """While the monitor's table holds the terminal, a rank's line goes above it once whole; its
    redraws are left out."""
    console, above = shown.console(), []
    console.above = lambda text: above.append(text) or True
    pipes = Pipes(console)
    os.write(pipes.err, b"\r 50%")
    time.sleep(OPEN_LINE_S * 3)
    os.write(pipes.err, b"\r100%\n")
    os.write(pipes.out, b"epoch ")
    time.sleep(OPEN_LINE_S * 3)
    os.write(pipes.out, b"1\n")
    pipes.close()
    assert above == ["[0] 100%\n", "[0] epoch 1\n"] and (shown.out, shown.err) == ("", "")


def test_the_log_keeps_stdout_and_stderr_lines_apart(shown, tmp_path):
    """A stdout line left open, then a traceback on stderr: the traceback starts a line of the log."""
    log = open(tmp_path / "rank.0.log", "wb")
    pipes = Pipes(shown.console(), log=log)
    os.write(pipes.out, b"loading data...")
    wait_for(shown, "[0] loading data...")
    os.write(pipes.err, b"Traceback (most recent call last):\nValueError: bad\n")
    wait_for(shown, "[0] ValueError: bad")   # read before stdout ends
    pipes.close()
    assert (tmp_path / "rank.0.log").read_bytes() == b"loading data...\nTraceback (most recent call last):\nValueError: bad\n"


def test_finish_gives_up_on_a_pipe_something_left_behind_holds(shown):
    """The rank's stdout ended; its stderr is held open by a process it left behind: finish()
    waits for the idle time, not for that process."""
    pipes = Pipes(shown.console())
    os.write(pipes.out, b"done\n")
    os.close(pipes.out)
    wait_for(shown, "[0] done")
    started = time.monotonic()
    pipes.output.finish(idle=0.5)
    assert time.monotonic() - started < 5, "finish() waited on the held pipe"
    os.close(pipes.err)


def test_pipes_above_select_s_descriptor_limit_are_read(shown):
    """A launcher in a program holding many files gets pipe descriptors above 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1200:
        pytest.skip(f"this machine allows {hard} open files: no descriptor above 1024 to test with")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    try:
        read_out, write_out = os.pipe()
        read_err, write_err = os.pipe()
        high = [os.dup2(fd, 1100 + i) for i, fd in enumerate((read_out, read_err))]
        os.close(read_out)
        os.close(read_err)
        output = RankOutput(0, os.fdopen(high[0], "rb"), os.fdopen(high[1], "rb"), shown.console(), None)
        os.write(write_out, b"high\n")
        os.close(write_out)
        os.close(write_err)
        output.finish(idle=5.0)
        assert shown.out == "[0] high\n"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_log_that_cannot_be_written_stops_nothing(shown):
    """A full disk under --log-dir: said once; the pipes are still read (the rank never blocks on
    a full pipe) and the console still gets the output."""
    pipes = Pipes(shown.console(), log=open("/dev/full", "wb"))
    os.set_blocking(pipes.out, False)
    data, deadline = b"x" * 99 + b"\n", time.monotonic() + 30
    left = memoryview(data * 3000)   # 300 KB: several times a pipe's buffer
    while left and time.monotonic() < deadline:
        try:
            left = left[os.write(pipes.out, left):]
        except BlockingIOError:
            time.sleep(0.01)
    pipes.close()
    out, err = shown.out, shown.err
    assert not left, "the rank's pipe was not read"
    assert out.count("[0] " + "x" * 99 + "\n") == 3000
    assert err.count("rank 0's log file can no longer be written (No space left on device)") == 1, err
