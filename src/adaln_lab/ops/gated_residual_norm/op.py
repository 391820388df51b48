"""`gated_residual_norm`: an H3 block's first gated residual and its second modulated RMSNorm as one op.

    x_out, out = gated_residual_norm(x (..., S, H), gate (R, H), y (..., S, H), norm_weight (H,),
                                     shift (R, H), scale (R, H), row_index (S,), eps)
    x_out = gated_residual(x, gate, y, row_index)
    out   = modulated_rms_norm(x_out, norm_weight, shift, scale, row_index, eps)

Broadcast and dtypes as the two ops (`adaln_lab.gated_residual`, `adaln_lab.modulated_rms_norm`): row s of
every leading index uses table row row_index[s] for the gate and for the modulation; gate, shift, scale are
float32 table chunks (any strides) holding `table_dtype` values. x_out goes on down the residual stream, out
into the feed-forward, so x_out receives two gradients: the one from downstream and the norm's dx.

Why one op: the unfused path reads x_out again for the norm (one pass over the rows more) and autograd
adds x_out's two gradients in a kernel of its own (two passes more). Here the forward is one kernel
(gated_residual_norm.cu) and the backward sums the residual gradient inside the norm's row pass
(norm_modulate_bwd_residual_sorted_bf16) before the gated residual's backward reads it. Every output and
gradient has the bits of the two ops run one after the other (tests/ops/test_gated_residual_norm.py): the sum is
rounded as autograd's bf16 add rounds it, bf16(bf16(norm dx) + d_x_out).

One way through: `gated_residual_norm` checks the inputs and decides the route once: "cupy" (the fused kernels) where
both ops' rules take the inputs, otherwise each op on its own route ("<residual>+<norm>": a bf16 gated residual
with, say, an fp32 norm_weight keeps gated_residual.cu's fixed-order d_gate), with a warning on CUDA. The one
autograd node `GatedResidualNorm` allocates the outputs and calls the launch ops (`launch`), in eager and compiled
code alike. When `out` is unused its gradient is zeros, so d_norm_weight, d_shift and d_scale come back as zeros
where the unfused ops give None. A block passes its table (the second of its three row ops): d_gate | d_shift |
d_scale then go into the block's table gradient (`core.table_gradient`), and the kernels read the table kernel's
bf16 row table of norm2.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...core import support, table_gradient, tensors
from ...core.checks import BLOCK_BACKENDS, check_option, check_order, check_rows
from ...core.library import apply
from ...reference.backward import compute_dtype
from ..gated_residual import launch as residual_launch
from ..gated_residual.op import residual_route
from ..modulated_rms_norm import launch as norm_launch
from ..row_order import row_order
from ..modulated_rms_norm.op import norm_route
from . import launch


class GatedResidualNorm(torch.autograd.Function):
    """forward(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, route, order, table, chunk,
    row_tables, sums) -> (x_out, out, the table handed on where given else None); backward(d_x_out, d_out, d_link)
    -> dx, d_gate, d_y, d_norm_weight, d_shift, d_scale (or, where a block passed its table, the table gradient with
    d_gate | d_shift | d_scale in chunks chunk .. chunk + 2, as the table's gradient). sums: None, or a block's
    `ops.block.exact.BlockSums` inside `adaln_lab.nn.ExactGradients`: the backward adds both parts' exact sums there
    (`BlockSums.gate` with x_out's whole gradient, then `BlockSums.norm`), each on its part's route."""

    @staticmethod
    def forward(ctx, x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, route, order, table, chunk,
                row_tables, sums):
        H = x.shape[-1]
        x_dtype = tensors.promoted(x.dtype, table_dtype, y.dtype)
        x_out = torch.empty_like(x, dtype=x_dtype, memory_format=torch.contiguous_format)
        out = torch.empty_like(x, dtype=tensors.promoted(x_dtype, table_dtype), memory_format=torch.contiguous_format)
        rstd = x.new_empty(x.numel() // H, dtype=compute_dtype(x_out))
        launch.forward(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, route, row_tables, x_out,
                       out, rstd)
        ctx.set_materialize_grads(False)
        ctx.x_dtype, ctx.table_dtype, ctx.route, ctx.chunk, ctx.sums = x.dtype, table_dtype, route, chunk, sums
        ctx.table = None if table is None else (table.shape, table.dtype, table.device)
        ctx.save_for_backward(x_out, gate, y, row_index, norm_weight, shift, scale, rstd, order)
        return x_out, out, (None if table is None else table.detach())

    @staticmethod
    @once_differentiable
    def backward(ctx, d_x_out, d_out, d_link):
        x_out, gate, y, row_index, norm_weight, shift, scale, rstd, order = ctx.saved_tensors
        R, H = shift.shape
        if ctx.route == "cupy":
            support.check_saved("gated_residual_norm", x_out, norm_weight=norm_weight)
        d_out = torch.zeros_like(x_out) if d_out is None else d_out.contiguous()  # out unused: zeros, as autograd's
        d_x_out = torch.zeros_like(x_out) if d_x_out is None else d_x_out.contiguous()
        if ctx.sums is not None and ctx.route == "cupy":
            return _backward_exact(ctx, d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd,
                                   order)
        if ctx.table is None:
            dtype = torch.float32 if "cupy" in ctx.route else torch.promote_types(gate.dtype, shift.dtype)
            d_table, column, partials = table_gradient.standalone(R, 3 * H, dtype, x_out.device), 0, None
        else:
            buffer, partials = table_gradient.for_row_op(d_link, ctx.table, H, ctx.chunk + 3, ctx.route, x_out, R)
            d_table, column = table_gradient.columns(buffer, H), ctx.chunk * H
        # with sums, dx is x_out's whole gradient in x_out's dtype (the gate's dy), cast to x's after as launch casts
        whole = x_out.dtype if ctx.sums is not None else ctx.x_dtype
        dx = torch.empty_like(x_out, dtype=whole, memory_format=torch.contiguous_format)
        d_y, d_norm_weight = torch.empty_like(y, memory_format=torch.contiguous_format), torch.empty_like(norm_weight)
        launch.backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, order,
                        ctx.table_dtype, ctx.route, dx, d_y, d_norm_weight, d_table, column,
                        partials)
        if ctx.sums is not None:  # dx: x_out's whole gradient (the norm's dx plus d_x_out), the gate's dy
            residual_route, norm_route = launch.parts(ctx.route)
            ctx.sums.gate(ctx.chunk, y, dx, row_index, residual_route == "cupy")  # kernels: a pass of their own
            ctx.sums.norm(ctx.chunk + 1, x_out, d_out, rstd, row_index, norm_route == "cupy")
            dx = tensors.as_dtype(dx, ctx.x_dtype)
        if ctx.table is None:
            d_gate, d_shift, d_scale = (tensors.as_dtype(d_table[:, i * H:(i + 1) * H], t.dtype)
                                        for i, t in enumerate((gate, shift, scale)))
            return dx, d_gate, d_y, None, d_norm_weight, d_shift, d_scale, *(None,) * 8
        return dx, None, d_y, None, d_norm_weight, None, None, *(None,) * 4, buffer, None, None, None


def _backward_exact(ctx, d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, order):
    """Route "cupy" inside ExactGradients: the norm's row pass with its exact sums (and d_x_out summed in: dx, x_out's
    whole gradient), then the gated residual's with the gate's exact sums of dx y; the same dx and d_y as
    `launch.backward`, no parameter gradient."""
    dx = torch.empty_like(x_out, memory_format=torch.contiguous_format)
    if order is None:  # one sort for the two passes
        order = row_order(row_index.contiguous(), *shift.shape)
    state, flags = norm_launch.backward_exact(d_out, x_out, norm_weight, shift, scale, row_index, rstd,
                                              tensors.as_dtype(d_x_out, x_out.dtype), order, dx)
    ctx.sums.add_norm(ctx.chunk + 1, state, flags)
    d_y = torch.empty_like(y, memory_format=torch.contiguous_format)
    ctx.sums.add_gate(ctx.chunk, *residual_launch.backward_exact(dx, gate, y, row_index, order, d_y))
    return tensors.as_dtype(dx, ctx.x_dtype), None, d_y, *(None,) * 12


def pair_route(x, gate, y, row_index, norm_weight, shift, scale, table_dtype, backend: str, op: str) -> str:
    """"cupy" where both ops' rules take the inputs (the fused kernels), else "<residual>+<norm>", each op's own
    route (backend "cupy" raises the first refusal). x stands for x_out in the norm's rule where x_out is bf16 (then
    x, y and the table dtype are, and x_out has x's shape and device); otherwise the norm's route is "torch" too, and
    the gated residual's refusal has said why."""
    residual = residual_route(x, gate, y, row_index, table_dtype, backend, op)
    x_out_dtype = torch.promote_types(x.dtype, torch.promote_types(table_dtype, y.dtype))
    normed = "torch" if x_out_dtype != torch.bfloat16 else norm_route(x, norm_weight, shift, scale, row_index,
                                                                       table_dtype, backend, op)
    return "cupy" if residual == normed == "cupy" else f"{residual}+{normed}"


def gated_residual_norm(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, norm_weight: torch.Tensor,
                        shift: torch.Tensor, scale: torch.Tensor, row_index: torch.Tensor, eps: float = 1e-5, *,
                        table_dtype: torch.dtype | None = None, row_order: torch.Tensor | None = None,
                        backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`x_out = x + gate[row_index] * y` and `out = modulated_rms_norm(x_out, ...)`, differentiable, in one op.

    Args:
        x: (..., S, H) residual stream; y: (..., S, H) the branch output (attention), x's shape.
        gate, shift, scale: (R, H) table chunks (any strides), float32 holding `table_dtype` values.
        norm_weight: (H,) the RMSNorm's weight; eps its epsilon.
        row_index: (S,) int64 in [0, R): the table row of each row (for every leading index).
        table_dtype: the projection's dtype the chunks are cast back to (default x's).
        row_order: None, or `adaln_lab.row_order(row_index, R, H)` computed once for several ops (the CUDA
            backward's row order).
        backend: "auto" (the kernels where they run), "cupy" (refuse what they cannot take) or "torch".

    Returns:
        (x_out, out), both (..., S, H): x_out of dtype promote_types(x, table_dtype, y), out of
        promote_types(x_out, table_dtype); diffusers' values for `x = x + gate * y; h = norm2(x) * ...`.
    """
    check_rows("gated_residual_norm", x, row_index, y=y, norms={"norm_weight": norm_weight}, gate=gate, shift=shift,
               scale=scale)
    check_order("gated_residual_norm", row_order, row_index, gate.shape[0])
    check_option("backend", backend, BLOCK_BACKENDS)
    table_dtype = x.dtype if table_dtype is None else table_dtype
    route = pair_route(x, gate, y, row_index, norm_weight, shift, scale, table_dtype, backend, "gated_residual_norm")
    x_out, out, _ = apply(GatedResidualNorm, x, gate, y, row_index, norm_weight, shift, scale, float(eps),
                          table_dtype, route, row_order, None, 0, None, None)
    return x_out, out
