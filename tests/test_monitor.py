"""The monitor, the timeline and the doctor's straggler verdict, on real jobs: 3 ranks over gloo whose
rank 1 sleeps 50 ms per step (tests/workers/straggler.py), under torchmn run and torchrun."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import REPO, WORKERS, clean_env, run_two_node_launchers

from torchmn.monitor import summary, timeline

STRAGGLER = str(WORKERS / "straggler.py")


def _run(argv, timeout=100, env=None):
    proc = subprocess.run(argv, cwd=REPO, env=clean_env(env), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One torchmn run -np 3 --monitor --timeline job of 60 steps: its output and its timeline."""
    path = tmp_path_factory.mktemp("monitor") / "timeline.json"
    proc = _run([sys.executable, "-m", "torchmn", "run", "-np", "3", "--monitor", "--timeline", str(path),
                 sys.executable, STRAGGLER, "60"])
    return proc, path


def test_monitor_names_the_straggler_with_its_step_time(job):
    proc, _ = job
    own = {int(r): float(ms) for r, ms in re.findall(r"\[\d\] OWN (\d) ([\d.]+)", proc.stdout)}
    slowest = re.search(r"torchmn monitor: slowest: rank (\d) \(\S+\), busy ([\d.]+) ms per step", proc.stderr)
    assert slowest and slowest.group(1) == "1", proc.stderr
    assert abs(float(slowest.group(2)) - own[1]) <= 0.2 * own[1], (own, proc.stderr)
    assert "torchmn monitor: straggler: rank(s) 1 " in proc.stderr, proc.stderr


def test_monitor_shows_the_others_waiting_for_the_straggler(job):
    proc, _ = job
    shares = dict(re.findall(r"rank (\d) (\d+)%", proc.stderr.split("the others wait for it")[-1].splitlines()[0]))
    assert set(shares) == {"0", "2"} and all(int(v) >= 50 for v in shares.values()), proc.stderr
    assert re.search(r"torchmn monitor: waits most: rank [02] ", proc.stderr), proc.stderr
    # The last table: one row per rank, each with its 60 steps.
    final = proc.stderr.split("torchmn monitor: the job's end")[-1]
    rows = re.findall(r"^\W+(\d)\W+\S+\W+(\d+)\W", final, re.M)
    assert sorted(rows) == [("0", "60"), ("1", "60"), ("2", "60")], proc.stderr


def test_timeline_holds_every_ranks_phases_in_order(job):
    _, path = job
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert_rows_nest(events)
    assert not timeline.parts_of(str(path)), "the parts were joined and removed"
    for rank in range(3):
        mine = sorted((e for e in events if e["pid"] == rank and e["name"] in ("forward+backward", "average", "update")),
                      key=lambda e: e["ts"])
        names = [e["name"] for e in mine]
        # The first step has no previous step's end to start forward+backward from.
        assert names[:2] == ["average", "update"] and names[2:] == ["forward+backward", "average", "update"] * 59, names
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(mine, mine[1:])), "phases overlap"
    buckets = [e for e in events if e["name"] == "bucket 0" and e["cat"] == "average"]
    assert sorted({e["pid"] for e in buckets}) == [0, 1, 2] and len(buckets) == 3 * 60, len(buckets)
    collectives = {e["name"] for e in events if e["cat"] == "collective"}
    assert "allgather_obj" in collectives, collectives  # the communicator's set-up, recorded too


