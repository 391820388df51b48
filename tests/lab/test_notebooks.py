"""Every notebook runs top to bottom on the CPU without an error (MODE "auto" -> evidence: the kernel
is shown no GPU, also on a GPU machine), says where its figures come from, shows no progress bars,
and prints the H200 report's own numbers.

Three runs, each notebook executed once in each: against the committed evidence (bench/results/<machine>:
report.json, and lab_*.json once the GPU run of `python -m adaln_lab.lab` is committed; until then the notebooks
compute a small CPU version live and say so); against a synthetic evidence directory holding complete lab_*.json
files (torch.compile, adaln_lab_numba, CUDA-graph times and a kernel profile included) beside a CPU run's
report.json (no forward_parity_vs_diffusers, no CUDA-graph times, no torch_compile), so the reading paths of GPU
lab data and of a CPU report run here too; and on a folder of `python -m adaln_lab.lab --out DIR --quick`
(ADALN_LAB_EVIDENCE_DIR=DIR), which holds no report.json: the report's parts say "not measured in this run".
Every notebook reads report.json: while the evidence folder waits for its GPU run, the tests that execute them
skip, naming the missing file. Each run's kernel also renders its figures as SVG with their text, so the tests
read that every figure names the machine of its data.

One pytest-xdist worker runs the tests of the committed evidence (`xdist_group`): those notebooks execute once.
"""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from ..paths import EVIDENCE, NOTEBOOKS as NOTEBOOK_DIR, needs_evidence

nbformat = pytest.importorskip("nbformat", reason="the test extra brings nbformat and nbclient")
nbclient = pytest.importorskip("nbclient")

from adaln_lab.harness.candidates import Named  # noqa: E402
from adaln_lab.harness.inputs import make, upstream  # noqa: E402
from adaln_lab.harness.protocol import QUICK  # noqa: E402
from adaln_lab.lab import errors, evidence, latency_sweep as latency, tables, walkthrough  # noqa: E402
from adaln_lab.lab import notebooks as run_notebooks  # noqa: E402
from adaln_lab.reference import replay  # noqa: E402

pytestmark = pytest.mark.integration  # the notebooks executed in a kernel of their own

one_worker = pytest.mark.xdist_group("notebooks")  # the tests of the module fixture `executed`: notebooks run once
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
PROGRESS = re.compile(r"\d+%\||\d+/\d+ \[|it/s|call/s|step/s|\d+/\d+ \w+ in [\d.]+ s")  # bars, and lines of a log
CPU = "computed now on this CPU"  # the caption of a figure a notebook computes itself on the CPU


def _svg_figures(env, directory: Path) -> None:
    """Make the kernels started under `env` render each figure as SVG too, its text kept as text."""
    profile = directory / "profile_default"
    profile.mkdir(parents=True, exist_ok=True)
    (profile / "ipython_kernel_config.py").write_text(
        'c.InlineBackend.figure_formats = {"png", "svg"}\nc.InlineBackend.rc = {"svg.fonttype": "none"}\n')
    env.setenv("IPYTHONDIR", str(directory))


def _execute(path: Path) -> tuple:
    """(executed notebook, seconds): `python -m adaln_lab.lab.notebooks`'s own runner, nothing written."""
    notebook, seconds, _ = run_notebooks.execute(path, timeout=600)
    return notebook, seconds


def _outputs(notebook) -> list:
    return [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]


def _text(notebook) -> str:
    parts = []
    for o in _outputs(notebook):
        if o.get("output_type") == "stream":
            parts.append(o["text"])
        for kind in ("text/plain", "text/markdown"):
            if kind in o.get("data", {}):
                parts.append(o["data"][kind])
    return "\n".join(parts)


