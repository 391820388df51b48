"""`python -m adaln_lab.lab` (adaln_lab/lab/__main__.py): the quick CPU run writes the files it is asked for and
says on stdout what it wrote, with their key figures; `table DIR` prints those again; --help names the
variable that points the notebooks at DIR."""

import json

import pytest

from adaln_lab.lab import summary, tables
from adaln_lab.lab.__main__ import main

from ..paths import EVIDENCE, needs_evidence

pytestmark = pytest.mark.integration  # the lab CLI end to end


def test_cli_quick_writes_the_asked_files_and_says_so_on_stdout(tmp_path, capsys):
    out = tmp_path / "new" / "dir"  # created
    assert main(["--out", str(out), "--quick", "--device", "cpu", "--only", "errors"]) == 0
    path = out / "lab_errors.json"
    data = json.loads(path.read_text())
    assert data["kind"] == "adaln_lab_lab_errors" and data["meta"]["quick"] is True
    assert set(data["candidates"]) == {"diffusers", "adaln_lab"}
    assert "torch_compile" in data["meta"]["skipped_candidates"]
    assert not (out / "lab_latency.json").exists()
    captured = capsys.readouterr()
    assert "adaln_lab.lab" in captured.err  # progress and candidates stay on stderr
    assert f"wrote {path} (errors," in captured.out
    assert summary.render([path]) in captured.out  # the key figures, as `table` prints them
    largest = data["errors"][str(data["table_sizes"][-1])]["adaln_lab"]
    assert f"| adaln_lab | {data['table_sizes'][-1]} | {tables.fmt(largest['fwd_rel_err'])} |" in captured.out
    assert f"python -m adaln_lab.lab table {out}" in captured.out
    assert f"ADALN_LAB_EVIDENCE_DIR={out}" in captured.out
    assert main(["table", str(out)]) == 0
    assert capsys.readouterr().out.strip() == summary.render([out])


def test_help_documents_table_and_the_notebooks_variable(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "ADALN_LAB_EVIDENCE_DIR=DIR" in text and "table DIR" in text and "not measured in this run" in text


@pytest.mark.parametrize("args, message", [
    (["--out", "/proc/no/such"], "--out /proc/no/such: cannot write there"),
    (["--only", "errors,speed"], "--only takes"),
])
def test_bad_arguments_fail_before_measuring_in_one_line(tmp_path, capsys, args, message):
    args = args if args[0] == "--out" else ["--out", str(tmp_path), *args]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--quick", "--device", "cpu"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err and not captured.out
    assert not list(tmp_path.iterdir())


def test_table_refuses_what_is_not_a_lab_file_in_one_line(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"kind": "adaln_lab_report"}))
    for path, message in [(tmp_path / "none.json", "no such file"), (report, "python -m adaln_lab table renders it"),
                          (tmp_path, "holds no lab_*.json")]:
        assert main(["table", str(path)]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and len(captured.err.strip().splitlines()) == 1 and not captured.out


@needs_evidence("lab_errors.json", "lab_latency.json", "lab_invariance.json")
def test_table_renders_the_committed_gpu_files(capsys):
    assert main(["table", str(EVIDENCE)]) == 0
    text = capsys.readouterr().out
    gpu = json.loads((EVIDENCE / "lab_errors.json").read_text())["meta"]["environment"]["gpu"]
    assert text.count(f": {gpu}, commit") == 3
    assert "| torch_compile |" in text and "NOT batch invariant" in text
