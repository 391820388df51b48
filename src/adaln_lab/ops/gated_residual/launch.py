"""The gated residual's two launch ops, writing outputs the caller allocated (`core.library.library_op`):

    forward(x, gate, y, row_index, table_dtype, route, out)
    backward(dout, gate, y, row_index, order, table_dtype, route, d_y, d_table, column, partials)

Shapes: x, y, out, dout, d_y (..., S, H); gate (R, H) (any strides, float32 holding `table_dtype` values); row_index
(S,) int64; order: None, or `row_order(row_index, R, H)`; d_table (R, W) with d_gate at columns [column, column + H)
(an op's own (R, H), or a block's table gradient viewed (3T, 6H)); partials: None, or float32 scratch for the
sorted pass's partial sums (`core.tensors.partials_floats(..., gate=True)` floats, 16-byte aligned; else the launch
allocates its own). The residual's gradient is dout itself (the op's Function hands it on).

route "cupy": gated_residual.cu forward; backward its sorted pass (d_y per row; d_gate per table row, ordered
per-range sums reduced in a fixed order). route "torch": diffusers' replay (the product rounded, then the sum) and
the exact derivative (`reference.backward.gated_residual_backward`: d_gate in float64, rows in order, rounded once).
backward_exact(dout, gate, y, row_index, order, d_y) -> (state, flags) (a block's gate inside ExactGradients, route
"cupy", eager): the same d_y from the sorted pass with the gate's sums kept as exact integers (exact_row_pass.cu).
"""

from __future__ import annotations

import torch

from ...core import launchers, tensors
from ...core.exact import ExactSum
from ...core.exact_kernels import ExactKernels
from ...core.library import library_op
from ...reference.backward import gated_residual_backward
from ...reference.block import replay_gated_residual
from .. import row_sums
from ..row_order import row_order


@library_op("adaln_lab::gated_residual_fwd", mutates_args=("out",))
def forward(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor, table_dtype: torch.dtype,
            route: str, out: torch.Tensor) -> None:
    """out (..., S, H) = x + gate[row_index] * y (module docstring)."""
    if route != "cupy":
        out.copy_(replay_gated_residual(x, gate.to(table_dtype), y, row_index))
        return
    plan, rows, k, stream = tensors.row_setup(x, gate.shape[0])
    (x, y), at = tensors.aligned_addresses(x, y)
    row_index = row_index.contiguous()
    gate, stride = tensors.gate_pointer(gate)
    launchers.launch_gated_residual(k, plan, rows, stream, at[0], gate.data_ptr(), at[1], row_index.data_ptr(),
                                    out.data_ptr(), stride, x.shape[-2])


@library_op("adaln_lab::gated_residual_bwd", mutates_args=("d_y", "d_table", "partials"))
def backward(dout: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor,
             order: torch.Tensor | None, table_dtype: torch.dtype, route: str, d_y: torch.Tensor,
             d_table: torch.Tensor, column: int, partials: torch.Tensor | None) -> None:
    """d_y, and d_gate into d_table's columns (module docstring); partials: None or float32 scratch of at least
    the sorted pass's slots x H floats (else one allocation here)."""
    R, H = gate.shape
    if route != "cupy":
        d_gate, grad_y = gated_residual_backward(dout, gate, y, row_index, table_dtype)
        d_y.copy_(grad_y), d_table[:, column:column + H].copy_(d_gate)
        return
    plan, rows, k, stream = tensors.row_setup(y, R)
    (dout, y), at = tensors.aligned_addresses(dout, y)
    row_index = row_index.contiguous()
    order = row_order(row_index, R, H) if order is None else order.contiguous()
    gate, stride = tensors.gate_pointer(gate)
    partials = tensors.scratch(partials, tensors.partials_floats(plan, rows, gate=True), y.device)
    launchers.launch_gated_residual_bwd(k, plan, rows, stream, at[0], gate.data_ptr(), at[1], row_index.data_ptr(),
                                        order.data_ptr(), d_y.data_ptr(), partials.data_ptr(),
                                        d_table.data_ptr() + 4 * column, stride, y.shape[-2], d_table.stride(0))


def backward_exact(dout: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor,
                   order: torch.Tensor | None, d_y: torch.Tensor) -> tuple[ExactSum, torch.Tensor]:
    """Route "cupy" inside ExactGradients (eager): d_y as `backward` writes it, and instead of d_gate the exact sums
    of dout y a table row (an ExactSum (R, H); gated_residual_bwd_sorted_exact_bf16, the same read of dout and y, and
    exact_fixup_gates_bf16 where plan.exact_row_double) with the kernel's flags (1,) int32."""
    R, H = gate.shape
    plan, rows, k, stream = tensors.row_setup(y, R)
    row_sums.check_rows(rows.rows, "gated_residual")
    (dout, y), at = tensors.aligned_addresses(dout, y)
    row_index = row_index.contiguous()
    order = row_order(row_index, R, H) if order is None else order.contiguous()
    gate, stride = tensors.gate_pointer(gate)
    limbs, flags, fixups = row_sums.pass_buffers(plan, rows, True, y.device, H)
    if rows.rows:
        capacity, per, S = row_sums.fixup_capacity(plan, rows, True), rows.bwd_rows_per_range, y.shape[-2]
        k["gated_residual_bwd_sorted_exact_bf16"]((rows.bwd_ranges, -(-H // (8 * plan.gr_threads)), 1),
                                                  (plan.gr_threads, 1, 1), 0, stream, at[0], gate.data_ptr(), at[1],
                                                  row_index.data_ptr(), order.data_ptr(), d_y.data_ptr(),
                                                  limbs.data_ptr(), flags.data_ptr(), fixups.data_ptr(), stride, S,
                                                  rows.rows, per, capacity)
        row_sums.launch_fixups(k, plan, stream, "exact_fixup_gates_bf16", capacity, at[0], at[1],
                               row_index.data_ptr(), order.data_ptr(), fixups.data_ptr(), flags.data_ptr(),
                               limbs.data_ptr(), S, rows.rows, per)
    return ExactSum.from_limbs(limbs, kernels=ExactKernels(k, y.device.index)).carried(), flags[:1]
