"""An elastic training job whose result can be replayed: float64 MLP, SGD with momentum, each
rank's batch a function of (step, rank, world size).

Run under ``torchmn run -np N --min-np M ...`` with OUT_DIR as its first argument. Every rank
writes its pid to OUT_DIR/pids/<worker> (so a test can kill it), and the place variables it started
with (RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE OMP_NUM_THREADS) to OUT_DIR/places/<worker>; after each step all ranks
compare their parameters; at the end (and a second run function, which changes nothing) rank 0 writes the final parameters, the
world size of every committed step and the reset callbacks' calls to OUT_DIR/result.pt. Rank 0 appends "<time> <step> <world size>" to
OUT_DIR/progress after each step. Options: --steps, --shard-state (none|false|true), --step-sleep
(seconds per step, so that kills land mid-training), --commit-every, --die-in-commit STEP (worker 1
kills itself inside that step's commit, as it is about to send its part of a sharded optimizer's
state on, having received its neighbour's), --die-in-commit-after-reset WORKER (that worker does so
in the first commit after its first reset), --die-in-setup-after-reset WORKER (that worker kills
itself while the members set up the world of its first reset, after it arrived there, so that the
others wait for it inside torch.distributed's set-up), --die-after-address-after-reset WORKER (that
worker kills itself in that set-up once its address is in the store, and the others read it a
second later, so that their gloo retries a dead address inside C++; every worker then bounds a
set-up at 5 s), --lr-per-rank LR (the learning rate is LR x
the world size, set again by a reset callback, instead of 0.05), --checkpoint-every K (a Checkpointer,
built before the run function as scripts do, saves every K steps into OUT_DIR/ckpt, across resets
that change the optimizer's kind; after each commit, or with --save-between-commits at every K-th
step, which a reset then repeats), --alone-before-step N --alone-s S (rank 1 works alone for S
seconds before step N, each time it comes there, after a reset too); the run also ends at the next commit once
OUT_DIR/stop exists. SIGUSR1 prints every thread's stack to stderr (a test that timed out says
where the workers were).
"""
import argparse
import faulthandler
import os
import signal
import time

import torch

import torchmn
import torchmn.elastic
from torchmn.elastic import setup_store
from elastic_train_model import loss_of, make_model

faulthandler.register(signal.SIGUSR1, all_threads=True)

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--shard-state", choices=["none", "false", "true"], default="none")
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--commit-every", type=int, default=1)
parser.add_argument("--die-in-commit", type=int, default=None)
parser.add_argument("--die-in-commit-after-reset", default=None)
parser.add_argument("--die-in-setup-after-reset", default=None)
parser.add_argument("--die-after-address-after-reset", default=None)
parser.add_argument("--lr-per-rank", type=float, default=None)
parser.add_argument("--checkpoint-every", type=int, default=None)
parser.add_argument("--save-between-commits", action="store_true")
parser.add_argument("--alone-before-step", type=int, default=None)
parser.add_argument("--alone-s", type=float, default=0.0)
args = parser.parse_args()


def die_in_setup_after_reset():
    """Make torch.distributed's set-up of any world after the first kill this process, a moment
    after it starts (the other members are inside theirs by then, waiting for this one)."""
    set_up = torch.distributed.init_process_group

    def set_up_then_die(*a, **k):
        if os.environ.get("TORCHMN_ELASTIC_GENERATION", "0") != "0":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        return set_up(*a, **k)
    torch.distributed.init_process_group = set_up_then_die


def die_after_address_after_reset(dies: bool):
    """In the set-up of any world after the first kill, make this process kill itself at its first
    wait for a key once it has written one (its address: gloo writes it before reading the others'),
    or, for the others, wait a second before their first read, so that they find its address only
    once it is dead."""
    watched = setup_store.watched

    def watched_then_die(store, generation):
        setup = watched(store, generation)
        if generation == 0:
            return setup

        class Dying(type(setup)):
            written = waited = False

            def set(self, key, value):
                super().set(key, value)
                Dying.written = True

            def wait(self, keys, timeout=None):
                if dies and Dying.written:
                    os.kill(os.getpid(), signal.SIGKILL)
                if not dies and not Dying.waited:
                    Dying.waited = True
                    time.sleep(1.0)
                return super().wait(keys, timeout)
        return Dying(store, generation)
    setup_store.watched = watched_then_die


