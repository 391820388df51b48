"""Where the lab's numbers come from: measured now, or read from the committed GPU evidence.

A notebook sets `MODE = "auto" | "evidence" | "measure"` at its top and calls `resolve_mode(MODE)`:
- "measure": measure afresh on this machine (the GPU when there is one; on a CPU the small sizes);
- "evidence": read the committed GPU files in `bench/results/<EVIDENCE_MACHINE>/` (`report.json`, written by
  `python -m adaln_lab report`; `lab_errors.json`, `lab_latency.json`, `lab_invariance.json`,
  written by `python -m adaln_lab.lab --out bench/results/<EVIDENCE_MACHINE>`); a lab file that is absent is
  computed live on this CPU at small sizes instead, and the banner says so;
- "auto": "measure" where torch sees CUDA, "evidence" elsewhere.

$ADALN_LAB_EVIDENCE_DIR=DIR makes evidence mode read DIR instead, e.g. the folder of `python -m adaln_lab.lab
--out DIR [--quick]`. Such a folder holds no report.json (unless `python -m adaln_lab report --out
DIR/report.json` wrote one) and no sweep.json: `load_report(required=False)` is then None, and a notebook
shows `missing(name)` ("report.json: not measured in this run ...") where a figure of those files would be.

`obtain(kind, mode, measure)` does the above for one lab file and returns `(data, banner)`: the
banner is the line a notebook prints, so a reader always sees what the figures are. With
$ADALN_LAB_SAVE_DIR set, measure mode on a GPU also writes what it measured there as `lab_<kind>.json`
(the quick figures of a CPU never): the GPU run that renders the notebooks thereby writes the evidence
they read on a CPU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch

MODES = ("auto", "evidence", "measure")
KINDS = ("errors", "latency", "invariance")
# the lent machine HEAD's evidence was made on: the one folder of bench/results/ that holds HEAD's kernels' figures
# (each file names its commit, command and device in the folder's MANIFEST.csv and its own header)
EVIDENCE_MACHINE = "h100"
RELATIVE = Path("bench") / "results" / EVIDENCE_MACHINE


def repo_root() -> Path:
    """The checkout holding `bench/results/<EVIDENCE_MACHINE>/report.json`: the package's own (editable install),
    else the current directory or one of its parents (a notebook runs in notebooks/)."""
    here = Path(__file__).resolve().parents[3]  # src/adaln_lab/lab/evidence.py -> the checkout
    for root in (here, Path.cwd(), *Path.cwd().parents):
        if (root / RELATIVE / "report.json").is_file():
            return root
    return here


def evidence_dir() -> Path:
    """bench/results/<EVIDENCE_MACHINE> of the checkout, or $ADALN_LAB_EVIDENCE_DIR when set: a folder of
    `python -m adaln_lab.lab --out DIR` (tests point it at a synthetic copy)."""
    override = os.environ.get("ADALN_LAB_EVIDENCE_DIR")
    return Path(override) if override else repo_root() / RELATIVE


def resolve_mode(mode: str = "auto") -> str:
    """"measure" or "evidence" (see module docstring); anything but the three MODES is an error."""
    if mode not in MODES:
        raise ValueError(f"MODE must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "measure" if torch.cuda.is_available() else "evidence"
    return mode


def device_for(mode: str) -> torch.device:
    """The device a measurement in this mode runs on: CUDA in measure mode when present, else the CPU."""
    return torch.device("cuda" if mode == "measure" and torch.cuda.is_available() else "cpu")


def lab_path(kind: str, directory: str | Path | None = None) -> Path:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return Path(directory or evidence_dir()) / f"lab_{kind}.json"


def load_json(path: str | Path) -> dict | None:
    """The JSON object in `path`, or None when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def load_report(directory: str | Path | None = None, required: bool = True) -> dict | None:
    """The committed report of `python -m adaln_lab report` (bench/results/<EVIDENCE_MACHINE>/report.json);
    when there is none, FileNotFoundError, or None if not `required` (a folder of `python -m adaln_lab.lab
    --out DIR` holds no report: the notebooks then say `missing("report.json")` where they would show it)."""
    path = Path(directory or evidence_dir()) / "report.json"
    report = load_json(path)
    if report is None and required:
        raise FileNotFoundError(f"no report at {path}")
    return report