def test_timeline_png_is_drawn(job, tmp_path):
    _, path = job
    out = tmp_path / "timeline.png"
    proc = _run([sys.executable, "-m", "torchmn", "timeline", str(path), "--png", str(out), "--last", "0.5"])
    assert "phases into" in proc.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_monitor_and_timeline_under_torchrun(tmp_path):
    """TORCHMN_MONITOR=1 and TORCHMN_TIMELINE under another launcher: rank 0 shows the summary
    and joins the ranks' parts."""
    path = tmp_path / "trace.json"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 STRAGGLER, "40"], env={"TORCHMN_MONITOR": "1", "TORCHMN_TIMELINE": str(path)})
    assert re.search(r"torchmn monitor: slowest: rank 1 \(\S+\), busy", proc.stderr), proc.stderr
    pids = {e["pid"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1} and not timeline.parts_of(str(path))


def _stale_part(path, rank, size):
    """A part an earlier run of ``path`` left unjoined, written an hour ago."""
    import os
    import time
    stale = timeline.write_part(str(path), rank, size, [("stale", "update", 1.0, 2.0, "MainThread", None)])
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    return stale


@pytest.mark.parametrize("launcher", ["torchmn", "torchrun"])
def test_timeline_leaves_out_an_earlier_runs_parts(tmp_path, launcher):
    """Parts an earlier run of the same path left unjoined (its rank 0 gave up waiting) are not
    joined into this job's timeline, nor counted as this job's (so rank 0 waits for its own)."""
    path = tmp_path / "trace.json"
    _stale_part(path, 1, 2)
    _stale_part(path, 2, 3)
    if launcher == "torchmn":
        proc = _run([sys.executable, "-m", "torchmn", "run", "-np", "2", "--timeline", str(path), sys.executable,
                     STRAGGLER, "5"])
        assert "timeline of 2 rank(s) written" in proc.stderr + proc.stdout, proc.stderr
    else:
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", STRAGGLER, "5"],
             env={"TORCHMN_TIMELINE": str(path)})
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1} and not any(e["name"] == "stale" for e in events), events[:5]
    assert sum(1 for e in events if e["pid"] == 1 and e["name"] == "update") == 5


def test_timeline_merge_joins_parts_written_elsewhere(tmp_path):
    path = str(tmp_path / "t.json")
    for rank in (0, 1):
        timeline.write_part(path, rank, 3, [("update", "update", 100.0 + rank, 100.5 + rank, "MainThread", None)])
    proc = _run([sys.executable, "-m", "torchmn", "timeline", "merge", path])
    assert "joined 2 rank(s)" in proc.stdout and "missing: rank(s) 2" in proc.stdout
    events = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in events] == [(0, 0.0, 500000.0), (1, 1000000.0, 500000.0)]


def test_timeline_merge_keeps_the_parts_while_a_rank_is_missing(tmp_path):
    """A merge with a rank's part missing (on another host) keeps the parts it found: once the
    missing one is copied here, merging again joins all three; then they are removed."""
    path = str(tmp_path / "t.json")
    for rank in (0, 1):
        timeline.write_part(path, rank, 3, [("update", "update", 100.0 + rank, 100.5 + rank, "MainThread", None)])
    assert timeline.merge(path)[1:] == ([0, 1], 3, [])
    assert len(timeline.parts_of(path)) == 2
    timeline.write_part(path, 2, 3, [("update", "update", 102.0, 102.5, "MainThread", None)])
    proc = _run([sys.executable, "-m", "torchmn", "timeline", "merge", path])
    assert "joined 3 rank(s)" in proc.stdout and "missing" not in proc.stdout, proc.stdout
    assert {e["pid"] for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"} == {0, 1, 2}
    assert timeline.parts_of(path) == []


def test_timeline_merge_leaves_out_an_earlier_job_s_parts(tmp_path):
    """A 3-rank job's parts, then a 2-rank job's beside them: rank 2's part is not this job's. It is
    kept, named, and not joined."""
    path = str(tmp_path / "t.json")
    old = timeline.write_part(path, 2, 3, [("update", "update", 50.0, 50.7, "MainThread", None)])
    os.utime(old, (time.time() - 60, time.time() - 60))
    for rank in (0, 1):
        timeline.write_part(path, rank, 2, [("update", "update", 100.0 + rank, 100.5 + rank, "MainThread", None)])
    proc = _run([sys.executable, "-m", "torchmn", "timeline", "merge", path])
    assert "joined 2 rank(s)" in proc.stdout and "missing" not in proc.stdout, proc.stdout
    assert "left out 1 part(s) of another job" in proc.stderr and old in proc.stderr, proc.stderr
    assert {e["pid"] for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert timeline.parts_of(path) == [old]


def test_timeline_command_reads_a_trace_another_tool_wrote(tmp_path):
    """torch.profiler-style events: string and number pids mixed, no category."""
    trace = tmp_path / "prof.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "aten::mm", "pid": "host 1", "tid": 3, "ts": 0, "dur": 2000},
        {"ph": "X", "name": "aten::add", "pid": 7, "tid": 1, "ts": 10, "dur": 1000, "cat": "cpu_op"}]}))
    proc = _run([sys.executable, "-m", "torchmn", "timeline", str(trace)])
    assert "rank 7: cpu_op 1.0 ms (1x)" in proc.stdout and "rank host 1: ? 2.0 ms (1x)" in proc.stdout, proc.stdout
    proc = _run([sys.executable, "-m", "torchmn", "timeline", str(trace), "--png", str(tmp_path / "prof.png")])
    assert "drew 2 phases" in proc.stdout, proc.stdout