@pytest.fixture(scope="module")
def executed(tmp_path_factory, worker_id):
    """{stem: (executed notebook, seconds)} against the committed evidence, each notebook run once per test session
    (the first pytest-xdist worker to get here runs them under a file lock and leaves them in the session's temporary
    folder; the others read them), in a kernel that sees no GPU (MODE "auto" -> evidence, as in CI, also on a GPU
    machine)."""
    import nbformat
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = (base if worker_id == "master" else base.parent) / "executed_notebooks"
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared / "lock")):
        if not (shared / "seconds.json").is_file():
            with pytest.MonkeyPatch.context() as env:
                env.setenv("CUDA_VISIBLE_DEVICES", "")
                _svg_figures(env, tmp_path_factory.mktemp("ipython"))
                seconds = {}
                for path in NOTEBOOKS:
                    notebook, seconds[path.stem] = _execute(path)
                    nbformat.write(notebook, shared / path.name)
            (shared / "seconds.json").write_text(json.dumps(seconds))
        seconds = json.loads((shared / "seconds.json").read_text())
    return {path.stem: (nbformat.read(shared / path.name, as_version=4), seconds[path.stem]) for path in NOTEBOOKS}


def _check_clean(notebook, machines=()):
    """No error, no progress output, the MODE banner, a figure; with `machines`, each figure (its SVG text)
    names one of them."""
    outputs = _outputs(notebook)
    assert outputs, "no output at all"
    errors_ = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors_, "\n".join(errors_[0].get("traceback", []))[-3000:]
    streams = "\n".join(o["text"] for o in outputs if o.get("output_type") == "stream")
    assert not PROGRESS.search(streams), f"progress-bar noise in the output: {PROGRESS.search(streams).group(0)!r}"
    assert "MODE " in streams  # the banner: measured now, committed evidence, or computed live on this CPU
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure"
    if machines:
        svgs = [o["data"]["image/svg+xml"] for o in outputs if "image/svg+xml" in o.get("data", {})]
        assert len(svgs) == sum("image/png" in o.get("data", {}) for o in outputs)
        unnamed = [k for k, svg in enumerate(svgs) if not any(m in svg for m in machines)]
        assert not unnamed, f"figures {unnamed} of {len(svgs)} name none of {machines}"


@one_worker
@needs_evidence("report.json")  # every notebook shows its figures
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, executed):
    _check_clean(executed[path.stem][0], (evidence.machine(evidence.load_report(EVIDENCE)), CPU))


def test_notebooks_are_set_up_for_both_modes():
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        code = [c.source for c in notebook.cells if c.cell_type == "code"]
        assert code[0].startswith('MODE = "auto"'), path.name
        assert "parameters" in notebook.cells[1].metadata.get("tags", []), path.name  # papermill's parameter cell
        assert not any("matplotlib.use" in source for source in code), path.name
        kernel_code = ("__global__", "cuda.jit", "triton.jit", "RawKernel", "load_inline")
        assert not any(k in source for k in kernel_code for source in code), path.name  # kernels live in adaln_lab


@one_worker
@needs_evidence("report.json")
def test_three_notebooks_take_under_four_minutes_on_the_cpu(executed):
    seconds = {stem: round(s, 1) for stem, (_, s) in executed.items()}
    assert sum(seconds.values()) < 240, seconds  # ~60 s on an idle 2-core CPU; the bar is loose for loaded CI


@one_worker
@needs_evidence("report.json")
def test_the_numbers_shown_are_the_reports(executed):
    report = evidence.load_report(EVIDENCE)
    runs = report["results"]["plain"]
    text = _text(executed["error_analysis"][0])
    for name in runs:
        for S in ("4097", "32768"):
            a = runs[name]["accuracy_latency"][S]
            row = f"| {name} | {S} | {tables.fmt(a['fwd_rel_err'])} | " + " | ".join(
                tables.fmt(a["grad_rel_err"][g]) for g in tables.GRADS)
            assert row in text, row
    assert tables.pct(runs["adaln_lab"]["forward_parity_vs_diffusers"]["table_backend=cuda"]["4097"]
                      ["bitwise_equal_fraction"], 5) in text
    text = _text(executed["latency_analysis"][0])
    for name in runs:
        a = runs[name]["accuracy_latency"]["4097"]
        assert f"| {name} | 4097 | {tables.us(a['fwd_us_graph'])} | {tables.us(a['fwd_us'])} |" in text
    assert f"autograd host floor {report['autograd_floor_host_us']:.1f} us" in text
    text = _text(executed["invariance_walkthrough"][0])
    b = runs["torch_compile"]["batch_invariance"]["full_vs_sub_batches"]
    assert f"{b['fwd_differ']} / {b['rowgrad_differ']}" in text
    assert "non_repeatable         caught by: params_repeatable" in text


