"""`adaln_lab.harness.candidates`: each candidate's source says what runs, on which device, and what it falls back
to."""

import sys


def test_candidate_sources_say_what_runs(monkeypatch):
    from adaln_lab.harness.candidates import adaln_lab_candidate, diffusers_candidate

    assert "table_backend=cuda" in adaln_lab_candidate(device="cuda").source
    cpu = adaln_lab_candidate(device="cpu")
    assert "torch replay" in cpu.source and "table_backend=cuda" not in cpu.source and cpu.warning
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers now raises ImportError
    missing = diffusers_candidate()
    assert missing.name == "diffusers_replay" and missing.replay_of == "diffusers"  # its row says what it is
    assert "REPLAYED by adaln_lab" in missing.source and "not importable" in missing.source
    assert "diffusers_replay" in missing.warning and "not diffusers" in missing.warning
