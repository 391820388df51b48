"""Progress of the harness on stderr: tqdm bars on a terminal, plain lines in a log.

On a terminal (stderr a TTY) `progress` is a tqdm bar; nested bars are fine there. When stderr
is a pipe or a file, tqdm's redraws (carriage returns, and for nested bars the cursor-up code
ESC [A) would litter the log, so `progress` is then `LineProgress`: one plain line when the
work ends ("all_rows n=8: 16/16 calls in 2.1 s"). `ADALN_LAB_PROGRESS=bars` or `=lines` forces
one or the other; `TQDM_DISABLE` (set, and not "0" or "false"; the notebooks set it) turns both off.
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm


def terminal(stream=None) -> bool:
    """Whether progress goes to a terminal (bars) rather than a log (plain lines)."""
    forced = os.environ.get("ADALN_LAB_PROGRESS")
    if forced in ("bars", "lines"):
        return forced == "bars"
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class LineProgress:
    """The part of tqdm's interface the harness uses, writing one line to stderr on `close`."""

    def __init__(self, total: int | None, desc: str, unit: str, iterable=None):
        self.total, self.desc, self.unit, self.iterable = total, desc, unit, iterable
        self.n, self.postfix, self.start, self.closed = 0, "", time.perf_counter(), False

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        of = f"/{self.total}" if self.total is not None else ""
        print(f"{self.desc}: {self.n}{of} {self.unit}s in {time.perf_counter() - self.start:.1f} s",
              file=sys.stderr, flush=True)

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def disabled() -> bool:
    """Whether TQDM_DISABLE asks for no progress at all: set, and not '', '0' or 'false'."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false")


def progress(total: int | None, desc: str, unit: str = "call", leave: bool = False, iterable=None):
    """A progress bar of `total` steps (or over `iterable`): tqdm on a terminal, else `LineProgress`;
    a silent tqdm when `disabled()`."""
    if iterable is not None and total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if disabled():
        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=True)
    if terminal():
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, dynamic_ncols=True)
    return LineProgress(total, desc, unit, iterable)


def write(line: str) -> None:
    """Print a line to stderr without breaking a bar in progress."""
    if terminal():
        tqdm.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)
