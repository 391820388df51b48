"""The command line (`python -m adaln_lab`, adaln_lab/__main__.py): help text, and where the report goes (checked
before anything is measured, kept when the final write fails). The measuring is replaced here by a canned report:
what is tested is the path handling around it."""

import argparse
import json
import subprocess
import sys
import tempfile

import pytest

from adaln_lab import __main__ as cli
from adaln_lab.harness import block_report, report

pytestmark = pytest.mark.integration  # the CLI end to end

CANNED = {"kind": "adaln_lab_report", "memory_floor": {}, "results": {"plain": {}}, "environment": {"device": "cpu"},
          "adaln_lab_commit": "abc1234", "copy_TBps": 0.01}


def measured_nothing(*args, **kwargs):
    raise AssertionError("measured although --out cannot be written")


@pytest.fixture
def no_measuring(monkeypatch):
    """The report and block report raise if they start measuring."""
    monkeypatch.setattr(report, "run_report", measured_nothing)
    monkeypatch.setattr(block_report, "run_block_report", measured_nothing)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("command", ["report", "block-report"])
def test_an_unwritable_out_fails_in_one_line_before_measuring(tmp_path, capsys, no_measuring, command):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for out, reason in (("/proc/x/r.json", "cannot create the directory /proc/x"),
                        (str(a_file / "r.json"), "is not a directory"),
                        (str(a_file / "sub" / "r.json"), "cannot create the directory"),
                        (str(tmp_path), "is a directory")):
        assert cli.main([command, "--quick", "--device", "cpu", "--out", out]) == 2
        captured = capsys.readouterr()
        line = one_error_line(captured.err)
        assert line.startswith(f"python -m adaln_lab {command}: error: --out {out}: ") and reason in line, line
        assert captured.out == ""


def test_the_command_itself_exits_2_on_an_unwritable_out():
    run = subprocess.run([sys.executable, "-m", "adaln_lab", "report", "--out", "/proc/x/r.json", "--quick"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    assert "--out /proc/x/r.json" in one_error_line(run.stderr)


def test_a_missing_directory_is_created_and_said(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report, "run_report", lambda *args, **kwargs: dict(CANNED))
    out = tmp_path / "new" / "deeper" / "r.json"
    assert cli.main(["report", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"created the directory {out.parent} for --out" in captured.err
    assert json.loads(out.read_text()) == CANNED
    assert "| candidate | rows |" in captured.out


def test_a_failed_final_write_prints_the_table_and_keeps_the_results(tmp_path, capsys, monkeypatch):
    """The directory, fine when checked, is gone when the report is written (a file in its place): the table
    is still printed, the JSON kept in a temporary file named on stderr, and the exit status is 1."""
    target = tmp_path / "results"
    spare = tmp_path / "tmp"
    spare.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare))

    def measure_then_lose_the_directory(*args, **kwargs):
        target.rmdir()
        target.write_text("not a directory any more")
        return dict(CANNED)

    monkeypatch.setattr(report, "run_report", measure_then_lose_the_directory)
    target.mkdir()
    assert cli.main(["report", "--quick", "--device", "cpu", "--out", str(target / "r.json")]) == 1
    captured = capsys.readouterr()
    assert "| candidate | rows |" in captured.out
    line = one_error_line(captured.err)
    assert line.startswith(f"python -m adaln_lab report: error: --out {target / 'r.json'}: could not write")
    kept = [path for path in spare.iterdir() if path.suffix == ".json"]
    assert len(kept) == 1 and str(kept[0]) in line
    assert json.loads(kept[0].read_text()) == CANNED


def help_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_keeps_each_usage_line_and_names_the_console_script(capsys):
    lines = [line.strip() for line in help_of([], capsys).splitlines()]
    for command in ("report --out FILE.json", "block-report --out FILE.json", "table FILE.json"):
        assert any(line.startswith(f"python -m adaln_lab {command}") for line in lines), command
    assert any(line.startswith("adaln-lab report --out") for line in lines)  # the console script, in the epilog
    assert "[project.scripts]" in " ".join(lines)


def test_every_option_of_every_command_has_help():
    top = cli.parser()
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) == {"report", "block-report", "table"}
    for name, sub in commands.choices.items():
        assert sub.description, name
        for action in sub._actions:
            assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest}"
    for action in commands._choices_actions:  # each command's line in the top-level help
        assert action.help and action.help.strip(), action.dest


def test_report_help_says_seconds_for_quick_on_a_cpu(capsys):
    text = " ".join(help_of(["report"], capsys).split())
    assert "a CPU finishes in minutes" not in text
    assert "--quick small sizes (H = 256): tens of seconds on a CPU" in text


def test_usage_errors_are_one_line_with_exit_2(capsys, no_measuring):
    with pytest.raises(SystemExit) as done:
        cli.main(["report", "--out", "x.json", "--no-such-option"])
    assert done.value.code == 2
    assert "unrecognized arguments: --no-such-option" in one_error_line(capsys.readouterr().err)
    assert cli.main(["block-report", "--out", "x.json", "--device", "cpu", "--candidates", "nope"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("python -m adaln_lab block-report: error: --candidates: unknown") and "nope" in line
