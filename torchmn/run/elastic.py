"""``torchmn run --min-np M --max-np N``: an elastic job, whose ranks come and go while it runs.

The launcher numbers every process it starts (a *worker*) once for the job's life, and decides
each membership (a *generation*) alone, writing it to the job's store
(:mod:`torchmn.elastic.protocol`). It announces a new generation when

- a member dies (the survivors are then waiting for one, or will at their next collective);
- a member left its generation without dying (its world broke: a timeout, say): the same
  workers again, in new process groups;
- a new worker waits at the rendezvous: the members see it at their next ``commit()``;
- the ``--host-discovery-script`` offers a host fewer slots than workers run there: the newest
  of them leave the job at the next ``commit()`` (never below ``--min-np``, nor the last that
  hold the training state), as Horovod's driver takes removed hosts' workers out.

New workers start where there is room and fewer than ``--max-np`` run: on the hosts the
``--host-discovery-script`` prints (``host:slots`` lines, read every second), else on the known
hosts (``-H``, or this machine with ``-np`` slots), in the slots that dead workers freed. With
fewer than ``--min-np`` workers alive for longer than ``--elastic-timeout`` seconds, the job ends,
naming the workers lost and their hosts.

Users' view: ``docs/elastic.md``. The ranks' side: :mod:`torchmn.elastic`.
"""
from __future__ import annotations

import collections
import dataclasses
import re
import shlex
import signal
import subprocess
import threading
import time
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from torchmn import network
from torchmn.elastic import protocol
from torchmn.run.config import LaunchConfig, RunError
from torchmn.run.job import Job
from torchmn.run.plan import Slot, cross_place, place_env
from torchmn.run.processes.output import describe_exit, exit_code_of, extract_traceback, failure_summary
from torchmn.run.processes.supervisor import Rank

DISCOVERY_EVERY_S = 1.0       # the pause between two runs of the discovery script
DISCOVERY_TIMEOUT_S = 30.0    # how long one run of it may take
# After a new worker on a host failed before joining, no new worker starts there for this long
# (a host that cannot run the program would otherwise take every free moment of the job).
COOLDOWN_S = 10.0
# Generations in a row that may break before any commit with every worker alive before the job ends
# (a collective that times out on a slow rank at the same place after each reset would loop forever).
STALLS_LIMIT = 3
_TORCH_PREFIX = re.compile(r"^(\[rank\d+\]:\s*)+")  # torch's excepthook prefixes each line of a rank's traceback


def place_workers(workers: Sequence[Tuple[int, str]]) -> List[Slot]:
    """The places of a generation whose ranks are ``workers``, in rank order.

    Args:
        workers: ``(worker, host)`` pairs, in rank order.

    Returns:
        One ``Slot`` per worker: its rank in the generation; local ranks count up per host in rank
        order, hosts are numbered in the order they first appear.

    Example::

        >>> [s.local_rank for s in place_workers([(0, "a"), (2, "b"), (3, "a")])]
        [0, 0, 1]
    """
    hosts = list(dict.fromkeys(h for _, h in workers))
    per_host = {h: [w for w, wh in workers if wh == h] for h in hosts}
    counts = [len(per_host[h]) for h in hosts]
    return [Slot(rank, len(workers), per_host[h].index(w), len(per_host[h]), hosts.index(h), len(hosts), h,
                 *cross_place(counts, hosts.index(h), per_host[h].index(w)))
            for rank, (w, h) in enumerate(workers)]


