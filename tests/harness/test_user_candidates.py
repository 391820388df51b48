"""Any callable is a candidate: `run_report` and `resolve` take one beside the built-in names, the CLI takes
`--candidate module:function`, rows are named module:qualname, and a candidate whose output is not a differentiable
tensor of x's shape gets a TypeError naming it."""

import dataclasses
import re
import json

import pytest
import torch

from adaln_lab.__main__ import main
from adaln_lab.harness import report as report_module
from adaln_lab.harness.calls import forward_backward
from adaln_lab.harness.candidates import Named, callable_name, load_candidate, resolve
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.harness.protocol import QUICK
from adaln_lab.reference import replay

from . import user_kernels

CPU = torch.device("cpu")
TINY = dataclasses.replace(QUICK, H=32, D=16, all_rows_sizes=(5,), seeds=(3,), full_batch=64, sub_batch_sizes=(7, 32),
                           sub_batch_seeds=(3,), small_limit=16, small_step=16, pool_size=16, probe_rows=(0, 15),
                           batch_sizes=(1, 2, 16), accuracy_sizes=(9,), warmup=1, iters=2, copy_bytes=1 << 20)
MINE = "tests.harness.user_kernels:replay_kernel"


def test_resolve_takes_a_callable_a_named_and_a_name():
    built = resolve([user_kernels.replay_kernel, Named("named", "the replay", replay), "adaln_lab",
                     user_kernels.replay_kernel], CPU)
    assert [c.name for c in built] == [MINE, "named", "adaln_lab", MINE + "#2"]
    assert built[0].fn is user_kernels.replay_kernel and MINE in built[0].source
    assert callable_name(user_kernels.Kernels.leaky) == "tests.harness.user_kernels:Kernels.leaky"
    with pytest.raises(TypeError, match="must be callable"):
        resolve([3], CPU)


def test_run_report_takes_a_callable_and_names_its_row():
    result = report_module.run_report([user_kernels.replay_kernel], "cpu", True, protocol=TINY)
    entry = result["results"]["plain"][MINE]
    assert entry["batch_invariance"]["batch_invariant"] and entry["batch_invariance"]["rows_invariant"]
    assert 0 < entry["accuracy_latency"]["9"]["fwd_rel_err"] < 0.02


def test_load_candidate_errors_name_what_is_wrong():
    assert load_candidate(MINE).fn is user_kernels.replay_kernel
    assert load_candidate("tests.harness.user_kernels:Kernels.leaky").fn is user_kernels.Kernels.leaky
    for spec, message in (("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
                          ("tests.harness.user_kernels:missing", "has no attribute 'missing'"),
                          ("tests.harness.user_kernels:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
                          ("tests.harness.user_kernels", "expected module:attribute")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            load_candidate(spec)


def test_cli_candidate_runs_beside_the_builtins_and_prints_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report_module, "QUICK", TINY)
    out = tmp_path / "mine.json"
    assert main(["report", "--quick", "--device", "cpu", "--candidates", "adaln_lab", "--candidate", MINE,
                 "--candidate", "tests.harness.user_kernels:Kernels.leaky", "--out", str(out)]) == 0
    plain = json.loads(out.read_text())["results"]["plain"]
    assert list(plain) == ["adaln_lab", MINE, "tests.harness.user_kernels:Kernels.leaky"]
    assert plain["tests.harness.user_kernels:Kernels.leaky"]["batch_invariance"]["rows_invariant"] is False
    captured = capsys.readouterr()
    assert f"| {MINE} | 9 | yes | yes |" in captured.out
    assert "| tests.harness.user_kernels:Kernels.leaky | 9 | no | yes |" in captured.out
    assert "Kernels.leaky is not batch-invariant:" in captured.err and "largest |diff|" in captured.err


def test_cli_candidate_errors_exit_2_with_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report_module, "QUICK", TINY)
    for spec, message in (("no_such_module_xyz:fn", "cannot import module"),
                          ("tests.harness.user_kernels:missing", "has no attribute 'missing'"),
                          ("tests.harness.user_kernels:NOT_CALLABLE", "not callable"),
                          ("tests.harness.user_kernels:returns_a_tuple", "returns_a_tuple returned a tuple of 2")):
        assert main(["report", "--quick", "--device", "cpu", "--candidates", "", "--candidate", spec,
                     "--out", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
        assert not (tmp_path / "x.json").exists()


def test_an_output_that_is_not_a_differentiable_tensor_is_a_type_error_naming_the_candidate():
    inputs = make(3, 4, H=32, D=16, T=3)
    dy = upstream(3, inputs.x)

    def detached(*args):
        return replay(*args).detach()

    def wrong_shape(*args):
        return replay(*args)[:, :8]

    for fn, message in ((user_kernels.returns_a_tuple, "user_kernels:returns_a_tuple returned a tuple of 2, not a "
                                                       r"tensor.*\(4, 32\)"),
                        (detached, "detached returned a tensor that does not require grad"),
                        (wrong_shape, r"wrong_shape returned a tensor of shape \(4, 8\); it must have x's shape")):
        with pytest.raises(TypeError, match=message):
            forward_backward(fn, inputs, dy)


def test_the_full_protocol_report_prints_its_measured_time_first(capsys):
    result = report_module.run_report([user_kernels.replay_kernel], "cpu", False, protocol=TINY)
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "full protocol" in line)
    assert re.search(r"about \d+ s on this device \(cpu; extrapolated from calls of 1 and 64 rows", line), line
    assert err.index(line) < err.index("batch invariance: ")  # before the first check
    assert result["quick"] is False
