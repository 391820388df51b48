"""`adaln_lab.lab.latency_sweep`: kernel bytes against bench/NOTES.md, the kernel table and roofline, the committed
sweep (bench/results/<machine>/sweep.json, skipped until it is refilled), the rows sweep on the CPU."""

import json

import pytest

from adaln_lab.harness.inputs import make
from adaln_lab.lab import latency_sweep as latency
from adaln_lab.reference import replay

from ..paths import EVIDENCE, needs_evidence
from .common import CPU, REPLAY, SHAPE


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


@needs_evidence("sweep.json", "report.json")
def test_committed_sweep_gives_the_shipped_kernels():
    sweep = json.loads((EVIDENCE / "sweep.json").read_text())
    copy = json.loads((EVIDENCE / "report.json").read_text())["copy_TBps"]  # the same run's copy bandwidth
    roof = latency.sweep_roofline(sweep, 32768, {"H": 5376, "D": 2688, "T": 3}, copy)
    assert [r["name"] for r in roof] == list(latency.SHIPPED)
    by = {r["name"]: r for r in roof}
    assert by["norm_modulate_warp_bf16"]["us"] == sweep["32768 default"]["us"]["norm_modulate"]
    assert by["table_bf16"]["us"] == sweep["32768 default"]["us"]["table"]  # HEAD's plan: sweep.py's "default"
    assert 0.5 * copy < by["norm_modulate_warp_bf16"]["TBps"] < copy  # below the copy bandwidth (NOTES v13: 93 %)


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
