"""`adaln_lab.harness.invariance` catches what it claims to catch: planted counter-examples fail, an invariant op
passes."""

import torch

from adaln_lab.harness import invariance
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.reference import replay

SHAPE = {"H": 32, "D": 16, "T": 3}
CPU = torch.device("cpu")


def invariant(*args):
    return replay(*args)


def batch_size_dependent(x, norm_weight, temb, weight, bias, timestep_indices):
    """Planted: every row is nudged by a term that depends on how many rows the batch has."""
    out = replay(x, norm_weight, temb, weight, bias, timestep_indices)
    return out + (x.shape[0] % 5) * 2.0 ** -4 * x


def order_dependent(x, norm_weight, temb, weight, bias, timestep_indices):
    """Planted: rows depend on the batch's first row (a cross-row reduction gone wrong)."""
    out = replay(x, norm_weight, temb, weight, bias, timestep_indices)
    return out + 2.0 ** -3 * x[:1].detach()


def non_repeatable(x, norm_weight, temb, weight, bias, timestep_indices):
    """Planted: the weight gradient is scaled by run-to-run noise, as unordered atomics would perturb it."""
    jitter = 1.0 + 2.0 ** -6 * torch.rand(())
    return replay(x, norm_weight, temb, weight * jitter, bias, timestep_indices)


def test_invariant_op_passes_every_check():
    rows = invariance.all_rows(invariant, (5, 9), (3,), CPU, SHAPE)
    assert all(r["fwd_differ"] == 0 and r["rowgrad_differ"] == 0 for r in rows.values())
    sub = invariance.full_vs_sub_batches(invariant, 64, (1, 7, 20), (3,), 16, 8, CPU, SHAPE)
    assert sub["fwd_differ"] == 0 and sub["rowgrad_differ"] == 0 and sub["sub_batches"] == 8 + 8 + 4
    sweep = invariance.batch_size_sweep(invariant, [1, 2, 3, 8, 16], (0, 7, 15), 16, (3,), CPU, SHAPE)
    assert sweep["differ"] == 0 and sweep["first_failures"] == []
    assert sweep["comparisons"] == 3 * (1 + 2 + 3 + 3 + 3) + 3
    batch = make(3, 10, **SHAPE)
    assert all(invariance.params_repeatable(invariant, batch, upstream(3, batch.x)).values())


def test_planted_batch_size_dependence_is_caught_by_every_row_check():
    rows = invariance.all_rows(batch_size_dependent, (7,), (3,), CPU, SHAPE)
    assert rows["7"]["fwd_differ"] == 7 and rows["7"]["rowgrad_differ"] == 7
    sub = invariance.full_vs_sub_batches(batch_size_dependent, 64, (7,), (3,), 16, 8, CPU, SHAPE)
    assert sub["fwd_differ"] > 0
    sweep = invariance.batch_size_sweep(batch_size_dependent, [1, 2, 3], (0, 5), 16, (3,), CPU, SHAPE)
    assert sweep["differ"] > 0 and sweep["first_failures"]
    assert set(sweep["first_failures"][0]) == {"seed", "batch_size", "probe_row", "position"}


def test_planted_order_dependence_is_caught_by_the_sweep_and_reversal():
    sweep = invariance.batch_size_sweep(order_dependent, [16], (0,), 16, (3,), CPU, SHAPE)
    # probe row 0 in the middle, last and reversed positions sees another first row
    assert sweep["differ"] >= 2


def test_planted_non_repeatable_gradients_are_caught():
    batch = make(3, 10, **SHAPE)
    same = invariance.params_repeatable(non_repeatable, batch, upstream(3, batch.x))
    assert not same["weight"]


def test_verdict_combines_every_check():
    clean = {"all_rows": {"4": {"rows": 4, "fwd_differ": 0, "rowgrad_differ": 0}}, "params_repeatable": True,
             "full_vs_sub_batches": {"fwd_differ": 0, "rowgrad_differ": 0}, "batch_size_sweep": {"differ": 0}}
    assert invariance.batch_invariant(clean)
    for broken in ({"params_repeatable": False}, {"batch_size_sweep": {"differ": 1}},
                   {"full_vs_sub_batches": {"fwd_differ": 0, "rowgrad_differ": 2}},
                   {"all_rows": {"4": {"rows": 4, "fwd_differ": 1, "rowgrad_differ": 0}}}):
        assert not invariance.batch_invariant({**clean, **broken})


def test_rows_differ_is_bitwise():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[1, 1] += 1  # one ulp
    assert invariance._rows_differ(a, b).tolist() == [False, True]
    z = torch.tensor([[0.0]]), torch.tensor([[-0.0]])
    assert invariance._rows_differ(*z).tolist() == [True]
