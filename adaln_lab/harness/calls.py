"""One differentiated call of a candidate: the unit every check of the harness is built from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .inputs import LEAVES, Inputs


@dataclass
class Result:
    """Forward output (..., S, H) and the gradients of the five leaves, keyed by `LEAVES` name."""

    out: torch.Tensor
    grads: dict[str, torch.Tensor]


def forward_backward(fn, inputs: Inputs, dy: torch.Tensor | None) -> Result:
    """Run `fn` on fresh leaf copies that require grad; backward with `dy` unless it is None."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    out = fn(*leaves, inputs.timestep_indices)
    if dy is None:
        return Result(out.detach(), {})
    out.backward(dy)
    grads = {name: leaf.grad for name, leaf in zip(LEAVES, leaves)}
    return Result(out.detach(), grads)
