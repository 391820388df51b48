"""tests/numba's setup: the simulator's tests on one core, and one process compiling the twin for sm_90."""

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _simulator_on_one_core():
    """numba's CUDA simulator runs a block as one Python thread per CUDA thread (512 for the table kernel) and a
    manager thread that polls them; on several cores they hand the GIL to each other across cores, which costs
    about 3x the wall time and 4x the CPU time of the same run on one core (a table launch at H 32, D 16, T 3:
    5.3 s wall / 6.4 s CPU on 2 cores, 1.7 s / 1.7 s on one), and steals the core of the other pytest-xdist
    worker. So this module's tests run on one core: pytest-xdist worker gwN takes core N (mod the cores it may
    use), and the affinity is put back after the module. Only scheduling changes: every simulated thread runs
    the same code on the same data, so every result is the same.

    Only where torch runs one thread here (pytest-xdist with a worker per core, see tests/conftest.py, or
    OMP_NUM_THREADS=1): a torch thread pool started while pinned would stay on that core."""
    simulating = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"  # tests/conftest.py: where there is no GPU
    if not simulating or not hasattr(os, "sched_setaffinity") or torch.get_num_threads() != 1:
        yield
        return
    allowed = os.sched_getaffinity(0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    cores = sorted(allowed)
    os.sched_setaffinity(0, {cores[(int(worker) if worker.isdigit() else 0) % len(cores)]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.fixture(scope="session")
def twin_ptx_for_sm90():
    """stdout of `compile_sm90` (tests/conftest.py) for the forward's and the backward's twin kernels together
    (test_forward.py's and test_backward.py's SM90_SIGS): one fresh process and one import of numba for both
    tests (about 3 s of each one's run), every kernel compiled and checked as before."""
    from ..conftest import compile_sm90
    from .test_backward import SM90_SIGS as backward
    from .test_forward import SM90_SIGS as forward

    return compile_sm90(forward + "\n_forward_sigs = sigs\n" + backward + "\nsigs = {**_forward_sigs, **sigs}\n")
