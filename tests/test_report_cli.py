"""The report CLI's quick CPU run writes the seed report's schema (same keys, side by side)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SEED = Path(__file__).parent / "data" / "seed_prior_art_b200.json"
RENAMED = {"rl_kernel_commit": "adaln_lab_commit"}


def schema(value, path="$"):
    """Key paths of a JSON value; size keys ("4097") and candidate names are generalised."""
    if isinstance(value, dict):
        out = set()
        for key, item in value.items():
            if key.isdigit():
                key = "<size>"
            elif path == "$.results.plain":
                key = "<candidate>"
            out |= schema(item, f"{path}.{RENAMED.get(key, key)}")
        return out or {path}
    return {path}


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "quick.json"
    run = subprocess.run([sys.executable, "-m", "adaln_lab", "report", "--quick", "--device", "cpu", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_quick_report_has_every_key_of_the_seed_report(quick_report):
    seed = json.loads(SEED.read_text())
    missing = schema(seed) - schema(quick_report)
    assert not missing, sorted(missing)


def test_quick_report_measures_and_says_what_it_ran(quick_report):
    assert quick_report["quick"] is True
    assert quick_report["copy_TBps"] > 0
    plain = quick_report["results"]["plain"]
    assert set(plain) == {"diffusers", "adaln_lab"}
    assert "real module" in plain["diffusers"]["source"]
    for entry in plain.values():
        assert entry["batch_invariance"]["batch_invariant"] in (True, False)
        for size, figures in entry["accuracy_latency"].items():
            assert size in quick_report["memory_floor"]
            assert 0 < figures["fwd_rel_err"] < 0.02
            assert figures["fwd_us"] > 0 and figures["fwd_bwd_us_pure"] > 0


def test_cli_rejects_unknown_candidates_and_gpu_only_ones_on_cpu(tmp_path):
    for names, message in (("nope", "unknown candidate"), ("torch_compile", "runs on CUDA only")):
        run = subprocess.run([sys.executable, "-m", "adaln_lab", "report", "--quick", "--device", "cpu",
                              "--candidates", names, "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and message in run.stderr
        assert not (tmp_path / "x.json").exists()


def test_provenance_prefers_the_named_commit_over_a_stale_git(monkeypatch):
    """A copied tree may carry a stale .git: ADALN_LAB_COMMIT wins, and the dirty flag is only
    git's answer when git's HEAD is the named commit."""
    from adaln_lab.harness import report

    answers = {("rev-parse", "HEAD"): "41b0f5953857cf4f6ec4aeac11da6b85a94ae448",
               ("status", "--porcelain", "--untracked-files=no"): " M adaln_lab/op.py"}
    monkeypatch.setattr(report, "_git", lambda *args: answers[args])
    monkeypatch.setenv("ADALN_LAB_COMMIT", "574ba6f")
    assert report._provenance() == {"adaln_lab_commit": "574ba6f", "tracked_tree_dirty": None}
    monkeypatch.setenv("ADALN_LAB_COMMIT", "41b0f59")
    assert report._provenance() == {"adaln_lab_commit": answers[("rev-parse", "HEAD")], "tracked_tree_dirty": True}
    monkeypatch.delenv("ADALN_LAB_COMMIT")
    assert report._provenance()["adaln_lab_commit"] == answers[("rev-parse", "HEAD")]
