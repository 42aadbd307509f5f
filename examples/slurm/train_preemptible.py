"""Training that survives Slurm preemption: checkpoint on a signal, requeue, resume.

    sbatch examples/slurm/preemptible.sbatch            # see that file and docs/launching/slurm.md

Slurm warns a job before it ends it: ``#SBATCH --signal=USR1@120`` sends SIGUSR1 to every task
120 s before the time limit, and ``scancel --signal=USR1 JOBID`` does the same on demand. Then:

1. every rank's handler only sets a flag (nothing unsafe happens inside a signal handler);
2. at the next step boundary all ranks agree with one allreduce whether any rank was signalled, so
   they all stop after the same step, even if the signal reached them at different moments;
3. rank 0 writes the checkpoint atomically (a temporary file, then ``os.replace``), so a job killed
   while saving leaves the previous checkpoint intact, never a torn one;
4. after a barrier (the checkpoint is complete before anyone leaves), rank 0 runs
   ``scontrol requeue $SLURM_JOB_ID``: Slurm ends this run and queues the same job again;
5. the requeued job runs the same command, finds the checkpoint and continues from its step.

Preemption and a plain ``scancel`` send SIGTERM instead, and SIGKILL ``KillWait`` seconds later (30
by default): on SIGTERM the ranks save the checkpoint the same way but do not requeue (a preempting
Slurm requeues the job itself where configured to; ``scancel`` means stop), so the next run of the
command resumes from it.

The model is a small linear regression on synthetic data, so the example needs no download; the
data of each step depends only on the step and the rank, so a resumed run sees the same batches it
would have seen without the interruption. ``--sleep`` slows each step down, to give you time to
send the signal by hand in a demonstration.

Outside Slurm (``torchmn run -np 2 python train_preemptible.py``) the same code checkpoints on
SIGUSR1 or SIGTERM to the launcher (which passes SIGUSR1 on, and stops the ranks with SIGTERM) and
exits; it just has no queue to go back to.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

import torch

import torchmn

FEATURES = 16
BATCH = 32


class StopRequest:
    """Remembers that a signal arrived; the training loop looks at it between steps."""

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        self.signum = 0
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum


def save_checkpoint(path, state):
    """Write ``state`` so that ``path`` always holds a whole checkpoint: old or new, never half."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX within one filesystem


def load_checkpoint(path):
    """The saved state, or None when there is no checkpoint yet (a first run)."""
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu")


def requeue_this_job():
    """Ask Slurm to end this run and queue the job again; False outside Slurm or if refused."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        print("not a Slurm job: nothing to requeue", flush=True)
        return False
    # The job needs --requeue (or JobRequeue=1 in slurm.conf, the default) for this to be allowed.
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        print(f"scontrol requeue {job_id} failed: {proc.stderr.strip()}", file=sys.stderr, flush=True)
        return False
    print(f"requeued job {job_id}", flush=True)
    return True


def batch(step, rank):
    """This rank's part of step ``step``: the same numbers whenever the step is run."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    true_w = torch.linspace(-1, 1, FEATURES)
    y = x @ true_w + 0.01 * torch.randn(BATCH, generator=g)
    return x, y


def main():
    parser = argparse.ArgumentParser(description="Preemption-aware training under Slurm")
    parser.add_argument("--steps", type=int, default=500, help="total training steps (default 500)")
    parser.add_argument("--checkpoint", default="checkpoints/preemptible.pt", metavar="PATH",
                        help="checkpoint file, on a filesystem every node sees")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0, help="initial weights")
    parser.add_argument("--sleep", type=float, default=0.0, metavar="SECONDS",
                        help="pause after each step (for demonstrations)")
    parser.add_argument("--print-every", type=int, default=20, metavar="N")
    parser.add_argument("--no-requeue", action="store_true",
                        help="on the signal, checkpoint and exit without requeueing")
    args = parser.parse_args()

    # Installed first thing: until then SIGUSR1 would kill the process (its default action).
    stop = StopRequest()
    comm = torchmn.create_communicator()

    torch.manual_seed(args.seed)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    # Also broadcasts rank 0's initial weights, so a fresh start is the same on every rank.
    optimizer = torchmn.create_multi_node_optimizer(optimizer, comm)

    # Rank 0 reads the checkpoint and sends it to all, so every rank starts from the same state.
    state = load_checkpoint(args.checkpoint) if comm.rank == 0 else None
    state = comm.bcast_obj(state)
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if comm.rank == 0:
            print(f"resumed from step {start} (restart {os.environ.get('SLURM_RESTART_COUNT', 0)})",
                  flush=True)

    for step in range(start, args.steps):
        # One tiny allreduce per step: stop together if any rank was signalled.
        signum = comm.allreduce(torch.tensor([stop.signum]), op="max").item()  # SIGTERM (15) wins
        if signum:
            if comm.rank == 0:
                save_checkpoint(args.checkpoint, {"step": step, "model": model.state_dict(),
                                                  "optimizer": optimizer.state_dict()})
                print(f"signal received ({signal.Signals(signum).name}): checkpoint saved at step {step} to "
                      f"{args.checkpoint}", flush=True)
            comm.barrier()  # the checkpoint is complete before any rank leaves
            if comm.rank == 0 and signum == signal.SIGUSR1 and not args.no_requeue:
                requeue_this_job()
            comm.finalize()
            return 0
        x, y = batch(step, comm.rank)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        loss.backward()
        optimizer.step()
        if comm.rank == 0 and (step % args.print_every == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)

    if comm.rank == 0 and start >= args.steps:
        # The checkpoint is already further on: rewriting it as step --steps would misstate its weights.
        print(f"nothing to do: the checkpoint is at step {start}, --steps is {args.steps}", flush=True)
    elif comm.rank == 0:
        save_checkpoint(args.checkpoint, {"step": args.steps, "model": model.state_dict(),
                                          "optimizer": optimizer.state_dict()})
        print(f"done: {args.steps} steps", flush=True)
    comm.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
