"""The modulated RMSNorm's two launch ops, writing outputs the caller allocated (`core.library.library_op`):

    forward(x, norm_weight, shift, scale, row_index, eps, table_dtype, route, row_tables, which, out, rstd)
    backward(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, order, route, dx, d_norm_weight,
             d_table, column, partials)

Shapes: x, out, dy, dx, d_residual (..., S, H); norm_weight, d_norm_weight (H,); shift, scale (R, H) (any strides,
float32 holding `table_dtype` values); row_index (S,) int64; rstd (rows,); row_tables: None, or a block's bf16 row
tables (2, R, 2H) of which table `which` holds shift | scale (written by the table kernel, read in place of a cast);
order: None, or `row_order(row_index, R, H)`; d_table (R, W) with d_shift at columns [column, column + H) and d_scale
at [column + H, column + 2H) (an op's own (R, 2H), or a block's table gradient viewed (3T, 6H)). With d_residual, dx
is the norm's dx plus d_residual, added in x's dtype as autograd adds. partials: None, or float32 scratch for the
sorted pass's partial sums (a block's, after its table gradient: `core.table_gradient.partials_of`).

    backward_exact(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, order, dx) -> (state, flags)

route "cupy": norm_modulate.cu forward; backward the sorted row pass (the residual summed in it where three rows fit
its stages, else torch's bf16 add: the same bits) and the reduce of its partials, in table-row order, every sum in a
fixed order. route "torch": diffusers' replay and the exact derivative (`reference.backward`: per row in float32, the
parameter sums in float64 in a fixed order, rounded once). backward_exact (a block's norm inside ExactGradients, route
"cupy", eager): the same dx from the sorted row pass with its column sums kept as exact integers (exact_row_pass.cu).
"""

from __future__ import annotations

import torch

from ...core import launchers, tensors
from ...core.exact import ExactSum
from ...core.exact_kernels import ExactKernels
from ...core.library import library_op
from ...reference.backward import modulated_rms_norm_backward, rstd_of
from ...reference.block import replay_modulated_rms_norm
from .. import row_sums
from ..row_order import row_order


@library_op("adaln_lab::modulated_rms_norm_fwd", mutates_args=("out", "rstd"))
def forward(x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
            row_index: torch.Tensor, eps: float, table_dtype: torch.dtype, route: str,
            row_tables: torch.Tensor | None, which: int, out: torch.Tensor, rstd: torch.Tensor) -> None:
    """out (..., S, H) and rstd (rows,) (module docstring)."""
    if route != "cupy":
        out.copy_(replay_modulated_rms_norm(x, norm_weight, shift.to(table_dtype), scale.to(table_dtype), row_index,
                                            eps))
        rstd.copy_(rstd_of(x, eps))
        return
    plan, rows, k, stream = tensors.row_setup(x, shift.shape[0])
    (x, norm_weight), at = tensors.aligned_addresses(x, norm_weight)
    row_index = row_index.contiguous()
    table = tensors.shift_scale_bf16(shift, scale) if row_tables is None else None
    table_ptr = table.data_ptr() if row_tables is None else tensors.row_table_address(shift, (row_tables, which))
    launchers.launch_norm_modulate(k, plan, rows, stream, at[0], at[1], table_ptr, row_index.data_ptr(),
                                   out.data_ptr(), rstd.data_ptr(), x.shape[-2], eps)


