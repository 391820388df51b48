"""`python -m adaln_lab` in the folder that holds the clone: Python takes the clone's folder (named adaln_lab, no
__init__.py) for an empty namespace package; the clone's root `__main__.py` says so in one line (exit 2) instead of
"No module named adaln_lab.__main__". In the clone's root the package's own command line still runs."""

import os
import subprocess
import sys

from tests.paths import ROOT
import pytest

pytestmark = pytest.mark.integration  # python started from the clone's parent


def _env():
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_python_m_adaln_lab_above_the_clone_says_what_python_imported(tmp_path):
    """-S: no site-packages, so no installed adaln_lab answers instead (a clone that is not installed)."""
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "adaln_lab").symlink_to(ROOT, target_is_directory=True)
    result = subprocess.run([sys.executable, "-S", "-m", "adaln_lab", "report", "--out", "r.json", "--quick"],
                            cwd=parent, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"python -m adaln_lab: error: from {parent}, 'adaln_lab' is the folder "
                                    f"{parent / 'adaln_lab'} itself (the clone: no __init__.py, so Python takes it "
                                    "for an empty namespace package), not the package inside it")
    assert "(cd adaln_lab)" in result.stderr and "`pip install -e adaln_lab`" in result.stderr
    assert not (parent / "r.json").exists()


def test_python_m_adaln_lab_in_the_clones_root_is_the_package():
    result = subprocess.run([sys.executable, "-m", "adaln_lab", "--help"], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m adaln_lab") and "block-report" in result.stdout
