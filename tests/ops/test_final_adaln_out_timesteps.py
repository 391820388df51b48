"""norm_out at many timesteps: from BWD_SORTED_MIN_T on its backward runs over the rows in timestep order
(plan.bwd_sorted: row_order.cu, the blocks' sorted row pass and its reduce), against the unsorted pass (`gpu`).
The shapes of tests/ops/test_final_adaln_out.py include T = 12 and 32 for the rest (parity, accuracy, invariance,
empty batches; bad indices in the forward)."""

import dataclasses

import pytest
import torch

from adaln_lab.harness.accuracy import SEED_GRAD_BOUNDS, accuracy
from adaln_lab.harness.calls import forward_backward
from adaln_lab.harness.candidates import adaln_lab_candidate
from adaln_lab.harness.inputs import make, upstream

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("lead", [(), (2,)], ids=["rows", "two_batches"])
def test_sorted_and_unsorted_backward_give_dx_bitwise_and_parameter_sums_within_the_bounds(monkeypatch, lead):
    """plan.bwd_sorted (from BWD_SORTED_MIN_T timesteps on): the rows in timestep order give the unsorted pass's
    dx bits (a row's dx never depends on the others), and parameter sums in another association, each within the
    seed bounds of the float64 golden; with leading dims (rows = 2 S) as well."""
    from adaln_lab.core import launchers, plan as plan_module

    inputs = make(2, 1500 if not lead else 750, "cuda", H=1024, D=256, T=12)
    if lead:
        inputs = dataclasses.replace(inputs, x=inputs.x.reshape(2, 375, 1024),
                                     timestep_indices=inputs.timestep_indices[:375])
    dy = upstream(2, inputs.x)
    got = {}
    try:
        for sorted_min_t in (12, 13):
            monkeypatch.setitem(plan_module.TUNING, "BWD_SORTED_MIN_T", sorted_min_t)
            launchers.forget_compiled()
            assert plan_module.plan(1024, 256, 12).bwd_sorted == (sorted_min_t == 12)
            got[sorted_min_t] = forward_backward(adaln_lab_candidate().fn, inputs, dy).grads["x"]
            acc = accuracy(adaln_lab_candidate().fn, inputs, dy)
            for key, bound in SEED_GRAD_BOUNDS.items():
                assert acc["grad_rel_err"][key] <= bound, (sorted_min_t, key, acc["grad_rel_err"][key])
    finally:
        monkeypatch.undo()
        launchers.forget_compiled()
    assert torch.equal(got[12], got[13])  # dx (the forward is the same kernels either way)
