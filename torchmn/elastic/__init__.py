"""Elastic training: ranks that die leave the job, new ones join it, and nobody restarts.

Under ``torchmn run -np 4 --min-np 2 --max-np 4`` a script wraps its training function::

    comm = torchmn.create_communicator()
    optimizer = torchmn.create_multi_node_optimizer(torch.optim.Adam(model.parameters()), comm)
    state = torchmn.elastic.State(model=model, optimizer=optimizer, epoch=0, batch=0)

    @torchmn.elastic.run
    def train(state):
        ...                      # state.commit() every few steps

    train(state)

When a rank dies, the survivors' collectives fail, and each goes back to its last commit, moves
to a new world of the survivors in the same process (the communicator and optimizer it holds then
describe that world) and goes on. A rank the launcher adds joins at the others' next commit and
receives the state from rank 0. Users' guide: ``docs/elastic.md``; the launcher's side:
:mod:`torchmn.run.elastic`; the store keys between them: :mod:`.protocol`.

The names load on first use, so that the launcher can read :mod:`.protocol` without torch.
"""
from torchmn import lazy_names

_NAMES = {
    "State": "torchmn.elastic.state",
    "ElasticSampler": "torchmn.elastic.sampler",
    "run": "torchmn.elastic.reset",
    "HostsUpdatedInterrupt": "torchmn.elastic.errors",
    "ElasticJobEndedError": "torchmn.elastic.errors",
    "StateLostError": "torchmn.elastic.errors",
}

__getattr__, __dir__, __all__ = lazy_names.attach(__name__, _NAMES)
