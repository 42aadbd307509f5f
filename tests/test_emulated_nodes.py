"""The cross-node benchmarks' harness (bench/multinode/nodes.py): emulated nodes with cores of their
own and a shaped link, a real job across them, and nothing left behind. Needs root, iproute2 (ip,
tc) and openssh-server, as the multi-host tests do."""
import os
import signal
import subprocess
import sys
import time

import pytest
from jobs import REPO, WORKERS, clean_env

sys.path.insert(0, str(REPO / "bench" / "multinode"))
from nodes import EmulatedNodes  # noqa: E402

from cluster.netns import ClusterError  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_two_emulated_nodes_shape_their_link_and_average_with_every_algorithm():
    with EmulatedNodes(2, "100mbit") as nodes:
        namespaces, bridge = list(nodes.cluster.namespaces), nodes.cluster.bridge
        pids = [p.pid for p in nodes.cluster.sshd.values()]
        proc = subprocess.run(nodes.torchmn_run(1, [sys.executable, str(WORKERS / "emulated_nodes_job.py")]),
                              cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for name in ("auto", "flat", "hierarchical", "naive"):
            assert f"PASS {name}" in proc.stdout, proc.stdout
        # Each rank on its own node, pinned to that node's cores.
        for rank, (host, cores) in enumerate(zip(nodes.names, nodes.cores)):
            assert f"NODE {rank} {host} {cores}" in proc.stdout, proc.stdout
        # The job's traffic went through the token bucket on both ends of each node's link.
        for name, ns in zip(nodes.names, namespaces):
            inside = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", "eth0"],
                                    capture_output=True, text=True, timeout=20).stdout
            outside = subprocess.run(["tc", "-s", "qdisc", "show", "dev", nodes.cluster.outer_link(name)],
                                     capture_output=True, text=True, timeout=20).stdout
            for shown in (inside, outside):
                assert "tbf" in shown and "rate 100Mbit" in shown and "Sent 0 bytes" not in shown, shown
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert not any(ns in listed for ns in namespaces), listed
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True, timeout=20).stdout
    assert bridge not in links
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_the_harness_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ClusterError, match=r"root .*sudo") as caught:
        with EmulatedNodes(2, "1gbit"):
            pass
    assert "tc (apt-get install iproute2)" in str(caught.value)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert "node1" not in listed


def _namespaces() -> set:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_two_sigterms_in_a_row_still_tear_everything_down():
    """`timeout` (or a scheduler) passes on a SIGTERM of its own after the harness's: the second one
    must not cut the teardown short and leave namespaces and links behind."""
    before = _namespaces()
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "multinode" / "nodes.py"), "--nodes", "2",
                             "--link", "1gbit", "--", "sleep", "60"], cwd=REPO, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_namespaces() - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        made = _namespaces() - before
        assert len(made) == 2, "the harness never brought its nodes up"
        time.sleep(2)  # the job is starting on them
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # in the teardown now
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not made & _namespaces(), (made, proc.stderr.read()[-3000:])
    links = subprocess.run(["ip", "-br", "link", "show"], capture_output=True, text=True, timeout=20).stdout
    prefixes = {name.split("-")[0] for name in made}  # a cluster's namespaces, bridge and links share one prefix
    assert not any(line.startswith(tuple(prefixes)) for line in links.splitlines()), links