@needs_evidence("lab_errors.json", "report.json")
def test_committed_lab_evidence_agrees_with_the_report():
    """Once the H200 run of `python -m adaln_lab.lab` is committed: its deterministic figures match report.json."""
    data = evidence.load_json(evidence.lab_path("errors", EVIDENCE))
    report = evidence.load_report(EVIDENCE)
    assert not data["meta"]["quick"] and data["meta"]["environment"]["gpu"]
    for S in ("4097", "32768"):
        for name in ("diffusers", "adaln_lab"):
            ours, theirs = data["errors"][S][name], report["results"]["plain"][name]["accuracy_latency"][S]
            assert ours["fwd_rel_err"] == pytest.approx(theirs["fwd_rel_err"], rel=0.05), (S, name)
        assert data["errors"][S]["adaln_lab"]["grad_correctly_rounded"]["b"] > 0.999
    comparison = errors.against_report(data, report)  # every figure in both: equal, or a named reason
    assert len(comparison["rows"]) == 2 * 6 * len(report["results"]["plain"]), comparison["rows"]
    assert not [r for r in comparison["rows"] if r["verdict"] == "unexplained"]
    if comparison["lab_commit"][:7] == comparison["report_commit"][:7]:  # one commit: adaln_lab's figures are equal
        assert {r["verdict"] for r in comparison["rows"] if r["candidate"] == "adaln_lab"} == {"equal"}


@one_worker
@needs_evidence("report.json", "lab_errors.json")
def test_the_error_notebook_says_why_lab_and_report_figures_differ_and_counts_outputs_of_zero(executed):
    text = _text(executed["error_analysis"][0])
    data = evidence.load_json(evidence.lab_path("errors", EVIDENCE))
    assert tables.against_report(errors.against_report(data, evidence.load_report(EVIDENCE))) in text
    assert "8.39e+307" not in text and "overflow encountered" not in text
    for u in data["ulp"].values():
        assert tables.cancellation_bins(u) in text and tables.ulp_largest(u) in text


# --- the same notebooks on complete (synthetic) lab files --------------------------------------------

def _cpu_report(report: dict) -> dict:
    """`report` as a CPU run writes it: no GPU, no forward_parity_vs_diffusers, no CUDA-graph times, no
    torch_compile (it runs on CUDA only)."""
    report = json.loads(json.dumps(report))
    report["environment"].update(gpu=None, cpu="x86_64", device="cpu")
    plain = report["results"]["plain"]
    plain.pop("torch_compile", None)
    plain["adaln_lab"].pop("forward_parity_vs_diffusers", None)
    for entry in plain.values():
        for a in entry["accuracy_latency"].values():
            a.update(fwd_us_graph=None, fwd_bwd_us_graph=None)
    return report


