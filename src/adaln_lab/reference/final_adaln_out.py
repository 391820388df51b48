"""Ground truth for `final_adaln_out`: the diffusers forward replayed op for op, and float64 goldens.

Shapes everywhere: x (..., S, H), norm_weight (H,), temb (T, D), weight (2H, D), bias (2H,),
timestep_indices (S,) int64 in [0, T); output (..., S, H) in x's dtype.

- `replay`: the very ops of diffusers 0.42 `MiniMaxH3AdaLayerNormOut.forward`, same order, same
  dtypes: SiLU at temb's precision, one cast to the projection dtype, `F.linear` (table in the
  projection dtype), `F.rms_norm` (rounds once to x's dtype; `rms_norm`), then `1 + scale`, the product and
  `+ shift`, each rounded to the stream dtype. Its backward is torch's, atomics included.
- `golden(..., flavour="pure")`: the same function in float64 on the upcast inputs, no rounding
  anywhere. This is the seed report's accuracy reference.
- `golden(..., flavour="declared")`: float64 too, but rounding where the module declares a dtype
  boundary: the SiLU output cast and the table (both to the projection dtype), straight-through
  for gradients (the rounding is treated as the identity by autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def table_reference(temb, weight, bias):
    """The modulation table `linear(silu(temb).to(weight.dtype))`, shape (T, 2H), as diffusers computes it."""
    return F.linear(F.silu(temb).to(weight.dtype), weight, bias)


def table_from_torch(temb, weight, bias):
    """(table (T, 2H) in weight's dtype, table_f32 (T, 2H)): the table by F.linear (cuBLAS), diffusers' bits, and its
    fp32 twin: the same sums unrounded (as table.cu's table_f32), which the backward uses."""
    act = F.silu(temb).to(weight.dtype)
    return F.linear(act, weight, bias), F.linear(act.float(), weight.float(), bias.float())


def table_rows(temb, weight, bias):
    """`table_reference` one temb row at a time: each row's bits are those of a batch of that row alone, whatever
    the other rows (F.linear's on a CPU can depend on T). The exact-gradient paths' table."""
    return torch.cat([table_reference(temb[t:t + 1], weight, bias) for t in range(temb.shape[0])])


def rms_norm(x, norm_weight, eps: float):
    """`F.rms_norm(x, (H,), norm_weight, eps)`, bit for bit (values and gradients): (..., S, H) in x's dtype.

    For a norm_weight of another dtype than x (say layerwise casting's fp16 x with bf16 parameters), torch
    skips its fused kernel for a composite of the ops below, and says so once per process with a UserWarning
    from its internals ("Mismatch dtype between input and weight ... Cannot dispatch to fused implementation").
    Here that composite is called directly: same ops, same order, same bits, no warning
    (tests/reference/test_rms_norm.py pins the equality against F.rms_norm)."""
    if norm_weight.dtype == x.dtype:
        return F.rms_norm(x, (x.shape[-1],), norm_weight, eps)
    upcast = x.to(torch.promote_types(x.dtype, torch.float32))  # torch's compute dtype: float32, or float64
    rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True).add_(eps))
    return (upcast * rstd * norm_weight).to(x.dtype)


def replay(x, norm_weight, temb, weight, bias, timestep_indices, eps: float = 1e-5, table=None):
    """diffusers' `MiniMaxH3AdaLayerNormOut.forward`, op for op (see module docstring); `table`: the (T, 2H) table
    to use instead of `table_reference`'s (the exact-gradient path's `table_rows`).

    A timestep index outside [0, T) (negative ones included) raises torch's IndexError ("index out of range
    in self") from `index_select` on CPU tensors, and a device-side assert on CUDA ones."""
    shift, scale = (table_reference(temb, weight, bias) if table is None else table).chunk(2, dim=-1)
    hidden_states = rms_norm(x, norm_weight, eps)
    return hidden_states * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(0, timestep_indices)


def _round_straight_through(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round `value` to `dtype` and back, with the identity as its gradient."""
    return value + (value.to(dtype).to(value.dtype) - value).detach()


def golden(x, norm_weight, temb, weight, bias, timestep_indices, eps: float = 1e-5, *, flavour: str = "pure"):
    """float64 evaluation of the op on the given (already float64 or to-be-upcast) inputs.

    `flavour="pure"` rounds nowhere; `flavour="declared"` rounds the SiLU output and the table to
    `weight`'s dtype *before* upcasting happens to the inputs, i.e. pass the original-dtype
    tensors and this function upcasts them itself. Differentiable: gradients flow to whichever
    inputs require grad, in float64.
    """
    if flavour not in ("pure", "declared"):
        raise ValueError(f"flavour must be 'pure' or 'declared', got {flavour!r}")
    proj_dtype = weight.dtype
    f64 = torch.float64
    x, norm_weight, temb, weight, bias = (t.to(f64) for t in (x, norm_weight, temb, weight, bias))
    act = F.silu(temb)
    if flavour == "declared":
        act = _round_straight_through(act, proj_dtype)
    table = F.linear(act, weight, bias)
    if flavour == "declared":
        table = _round_straight_through(table, proj_dtype)
    shift, scale = table.chunk(2, dim=-1)
    rstd = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = x * rstd * norm_weight
    return normed * (1.0 + scale[timestep_indices]) + shift[timestep_indices]

