"""Invariance assertions for your own kernel, ready for pytest.

Start with `quick=True` (392 calls at H=256: seconds); the default is the seed's full protocol
(11483 calls at H=5376, batches up to 131072 rows: minutes on a GPU, far longer on a CPU).

    from adaln_lab.testing import assert_batch_invariant

    def test_my_kernel_is_batch_invariant():
        assert_batch_invariant(my_kernel, device="cuda", quick=True)  # small sizes, seconds
        assert_batch_invariant(my_kernel, device="cuda")            # the seed's full protocol

`my_kernel(x, norm_weight, temb, weight, bias, timestep_indices) -> out` must be differentiable by
torch autograd (shapes as in `adaln_lab.final_adaln_out`). The assertion runs the three row checks
and the parameter-gradient repeatability check of `adaln_lab.harness.invariance` and fails with
every nonzero count and the first failing comparisons. It prints an estimate of the work up
front and tqdm progress bars while it runs, on stderr (`pytest -s` shows them).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from .harness.protocol import FULL, QUICK, invariance_calls
from .harness.report import batch_invariance


def estimate(protocol, quick: bool, device) -> str:
    """The up-front line: how much work this call is, and how to make it small."""
    calls = invariance_calls(protocol)
    shape = f"H={protocol.H}, D={protocol.D}, T={protocol.T}, batches up to {protocol.full_batch} rows"
    if quick:
        return f"assert_batch_invariant: quick protocol on {device}: ~{calls} calls ({shape}), seconds"
    return (f"assert_batch_invariant: full protocol on {device}: ~{calls} calls ({shape}); minutes on a GPU, "
            f"far longer on a CPU; quick=True runs {invariance_calls(QUICK)} small calls in seconds")


def assert_batch_invariant(fn, *, device="cpu", quick: bool = False, H: int | None = None,
                           D: int | None = None, T: int | None = None) -> dict:
    """Raise AssertionError unless `fn` is bitwise batch-invariant; return the check's report.

    quick=True: small sizes (H=256, D=128, batches up to 512 rows, 392 calls), seconds; try this
    first. quick=False (default): the seed's full protocol, 11483 calls at H=5376 with batches up
    to 131072 rows, minutes on a GPU and far longer on a CPU. An estimate line and progress bars
    go to stderr. H, D, T override the protocol's shapes.
    """
    protocol = QUICK if quick else FULL
    protocol = dataclasses.replace(protocol, **{k: v for k, v in (("H", H), ("D", D), ("T", T)) if v is not None})
    print(estimate(protocol, quick, device), file=sys.stderr, flush=True)
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
