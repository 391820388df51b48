"""`modulated_rms_norm`: an H3 block's `norm(x) * (1 + scale[row_index]) + shift[row_index]` differentiable.

    out = modulated_rms_norm(x (..., S, H), norm_weight (H,), shift (R, H), scale (R, H), row_index (S,), eps)

Broadcast: row s of every leading index of x is modulated by table row row_index[s] (R = 3T table rows
for a block: `adaln_indices = timestep_indices * 3 + token_tags`). shift and scale are usually column
chunks of `modulation_table`'s (T, 18H) float32 table viewed (3T, 6H): any strides, float32 holding values
of the projection's dtype `table_dtype` (default x's dtype). The forward casts them back to `table_dtype`
(exact) and replays diffusers (`F.rms_norm` in x's dtype, `1 + scale` in table_dtype, then the product and
`+ shift`, each rounded), so it is diffusers' output bit for bit on the CPU; out has dtype
promote_types(x.dtype, table_dtype).

One way through: the public functions check the inputs and decide the route once (`core.support.route`: the row
kernels for bf16 x, norm_weight and table dtype on CUDA with a width the plan takes; otherwise the torch code, with a
warning on CUDA); the one autograd node `ModulatedRMSNorm` allocates the outputs and calls the launch ops (`launch`),
in eager and compiled code alike. It serves three callers: `modulated_rms_norm` (out), `modulated_rms_norm_and_residual`
(out and x handed on down the residual stream, whose gradient the backward sums in the norm's row pass) and a block's
norm1, which also passes the table (its chunks' gradients go into the block's table gradient: `core.table_gradient`)
and the table kernel's bf16 row tables.

The torch code replays diffusers forward and takes the exact derivative backward (`reference.backward`: per row in
float32, the parameter sums in float64 in a fixed order, rounded once); the kernels are norm_out's row kernels with
the R table rows as timesteps, the backward walking the rows in table-row order (`row_order`).

Gradients: dx in x's dtype, d_norm_weight in norm_weight's, d_shift / d_scale (R, H) in shift's / scale's
(float32 for the table's chunks, so autograd adds the chunks' gradients into the table in float32).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...core import support, table_gradient, tensors
from ...core.checks import BLOCK_BACKENDS, check_option, check_order, check_rows
from ...core.library import apply
from ...reference.backward import compute_dtype
from . import launch


class ModulatedRMSNorm(torch.autograd.Function):
    """forward(x, norm_weight, shift, scale, row_index, eps, table_dtype, route, order, residual, table, chunk,
    row_tables, sums) -> (out, x handed on where `residual` else None, the table handed on where given else None).

    A block passes its table with shift and scale detached chunks of it and `chunk` the index of shift's chunk
    (`core.table_gradient`): the backward then writes d_shift | d_scale into the table gradient and returns it as
    the table's gradient; and its bf16 row tables, which the kernels read instead of casting shift and scale.
    sums: None, or a block's `ops.block.exact.BlockSums` inside `adaln_lab.nn.ExactGradients`: the backward adds
    its rows' exact sums there (`BlockSums.norm`, on exact_row_pass.cu on route "cupy")."""

    @staticmethod
    def forward(ctx, x, norm_weight, shift, scale, row_index, eps, table_dtype, route, order, residual, table, chunk,
                row_tables, sums):
        H = x.shape[-1]
        out = torch.empty_like(x, dtype=tensors.promoted(x.dtype, table_dtype), memory_format=torch.contiguous_format)
        rstd = x.new_empty(x.numel() // H, dtype=compute_dtype(x))
        launch.forward(x, norm_weight, shift, scale, row_index, eps, table_dtype, route, row_tables,
                       int(chunk == table_gradient.SHIFT_MLP), out, rstd)
        ctx.set_materialize_grads(False)
        ctx.route, ctx.chunk, ctx.out_dtype, ctx.sums = route, chunk, out.dtype, sums
        ctx.table = None if table is None else (table.shape, table.dtype, table.device)
        ctx.save_for_backward(x, norm_weight, shift, scale, row_index, rstd, order)
        return out, (x if residual else None), (None if table is None else table.detach())

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_x, d_link):
        x, norm_weight, shift, scale, row_index, rstd, order = ctx.saved_tensors
        R, H = shift.shape
        if ctx.route == "cupy":
            support.check_saved("modulated_rms_norm", x, norm_weight=norm_weight)
        if d_out is None:
            d_out = torch.zeros(x.shape, dtype=ctx.out_dtype, device=x.device)
        d_residual = None if d_x is None else tensors.as_dtype(d_x, x.dtype).contiguous()
        if ctx.sums is not None and ctx.route == "cupy":  # the row pass keeps the exact sums; no parameter gradient
            dx = torch.empty_like(x, memory_format=torch.contiguous_format)
            state, flags = launch.backward_exact(d_out.contiguous(), x, norm_weight, shift, scale, row_index, rstd,
                                                 d_residual, order, dx)
            ctx.sums.add_norm(ctx.chunk, state, flags)
            return dx, *(None,) * 13
        if ctx.table is None:
            dtype = torch.float32 if ctx.route == "cupy" else torch.promote_types(shift.dtype, scale.dtype)
            d_table, column, partials = table_gradient.standalone(R, 2 * H, dtype, x.device), 0, None
        else:
            buffer, partials = table_gradient.for_row_op(d_link, ctx.table, H, ctx.chunk + 2, ctx.route, x, R)
            d_table, column = table_gradient.columns(buffer, H), ctx.chunk * H
        dx, d_norm_weight = torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(norm_weight)
        d_out = d_out.contiguous()
        launch.backward(d_out, x, norm_weight, shift, scale, row_index, rstd, d_residual, order, ctx.route, dx,
                        d_norm_weight, d_table, column, partials)
        if ctx.sums is not None:  # the torch code's route (the kernels' returned above)
            ctx.sums.norm(ctx.chunk, x, d_out, rstd, row_index, False)
        if ctx.table is None:
            d_shift = tensors.as_dtype(d_table[:, :H], shift.dtype)
            d_scale = tensors.as_dtype(d_table[:, H:], scale.dtype)
            return dx, d_norm_weight, d_shift, d_scale, *(None,) * 10
        return dx, d_norm_weight, None, None, *(None,) * 6, buffer, None, None, None


def norm_route(x, norm_weight, shift, scale, row_index, table_dtype, backend: str, op: str, **bf16) -> str:
    """The route of the modulated norm on these inputs: "cupy" where the row kernels take them (bf16 table dtype;
    x, norm_weight and `bf16` bf16 on x's CUDA device, at most T_MAX table rows, a width the plan takes), else
    "torch" (warned on CUDA; backend "cupy" raises instead)."""
    if backend == "torch":
        return "torch"
    error = (support.table_dtype(table_dtype) or support.on_device(x, shift=shift, scale=scale, row_index=row_index)
             or support.rows(x, shift.shape[0], norm_weight=norm_weight, **bf16))
    return support.route(op, backend, x, error)


def modulated_rms_norm(x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                       row_index: torch.Tensor, eps: float = 1e-5, *, table_dtype: torch.dtype | None = None,
                       backend: str = "auto") -> torch.Tensor:
    """`rms_norm(x, norm_weight, eps) * (1 + scale[row_index]) + shift[row_index]`, differentiable.

    Args:
        x: (..., S, H) hidden states, any float dtype (the CUDA kernels take bf16).
        norm_weight: (H,) RMSNorm weight.
        shift, scale: (R, H) table chunks (any strides), float32 holding `table_dtype` values.
        row_index: (S,) int64 in [0, R): the table row of each row of x (for every leading index).
        eps: RMSNorm epsilon.
        table_dtype: the projection's dtype the chunks are cast back to before diffusers' ops (default x's).
        backend: "auto" (the kernels where they run), "cupy" (refuse what they cannot take) or "torch".

    Returns:
        (..., S, H) tensor of dtype promote_types(x.dtype, table_dtype), diffusers' output.
    """
    check_rows("modulated_rms_norm", x, row_index, norms={"norm_weight": norm_weight}, shift=shift, scale=scale)
    check_option("backend", backend, BLOCK_BACKENDS)
    table_dtype = x.dtype if table_dtype is None else table_dtype
    route = norm_route(x, norm_weight, shift, scale, row_index, table_dtype, backend, "modulated_rms_norm")
    return apply(ModulatedRMSNorm, x, norm_weight, shift, scale, row_index, float(eps), table_dtype, route, None,
                 False, None, 0, None, None)[0]


def modulated_rms_norm_and_residual(x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor,
                                    scale: torch.Tensor, row_index: torch.Tensor, eps: float = 1e-5, *,
                                    table_dtype: torch.dtype | None = None, row_order: torch.Tensor | None = None,
                                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(modulated_rms_norm(x, ...), x): the norm and x itself (a view) to carry on down the residual stream.

    Same values and gradients, bit for bit, as `modulated_rms_norm` with the caller then using x in place of
    the returned view: x's two gradients (the norm's and the one reaching the returned x) are summed inside
    the norm's backward (on the CUDA kernels, in its row pass: one pass over the rows instead of three).
    If the caller uses the original x as well, its third gradient is added by autograd afterwards (the same
    values, another order of the additions). The returned x is a view of x made by an autograd.Function:
    modifying it in place under grad mode raises. Arguments as `modulated_rms_norm`, and row_order: None, or
    `adaln_lab.row_order(row_index, R, H)` computed once for several ops (the CUDA backward's row order).
    """
    check_rows("modulated_rms_norm_and_residual", x, row_index, norms={"norm_weight": norm_weight}, shift=shift,
               scale=scale)
    check_order("modulated_rms_norm_and_residual", row_order, row_index, shift.shape[0])
    check_option("backend", backend, BLOCK_BACKENDS)
    table_dtype = x.dtype if table_dtype is None else table_dtype
    route = norm_route(x, norm_weight, shift, scale, row_index, table_dtype, backend,
                       "modulated_rms_norm_and_residual")
    out, x, _ = apply(ModulatedRMSNorm, x, norm_weight, shift, scale, row_index, float(eps), table_dtype, route,
                      row_order, True, None, 0, None, None)
    return out, x
