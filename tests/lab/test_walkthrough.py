"""`adaln_lab.lab.walkthrough`: each planted counter-example caught by its check, the rows that differ, the
candidates that run here (and why others do not), the user report in the harness table."""

import dataclasses

from adaln_lab.harness.candidates import Named
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.harness.protocol import QUICK
from adaln_lab.harness.render import markdown
from adaln_lab.lab import walkthrough
from adaln_lab.reference import replay

from .common import CPU, SHAPE


def test_each_planted_counter_example_is_caught_by_its_check():
    small = dataclasses.replace(QUICK, H=32, D=16, seeds=(3,), sub_batch_sizes=(7, 256), batch_sizes=(1, 2, 17, 64))
    table = walkthrough.planted_table(small)
    assert {c for c, n in table["non_repeatable"].items() if n} == {"params_repeatable"}
    assert {c for c, n in table["big_batch_path"].items() if n} == {"full_vs_sub_batches"}
    assert table["dx_batch_dependent"]["all_rows"] > 0 and table["dx_batch_dependent"]["params_repeatable"] == 0
    assert all(n > 0 for c, n in table["batch_size_dependent"].items() if c != "params_repeatable")
    assert walkthrough.failures("all_rows", walkthrough.run_check("all_rows", replay, small, CPU)) == 0


def test_rows_that_differ_shows_dx_only_differences():
    i = make(3, 9, **SHAPE)  # 9 rows: dx scaled by 1, a row alone by 1 + 2^-7
    dy = upstream(3, i.x)
    planted = walkthrough.rows_that_differ(walkthrough.dx_batch_dependent, i, dy, [0, 4])
    assert all(r["fwd_differ"] == 0 and r["dx_differ"] > 0 and r["dx_max_ulp"] >= 1 for r in planted)
    same = walkthrough.rows_that_differ(replay, i, dy, [0, 8])
    assert all(r["dx_differ"] == 0 and r["dx_max_rel"] == 0 for r in same)


def test_candidates_here_skips_what_cannot_run_with_the_reason():
    names, skipped = walkthrough.candidate_names(CPU)
    assert "diffusers" in names and "adaln_lab" in names
    assert "torch_compile" in skipped and "CUDA" in skipped["torch_compile"]
    built, _ = walkthrough.candidates_here(CPU, ("adaln_lab",))
    assert [c.name for c in built] == ["adaln_lab"]


def test_user_report_renders_with_the_harness_table():
    p = dataclasses.replace(QUICK, H=32, D=16, warmup=1, iters=2)
    rep = walkthrough.user_report([Named("mine", "the replay", replay)], CPU, protocol=p)
    assert rep["results"]["plain"]["mine"]["batch_invariance"]["batch_invariant"] is True
    assert "| mine | 65 | yes | yes |" in markdown(rep)


def test_checks_print_no_progress_when_tqdm_is_disabled(monkeypatch, capfd):
    """The notebooks set TQDM_DISABLE: the plain-line progress of a log (a kernel's stderr) stays off too."""
    small = dataclasses.replace(QUICK, H=32, D=16, seeds=(3,))
    monkeypatch.setenv("ADALN_LAB_PROGRESS", "lines")  # what a notebook kernel's stderr (no TTY) gets
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    walkthrough.run_check("all_rows", replay, small, CPU)
    assert "all_rows n=8:" in capfd.readouterr().err  # the line the notebooks showed 41 of
    monkeypatch.setenv("TQDM_DISABLE", "1")
    result = walkthrough.run_check("all_rows", replay, small, CPU)
    assert walkthrough.failures("all_rows", result) == 0
    assert capfd.readouterr().err == ""
