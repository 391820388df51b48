"""`.ci/run` stops at the first failing step: `set -euo pipefail` before any command, one command a line, no
`&&` / `||` / `;` chaining (under `set -e` a failure on the left of `&&` does not stop the script, so a
failed install could skip the tests and CI pass with no test run); its commands are the README's; and it
installs nothing outside a virtualenv unless CI=true (its first command, `GUARD`, refuses in one line)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.integration  # .ci/run in processes of its own

CI_RUN = ROOT / ".ci" / "run"
CHAINING = ("&&", "||", ";", "&")
GUARD = "python3 -c "  # the virtualenv check, the script's first python3 command


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


def run_copy(tmp_path: Path, interpreter: Path, status: int, ci: str | None) -> tuple[subprocess.CompletedProcess,
                                                                                      list[str]]:
    """Run a copy of the script with a `python3` on PATH that logs its arguments, runs `python3 -c` (the guard)
    with `interpreter` and answers every other call with `status`; CI set to `ci` (None: unset).
    Returns the result and the logged calls' arguments."""
    (tmp_path / ".ci").mkdir()
    script = tmp_path / ".ci" / "run"
    script.write_text(CI_RUN.read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\nif [ "$1" = "-c" ]; then exec {interpreter} "$@"; fi\n'
                    f"exit {status}\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    if ci is not None:
        env["CI"] = ci
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    return result, log.read_text().splitlines() if log.exists() else []


def python3_calls() -> list[str]:
    """The arguments of the script's python3 commands, in order (the guard first)."""
    return [" ".join(shlex.split(line)[1:]) for line in commands(CI_RUN.read_text()) if line.startswith("python3 ")]


def base_interpreter() -> Path:
    """This Python's base installation (not a virtualenv's), which the guard must refuse."""
    path = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert path.is_file(), path
    return path


def test_ci_run_exits_at_a_failing_step_and_runs_no_later_one(tmp_path):
    """Under CI=true the guard passes and the install fails: two calls, exit 1, no test or report run."""
    result, calls = run_copy(tmp_path, base_interpreter(), status=1, ci="true")
    assert result.returncode == 1
    assert calls == python3_calls()[:2] and calls[1].startswith("-m pip install")


def test_ci_run_refuses_outside_a_virtualenv_unless_ci_is_true(tmp_path):
    """Outside a virtualenv, without CI=true: one line on stderr, non-zero, and pip never runs."""
    result, calls = run_copy(tmp_path, base_interpreter(), status=0, ci=None)
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(".ci/run: error: ")
    assert f"it would install into {base_interpreter()}, outside any virtualenv" in result.stderr
    assert "CI=true" in result.stderr and calls == python3_calls()[:1]


@pytest.mark.parametrize("ci", ["true", None])
def test_ci_run_runs_every_step_under_ci_or_in_a_virtualenv(tmp_path, ci):
    """CI=true with the base interpreter, or no CI with a virtualenv's python3: every command runs, exit 0."""
    interpreter = base_interpreter()
    if ci is None:
        subprocess.run([str(interpreter), "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True,
                       timeout=120)
        interpreter = tmp_path / "venv" / "bin" / "python3"
    result, calls = run_copy(tmp_path, interpreter, status=0, ci=ci)
    assert result.returncode == 0, result.stderr
    assert calls == python3_calls() and len(calls) == 4

def test_ci_run_runs_the_readme_commands_in_order():
    """The README says `.ci/run` runs exactly its install, test and report commands, in this order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Install and test", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    readme_commands = [line for block in blocks for line in commands(block)]
    ci_commands = [line for line in commands(CI_RUN.read_text()) if not line.startswith(("set ", "cd ", GUARD))]
    assert ci_commands == readme_commands
