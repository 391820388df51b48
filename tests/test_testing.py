"""adaln_lab.testing.assert_batch_invariant passes an invariant op and fails a planted one."""

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


def test_planted_counter_example_fails_with_its_counts():
    def every_row_sees_the_batch_mean(x, *rest):
        return replay(x, *rest) + 2.0 ** -4 * x.mean(dim=0, keepdim=True)

    with pytest.raises(AssertionError, match="not batch-invariant") as error:
        assert_batch_invariant(every_row_sees_the_batch_mean, quick=True, H=32, D=16)
    assert "first_failures" in str(error.value) and "fwd_differ" in str(error.value)


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
