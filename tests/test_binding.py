"""`torchmn run --bind`: which CPUs each rank of a host gets (on a made-up two-domain machine), and
real ranks started bound to them with their share of threads."""
import os
import subprocess
import sys

import pytest

from torchmn import resources
from torchmn.run.processes import binding

AFFINITY = "import os; print('CPUS', sorted(os.sched_getaffinity(0)), 'THREADS', os.environ.get('OMP_NUM_THREADS'))"


def two_domain_machine(root):
    """8 CPUs in 2 NUMA domains (0,1,4,5 and 2,3,6,7), 4 cores of 2 hardware threads (CPUs n and n+4)."""
    for node, cpus in ((0, "0-1,4-5"), (1, "2-3,6-7")):
        os.makedirs(root / "node" / f"node{node}")
        (root / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    for cpu in range(8):
        topology = root / "cpu" / f"cpu{cpu}" / "topology"
        os.makedirs(topology)
        (topology / "thread_siblings_list").write_text(f"{cpu % 4},{cpu % 4 + 4}\n")
    return str(root)


def test_numa_binding_spreads_a_hosts_ranks_over_its_domains_in_blocks(tmp_path):
    root = two_domain_machine(tmp_path)
    four = binding.plan("numa", 4, range(8), root)
    assert [b.cpus for b in four] == [(0, 1, 4, 5), (0, 1, 4, 5), (2, 3, 6, 7), (2, 3, 6, 7)]
    assert [b.sharing for b in four] == [2, 2, 2, 2] and [b.threads for b in four] == [2, 2, 2, 2]
    assert four[2].where == "NUMA node 1 (CPUs 2-3,6-7)"
    assert [b.cpus for b in binding.plan("numa", 2, range(8), root)] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    three = binding.plan("numa", 3, range(8), root)  # the lone rank of domain 1 has it to itself
    assert [(b.cpus, b.threads) for b in three] == [((0, 1, 4, 5), 2), ((0, 1, 4, 5), 2), ((2, 3, 6, 7), 4)]
    one = binding.plan("numa", 1, range(8), root)
    assert one[0].cpus == (0, 1, 4, 5, 2, 3, 6, 7) and one[0].threads == 8


def test_numa_binding_binds_nothing_on_a_host_of_one_domain(tmp_path):
    assert binding.plan("numa", 2, [0, 1], str(tmp_path)) == [None, None]  # no node folders: one domain
    root = two_domain_machine(tmp_path)
    assert binding.plan("numa", 2, [0, 1, 4, 5], root) == [None, None]     # allowed CPUs all in domain 0
    assert binding.plan("none", 2, range(8), root) == [None, None]


def test_core_binding_gives_each_rank_whole_cores_of_its_domain(tmp_path):
    root = two_domain_machine(tmp_path)
    assert [b.cpus for b in binding.plan("core", 4, range(8), root)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    two = binding.plan("core", 2, range(8), root)
    assert [b.cpus for b in two] == [(0, 4, 1, 5), (2, 6, 3, 7)] and [b.threads for b in two] == [4, 4]


def test_core_binding_keeps_each_rank_within_one_domain(tmp_path):
    """3 ranks on 2 domains of 4 cores: cores in blocks of 8/3 would give rank 1 cores of both
    domains; spread over the domains first, each rank's cores are all in one."""
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        os.makedirs(tmp_path / "node" / f"node{node}")
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    three = binding.plan("core", 3, range(8), str(tmp_path))
    assert [b.cpus for b in three] == [(0, 1), (2, 3), (4, 5, 6, 7)]
    assert [b.cpus for b in binding.plan("core", 1, range(8), str(tmp_path))] == [tuple(range(8))]
    # Domains cut unevenly by the affinity (one core left in domain 0, 2 ranks' home): blocks of cores.
    assert [b.cpus for b in binding.plan("core", 4, [0, 4, 5, 6], str(tmp_path))] == [(0,), (4,), (5,), (6,)]


def test_core_binding_refuses_more_ranks_than_cores(tmp_path):
    with pytest.raises(ValueError, match=r"--bind core: 5 ranks on this host, but the launcher may use 4 core\(s\) "
                                         r"here \(CPUs 0-7\).*at most 4 ranks.*--bind numa.*--bind none"):
        binding.plan("core", 5, range(8), two_domain_machine(tmp_path))


def test_a_bound_ranks_thread_budget_is_its_share_within_an_allocation():
    n = resources.cpu_count_available()
    # A rank alone on its CPUs gets them all, however many ranks its host has; shared, its share.
    assert resources.launcher_thread_env(2, {}, bound=(n, 1))["OMP_NUM_THREADS"] == str(n)
    assert resources.launcher_thread_env(2, {}, bound=(n, 2))["OMP_NUM_THREADS"] == str(max(1, n // 2))
    # A Slurm allocation of 1 CPU on the node: at most its share, whatever the binding says.
    slurm = {"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "1"}
    assert resources.launcher_thread_env(2, slurm, bound=(n, 1))["OMP_NUM_THREADS"] == "1"
    assert resources.launcher_thread_env(2, {"OMP_NUM_THREADS": "3"}, bound=(n, 1)) == {}


def run(*args):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    return subprocess.run([sys.executable, "-m", "torchmn", "run", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_ranks_run_bound_to_their_cores_with_their_share_of_threads():
    mine = sorted(os.sched_getaffinity(0))
    n = min(2, len(mine))
    result = run("-np", str(n), "--bind", "core", sys.executable, "-c", AFFINITY)
    assert result.returncode == 0, result.stderr
    seen = sorted(line for line in result.stdout.splitlines() if "CPUS" in line)
    expected = [f"[{r}] CPUS {sorted(b.cpus)} THREADS {b.threads}" for r, b in enumerate(binding.plan("core", n, mine))]
    assert seen == expected, (seen, expected)
    unbound = run("-np", str(n), "--bind", "none", sys.executable, "-c", AFFINITY)
    assert unbound.stdout.count(f"CPUS {mine}") == n, unbound.stdout


def test_bind_core_with_more_ranks_than_cores_starts_no_rank():
    n = len(os.sched_getaffinity(0)) + 1
    result = run("-np", str(n), "--bind", "core", sys.executable, "-c", "print('STARTED')")
    assert result.returncode == 2, result.stderr
    assert f"--bind core: {n} ranks on this host" in result.stderr and "STARTED" not in result.stdout


def test_dry_run_shows_each_ranks_cpus():
    mine = sorted(os.sched_getaffinity(0))
    n = min(2, len(mine))
    dry = run("--dry-run", "-np", str(n), "--bind", "core", sys.executable, "train.py")
    assert dry.returncode == 0, dry.stderr
    shown = [line.strip() for line in dry.stdout.splitlines() if line.startswith("  CPUs")]
    assert shown == [f"CPUs (--bind core): {b.where}" for b in binding.plan("core", n, mine)], dry.stdout
    if binding.plan("numa", 2, mine) == [None, None]:  # one NUMA domain here, as on most small machines
        assert "CPUs (--bind numa): any (nothing to bind)" in run("--dry-run", "-np", "2", "true").stdout
