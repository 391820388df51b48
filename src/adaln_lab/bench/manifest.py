"""MANIFEST.csv of an evidence folder, and the facts each of its rows records about the machine and the tree.

One row per file of the folder: `file` (relative to the folder), `commit` (of the tree that made it, `-dirty`
when tracked files differed from it), `command` (as run from the checkout's root, the folder written as `.`),
`torch` (torch's version), `gpu` (torch's name of GPU 0, "none" without one), `driver` (the NVIDIA driver's
version as nvidia-smi reports it, "none" without a GPU, "unknown" where it could not be read) and `date` (UTC,
when the step ended). Rows of folders written before the gpu and driver columns read "unknown" there.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

FIELDS = ("file", "commit", "command", "torch", "gpu", "driver", "date")
NAME = "MANIFEST.csv"

_PROBE = ("import json, torch\n"
          "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
          "print(json.dumps({'torch': torch.__version__, 'gpus': n, 'gpu': torch.cuda.get_device_name(0) if n else "
          "'none'}))")


def read(path: Path) -> list[dict]:
    """The rows of a MANIFEST.csv (none when it does not exist); columns it lacks read "unknown"."""
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [{k: row.get(k) or "unknown" for k in FIELDS} for row in csv.DictReader(f)]


def write(path: Path, rows: list[dict]) -> None:
    """MANIFEST.csv with FIELDS as its header and `rows` in order (written whole, then moved into place)."""
    part = path.with_name(f".{path.name}.part")
    with part.open("w", newline="") as f:
        out = csv.DictWriter(f, FIELDS, lineterminator="\n")
        out.writeheader()
        out.writerows({k: row[k] for k in FIELDS} for row in rows)
    os.replace(part, path)


def record(path: Path, rows: list[dict]) -> None:
    """Adds `rows` to the manifest at `path`; an older row of the same file goes (one row per file)."""
    files = {row["file"] for row in rows}
    write(path, [row for row in read(path) if row["file"] not in files] + rows)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def machine(env: dict | None = None) -> dict:
    """{"torch", "gpus", "gpu", "driver"} of this machine: torch asked in a process of its own (the caller holds no
    CUDA context while the steps run), the driver from nvidia-smi."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        found = {"torch": "unknown", "gpus": 0, "gpu": "unknown"}
    found["driver"] = driver() if found["gpus"] else "none"
    return found


def driver() -> str:
    """The NVIDIA driver's version (nvidia-smi), "unknown" where nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown"
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=60)
    except subprocess.SubprocessError:
        return "unknown"
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else "unknown"


def tree_commit(root: Path) -> tuple[str, bool]:
    """(commit, dirty) of the checkout at `root`: its COMMIT file (a copied tree), else git's short HEAD with
    dirty = tracked files differ from it, else ("unknown", False)."""
    named = root / "COMMIT"
    if named.is_file() and named.read_text().strip():
        return named.read_text().strip(), False

    def git(*args):
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown", False
    return head, bool(git("status", "--porcelain", "--untracked-files=no"))
