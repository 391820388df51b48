"""The block report (adaln_lab/harness/block_report.py): inputs, floor, golden, accuracy, CLI."""

import json
import re
import subprocess
import sys

import pytest
import torch

from adaln_lab.__main__ import main
from adaln_lab.harness import block_report as br

pytestmark = pytest.mark.integration  # the block report CLI end to end


def test_inputs_shapes_and_indices():
    inputs = br.make_block(1, 50, H=16, D=8, T=4)
    assert inputs.x.shape == (50, 16) and inputs.x.dtype == torch.bfloat16
    assert inputs.weight.shape == (18 * 16, 8) and inputs.bias.shape == (18 * 16,)
    assert inputs.temb.shape == (4, 8) and inputs.temb.dtype == torch.float32
    idx = inputs.timestep_indices
    assert idx.dtype == torch.int64 and int(idx.min()) >= 0 and int(idx.max()) < 3 * 4
    assert len(set(idx.tolist())) > 6  # timesteps and tags both vary
    again = br.make_block(2, 50, H=16, D=8, T=4)
    assert torch.equal(inputs.weight, again.weight) and not torch.equal(inputs.x, again.x)


def test_floor_counts_passes_over_rows_and_the_weight():
    S, H, D, T = 4097, 5376, 2688, 3
    u, W = S * H * 2, 18 * H * D * 2
    floor = br.block_floor_bytes(S, H, D, T)
    assert floor["fwd_bytes"] == 9 * u + W
    assert floor["fwd_bwd_bytes"] == 22 * u + 3 * W
    assert W == 520_224_768  # the 520 MB per block


def test_golden_is_the_diffusers_block_in_float64_and_catches_a_wrong_candidate():
    inputs = br.make_block(1, 33, H=16, D=8, T=2)
    dy = torch.randn(inputs.x.shape).to(torch.bfloat16)
    reference = br.golden(inputs, dy)
    assert reference[0].dtype == torch.float64
    good = br.accuracy(br.diffusers_block_call, inputs, dy, reference)
    assert good["fwd_rel_err"] < 0.02 and max(good["grad_rel_err"].values()) < 0.05
    assert good["grads_repeat_bitwise"]

    def wrong(x, n1, n2, temb, w, b, idx):  # norm2's weight ignored: its gradient is then zero
        return br.diffusers_block_call(x, n1, n1 + 0 * n2, temb, w, b, idx)

    bad = br.accuracy(wrong, inputs, dy, reference)
    assert bad["grad_rel_err"]["norm2_weight"] > 0.5