def test_timeline_command_counts_each_moment_of_a_thread_once(tmp_path):
    """Phases nested in others (a collective inside forward+backward, the wait inside average), a
    phase on the thread's second row overlapping one on its first, and buckets in flight on the
    averaging row: per rank, each moment of the training thread goes to its innermost phase, and
    the buckets in flight are a figure apart, so the times add up to at most the trace's span."""
    meta = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0 (a)"}}] + [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}
        for tid, name in ((0, "MainThread"), (1, "MainThread (2)"), (2, "averaging"))]
    phases = [(0, "forward+backward", "compute", 0, 10_000), (0, "allreduce_flat", "collective", 2_000, 1_000),
              (0, "average", "average", 10_000, 4_000), (0, "wait for averages", "average", 11_000, 3_000),
              (1, "allgather_obj", "collective", 13_000, 2_000),  # overlaps the end of average by 1 ms
              (0, "update", "update", 15_000, 1_000),
              (2, "bucket 0", "average", 3_000, 9_000), (2, "bucket 1", "average", 5_000, 8_000)]
    events = [{"ph": "X", "pid": 0, "tid": tid, "name": name, "cat": cat, "ts": ts, "dur": dur}
              for tid, name, cat, ts, dur in phases]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": meta + events}))
    out = _run([sys.executable, "-m", "torchmn", "timeline", str(trace)]).stdout
    assert out.splitlines() == ["rank 0 (a): averaging (waiting) 3.0 ms (2x), collective 3.0 ms (2x), "
                                "forward+backward 9.0 ms (1x), update 1.0 ms (1x); "
                                "averaging in flight 10.0 ms (2 buckets)"], out


def test_timeline_of_a_job_stopped_by_sigterm_is_written(tmp_path):
    """The ranks append their events every second: a job stopped by SIGTERM (scancel, a CI
    timeout), whose ranks never reach their exit handlers, still gets its timeline, up to the end."""
    import time

    path = tmp_path / "trace.json"
    launcher = subprocess.Popen([sys.executable, "-m", "torchmn", "run", "-np", "2", "--timeline", str(path),
                                 sys.executable, STRAGGLER, "100000"], cwd=REPO, env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                p.exists() and len(p.read_text().splitlines()) >= 3 for p in map(Path, timeline_parts(path, 2))):
            time.sleep(0.2)
        launcher.terminate()
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert "timeline of 2 rank(s) written" in err, err
    updates = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X" and e["name"] == "update"]
    assert {e["pid"] for e in updates} == {0, 1} and len(updates) >= 4, updates[:4]
    assert not timeline.parts_of(str(path))


def timeline_parts(path, size):
    return [timeline.part_path(str(path), r) for r in range(size)]