def _synthetic_evidence(directory: Path) -> None:
    """report.json as a CPU run writes it (`_cpu_report`: the committed evidence run reads the GPU one), sweep.json
    copied; lab_*.json made on the CPU at tiny sizes with the GPU-only parts filled in: a 'torch_compile' (the
    replay, named so), an 'adaln_lab_numba' row, CUDA-graph times (half the eager ones) and a kernel profile."""
    (directory / "report.json").write_text(json.dumps(_cpu_report(evidence.load_report(EVIDENCE))))
    shutil.copy(EVIDENCE / "sweep.json", directory / "sweep.json")
    shape = {"H": 64, "D": 32, "T": 3}
    named = walkthrough.candidates_here("cpu", ("diffusers", "adaln_lab"))[0]
    named.insert(1, Named("torch_compile", "the replay, standing in for torch.compile", replay))
    meta = {**evidence.meta(torch.device("cpu"), False), "seconds": 1.0}
    meta["environment"]["gpu"] = "synthetic H200"
    data = errors.measure(named, "cpu", shape=shape, sizes=(16, 64, 256), table_sizes=(64, 256), attribution_rows=64,
                          ulp_rows=256, spread_rows=64, repeats=2, chunk_rows=100)
    evidence.save({**data, "meta": meta}, evidence.lab_path("errors", directory))
    lat = {"kind": "adaln_lab_lab_latency", "candidates": {c.name: c.source for c in named}, "warnings": {},
           "sweep": latency.rows_sweep(named, (1, 16, 256), "cpu", shape, quick=True), "kernels_error": None}
    for entries in lat["sweep"]["candidates"].values():
        for e in entries.values():
            e["fwd_us_graph"], e["fwd_bwd_us_graph"] = e["fwd_us"] / 2, e["fwd_bwd_us_pure"] / 2
    profile = [{"name": n, "calls": 1.0, "us": 10.0 + k} for k, n in enumerate(latency.kernel_bytes(256, **shape))]
    lat["kernels"] = {"256": latency.roofline(profile + [{"name": "Memset (Device)", "calls": 1.0, "us": 1.0}], 256,
                                              shape, lat["sweep"]["copy_TBps"])}
    evidence.save({**lat, "meta": meta}, evidence.lab_path("latency", directory))
    small = dataclasses.replace(QUICK, H=32, D=16, seeds=(3,), sub_batch_sizes=(7,), batch_sizes=(1, 2, 17))
    checks = {"diffusers": replay, "torch_compile": walkthrough.dx_batch_dependent, "adaln_lab_numba": replay}
    inputs = make(3, 33, **small.shape)
    dy = upstream(3, inputs.x)
    inv = {"kind": "adaln_lab_lab_invariance", "protocol": dataclasses.asdict(small), "candidates": {},
           "checks": {n: {c: walkthrough.run_check(c, fn, small, "cpu") for c in walkthrough.CHECKS}
                      for n, fn in checks.items()},
           "planted": None,
           "rows_differ": {"torch_compile": walkthrough.rows_that_differ(walkthrough.dx_batch_dependent, inputs, dy,
                                                                          range(0, 33, 8))}, "meta": meta}
    evidence.save(inv, evidence.lab_path("invariance", directory))


@needs_evidence("report.json", "sweep.json")
def test_notebooks_read_complete_lab_files(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny CPU problems: faster on one thread
    try:
        _synthetic_evidence(tmp_path)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("ADALN_LAB_EVIDENCE_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # evidence mode on any machine
    _svg_figures(monkeypatch, tmp_path / "ipython")
    texts = {}
    for path in NOTEBOOKS:
        notebook, _ = _execute(path)
        _check_clean(notebook, ("synthetic H200", evidence.machine(evidence.load_report(tmp_path)), CPU))
        texts[path.stem] = _text(notebook)
        assert "synthetic H200" in texts[path.stem], path.stem  # the banner names the committed file's machine
        assert "NOT GPU" not in texts[path.stem], path.stem
    assert "profiled inside forward+backward calls" in texts["latency_analysis"]  # the kernel profile was read
    assert "torch_compile" in texts["error_analysis"] and "adaln_lab_numba" in texts["invariance_walkthrough"]
    # a CPU run's report.json: the parity it lacks is said, not shown as a figure
    assert f"adaln_lab's forward against diffusers': {evidence.NOT_MEASURED}" in texts["error_analysis"]


# --- the notebooks on a folder of `python -m adaln_lab.lab --out DIR --quick` -------------------------------

@needs_evidence("report.json")
def test_notebooks_read_a_quick_lab_folder(tmp_path, monkeypatch):
    from adaln_lab.lab.__main__ import main

    threads = torch.get_num_threads()
    try:
        assert main(["--out", str(tmp_path), "--quick", "--device", "cpu"]) == 0
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("ADALN_LAB_EVIDENCE_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _svg_figures(monkeypatch, tmp_path / "ipython")
    for path in NOTEBOOKS:  # no report.json, no sweep.json
        notebook, _ = _execute(path)
        _check_clean(notebook, ("CPU (x86_64)", "CPU (", CPU))
        text = _text(notebook)
        assert f": {evidence.NOT_MEASURED} (no report.json" in text
        assert "NOT GPU" not in text  # the folder's lab files are read, not recomputed
