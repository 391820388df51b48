"""adaln_lab.bench.host_model, the eager path's own host cost on a CPU with the GPU stood in for: it runs the
shipped glue end to end (every kernel of norm_out and of one block reached, each launch's argument block
written) and puts every stand-in back afterwards. And adaln_lab.bench.host_breakdown's bounds, run under those
stand-ins: each bare Function makes the launches it names."""

import pytest
import torch

from adaln_lab.bench import host_breakdown, host_model
from adaln_lab.core import launchers, tensors
from adaln_lab.core import support


def test_the_host_model_reaches_every_launch_and_restores_the_stand_ins():
    originals = (launchers.kernels, launchers.bind, tensors.current_stream, support._not_cuda,
                 torch.cuda.current_device)
    lines = []
    found = host_model.measure(rows=8, calls=3, H=1024, D=256, out=lines.append)
    # norm_out: table_act, table, rows, then the backward's row pass, reduce, table_bwd and its reduce
    # (tests/core/test_launchers.py); a block: table_act, the table, the row order, three forward row kernels and
    # the backward's ten
    assert found["final_adaln_out"]["launches"] == 7 and found["block_adaln_path"]["launches"] == 16
    assert all(f["allocations"] > 0 and f["us"] > 0 and f["floor_us"] > 0 for f in found.values())
    assert len(lines) == 3 and lines[1].startswith("final_adaln_out: fwd+bwd")
    assert (launchers.kernels, launchers.bind, tensors.current_stream, support._not_cuda,
            torch.cuda.current_device) == originals


def test_the_bounds_make_the_launches_they_name(monkeypatch, capsys):
    from adaln_lab.harness import inputs

    monkeypatch.setattr(host_breakdown, "make", lambda T, n, device: inputs.make(T, n, device, H=64, D=32))
    host_model.LAUNCHES.clear()
    with host_model.gpu_stood_in():
        host_breakdown.bounds(8, rounds=1, device="cpu", samples=2, warmup=1)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "bound identity floor (the report's)", "bound final_adaln_out adaln_lab",
        "bound Bare, the op's 2+4 launches, 2+6 allocations", "bound Bare, 2+1 launches, 2+5 allocations",
        "bound Bare, 1+1 launches, 1+5 allocations"]
    assert lines[0].endswith("(1.00x the floor)")
    assert len(host_model.LAUNCHES) == 3 * ((2 + 4) + (2 + 1) + (1 + 1))  # the op runs torch's code on a CPU


def test_host_model_ab_finds_each_trees_host_model(tmp_path):
    from adaln_lab.bench import host_model_ab

    (tmp_path / "src" / "adaln_lab").mkdir(parents=True)
    (tmp_path / "flat" / "adaln_lab").mkdir(parents=True)
    path, script = host_model_ab.tree_layout(tmp_path)
    assert path == tmp_path / "src" and script.relative_to(path).parts == ("adaln_lab", "bench", "host_model.py")
    path, script = host_model_ab.tree_layout(tmp_path / "flat")
    assert path == tmp_path / "flat" and script.relative_to(path).parts == ("bench", "scripts", "host_model.py")
    with pytest.raises(SystemExit, match="holds neither"):
        host_model_ab.tree_layout(tmp_path / "flat" / "adaln_lab")


def test_host_model_ab_prints_min_and_median_of_the_rounds(monkeypatch, capsys):
    """The table: per step and phase, each tree's min / median over the rounds of its runs' medians."""
    from adaln_lab.bench import host_model_ab

    runs = iter([{("norm_out", "forward"): v, ("norm_out", "backward"): 2 * v} for v in (10.0, 1.0, 30.0, 2.0, 20.0,
                                                                                          9.0)])
    monkeypatch.setattr(host_model_ab, "run_tree", lambda tree, H, D, calls: next(runs))
    host_model_ab.main(["--base", "a", "--tree", "b", "--rounds", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["norm_out", "forward", "base", "10.0", "/", "20.0", "this", "1.0", "/", "2.0"]
    assert lines[2].split() == ["norm_out", "backward", "base", "20.0", "/", "40.0", "this", "2.0", "/", "4.0"]
    with pytest.raises(SystemExit):
        host_model_ab.main(["--rounds", "0"])


@pytest.mark.integration
def test_host_model_ab_times_both_phases_of_both_steps_in_a_process_of_its_own():
    from pathlib import Path

    from adaln_lab.bench import host_model_ab

    found = host_model_ab.run_tree(Path(__file__).resolve().parents[2], 64, 32, 5)
    assert sorted(found) == [("block", "backward"), ("block", "forward"), ("norm_out", "backward"),
                             ("norm_out", "forward")]
    assert all(us > 0 for us in found.values())
