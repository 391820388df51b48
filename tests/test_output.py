"""What the README's test command prints: failures and errors summarised, not a line per skipped GPU test."""

import subprocess
import sys

import pytest

from .paths import ROOT

pytestmark = pytest.mark.integration  # a pytest run of its own


def test_the_test_command_lists_no_skipped_gpu_tests():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_dlpack.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    lines = run.stdout.splitlines()
    assert any("skipped" in line for line in lines[-3:]), lines[-3:]  # GPU tests were skipped, and counted
    assert not [line for line in lines if line.startswith("SKIPPED")], run.stdout[-2000:]
