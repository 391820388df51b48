"""Where a report goes: checked before anything is measured, kept when the write fails anyway.

`check_output(path)` runs before the measuring starts: it creates a missing directory (returning it, for
the caller to say so) and raises `OutputError`, one line naming the path, where nothing can be written.
`write` writes the JSON through a temporary file renamed over the target; `keep` writes it to a new
file in the system's temporary directory, for when `write` failed after the measuring.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path


class OutputError(ValueError):
    """An output path that cannot be written; the message is one line naming the path."""


def check_output(path: str | Path) -> Path | None:
    """Make sure a report can be written at `path`, before anything is measured.

    A missing directory is created (and returned, for the caller to say so); a path that is a
    directory, a parent that is a file, a directory that cannot be created or written in raise
    OutputError. Writability is probed with a temporary file, removed at once.
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{path} is a directory; give a file path, e.g. {path / 'report.json'}")
    parent, created = path.parent, None
    if not parent.exists():
        try:
            parent.mkdir(parents=True)
        except OSError as error:
            raise OutputError(f"cannot create the directory {parent} ({error.strerror or error})") from None
        created = parent
    elif not parent.is_dir():
        raise OutputError(f"{parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise OutputError(f"cannot write in {parent} ({error.strerror or error})") from None
    return created


def write(report: dict, path: str | Path) -> None:
    """`report` as JSON at `path` (its directory made if missing), through `path`.tmp renamed over it: a
    failed write (OSError, raised) leaves no half-written report and no .tmp behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    print(f"wrote {path}", file=sys.stderr)


def keep(report: dict) -> Path:
    """Write `report` to a new file in the temporary directory (where `write` failed) and return its path."""
    fd, name = tempfile.mkstemp(prefix=f"{report.get('kind', 'adaln_lab_report')}-{time.strftime('%Y%m%d-%H%M%S')}-",
                                suffix=".json")
    with os.fdopen(fd, "w") as file:
        file.write(json.dumps(report, indent=2, default=str) + "\n")
    return Path(name)
