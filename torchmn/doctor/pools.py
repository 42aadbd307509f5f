"""The thread pools a process with a rank's thread settings opens: torch's intra- and inter-op
pools and every OpenMP/BLAS pool threadpoolctl finds.

Another process's pools cannot be asked directly, so a short probe process is started with the
rank's thread variables and reports what it opened (what the rank's pools started at, before the
script's own ``torch.set_num_threads``, which its busy threads then show).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

_PROBE = """
import json, os, torch
from threadpoolctl import threadpool_info
print(json.dumps({"torch_intra_op": torch.get_num_threads(), "torch_inter_op": torch.get_num_interop_threads(),
                  "pools": [{"api": i["internal_api"], "library": os.path.basename(i["filepath"]),
                             "threads": i["num_threads"]} for i in threadpool_info()]}))
"""
# Variables that size thread pools: the rank's values replace the doctor's own.
_POOL_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "VECLIB_", "NUMEXPR_", "GOMP_", "KMP_")


def probe(settings: dict, timeout: float = 60) -> Optional[dict]:
    """The pools a process with these thread settings opens.

    Args:
        settings: a rank's thread variables (``RankProcess.settings``).
        timeout: seconds the probe may take.

    Returns:
        ``{"torch_intra_op": n, "torch_inter_op": m, "pools": [{"api", "library", "threads"}]}``,
        or None where the probe failed.

    Example::

        >>> probe({"OMP_NUM_THREADS": "1"})["torch_intra_op"]
        1
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(_POOL_PREFIXES)}
    env.update({k: v for k, v in settings.items() if k.startswith(_POOL_PREFIXES)})
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=timeout)
        return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def describe_pools(pools: Optional[dict]) -> str:
    """The pools :func:`probe` found, in one line of words.

    Args:
        pools: what :func:`probe` returned, or None where it failed.

    Returns:
        ``"torch intra-op N, inter-op M"`` followed by each OpenMP/BLAS pool's API, library and
        threads, or ``"unknown (the probe process failed)"`` where ``pools`` is empty or None.

    Example::

        >>> describe_pools(probe({"OMP_NUM_THREADS": "1"}))
        'torch intra-op 1, inter-op 1; openmp (libgomp.so.1) 1'
    """
    if not pools:
        return "unknown (the probe process failed)"
    libs = ", ".join(f"{p['api']} ({p['library']}) {p['threads']}" for p in pools["pools"])
    return f"torch intra-op {pools['torch_intra_op']}, inter-op {pools['torch_inter_op']}" + (f"; {libs}" if libs else "")
