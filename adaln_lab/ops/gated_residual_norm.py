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

Layers (as `adaln_lab.ops.final_adaln_out`):
- `torch.ops.adaln_lab.gated_residual_norm_fwd(x, gate, y, row_index, norm_weight, shift, scale, eps,
  table_dtype) -> (x_out, out, rstd (rows,))` and `torch.ops.adaln_lab.gated_residual_norm_bwd(d_x_out,
  d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, table_dtype, x_dtype) -> (dx, d_gate,
  d_y, d_norm_weight, d_shift, d_scale)` (d_x_out and d_out of x_out's shape, dx in x_dtype): custom ops
  with fake kernels and `register_autograd`. When `out` is unused autograd hands the backward zeros, so
  d_norm_weight, d_shift and d_scale come back as zeros where the unfused ops give None.
- Default (CPU) kernels: the two ops one after the other (their torch code: diffusers' forward bit for bit).
- CUDA kernels (`adaln_lab.core.tensors.gated_residual_norm_fwd / _bwd`) for bf16 x, y, norm_weight and
  table_dtype with supported shapes; anything else runs the two ops one after the other, each on its own
  kernels where it can (a bf16 gated residual with, say, an fp32 norm_weight keeps gated_residual.cu's
  fixed-order d_gate), so the bits are the unfused ops' in every case.
- `GatedResidualNorm`: the lean eager path, one autograd.Function straight onto the same implementations.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..core import tensors
from ..reference.backward import compute_dtype
from . import gated_residual as gr
from . import modulated_rms_norm as mrn
from ..core import support
from ..core.checks import check_order, check_rows
from .eager import apply
from .table_gradient import GATE_MSA


def kernels_take(x, gate, y, row_index, norm_weight, shift, scale, table_dtype, **more) -> bool:
    """Whether the fused kernels run: bf16 table dtype; x, y, norm_weight (and `more`) bf16 on x's CUDA device."""
    return (table_dtype == torch.bfloat16 and x.is_cuda
            and support.on_device(x, gate=gate, shift=shift, scale=scale, row_index=row_index) is None
            and support.rows(x, shift.shape[0], norm_weight=norm_weight, y=y, **more) is None)


def forward(x, gate, y, row_index, norm_weight, shift, scale, eps: float, table_dtype, kernels: bool,
            row_table=None):
    """(x_out, out, rstd): one kernel where `kernels` (reading shift | scale from a block's row table where given),
    else the two ops one after the other, each on its own kernels where it can."""
    if kernels:
        return tensors.gated_residual_norm_fwd(x, gate, y, row_index, norm_weight, shift, scale, eps, row_table)
    x_out = gr.forward(x, gate, y, row_index, table_dtype, gr.kernels_take(x, gate, y, row_index, table_dtype))
    out, rstd = mrn.forward(x_out, norm_weight, shift, scale, row_index, eps, table_dtype,
                            mrn.kernels_take(x_out, norm_weight, shift, scale, row_index, table_dtype))
    return x_out, out, rstd


def backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, table_dtype, x_dtype,
             row_order, kernels: bool, into=None):
    """(dx in x_dtype, d_gate, d_y, d_norm_weight, d_shift, d_scale): the fused backward where `kernels`, else
    the two ops' backwards one after the other (the norm's summing d_x_out in), each on its own kernels. into:
    None, or (TableGradient, chunk): d_gate, d_shift and d_scale then go into that chunk's columns and the next
    two's and come back None."""
    if kernels:
        support.check_saved("gated_residual_norm", x_out, norm_weight=norm_weight)
        dx, d_gate, d_y, d_norm_weight, d_shift, d_scale = tensors.gated_residual_norm_bwd(
            d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, order=row_order,
            into=None if into is None else into[0].pointer(into[1], 3),
            workspaces=(None, None) if into is None else (into[0].workspace(into[1] + 1), into[0].workspace(into[1])))
        if into is not None:
            return dx, None, d_y, d_norm_weight, None, None
        return (dx, tensors.as_dtype(d_gate, gate.dtype), d_y, d_norm_weight, tensors.as_dtype(d_shift, shift.dtype),
                tensors.as_dtype(d_scale, scale.dtype))
    d_residual = d_x_out.to(x_out.dtype)
    norm_kernels = (rstd.dtype == torch.float32 and support.on_device(x_out, rstd=rstd) is None
                    and mrn.kernels_take(x_out, norm_weight, shift, scale, row_index, torch.bfloat16, dy=d_out,
                                         d_residual=d_residual))
    dx, d_norm_weight, d_shift, d_scale = mrn.backward(d_out, x_out, norm_weight, shift, scale, row_index, rstd,
                                                       d_residual, row_order, norm_kernels,
                                                       None if into is None else (into[0], into[1] + 1))
    d_gate, d_y = gr.backward(dx, gate, y, row_index, table_dtype, row_order,
                              gr.kernels_take(y, gate, y, row_index, table_dtype, dout=dx), into)
    return dx.to(x_dtype), d_gate, d_y, d_norm_weight, d_shift, d_scale


def _check_gradients(x_out, **gradients) -> None:
    for name, t in gradients.items():
        if t.shape != x_out.shape:
            raise ValueError(f"gated_residual_norm_bwd needs {name} of x_out's shape {tuple(x_out.shape)}, got "
                             f"{tuple(t.shape)}")


def _bwd_kernels(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, table_dtype,
                 x_dtype) -> bool:
    # the gradients are bf16 exactly when the forward's outputs were (the kernels' case)
    return (rstd.dtype == torch.float32 and x_dtype == torch.bfloat16 and support.on_device(x_out, rstd=rstd) is None
            and kernels_take(x_out, gate, y, row_index, norm_weight, shift, scale, table_dtype, d_x_out=d_x_out,
                             d_out=d_out))


@torch.library.custom_op("adaln_lab::gated_residual_norm_fwd", mutates_args=())
def gated_residual_norm_fwd(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor,
                            norm_weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                            table_dtype: torch.dtype, row_order: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_out (..., S, H), out (..., S, H), rstd (rows,)) (module docstring); row_order is only kept for the
    backward."""
    return forward(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, False)


@gated_residual_norm_fwd.register_fake
def _(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, row_order=None):
    H = x.shape[-1]
    x_dtype = torch.promote_types(x.dtype, torch.promote_types(table_dtype, y.dtype))
    return (x.new_empty(x.shape, dtype=x_dtype), x.new_empty(x.shape, dtype=torch.promote_types(x_dtype, table_dtype)),
            x.new_empty((x.numel() // H,), dtype=compute_dtype(x.new_empty((), dtype=x_dtype))))


@gated_residual_norm_fwd.register_kernel("cuda")
def _(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, row_order=None):
    kernels = kernels_take(x, gate, y, row_index, norm_weight, shift, scale, table_dtype)
    return forward(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, kernels)


@torch.library.custom_op("adaln_lab::gated_residual_norm_bwd", mutates_args=())
def gated_residual_norm_bwd(d_x_out: torch.Tensor, d_out: torch.Tensor, x_out: torch.Tensor, gate: torch.Tensor,
                            y: torch.Tensor, row_index: torch.Tensor, norm_weight: torch.Tensor,
                            shift: torch.Tensor, scale: torch.Tensor, rstd: torch.Tensor, table_dtype: torch.dtype,
                            x_dtype: torch.dtype, row_order: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor]:
    """(dx in x_dtype, d_gate (R, H), d_y, d_norm_weight (H,), d_shift (R, H), d_scale (R, H)) (module docstring);
    row_order: see `adaln_lab.row_order`."""
    _check_gradients(x_out, d_x_out=d_x_out, d_out=d_out)
    return backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, table_dtype, x_dtype,
                    None, False)


@gated_residual_norm_bwd.register_fake
def _(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, table_dtype, x_dtype,
      row_order=None):
    return (x_out.new_empty(x_out.shape, dtype=x_dtype), gate.new_empty(gate.shape), y.new_empty(y.shape),
            norm_weight.new_empty(norm_weight.shape), shift.new_empty(shift.shape), scale.new_empty(scale.shape))


@gated_residual_norm_bwd.register_kernel("cuda")
def _(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, table_dtype, x_dtype,
      row_order=None):
    _check_gradients(x_out, d_x_out=d_x_out, d_out=d_out)
    kernels = _bwd_kernels(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, table_dtype,
                           x_dtype)
    return backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, table_dtype,
                    x_dtype, row_order, kernels)


def _setup_context(ctx, inputs, output):
    x, gate, y, row_index, norm_weight, shift, scale, _, table_dtype, row_order = inputs
    x_out, _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.x_dtype, ctx.table_dtype = x.dtype, table_dtype
    ctx.save_for_backward(x_out, gate, y, row_index, norm_weight, shift, scale, rstd, row_order)


def _backward(ctx, d_x_out, d_out, d_rstd):
    x_out, gate, y, row_index, norm_weight, shift, scale, rstd, row_order = ctx.saved_tensors
    dx, d_gate, d_y, d_norm_weight, d_shift, d_scale = gated_residual_norm_bwd(
        d_x_out.contiguous(), d_out.contiguous(), x_out, gate, y, row_index, norm_weight, shift, scale, rstd,
        ctx.table_dtype, ctx.x_dtype, row_order)
    return dx, d_gate, d_y, None, d_norm_weight, d_shift, d_scale, None, None, None


gated_residual_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class GatedResidualNorm(torch.autograd.Function):
    """The lean eager path: forward(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, row_order,
    kernels, table=None, table_grad=None, row_table=None) -> (x_out, out); backward(d_x_out, d_out) -> dx, d_gate,
    d_y, d_norm_weight, d_shift, d_scale. A block passes its table and TableGradient with gate, shift and scale
    detached: their gradients go into the table gradient (`ops.table_gradient`); and its row table, which the
    kernels read instead of casting shift and scale."""

    @staticmethod
    def forward(ctx, x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, row_order, kernels,
                table=None, table_grad=None, row_table=None):
        x_out, out, rstd = forward(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, kernels,
                                   row_table)
        ctx.x_dtype, ctx.table_dtype, ctx.kernels, ctx.table_grad = x.dtype, table_dtype, kernels, table_grad
        ctx.save_for_backward(x_out, gate, y, row_index, norm_weight, shift, scale, rstd, row_order)
        return x_out, out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_x_out, d_out):
        x_out, gate, y, row_index, norm_weight, shift, scale, rstd, row_order = ctx.saved_tensors
        if d_out is None:  # out unused: zeros, as autograd hands the custom op
            d_out = torch.zeros_like(x_out)
        if d_x_out is None:
            d_x_out = torch.zeros_like(x_out)
        table_grad, d_table = ctx.table_grad, None
        # compiled autograd traces this backward: no writes into the table gradient, a tensor of its own instead
        in_place = table_grad is not None and not torch.compiler.is_compiling()
        dx, d_gate, d_y, d_norm_weight, d_shift, d_scale = backward(
            d_x_out.contiguous(), d_out.contiguous(), x_out, gate, y, row_index, norm_weight, shift, scale, rstd,
            ctx.table_dtype, ctx.x_dtype, row_order, ctx.kernels, (table_grad, GATE_MSA) if in_place else None)
        if table_grad is not None and not in_place:
            d_table = table_grad.as_table(GATE_MSA, d_gate, d_shift, d_scale)
            d_gate = d_shift = d_scale = None
        return dx, d_gate, d_y, None, d_norm_weight, d_shift, d_scale, None, None, None, None, d_table, None, None


def gated_residual_norm_op(x, gate, y, row_index, norm_weight, shift, scale, eps: float, table_dtype, row_order,
                           kernels: bool, table=None, table_grad=None, row_table=None):
    """Checked inputs: (x_out, out) by the custom op under torch.compile, else the eager node (kernels decided; a
    block's table, TableGradient and row table passed on)."""
    if torch.compiler.is_compiling():
        x_out, out, _ = gated_residual_norm_fwd(x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype,
                                                row_order)
        return x_out, out
    return apply(GatedResidualNorm, x, gate, y, row_index, norm_weight, shift, scale, eps, table_dtype, row_order,
                 kernels, table, table_grad, row_table)


def gated_residual_norm(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, norm_weight: torch.Tensor,
                        shift: torch.Tensor, scale: torch.Tensor, row_index: torch.Tensor, eps: float = 1e-5, *,
                        table_dtype: torch.dtype | None = None,
                        row_order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x_out = x + gate[row_index] * y` and `out = modulated_rms_norm(x_out, ...)`, differentiable, in one op.

    Args:
        x: (..., S, H) residual stream; y: (..., S, H) the branch output (attention), x's shape.
        gate, shift, scale: (R, H) table chunks (any strides), float32 holding `table_dtype` values.
        norm_weight: (H,) the RMSNorm's weight; eps its epsilon.
        row_index: (S,) int64 in [0, R): the table row of each row (for every leading index).
        table_dtype: the projection's dtype the chunks are cast back to (default x's).
        row_order: None, or `adaln_lab.row_order(row_index, R, H)` computed once for several ops (the CUDA
            backward's row order).

    Returns:
        (x_out, out), both (..., S, H): x_out of dtype promote_types(x, table_dtype, y), out of
        promote_types(x_out, table_dtype); diffusers' values for `x = x + gate * y; h = norm2(x) * ...`.
    """
    check_rows("gated_residual_norm", x, row_index, y=y, norm_weight=norm_weight, gate=gate, shift=shift,
               scale=scale)
    check_order("gated_residual_norm", row_order, row_index, gate.shape[0])
    table_dtype = x.dtype if table_dtype is None else table_dtype
    kernels = not torch.compiler.is_compiling() and kernels_take(x, gate, y, row_index, norm_weight, shift, scale,
                                                                  table_dtype)
    return gated_residual_norm_op(x, gate, y, row_index, norm_weight, shift, scale, float(eps), table_dtype,
                                  row_order, kernels)
