"""What a step of the evidence runner works with: its commands, each in a process group of its own under the
step's deadline, and the files they write (for MANIFEST.csv).

`Context.run(files, argv, ...)` removes the files first (a file left by an earlier run must never be recorded
under this commit), notes each with the command as the manifest shows it (from the checkout's root, the output
folder written as `.`), and runs the command from the root. A command the step's deadline cuts is killed with
its process group and ends the step (`StepTimeout`); one cut by its own, shorter timeout returns 124, as
coreutils' `timeout` does. In a dry run nothing is removed or run: each command is printed.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

STDOUT = "&1"  # stderr into the stdout file
TIMED_OUT = 124
BASE_MARK = "@BASE@"  # a tree exported for --base, shown as $BASE


class StepTimeout(Exception):
    """The step's deadline came while one of its commands ran."""


@dataclass
class Context:
    """One step's run: `root` (the checkout, every command's directory unless told), `out` (the output folder),
    `env` (the commands' environment), `deadline` (time.monotonic() at which the step is cut), `options` (the
    runner's parsed arguments), `machine` (manifest.machine()), `say` (prints a line to the console and the run's
    log), `dry_run`."""

    step: str
    root: Path
    out: Path
    env: dict
    deadline: float
    options: object
    machine: dict
    say: object
    dry_run: bool = False
    base: Path | None = None
    base_label: str | None = None
    recorded: list = field(default_factory=list)

    def left(self) -> float:
        """Seconds until the step's deadline."""
        return self.deadline - time.monotonic()

    def within(self, seconds: float) -> int:
        """`seconds`, or less where the step's deadline comes first (5 s kept for what follows; at least 1)."""
        return max(1, int(min(seconds, self.left() - 5)))

    def shown(self, argv: list[str], stdout: str | None = None, stderr: str | None = None,
              cwd: Path | None = None, env: dict | None = None) -> str:
        """The command as the manifest shows it: python3 for this interpreter, paths relative to the checkout, the
        output folder as `.`, a tree exported for --base as $BASE; redirections and a directory change spelt."""
        words = ["python3" if a == sys.executable else self.word(a) for a in argv]
        line = shlex.join(words).replace(BASE_MARK, "$BASE")
        line = " ".join(f"{k}={self.word(v)}" for k, v in (env or {}).items()) + (" " if env else "") + line
        if stdout:
            line += f" > {stdout}"
        if stderr:
            line += " 2>&1" if stderr == STDOUT else f" 2> {stderr}"
        if cwd is not None and Path(cwd) != self.root:
            line = f"cd {self.word(str(cwd))} && {line}"
        return line

    def word(self, text: str) -> str:
        for path, name in ((self.out, "."), (self.base, BASE_MARK if self.base_label else None), (self.root, ".")):
            if path is None or name is None:
                continue
            prefix = str(path)
            if text == prefix:
                return name
            if text.startswith(prefix + os.sep):
                rest = text[len(prefix) + 1:]
                return rest if name == "." else f"{name}/{rest}"
        return text.replace(BASE_MARK, "$BASE") if text.startswith(BASE_MARK) else text

    def run(self, files: list[str], argv: list[str], stdout: str | None = None, stderr: str | None = None,
            cwd: Path | None = None, env: dict | None = None, timeout: float | None = None, header: str = "",
            append: bool = False, shown: str | None = None) -> int:
        """Runs `argv` (its stdout into the output folder's file `stdout`, stderr into `stderr` or STDOUT, `header`
        written first, `append` to keep what the file holds) with `env` added to the environment; `files` (names in
        the output folder) are the ones the manifest gets rows for, under `shown` or the command as shown()."""
        line = shown or self.shown(argv, stdout, stderr, cwd, env)
        if self.dry_run:
            self.say(f"  {line}")
            return 0
        for name in files:
            if not append:
                (self.out / name).unlink(missing_ok=True)
            self.recorded.append((name, line))
        left = self.left()
        if left <= 0:
            raise StepTimeout
        step_cuts = timeout is None or timeout >= left  # else the command's own timeout comes first
        limit = left if step_cuts else timeout
        outputs = []
        try:
            out_file = err_file = subprocess.DEVNULL
            if stdout:
                (self.out / stdout).parent.mkdir(parents=True, exist_ok=True)
                out_file = open(self.out / stdout, "a" if append else "w")
                outputs.append(out_file)
                out_file.write(header)
                out_file.flush()
            if stderr == STDOUT:
                err_file = subprocess.STDOUT if stdout else subprocess.DEVNULL
            elif stderr:
                err_file = open(self.out / stderr, "w")
                outputs.append(err_file)
            process = subprocess.Popen(argv, cwd=cwd or self.root, env={**self.env, **(env or {})}, stdout=out_file,
                                       stderr=err_file, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                return process.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                if step_cuts:
                    raise StepTimeout from None
                return TIMED_OUT
        finally:
            for f in outputs:
                f.close()

    def note(self, name: str, line: str) -> None:
        """A file the step writes itself (a summary), recorded under `line`."""
        if not self.dry_run:
            self.recorded.append((name, line))

    def lines(self, name: str) -> list[str]:
        path = self.out / name
        return path.read_text(errors="replace").splitlines() if path.is_file() else []

    def show_tail(self, name: str, count: int) -> None:
        """Prints the last `count` lines of an output file (nothing in a dry run)."""
        if not self.dry_run:
            for line in self.lines(name)[-count:]:
                self.say(line)

    def show_matching(self, name: str, pattern: str, count: int | None = None) -> None:
        """Prints the lines of an output file that match `pattern` (the first `count` of them)."""
        if not self.dry_run:
            for line in [x for x in self.lines(name) if re.search(pattern, x)][:count]:
                self.say(line)
