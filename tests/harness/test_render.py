"""`adaln_lab.harness.render` (`python -m adaln_lab table`): a committed GPU report without the newer keys renders
with n/a, a failed CUDA-graph capture is named, a missing or broken file is a one-line error. (A new report's
table: tests/harness/test_report.py.)"""

import json

import pytest

from adaln_lab.harness.render import markdown

from ..paths import EVIDENCE, needs_evidence
from .test_report import NEW_FIGURES, table

OLD_REPORT = EVIDENCE / "report.json"  # skipped while the evidence folder waits for its GPU run


@pytest.mark.integration  # a process of its own
@needs_evidence("report.json")
def test_table_renders_an_old_report_with_na():
    report = json.loads(OLD_REPORT.read_text())
    run = table(OLD_REPORT)
    assert run.returncode == 0, run.stderr
    for entry in report["results"]["plain"].values():  # the same report without any of the new keys
        for figures in entry["accuracy_latency"].values():
            for key in NEW_FIGURES:
                figures.pop(key, None)
    for key in ("autograd_floor_us", "autograd_floor_host_us", "schema_notes"):
        report.pop(key, None)
    text = markdown(report)
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.split(" | ")[1].isdigit()]
    assert len(rows) == len(report["memory_floor"]) * len(report["results"]["plain"])
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert cells[4] == cells[5] == cells[8] == cells[9] == "n/a"  # graph, inference, host
        assert "x)" in cells[6] and "x)" in cells[7]  # eager figures and their floor multiples remain
    assert "autograd floor" in text and "n/a (not in this report)" in text


@needs_evidence("report.json")
def test_table_names_a_failed_capture():
    report = json.loads(OLD_REPORT.read_text())
    figures = next(iter(report["results"]["plain"]["adaln_lab"]["accuracy_latency"].values()))
    figures.update(fwd_us_graph=None, fwd_us_graph_error="RuntimeError: operation not permitted when stream is "
                   "capturing", fwd_bwd_us_graph=123.0, fwd_bwd_us_graph_error=None)
    text = markdown(report)
    assert "graph fwd of adaln_lab @" in text and "failed to capture: RuntimeError" in text
    assert "| 123 (" in text or "| 123 ±" in text  # the figure, with or without its spread


@pytest.mark.integration  # a process of its own
def test_table_of_a_missing_or_broken_file_is_a_one_line_error(tmp_path, capsys):
    from adaln_lab.__main__ import main

    broken = tmp_path / "broken.json"
    broken.write_text("{")
    run = table(tmp_path / "missing.json")  # the command itself, in a process of its own (import included)
    assert run.returncode == 2 and "no such report file" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    for path, message in ((broken, "is not JSON"), (tmp_path, "cannot read")):  # its main() (what `python -m
        # adaln_lab` exits with) on the other unreadable files, in this process: each a process's import less
        assert main(["table", str(path)]) == 2  # an exception other than the one-line error would raise here
        err = capsys.readouterr().err
        assert message in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
