"""pyproject.toml's extras: `notebooks` brings a notebook client and every module the notebooks import; the
CUDA-only wheels (CuPy, numba-cuda) are the `cuda` extra, which the test extra includes; the package imports and
runs on a CPU without them."""

import ast
import os
import re
import subprocess
import sys

import pytest

from ..paths import NOTEBOOKS, ROOT

pytestmark = pytest.mark.integration  # processes without the extras

tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML")
nbformat = pytest.importorskip("nbformat", reason="the test extra brings nbformat")

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
CUDA_ONLY = ("cupy-cuda13x", "numba-cuda")
# the distribution that provides a module the notebooks import (standard library modules need none)
PROVIDES = {"matplotlib": "matplotlib", "IPython": "ipykernel", "torch": "torch", "adaln_lab": None}


def _names(requirements) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def _notebook_imports() -> set[str]:
    modules = set()
    for path in NOTEBOOKS.glob("*.ipynb"):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            code = "\n".join(line for line in cell.source.splitlines() if not line.startswith(("%", "!")))
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.Import):
                    modules |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    modules.add(node.module.split(".")[0])
    return modules


def test_the_notebooks_extra_brings_a_client_and_what_the_notebooks_import():
    notebooks = _names(EXTRAS["notebooks"])
    assert notebooks & {"jupyterlab", "notebook"}, "no notebook client in the notebooks extra"
    assert {"ipykernel", "nbclient", "nbformat"} <= notebooks  # a kernel, and `python -m adaln_lab.lab.notebooks`
    available = notebooks | _names(PROJECT["dependencies"])
    for module in _notebook_imports() - set(sys.stdlib_module_names):
        assert module in PROVIDES, f"the notebooks import {module}: say which distribution provides it"
        assert PROVIDES[module] is None or PROVIDES[module] in available, module


def test_cuda_only_wheels_are_an_extra_that_the_test_extra_includes():
    assert not _names(PROJECT["dependencies"]) & set(CUDA_ONLY)
    assert _names(EXTRAS["cuda"]) == set(CUDA_ONLY)
    assert "adaln_lab[cuda]" in EXTRAS["test"]  # the CPU tests use numba's CUDA simulator and CuPy's kernel cache


BLOCKED = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("cupy", "cupyx", "cupy_backends", "numba", "numba_cuda"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
import adaln_lab, adaln_lab.nn, adaln_lab.harness.report, adaln_lab.lab.errors
from adaln_lab import final_adaln_out
from adaln_lab.harness.inputs import make

out = final_adaln_out(*make(1, 5, H=64, D=32, T=3).args)
assert out.shape == (5, 64), out.shape
print("ok without the cuda extra")
"""


def test_the_package_imports_and_runs_on_a_cpu_without_the_cuda_extra():
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, cwd=ROOT)
    assert done.returncode == 0 and "ok without the cuda extra" in done.stdout, done.stderr[-3000:]
