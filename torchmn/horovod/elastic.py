"""``hvd.elastic`` is not part of torchmn.horovod: importing it says what to use instead."""
from torchmn.horovod.errors import ElasticImportError

raise ElasticImportError(
    "torchmn.horovod does not implement hvd.elastic (workers joining and leaving a running job). Use a "
    "checkpointing script that its scheduler or launcher restarts instead: save with torch.save on rank 0 every "
    "few steps, resume from the newest checkpoint at start, and let Slurm requeue the job (sbatch --requeue) or "
    "restart it; examples/slurm/ shows the set-up. hvd.elastic.State's commit()/restore() map to saving and "
    "loading that checkpoint.")