def test_timeline_rows_nest_where_phases_overlap():
    """Complete events on one row must nest (Perfetto drops those that overlap): phases of a
    thread that overlap without nesting (buckets in flight together) get a further row."""
    events = [("a", "average", 10.0, 12.0, "MainThread", None), ("b", "average", 11.0, 13.0, "MainThread", None),
              ("c", "compute", 11.5, 11.8, "MainThread", None), ("d", "update", 12.0, 12.5, "MainThread", None)]
    out = timeline.trace([(0, "h", events)])["traceEvents"]
    rows = {e["args"]["name"]: e["tid"] for e in out if e["name"] == "thread_name"}
    assert {e["name"]: e["tid"] for e in out if e["ph"] == "X"} == {
        "a": rows["MainThread"], "c": rows["MainThread"], "d": rows["MainThread"], "b": rows["MainThread (2)"]}
    assert_rows_nest(out)


def assert_rows_nest(trace_events):
    rows = {}
    for e in trace_events:
        if e["ph"] == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], round(e["ts"] + e["dur"], 1), e["name"]))
    for row, spans in rows.items():
        open_ends = []
        for ts, te, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= ts:
                open_ends.pop()
            assert not open_ends or te <= open_ends[-1], (row, name, ts, te, open_ends)
            open_ends.append(te)


def test_horovod_timeline_and_the_jobs_timeline_keep_their_own_events(tmp_path):
    """hvd.start_timeline/stop_timeline in a job recorded with --timeline: the Horovod file has the
    calls from its start on, the job's timeline keeps every call of the run."""
    whole, window = tmp_path / "whole.json", tmp_path / "window.json"
    _run([sys.executable, "-m", "torchmn", "run", "-np", "2", "--timeline", str(whole), sys.executable,
          str(WORKERS / "horovod_timeline_window.py"), str(window)])
    tensors = sorted({e["args"]["tensor"] for e in json.loads(window.read_text())["traceEvents"]
                      if e["ph"] == "X" and "tensor" in e["args"]})
    assert tensors == [f"step.{i}" for i in range(10, 15)], tensors
    calls = [(e["pid"], e["args"]["tensor"]) for e in json.loads(whole.read_text())["traceEvents"]
             if e["ph"] == "X" and "tensor" in e["args"]]
    assert sorted(calls) == sorted((r, f"step.{i}") for r in (0, 1) for i in range(25)), calls


def test_monitor_names_the_straggler_of_a_loop_in_a_thread():
    """Training in a thread of its own (as Ray Train runs it): its waiting counts, so the ranks
    it waits for are told from the one that is slow."""
    proc = _run([sys.executable, "-m", "torchmn", "run", "-np", "2", "--monitor", sys.executable, STRAGGLER, "40",
                 "--thread"])
    assert "torchmn monitor: straggler: rank(s) 1 " in proc.stderr, proc.stderr


def test_unwritable_monitor_folder_and_timeline_do_not_stop_training(tmp_path):
    """A monitor folder or a timeline the ranks cannot write is said on each rank, and the job
    trains on."""
    proc = _run([sys.executable, "-m", "torchmn", "run", "-np", "2", sys.executable, STRAGGLER, "3"],
                env={"TORCHMN_MONITOR_DIR": "/proc/no-such/monitor", "TORCHMN_TIMELINE": "/proc/no-such/t.json"})
    for rank in (0, 1):
        assert re.search(rf"rank {rank} on \S+: the monitor's folder /proc/no-such/monitor", proc.stderr), proc.stderr
        assert re.search(rf"rank {rank} on \S+: cannot write its part of the timeline /proc/no-such/t.json",
                         proc.stderr), proc.stderr
    assert "[1] OWN 1" in proc.stdout


