"""`adaln_lab.lab.errors` on the CPU at tiny sizes: goldens with any rounding points, chunked errors, the rounding
attribution, ulp analysis (outputs of 0 counted apart), run-to-run spread, `measure`, and the comparison of a lab
file with a report."""

import json
import math

import pytest
import torch

from adaln_lab.harness.accuracy import accuracy, golden_result
from adaln_lab.harness.candidates import Named
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.lab import errors, tables, walkthrough
from adaln_lab.reference import golden, replay

from .common import CPU, REPLAY, SHAPE, bump as _bump


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


def test_ulp_analysis_counts_outputs_of_zero_apart_and_keeps_every_ratio_finite():
    i = make(1, 9, **SHAPE)
    flat = replay(*i.args).flatten().clone()
    flat[[5, 77]] = 0  # diffusers' output 0 there: max(|p|, |shift|) / |out| has no value
    b = flat.view(9, SHAPE["H"])
    a = _bump(b, torch.tensor([5, 77, 300]), 3)
    u = errors.ulp_analysis(a, b, i, top=4)
    zeros = int((b == 0).sum())
    assert u["zero_output"] == {"elements": zeros, "differ": 2, "max_ulp": 3}
    assert sum(c["elements"] for c in u["by_cancellation"]) + zeros == b.numel()
    assert sum(c["differ"] for c in u["by_cancellation"]) == 1
    assert all(math.isfinite(c) and c < 1e6 for c in u["sample"]["cancellation"])
    assert u["sample"]["ulps"] == [3] and u["sample"]["zero_output_ulps"] == [3, 3]
    at_zero = [d for d in u["largest"] if d["b"] == 0]
    assert len(at_zero) == 2 and all(d["cancellation"] is None for d in at_zero)
    assert all(math.isfinite(d["cancellation"]) for d in u["largest"] if d["b"] != 0)
    json.dumps(u, allow_nan=False)  # no inf or nan reaches lab_errors.json
    assert tables.ZERO_OUTPUT in tables.cancellation_bins(u) and tables.ZERO_OUTPUT in tables.ulp_largest(u)


def test_ulp_sample_always_holds_the_largest_distances():
    i = make(1, 9, **SHAPE)
    b = replay(*i.args)
    a = _bump(_bump(b, torch.arange(0, 400), 1), torch.tensor([450]), 40)
    u = errors.ulp_analysis(a, b, i, top=3, sample=5)  # 5 of 401 drawn at random: the 40 would be missed
    assert u["max_ulp"] == 40 and 40 in u["sample"]["ulps"]
    assert errors.cancellation_points(u)["ulps"].count(40) >= 1


def test_files_written_before_the_zero_count_read_as_out_equal_zero():
    legacy = {"sample": {"cancellation": [1.5, 8.391575375626826e+307], "ulps": [1, 15488]},
              "largest": [{"ulps": 15488, "cancellation": 8.391575375626826e+307, "b": 0.0}],
              "by_cancellation": [{"from": 1, "to": None, "elements": 10, "differ": 2, "max_ulp": 15488}]}
    points = errors.cancellation_points(legacy)
    assert points["cancellation"] == [1.5] and points["zero_output_ulps"] == [15488, 15488]
    assert tables.cancellation(8.391575375626826e+307) == tables.ZERO_OUTPUT and tables.cancellation(133.0) == "133"
    assert "incl. out = 0" in tables.cancellation_bins(legacy)


def _lab_and_report(commit_lab, commit_report, lab_temb, report_temb, distinct=1):
    entry = {"fwd_rel_err": 0.0068, "grad_rel_err": {"x": 0.0039, "nw": 0.0022, "temb": lab_temb, "w": 0.0021,
                                                     "b": 0.0026}}
    theirs = {"fwd_rel_err": 0.0068, "grad_rel_err": {**entry["grad_rel_err"], "temb": report_temb}}
    data = {"errors": {"4097": {"adaln_lab": entry}}, "meta": {"adaln_lab_commit": commit_lab},
            "spread": {"candidates": {"adaln_lab": {"temb": {"distinct": distinct}}}}}
    report = {"adaln_lab_commit": commit_report,
              "results": {"plain": {"adaln_lab": {"accuracy_latency": {"4097": theirs}}}}}
    return data, report


def test_against_report_says_why_a_figure_differs():
    # the pair of 6b65938: lab file of 5613c04, report of bc33a1f, same inputs and metric
    comparison = errors.against_report(*_lab_and_report("5613c04", "bc33a1f", 8.42e-08, 1.16e-07))
    verdicts = {r["quantity"]: r["verdict"] for r in comparison["rows"]}
    assert verdicts == {"fwd": "equal", "dx": "equal", "dnw": "equal", "dtemb": "commits differ", "dw": "equal",
                        "db": "equal"}
    assert "commits differ" in tables.against_report(comparison) and "5613c04" in tables.against_report(comparison)
    same = errors.against_report(*_lab_and_report("ad16fd5aaaa", "ad16fd5", 1.16e-07, 1.16e-07 + 1e-15))
    assert {r["verdict"] for r in same["rows"]} == {"equal"}
    varies = errors.against_report(*_lab_and_report("ad16fd5", "ad16fd5", 0.031, 0.029, distinct=5))
    assert {r["quantity"]: r["verdict"] for r in varies["rows"]}["dtemb"] == "run to run"
    odd = errors.against_report(*_lab_and_report("ad16fd5", "ad16fd5", 0.031, 0.029))
    assert {r["quantity"]: r["verdict"] for r in odd["rows"]}["dtemb"] == "unexplained"


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