def choose_leavers(workers: Sequence[Tuple[int, str]], offered: Mapping[str, int], keep: int,
                   holders: Collection[int]) -> List[int]:
    """The workers to take out of an elastic job where their hosts run more of them than the
    discovery script offers now: on each such host the newest (they have the least done), down to
    the host's slots, while at least ``keep`` workers and one that holds the training state stay.

    Args:
        workers: ``(worker, host)`` for every worker that stays so far.
        offered: the slots each host offers now (a host not in it offers none).
        keep: the fewest workers the job goes on with (``--min-np``).
        holders: the workers that hold the training state.

    Returns:
        The workers to take out, newest first on each host; fewer than the hosts' excess where
        ``keep`` or the last holder stops it.

    Example::

        >>> choose_leavers([(0, "a"), (1, "a"), (2, "b")], {"a": 1, "b": 1}, keep=1, holders={0, 1, 2})
        [1]
        >>> choose_leavers([(0, "a"), (1, "a")], {"a": 0}, keep=1, holders={0, 1})
        [1]
    """
    staying = {w for w, _ in workers}
    by_host: Dict[str, List[int]] = collections.defaultdict(list)
    for w, host in sorted(workers):
        by_host[host].append(w)
    leavers = []
    for host, on_host in by_host.items():
        excess = len(on_host) - offered.get(host, 0)
        for w in reversed(on_host):
            if excess <= 0 or len(staying) <= keep:
                break
            if w in holders and not set(holders) & (staying - {w}):
                continue  # the last that holds the state: the others would have nobody to receive it from
            leavers.append(w)
            staying.discard(w)
            excess -= 1
    return leavers


def parse_discovery(text: str, script: str) -> Dict[str, int]:
    """The hosts and slots a discovery script printed: one ``host`` or ``host:slots`` per line.

    Args:
        text: the script's output.
        script: its path, for the message.

    Returns:
        ``{host: slots}``, in the order printed (a bare host has 1 slot; ``host:0`` none, a host
        being drained; a host printed twice keeps the last count).

    Raises:
        RunError: a line that is neither form, or a slot count that is not a whole number.

    Example::

        >>> parse_discovery("node1:2\\nnode2\\n", "discover.sh")
        {'node1': 2, 'node2': 1}
    """
    hosts: Dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        try:
            count = int(slots) if slots else 1
        except ValueError:
            count = 0
        if not host or count < 0 or (slots and not slots.strip().isdigit()) or " " in host:
            raise RunError(f"--host-discovery-script {script}: line {number} is {line!r}; each line must be "
                           f"'host' or 'host:slots' with slots a whole number (0: no slots now)")
        hosts[host] = count
    return hosts


