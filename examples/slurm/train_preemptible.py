"""Training that survives Slurm preemption and failures: checkpoint, requeue, resume.

    sbatch examples/slurm/preemptible.sbatch            # one srun task per rank
    sbatch examples/slurm/preemptible_torchmn_run.sbatch   # one torchmn run per node
    # see those files and docs/launching/slurm.md

Slurm warns a job before it ends it: ``#SBATCH --signal=USR1@120`` sends SIGUSR1 to every task
120 s before the time limit, and ``scancel --signal=USR1 JOBID`` does the same on demand. Then:

1. every rank's handler only sets a flag (nothing unsafe happens inside a signal handler);
2. at the next step boundary all ranks agree with one allreduce whether any rank was signalled, so
   they all stop after the same step, even if the signal reached them at different moments;
3. every rank saves a checkpoint with ``torchmn.checkpoint.Checkpointer`` (model, optimizer, and
   each rank's random number generators); its files are written atomically and the step counts
   only once every rank has written, so a job killed while saving resumes from the previous one;
4. rank 0 runs ``scontrol requeue $SLURM_JOB_ID``: Slurm ends this run and queues the same job again;
5. the requeued job runs the same command, loads the newest complete checkpoint and continues.

The script also saves a checkpoint every ``--checkpoint-every`` steps, so that a run that fails
(a crash, a lost node) loses little: ``preemptible_torchmn_run.sbatch`` requeues a job whose step
failed, and ``torchmn run --max-restarts`` restarts one on a single machine; either way the next
run resumes here. ``--fail-at STEP`` makes the last rank fail once at that step (in the first run
only), to try this.

Preemption and a plain ``scancel`` send SIGTERM instead, and SIGKILL ``KillWait`` seconds later (30
by default): on SIGTERM the ranks save the checkpoint the same way but do not requeue (a preempting
Slurm requeues the job itself where configured to; ``scancel`` means stop), so the next run of the
command resumes from it.

The model is a small linear regression on synthetic data, so the example needs no download; the
data of each step depends only on the step and the rank, so a resumed run ends with the weights
of a run that was never interrupted, bit for bit. ``--sleep`` slows each step down, to give you
time to send the signal by hand in a demonstration.

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
from torchmn.checkpoint import Checkpointer, atomic_save

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mnist"))
from device_choice import add_device_argument, training_device  # noqa: E402

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


def requeue_this_job():
    """Ask Slurm to end this run and queue the job again; False outside Slurm or if refused."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        print("not a Slurm job: nothing to requeue", flush=True)
        return False
    # Said first: Slurm ends this run (SIGTERM to every process, scontrol too) as soon as it accepts.
    print(f"requeueing job {job_id}", flush=True)
    # The job needs --requeue (or JobRequeue=1 in slurm.conf, the default) for this to be allowed.
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if proc.returncode > 0:  # below 0: scontrol was stopped by that SIGTERM, the requeue under way
        print(f"scontrol requeue {job_id} failed: {proc.stderr.strip()}", file=sys.stderr, flush=True)
        return False
    return True


def restart_count():
    """How many times this job was started before: Slurm's requeues plus torchmn run's restarts."""
    return int(os.environ.get("SLURM_RESTART_COUNT", 0)) + int(os.environ.get("TORCHMN_RESTART_COUNT", 0))


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
    parser.add_argument("--checkpoint", default="checkpoints/preemptible", metavar="DIR",
                        help="checkpoint directory, on a filesystem every node sees")
    parser.add_argument("--checkpoint-every", type=int, default=100, metavar="N",
                        help="also save a checkpoint every N steps (default 100)")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help="where rank 0 writes the trained weights at the end (default: DIR/model.pt)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0, help="initial weights")
    parser.add_argument("--sleep", type=float, default=0.0, metavar="SECONDS",
                        help="pause after each step (for demonstrations)")
    parser.add_argument("--print-every", type=int, default=20, metavar="N")
    parser.add_argument("--no-requeue", action="store_true",
                        help="on the signal, checkpoint and exit without requeueing")
    parser.add_argument("--fail-at", type=int, default=None, metavar="STEP",
                        help="the last rank fails at this step in the job's first run (to try restarts)")
    add_device_argument(parser)
    args = parser.parse_args()

    # Installed first thing: until then SIGUSR1 would kill the process (its default action).
    stop = StopRequest()
    comm = torchmn.create_communicator()
    device = training_device(comm, args.device)

    torch.manual_seed(args.seed)
    model = torch.nn.Linear(FEATURES, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    # Also broadcasts rank 0's initial weights, so a fresh start is the same on every rank.
    optimizer = torchmn.create_multi_node_optimizer(optimizer, comm)

    # Every rank loads the newest step that every rank saved completely; None on a first run.
    checkpoints = Checkpointer(args.checkpoint, comm, keep=2, model=model, optimizer=optimizer)
    start = checkpoints.load_latest() or 0
    if start and comm.rank == 0:
        print(f"resumed from step {start} (restart {restart_count()})", flush=True)

    saved = checkpoints.resumed_from  # the step on disk that holds the current state, if any
    for step in range(start, args.steps):
        # One tiny allreduce per step: stop together if any rank was signalled.
        signum = comm.allreduce(torch.tensor([stop.signum]), op="max").item()  # SIGTERM (15) wins
        if signum:
            if step != saved:
                checkpoints.save(step)  # collective: returns once every rank's files are written
            if comm.rank == 0:
                print(f"signal received ({signal.Signals(signum).name}): checkpoint saved at step {step} to "
                      f"{args.checkpoint}", flush=True)
                if signum == signal.SIGUSR1 and not args.no_requeue:
                    requeue_this_job()
            comm.finalize()
            return 0
        if step == args.fail_at and restart_count() == 0 and comm.rank == comm.size - 1:
            raise RuntimeError(f"failing at step {step} on purpose (--fail-at)")
        x, y = (t.to(device) for t in batch(step, comm.rank))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        loss.backward()
        optimizer.step()
        if comm.rank == 0 and (step % args.print_every == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        if (step + 1) % args.checkpoint_every == 0 and step + 1 < args.steps:
            checkpoints.save(step + 1)
            saved = step + 1
        if args.sleep:
            time.sleep(args.sleep)

    if start >= args.steps:
        if comm.rank == 0:
            print(f"nothing to do: the checkpoint is at step {start}, --steps is {args.steps}", flush=True)
    else:
        checkpoints.save(args.steps)
        if comm.rank == 0:
            atomic_save(model.state_dict(), args.out or os.path.join(args.checkpoint, "model.pt"))
            print(f"done: {args.steps} steps", flush=True)
    comm.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
