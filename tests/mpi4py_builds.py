"""mpi4py for the tests: one build per MPI, each in its own folder, which a test puts on PYTHONPATH.

One mpi4py build links one MPI library (Open MPI's libmpi.so.40 or MPICH's libmpich.so.12), and
both MPIs are tested, so neither build goes into the interpreter's site-packages: a job gets the
build of the MPI that launches it, or none. mpi4py's binary wheel (4.1+) picks its MPI at run
time, but not Debian's MPICH, whose library is named libmpich.so.12; the builds come from source.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MPI4PY_VERSION = "4.1.2"
MPICC = {"openmpi": "mpicc.openmpi", "mpich": "mpicc.mpich"}
DEV_PACKAGE = {"openmpi": "libopenmpi-dev", "mpich": "libmpich-dev"}


def build_command(mpi: str) -> str:
    """The command that builds mpi4py against ``mpi`` into its folder (run from the repository)."""
    return (f"MPI4PY_BUILD_MPICC={MPICC[mpi]} python -m pip install --no-cache-dir --no-binary mpi4py "
            f"--target build/mpi4py-{mpi} mpi4py=={MPI4PY_VERSION}")


def mpi4py_dir(mpi: str) -> str:
    """The folder holding mpi4py built against ``mpi`` ("openmpi" or "mpich"); fails the test, with
    the command that builds it, when it is missing."""
    folder = REPO / "build" / f"mpi4py-{mpi}"
    if not (folder / "mpi4py" / "__init__.py").is_file():
        pytest.fail(f"mpi4py built against {mpi} is missing from {folder}: `apt-get install -y {DEV_PACKAGE[mpi]}` "
                    f"and run, in {REPO}: {build_command(mpi)}")
    return os.fspath(folder)
