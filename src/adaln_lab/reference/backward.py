"""The analytic backward of every op, written once: the ops' torch kernels (CPU, and CUDA inputs the kernels
do not take) are these functions.

Each is the exact derivative of the unrounded function at the given inputs (the forward's roundings, of
`1 + scale` and of the normalised rows, left out: the float64 golden's derivative), with the formulas of
the CUDA kernels: per row in the compute dtype c = promote_types(x.dtype, float32),

    xhat = x * rstd,  g = dy * (1 + scale[i]) * norm_weight,  dx = rstd * (g - xhat * mean(g * xhat))

(dx of a row depends on that row only), and the parameter sums in float64, rows in order into their table
row, then table rows in order, rounded once:

    d_shift[r] = sum_{i(s)=r} dy,   d_scale[r] = norm_weight * sum_{i(s)=r} dy * xhat,
    d_norm_weight = sum_r (1 + scale[r]) * sum_{i(s)=r} dy * xhat,
    d_weight = d_table^T @ silu(temb),  d_bias = sum_t d_table[t],  d_temb = (d_table @ weight) * silu'(temb),
    d_gate[r] = sum_{i(s)=r} dout * y,  d_y = dout * gate[i].

Shapes: x, dy (..., S, H); row_index (S,) int64 in [0, R), row s of every leading index uses table row
row_index[s]; shift, scale, gate (R, H); rstd (rows,) with rows = x.numel() / H; temb (T, D); weight (N, D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_F64 = torch.float64


def rows_index(row_index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The table row of each of the x.numel() / H rows of x (row_index repeated over the leading dims)."""
    S, H = x.shape[-2], x.shape[-1]
    return row_index.repeat(x.numel() // H // S) if S else row_index


_NARROW = frozenset((torch.bfloat16, torch.float16, torch.float32))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the per-row sums run in: promote_types(x.dtype, float32)."""
    return torch.float32 if x.dtype in _NARROW else torch.promote_types(x.dtype, torch.float32)


def rstd_of(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) per row, (rows,) in compute_dtype(x)."""
    xc = x.to(compute_dtype(x)).reshape(-1, x.shape[-1])
    return torch.rsqrt(xc.pow(2).mean(dim=-1) + eps)


def modulated_rms_norm_backward(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None):
    """(dx (x's shape and dtype), d_norm_weight (H,), d_shift (R, H), d_scale (R, H)) in their inputs' dtypes;
    with d_residual (x's shape) dx is the norm's dx plus d_residual, added in x's dtype as autograd adds."""
    H, R = x.shape[-1], shift.shape[0]
    c = rstd.dtype
    idx = rows_index(row_index, x)
    xc, dyc = x.to(c).reshape(-1, H), dy.to(c).reshape(-1, H)
    xhat = xc * rstd[:, None]
    g = dyc * (1.0 + scale.to(c)).index_select(0, idx) * norm_weight.to(c)
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    a = torch.zeros(R, H, dtype=_F64, device=x.device).index_add_(0, idx, (dyc * xhat).to(_F64))
    b = torch.zeros(R, H, dtype=_F64, device=x.device).index_add_(0, idx, dyc.to(_F64))
    d_scale = norm_weight.to(_F64) * a
    d_norm_weight = ((1.0 + scale.to(_F64)) * a).sum(0)
    dx = dx.to(x.dtype).reshape(x.shape).contiguous()
    if d_residual is not None:
        dx = dx + d_residual.to(x.dtype)
    return dx, d_norm_weight.to(norm_weight.dtype), b.to(shift.dtype), d_scale.to(scale.dtype)


def table_weight_grad(d_table, temb) -> torch.Tensor:
    """d_weight (N, D) in float64 = d_table^T silu(temb) from d_table (T, N) and temb (T, D) (the SiLU output
    unrounded)."""
    return d_table.to(_F64).T @ F.silu(temb.to(_F64))


def modulation_table_backward(d_table, temb, weight, bias_dtype: torch.dtype):
    """(d_temb (T, D), d_weight (N, D), d_bias (N,)) in temb's, weight's and bias_dtype, from d_table (T, N).
    The SiLU output is used unrounded (straight-through the declared cast to weight's dtype)."""
    d_table64, temb64 = d_table.to(_F64), temb.to(_F64)
    d_weight = table_weight_grad(d_table64, temb64)
    sig = torch.sigmoid(temb64)
    d_temb = (d_table64 @ weight.to(_F64)) * sig * (1.0 + temb64 * (1.0 - sig))
    return d_temb.to(temb.dtype), d_weight.to(weight.dtype), d_table64.sum(0).to(bias_dtype)


def gated_residual_backward(dout, gate, y, row_index, table_dtype):
    """(d_gate (R, H) in gate's dtype, d_y (y's shape and dtype)); gate is cast to table_dtype as the forward."""
    H, R = y.shape[-1], gate.shape[0]
    c = torch.promote_types(torch.promote_types(dout.dtype, y.dtype), torch.promote_types(gate.dtype, torch.float32))
    idx = rows_index(row_index, y)
    doutc = dout.to(c).reshape(-1, H)
    d_y = (doutc * gate.to(table_dtype).to(c).index_select(0, idx)).to(y.dtype).reshape(y.shape).contiguous()
    d_gate = torch.zeros(R, H, dtype=_F64, device=y.device).index_add_(0, idx, doutc.to(_F64) * y.reshape(-1, H).to(_F64))
    return d_gate.to(gate.dtype), d_y


def final_adaln_out_backward(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd):
    """(dx, d_norm_weight, d_temb, d_weight, d_bias) of norm_out: the modulated norm's backward on the table's
    shift | scale halves (T, 2H) fp32, then the table's; d_table is rounded to float32 between, as the kernels."""
    H = x.shape[-1]
    dx, d_norm_weight, d_shift, d_scale = modulated_rms_norm_backward(
        dy, x, norm_weight, table_f32[:, :H], table_f32[:, H:], timestep_indices, rstd)
    d_table = torch.cat([d_shift, d_scale], dim=-1)
    d_temb, d_weight, d_bias = modulation_table_backward(d_table, temb, weight, weight.dtype)
    return dx, d_norm_weight, d_temb, d_weight, d_bias
