"""The evidence runner, `python -m adaln_lab.bench STEP ... --out DIR [--base REV|DIR]`: its arguments (a mistake
exits 2 naming the argument, before anything runs or is written), --base (a directory or a commit exported with
git archive), the MANIFEST.csv rows it writes itself, per-step limits, and a failing, cut or skipped step not
stopping the next. The steps that run here run on a CPU: `upstream` over a stand-in of diffusers' H3 test file in a
stand-in checkout (the runner's mechanics, not diffusers' tests), `compare` on the CPU cut by its limit."""

from __future__ import annotations

import csv
import os
import subprocess
import tarfile
from datetime import datetime
from pathlib import Path

import pytest
import torch

from adaln_lab.bench import manifest, runner
from adaln_lab.bench.compare_trees import child_path, import_dir
from adaln_lab.bench.steps import STEPS, UPSTREAM_TEST, sanitizer_verdict

from ..paths import ROOT

pytestmark = pytest.mark.integration  # the evidence runner's processes

NO_GPU = {"torch": torch.__version__, "gpus": 0, "gpu": "none", "driver": "none"}


def checkout(tmp_path: Path) -> Path:
    """A stand-in checkout: pyproject.toml, a COMMIT file, and .dtests/ with a one-test stand-in of diffusers' H3
    model tests (its own COMMIT file)."""
    root = tmp_path / "checkout"
    (root / ".dtests" / UPSTREAM_TEST).parent.mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    (root / "COMMIT").write_text("abc1234\n")
    (root / ".dtests" / "COMMIT").write_text("d1ff5e5\n")
    (root / ".dtests" / UPSTREAM_TEST).write_text("def test_stands_in():\n    assert True\n")
    return root


def rows(out: Path) -> dict:
    with (out / "MANIFEST.csv").open(newline="") as f:
        found = list(csv.reader(f))
    assert tuple(found[0]) == manifest.FIELDS == ("file", "commit", "command", "torch", "gpu", "driver", "date")
    return {row[0]: dict(zip(found[0], row)) for row in found[1:]}


def run(capsys, *argv, root=ROOT) -> tuple[int, str, str]:
    try:
        code = runner.main(list(argv), root=root)
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv, says", [
    (["memory", "nosuch"], "unknown step: 'nosuch'"),
    (["memory"], "the following arguments are required: --out"),
    (["report+memory"], "report times the GPU: run it alone, not in report+memory"),
    (["memory", "--limit", "memory"], "--limit 'memory': STEP=SECONDS"),
    (["memory", "--limit", "nosuch=5"], "--limit 'nosuch=5': STEP=SECONDS"),
    (["sanitize", "--sanitize-tools", "memcheck,leakcheck"], "--sanitize-tools 'memcheck,leakcheck'"),
    (["upstream", "--upstream-runs", "patched,other"], "--upstream-runs 'patched,other'"),
    (["compare", "--base", "no/such/dir-or-rev"], "--base no/such/dir-or-rev: neither a directory nor a commit"),
])
def test_a_mistake_in_the_arguments_exits_2_in_one_line_naming_it_before_anything_is_written(capsys, tmp_path,
                                                                                            argv, says):
    out = tmp_path / "out"
    code, stdout, stderr = run(capsys, *argv, *([] if argv == ["memory"] else ["--out", str(out)]))
    assert code == 2 and says in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert stdout == "" and not out.exists()