def test_run_refuses_a_timeline_it_cannot_write_before_starting():
    proc = subprocess.run([sys.executable, "-m", "torchmn", "run", "-np", "2", "--timeline", "/proc/no-such/t.json",
                           sys.executable, "-c", "print('started')"], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "started" not in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
    assert "--timeline /proc/no-such/t.json: the ranks cannot write their parts in /proc/no-such" in proc.stderr


def test_p95_step_time_is_the_nearest_rank():
    """Of 20 steps of 1, 2, ..., 20 ms, the 95th percentile is 19 ms (nearest rank), not the maximum."""
    code = ("from torchmn.monitor import recorder\n"
            "t = 0.0\nrecorder.step_ended(t)\n"
            "for ms in range(1, 21):\n    t += ms / 1e3\n    recorder.step_ended(t)\n"
            "print(round(recorder.figures()['step_p95_ms'], 3))")
    proc = _run([sys.executable, "-c", code])
    assert proc.stdout.strip() == "19.0", proc.stdout


def test_timeline_command_says_a_timeline_holds_no_phases(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text('{"traceEvents": [], "displayTimeUnit": "ms"}')
    proc = subprocess.run([sys.executable, "-m", "torchmn", "timeline", str(empty)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "holds no phases" in proc.stderr, (proc.returncode, proc.stdout, proc.stderr)


def test_timeline_command_refuses_a_file_that_is_not_a_timeline(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    proc = subprocess.run([sys.executable, "-m", "torchmn", "timeline", str(bad), "--png", str(tmp_path / "x.png")],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "has no traceEvents list: it is not a Chrome trace" in proc.stderr


@pytest.mark.parametrize("args,words", [(["--png", "x.png", "--last", "-1"], "--last -1: give a positive number"),
                                        (["--last", "1"], "--last chooses what --png draws")])
def test_timeline_command_refuses_a_bad_last(capsys, args, words):
    from torchmn.cli import main
    with pytest.raises(SystemExit) as stop:
        main(["timeline", "trace.json", *args])
    assert stop.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_doctor_gives_the_straggler_its_verdict():
    # The doctor samples once every rank has reported optimizer steps; its wait for them is counted in
    # the CPU time the job uses, so the ranks' start-up -- three imports of torch at once, slow on the
    # clock on a loaded 2-core machine -- is not sampled, where it would read as oversubscription.
    proc = _run([sys.executable, "-m", "torchmn", "doctor", "-np", "3", "--json", "--warmup", "3", "--seconds", "3",
                 "--", sys.executable, STRAGGLER, "100000"], timeout=150)
    d = json.loads(proc.stdout)
    verdicts = {row["rank"]: row.get("verdict") for row in d["ranks"]}
    assert verdicts == {0: None, 1: "straggler", 2: None}, d["ranks"]
    assert d["steps"]["stragglers"] == [1] and d["ranks"][1]["steps"]["busy_ms"] > 40, d["steps"]


@pytest.mark.timeout(180)
def test_doctor_waits_for_a_start_up_that_stalls_on_the_clock():
    # 30 s of sleep before the communicator: a start-up long on the clock that takes no CPU time. The
    # doctor's wait for step figures is counted in CPU time, so it samples training, not the start-up.
    proc = _run([sys.executable, "-m", "torchmn", "doctor", "-np", "2", "--json", "--warmup", "1", "--seconds", "2",
                 "--", sys.executable, STRAGGLER, "100000", "30"], timeout=170)
    d = json.loads(proc.stdout)
    assert all((row.get("steps") or {}).get("steps", 0) >= 2 for row in d["ranks"]), d["ranks"]
    assert d["steps"]["stragglers"] == [1], d["steps"]


def test_summary_without_a_straggler_says_so():
    lines = summary.describe({0: {"busy_ms": 10.0, "wait_share": 0.1, "host": "a"},
                              1: {"busy_ms": 11.0, "wait_share": 0.05, "host": "b"}})
    assert lines[1] == "no straggler: every rank is busy within 1.25x the other ranks' median"
    assert lines[2] == "waits most: rank 0 (a), 10% of its steps"


def test_summary_names_the_straggler_of_two_ranks():
    """Two ranks: each is compared with the other (a median over both is their mean, which a
    rank 1.6x the other's time stays within 1.25x of)."""
    lines = summary.describe({0: {"busy_ms": 20.0, "wait_share": 0.4, "host": "a"},
                              1: {"busy_ms": 32.0, "wait_share": 0.0, "host": "a"}})
    assert lines[0] == "slowest: rank 1 (a), busy 32.0 ms per step, 1.60x the other ranks' median (20.0 ms)"
    assert lines[1].startswith("straggler: rank(s) 1 (busy over 1.25x the other ranks' median)"), lines


def test_summary_of_ranks_that_paused_alike_names_no_stall():
    """Every rank busy 1.5 s in one step (an evaluation each runs): nobody waited for anybody."""
    alike = {r: {"busy_ms": 6.5, "max_busy_ms": 1500.0 + r, "wait_share": 0.1, "host": "a"} for r in range(2)}
    lines = summary.describe(alike)
    assert summary.stalled(alike) == [] and not any(line.startswith("stall") for line in lines), lines
    assert lines[-1].startswith("pause: every rank was busy up to 1.5 s in one step, alike"), lines
    alike[1]["max_busy_ms"] = 20.0
    assert summary.stalled(alike) == [0]


def test_summary_without_steps_says_why():
    assert summary.describe({0: {"steps": 0}, 1: {"steps": 1}}) == [
        "1 of 2 rank(s) reported optimizer steps and fewer than 2 have two or more: nothing to compare "
        "(a step's time is the time between two steps of torchmn's optimizers)"]


def test_per_node_launchers_join_the_timeline_once_every_node_ended(tmp_path):
    """One launcher per node (both here, sharing the folder as a shared file system would): node 0
    joins the timeline after node 1's rank, which ends later, has written its part."""
    path = tmp_path / "trace.json"
    code = ("import os, time, torchmn\n"
            "comm = torchmn.create_communicator(); comm.barrier()\n"
            "time.sleep(3 * comm.rank); comm.finalize()\n")
    results = run_two_node_launchers(["--timeline", str(path)], [sys.executable, "-c", code], timeout=100)
    assert [code for code, _, _ in results] == [0, 0], results
    assert "timeline of 2 rank(s) written" in results[0][2], results[0][2]
    assert {e["pid"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"} == {0, 1}


def test_monitor_names_a_rank_that_stalled_once():
    """Rank 1 stops for 5 s once: the median hides it, the summary names it (the live table's
    'now' column: test_monitor_table_says_which_rank_is_held_up)."""
    proc = _run([sys.executable, "-m", "torchmn", "run", "-np", "2", "--monitor", sys.executable, STRAGGLER, "30",
                 "--stall"])
    assert re.search(r"torchmn monitor: stall: rank 1 \(\S+\) was busy 5\.\d s in one step", proc.stderr), proc.stderr


RAISES_IN_A_WAIT = """
import time, torch, torchmn
from torchmn.monitor import recorder
comm = torchmn.create_communicator("flat")
model = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm, shard_state=False,
                                                zero_fill=False)
for step in range(20):
    optimizer.zero_grad()
    x = torch.randn(2, 4)
    # Step 5: rank 1 leaves the second layer out, which zero_fill=False refuses on every rank while
    # the averages are awaited; the script goes on with the next batch.
    y = model[0](x) if (step == 5 and comm.rank == 1) else model[1](model[0](x))
    try:
        y.sum().backward()
        optimizer.step()
    except torchmn.CollectiveMismatchError:
        optimizer.zero_grad()
    if comm.rank == 1:
        time.sleep(0.03)
print("WAITING_NOW", recorder.figures()["waiting_now_s"])
"""


def test_monitor_keeps_timing_waits_after_a_step_raised_in_one():
    """A step that raised while it waited for the averages (every rank alike) closes that wait: the
    waits after it still count as waiting, so the straggler is still named, and no rank shows as
    waiting for good."""
    proc = _run([sys.executable, "-m", "torchmn", "run", "-np", "2", "--monitor", sys.executable, "-c",
                 RAISES_IN_A_WAIT])
    assert "torchmn monitor: straggler: rank(s) 1 " in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.count("WAITING_NOW None") == 2, proc.stdout


def test_monitor_table_says_which_rank_is_held_up():
    from torchmn.monitor import display

    snapshots = {0: {"steps": 40, "step_ms": 60.0, "since_step_s": 30.2, "waiting_now_s": 30.1},
                 1: {"steps": 40, "step_ms": 60.0, "since_step_s": 30.3, "waiting_now_s": None},
                 2: {"steps": 41, "step_ms": 60.0, "since_step_s": 0.05, "waiting_now_s": None}}
    text = display.as_text(snapshots, 3)
    rows = {int(line.split()[1]): line for line in text.splitlines() if re.match(r"^\W*\d\W", line)}
    assert "waiting 30 s" in rows[0] and "busy 30 s" in rows[1] and rows[2].split()[-2:] == ["-", "│"], text


def test_a_rank_held_up_before_its_first_step_shows_as_held():
    """A rank stuck before its first optimizer step (a data mount, a deadlock at step 1) is timed
    from the start of recording, and one waiting in the first averaging shows as waiting."""
    code = ("import time\n"
            "from torchmn.monitor import recorder\n"
            "recorder.start(); time.sleep(0.3)\n"
            "busy = recorder.figures()\n"
            "t0 = recorder.begin(); time.sleep(0.3)\n"
            "waiting = recorder.figures()\n"
            "print(busy['since_step_s'], busy['waiting_now_s'], waiting['since_step_s'], waiting['waiting_now_s'])\n")
    proc = _run([sys.executable, "-c", code], timeout=60)
    busy_since, busy_waiting, since, waiting = proc.stdout.split()
    assert float(busy_since) >= 0.3 and busy_waiting == "None", proc.stdout
    assert float(since) >= 0.6 and float(waiting) >= 0.3, proc.stdout


def test_timeline_merge_during_the_run_keeps_the_parts(tmp_path):
    """A merge by hand while the ranks still write (a part not closed) joins what is there and
    keeps every part, so that the next merge has them all."""
    path = str(tmp_path / "t.json")
    timeline.write_part(path, 0, 2, [("update", "update", 100.0, 100.5, "MainThread", None)])
    running = timeline.part_path(path, 1)
    with open(running, "w") as f:  # as a PartWriter leaves it between two appends
        f.write(json.dumps({"rank": 1, "size": 2, "host": "h"}) + "\n")
        f.write(json.dumps([["update", "update", 101.0, 101.5, "MainThread", None]]) + "\n")
    proc = _run([sys.executable, "-m", "torchmn", "timeline", "merge", path])
    assert "joined 2 rank(s)" in proc.stdout and "rank(s) 1 still write theirs" in proc.stdout, proc.stdout
    assert len(timeline.parts_of(path)) == 2


def test_timeline_part_goes_into_a_folder_made_for_it(tmp_path):
    code = ("import sys; from torchmn.monitor import timeline\n"
            "w = timeline.PartWriter(sys.argv[1], 0, 1); w.close()\n"
            "print(timeline.ended(w.path), timeline.read_part(w.path)[:3])")
    proc = _run([sys.executable, "-c", code, str(tmp_path / "new" / "folder" / "t.json")])
    assert proc.stdout.split()[0] == "True", proc.stdout


FORKING = """
import os, sys, torch, torchmn
comm = torchmn.create_communicator()
model = torch.nn.Linear(4, 2)
optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
for step in range(20):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    if step == 10 and os.fork() == 0:
        sys.exit(0)  # a helper process that ends normally: it runs the exit handlers it inherited
os.wait()
comm.finalize()
"""


def test_timeline_of_a_rank_that_forks_a_process_is_its_own(tmp_path):
    """A process forked from a rank, ending normally, neither writes into the rank's part nor
    joins or removes the parts: the timeline holds each rank's 20 updates once."""
    path = tmp_path / "trace.json"
    script = tmp_path / "forking.py"
    script.write_text(FORKING)
    proc = _run([sys.executable, "-m", "torchmn", "run", "-np", "2", "--timeline", str(path), sys.executable,
                 str(script)])
    assert "timeline of 2 rank(s) written" in proc.stderr, proc.stderr
    updates = [e["pid"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X" and e["name"] == "update"]
    assert sorted(updates) == [0] * 20 + [1] * 20, updates
