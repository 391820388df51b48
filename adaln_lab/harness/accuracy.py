"""Accuracy of any candidate: max|err| / max|ref| against the float64 `pure` golden.

The upstream gradient is randn in the output dtype (`inputs.upstream`); the golden is the op in
float64 on the upcast inputs with no rounding at all (`reference.golden(flavour="pure")`).
"""

from __future__ import annotations

import torch

from ..reference import golden
from .calls import forward_backward
from .inputs import LEAVES, Inputs

GRAD_KEYS = {"x": "x", "norm_weight": "nw", "temb": "temb", "weight": "w", "bias": "b"}


def rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    """max|value - ref| / max|ref|, in float64."""
    ref = ref.to(torch.float64)
    return float((value.to(torch.float64) - ref).abs().max() / ref.abs().max())


def golden_result(inputs: Inputs, dy: torch.Tensor, flavour: str = "pure"):
    """Output and the five gradients of the float64 golden (each float64)."""
    leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in inputs.leaves]
    if flavour == "declared":  # the golden rounds at the projection dtype itself: pass that dtype in
        leaves[3] = inputs.weight.detach().clone().requires_grad_(True)
        leaves[4] = inputs.bias.detach().clone().requires_grad_(True)
    out = golden(*leaves, inputs.timestep_indices, flavour=flavour)
    out.backward(dy.to(torch.float64))
    return out.detach(), {name: leaf.grad for name, leaf in zip(LEAVES, leaves)}


def accuracy(fn, inputs: Inputs, dy: torch.Tensor) -> dict:
    """`fwd_rel_err` and `grad_rel_err` (keys x, nw, temb, w, b) of candidate `fn`."""
    result = forward_backward(fn, inputs, dy)
    ref_out, ref_grads = golden_result(inputs, dy)
    return {
        "fwd_rel_err": rel_err(result.out, ref_out),
        "grad_rel_err": {key: rel_err(result.grads[name], ref_grads[name]) for name, key in GRAD_KEYS.items()},
    }


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two tensors of one 16-bit float dtype (int64)."""
    if a.dtype != b.dtype or a.element_size() != 2:
        raise TypeError(f"ulp_distance needs two tensors of one 16-bit dtype, got {a.dtype} and {b.dtype}")

    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def parity(fn, baseline, inputs: Inputs) -> dict:
    """How far `fn`'s forward is from `baseline`'s: bitwise-equal fraction and max ulp distance."""
    with torch.no_grad():
        out, ref = fn(*inputs.args), baseline(*inputs.args)
    ulps = ulp_distance(out, ref)
    return {"bitwise_equal_fraction": float((ulps == 0).double().mean()), "max_ulp": int(ulps.max()),
            "within_1_ulp_fraction": float((ulps <= 1).double().mean())}
