"""Prints the variables a launcher gives a rank, one KEY=VALUE line each."""
import os

NAMES = ("TORCHMN_RANK", "TORCHMN_SIZE", "TORCHMN_LOCAL_RANK", "TORCHMN_LOCAL_SIZE", "TORCHMN_NODE_RANK",
         "TORCHMN_NODE_COUNT", "TORCHMN_HOST", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
         "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "PYTHONUNBUFFERED",
         "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCHMN_NUM_THREADS")
for name in NAMES:
    print(f"{name}={os.environ.get(name, '<unset>')}")
