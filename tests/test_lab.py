"""adaln_lab.lab on the CPU at tiny sizes: each function measures what it says it measures."""

import json

import pytest
import torch

from adaln_lab.harness.accuracy import accuracy, golden_result
from adaln_lab.harness.candidates import Named
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.lab import errors, evidence, latency, tables, walkthrough
from adaln_lab.reference import golden, replay

SHAPE = {"H": 64, "D": 32, "T": 3}
CPU = torch.device("cpu")
REPLAY = Named("replay", "adaln_lab.reference.replay", replay)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny CPU problems: one thread is faster and does not stall on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bump(t: torch.Tensor, index, ulps: int) -> torch.Tensor:
    """t (bf16) with the elements at flat `index` moved `ulps` units in the last place away from 0."""
    bits = t.clone().view(torch.int16).flatten()
    bits[index] += ulps
    return bits.view(torch.bfloat16).view(t.shape)


def test_rounded_golden_spans_pure_declared_and_diffusers():
    i = make(1, 33, **SHAPE)
    pure = golden(*i.args)
    assert torch.equal(errors.rounded_golden(i, ()), pure)
    declared, _ = golden_result(i, upstream(1, i.x), "declared")
    assert torch.equal(errors.rounded_golden(i, errors.DECLARED), declared)
    six = errors.rounded_golden(i, errors.ROUNDING_POINTS).to(torch.bfloat16)
    assert (six == replay(*i.args)).double().mean() >= 0.9999  # diffusers' arithmetic, bar double roundings
    assert not torch.equal(errors.rounded_golden(i, ("one_plus_scale",)), pure)
    with pytest.raises(ValueError, match="unknown rounding"):
        errors.rounded_golden(i, ("fma",))


def test_chunked_errors_equal_the_harness_accuracy():
    i = make(1, 37, **SHAPE)
    dy = upstream(1, i.x)
    entries, results = errors.errors_at([REPLAY], i, dy, chunk_rows=8)  # 5 chunks, the last one short
    ours, theirs = entries["replay"], accuracy(replay, i, dy)
    assert ours["fwd_rel_err"] == pytest.approx(theirs["fwd_rel_err"], rel=1e-12)
    for key in ("x", "nw", "temb", "w", "b"):
        assert ours["grad_rel_err"][key] == pytest.approx(theirs["grad_rel_err"][key], rel=1e-9)
        assert ours["grad_correctly_rounded"][key] == pytest.approx(theirs["grad_correctly_rounded"][key], abs=1e-12)
    assert results["replay"].out.shape == (37, SHAPE["H"])


def test_attribution_accounts_for_every_rounding_point():
    i = make(1, 65, **SHAPE)
    att = errors.attribution(i, {"replay": replay(*i.args)})
    by = {v["label"]: v for v in att["variants"]}
    assert by["none (pure golden)"]["max_rel_err"] == 0
    assert by["all six (diffusers)"]["match"]["replay"] >= 0.9999
    assert sum(p["variance_share"] for p in att["points"].values()) == pytest.approx(1.0)
    for point, p in att["points"].items():
        assert 0 < p["alone_max_rel_err"] < 2 ** -7, point  # one bf16 rounding: at most ~half an ulp of max|ref|
        assert p["without_rms_rel_err"] < att["all_rms_rel_err"] * 1.02, point  # removing one never adds error
    assert len(att["variants"]) == 2 * len(errors.ROUNDING_POINTS) + 3


def test_ulp_analysis_counts_planted_distances_and_finds_the_largest():
    i = make(1, 9, **SHAPE)
    b = replay(*i.args)
    a = _bump(b, torch.tensor([3, 70, 200]), 1)
    a = _bump(a, torch.tensor([400]), 6)
    u = errors.ulp_analysis(a, b, i, top=4)
    hist = dict(zip(u["bins"], u["histogram"]))
    assert sum(u["histogram"]) == b.numel()
    assert hist["1"] == 3 and hist["5-8"] == 1 and hist["0"] == b.numel() - 4
    assert u["max_ulp"] == 6 and u["largest"][0]["ulps"] == 6
    assert (u["largest"][0]["row"], u["largest"][0]["col"]) == divmod(400, SHAPE["H"])
    assert sum(c["differ"] for c in u["by_cancellation"]) == 4
    assert sorted(u["sample"]["ulps"]) == [1, 1, 1, 6]


