"""The first gated residual and the second modulated norm of an H3 block as one pair of launch ops, writing outputs
the caller allocated (`core.library.library_op`):

    forward(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, route, row_tables, x_out, out, rstd)
    backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, order, table_dtype, route,
             dx, d_y, d_norm_weight, d_table, column, partials)

Shapes as the two ops' (`..gated_residual.launch`, `..modulated_rms_norm.launch`); d_table (R, W) takes d_gate |
d_shift | d_scale at columns [column, column + 3H). route "cupy": the forward is one kernel (gated_residual_norm.cu),
the backward the norm's sorted row pass summing d_x_out in (norm_modulate_bwd_residual_sorted_bf16) then the gated
residual's; any other route is "<gated residual's route>+<norm's route>": the two ops' launch bodies one after the
other, each on its own route. Every output and gradient has the bits of the two ops run one after the other, the
residual gradient added as autograd's add rounds it, bf16(bf16(norm dx) + d_x_out).
"""

from __future__ import annotations

import torch

from ...core import launchers, tensors
from ...core.library import library_op
from ..gated_residual import launch as residual
from ..modulated_rms_norm import launch as norm
from ..row_order import row_order

# the two ops' launch bodies, called from inside this op's (already past the eager/compiled switch)
_residual_forward, _residual_backward = residual.forward.body, residual.backward.body
_norm_forward, _norm_backward = norm.forward.body, norm.backward.body


def parts(route: str) -> tuple[str, str]:
    """(the gated residual's route, the norm's route) of a route."""
    return ("cupy", "cupy") if route == "cupy" else tuple(route.split("+"))


@library_op("adaln_lab::gated_residual_norm_fwd", mutates_args=("x_out", "out", "rstd"))
def forward(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor, norm_weight: torch.Tensor,
            shift: torch.Tensor, scale: torch.Tensor, eps: float, table_dtype: torch.dtype, route: str,
            row_tables: torch.Tensor | None, x_out: torch.Tensor, out: torch.Tensor, rstd: torch.Tensor) -> None:
    """x_out = x + gate[row_index] * y, out = the modulated norm of x_out, rstd (module docstring)."""
    if route != "cupy":
        residual_route, norm_route = parts(route)
        _residual_forward(x, gate, y, row_index, table_dtype, residual_route, x_out)
        _norm_forward(x_out, norm_weight, shift, scale, row_index, eps, table_dtype, norm_route, None, 0, out, rstd)
        return
    plan, rows, k, stream = tensors.row_setup(x, shift.shape[0])
    (x, y, norm_weight), at = tensors.aligned_addresses(x, y, norm_weight)
    row_index = row_index.contiguous()
    gate, stride = tensors.gate_pointer(gate)
    table = tensors.shift_scale_bf16(shift, scale) if row_tables is None else None
    table_ptr = table.data_ptr() if row_tables is None else tensors.row_table_address(shift, (row_tables, 1))
    launchers.launch_gated_residual_norm(k, plan, rows, stream, at[0], gate.data_ptr(), at[1], row_index.data_ptr(),
                                         at[2], table_ptr, x_out.data_ptr(), out.data_ptr(), rstd.data_ptr(), stride,
                                         x.shape[-2], eps)


@library_op("adaln_lab::gated_residual_norm_bwd",
            mutates_args=("dx", "d_y", "d_norm_weight", "d_table", "partials"))
def backward(d_x_out: torch.Tensor, d_out: torch.Tensor, x_out: torch.Tensor, gate: torch.Tensor, y: torch.Tensor,
             row_index: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
             rstd: torch.Tensor, order: torch.Tensor | None, table_dtype: torch.dtype, route: str, dx: torch.Tensor,
             d_y: torch.Tensor, d_norm_weight: torch.Tensor, d_table: torch.Tensor, column: int,
             partials: torch.Tensor | None) -> None:
    """dx (in x's dtype), d_y, d_norm_weight, and d_gate | d_shift | d_scale into d_table's columns; partials: the
    scratch of the norm's pass and then of the gated residual's, the same memory used by each in turn (the norm's
    size, `core.tensors.partials_floats`)."""
    residual_route, norm_route = parts(route)
    H = x_out.shape[-1]
    if order is None and route == "cupy":  # one sort for the two passes
        order = row_order(row_index.contiguous(), shift.shape[0], H)
    d_norm = dx if dx.dtype == x_out.dtype else torch.empty_like(x_out)
    _norm_backward(d_out, x_out, norm_weight, shift, scale, row_index, rstd, tensors.as_dtype(d_x_out, x_out.dtype),
                   order, norm_route, d_norm, d_norm_weight, d_table, column + H, partials)
    _residual_backward(d_norm, gate, y, row_index, order, table_dtype, residual_route, d_y, d_table, column, partials)
    if d_norm is not dx:
        dx.copy_(d_norm)
