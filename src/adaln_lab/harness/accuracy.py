"""Accuracy of any candidate: max|err| / max|ref| against the float64 `pure` golden.

The upstream gradient is randn in the output dtype (`inputs.upstream`); the golden is the op in
float64 on the upcast inputs with no rounding at all (`reference.golden(flavour="pure")`).
"""

from __future__ import annotations

import torch

from ..reference.final_adaln_out import golden, table_reference
from .calls import forward_backward
from .inputs import LEAVES, Inputs

GRAD_KEYS = {"x": "x", "norm_weight": "nw", "temb": "temb", "weight": "w", "bias": "b"}
# The seed report's rl_kernel gradient errors (the smaller of its two sizes): the bounds adaln_lab's GPU
# tests and adaln_lab/bench/sweep.py hold every kernel version to. d_bias is held to being correctly rounded.
SEED_GRAD_BOUNDS = {"x": 0.0051, "nw": 0.0036, "temb": 0.0010, "w": 0.0038}


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
    """`fwd_rel_err`, `grad_rel_err` and `grad_correctly_rounded` (keys x, nw, temb, w, b) of `fn`."""
    result = forward_backward(fn, inputs, dy)
    ref_out, ref_grads = golden_result(inputs, dy)
    return {
        "fwd_rel_err": rel_err(result.out, ref_out),
        "grad_rel_err": {key: rel_err(result.grads[name], ref_grads[name]) for name, key in GRAD_KEYS.items()},
        "grad_correctly_rounded": {key: correctly_rounded(result.grads[name], ref_grads[name])
                                   for name, key in GRAD_KEYS.items()},
    }


def correctly_rounded(value: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of elements equal to the float64 reference rounded once to value's dtype.

    For a gradient stored in bf16 this is the best any implementation can do: its rel_err is then
    the rounding of the exact gradient alone.
    """
    return float((value == ref.to(value.dtype)).double().mean())


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two tensors of one 16-bit float dtype (int64)."""
    if a.dtype != b.dtype or a.element_size() != 2:
        raise TypeError(f"ulp_distance needs two tensors of one 16-bit dtype, got {a.dtype} and {b.dtype}")

    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def bf16_ulp(magnitude: torch.Tensor) -> torch.Tensor:
    """The bf16 ulp at |magnitude| (float64): 2^(exponent - 7), subnormals floored at 2^-133."""
    exponent = torch.floor(torch.log2(magnitude.clamp_min(2.0 ** -126)))
    return torch.exp2(exponent - 7)


def parity(fn, baseline, inputs: Inputs) -> dict:
    """How far `fn`'s forward is from `baseline`'s (bf16 outputs).

    - `bitwise_equal_fraction`, `within_1_ulp_fraction`, `max_ulp`: distances counted in ulps of
      the output itself. Where `p + shift` cancels, a 1-ulp difference of `p` is many ulps of
      the small result, so `max_ulp` can be large while the arithmetic differs by one rounding.
    - `max_operand_ulp`: the largest difference in ulps of the final add's largest operand,
      max(|out|, |out - shift|), with the baseline's shift row (bf16 table of F.linear).
    """
    with torch.no_grad():
        out, ref = fn(*inputs.args), baseline(*inputs.args)
        shift = table_reference(inputs.temb, inputs.weight, inputs.bias).chunk(2, dim=-1)[0]
        shift = shift.index_select(0, inputs.timestep_indices).to(torch.float64)
    ulps = ulp_distance(out, ref)
    ref64 = ref.to(torch.float64)
    operand = torch.maximum(ref64.abs(), (ref64 - shift).abs())
    operand_ulps = (out.to(torch.float64) - ref64).abs() / bf16_ulp(operand)
    return {"bitwise_equal_fraction": float((ulps == 0).double().mean()), "max_ulp": int(ulps.max()),
            "within_1_ulp_fraction": float((ulps <= 1).double().mean()),
            "max_operand_ulp": float(operand_ulps.max())}