def test_spread_sees_non_repeatable_gradients_and_not_repeatable_ones():
    i = make(1, 16, **SHAPE)
    dy = upstream(1, i.x)
    planted = Named("planted", "non_repeatable", walkthrough.non_repeatable)
    sp = errors.spread([REPLAY, planted], i, dy, repeats=3)
    assert all(e["distinct"] == 1 and e["differ_fraction"] == 0 for e in sp["candidates"]["replay"].values())
    weight = sp["candidates"]["planted"]["weight"]
    assert weight["distinct"] >= 2 and weight["differ_fraction"] > 0 and 0 < weight["max_spread_rel"] < 2 ** -5
    assert sp["candidates"]["planted"]["bias"]["distinct"] == 1


def test_measure_errors_writes_every_section():
    data = errors.measure([REPLAY], CPU, quick=True, shape=SHAPE, sizes=(8, 33), table_sizes=(33,),
                          attribution_rows=8, ulp_rows=33, spread_rows=8, repeats=2, chunk_rows=16)
    assert set(data["errors"]) == {"8", "33"} and data["attribution"]["rows"] == 8
    assert data["spread"]["rows"] == 8 and data["ulp"] == {}  # no diffusers: no ulp baseline
    assert errors.growth(data)["replay"]["w"] == [data["errors"][S]["replay"]["grad_rel_err"]["w"] for S in ("8", "33")]
    json.dumps(data)  # what the CLI writes


def test_kernel_bytes_match_the_notes():
    """bench/NOTES.md, 32768 rows: table 57.8 MB, norm_modulate 704.6 MB, norm_modulate_bwd 1057 MB + 17 MB."""
    b = latency.kernel_bytes(32768, 5376, 2688, 3)
    assert b["table_bf16"] == pytest.approx(57.8e6, rel=0.01)
    assert b["norm_modulate_bf16"] == pytest.approx(704.6e6, rel=0.01)
    assert b["norm_modulate_bwd_bf16"] == pytest.approx(1057e6 + 17e6, rel=0.01)
    assert b["reduce_partials_bf16"] == pytest.approx(17e6, rel=0.03)
    assert b["table_bwd_bf16"] == pytest.approx(115.6e6, rel=0.03)
    assert latency.kernel_bytes(1, 5376, 2688, 3)["norm_modulate_bwd_bf16"] < b["norm_modulate_bwd_bf16"] / 100


def test_kernel_table_and_roofline():
    events = [("norm_modulate_bf16", 200.0), ("table_bf16", 30.0), ("norm_modulate_bf16", 220.0), ("Memset", 1.0)]
    rows = latency.kernel_table(events, iters=2)
    assert rows[0] == {"name": "norm_modulate_bf16", "calls": 1.0, "us": 210.0}
    roof = {r["name"]: r for r in latency.roofline(rows, 32768, {"H": 5376, "D": 2688, "T": 3}, 4.0)}
    nbytes = latency.kernel_bytes(32768, 5376, 2688, 3)["norm_modulate_bf16"]
    assert roof["norm_modulate_bf16"]["TBps"] == pytest.approx(nbytes / 210e-6 / 1e12)
    assert roof["norm_modulate_bf16"]["x_floor"] == pytest.approx(4.0 / roof["norm_modulate_bf16"]["TBps"])
    assert roof["Memset"]["bytes"] is None and roof["Memset"]["x_floor"] is None


