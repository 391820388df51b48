"""Invariance assertions for your own kernel, ready for pytest.

    from adaln_lab.testing import assert_batch_invariant

    def test_my_kernel_is_batch_invariant():
        assert_batch_invariant(my_kernel, device="cuda")            # the seed's full protocol
        assert_batch_invariant(my_kernel, device="cuda", quick=True)  # small sizes, seconds

`my_kernel(x, norm_weight, temb, weight, bias, timestep_indices) -> out` must be differentiable by
torch autograd (shapes as in `adaln_lab.final_adaln_out`). The assertion runs the three row checks
and the parameter-gradient repeatability check of `adaln_lab.harness.invariance` and fails with
every nonzero count and the first failing comparisons.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from .harness.protocol import FULL, QUICK
from .harness.report import batch_invariance


def assert_batch_invariant(fn, *, device="cpu", quick: bool = False, H: int | None = None,
                           D: int | None = None, T: int | None = None) -> dict:
    """Raise AssertionError unless `fn` is bitwise batch-invariant; return the check's report.

    H, D, T override the protocol's shapes (the quick protocol uses H=256, D=128, T=3).
    """
    protocol = QUICK if quick else FULL
    protocol = dataclasses.replace(protocol, **{k: v for k, v in (("H", H), ("D", D), ("T", T)) if v is not None})
    report = batch_invariance(fn, protocol, torch.device(device))
    if not report["batch_invariant"]:
        summary = {
            "all_rows": {n: r for n, r in report["all_rows"].items() if r["fwd_differ"] or r["rowgrad_differ"]},
            "params_repeatable_each": report["params_repeatable_each"],
            "full_vs_sub_batches": {k: report["full_vs_sub_batches"][k] for k in ("fwd_differ", "rowgrad_differ")},
            "batch_size_sweep": {k: report["batch_size_sweep"][k] for k in ("differ", "first_failures")},
        }
        raise AssertionError("candidate is not batch-invariant:\n" + json.dumps(summary, indent=1))
    return report
