"""``torchmn timeline``: join a timeline's parts (``merge``), summarise a timeline per rank, or
draw it (``--png``)."""
from __future__ import annotations

import argparse
import collections
import heapq
import re
import sys

from torchmn.errors import TorchmnValueError

EXIT_BAD_INPUT = 2


def add_timeline(subparsers) -> None:
    """Register ``torchmn timeline`` on the ``torchmn`` command's subparsers.

    ``torchmn timeline FILE`` prints each rank's time per kind of phase; with ``--png OUT`` it draws
    the timeline; ``torchmn timeline merge FILE`` joins the parts ranks wrote (``FILE.rank<r>.json``).

    Args:
        subparsers: what ``argparse.ArgumentParser.add_subparsers`` returned.

    Example::

        >>> parser = argparse.ArgumentParser(prog="torchmn")
        >>> add_timeline(parser.add_subparsers())
        >>> parser.parse_args(["timeline", "trace.json", "--png", "t.png"]).png
        't.png'
    """
    p = subparsers.add_parser(
        "timeline", allow_abbrev=False, help="summarise, draw or join a timeline (torchmn run --timeline)",
        description="torchmn timeline FILE: each rank's time per kind of phase. With --png OUT: draw it "
                    "(matplotlib). torchmn timeline merge FILE: join the parts the ranks wrote "
                    "(FILE.rank<r>.json, copied into one folder where they ran on several machines).")
    p.add_argument("args", nargs="+", metavar="[merge] FILE")
    p.add_argument("--png", default=None, metavar="OUT", help="draw the timeline into this image")
    p.add_argument("--last", type=float, default=None, metavar="SECONDS", help="draw only the last SECONDS")
    p.set_defaults(handler=run_timeline, subparser=p)


def run_timeline(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Do what ``torchmn timeline`` was asked; errors go to stderr in words.

    Args:
        args: the parsed command line.
        parser: the subcommand's parser, for usage errors.

    Returns:
        0, or 2 for a missing or unreadable file.

    Example::

        >>> from torchmn.cli import main
        >>> main(["timeline", "trace.json", "--png", "trace.png"])   # doctest: +SKIP
        0
    """
    from torchmn.monitor import plot, timeline

    words = list(args.args)
    if args.last is not None and not args.last > 0:
        parser.error(f"--last {args.last:g}: give a positive number of seconds")
    if args.last is not None and not args.png:
        parser.error("--last chooses what --png draws: give --png OUT too")
    try:
        if words[0] == "merge":
            if len(words) != 2:
                parser.error("usage: torchmn timeline merge FILE")
            running = [timeline.part_rank(f) for f in timeline.parts_of(words[1]) if not timeline.ended(f)]
            path, ranks, size, left_out = timeline.merge(words[1])
            missing = sorted(set(range(size or 0)) - set(ranks))
            running = [r for r in running if r in ranks]
            print(f"joined {len(ranks)} rank(s) into {path}" +
                  (f"; missing: rank(s) {', '.join(map(str, missing))}" if missing else "") +
                  (f"; rank(s) {', '.join(map(str, running))} still write theirs (or were killed): their parts "
                   f"are kept, merge again once they end" if running else ""))
            if left_out:
                print(f"left out {len(left_out)} part(s) of another job, of another number of ranks than the "
                      f"newest part's {size}: {', '.join(left_out)} (kept; move them away)", file=sys.stderr)
            return 0
        if len(words) != 1:
            parser.error("give one FILE (or: merge FILE)")
        if args.png:
            drawn = plot.draw(words[0], args.png, args.last)
            print(f"drew {drawn} phases into {args.png}")
            return 0
        _print_summary(words[0], plot.load(words[0]))
        return 0
    except (OSError, ValueError) as e:
        sys.stderr.write(f"torchmn timeline: error: {e}\n")
        return EXIT_BAD_INPUT


def _print_summary(path: str, data: dict) -> None:
    from torchmn.monitor import plot  # matplotlib only where drawn: plot imports it inside draw()

    names, threads, rows = {}, {}, collections.defaultdict(list)
    for e in data["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            # A thread's phases that overlap go on rows of their own, "<thread> (2)" and on: one thread.
            threads[(e.get("pid"), e.get("tid"))] = _LANE.sub("", str(e["args"]["name"]))
        elif e.get("ph") == "X" and "dur" in e:
            rows[(e.get("pid"), e.get("tid"))].append(e)
    if not rows:
        raise TorchmnValueError(f"{path} holds no phases: did the ranks record (TORCHMN_TIMELINE) and step?")
    by_thread = collections.defaultdict(list)
    for (pid, tid), events in rows.items():
        by_thread[(pid, threads.get((pid, tid), tid))].extend(events)
    totals, counts, in_flight = collections.defaultdict(float), collections.Counter(), {}
    for (pid, thread), events in by_thread.items():
        if thread == AVERAGING_ROW:  # buckets in flight beside the training thread, not its time
            in_flight[pid] = (sum(_innermost_times(events).values()), len(events))
            continue
        # Traces other tools write (torch.profiler's) may mix string and number ids and leave out
        # categories: ordered by their text.
        for cat, ms in _innermost_times(events).items():
            totals[(pid, cat)] += ms
        counts.update((pid, e.get("cat") or "?") for e in events)
    for pid in sorted({p for p, _ in counts} | set(in_flight), key=str):
        parts = ", ".join(f"{plot.LABELS.get(cat, cat)} {totals[(p, cat)]:.1f} ms ({counts[(p, cat)]}x)"
                          for p, cat in sorted(counts, key=lambda k: (str(k[0]), str(k[1]))) if p == pid)
        if pid in in_flight:
            ms, buckets = in_flight[pid]
            parts += f"{'; ' if parts else ''}averaging in flight {ms:.1f} ms ({buckets} buckets)"
        print(f"{names.get(pid, f'rank {pid}')}: {parts}")


# The row a rank's buckets in flight are drawn on (torchmn.monitor.recorder's thread="averaging").
AVERAGING_ROW = "averaging"
_LANE = re.compile(r" \(\d+\)$")


def _innermost_times(events: list) -> dict:
    """Each moment of one thread's phases, in milliseconds, given to the innermost phase open then
    (the one that started last; the shorter of two that started together), by category: phases
    nested in others (a collective inside backward) or overlapping them count once."""
    events = sorted(events, key=lambda e: e["ts"])
    points = sorted({t for e in events for t in (e["ts"], e["ts"] + e["dur"])})
    times: dict = collections.defaultdict(float)
    open_: list = []  # a heap: the latest start (then the shortest) first; ended ones leave it when on top
    taken = 0
    for a, b in zip(points, points[1:]):
        while taken < len(events) and events[taken]["ts"] <= a:
            e = events[taken]
            heapq.heappush(open_, (-e["ts"], e["dur"], taken, e["ts"] + e["dur"], e.get("cat") or "?"))
            taken += 1
        while open_ and open_[0][3] <= a:
            heapq.heappop(open_)
        if open_:
            times[open_[0][4]] += (b - a) / 1e3
    return times