NOT_MEASURED = "not measured in this run"
WRITERS = {"report.json": "python -m adaln_lab report --out DIR/report.json",
           **{f"lab_{kind}.json": "python -m adaln_lab.lab --out DIR" for kind in KINDS}}


def missing(name: str, what: str = "") -> str:
    """The line a notebook shows for a figure whose evidence file `name` the evidence folder lacks."""
    writer = WRITERS.get(name)
    return (f"{what or name}: {NOT_MEASURED} (no {name} in {_shown(evidence_dir())}"
            + (f"; `{writer}` writes one)" if writer else ")"))


def machine(data: dict) -> str:
    """The machine of a lab file (its `meta`) or of a report (top level): the GPU's name, else 'CPU (arch)'."""
    env = (data.get("meta") or data).get("environment") or {}
    return env.get("gpu") or f"CPU ({env.get('cpu') or 'unknown'})"


def live(device) -> str:
    """'computed now on NVIDIA H100 80GB HBM3' or 'computed now on this CPU': for what a notebook measures itself."""
    device = torch.device(device)
    return f"computed now on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'this CPU'}"


def save(data: dict, path: str | Path) -> Path:
    """Write `data` as indented JSON, atomically (the report's writer: a temporary file, then a rename)."""
    from ..harness.report import write

    write(data, path)
    return Path(path)


def meta(device: torch.device, quick: bool) -> dict:
    """Provenance of a measurement: the harness report's environment and commit, and the size flag."""
    from ..harness.report import provenance, environment

    return {**provenance(), "environment": environment(device), "quick": quick}


def describe(data: dict) -> str:
    """'NVIDIA H200, commit 0123abc, full sizes' for a lab file's `meta` or a report's top level."""
    m = data.get("meta") or data
    commit = str(m.get("adaln_lab_commit") or "unknown")[:7]
    return f"{machine(data)}, commit {commit}, {'quick (small) sizes' if m.get('quick') else 'full sizes'}"


def obtain(kind: str, mode: str, measure: Callable[[torch.device, bool], dict],
           directory: str | Path | None = None) -> tuple[dict, str]:
    """(data, banner) for one lab file. `measure(device, quick)` makes the data when it is not read.

    measure mode: `measure(device, quick=device is the CPU)`. evidence mode: the committed
    `lab_<kind>.json`, or, when it is absent, `measure(cpu, quick=True)` with a banner saying that
    these are small CPU figures and not the GPU's.
    """
    mode = resolve_mode(mode)
    path = lab_path(kind, directory)
    if mode == "measure":
        device = device_for(mode)
        data = _measured(measure, device, device.type == "cpu")
        if os.environ.get("ADALN_LAB_SAVE_DIR") and device.type == "cuda":
            save(data, lab_path(kind, os.environ["ADALN_LAB_SAVE_DIR"]))
        return data, f"MODE measure: measured now on {describe(data)}."
    data = load_json(path)
    if data is not None:
        source = "ADALN_LAB_EVIDENCE_DIR" if os.environ.get("ADALN_LAB_EVIDENCE_DIR") else "committed evidence"
        return data, f"MODE evidence: {source} {_shown(path)} ({describe(data)})."
    data = _measured(measure, torch.device("cpu"), True)
    return data, (f"MODE evidence, but {path.name} is not committed yet: computed live on this CPU at small sizes "
                  f"({describe(data)}). These are NOT GPU figures; a GPU run of "
                  f"`python -m adaln_lab.lab --out bench/results/<machine>` replaces them.")


def _measured(measure, device: torch.device, quick: bool) -> dict:
    data = measure(device, quick)
    data.setdefault("meta", meta(device, quick))
    return data


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(repo_root().resolve()))
    except ValueError:
        return str(path)


def say(banner: str) -> None:
    """Print the banner where a notebook reader sees it (stdout, framed)."""
    line = "=" * min(100, max(len(part) for part in banner.split("\n")))
    print(f"{line}\n{banner}\n{line}", file=sys.stdout)
