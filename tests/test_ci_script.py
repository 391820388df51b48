"""`.ci/run` stops at the first failing step: `set -euo pipefail` before any command, one command a line, no
`&&` / `||` / `;` chaining (under `set -e` a failure on the left of `&&` does not stop the script, so a
failed install could skip the tests and CI pass with no test run); and its commands are the README's."""

import os
import re
import shlex
import subprocess
from pathlib import Path

from tests.paths import ROOT

CI_RUN = ROOT / ".ci" / "run"
CHAINING = ("&&", "||", ";", "&")


def commands(text: str) -> list[str]:
    """The script's command lines: comments, the shebang and blank lines dropped."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def problems(text: str) -> list[str]:
    """What lets a failing step of the script go unnoticed: a missing `set -euo pipefail` (first command),
    a command chained to another with && / || / ; / &, a line continued with a backslash."""
    lines = commands(text)
    found = [] if lines and lines[0] == "set -euo pipefail" else ["the first command is not `set -euo pipefail`"]
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        if any(token in CHAINING for token in tokens):
            found.append(f"chained command (a failure could be skipped): {line}")
        if line.endswith("\\"):
            found.append(f"continued line: {line}")
    return found


def test_ci_run_stops_at_the_first_failing_step():
    assert problems(CI_RUN.read_text()) == []
    assert os.access(CI_RUN, os.X_OK), ".ci/run must be executable"


def test_the_check_catches_chained_steps_and_a_missing_set_e():
    """The script as it was: `install && pytest` under set -e; and the same steps without `set -euo pipefail`."""
    old = ('#!/usr/bin/env bash\nset -euo pipefail\ncd "$(dirname "$0")/.."\n'
           'python3 -m pip install "torch==2.13.0" -e ".[test]" && python3 -m pytest -q\n'
           'python3 -m pip install -e . && python3 -m adaln_lab report --out report.json --quick\n')
    assert len(problems(old)) == 2 and all(p.startswith("chained command") for p in problems(old))
    assert problems("python3 -m pytest -q; python3 -m adaln_lab report\n") == [
        "the first command is not `set -euo pipefail`",
        "chained command (a failure could be skipped): python3 -m pytest -q; python3 -m adaln_lab report"]
    assert problems('set -euo pipefail\npython3 -c "print(1); print(2)"\n') == []  # quoted: not chaining


def test_ci_run_exits_at_a_failing_step_and_runs_no_later_one(tmp_path):
    """Run a copy of the script with a `python3` on PATH that logs its arguments and fails: one call, exit 1."""
    (tmp_path / ".ci").mkdir()
    script = tmp_path / ".ci" / "run"
    script.write_text(CI_RUN.read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls.log"}\nexit 1\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    first = next(line for line in commands(CI_RUN.read_text()) if line.startswith("python3 "))
    assert (tmp_path / "calls.log").read_text().splitlines() == [" ".join(shlex.split(first)[1:])]

def test_ci_run_runs_the_readme_commands_in_order():
    """The README says `.ci/run` runs exactly its install, test and report commands, in this order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Install and test", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    readme_commands = [line for block in blocks for line in commands(block)]
    ci_commands = [line for line in commands(CI_RUN.read_text()) if not line.startswith(("set ", "cd "))]
    assert ci_commands == readme_commands
