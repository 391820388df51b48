"""`python -m adaln_lab.lab` (adaln_lab/lab/__main__.py): the quick CPU run writes the files it is asked for."""

import json


def test_cli_quick_writes_the_asked_files(tmp_path, capsys):
    from adaln_lab.lab.__main__ import main

    assert main(["--out", str(tmp_path), "--quick", "--device", "cpu", "--only", "errors"]) == 0
    data = json.loads((tmp_path / "lab_errors.json").read_text())
    assert data["kind"] == "adaln_lab_lab_errors" and data["meta"]["quick"] is True
    assert set(data["candidates"]) == {"diffusers", "adaln_lab"}
    assert "torch_compile" in data["meta"]["skipped_candidates"]
    assert not (tmp_path / "lab_latency.json").exists()
    assert "adaln_lab.lab" in capsys.readouterr().err
