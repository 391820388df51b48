"""Shared test setup.

- `gpu` mark: skipped without a CUDA device (on a GPU machine: `python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider
  tests`).
- `slow` mark: a repeat that adds no coverage (another test already checks the same property); skipped unless
  `--runslow` is given or ADALN_LAB_SLOW=1 is set: `python3 -m pytest -q -n 2 --runslow -m slow` runs them.
  A skip rather than `-m "not slow"` in addopts, so that `-m gpu` keeps working as it is.
- No GPU: NUMBA_ENABLE_CUDASIM=1 (set here, before anything imports numba), so the Numba twin's tests run in
  numba's CUDA simulator; tests that need it off start a fresh process without it.
- pytest-xdist: each worker takes its share of the cores (torch threads, and OMP_NUM_THREADS for the processes
  tests start, unless OMP_NUM_THREADS is set): N workers of all-core OpenMP pools on the same cores spin in
  each other's barriers. And `-n N` alone distributes with `--dist loadgroup` (like `load`, but the tests of
  one `xdist_group` share a worker, so a module-scoped fixture is built once); an explicit --dist is kept. Every
  worker puts the longest tests (LONG_FIRST) at the front of its collection, so none of them starts last.
"""

import os

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


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (or set ADALN_LAB_SLOW=1)")


def _run_slow(config) -> bool:
    return config.getoption("--runslow") or os.environ.get("ADALN_LAB_SLOW", "") == "1"


def _default_dist(config) -> bool:
    """Whether the command asked for no --dist of its own (`-n N` alone sets it to 'load')."""
    args = [str(a) for a in config.invocation_params.args]
    return not any(a == "--dist" or a.startswith("--dist=") or a == "-d" for a in args)


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "load" and _default_dist(config):
        config.option.dist = "loadgroup"  # the controller schedules by group
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and workerinput.get("adaln_lab_loadgroup"):
        config.option.loadgroup = True  # workers tag the grouped tests' ids (xdist reads its own --dist there)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist: tell each worker that the controller runs --dist loadgroup."""
    node.workerinput["adaln_lab_loadgroup"] = node.config.getoption("dist") == "loadgroup"


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
    if getattr(config, "workerinput", None) is not None:  # a pytest-xdist worker: the long tests go out first
        first = {name: rank for rank, name in enumerate(LONG_FIRST)}
        items.sort(key=lambda item: first.get(item.nodeid.split("[")[0].split("@")[0], len(first)))


# pytest-xdist sends a worker the next test when it is nearly done (the groups of `xdist_group` first, the biggest
# first; then the tests in collection order): a long test sent last keeps one worker busy while the other idles.
# So these, the longest on a 2-core CPU (seconds there) and not in a group, lead the collection of every worker
# (the same order everywhere, as xdist requires); the other tests keep theirs. A run without xdist keeps file order.
LONG_FIRST = (
    "tests/lab/test_notebooks.py::test_notebooks_read_complete_lab_files",  # 23
    "tests/core/test_kernels_compile.py::test_the_largest_T_accepted_compiles_in_seconds",  # 22
    "tests/nn/test_multi_gpu_script.py::test_the_multi_gpu_script_on_two_cpu_ranks",  # 13
    "tests/test_readme.py::test_readme_python_blocks_run_in_order_on_a_cpu",  # 10
    "tests/nn/test_fsdp.py::test_fsdp2_two_cpu_ranks_forward_bitwise_and_gradients_the_reduce_scatters_mean",  # 5
    "tests/harness/test_block_report.py::test_cli_writes_a_block_report_prints_its_figures_and_table_renders_it",  # 4
    "tests/core/test_kernels_compile.py::test_every_kernel_compiles",  # 8 x 2-5
    "tests/numba/test_forward.py::test_twin_table_rows_are_T_invariant",  # 4
    "tests/numba/test_op.py::test_numba_is_imported_only_by_the_numba_backend_and_cpu_tensors_need_the_simulator",
    "tests/nn/test_multi_gpu_script.py::test_the_multi_gpu_script_refuses_an_unknown_run_and_no_ranks",  # 3
    "tests/core/test_loader.py::test_cupys_import_fails_on_a_cache_path_it_cannot_make_unless_launchers_comes_first",
)


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