@library_op("adaln_lab::modulated_rms_norm_bwd", mutates_args=("dx", "d_norm_weight", "d_table", "partials"))
def backward(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
             row_index: torch.Tensor, rstd: torch.Tensor, d_residual: torch.Tensor | None, order: torch.Tensor | None,
             route: str, dx: torch.Tensor, d_norm_weight: torch.Tensor, d_table: torch.Tensor, column: int,
             partials: torch.Tensor | None) -> None:
    """dx, d_norm_weight, and d_shift | d_scale into d_table's columns (module docstring); partials: None or float32
    scratch of at least `tensors.row_partials_floats` floats (else one allocation here)."""
    R, H = shift.shape
    if route != "cupy":
        grads = modulated_rms_norm_backward(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual)
        dx.copy_(grads[0]), d_norm_weight.copy_(grads[1])
        d_table[:, column:column + H].copy_(grads[2]), d_table[:, column + H:column + 2 * H].copy_(grads[3])
        return
    plan, rows, k, stream = tensors.row_setup(x, R)
    (dy, x, norm_weight), at = tensors.aligned_addresses(dy, x, norm_weight)
    table_f32, table_stride = tensors.shift_scale(shift, scale)
    table_at = table_f32.data_ptr()
    row_index, rstd = row_index.contiguous(), rstd.contiguous()
    order = row_order(row_index, R, H) if order is None else order.contiguous()
    order_at = order.data_ptr()
    fused = d_residual is not None and plan.bwd_res_stages > 0
    d_residual = tensors.aligned(d_residual) if fused else d_residual
    slots = launchers.sorted_slots(plan, rows)
    # the row partials, and after them room for the reduce's d_bias output (2H bf16), which the blocks do not use
    partials = tensors.scratch(partials, tensors.partials_floats(plan, rows), x.device)
    workspace = partials.data_ptr()
    S = x.shape[-2]
    launchers.launch_sorted_row_pass(k, plan, rows, stream, at[0], at[1], rstd.data_ptr(), at[2], table_at,
                                     row_index.data_ptr(), order_at, dx.data_ptr(), workspace, S,
                                     d_residual.data_ptr() if fused else 0, table_stride)
    d_shift = d_table.data_ptr() + 4 * column
    launchers.launch_reduce_sorted_partials(k, plan, rows, stream, workspace, at[2], table_at, d_shift, d_shift + 4 * H,
                                            d_norm_weight.data_ptr(), workspace + 4 * slots * 2 * H, order_at, S,
                                            table_stride, d_table.stride(0))
    if d_residual is not None and not fused:  # a row too wide for three staged inputs: torch's bf16 add, same bits
        dx.add_(d_residual)


def backward_exact(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor,
                   scale: torch.Tensor, row_index: torch.Tensor, rstd: torch.Tensor, d_residual: torch.Tensor | None,
                   order: torch.Tensor | None, dx: torch.Tensor) -> tuple[ExactSum, torch.Tensor]:
    """Route "cupy" inside ExactGradients (eager): dx as `backward` writes it, and instead of the parameter
    gradients the exact sums of its row pass (`ops.row_sums`: B | A (R, 2H), from norm_modulate_bwd_(residual_)
    sorted_exact_bf16 in the same read of x and dy, and exact_fixup_sorted_bf16 where plan.exact_row_double)
    with the kernels' flags (1,) int32."""
    R, H = shift.shape
    plan, rows, k, stream = tensors.row_setup(x, R)
    row_sums.check_rows(rows.rows, "modulated_rms_norm")
    (dy, x, norm_weight), at = tensors.aligned_addresses(dy, x, norm_weight)
    table_f32, table_stride = tensors.shift_scale(shift, scale)
    row_index, rstd = row_index.contiguous(), rstd.contiguous()
    order = row_order(row_index, R, H) if order is None else order.contiguous()
    fused = d_residual is not None and plan.bwd_res_stages > 0
    d_residual = tensors.aligned(d_residual) if fused else d_residual
    limbs, flags, fixups = row_sums.pass_buffers(plan, rows, True, x.device)
    row_sums.launch_sorted_row_sums(k, plan, rows, stream, at[0], at[1], rstd.data_ptr(), at[2],
                                    table_f32.data_ptr(), row_index.data_ptr(), order.data_ptr(), dx.data_ptr(),
                                    limbs.data_ptr(), flags.data_ptr(), fixups.data_ptr(), x.shape[-2],
                                    d_residual.data_ptr() if fused else 0, table_stride)
    state = ExactSum.from_limbs(limbs, kernels=ExactKernels(k, x.device.index)).carried()
    if d_residual is not None and not fused:
        dx.add_(d_residual)
    return state, flags[:1]
