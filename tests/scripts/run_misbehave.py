"""A rank that misbehaves on purpose, for launcher teardown tests.

Usage: run_misbehave.py MODE PID_DIR FAIL_RANK
Every rank writes its pid to PID_DIR/rank<r>.pid. Modes:
  raise       FAIL_RANK raises ValueError once every rank has started; the others sleep.
  sigkill     FAIL_RANK kills itself with SIGKILL; the others sleep.
  grandchild  every rank starts a `sleep 600` in its own process group (pid in grandchild<r>.pid),
              the others also one in a new session (escaped<r>.pid); then like `raise`.
  sleep       every rank sleeps (for signal forwarding tests).
"""
import os
import signal
import subprocess
import sys
import time

mode, pid_dir, fail_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def write(name, pid):
    path = os.path.join(pid_dir, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(pid))
    os.replace(path + ".tmp", path)


if mode == "grandchild":
    child = subprocess.Popen(["sleep", "600"])
    write(f"grandchild{rank}.pid", child.pid)
    if rank != fail_rank:
        # A daemon that left the rank's process group; found through the launcher's scans.
        escaped = subprocess.Popen(["sleep", "600"], start_new_session=True)
        write(f"escaped{rank}.pid", escaped.pid)
write(f"rank{rank}.pid", os.getpid())
print(f"rank {rank} started", flush=True)

if rank == fail_rank and mode in ("raise", "sigkill", "grandchild"):
    # Fail only once every rank is up, so the test knows every pid it must see gone.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len([n for n in os.listdir(pid_dir) if n.startswith("rank")]) < size:
        time.sleep(0.05)
    time.sleep(0.3)  # let the others' descendant scans see their children
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"boom from rank {rank}")
time.sleep(600)