if __name__ == "__main__":
    os.makedirs(os.path.join(args.out, "pids"), exist_ok=True)
    worker = os.environ.get("TORCHMN_ELASTIC_WORKER", "0")
    if worker == args.die_in_setup_after_reset:
        die_in_setup_after_reset()
    if args.die_after_address_after_reset is not None:
        setup_store.SETUP_TIMEOUT_S = 5.0
        die_after_address_after_reset(worker == args.die_after_address_after_reset)
    with open(os.path.join(args.out, "pids", worker), "w") as f:
        f.write(str(os.getpid()))
    os.makedirs(os.path.join(args.out, "places"), exist_ok=True)
    with open(os.path.join(args.out, "places", worker), "w") as f:  # the place it started in, before any world
        f.write(" ".join(os.environ.get(k, "-") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                          "OMP_NUM_THREADS")))
    comm = torchmn.create_communicator()
    model = make_model()
    shard = {"none": None, "false": False, "true": True}[args.shard_state]
    lr = 0.05 if args.lr_per_rank is None else args.lr_per_rank * comm.size
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                                    comm, shard_state=shard)
    state = torchmn.elastic.State(model=model, optimizer=optimizer, step=0, sizes=[])
    resets = []

    def on_reset():
        resets.append(comm.size)
        if args.lr_per_rank is not None:
            for group in optimizer.param_groups:
                group["lr"] = args.lr_per_rank * comm.size
    state.register_reset_callbacks([on_reset])
    checkpointer = None
    if args.checkpoint_every:
        from torchmn.checkpoint import Checkpointer
        checkpointer = Checkpointer(os.path.join(args.out, "ckpt"), comm, keep=2, model=model, optimizer=optimizer)

    @torchmn.elastic.run
    def train(state):
        while state.step < args.steps:
            if state.step == args.alone_before_step and comm.rank == 1:
                time.sleep(args.alone_s)  # works alone (evaluates, say) each time it comes here
            optimizer.zero_grad()
            loss_of(model, state.step, comm.rank, comm.size).backward()
            optimizer.step()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            lo, hi = comm.allreduce(flat.clone(), "min"), comm.allreduce(flat.clone(), "max")
            if not torch.equal(lo, hi):
                print(f"MISMATCH at step {state.step} on rank {comm.rank}/{comm.size}", flush=True)
                raise SystemExit(3)
            state.sizes = state.sizes + [comm.size]
            state.step += 1
            if comm.rank == 0:
                with open(os.path.join(args.out, "progress"), "a") as f:
                    f.write(f"{time.time():.3f} {state.step} {comm.size}\n")
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if checkpointer is not None and args.save_between_commits and state.step % args.checkpoint_every == 0:
                checkpointer.save(state.step)   # a reset goes back past it: the replay saves it again
            if state.step % args.commit_every == 0 or state.step == args.steps:
                if (state.step == args.die_in_commit and worker == "1") or \
                        (worker == args.die_in_commit_after_reset and resets):
                    comm.send_obj = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
                state.commit()
                if checkpointer is not None and not args.save_between_commits and \
                        state.step % args.checkpoint_every == 0:
                    checkpointer.save(state.step)
                stop = torch.tensor([float(os.path.exists(os.path.join(args.out, "stop")))])
                if comm.allreduce(stop, "max").item():
                    break

    train(state)
    after_train = list(resets)
    trained = [p.detach().clone() for p in model.parameters()]

    @torchmn.elastic.run
    def evaluate(state):  # a second run function in the same world, as scripts call one to evaluate
        return state.step, [p.detach().clone() for p in model.parameters()]

    # What changed after the last commit (a last step, say) is what the second run function starts
    # from, and a State made after a reset (held by every rank, committed by none) is no lost state.
    # The same values on every rank, each once every rank holds its copy: the default optimizer's
    # ranks on a node share their parameters.
    comm.barrier()
    with torch.no_grad():
        for p, t in zip(model.parameters(), trained):
            p.copy_(t + 1)
    committed_step = state.step
    state.step += 100
    seen_step, seen_params = evaluate(state)
    fresh_step, _ = evaluate(torchmn.elastic.State(model=model, step=state.step + 1))
    comm.barrier()
    with torch.no_grad():
        for p, t in zip(model.parameters(), trained):
            p.copy_(t)
    state.step = committed_step
    if comm.rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()], "sizes": state.sizes,
                    "resets": after_train, "resets_after_evaluate": list(resets),
                    "evaluate_saw": (seen_step - committed_step,
                                     all(torch.equal(s, t + 1) for s, t in zip(seen_params, trained))),
                    "fresh_state_saw": fresh_step - committed_step}, os.path.join(args.out, "result.pt"))
    print(f"worker {worker} done as rank {comm.rank}/{comm.size} after {len(resets)} reset(s)", flush=True)