def test_cli_writes_a_block_report_prints_its_figures_and_table_renders_it(tmp_path, capsys):
    out = tmp_path / "block.json"
    assert main(["block-report", "--out", str(out), "--quick", "--device", "cpu", "--candidates", "diffusers"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("[block report] S=")]
    assert len(lines) == 2 and all("None" not in line for line in lines)
    assert re.fullmatch(r"\[block report\] S=257 diffusers: host fwd \d+ us, fwd\+bwd \d+ us "
                        r"\(CUDA graphs: n/a on CPU\)", lines[0]), lines[0]
    assert "| 257 | diffusers | n/a on CPU | n/a on CPU |" in captured.out  # the table, on screen at the end
    assert main(["table", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.strip() == captured.out.strip()
    assert "| 1024 | diffusers | n/a on CPU |" in text and "- CPU run:" in text
    assert re.search(r"host memory copy [0-9.e-]+ TB/s \(no floor on CPU\)", text)  # printed, as in the JSON
    report = json.loads(out.read_text())
    assert report["kind"] == "adaln_lab_block_report" and report["quick"]
    entry = report["sizes"]["257"]
    assert entry["floor"]["fwd_bwd_bytes"] == br.block_floor_bytes(257, **br.QUICK_SHAPE)["fwd_bwd_bytes"]
    result = entry["candidates"]["diffusers"]
    assert result["fwd_us_graph"] is None and result["fwd_us_graph_error"] == "no CUDA"
    assert result["host_fwd_bwd_us"] > 0 and result["grads_repeat_bitwise"]
    assert entry["floor"]["fwd_us"] is None and "CPU" in entry["floor"]["null_reason"]  # printed as n/a on CPU
    spread = result["spread_us"]["host_fwd_bwd_us"]
    assert spread["median"] == result["host_fwd_bwd_us"] and spread["n"] == br.HOST_SAMPLES
    assert re.search(r"\| 257 \| diffusers \| n/a on CPU \| n/a on CPU \| n/a on CPU \| \d+ ±\d+% \|", text)


def test_the_block_line_shows_graph_and_host_figures_or_why_graphs_are_missing():
    floor = {"fwd_us": 100.0, "fwd_bwd_us": 300.0}
    gpu = {"fwd_us_graph": 120.4, "fwd_bwd_us_graph": 350.6, "host_fwd_us": 40.0, "host_fwd_bwd_us": 90.0}
    assert br.measured(gpu, floor) == ("graph fwd 120 us, fwd+bwd 351 us (floor 100 / 300); "
                                       "host fwd 40 us, fwd+bwd 90 us")
    failed = dict(gpu, fwd_us_graph=None, fwd_bwd_us_graph=None, fwd_bwd_us_graph_error="RuntimeError: capture")
    assert br.measured(failed, floor) == "host fwd 40 us, fwd+bwd 90 us (CUDA graphs: RuntimeError: capture)"


def test_cli_refuses_an_unknown_candidate(tmp_path):
    assert main(["block-report", "--out", str(tmp_path / "x.json"), "--quick", "--device", "cpu",
                 "--candidates", "nope"]) == 2


WITHOUT_DIFFUSERS = """
import sys
sys.modules["diffusers"] = None  # import diffusers now raises ImportError, as after a plain `pip install -e .`
from adaln_lab.harness import block_report as br
br.QUICK_SIZES, br.HOST_SAMPLES, br.WARMUP, br.ITERS = (33,), 3, 1, 3  # the run's cost, not what it does
from adaln_lab.__main__ import main

sys.exit(main(["block-report", "--quick", "--device", "cpu", "--candidates", "diffusers,adaln_lab",
              "--out", sys.argv[1]]))
"""


def test_block_report_runs_without_diffusers_and_says_its_rows_are_the_replay(tmp_path):
    out = tmp_path / "block.json"
    run = subprocess.run([sys.executable, "-c", WITHOUT_DIFFUSERS, str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "diffusers not importable" in run.stderr and "named diffusers_replay" in run.stderr
    assert "| 33 | diffusers_replay |" in run.stdout and "| 33 | adaln_lab |" in run.stdout
    assert "| diffusers |" not in run.stdout
    assert "- diffusers_replay: NOT diffusers (diffusers is not installed here)" in run.stdout
    report = json.loads(out.read_text())
    rows = report["sizes"]["33"]["candidates"]
    assert set(rows) == {"diffusers_replay", "adaln_lab"}
    assert rows["diffusers_replay"]["replay_of"] == "diffusers" and "replay_of" not in rows["adaln_lab"]
    assert all("REPLAYED" in row["source"] or "replay of diffusers' block" in row["source"] for row in rows.values())
    assert "replay of diffusers' block" in report["golden"]
    assert rows["adaln_lab"]["fwd_rel_err"] < 0.02 and rows["adaln_lab"]["grads_repeat_bitwise"]


def test_the_replay_block_is_diffusers_block_bit_for_bit():
    pytest.importorskip("diffusers.models.transformers.transformer_minimax_h3")
    inputs = br.make_block(1, 33, H=16, D=8, T=2)
    dy = torch.randn(inputs.x.shape).to(torch.bfloat16)
    with torch.device("meta"):
        replay = br.ReplayBlock(16, 8)
    ours = br.forward_backward(br.block_call(replay), inputs, dy)
    theirs = br.forward_backward(br.diffusers_block_call, inputs, dy)
    assert br.diffusers_missing() is None  # theirs is diffusers' own block
    assert torch.equal(ours[0], theirs[0])
    assert all(torch.equal(ours[1][name], theirs[1][name]) for name in br.LEAVES)
