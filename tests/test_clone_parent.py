"""Python started in the folder that holds the clone, where the clone's own folder is named adaln_lab.

With the clone installed editable, `import adaln_lab` there gets the package (src/adaln_lab/): the install puts src/
on sys.path with a plain .pth file, and a regular package found anywhere on the path wins over the clone's folder,
which Python would take for an empty namespace package. (A flat layout, the package beside pyproject.toml, is
installed through a meta-path finder that runs after the path's: there the namespace package won.) Without an
install, `python -m adaln_lab` gets that namespace package; the clone's root `__main__.py` says so in one line (exit
2) instead of "No module named adaln_lab.__main__". In the clone's root the package's own command line runs."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from tests.paths import PACKAGE, ROOT

pytestmark = pytest.mark.integration  # python started from the clone's parent

IMPORT = "import adaln_lab; print(adaln_lab.__file__)"


def _env():
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _parent(tmp_path: Path) -> Path:
    """tmp/parent, holding adaln_lab: a link to the clone (the folder a `git clone` makes)."""
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "adaln_lab").symlink_to(ROOT, target_is_directory=True)
    return parent


def _not_installed_editable() -> str | None:
    """Why this clone is not installed editable for this Python (pip's direct_url.json names where an install came
    from, and whether it is editable), or None when it is."""
    found = []
    for dist in importlib.metadata.distributions(name="adaln_lab"):
        info = json.loads(dist.read_text("direct_url.json") or "{}")
        url = urlparse(info.get("url", ""))
        source = Path(unquote(url.path)).resolve() if url.scheme == "file" else None
        if source == ROOT.resolve() and info.get("dir_info", {}).get("editable"):
            return None
        found.append(f"{info.get('url', 'no direct_url.json')} (editable: {info.get('dir_info', {}).get('editable')})")
    return (f"this clone ({ROOT}) is not installed editable for {sys.executable} (adaln_lab installs found: "
            f"{', '.join(found) or 'none'}): `pip install -e .` in the clone, as .ci/run does")


def test_import_adaln_lab_above_the_installed_clone_is_the_package(tmp_path):
    """The clone installed editable: from the folder holding it, `import adaln_lab` is the package's
    src/adaln_lab/__init__.py, the same file it is from any other folder (not an empty namespace package)."""
    reason = _not_installed_editable()
    if reason:
        pytest.skip(reason)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    anywhere = subprocess.run([sys.executable, "-c", IMPORT], cwd=elsewhere, env=_env(), capture_output=True,
                              text=True, timeout=120)
    assert anywhere.returncode == 0, anywhere.stderr[-2000:]
    assert Path(anywhere.stdout.strip()).resolve() == (PACKAGE / "__init__.py").resolve(), anywhere.stdout
    parent = _parent(tmp_path)
    above = subprocess.run([sys.executable, "-c", IMPORT], cwd=parent, env=_env(), capture_output=True, text=True,
                           timeout=120)
    assert above.returncode == 0, above.stderr[-2000:]
    printed = above.stdout.strip()
    assert printed != "None", (f"from {parent}, `import adaln_lab` got the clone's folder {parent / 'adaln_lab'} as "
                               "an empty namespace package, not the installed package")
    assert Path(printed).resolve() == (PACKAGE / "__init__.py").resolve() and Path(printed).is_file(), printed


def test_python_m_adaln_lab_above_the_clone_says_what_python_imported(tmp_path):
    """-S: no site-packages, so no installed adaln_lab answers instead (a clone that is not installed)."""
    parent = _parent(tmp_path)
    result = subprocess.run([sys.executable, "-S", "-m", "adaln_lab", "report", "--out", "r.json", "--quick"],
                            cwd=parent, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"python -m adaln_lab: error: from {parent}, 'adaln_lab' is the folder "
                                    f"{parent / 'adaln_lab'} itself (the clone: no __init__.py, so Python takes it "
                                    "for an empty namespace package), not the package inside it, src/adaln_lab/")
    assert "`pip install -e adaln_lab`" in result.stderr and "(PYTHONPATH=adaln_lab/src)" in result.stderr
    assert not (parent / "r.json").exists()


def test_python_m_adaln_lab_in_the_clones_root_is_the_package():
    """With the clone installed, or its src/ on PYTHONPATH (the GPU machine's bench/device.sh)."""
    result = subprocess.run([sys.executable, "-m", "adaln_lab", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m adaln_lab") and "block-report" in result.stdout
