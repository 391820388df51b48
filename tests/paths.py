"""Paths the tests read, from the checkout's root, and the rule for committed evidence files (`needs_evidence`)."""

import os
from pathlib import Path

import pytest

from adaln_lab.lab.evidence import RELATIVE

ROOT = Path(__file__).resolve().parent.parent  # the checkout: pyproject.toml, src/, bench/, docs/, notebooks/
PACKAGE = ROOT / "src" / "adaln_lab"  # the package (src layout), its CUDA sources in kernels_cu/
DATA = ROOT / "tests" / "data"
# the committed GPU evidence (refilled from a GPU run), or ADALN_LAB_EVIDENCE_DIR as adaln_lab.lab.evidence reads it
EVIDENCE = Path(os.environ.get("ADALN_LAB_EVIDENCE_DIR") or ROOT / RELATIVE)
NOTEBOOKS = ROOT / "notebooks"


def _missing(path: Path) -> str:
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"{shown} is not committed (yet): it comes from a GPU run, see bench/README.md"


def needs_evidence(*names: str):
    """Mark: skip the test while any of these committed evidence files (in EVIDENCE) is missing
    (the evidence folder is emptied and refilled from a GPU run); what it checks is checked whenever they
    are there."""
    missing = [EVIDENCE / name for name in names if not (EVIDENCE / name).is_file()]
    return pytest.mark.skipif(bool(missing), reason="; ".join(_missing(p) for p in missing))
