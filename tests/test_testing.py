"""adaln_lab.testing.assert_batch_invariant passes an invariant op and fails a planted one."""

import re

import pytest
import torch

from adaln_lab.reference import replay
from adaln_lab.testing import assert_batch_invariant


def test_replay_passes():
    report = assert_batch_invariant(replay, quick=True, H=32, D=16)
    assert report["batch_invariant"]


def test_it_says_up_front_how_much_work_it_is_and_how_to_make_it_small(capsys):
    assert "quick=True" in assert_batch_invariant.__doc__.split("\n\n")[1]
    assert_batch_invariant(replay, quick=True, H=32, D=16)
    err = capsys.readouterr().err
    assert "assert_batch_invariant: quick protocol on cpu: ~392 calls" in err
    assert "batch invariance" in err  # the per-check progress bar


def test_the_full_protocol_estimate_points_to_quick():
    from adaln_lab.harness.protocol import FULL, QUICK, invariance_calls
    from adaln_lab.testing import estimate

    line = estimate(FULL, False, "cuda")
    assert "full protocol" in line and "~11483 calls" in line and "quick=True" in line
    assert invariance_calls(QUICK) == 392


def every_row_sees_the_batch_mean(x, *rest):
    """Planted leak: every row sees the batch mean (output and dx)."""
    return replay(x, *rest) + 2.0 ** -4 * x.mean(dim=0, keepdim=True)


def test_planted_counter_example_fails_in_a_few_lines_with_check_count_largest_diff_and_first_row():
    with pytest.raises(AssertionError, match="not batch-invariant") as error:
        assert_batch_invariant(every_row_sees_the_batch_mean, quick=True, H=32, D=16)
    text = str(error.value)
    lines = text.splitlines()
    assert len(lines) <= 6, text
    assert lines[0].startswith("tests.test_testing:every_row_sees_the_batch_mean is not batch-invariant: 3 of 4 checks")
    rows = next(line for line in lines if line.strip().startswith("all_rows"))
    assert "50 of 50 rows differ in the output" in rows and "50 of 50 rows differ in dx, the gradient of x" in rows
    assert "first differing row: n=8, seed=3, row=0" in rows
    largest = [float(v) for v in re.findall(r"largest \|diff\| ([0-9.e+-]+)", rows)]
    assert len(largest) == 2 and all(v > 2.0 ** -8 for v in largest)  # the planted term is 2^-4 * mean(x)
    assert any(line.strip().startswith("full_vs_sub_batches") and "first differing row" in line for line in lines)
    assert any(line.strip().startswith("batch_size_sweep") and "probe_row=" in line for line in lines)
    assert lines[-1].strip() == "passed: params_repeatable"
    assert "{" not in text  # no JSON dump


def test_a_dx_only_leak_is_reported_as_rows_whose_dx_differ():
    class DxSeesTheBatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, dy):
            return dy * (1 + 2.0 ** -6 * (dy.shape[0] > 1))

    def dx_leak(x, *rest):
        return replay(DxSeesTheBatch.apply(x), *rest)

    with pytest.raises(AssertionError) as error:
        assert_batch_invariant(dx_leak, quick=True, H=32, D=16)
    rows = next(line for line in str(error.value).splitlines() if line.strip().startswith("all_rows"))
    assert "in the output" not in rows and "50 of 50 rows differ in dx, the gradient of x" in rows


def test_a_tuple_returning_candidate_gets_a_type_error_naming_it():
    def returns_out_and_rstd(*args):
        return replay(*args), None

    with pytest.raises(TypeError, match="returns_out_and_rstd returned a tuple of 2, not a tensor"):
        assert_batch_invariant(returns_out_and_rstd, quick=True, H=32, D=16)

    def not_differentiable(*args):
        with torch.no_grad():
            return replay(*args)

    with pytest.raises(TypeError, match="not_differentiable returned a tensor that does not require grad"):
        assert_batch_invariant(not_differentiable, quick=True, H=32, D=16)


def test_the_full_protocol_prints_its_measured_time_before_it_starts(monkeypatch, capsys):
    from adaln_lab import testing
    from adaln_lab.harness import estimate

    def stop(*args):
        assert re.search(r"about [0-9.]+ (s|min|h)\b.* on this device", capsys.readouterr().err)  # before the checks
        raise KeyboardInterrupt

    monkeypatch.setattr(testing, "batch_invariance", stop)
    with pytest.raises(KeyboardInterrupt):
        assert_batch_invariant(replay, H=32, D=16)
    monkeypatch.setattr(estimate, "call_cost", lambda fn, protocol, device: (0.01, 0.0))
    line = testing.estimate(testing.FULL, False, "cpu", replay)
    assert "about 2 min on this device" in line  # 11483 calls at 0.01 s
    assert estimate.minutes(3 * 3600) == "about 3.0 h (180 min)"
    assert estimate.minutes(3) == "about 3 s" and estimate.minutes(150) == "about 2 min"
    assert sum(estimate.invariance_batches(testing.QUICK)) > len(estimate.invariance_batches(testing.QUICK)) == 392


def test_make_inputs_builds_one_calls_arguments_and_the_upstream():
    from adaln_lab import final_adaln_out
    from adaln_lab.testing import make_inputs

    args = make_inputs(17, H=64, D=32, T=3)
    dy = args.pop("dy")
    out = final_adaln_out(**args)
    assert out.shape == dy.shape == (17, 64) and out.dtype == dy.dtype == torch.bfloat16
    assert int(args["timestep_indices"].max()) < 3 and args["temb"].shape == (3, 32)
    again = make_inputs(17, H=64, D=32, T=3)
    assert all(torch.equal(again[k], v) for k, v in args.items())
    with pytest.raises(ValueError, match="H must be an int >= 1"):
        make_inputs(4, H=0)


def test_tiny_h3_model_runs_and_patches_to_the_same_output():
    pytest.importorskip("diffusers", reason="the test extra brings diffusers 0.42")
    import adaln_lab
    from adaln_lab.testing import tiny_h3_model

    model, inputs = tiny_h3_model()
    want = model(**inputs).sample
    assert want.shape == (1, 8, 16)
    assert adaln_lab.patch(model, parts=("norm_out", "blocks"))
    assert torch.equal(model(**inputs).sample, want)


def test_the_readmes_leaky_kernel_fails_in_at_most_15_lines_naming_check_count_and_largest_diff():
    def leaky_kernel(x, norm_weight, temb, weight, bias, timestep_indices):  # the README's: the whole batch's RMS
        out = replay(x, norm_weight, temb, weight, bias, timestep_indices)
        return out * (x.float().pow(2).mean() + 1).rsqrt().to(out.dtype)

    with pytest.raises(AssertionError) as error:
        assert_batch_invariant(leaky_kernel, quick=True, H=32, D=16)
    lines = str(error.value).splitlines()
    assert len(lines) <= 15 and "3 of 4 checks failed" in lines[0]
    for check in ("all_rows", "full_vs_sub_batches", "batch_size_sweep"):
        line = next(line for line in lines if line.strip().startswith(check))
        assert re.search(r"\d+ of \d+ rows differ in (the output|dx)", line) and "largest |diff| " in line, line