def test_base_must_hold_a_tree_of_this_project(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, stderr = run(capsys, "compare", "--base", str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert code == 2 and f"--base {tmp_path / 'empty'}: the directory" in stderr
    assert "holds no src/adaln_lab/ or adaln_lab/" in stderr


def test_base_as_a_commit_is_exported_with_git_archive(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("no .git in this checkout: --base can only name a directory here")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    tree, rev = runner.resolve_base("HEAD", ROOT, tmp_path)
    assert rev == head and (tree / "COMMIT").read_text().strip() == head
    assert (tree / "src" / "adaln_lab" / "__init__.py").read_bytes() == subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{head}:src/adaln_lab/__init__.py"], capture_output=True, check=True).stdout
    assert tree.parent == tmp_path and not (tree / ".git").exists()
    with pytest.raises(ValueError, match="--base HEAD: no such directory, and no .git"):
        runner.resolve_base("HEAD", tmp_path / "nowhere", tmp_path)


def test_a_base_of_either_layout_is_a_tree_and_its_processes_get_the_folder_holding_its_package(tmp_path):
    """src/adaln_lab/ (this layout) or adaln_lab/ (the flat layout of the commits before the move to src/)."""
    flat, src = tmp_path / "flat", tmp_path / "src_layout"
    for package in (flat / "adaln_lab", src / "src" / "adaln_lab"):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
    assert import_dir(flat) == flat and import_dir(src) == src / "src" and import_dir(ROOT) == ROOT / "src"
    for tree in (flat, src):
        assert runner.resolve_base(str(tree), ROOT, tmp_path) == (tree.resolve(), None)
        assert child_path(tree).split(os.pathsep)[0] == str(import_dir(tree))


def test_a_commit_of_the_flat_layout_is_a_base_too(tmp_path):
    """8c7a04a (the base of the committed compare evidence) holds adaln_lab/ at its root."""
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", "8c7a04a^{commit}"], capture_output=True)
    if known.returncode != 0:
        pytest.skip("git knows no commit 8c7a04a here (no .git, or a shallow clone)")
    tree, rev = runner.resolve_base("8c7a04a", ROOT, tmp_path)
    assert rev == "8c7a04a" and not (tree / "src").exists() and import_dir(tree) == tree
    assert (tree / "adaln_lab" / "__init__.py").is_file()

def test_a_dry_run_prints_each_steps_commands_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "machine", lambda env=None: NO_GPU)
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, "tests+compare", "host-ab", "sanitize", "--base", str(ROOT), "--out", str(out),
                          "--dry-run", "--sanitize-tools", "racecheck")
    assert code == 0 and not out.exists()
    lines = stdout.splitlines()
    assert "compare (limit 300 s): needs a CUDA GPU, none here:" in lines
    assert any(line.startswith("  python3 -m adaln_lab.bench.compare_trees --old . --old-commit ") for line in lines)
    assert any("--tool racecheck" in line and "python3 -m adaln_lab.bench.sanitize_calls" in line for line in lines)
    assert not any("--tool memcheck" in line for line in lines)
    assert any(line.startswith("  script=$PWD/src/adaln_lab/bench/host_breakdown.py; for round in $(seq 3)")
               and "(cd $tree && PYTHONPATH=$(test -d src/adaln_lab && echo $PWD/src || echo $PWD) python3" in line
               for line in lines)
    assert lines[-1].endswith("0 step(s) failed or skipped (dry run: nothing ran)")


def test_a_dry_run_says_which_step_lacks_its_tree(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "machine", lambda env=None: NO_GPU)
    code, stdout, _ = run(capsys, "host-ab", "upstream", "--out", str(tmp_path / "out"), "--dry-run",
                          root=checkout(tmp_path))
    assert code == 1 and "host-ab: no tree to compare with: give --base REV|DIR, or copy one along at .ab_tree/" in stdout
    assert "  cd .dtests && python3 -m pytest -q -rfEX -p no:cacheprovider" in stdout


def test_a_step_cut_at_its_limit_does_not_stop_the_next_which_writes_its_files_and_manifest_rows(capsys, tmp_path):
    root, out = checkout(tmp_path), tmp_path / "out"
    code, stdout, _ = run(capsys, "compare", "upstream", "--limit", "compare=3", "--compare-args", "--device cpu --quick",
                          "--base", str(ROOT), "--upstream-runs", "unpatched", "--out", str(out), root=root)
    assert code == 1  # the compare was cut
    lines = stdout.splitlines()
    assert lines[0].startswith("adaln_lab.bench: commit abc1234, torch ")
    assert any(line.startswith("compare: exit 124 after ") and line.endswith("(limit 3 s)") for line in lines), stdout
    assert any(line.startswith("upstream: exit 0 after ") for line in lines), stdout
    assert lines[-1].endswith("1 step(s) failed or skipped")
    result = (out / "diffusers_h3_tests_unpatched.txt").read_text().splitlines()
    assert result[0] == "diffusers tests/ of commit d1ff5e5" and "1 passed" in result[-1]
    found = rows(out)
    log = "bench_compare_upstream.log"
    assert set(found) == {"diffusers_h3_tests_unpatched.txt", log}  # the cut compare left no file to record
    row = found["diffusers_h3_tests_unpatched.txt"]
    assert row["commit"] == "abc1234" and row["torch"] == torch.__version__
    assert row["command"].startswith("cd .dtests && python3 -m pytest -q -rfEX -p no:cacheprovider ")
    assert row["command"].endswith(f" {UPSTREAM_TEST} > diffusers_h3_tests_unpatched.txt 2>&1")
    assert row["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
    assert row["driver"] != "" and (row["driver"] == "none") == (not torch.cuda.is_available())
    datetime.strptime(row["date"], "%Y-%m-%dT%H:%M:%SZ")
    assert found[log]["command"] == ("python3 -m adaln_lab.bench compare upstream --out . --base " + str(ROOT))
    assert (out / log).read_text().splitlines() == lines  # the console, kept
    with tarfile.open(out / "all.tgz") as tar:
        assert {"./MANIFEST.csv", "./diffusers_h3_tests_unpatched.txt", f"./{log}"} <= set(tar.getnames())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")
def test_a_step_that_needs_a_gpu_is_skipped_with_its_reason_and_the_log_records_it(capsys, tmp_path):
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, "memory", "--out", str(out))
    assert code == 1
    skip = f"memory: skipped: needs a CUDA GPU (torch {torch.__version__} sees none here)"
    assert skip in stdout.splitlines() and skip in (out / "bench_memory.log").read_text().splitlines()
    assert set(rows(out)) == {"bench_memory.log"} and not (out / "memory_figures.json").exists()


def test_no_step_starts_when_the_budget_is_spent(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "machine", lambda env=None: NO_GPU)
    code, stdout, _ = run(capsys, "upstream", "--budget", str(runner.MIN_START), "--out", str(tmp_path / "out"),
                          root=checkout(tmp_path))
    assert code == 1 and f"upstream: skipped (the budget of {runner.MIN_START} s is spent)" in stdout
    assert not (tmp_path / "out" / "diffusers_h3_tests_unpatched.txt").exists()


def test_the_manifest_keeps_one_row_per_file_and_reads_old_folders_gpu_and_driver_as_unknown(tmp_path):
    path = tmp_path / "MANIFEST.csv"
    path.write_text("file,commit,command,torch,date\na.txt,1111111,python3 a,2.11.0,2026-12-01T00:00:00Z\n"
                    "b.txt,1111111,\"x, \"\"quoted\"\"\",2.11.0,2026-12-01T00:00:00Z\n")
    new = {"file": "a.txt", "commit": "2222222", "command": "python3 a > a.txt", "torch": "2.13.0",
           "gpu": "NVIDIA H100 80GB HBM3", "driver": "580.65.06", "date": "2026-12-02T00:00:00Z"}
    manifest.record(path, [new])
    found = rows(tmp_path)
    assert list(found) == ["b.txt", "a.txt"] and found["a.txt"] == new
    assert found["b.txt"]["command"] == 'x, "quoted"' and found["b.txt"]["gpu"] == found["b.txt"]["driver"] == "unknown"


def test_every_step_device_sh_ran_is_a_step_of_the_runner():
    assert list(STEPS) == ["tests", "compare", "report", "block-report", "lab", "sanitize", "profile", "host",
                           "host-ab", "trace", "train", "multi", "upstream", "sweep", "memory", "exact"]
    assert {name for name, step in STEPS.items() if step.shares} == {"tests", "compare", "sanitize", "memory",
                                                                    "upstream"}


def test_the_sanitizer_verdict_reads_each_tools_summary():
    ok = ["small calls done", "========= ERROR SUMMARY: 0 errors"]
    assert sanitizer_verdict(ok) == {"errors": 0, "warnings": None, "note": ""}
    race = ["small calls done", "========= RACECHECK SUMMARY: 3 hazards displayed (0 errors, 3 warnings)"]
    assert sanitizer_verdict(race) == {"errors": 0, "warnings": 3, "note": ""}
    assert sanitizer_verdict(["========= ERROR SUMMARY: 1,024 errors"])["errors"] == 1024
    assert sanitizer_verdict(["small calls done"]) == {"errors": None, "warnings": None, "note": " NO SUMMARY"}
    assert sanitizer_verdict(ok[1:])["note"] == " WORKLOAD DID NOT FINISH"
    committed = ROOT / "bench" / "results" / "h100" / "sanitize"
    for log in sorted(committed.glob("sanitize_*check.txt")):  # the committed runs: what their summary says
        verdict = sanitizer_verdict(log.read_text(errors="replace").splitlines())
        assert verdict["errors"] == 0 and verdict["note"] == "", log.name
        assert f"{log.stem.split('_')[1]:<9} exit 0   errors 0" in (committed / "sanitize_summary.txt").read_text()
