"""Where the evidence tooling lives: the modules the runner's steps run are importable as adaln_lab.bench.*
(no bench/scripts/ left, no test loading a file by its path), each development one-off in bench/tools/ says what
it is in a one-line docstring that bench/README.md repeats, and bench/device.sh only prepares the machine and calls
the runner. Every evidence folder's MANIFEST.csv has one row per file, with the GPU and the driver."""

import ast
import csv
import json
import subprocess
import sys
from pathlib import Path

from adaln_lab.bench import manifest
from adaln_lab.bench.steps import STEPS

from ..paths import PACKAGE as ADALN_LAB, ROOT
import pytest

pytestmark = pytest.mark.integration  # every step module imported

PACKAGE = ADALN_LAB / "bench"
TOOLS = sorted((ROOT / "bench" / "tools").glob("*.py"))


def test_the_step_modules_import_and_the_package_imports_none_of_them():
    names = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert {"compare_trees", "host_breakdown", "host_model", "memory_figures", "multi_gpu", "sanitize_calls", "sweep",
            "train_step", "host_trace", "block_profile", "runner", "steps", "manifest", "timing"} <= set(names)
    probe = ("import importlib, importlib.util, json, sys\nimport adaln_lab.bench\n"
             "bare = sorted(m for m in sys.modules if m.startswith('adaln_lab.bench.'))\n"
             f"for name in {names!r}:\n"
             "    if name != 'diffusers_patch_plugin' or importlib.util.find_spec('diffusers'):\n"
             "        importlib.import_module('adaln_lab.bench.' + name)\n"
             "print(json.dumps(bare))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_no_script_directory_is_left_and_no_test_loads_a_file_by_path():
    assert not list((ROOT / "bench").glob("scripts/*.py"))
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__):
            continue
        text = path.read_text()
        for needle in ("spec_from_file_location", "SourceFileLoader", "run_path(", '/ "scripts"', '/ "tools"'):
            assert needle not in text, f"{path.relative_to(ROOT)} holds {needle!r}"


def test_each_tool_has_a_one_line_docstring_that_the_bench_readme_repeats():
    readme = (ROOT / "bench" / "README.md").read_text()
    assert len(TOOLS) >= 5
    for tool in TOOLS:
        doc = ast.get_docstring(ast.parse(tool.read_text()))
        assert doc and "\n" not in doc and doc.endswith("."), tool.name
        assert f"`{tool.name}`: {doc[0].lower()}{doc[1:]}" in readme or f"`{tool.name}`: {doc}" in readme, tool.name


def test_each_name_a_tool_imports_from_adaln_lab_exists():
    """The tools run only on the device; a name they import that a refactor removed fails here, on the CPU."""
    import importlib.util

    missing = []
    for tool in TOOLS:
        for node in ast.walk(ast.parse(tool.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "adaln_lab":
                module = importlib.import_module(node.module)
                missing += [f"{tool.name}: {node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name) and not (
                                hasattr(module, "__path__")
                                and importlib.util.find_spec(f"{node.module}.{alias.name}"))]
    assert not missing


def test_the_bench_readme_names_every_step_and_device_sh_is_a_thin_wrapper():
    readme = (ROOT / "bench" / "README.md").read_text()
    for name in STEPS:
        assert f"| `{name}` |" in readme, name
    device = (ROOT / "bench" / "device.sh").read_text().splitlines()
    assert len(device) < 40 and device[-1] == 'exec python3 -m adaln_lab.bench "$@"'


def test_every_evidence_folder_lists_each_of_its_files_once_with_the_gpu_and_driver():
    folders = sorted(p for p in (ROOT / "bench" / "results").iterdir() if p.is_dir())
    assert {"h100", "h200", "cpu"} <= {f.name for f in folders}
    for folder in folders:
        with (folder / manifest.NAME).open(newline="") as f:
            header = next(csv.reader(f))
        assert tuple(header) == manifest.FIELDS, folder.name
        rows = manifest.read(folder / manifest.NAME)
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                       if p.is_file() and p.name != manifest.NAME)
        assert sorted(row["file"] for row in rows) == files, folder.name
        for row in rows:
            assert row["gpu"] == "none" if folder.name == "cpu" else folder.name.upper() in row["gpu"], row
            assert row["driver"] and row["torch"] and row["commit"], row
