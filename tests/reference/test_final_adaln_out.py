"""The replay is diffusers, bit for bit; the goldens agree where they should."""

import pytest
import torch

from adaln_lab.harness.accuracy import golden_result, rel_err
from adaln_lab.harness.calls import forward_backward
from adaln_lab.harness.candidates import diffusers_candidate
from adaln_lab.harness.inputs import LEAVES, make, upstream
from adaln_lab.reference import golden, replay

diffusers = pytest.importorskip("diffusers", reason="the test extra brings diffusers 0.42")


def _cast(inputs, dtype):
    for name in ("x", "norm_weight", "weight", "bias"):
        setattr(inputs, name, getattr(inputs, name).to(dtype))
    return inputs


@pytest.mark.parametrize("n,H,D,T", [(7, 64, 32, 1), (33, 96, 48, 3), (130, 256, 128, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_replay_bitwise_equals_diffusers(n, H, D, T, dtype):
    module = diffusers_candidate()
    assert "real module" in module.source
    inputs = _cast(make(3, n, H=H, D=D, T=T), dtype)
    dy = upstream(3, inputs.x)
    ours = forward_backward(lambda *a: replay(*a), inputs, dy)
    theirs = forward_backward(module.fn, inputs, dy)
    assert torch.equal(ours.out, theirs.out)
    for name in LEAVES:
        assert torch.equal(ours.grads[name], theirs.grads[name]), name


def test_replay_with_leading_dims_equals_diffusers():
    inputs = make(4, 24, H=64, D=32, T=2)
    x = inputs.x.view(2, 12, 64)
    idx = inputs.timestep_indices[:12]
    args = (x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.bias, idx)
    assert torch.equal(replay(*args), diffusers_candidate().fn(*args))


def test_goldens_agree_where_they_should():
    inputs = make(5, 40, H=64, D=32, T=3)
    dy = upstream(5, inputs.x)
    pure_out, pure_grads = golden_result(inputs, dy, "pure")
    declared_out, declared_grads = golden_result(inputs, dy, "declared")
    # float64 projection dtype: the declared roundings are no-ops, so both goldens are identical
    f64 = _cast(make(5, 40, H=64, D=32, T=3), torch.float64)
    a_out, a_grads = golden_result(f64, dy.double(), "pure")
    b_out, b_grads = golden_result(f64, dy.double(), "declared")
    assert torch.equal(a_out, b_out)
    assert all(torch.equal(a_grads[k], b_grads[k]) for k in LEAVES)
    # bf16: the declared table rounding moves the output by about a bf16 ulp of the table, no more
    assert 0 < rel_err(declared_out, pure_out) < 2 ** -7
    # straight-through: the x gradient differs only through the rounded scale
    assert rel_err(declared_grads["x"], pure_grads["x"]) < 2 ** -7
    # the diffusers replay sits near both, nearer than bf16 output rounding allows it to be off
    assert rel_err(replay(*inputs.args), declared_out) < 2 ** -6


def test_golden_is_float64_and_rejects_unknown_flavour():
    inputs = make(1, 4, H=16, D=8, T=2)
    assert golden(*inputs.args).dtype == torch.float64
    with pytest.raises(ValueError, match="flavour"):
        golden(*inputs.args, flavour="exact")


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 40), H=st.integers(1, 48), D=st.integers(1, 24), T=st.integers(1, 5),
       seed=st.integers(0, 10 ** 6), leading=st.integers(1, 2))
def test_replay_equals_diffusers_on_random_shapes(n, H, D, T, seed, leading):
    inputs = make(seed, n * leading, H=H, D=D, T=T)
    x = inputs.x.view(leading, n, H) if leading > 1 else inputs.x
    idx = inputs.timestep_indices[:n]
    args = (x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.bias, idx)
    assert torch.equal(replay(*args), diffusers_candidate().fn(*args))
