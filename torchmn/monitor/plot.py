"""A timeline drawn with matplotlib, for those who will not open Perfetto: one row per rank and
thread, one bar per phase, coloured by kind."""
from __future__ import annotations

import json
from typing import Optional

from torchmn.errors import TorchmnValueError

COLOURS = {"compute": "#4C72B0", "average": "#DD8452", "update": "#55A868", "collective": "#C44E52",
           "horovod": "#8172B3"}
LABELS = {"compute": "forward+backward", "average": "averaging (waiting)", "update": "update",
          "collective": "collective", "horovod": "Horovod call"}


def load(path: str) -> dict:
    """Read a timeline file.

    Args:
        path: a Chrome trace written by torchmn (``--timeline``, ``hvd.stop_timeline``).

    Returns:
        The parsed JSON (``{"traceEvents": [...]}``).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a Chrome trace (names the file).

    Example::

        >>> len(load("/tmp/trace.json")["traceEvents"])   # doctest: +SKIP
        1234
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise TorchmnValueError(f"{path} is not JSON ({e}): is it a timeline torchmn wrote?") from e
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TorchmnValueError(f"{path} has no traceEvents list: it is not a Chrome trace")
    return data


def draw(path: str, out: str, last_s: Optional[float] = None) -> int:
    """Draw the timeline ``path`` into the image ``out``.

    Args:
        path: the timeline file.
        out: the image to write (``.png``, or any format matplotlib knows by its suffix).
        last_s: draw only the last this many seconds (None: all of it).

    Returns:
        The number of phases drawn.

    Raises:
        OSError, ValueError: as :func:`load`; ValueError also for a timeline without phases.

    Example::

        >>> draw("/tmp/trace.json", "/tmp/trace.png", last_s=0.5)   # doctest: +SKIP
        812
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = load(path)["traceEvents"]
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[(e["pid"], None)] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    # Traces other tools write (torch.profiler's) may mix string and number ids and leave out
    # categories: rows are ordered by their text.
    phases = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    if not phases:
        raise TorchmnValueError(f"{path} holds no phases: did the ranks record (TORCHMN_TIMELINE) and step?")
    end = max(e["ts"] + e["dur"] for e in phases)
    start = end - last_s * 1e6 if last_s is not None else min(e["ts"] for e in phases)
    phases = [e for e in phases if e["ts"] + e["dur"] >= start]
    rows = sorted({(e.get("pid"), e.get("tid", 0)) for e in phases}, key=lambda row: (str(row[0]), str(row[1])))
    # Constrained layout makes room for the legend below the axes, whatever the number of rows.
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.45 * len(rows)), layout="constrained")
    for y, (pid, tid) in enumerate(rows):
        mine = [e for e in phases if e.get("pid") == pid and e.get("tid", 0) == tid]
        ax.broken_barh([((e["ts"] - start) / 1e3, max(e["dur"] / 1e3, 0.01)) for e in mine], (y - 0.4, 0.8),
                       facecolors=[COLOURS.get(e.get("cat"), "#999999") for e in mine], linewidth=0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{names.get((pid, None), f'rank {pid}')} · {names.get((pid, tid), tid)}"
                        for pid, tid in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_xlim(0, (end - start) / 1e3)
    used = sorted({e.get("cat") for e in phases} & set(COLOURS), key=list(COLOURS).index)
    handles = [Patch(color=COLOURS[c], label=LABELS[c]) for c in used]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="blank: the script's code between backward and step"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    ax.set_title(f"torchmn timeline: {path.rsplit('/', 1)[-1]}" + (f" (last {last_s:g} s)" if last_s else ""),
                 fontsize=10, loc="left")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return len(phases)