class ElasticJob(Job):
    """A ``torchmn run`` job with ``--min-np``/``--max-np``: ranks that die are not replaced by a
    restart of all; the survivors go on, and new workers join where there is room.

    Args:
        config: what to run; ``config.min_np`` is set.
        env: the launcher's environment.

    Raises:
        RunError: also for one launcher per node (``--nnodes``, a Slurm step of several tasks),
            where membership would need every node's launcher to agree.

    Example::

        >>> job = ElasticJob(LaunchConfig(["python", "train.py"], np=4, min_np=2, max_np=4))
        >>> code = job.run_once()   # doctest: +SKIP
    """

    def __init__(self, config: LaunchConfig, env: Optional[Mapping[str, str]] = None):
        super().__init__(config, env)
        if self.nodes is not None:
            raise RunError(f"--min-np/--max-np need one torchmn run for the whole job; this one is one of "
                           f"{self.nodes.step.tasks} {self.nodes.step.kind}s (one launcher per node). Run a single "
                           f"torchmn run with -H/--hostfile (or --host-discovery-script) instead.")
        known = self.hosts if self.hosts else [(self.host, config.max_np)]
        self.known_hosts: Dict[str, int] = dict(known)
        # The name the job's ranks on this machine go by (-H localhost:2: "localhost"): a discovery
        # script's names for this machine count as it, so its running ranks count against them.
        self.local_name = next((h for h in self.known_hosts if h == self.host or network.is_local(h)), self.host)
        self.live: Dict[int, Rank] = {}          # workers running, by number
        self.members: List[int] = []             # the current generation, in rank order
        self.generation = 0
        self.next_worker = len(self.slots)
        self.finished: List[int] = []            # workers that ended with status 0
        self.lost: List[Rank] = []               # workers that died while the job went on
        self.added: List[int] = []               # workers started after the first generation
        self.cooldown: Dict[str, float] = {}     # host -> no new worker there before this time
        self.below_min_since: Optional[float] = None
        self.gave_up: Optional[str] = None
        self.discovered: Optional[Dict[str, int]] = None
        self.discovery_done = threading.Event()   # the job ended: the script runs no more
        self.holders: set = set()                # workers that have held the training state
        self.published = False                  # the first generation is in the store
        self.refused: set = set()                # discovered hosts the job cannot use, said once
        self.leaving: set = set()                # workers taken out (their host offers fewer slots now)
        self.left: List[int] = []                # those of them that have ended
        self.kept_said: Optional[tuple] = None   # the offer for which workers were kept over it, said once
        self.provisional: Dict[int, Slot] = {}   # a worker being started after the first generation: its place until it joins
        self.stalled: List[int] = []             # generations in a row that broke, every member alive, before a commit

    # -- starting ---------------------------------------------------------------------------------

    def rank_environment(self, slot: Slot, port: Union[int, str]) -> Dict[str, str]:
        """The variables of one worker: a rank's (``Job.rank_environment``) and the elastic ones.

        Args:
            slot: its place; ``slot.rank`` is the worker's number (a worker started after the first
                generation learns its place at the rendezvous).
            port: the rendezvous port.

        Returns:
            The variables.

        Example::

            >>> job.rank_environment(job.slots[0], 29500)["TORCHMN_ELASTIC_WORKER"]
            '0'
        """
        env = super().rank_environment(slot, port)
        env[protocol.ELASTIC_VARIABLE] = "1"
        env[protocol.WORKER_VARIABLE] = str(slot.rank)
        env[protocol.TIMEOUT_VARIABLE] = f"{self.config.elastic_timeout:g}"
        if slot.rank < len(self.slots):
            env[protocol.GENERATION_VARIABLE] = "0"
        elif slot.rank in self.provisional:
            # Until it joins, a later worker's place is the one it would take in a generation of the
            # workers alive now: a rank below the size, a local rank no other worker of its host holds.
            env.update(place_env(self.provisional.pop(slot.rank)))
        return env

    def start(self) -> None:
        super().start()
        for rank in self.ranks:
            self.live[rank.slot.rank] = rank
        self.members = sorted(self.live)
        if self.config.host_discovery_script is not None:
            threading.Thread(target=self._discover_in_background, daemon=True, name="torchmn-host-discovery").start()

    def _start_worker(self, host: str) -> None:
        worker = self.next_worker
        self.next_worker += 1
        staying = sorted(w for w in self.live if w not in self.leaving)
        place = place_workers([(w, self.live[w].slot.host) for w in staying] + [(worker, host)])[-1]
        # The slot's rank is the worker's number, which names it for the job's life; its local place
        # (and with it the thread budget) is the one it would take among its host's workers.
        self.provisional[worker] = place
        slot = dataclasses.replace(place, rank=worker)
        try:
            rank = self.start_rank(slot, self.store.port)
        except RunError as e:
            self.provisional.pop(worker, None)
            self.console.message(f"torchmn run: could not start a new worker on {host}: {e}")
            self.cooldown[host] = time.monotonic() + COOLDOWN_S
            return
        self.live[worker] = rank
        self.added.append(worker)
        self.console.message(f"torchmn run: started worker {worker} on {host} ({len(self.live)} running); it joins "
                             f"at the others' next commit")

    # -- watching ---------------------------------------------------------------------------------

    def _handle(self, event: tuple, escalate: bool) -> None:
        if event[0] != "exit" or self.gave_up is not None or self.ending():
            super()._handle(event, escalate)
            return
        _, rank, code = event
        rank.returncode = code
        worker = rank.slot.rank
        self.live.pop(worker, None)
        if worker in self.leaving:
            self.left.append(worker)
            if code != 0 and not rank.stopped_by_launcher:
                self.console.message(f"torchmn run: worker {worker} (host {rank.slot.host}), which was leaving the "
                                     f"job, {describe_exit(code)}")
            return
        if code == 0:
            if not self.finished:
                # The job is done: workers still joining have nothing left to join.
                self._note_holders()
                waiting = [r for w, r in self.live.items() if w not in self.holders]
                self.procs.stop(signal.SIGTERM, only=waiting)
            self.finished.append(worker)
            return
        if rank.stopped_by_launcher:
            return
        if self.finished:
            # The others have completed: a failure now ends the job as in a fixed-size one.
            super()._handle(event, escalate)
            return
        if worker not in self.members:  # started, but never joined
            self.cooldown[rank.slot.host] = time.monotonic() + COOLDOWN_S
        self.lost.append(rank)
        alive = [w for w in self.members if w in self.live]
        self.console.message(f"torchmn run: worker {worker} (host {rank.slot.host}) {describe_exit(code)}; "
                             f"{len(alive)} of the generation's {len(self.members)} go on")
        if worker in self.members:
            self.stalled = []  # a reset that a lost worker asks for
            self._mark_broken()
            self._announce(alive)

    def watch(self) -> int:
        """Run the elastic job to its end: follow deaths, arrivals and the discovery script.

        Returns:
            0 when the last generation's workers all ended with status 0; the first failure's code
            when the job could not go on (every worker lost, or a failure after others completed);
            1 when it stayed below ``--min-np`` for longer than ``--elastic-timeout``; 128+N for a
            signal N to the launcher.

        Example::

            >>> job.start(); code = job.watch()   # doctest: +SKIP
        """
        last_scan = 0.0
        while self.live and not self.ending() and self.gave_up is None:
            self.next_event(0.05)
            if self.ending() or self.gave_up is not None:
                break
            self._follow_members()
            if time.monotonic() - last_scan > 0.5:
                self.procs.remember_descendants()
                last_scan = time.monotonic()
        if not self.live and not self.finished and self.first_failure is None and self.lost:
            # Nobody left to go on: the last to fail says why the job could not (the first were
            # absorbed by resets).
            self.first_failure = self.lost[-1]
        self.discovery_done.set()
        if self.gave_up is not None:
            self._tell_ranks_the_end()
        self.teardown(self.received_signal or signal.SIGTERM)
        for rank in self.ranks:
            rank.output.finish(idle=2.0)
        self.finish_display()
        return self._summarize()

    def _follow_members(self) -> None:
        """One look at the store and the hosts: announce a generation where one is due, start new
        workers where there is room, give up below --min-np after --elastic-timeout."""
        store = self.store.store
        if not self.published:
            # The first generation's ranks know their places from their variables; a worker that
            # joins later reads every generation from the store.
            self.published = True
            store.set(protocol.members_key(0), self._members_text([w for w in self.members if w in self.live]))
            store.set(protocol.GENERATION_KEY, "0")
        alive_members = [w for w in self.members if w in self.live]
        waiting = {}
        for w in list(self.live):
            key = protocol.waiting_key(w)
            if store.check([key]):
                waiting[w] = int(store.get(key).decode())
        newcomers = [w for w in self.live if w not in self.members and w in waiting and w not in self.leaving]
        left = [w for w in alive_members if waiting.get(w) == self.generation]
        if left:
            self._mark_broken()
            if self.generation not in self.stalled:
                self._count_stalls(store)
            if self.gave_up is not None:
                return
        if newcomers or left:
            self._announce(alive_members + sorted(newcomers))
        self._note_holders()
        if self.live and not self.finished and self.holders and not self.holders & set(self.live):
            last = next((r for r in reversed(self.lost) if r.slot.rank in self.holders), None)
            why = ""
            if last is not None:
                error = [line for line in extract_traceback(list(last.output.tail)) if line.strip()]
                why = (f" The last of them, worker {last.slot.rank} (host {last.slot.host}), "
                       f"{describe_exit(last.returncode)}" + (f": {_TORCH_PREFIX.sub('', error[-1].strip()).rstrip('.')}"
                                                              if error else "") + ".")
            # An error of the training code is quoted above and says what to do; a killed one needs the checkpoint.
            advice = ("see that error" if last is not None and 0 < last.returncode < 128
                      else "start it again from the newest checkpoint")
            self.gave_up = (f"torchmn run: every worker that held the training state is gone (workers "
                            f"{', '.join(map(str, sorted(self.holders)))}); the {len(self.live)} left had not received "
                            f"it yet.{why} Ended the job: {advice}.")
            return
        self._take_out_excess()
        alive = len(self.live)
        if alive < self.config.min_np:
            self.below_min_since = self.below_min_since or time.monotonic()
            if time.monotonic() - self.below_min_since > self.config.elastic_timeout:
                self._give_up()
                return
        else:
            self.below_min_since = None
        self._add_workers()

    def _count_stalls(self, store) -> None:
        """Members left the current generation with every one of them alive: a collective timed
        out (``TORCHMN_TIMEOUT``) waiting for a rank that was only slow, or ranks joined at a commit.
        Before any commit, that generation made no progress, and a reset goes back to the same
        commit: after STALLS_LIMIT such generations in a row, end the job instead of resetting forever."""
        if store.check([protocol.committed_key(self.generation)]):
            self.stalled = []
            return
        self.stalled.append(self.generation)
        if len(self.stalled) < STALLS_LIMIT:
            return
        timeout = self.exports.get("TORCHMN_TIMEOUT", self.base_env.get("TORCHMN_TIMEOUT"))
        self.gave_up = (f"torchmn run: {STALLS_LIMIT} generations in a row broke before any commit with every worker "
                        f"alive (generations {', '.join(map(str, self.stalled))}): a collective "
                        f"waited longer than TORCHMN_TIMEOUT ({timeout + ' s' if timeout else 'its default'}) for a "
                        f"rank that was still working (the ranks' output names it), and each reset went back to the "
                        f"same commit. Ended the job instead of resetting again: raise TORCHMN_TIMEOUT above the "
                        f"longest time one rank works while the others wait (evaluating or saving alone), or commit "
                        f"after that work.")

    def _note_holders(self) -> None:
        """Note the workers that have said they hold the training state."""
        store = self.store.store
        for w in self.live:
            if w not in self.holders and store.check([protocol.holds_key(w)]):
                self.holders.add(w)

    def _take_out_excess(self) -> None:
        """Take workers out where the discovery script now offers their host fewer slots than
        workers run there (:func:`choose_leavers`): a member leaves at the job's next commit (the
        others move to a generation without it, and it exits with status 0); a worker that has
        not joined yet is stopped."""
        if self.config.host_discovery_script is None or self.finished or self.gave_up is not None:
            return
        offered = self._capacity()
        staying = [(w, rank.slot.host) for w, rank in self.live.items() if w not in self.leaving]
        over = sum(max(0, n - offered.get(host, 0))
                   for host, n in collections.Counter(host for _, host in staying).items())
        if not over:
            self.kept_said = None
            return
        leavers = choose_leavers(staying, offered, self.config.min_np, self.holders & set(self.live))
        if len(leavers) < over and self.kept_said != tuple(offered.items()):
            self.kept_said = tuple(offered.items())
            self.console.message(f"torchmn run: --host-discovery-script offers fewer slots than the {len(staying)} "
                                 f"workers running; {over - len(leavers)} of them stay over the offer, since the "
                                 f"job keeps --min-np {self.config.min_np} and one worker that holds the training "
                                 f"state")
        if not leavers:
            return
        self.leaving.update(leavers)
        joined = [w for w in leavers if w in self.members]
        waiting = [self.live[w] for w in leavers if w not in self.members]
        for w in joined:
            self.store.store.set(protocol.removed_key(w), "")
        if waiting:
            self.procs.stop(signal.SIGTERM, only=waiting)
        hosts = ", ".join(f"{host}:{offered.get(host, 0)}" for host in dict.fromkeys(self.live[w].slot.host
                                                                                     for w in leavers))
        self.console.message(f"torchmn run: --host-discovery-script now offers {hosts}; "
                             + "; ".join(part for part in (
                                 joined and f"worker(s) {', '.join(map(str, joined))} leave the job at its next commit",
                                 waiting and f"stopped worker(s) {', '.join(str(r.slot.rank) for r in waiting)}, "
                                             f"which had not joined yet") if part))
        if joined:
            self._announce([w for w in self.members if w in self.live])

    def _mark_broken(self) -> None:
        """Tell the members that the current generation lost one: its world cannot be set up."""
        self.store.store.set(protocol.broken_key(self.generation), "")

    def _announce(self, workers: List[int]) -> None:
        """Publish a new generation of ``workers`` (in rank order), if there are enough of them."""
        workers = [w for w in workers if w in self.live and w not in self.leaving]
        if len(workers) < self.config.min_np or not workers:
            return  # the survivors wait at the rendezvous; _follow_members counts the time
        limit = self.config.reset_limit
        if limit is not None and self.generation >= limit:
            lost = "; ".join(f"worker {r.slot.rank} (host {r.slot.host}, {describe_exit(r.returncode)})"
                             for r in self.lost[-5:])
            self.gave_up = (f"torchmn run: the job reset {self.generation} time(s), --reset-limit {limit}; ended it "
                            f"instead of another reset. Last workers lost: {lost or 'none'}.")
            return
        store = self.store.store
        self.generation += 1
        store.set(protocol.members_key(self.generation), self._members_text(workers))
        store.set(protocol.GENERATION_KEY, str(self.generation))
        self.members = list(workers)
        if self.config.verbose:
            self.console.message(f"torchmn run: generation {self.generation}: workers "
                                 f"{', '.join(map(str, workers))} as ranks 0-{len(workers) - 1}")

    def _members_text(self, workers: List[int]) -> str:
        """A generation of ``workers`` (in rank order) as the store holds it: each one's place variables."""
        slots = place_workers([(w, self.live[w].slot.host) for w in workers])
        return protocol.dump_members([(w, place_env(slot)) for w, slot in zip(workers, slots)])

    def check_command(self) -> None:
        """:meth:`Job.check_command`, and one run of the discovery script, so that one that cannot
        run, fails or prints no ``host:slots`` lines is refused before any rank starts.

        Raises:
            RunError: the command is not found, or the discovery script does not answer.

        Example::

            >>> ElasticJob(LaunchConfig(["python", "train.py"], np=2, min_np=1,
            ...                         host_discovery_script="./missing.sh")).check_command()
            Traceback (most recent call last):
            torchmn.run.config.RunError: --host-discovery-script ./missing.sh could not run: ...
        """
        super().check_command()
        if self.config.host_discovery_script is not None:
            self.discovered = self._known(self._discover())

    def _discover(self) -> Dict[str, int]:
        """The hosts and slots the discovery script offers now; RunError where it does not answer."""
        script = self.config.host_discovery_script
        try:
            # A command line too, as Horovod takes it ("python3 discover.py").
            done = subprocess.run(shlex.split(script), capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_S)
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            raise RunError(f"--host-discovery-script {script} could not run: {e}. It must be an executable "
                           f"program (chmod +x), or a command line such as 'python3 discover.py', that prints "
                           f"host:slots lines") from e
        if done.returncode != 0:
            raise RunError(f"--host-discovery-script {script} exited with {done.returncode}: "
                           f"{done.stderr.strip()[-500:] or 'nothing on stderr'}")
        return parse_discovery(done.stdout, script)

    def _capacity(self) -> Dict[str, int]:
        """The hosts and slots new workers may take now: the discovery script's last answer."""
        if self.config.host_discovery_script is None:
            return self.known_hosts
        return self.discovered or {}

    def _discover_in_background(self) -> None:
        """Run the discovery script again and again, a second after each run ends, until the job
        ends: on a thread of its own (as Horovod's driver runs it), so that a slow script never
        holds up the launcher's handling of deaths, joins and signals, and its answer is at most a
        second and one run old when a slot frees."""
        while not self.discovery_done.wait(DISCOVERY_EVERY_S):
            try:
                self.discovered = self._known(self._discover())
            except RunError as e:  # a bad answer now and then must not end a running job
                self.console.message(f"torchmn run: {e}; keeping its last good answer")

    def _known(self, offered: Dict[str, int]) -> Dict[str, int]:
        """The hosts offered, this machine's names as one; hosts the job cannot reach are left out,
        once said: ranks on other hosts need them among -H/--hostfile (checked over ssh at the
        start, and the rendezvous placed where they reach it)."""
        hosts: Dict[str, int] = {}
        for host, slots in offered.items():
            if host == self.local_name or network.is_local(host):
                host = self.local_name
            elif host not in self.known_hosts:
                if host not in self.refused:
                    self.refused.add(host)
                    self.console.message(f"torchmn run: --host-discovery-script offers {host}, which is not among the "
                                         f"hosts given with -H/--hostfile; start the job with every host that may take "
                                         f"part in -H (with the slots it starts with), so it can be checked and reach "
                                         f"the rendezvous")
                continue
            hosts[host] = slots   # this machine under two names: the last, as for a host printed twice
        return hosts

    def _add_workers(self) -> None:
        """Start new workers in free slots, up to --max-np, while a member holds the state to give them."""
        if self.finished or not self.holders & set(self.live):
            return  # a new worker needs one that holds the state to receive it from
        room = self.config.max_np - len(self.live)
        if room <= 0:
            return
        used = collections.Counter(rank.slot.host for rank in self.live.values())
        now = time.monotonic()
        for host, slots in self._capacity().items():
            while room > 0 and used[host] < slots and self.cooldown.get(host, 0.0) <= now:
                self._start_worker(host)
                used[host] += 1
                room -= 1

    def _give_up(self) -> None:
        missing = [f"worker {r.slot.rank} (host {r.slot.host}, {describe_exit(r.returncode)})" for r in self.lost]
        self.gave_up = (f"torchmn run: only {len(self.live)} worker(s) left, below --min-np {self.config.min_np}, "
                        f"for more than --elastic-timeout {self.config.elastic_timeout:g} s; ended the job. Lost: "
                        f"{'; '.join(missing) or 'none'}. Offer more slots (-H, --host-discovery-script), lower "
                        f"--min-np, or raise --elastic-timeout.")

    def _tell_ranks_the_end(self) -> None:
        try:
            self.store.store.set(protocol.ENDED_KEY, self.gave_up)
        except Exception:  # noqa: BLE001 (the ranks are stopped next anyway)
            pass

    def _summarize(self) -> int:
        if self.gave_up is not None:
            self.console.message(self.gave_up)
            return 1
        if self.lost or self.added or self.left:
            lost = ", ".join(f"{r.slot.rank} ({r.slot.host}, {describe_exit(r.returncode)})" for r in self.lost)
            self.console.message(f"torchmn run: elastic job: {self.generation} generation(s) after the first; "
                                 f"workers lost: {lost or 'none'}; workers added: "
                                 f"{', '.join(f'worker {w}' for w in self.added) or 'none'}"
                                 + (f"; workers taken out: {', '.join(map(str, self.left))}" if self.left else ""))
        failed = self.first_failure
        if failed is not None and self.received_signal is None and not self.finished:
            self.console.message(failure_summary(failed, self.ranks, None,
                                                 earlier=[r for r in self.lost if r is not failed]))
            return exit_code_of(failed.returncode)
        return super()._summarize()
