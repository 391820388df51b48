"""`adaln_lab.harness.report` and its CLI (`python -m adaln_lab report`): the quick CPU run writes the seed report's
schema (same keys, side by side), says what each row ran, and `python -m adaln_lab table` renders it."""

import json
import re
import subprocess
import sys

import pytest

from ..paths import DATA

pytestmark = pytest.mark.integration  # the report CLI end to end

one_worker = pytest.mark.xdist_group("harness_report")  # the tests of the module fixture `quick_run`: built once
SEED = DATA / "seed_prior_art_b200.json"
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


NEW_FIGURES = ("fwd_us_inference", "host_fwd_us", "host_fwd_bwd_us", "fwd_us_graph", "fwd_bwd_us_graph",
               "fwd_us_graph_error", "fwd_bwd_us_graph_error")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "quick.json"
    run = subprocess.run([sys.executable, "-m", "adaln_lab", "report", "--quick", "--device", "cpu", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run


@pytest.fixture(scope="module")
def quick_report(quick_run):
    return json.loads(quick_run[0].read_text())


def table(path):
    return subprocess.run([sys.executable, "-m", "adaln_lab", "table", str(path)], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def quick_table(quick_run):
    """`python -m adaln_lab table` of the quick report, run once for the tests that read its output."""
    return table(quick_run[0])


@one_worker
def test_quick_report_has_every_key_of_the_seed_report(quick_report):
    seed = json.loads(SEED.read_text())
    missing = schema(seed) - schema(quick_report)
    assert not missing, sorted(missing)


@one_worker
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


def test_cli_rejects_unknown_candidates_and_gpu_only_ones_on_cpu(tmp_path, capsys):
    from adaln_lab.__main__ import main

    args = ["report", "--quick", "--device", "cpu", "--out", str(tmp_path / "x.json"), "--candidates"]
    run = subprocess.run([sys.executable, "-m", "adaln_lab", *args, "nope"], capture_output=True, text=True,
                         timeout=120)  # the command itself, in a process of its own
    assert run.returncode == 2 and "unknown candidate" in run.stderr
    assert not (tmp_path / "x.json").exists()
    assert main([*args, "torch_compile"]) == 2  # its main() (what `python -m adaln_lab` runs), in this process
    assert "runs on CUDA only" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_provenance_prefers_the_named_commit_over_a_stale_git(monkeypatch):
    """A copied tree may carry a stale .git: ADALN_LAB_COMMIT wins, and the dirty flag is only
    git's answer when git's HEAD is the named commit."""
    from adaln_lab.harness import report

    answers = {("rev-parse", "HEAD"): "41b0f5953857cf4f6ec4aeac11da6b85a94ae448",
               ("status", "--porcelain", "--untracked-files=no"): " M src/adaln_lab/ops/final_adaln_out/op.py"}
    monkeypatch.setattr(report, "_git", lambda *args: answers[args])
    monkeypatch.setenv("ADALN_LAB_COMMIT", "574ba6f")
    assert report.provenance() == {"adaln_lab_commit": "574ba6f", "tracked_tree_dirty": None}
    monkeypatch.setenv("ADALN_LAB_COMMIT", "41b0f59")
    assert report.provenance() == {"adaln_lab_commit": answers[("rev-parse", "HEAD")], "tracked_tree_dirty": True}
    monkeypatch.delenv("ADALN_LAB_COMMIT")
    assert report.provenance()["adaln_lab_commit"] == answers[("rev-parse", "HEAD")]


@one_worker
def test_quick_report_has_every_new_timing_key(quick_report):
    assert quick_report["autograd_floor_us"] > 0 and quick_report["autograd_floor_host_us"] > 0
    for entry in quick_report["results"]["plain"].values():
        for figures in entry["accuracy_latency"].values():
            assert set(NEW_FIGURES) <= set(figures)
            assert figures["fwd_us_inference"] > 0
            assert figures["host_fwd_us"] > 0 and figures["host_fwd_bwd_us"] > 0
            assert figures["fwd_us_graph"] is None and figures["fwd_bwd_us_graph"] is None
            assert figures["fwd_us_graph_error"] == figures["fwd_bwd_us_graph_error"] == "no CUDA"


@one_worker
def test_quick_report_explains_the_seed_schema_keys(quick_report):
    notes = quick_report["schema_notes"]
    assert quick_report["rfc"] is None and "unused" in notes["rfc"]
    assert "seed_prior_art_b200.json" in notes["seed"] and "RL-Kernel" in notes["seed"]
    for key in ("fwd_us_graph", "fwd_us_inference", "host_fwd_bwd_us", "autograd_floor_us", "autograd_floor_host_us"):
        assert key in notes


@one_worker
def test_report_says_on_screen_what_each_row_ran(quick_run, quick_report):
    lines = [line for line in quick_run[1].stderr.splitlines() if "[adaln_lab report] candidate" in line]
    assert len(lines) == 2
    lab = quick_report["results"]["plain"]["adaln_lab"]["source"]
    assert "torch replay" in lab and "table_backend=cuda" not in lab
    assert any("adaln_lab" in line and "WARNING" in line and "torch replay" in line for line in lines)


@one_worker
def test_table_renders_a_new_report(quick_table):
    run = quick_table
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "| graph fwd us (x floor) |" in text and "| inference fwd us |" in text
    assert text.count("| adaln_lab |") == text.count("| diffusers |") == 2
    assert "(floor " in text and "us host." in text
    assert "| rows | memory floor fwd us | memory floor fwd+bwd us |" in text
    assert "- adaln_lab ran: " in text


@one_worker
def test_report_prints_its_table_on_screen(quick_run, quick_table):
    assert quick_table.stdout.strip() in quick_run[1].stdout  # the very table `table` prints
    assert "| candidate | rows | batch invariant |" in quick_run[1].stdout


@one_worker
def test_cpu_table_says_na_on_cpu_for_gpu_figures_and_what_the_rows_measure(quick_table):
    text = quick_table.stdout
    rows = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith(("| diffusers |",
                                                                                           "| adaln_lab |"))]
    assert len(rows) == 4
    for cells in rows:
        assert cells[4] == cells[5] == "n/a on CPU"  # CUDA-graph times
        assert cells[6].endswith(" (n/a on CPU)") and cells[7].endswith(" (n/a on CPU)")  # no x-floor ratio
        assert "x)" not in " ".join(cells)
    assert "| 65 | n/a on CPU | n/a on CPU |" in text  # the memory floor
    assert "CUDA events n/a on CPU" in text and "us CUDA events" not in text
    assert re.search(r"host memory copy [0-9.e-]+ TB/s \(no floor on CPU\)", text)  # measured, in the JSON too
    cpu = [line for line in text.splitlines() if line.startswith("- CPU run:")]
    assert len(cpu) == 1 and "wall clock" in cpu[0]
    assert "- diffusers and adaln_lab give the same errors: on a CPU they run the same torch ops" in text


@one_worker
def test_batch_invariant_column_counts_the_row_checks_only(quick_report):
    from adaln_lab.harness.render import markdown

    report = json.loads(json.dumps(quick_report))
    inv = report["results"]["plain"]["diffusers"]["batch_invariance"]
    inv.update(params_repeatable=False, batch_invariant=False)
    assert "| diffusers | 65 | yes | no |" in markdown(report)  # the "no" is the params repeat column's alone
    del inv["rows_invariant"]  # an older report: the column is computed from the row counts
    assert "| diffusers | 65 | yes | no |" in markdown(report)
    inv["full_vs_sub_batches"]["rowgrad_differ"] = 1
    assert "| diffusers | 65 | no | no |" in markdown(report)


@one_worker
def test_progress_in_a_log_is_plain_lines_without_escape_codes(quick_run):
    err = quick_run[1].stderr
    assert "\x1b[" not in err and "\r" not in err  # no tqdm redraws, no cursor-up of nested bars
    assert "batch invariance: 4/4 checks in " in err and "all_rows n=8: 16/16 calls in " in err


TIMINGS = ("fwd_us", "fwd_bwd_us", "fwd_bwd_us_pure", "fwd_us_inference", "host_fwd_us", "host_fwd_bwd_us")


@one_worker
def test_quick_report_has_the_spread_of_each_timing_and_no_cpu_floor_figures(quick_report, quick_run):
    for floor in quick_report["memory_floor"].values():  # printed as "n/a on CPU": null here, with the reason
        assert floor["fwd_us"] is None and floor["fwd_bwd_us"] is None and "CPU" in floor["floor_null_reason"]
        assert floor["fwd_bytes"] > 0 and floor["fwd_bwd_bytes"] > floor["fwd_bytes"]
    for entry in quick_report["results"]["plain"].values():
        for figures in entry["accuracy_latency"].values():
            assert figures["fwd_floor_fraction"] is None and figures["fwd_bwd_floor_fraction"] is None
            assert set(figures["spread_us"]) == set(TIMINGS)  # no CUDA graphs on a CPU: no samples of theirs
            for key in TIMINGS:
                s = figures["spread_us"][key]
                assert s["median"] == figures[key] and s["n"] == quick_report["protocol"]["iters"]
                assert 0 < s["min"] <= s["p25"] <= s["median"] <= s["p75"] <= s["max"]
    rows = [line for line in quick_run[1].stdout.splitlines() if line.startswith("| adaln_lab |")]
    assert rows and all(len(re.findall(r"\d ±\d+%", row)) == 4 for row in rows)  # eager x2, inference, host


def spread_report():
    """A one-row report whose fwd_us samples have p25 100, median 200, p75 300 (a half-IQR of 50 %)."""
    figures = {"fwd_us": 200.0, "spread_us": {"fwd_us": {"min": 90.0, "p25": 100.0, "median": 200.0, "p75": 300.0,
                                                         "max": 9000.0, "n": 5}}}
    return {"kind": "adaln_lab_report", "memory_floor": {"9": {"fwd_us": None, "fwd_bwd_us": None}},
            "environment": {"device": "cpu"}, "results": {"plain": {"mine": {"accuracy_latency": {"9": figures}}}}}


def test_table_prints_the_spread_beside_the_median():
    from adaln_lab.harness.render import markdown

    text = markdown(spread_report())
    assert "| mine | 9 | n/a | n/a | n/a on CPU | n/a on CPU | 200 ±50% (n/a on CPU) | n/a |" in text
    assert "- ±N%: half the interquartile range" in text


def test_report_without_diffusers_names_its_row_diffusers_replay(tmp_path, monkeypatch, capsys):
    """Without diffusers the 'diffusers' row is adaln_lab's replay: named so on screen, in the table and the JSON."""
    from adaln_lab.__main__ import main
    from adaln_lab.harness import report as report_module

    from .test_user_candidates import TINY

    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers now raises ImportError
    monkeypatch.setattr(report_module, "QUICK", TINY)
    out = tmp_path / "r.json"
    assert main(["report", "--quick", "--device", "cpu", "--candidates", "diffusers,adaln_lab", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "[adaln_lab report] candidate diffusers_replay on cpu: diffusers REPLAYED by adaln_lab" in captured.err
    assert "| diffusers_replay | 9 |" in captured.out and "| diffusers |" not in captured.out
    assert "- diffusers_replay: NOT diffusers (diffusers is not installed here)" in captured.out
    plain = json.loads(out.read_text())["results"]["plain"]
    assert set(plain) == {"diffusers_replay", "adaln_lab"}
    assert plain["diffusers_replay"]["replay_of"] == "diffusers" and "replay_of" not in plain["adaln_lab"]
