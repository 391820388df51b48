"""`adaln_lab.lab.evidence`: the notebooks' MODE and the fallback between committed evidence and measuring now."""

import json

import pytest
import torch

from adaln_lab.lab import evidence


def test_modes_and_the_evidence_fallback(tmp_path, monkeypatch):
    assert evidence.resolve_mode("evidence") == "evidence"
    assert evidence.resolve_mode("auto") == ("measure" if torch.cuda.is_available() else "evidence")
    with pytest.raises(ValueError, match="MODE must be"):
        evidence.resolve_mode("gpu")
    calls = []

    def measure(device, quick):
        calls.append((device.type, quick))
        return {"x": 1}

    data, banner = evidence.obtain("errors", "evidence", measure, directory=tmp_path)
    assert calls == [("cpu", True)] and "NOT GPU" in banner and data["meta"]["quick"] is True
    evidence.save({"x": 2, "meta": {"environment": {"gpu": "NVIDIA H200"}, "adaln_lab_commit": "abcdef0123",
                                    "quick": False}}, evidence.lab_path("errors", tmp_path))
    data, banner = evidence.obtain("errors", "evidence", measure, directory=tmp_path)
    assert data["x"] == 2 and "NVIDIA H200, commit abcdef0, full sizes" in banner and len(calls) == 1
    monkeypatch.setenv("ADALN_LAB_EVIDENCE_DIR", str(tmp_path))
    assert evidence.lab_path("latency") == tmp_path / "lab_latency.json"
    saved = tmp_path / "saved"
    monkeypatch.delenv("ADALN_LAB_SAVE_DIR", raising=False)
    monkeypatch.setattr(evidence, "device_for", lambda mode: torch.device("cuda"))  # as on a GPU
    monkeypatch.setattr(evidence, "meta", lambda device, quick: {"device": device.type, "quick": quick})
    assert evidence.obtain("latency", "measure", measure)[0]["x"] == 1
    assert not (tmp_path / "lab_latency.json").exists() and not saved.exists()  # no save dir, no file
    monkeypatch.setenv("ADALN_LAB_SAVE_DIR", str(saved))
    data, banner = evidence.obtain("latency", "measure", measure)
    assert "measured now" in banner and json.loads((saved / "lab_latency.json").read_text()) == data
    monkeypatch.setattr(evidence, "device_for", lambda mode: torch.device("cpu"))  # quick CPU figures
    (saved / "lab_latency.json").unlink()
    evidence.obtain("latency", "measure", measure)
    assert not (saved / "lab_latency.json").exists()  # are never saved as evidence


def test_a_lab_folder_without_report_or_parity_says_not_measured(tmp_path, monkeypatch):
    """A folder of `python -m adaln_lab.lab --out DIR --quick` has no report.json, and a CPU report has no
    forward_parity_vs_diffusers: the readers say so in one line instead of raising (KeyError before)."""
    from adaln_lab.lab import tables

    monkeypatch.setenv("ADALN_LAB_EVIDENCE_DIR", str(tmp_path))
    assert evidence.load_report(required=False) is None
    with pytest.raises(FileNotFoundError):
        evidence.load_report()
    for text in (tables.report_errors(None), tables.report_latency(None), tables.invariance(None),
                 tables.report_parity(None)):
        assert evidence.NOT_MEASURED in text and "report.json" in text and "\n" not in text
    cpu_report = {"environment": {"gpu": None, "cpu": "x86_64"}, "adaln_lab_commit": "8c7a04a0", "quick": True,
                  "results": {"plain": {"adaln_lab": {"source": "the replay"}}}}
    assert evidence.machine(cpu_report) == "CPU (x86_64)"
    assert evidence.describe(cpu_report) == "CPU (x86_64), commit 8c7a04a, quick (small) sizes"
    line = tables.report_parity(cpu_report)
    assert evidence.NOT_MEASURED in line and "CPU (x86_64)" in line and "\n" not in line
    assert tables.parity_largest(cpu_report) is None
    parity = {"4097": {"bitwise_equal_fraction": 0.999, "within_1_ulp_fraction": 1.0, "max_ulp": 7,
                       "max_operand_ulp": 1}}
    cpu_report["results"]["plain"]["adaln_lab"]["forward_parity_vs_diffusers"] = {"table_backend=cuda": parity}
    assert "7 ulps of the output, but 1 ulps" in tables.parity_largest(cpu_report)
    assert "| table_backend=cuda | 4097 |" in tables.report_parity(cpu_report)