def test_committed_sweep_gives_the_shipped_kernels():
    sweep = json.loads((evidence.evidence_dir() / "sweep.json").read_text())
    roof = latency.sweep_roofline(sweep, 32768, {"H": 5376, "D": 2688, "T": 3}, 4.26)
    assert [r["name"] for r in roof] == list(latency.SHIPPED)
    by = {r["name"]: r for r in roof}
    assert by["norm_modulate_bf16"]["us"] == sweep["32768 default"]["us"]["norm_modulate"]
    assert by["table_bf16"]["us"] == sweep["32768 baseline"]["us"]["table"]
    assert 2.5 < by["norm_modulate_bf16"]["TBps"] < 4.26  # below the copy bandwidth, as NOTES says (3.2 TB/s)


def test_rows_sweep_on_the_cpu():
    data = latency.rows_sweep([REPLAY], (1, 64), CPU, SHAPE, quick=True)
    e = data["candidates"]["replay"]["64"]
    assert e["fwd_us_graph"] is None and e["fwd_us_graph_error"] == "no CUDA"
    assert e["fwd_us"] > 0 and e["host_fwd_bwd_us"] > 0
    assert data["memory_floor"]["64"]["fwd_bytes"] > data["memory_floor"]["1"]["fwd_bytes"]
    assert set(data["autograd_floor"]["1"]) == {"autograd_floor_us", "autograd_floor_host_us"}
    assert latency.host_bound_rows(data, "replay") == []  # no graph time, no verdict
    data["candidates"]["replay"]["64"]["fwd_bwd_us_graph"] = e["host_fwd_bwd_us"] / 2
    assert latency.host_bound_rows(data, "replay") == [64]
    assert latency.kernel_profile(replay, make(1, 4, **SHAPE)) is None


def test_each_planted_counter_example_is_caught_by_its_check():
    from adaln_lab.harness.protocol import QUICK
    import dataclasses

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
    from adaln_lab.harness.protocol import QUICK
    from adaln_lab.harness.table import markdown
    import dataclasses

    p = dataclasses.replace(QUICK, H=32, D=16, warmup=1, iters=2)
    rep = walkthrough.user_report([Named("mine", "the replay", replay)], CPU, protocol=p)
    assert rep["results"]["plain"]["mine"]["batch_invariance"]["batch_invariant"] is True
    assert "| mine | 65 | yes | yes |" in markdown(rep)


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
    assert calls == [("cpu", True)] and "NOT H200" in banner and data["meta"]["quick"] is True
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


def test_tables_print_the_report_figures():
    report = evidence.load_report()
    text = tables.report_errors(report)
    a = report["results"]["plain"]["adaln_lab"]["accuracy_latency"]["4097"]
    assert f"| adaln_lab | 4097 | {tables.fmt(a['fwd_rel_err'])} |" in text
    assert tables.pct(a["grad_correctly_rounded"]["b"]) in text
    assert tables.us(a["fwd_bwd_us_graph"]) in tables.report_latency(report)
    sub = report["results"]["plain"]["torch_compile"]["batch_invariance"]["full_vs_sub_batches"]
    assert "| torch_compile | " in tables.invariance(report)
    assert f" | {sub['fwd_differ']} / {sub['rowgrad_differ']} | " in tables.invariance(report)  # its sub-batch rows


def test_cli_quick_writes_the_asked_files(tmp_path, capsys):
    from adaln_lab.lab.__main__ import main

    assert main(["--out", str(tmp_path), "--quick", "--device", "cpu", "--only", "errors"]) == 0
    data = json.loads((tmp_path / "lab_errors.json").read_text())
    assert data["kind"] == "adaln_lab_lab_errors" and data["meta"]["quick"] is True
    assert set(data["candidates"]) == {"diffusers", "adaln_lab"}
    assert "torch_compile" in data["meta"]["skipped_candidates"]
    assert not (tmp_path / "lab_latency.json").exists()
    assert "adaln_lab.lab" in capsys.readouterr().err
