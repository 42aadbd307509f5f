"""From samples to a verdict (oversubscribed, under-used, fine), the fix, and the report in words
or JSON."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from torchmn.doctor import pools
from torchmn.monitor import summary

OVERSUBSCRIBED, UNDER_USED, FINE = "oversubscribed", "under-used", "fine"
# A rank's own verdict where its steps take much longer than the others' (see torchmn.monitor.summary).
STRAGGLER = "straggler"
# Runnable threads per CPU above which the ranks wait for CPUs (context switches, cold caches, and
# OpenMP threads spinning for a partner that is not running): the 3-6x slowdowns.
TOO_MANY = 1.25
# Below this share of the CPUs used, the job leaves CPUs idle.
TOO_FEW = 0.6


@dataclasses.dataclass
class Diagnosis:
    """The doctor's findings.

    Attributes:
        verdict: :data:`OVERSUBSCRIBED`, :data:`UNDER_USED` or :data:`FINE`.
        cpus: CPUs the ranks may use on this machine (the tightest of ``limits``).
        limits: what limits them (``torchmn.resources.cpu_limits``: affinity, cgroup, slurm).
        pools: the thread pools a process with the first rank's settings opens (``pools.probe``).
        runnable: runnable threads of the job on average.
        cpu_percent: CPU the job used, in percent of one CPU.
        ranks: one dict per rank (pid, rank, threads, busy threads, CPU%, budget, settings, workers).
        fix: what to change, in words ("" where nothing needs to).
        seconds: the sampling window (shorter than asked where every process ended in it).
        ended: processes (pids) that ended during the window: their figures are over the time they ran.
        steps: what the ranks' own step figures say (``torchmn.monitor``): ``stragglers`` (ranks
            busy more than ``STRAGGLER_RATIO`` times the median per step) and ``findings`` in
            words; None where no rank sent figures.
    """

    verdict: str
    cpus: int
    limits: dict
    pools: Optional[dict]
    runnable: float
    cpu_percent: float
    ranks: list
    fix: str
    seconds: float
    steps: Optional[dict] = None
    ended: list = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        """The diagnosis as plain data, for ``torchmn doctor --json``.

        Returns:
            A dict of the attributes by name (``dataclasses.asdict``): only dicts, lists,
            strings, numbers and None, which ``json.dumps`` takes as they are.

        Example::

            >>> print(json.dumps(diagnose(ranks, samples, limits, 3.0).to_json(), indent=1))
        """
        return dataclasses.asdict(self)


def diagnose(ranks: list, samples: dict, limits: dict, seconds: float, pools: Optional[dict] = None,
             steps: Optional[Dict[int, dict]] = None) -> Diagnosis:
    """Judge a sampled job.

    Args:
        ranks: the :class:`~torchmn.doctor.processes.RankProcess` objects of this machine.
        samples: ``{pid: ProcessSample}`` for the ranks and their workers.
        limits: what limits the CPUs the ranks may use (``torchmn.resources.cpu_limits``).
        seconds: the sampling window asked for (the report gives the one sampled, shorter where
            every process ended in it).
        pools: the thread pools the first rank's settings open (``pools.probe``), for the report.
        steps: each rank's step figures (``torchmn.monitor.publisher``), by rank; a rank busy more
            than ``STRAGGLER_RATIO`` times the median rank per step gets the verdict "straggler".

    Returns:
        The :class:`Diagnosis`.

    Example::

        >>> d = diagnose(ranks, sample(pids, 3.0), resources.cpu_limits(), 3.0)
        >>> d.verdict
        'fine'
    """
    cpus = max(1, min(n for n in limits.values() if n is not None))
    budget = max(1, cpus // max(1, len(ranks)))
    rows, runnable, used = [], 0.0, 0.0
    for r in ranks:
        own = samples.get(r.pid)
        workers = [samples[w] for w in r.workers if w in samples]
        row = {"pid": r.pid, "rank": r.rank, "host": r.host, "settings": r.settings,
               "environment_read": r.environment_read,
               "threads": own.threads if own else 0, "busy_threads": own.busy_threads if own else 0,
               "cpu_percent": round(own.cpu_percent, 1) if own else 0.0,
               "runnable": round(own.runnable, 2) if own else 0.0,
               "involuntary_switches_per_s": round(own.involuntary_per_s, 1) if own else 0.0,
               "budget_threads": budget, "workers": len(workers),
               "workers_cpu_percent": round(sum(w.cpu_percent for w in workers), 1),
               "workers_runnable": round(sum(w.runnable for w in workers), 2)}
        figures = (steps or {}).get(r.rank if r.rank is not None else 0)
        if figures is not None:
            row["steps"] = {k: figures.get(k) for k in ("steps", "step_ms", "step_p95_ms", "busy_ms", "wait_share")}
        rows.append(row)
        runnable += row["runnable"] + row["workers_runnable"]
        used += row["cpu_percent"] + row["workers_cpu_percent"]
    found, stragglers = None, []
    if steps:
        compared = summary.compare(steps)
        stragglers = compared.stragglers if compared is not None else []
        for row in rows:
            if row["rank"] in stragglers:
                row["verdict"] = STRAGGLER
        found = {"stragglers": stragglers, "findings": summary.describe(steps)}
    if runnable > TOO_MANY * cpus and runnable - cpus >= 0.5:
        verdict, fix = OVERSUBSCRIBED, _fix_oversubscribed(rows, cpus, budget)
    elif used < TOO_FEW * 100 * cpus and runnable < TOO_FEW * cpus + 0.5:
        verdict, fix = UNDER_USED, _fix_under_used(rows, cpus, used, stragglers)
    else:
        verdict, fix = FINE, ""
    watched = [s.seconds for s in samples.values() if s.seconds > 0]
    window = min(seconds, max(watched)) if watched else seconds
    ended = sorted(pid for pid, s in samples.items() if not s.alive)
    return Diagnosis(verdict, cpus, dict(limits), pools, round(runnable, 2), round(used, 1), rows, fix,
                     round(window, 2), found, ended)


def _fix_oversubscribed(rows: list, cpus: int, budget: int) -> str:
    fixes = []
    # OMP_NUM_THREADS the user set (torchmn run lists those it set in TORCHMN_THREAD_VARIABLES).
    users = {row["settings"].get("OMP_NUM_THREADS") for row in rows
             if "OMP_NUM_THREADS" not in row["settings"].get("TORCHMN_THREAD_VARIABLES", "")} - {None}
    asked = {row["settings"].get("TORCHMN_NUM_THREADS") for row in rows} - {None}
    if any(v.isdigit() and int(v) > budget for v in users):
        fixes.append(f"OMP_NUM_THREADS={'/'.join(sorted(users))} in the ranks' environment overrides torchmn's "
                     f"budget of {budget} thread(s) per rank ({cpus} CPUs / {len(rows)} ranks): unset it (torchmn "
                     f"run, and create_communicator() under other launchers, then give each rank {budget}) or set "
                     f"OMP_NUM_THREADS={budget}")
    elif any(v.isdigit() and int(v) > budget for v in asked):
        fixes.append(f"TORCHMN_NUM_THREADS={'/'.join(sorted(asked))} asks for more than the {budget} thread(s) per "
                     f"rank that {cpus} CPUs give {len(rows)} ranks: unset it or set TORCHMN_NUM_THREADS={budget}")
    elif any(row["busy_threads"] > budget or row["runnable"] > budget + 0.5 for row in rows):
        fixes.append(f"each rank runs more threads than its share ({budget} of {cpus} CPUs for {len(rows)} "
                     f"ranks): import torchmn before torch opens its pools, drop torch.set_num_threads() "
                     f"calls above {budget}, or set TORCHMN_NUM_THREADS={budget}")
    workers = sum(row["workers"] for row in rows)
    if workers and sum(row["workers_runnable"] for row in rows) >= 0.5:
        spare = max(0, budget - 1)  # what dataloader_workers_budget gives a rank on this budget
        fixes.append(f"{workers} DataLoader worker process(es) compete with the ranks for {cpus} CPUs: use "
                     f"num_workers=torchmn.resources.dataloader_workers_budget(comm.intra_size) ({spare} here)")
    if len(rows) > cpus:
        fixes.append(f"{len(rows)} ranks on {cpus} CPUs: start at most {cpus} ranks on this machine (-np {cpus})")
    if not fixes:
        fixes.append("the extra runnable threads are not torch's pools nor DataLoader workers: threads the script "
                     "or another library starts (see each rank's busy threads above)")
    return "; ".join(fixes)


def _fix_under_used(rows: list, cpus: int, used: float, stragglers: list) -> str:
    idle = f"{len(rows)} rank(s) used {used / 100:.1f} of {cpus} CPUs"
    if stragglers:
        return (f"{idle}: the others wait for rank(s) {', '.join(map(str, stragglers))}, busy longer per step "
                f"(below): give the ranks equal work (batches of one size, data of one cost), or look for what "
                f"only those ranks do (logging, evaluation, checkpoints, a slower machine)")
    threads = max(1, max((row["busy_threads"] for row in rows), default=1))
    per_rank = max(1, cpus // max(1, len(rows)))
    ranks = max(1, cpus // threads)
    have = {row["settings"].get("TORCHMN_NUM_THREADS") or row["settings"].get("OMP_NUM_THREADS") for row in rows}
    if have == {str(per_rank)} and ranks <= len(rows):
        return (f"{idle}, with torchmn's budget of {per_rank} thread(s) per rank already: the ranks wait on data "
                f"or communication; more DataLoader workers or larger batches help")
    return (f"{idle}: give each rank {per_rank} thread(s) (unset OMP_NUM_THREADS, or "
            f"TORCHMN_NUM_THREADS={per_rank})" + (f" or start {ranks} ranks (-np {ranks})" if ranks > len(rows) else "")
            + "; if the ranks wait on data or communication instead, more DataLoader workers or larger batches help")


def _rank_name(row: dict) -> str:
    return f"rank {row['rank']}" if row["rank"] is not None else "the process"


def report(d: Diagnosis, where: Optional[str] = None) -> str:
    """The diagnosis in plain words, a line per finding.

    Args:
        d: the diagnosis.
        where: what was sampled (a command, a pid, a job).

    Returns:
        The report.

    Example::

        >>> print(report(diagnose(ranks, samples, resources.cpu_limits(), 3.0), "pid 4242"))
    """
    lines = [f"torchmn doctor: {len(d.ranks)} rank(s) on {d.ranks[0]['host'] if d.ranks else '?'}"
             + (f" ({where})" if where else "") + f", sampled for {d.seconds:.1f} s"
             + (f" (process(es) {', '.join(map(str, d.ended))} ended meanwhile: their figures are over the time "
                f"they ran)" if d.ended else ""),
             f"CPUs the ranks may use here: {d.cpus} (affinity {d.limits.get('affinity')}, cgroup quota "
             f"{d.limits.get('cgroup') or 'none'}, Slurm allocation {d.limits.get('slurm') or 'none'}); "
             f"torchmn's budget: {d.ranks[0]['budget_threads'] if d.ranks else '-'} thread(s) per rank",
             f"thread pools a process with {_rank_name(d.ranks[0]) if d.ranks else 'its'}'s settings opens: "
             f"{pools.describe_pools(d.pools)}"]
    for row in d.ranks:
        ours = row["settings"].get("TORCHMN_THREAD_VARIABLES", "").split(",")
        settings = ", ".join(f"{k}={v}" + (" (torchmn's budget)" if k in ours else "")
                             for k, v in row["settings"].items() if k != "TORCHMN_THREAD_VARIABLES")
        if not row.get("environment_read", True):
            settings = ("its environment is not readable by this user, so its thread settings are unknown "
                        "(run torchmn doctor as the job's user, or as root)")
        settings = settings or "no thread variables set"
        lines.append(f"{_rank_name(row)} (pid {row['pid']}): {row['threads']} threads, {row['busy_threads']} busy, "
                     f"{row['runnable']:.1f} runnable on average, CPU {row['cpu_percent']:.0f}% "
                     f"(its budget allows {100 * row['budget_threads']}%), {row['involuntary_switches_per_s']:.0f} "
                     f"involuntary context switches/s; {settings}")
        if row["workers"]:
            lines.append(f"  {row['workers']} worker process(es) (DataLoader): CPU {row['workers_cpu_percent']:.0f}%, "
                         f"{row['workers_runnable']:.1f} runnable on average")
    lines.append(f"runnable threads: {d.runnable:.1f} on average for {d.cpus} CPUs "
                 f"({d.runnable / max(1, d.cpus):.1f} per CPU); CPU used: {d.cpu_percent / 100:.1f} of {d.cpus}")
    lines.append(f"verdict: {d.verdict}")
    if d.fix:
        lines.append(f"fix: {d.fix}")
    if d.steps is not None:
        for row in d.ranks:
            f = row.get("steps")
            if f and f.get("busy_ms") is not None:
                lines.append(f"{_rank_name(row)}: {f['steps']} steps, step {f['step_ms']:.1f} ms (p95 "
                             f"{f['step_p95_ms']:.1f}), busy {f['busy_ms']:.1f} ms, waiting {100 * f['wait_share']:.0f}% "
                             f"of the step" + (f": verdict {STRAGGLER}" if row.get("verdict") == STRAGGLER else ""))
        lines.extend(f"steps: {line}" for line in d.steps["findings"])
    return "\n".join(lines)
