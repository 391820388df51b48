"""`gated_residual`: an H3 block's `x + gate[row_index] * y` differentiable.

    out = gated_residual(x (..., S, H), gate (R, H), y (..., S, H), row_index (S,))

Broadcast: row s of every leading index uses table row row_index[s]; y has x's shape (the attention or
feed-forward output). gate is usually a column chunk of `modulation_table`'s float32 table viewed
(3T, 6H) (any strides), holding values of the projection's dtype `table_dtype` (default x's dtype). The
forward casts it back (exact) and replays diffusers: the product `gate[i] * y` rounded to its dtype, then
the sum, so it is diffusers' output bit for bit on the CPU; out has dtype promote_types(x, table_dtype, y).

One way through: `gated_residual` checks the inputs and decides the route once (`core.support.route`: gated_residual.cu
for bf16 x, y and table dtype on CUDA with a width the plan takes; otherwise the torch code, with a warning on CUDA);
the one autograd node `GatedResidual` allocates the outputs and calls the launch ops (`launch`), in eager and compiled
code alike. The residual's gradient is the identity: dout itself is handed on as dx (cast to x's dtype if they
differ), no copy. The torch code replays diffusers forward and takes the exact derivative backward: d_y = dout *
gate[i] (gate in table_dtype as in the forward; one rounding to y's dtype), d_gate[r] = sum_{i(s)=r} dout * y (float64,
rows in order, rounded once to gate's dtype). A block passes its table (the last of its three row ops): d_gate then
goes into the block's table gradient (`core.table_gradient`).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...core import support, table_gradient, tensors
from ...core.checks import BLOCK_BACKENDS, check_option, check_order, check_rows
from ...core.library import apply
from . import launch


class GatedResidual(torch.autograd.Function):
    """forward(x, gate, y, row_index, table_dtype, route, order, table, chunk, sums) -> out; backward(dout) -> dx
    (dout itself, in x's dtype), d_gate (or, where a block passed its table, the table gradient with d_gate in chunk
    `chunk`'s columns, as the table's gradient), d_y. sums: None, or a block's `ops.block.exact.BlockSums` inside
    `adaln_lab.nn.ExactGradients`: the backward adds its rows' exact sums there (`BlockSums.gate`)."""

    @staticmethod
    def forward(ctx, x, gate, y, row_index, table_dtype, route, order, table, chunk, sums):
        dtype = tensors.promoted(x.dtype, table_dtype, y.dtype)
        out = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
        launch.forward(x, gate, y, row_index, table_dtype, route, out)
        ctx.x_dtype, ctx.table_dtype, ctx.route, ctx.chunk, ctx.sums = x.dtype, table_dtype, route, chunk, sums
        ctx.table = None if table is None else (table.shape, table.dtype, table.device)
        ctx.save_for_backward(gate, y, row_index, order)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        gate, y, row_index, order = ctx.saved_tensors
        R, H = gate.shape
        dout = dout.contiguous()
        if ctx.sums is not None and ctx.route == "cupy":  # the pass keeps the gate's exact sums; no d_gate
            d_y = torch.empty_like(y, memory_format=torch.contiguous_format)
            state, flags = launch.backward_exact(dout, gate, y, row_index, order, d_y)
            ctx.sums.add_gate(ctx.chunk, state, flags)
            return tensors.as_dtype(dout, ctx.x_dtype), None, d_y, *(None,) * 7
        if ctx.table is None:
            dtype = torch.float32 if ctx.route == "cupy" else gate.dtype
            d_table, column, partials = table_gradient.standalone(R, H, dtype, y.device), 0, None
        else:
            buffer, partials = table_gradient.for_row_op(None, ctx.table, H, ctx.chunk + 1, ctx.route, y, R)
            d_table, column = table_gradient.columns(buffer, H), ctx.chunk * H
        d_y = torch.empty_like(y, memory_format=torch.contiguous_format)
        launch.backward(dout, gate, y, row_index, order, ctx.table_dtype, ctx.route, d_y, d_table, column,
                        partials)
        if ctx.sums is not None:
            ctx.sums.gate(ctx.chunk, y, dout, row_index, False)  # the torch code's route
        dx = tensors.as_dtype(dout, ctx.x_dtype)
        if ctx.table is None:
            return dx, tensors.as_dtype(d_table, gate.dtype), d_y, *(None,) * 7
        return dx, None, d_y, *(None,) * 4, buffer, None, None


def residual_route(x, gate, y, row_index, table_dtype, backend: str, op: str, **bf16) -> str:
    """The route of the gated residual on these inputs: "cupy" where gated_residual.cu takes them (bf16 table dtype;
    x, y and `bf16` bf16 on x's CUDA device, a width the plan takes), else "torch" (warned on CUDA; backend "cupy"
    raises instead)."""
    if backend == "torch":
        return "torch"
    error = (support.table_dtype(table_dtype) or support.on_device(x, gate=gate, row_index=row_index)
             or support.rows(x, gate.shape[0], y=y, **bf16))
    return support.route(op, backend, x, error)


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor, *,
                   table_dtype: torch.dtype | None = None, row_order: torch.Tensor | None = None,
                   backend: str = "auto") -> torch.Tensor:
    """`x + gate[row_index] * y` with diffusers' rounding, differentiable.

    Args:
        x: (..., S, H) residual stream, any float dtype (the CUDA kernels take bf16).
        gate: (R, H) table chunk (any strides), float32 holding `table_dtype` values.
        y: (..., S, H) the branch output (attention or feed-forward), x's shape.
        row_index: (S,) int64 in [0, R): the table row of each row of x (for every leading index).
        table_dtype: the projection's dtype gate is cast back to before diffusers' ops (default x's).
        row_order: None, or `adaln_lab.row_order(row_index, R, H)` computed once for several ops (the CUDA
            backward's row order).
        backend: "auto" (the kernels where they run), "cupy" (refuse what they cannot take) or "torch".

    Returns:
        (..., S, H) tensor of dtype promote_types(x.dtype, table_dtype, y.dtype), diffusers' output.
    """
    check_rows("gated_residual", x, row_index, y=y, gate=gate)
    check_order("gated_residual", row_order, row_index, gate.shape[0])
    check_option("backend", backend, BLOCK_BACKENDS)
    table_dtype = x.dtype if table_dtype is None else table_dtype
    route = residual_route(x, gate, y, row_index, table_dtype, backend, "gated_residual")
    return apply(GatedResidual, x, gate, y, row_index, table_dtype, route, row_order, None, 0, None)
