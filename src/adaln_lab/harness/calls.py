"""One differentiated call of a candidate: the unit every check of the harness is built from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .candidates import callable_name
from .inputs import LEAVES, Inputs


@dataclass
class Result:
    """Forward output (..., S, H) and the gradients of the five leaves, keyed by `LEAVES` name."""

    out: torch.Tensor
    grads: dict[str, torch.Tensor]


class CandidateOutputError(TypeError):
    """A candidate's output is not a differentiable tensor of x's shape; the message names the candidate."""


def check_output(fn, out, x: torch.Tensor, backward: bool) -> None:
    """Raise CandidateOutputError (a TypeError), naming the candidate and what it returned, unless `out`
    is a tensor of x's shape (..., S, H) that, when `backward`, requires grad (autograd can differentiate
    it)."""
    name = callable_name(fn)
    if not isinstance(out, torch.Tensor):
        kind = type(out).__name__
        detail = f" of {len(out)}" if isinstance(out, (tuple, list)) else ""
        raise CandidateOutputError(f"candidate {name} returned a {kind}{detail}, not a tensor: a candidate returns "
                                   f"the output alone, a tensor of x's shape {tuple(x.shape)} (..., S, H)")
    if out.shape != x.shape:
        raise CandidateOutputError(f"candidate {name} returned a tensor of shape {tuple(out.shape)}; it must have "
                                   f"x's shape {tuple(x.shape)} (..., S, H)")
    if backward and not out.requires_grad:
        raise CandidateOutputError(f"candidate {name} returned a tensor that does not require grad (computed under "
                                   "no_grad, detached, or through a non-differentiable op): the harness differentiates "
                                   "every candidate with torch autograd; wrap a custom kernel in a "
                                   "torch.autograd.Function")


def forward_backward(fn, inputs: Inputs, dy: torch.Tensor | None) -> Result:
    """Run `fn` on fresh leaf copies that require grad; backward with `dy` (x's shape) unless it is None.

    Raises CandidateOutputError, a TypeError (`check_output`), when the output is not a differentiable
    tensor of x's shape. A leaf the candidate does not use gets a zero gradient (what autograd means by none)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    out = fn(*leaves, inputs.timestep_indices)
    check_output(fn, out, inputs.x, dy is not None)
    if dy is None:
        return Result(out.detach(), {})
    try:
        out.backward(dy)
    except RuntimeError as error:
        error.add_note(f"(in the backward of candidate {callable_name(fn)})")
        raise
    grads = {name: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
             for name, leaf in zip(LEAVES, leaves)}
    return Result(out.detach(), grads)
