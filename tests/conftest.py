import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); run on the H200, see bench/README.md")
    for item in items:
        if "gpu" in item.keywords:
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


@pytest.fixture
def compile_for_sm90():
    """compile(source) -> stdout: runs `source` (which defines sigs = {name: (numba kernel, signature,
    text the PTX must hold)}) and compiles each kernel for numba's real CUDA target (NVVM, sm_90) in a
    fresh process without the simulator; skips when libNVVM is missing."""
    import os
    import subprocess
    import sys

    def compile_(source: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        run = subprocess.run([sys.executable, "-c", source + _SM90_LOOP], capture_output=True, text=True, env=env,
                             timeout=600)
        if "NO_NVVM" in run.stdout:
            pytest.skip("libNVVM not installed (the test extra brings cuda-toolkit[nvvm])")
        assert run.returncode == 0, run.stderr[-4000:]
        return run.stdout

    return compile_
