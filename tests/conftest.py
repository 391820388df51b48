"""Shared test setup.

- `gpu` mark: skipped without a CUDA device (on a GPU machine: `python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider
  tests`).
- `integration` mark: the heavy end-to-end tests (NVRTC compiles of the whole unit, the notebooks, the README's
  blocks, processes of their own: CuPy's cache, gloo ranks, CLI runs). CI runs them; `-m "not integration"` is the
  quick loop over the unit tests.
- `slow` mark: a repeat that adds no coverage (another test already checks the same property); skipped unless
  `--runslow` is given or ADALN_LAB_SLOW=1 is set: `python3 -m pytest -q -n 2 --runslow -m slow` runs them.
  A skip rather than `-m "not slow"` in addopts, so that `-m gpu` keeps working as it is.
- The package under test is this checkout's src/adaln_lab/ (installed editable, or src/ on PYTHONPATH): the tests
  and the processes they start import it by name, so another install answering instead stops the run at once.
- No GPU: NUMBA_ENABLE_CUDASIM=1 (set here, before anything imports numba), so the Numba twin's tests run in
  numba's CUDA simulator; tests that need it off start a fresh process without it.
- pytest-xdist (`-n N`, scheduled `--dist worksteal` by pyproject's addopts: an idle worker takes queued tests from a
  busy one, so no hand-kept order is needed): each worker takes its share of the cores (torch threads, and
  OMP_NUM_THREADS for the processes tests start, unless OMP_NUM_THREADS is set): N workers of all-core OpenMP pools on
  the same cores spin in each other's barriers.
"""

import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS and "OMP_NUM_THREADS" not in os.environ:  # a pytest-xdist worker: its share of the cores, for
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _THREADS = str(max(1, _CORES // _WORKERS))  # torch here and the processes the tests start
    os.environ["OMP_NUM_THREADS"] = _THREADS
    torch.set_num_threads(int(_THREADS))
if not HAS_CUDA:  # before any test module imports numba: without a GPU the Numba twin runs in numba's CUDA simulator
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def pytest_configure(config):
    import adaln_lab

    from tests.paths import PACKAGE

    found = getattr(adaln_lab, "__file__", None)
    if found is None or Path(found).resolve() != (PACKAGE / "__init__.py").resolve():
        raise pytest.UsageError(f"the tests import adaln_lab from {found or 'no file (a namespace package)'}, not "
                                f"from this checkout's {PACKAGE}: install the checkout (pip install -e .) or put its "
                                "src/ on PYTHONPATH")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (or set ADALN_LAB_SLOW=1)")


@pytest.fixture
def one_thread():
    """torch on one CPU thread for the test: many tiny calls, whose OpenMP barriers spin for ages on a busy 2-core
    machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_slow(config) -> bool:
    return config.getoption("--runslow") or os.environ.get("ADALN_LAB_SLOW", "") == "1"


def pytest_collection_modifyitems(config, items):
    skips = []
    if not HAS_CUDA:
        skips.append(("gpu", pytest.mark.skip(reason="needs a CUDA GPU (none here); run on a GPU machine, see "
                                                     "bench/README.md")))
    if not _run_slow(config):
        skips.append(("slow", pytest.mark.skip(reason="slow: a repeat of a property another test checks; run with "
                                                      "--runslow or ADALN_LAB_SLOW=1")))
    for item in items:
        for keyword, skip in skips:
            if keyword in item.keywords:
                item.add_marker(skip)


_SM90_LOOP = """
import types
from numba import cuda
from numba.cuda import dispatcher
from numba.cuda.cudadrv.error import NvvmSupportError
# device functions ask the current GPU for its compute capability; there is none here: say sm_90
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
for name, (kernel, sig, needle) in sigs.items():
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    except NvvmSupportError as error:
        print("NO_NVVM", error)
        raise SystemExit(0)
    assert ".entry" in ptx and needle in ptx, name
    print(name, "ok", len(ptx))
"""


def compile_sm90(source: str) -> str:
    """Runs `source` (which defines sigs = {name: (numba kernel, signature, text the PTX must hold)}) and compiles
    each kernel for numba's real CUDA target (NVVM, sm_90) in a fresh process without the simulator; returns its
    stdout (a line "<name> ok <PTX length>" per kernel); skips when libNVVM is missing."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-c", source + _SM90_LOOP], capture_output=True, text=True, env=env,
                         timeout=600)
    if "NO_NVVM" in run.stdout:
        pytest.skip("libNVVM not installed (the test extra brings cuda-toolkit[nvvm])")
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout
