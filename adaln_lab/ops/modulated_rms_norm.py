"""`modulated_rms_norm`: an H3 block's `norm(x) * (1 + scale[row_index]) + shift[row_index]` as a custom op.

    out = modulated_rms_norm(x (..., S, H), norm_weight (H,), shift (R, H), scale (R, H), row_index (S,), eps)

Broadcast: row s of every leading index of x is modulated by table row row_index[s] (R = 3T table rows
for a block: `adaln_indices = timestep_indices * 3 + token_tags`). shift and scale are usually column
chunks of `modulation_table`'s (T, 18H) float32 table viewed (3T, 6H): any strides, float32 holding values
of the projection's dtype `table_dtype` (default x's dtype). The forward casts them back to `table_dtype`
(exact) and replays diffusers (`F.rms_norm` in x's dtype, `1 + scale` in table_dtype, then the product and
`+ shift`, each rounded), so it is diffusers' output bit for bit on the CPU; out has dtype
promote_types(x.dtype, table_dtype).

Layers (as `adaln_lab.ops.final_adaln_out`):
- `torch.ops.adaln_lab.modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, eps, table_dtype)
  -> (out (..., S, H), rstd (rows,))` and `torch.ops.adaln_lab.modulated_rms_norm_bwd(dy, x, norm_weight,
  shift, scale, row_index, rstd, d_residual=None) -> (dx, d_norm_weight, d_shift, d_scale)` (with d_residual,
  x's shape, dx is the norm's dx plus d_residual, added in x's dtype): custom ops with fake kernels and
  `register_autograd`. rows = x.numel() / H; rstd = rsqrt(mean(x^2) + eps) per row, in
  promote_types(x.dtype, float32).
- `modulated_rms_norm_and_residual(x, ...) -> (out, x)`: the norm, and x itself handed on down the residual
  stream, whose gradient is summed inside the norm's backward (an autograd.Function over the two ops).
- Default (CPU) kernels, torch code: the forward is the replay; the backward the exact derivative
  (`reference.backward.modulated_rms_norm_backward`: per row in float32, the parameter sums in float64 in a
  fixed order, rounded once).
- CUDA kernels (`adaln_lab.core.tensors`: norm_out's row kernels with the R table rows as timesteps) for
  bf16 x, norm_weight and table_dtype with supported shapes (`support.rows`); anything else runs the torch
  code.
- `ModulatedRMSNorm`, `ModulatedRMSNormAndResidual`: the lean eager path, autograd.Functions straight onto
  the same implementations (`forward`, `backward`), the kernels decided once by the caller.

Gradients: dx in x's dtype, d_norm_weight in norm_weight's, d_shift / d_scale (R, H) in shift's / scale's
(float32 for the table's chunks, so autograd adds the chunks' gradients into the table in float32).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..core import tensors
from ..reference.backward import compute_dtype, modulated_rms_norm_backward, rstd_of
from ..reference.block import replay_modulated_rms_norm
from ..core import support
from ..core.checks import check_order, check_rows
from .eager import apply
from .table_gradient import SHIFT_MSA


def kernels_take(x, norm_weight, shift, scale, row_index, table_dtype, **more) -> bool:
    """Whether the row kernels run: bf16 table dtype, `support.rows` for x, norm_weight and `more` (bf16
    tensors), the other tensors on x's device."""
    return (table_dtype == torch.bfloat16 and x.is_cuda
            and support.on_device(x, shift=shift, scale=scale, row_index=row_index) is None
            and support.rows(x, shift.shape[0], norm_weight=norm_weight, **more) is None)


def forward(x, norm_weight, shift, scale, row_index, eps: float, table_dtype, kernels: bool, row_table=None):
    """(out (..., S, H), rstd (rows,)): the row kernels where `kernels` (reading shift | scale from a block's row
    table where given, `core.tensors.modulated_rms_norm_fwd`), else diffusers' replay."""
    if kernels:
        return tensors.modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, eps, row_table)
    out = replay_modulated_rms_norm(x, norm_weight, shift.to(table_dtype), scale.to(table_dtype), row_index, eps)
    return out.contiguous(), rstd_of(x, eps)


def _check_residual(x, d_residual) -> None:
    if d_residual is not None and d_residual.shape != x.shape:
        raise ValueError(f"modulated_rms_norm_bwd needs d_residual of x's shape {tuple(x.shape)}, got "
                         f"{tuple(d_residual.shape)}")


def backward(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, row_order, kernels: bool, into=None):
    """(dx, d_norm_weight, d_shift, d_scale): the row kernels where `kernels` (in row_order, sorted here when
    None), else `reference.backward.modulated_rms_norm_backward`. into: None, or (TableGradient, chunk): d_shift
    and d_scale then go into that chunk's columns and the next one's (`ops.table_gradient`) and come back None."""
    if kernels:
        support.check_saved("modulated_rms_norm", x, norm_weight=norm_weight)
        dx, d_norm_weight, d_shift, d_scale = tensors.modulated_rms_norm_bwd(
            dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, order=row_order,
            into=None if into is None else into[0].pointer(into[1], 2),
            workspace=None if into is None else into[0].workspace(into[1]))
        if into is not None:
            return dx, d_norm_weight, None, None
        return dx, d_norm_weight, tensors.as_dtype(d_shift, shift.dtype), tensors.as_dtype(d_scale, scale.dtype)
    dx, d_norm_weight, d_shift, d_scale = modulated_rms_norm_backward(dy, x, norm_weight, shift, scale, row_index,
                                                                      rstd, d_residual)
    if into is None:
        return dx, d_norm_weight, d_shift, d_scale
    into[0].write(into[1], d_shift, d_scale)
    return dx, d_norm_weight, None, None


@torch.library.custom_op("adaln_lab::modulated_rms_norm_fwd", mutates_args=())
def modulated_rms_norm_fwd(x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                           row_index: torch.Tensor, eps: float,
                           table_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (..., S, H), rstd (rows,)): diffusers' replay and the rows' rstd (module docstring)."""
    return forward(x, norm_weight, shift, scale, row_index, eps, table_dtype, False)


@modulated_rms_norm_fwd.register_fake
def _(x, norm_weight, shift, scale, row_index, eps, table_dtype):
    H = x.shape[-1]
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, table_dtype)),
            x.new_empty((x.numel() // H,), dtype=compute_dtype(x)))


@modulated_rms_norm_fwd.register_kernel("cuda")
def _(x, norm_weight, shift, scale, row_index, eps, table_dtype):
    kernels = kernels_take(x, norm_weight, shift, scale, row_index, table_dtype)
    return forward(x, norm_weight, shift, scale, row_index, eps, table_dtype, kernels)


@torch.library.custom_op("adaln_lab::modulated_rms_norm_bwd", mutates_args=())
def modulated_rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor,
                           scale: torch.Tensor, row_index: torch.Tensor, rstd: torch.Tensor,
                           d_residual: torch.Tensor | None = None, row_order: torch.Tensor | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx (..., S, H), d_norm_weight (H,), d_shift (R, H), d_scale (R, H)) (module docstring); with d_residual
    (x's shape) dx is the norm's dx plus d_residual, added in x's dtype as autograd would. row_order: see
    `adaln_lab.row_order` (the CUDA kernels' row order, sorted here when None; the torch code ignores it)."""
    _check_residual(x, d_residual)
    return backward(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, row_order, False)


@modulated_rms_norm_bwd.register_fake
def _(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None, row_order=None):
    return (x.new_empty(x.shape), norm_weight.new_empty(norm_weight.shape), shift.new_empty(shift.shape),
            scale.new_empty(scale.shape))


@modulated_rms_norm_bwd.register_kernel("cuda")
def _(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None, row_order=None):
    # dy is bf16 exactly when the forward's output was, i.e. when the forward ran the kernels
    _check_residual(x, d_residual)
    more = {} if d_residual is None else {"d_residual": d_residual}
    kernels = (rstd.dtype == torch.float32 and support.on_device(x, rstd=rstd) is None
               and kernels_take(x, norm_weight, shift, scale, row_index, torch.bfloat16, dy=dy, **more))
    return backward(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, row_order, kernels)


def _setup_context(ctx, inputs, output):
    x, norm_weight, shift, scale, row_index, _, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, norm_weight, shift, scale, row_index, rstd)


def _backward(ctx, d_out, d_rstd):
    x, norm_weight, shift, scale, row_index, rstd = ctx.saved_tensors
    grads = modulated_rms_norm_bwd(d_out.contiguous(), x, norm_weight, shift, scale, row_index, rstd)
    return (*grads, None, None, None)


modulated_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class ModulatedRMSNorm(torch.autograd.Function):
    """The lean eager path: forward(x, norm_weight, shift, scale, row_index, eps, table_dtype, kernels) -> out;
    backward(d_out) -> dx, d_norm_weight, d_shift, d_scale (the kernels as the forward)."""

    @staticmethod
    def forward(ctx, x, norm_weight, shift, scale, row_index, eps, table_dtype, kernels):
        out, rstd = forward(x, norm_weight, shift, scale, row_index, eps, table_dtype, kernels)
        ctx.kernels = kernels
        ctx.save_for_backward(x, norm_weight, shift, scale, row_index, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        x, norm_weight, shift, scale, row_index, rstd = ctx.saved_tensors
        grads = backward(d_out.contiguous(), x, norm_weight, shift, scale, row_index, rstd, None, None, ctx.kernels)
        return (*grads, None, None, None, None)


class ModulatedRMSNormAndResidual(torch.autograd.Function):
    """(out, x): the modulated norm of x and x itself (returned as is: autograd gives the caller a view), so
    that x's gradient from the residual stream reaches this backward, which sums it inside the norm's row
    pass (`backward(..., d_residual)`) instead of autograd adding it in a kernel of its own.

    forward(x, norm_weight, shift, scale, row_index, eps, table_dtype, row_order, kernels, table=None,
    table_grad=None, row_table=None); under torch.compile it runs the custom ops (kernels is then decided inside
    them). A block's norm1 passes its table and TableGradient with shift and scale detached: the backward writes
    d_shift | d_scale into the table gradient and returns it, whole, as the table's gradient (`ops.table_gradient`);
    and its row table, which the kernels read instead of casting shift and scale."""

    @staticmethod
    def forward(ctx, x, norm_weight, shift, scale, row_index, eps, table_dtype, row_order, kernels, table=None,
                table_grad=None, row_table=None):
        if torch.compiler.is_compiling():
            out, rstd = modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, eps, table_dtype)
        else:
            out, rstd = forward(x, norm_weight, shift, scale, row_index, eps, table_dtype, kernels, row_table)
        ctx.kernels, ctx.table_grad = kernels, table_grad
        ctx.save_for_backward(x, norm_weight, shift, scale, row_index, rstd, row_order)
        return out, x

    @staticmethod
    def backward(ctx, d_out, d_x):
        x, norm_weight, shift, scale, row_index, rstd, row_order = ctx.saved_tensors
        d_residual = tensors.as_dtype(d_x, x.dtype).contiguous()
        table_grad, d_table = ctx.table_grad, None
        if torch.compiler.is_compiling():  # compiled autograd: the custom op, the table's gradient as a tensor
            grads = modulated_rms_norm_bwd(d_out.contiguous(), x, norm_weight, shift, scale, row_index, rstd,
                                           d_residual, row_order)
            if table_grad is not None:
                d_table, grads = table_grad.as_table(SHIFT_MSA, *grads[2:]), (*grads[:2], None, None)
        else:
            into = None if table_grad is None else (table_grad, SHIFT_MSA)
            grads = backward(d_out.contiguous(), x, norm_weight, shift, scale, row_index, rstd, d_residual,
                             row_order, ctx.kernels, into)
            d_table = None if table_grad is None else table_grad.take()
        return (*grads, None, None, None, None, None, d_table, None, None)


def modulated_rms_norm(x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                       row_index: torch.Tensor, eps: float = 1e-5, *,
                       table_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`rms_norm(x, norm_weight, eps) * (1 + scale[row_index]) + shift[row_index]`, differentiable.

    Args:
        x: (..., S, H) hidden states, any float dtype (the CUDA kernels take bf16).
        norm_weight: (H,) RMSNorm weight.
        shift, scale: (R, H) table chunks (any strides), float32 holding `table_dtype` values.
        row_index: (S,) int64 in [0, R): the table row of each row of x (for every leading index).
        eps: RMSNorm epsilon.
        table_dtype: the projection's dtype the chunks are cast back to before diffusers' ops (default x's).

    Returns:
        (..., S, H) tensor of dtype promote_types(x.dtype, table_dtype), diffusers' output.
    """
    check_rows("modulated_rms_norm", x, row_index, norm_weight=norm_weight, shift=shift, scale=scale)
    table_dtype = x.dtype if table_dtype is None else table_dtype
    if torch.compiler.is_compiling():
        return modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, float(eps), table_dtype)[0]
    kernels = kernels_take(x, norm_weight, shift, scale, row_index, table_dtype)
    return apply(ModulatedRMSNorm, x, norm_weight, shift, scale, row_index, float(eps), table_dtype, kernels)


def modulated_rms_norm_and_residual(x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor,
                                    scale: torch.Tensor, row_index: torch.Tensor, eps: float = 1e-5, *,
                                    table_dtype: torch.dtype | None = None,
                                    row_order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(modulated_rms_norm(x, ...), x): the norm and x itself (a view) to carry on down the residual stream.

    Same values and gradients, bit for bit, as `modulated_rms_norm` with the caller then using x in place of
    the returned view: x's two gradients (the norm's and the one reaching the returned x) are summed inside
    the norm's backward (on the CUDA kernels, in its row pass: one pass over the rows instead of three).
    If the caller uses the original x as well, its third gradient is added by autograd afterwards (the same
    values, another order of the additions). The returned x is a view of x made by an autograd.Function:
    modifying it in place under grad mode raises. Arguments as `modulated_rms_norm`, and row_order: None, or
    `adaln_lab.row_order(row_index, R, H)` computed once for several ops (the CUDA backward's row order).
    """
    check_rows("modulated_rms_norm_and_residual", x, row_index, norm_weight=norm_weight, shift=shift, scale=scale)
    check_order("modulated_rms_norm_and_residual", row_order, row_index, shift.shape[0])
    table_dtype = x.dtype if table_dtype is None else table_dtype
    kernels = not torch.compiler.is_compiling() and kernels_take(x, norm_weight, shift, scale, row_index,
                                                                  table_dtype)
    return apply(ModulatedRMSNormAndResidual, x, norm_weight, shift, scale, row_index, float(eps), table_dtype,
                 row_order, kernels)
