"""`gated_residual`: an H3 block's `x + gate[row_index] * y` as a custom op.

    out = gated_residual(x (..., S, H), gate (R, H), y (..., S, H), row_index (S,))

Broadcast: row s of every leading index uses table row row_index[s]; y has x's shape (the attention or
feed-forward output). gate is usually a column chunk of `modulation_table`'s float32 table viewed
(3T, 6H) (any strides), holding values of the projection's dtype `table_dtype` (default x's dtype). The
forward casts it back (exact) and replays diffusers: the product `gate[i] * y` rounded to its dtype, then
the sum, so it is diffusers' output bit for bit on the CPU; out has dtype promote_types(x, table_dtype, y).

Layers (as `adaln_lab.ops.final_adaln_out`):
- `torch.ops.adaln_lab.gated_residual_fwd(x, gate, y, row_index, table_dtype) -> out` and
  `torch.ops.adaln_lab.gated_residual_bwd(dout, gate, y, row_index, table_dtype) -> (d_gate (R, H), d_y)`: custom ops
  with fake kernels and `register_autograd`. A custom op's outputs cannot alias its inputs, so the
  backward op leaves dx out and the autograd formula passes dout itself on as dx (cast to x's dtype
  if they differ): the residual's gradient is the identity, with no copy.
- Default (CPU) kernels, torch code: the forward is the replay; the backward is the exact derivative
  (`reference.backward.gated_residual_backward`): d_y = dout * gate[i] (gate in table_dtype as in the
  forward; one rounding to y's dtype), d_gate[r] = sum_{i(s)=r} dout * y (float64, rows in order, rounded
  once to gate's dtype).
- CUDA kernels (`adaln_lab.core.tensors`: gated_residual.cu, ordered per-range sums) for bf16 x, y and
  table_dtype with supported shapes (`support.rows`); anything else runs the torch code.
- `GatedResidual`: the lean eager path, one autograd.Function straight onto the same implementations.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..core import tensors
from ..reference.backward import gated_residual_backward
from ..reference.block import replay_gated_residual
from ..core import support
from ..core.checks import check_order, check_rows
from .eager import apply
from .table_gradient import GATE_MLP


def kernels_take(x, gate, y, row_index, table_dtype, **more) -> bool:
    """Whether gated_residual.cu runs: bf16 table dtype, x, y (and `more`) bf16 on x's CUDA device."""
    return (table_dtype == torch.bfloat16 and x.is_cuda
            and support.on_device(x, gate=gate, row_index=row_index) is None
            and support.rows(x, gate.shape[0], y=y, **more) is None)


def forward(x, gate, y, row_index, table_dtype, kernels: bool) -> torch.Tensor:
    """out (..., S, H): gated_residual.cu where `kernels`, else diffusers' replay."""
    if kernels:
        return tensors.gated_residual_fwd(x, gate, y, row_index)
    return replay_gated_residual(x, gate.to(table_dtype), y, row_index).contiguous()


def backward(dout, gate, y, row_index, table_dtype, row_order, kernels: bool, into=None):
    """(d_gate (R, H) in gate's dtype, d_y): the kernels (in row_order) where `kernels`, else the reference. into:
    None, or (TableGradient, chunk): d_gate then goes into that chunk's columns and comes back None."""
    if kernels:
        d_gate, d_y = tensors.gated_residual_bwd(dout, gate, y, row_index, order=row_order,
                                                 into=None if into is None else into[0].pointer(into[1], 1),
                                                 workspace=None if into is None else into[0].workspace(into[1]))
        return (None if into is not None else tensors.as_dtype(d_gate, gate.dtype)), d_y
    d_gate, d_y = gated_residual_backward(dout, gate, y, row_index, table_dtype)
    if into is None:
        return d_gate, d_y
    into[0].write(into[1], d_gate)
    return None, d_y


@torch.library.custom_op("adaln_lab::gated_residual_fwd", mutates_args=())
def gated_residual_fwd(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor,
                       table_dtype: torch.dtype, row_order: torch.Tensor | None = None) -> torch.Tensor:
    """out (..., S, H) = x + gate[row_index] * y, diffusers' rounding (module docstring); row_order is only
    kept for the backward."""
    return forward(x, gate, y, row_index, table_dtype, False)


@gated_residual_fwd.register_fake
def _(x, gate, y, row_index, table_dtype, row_order=None):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, torch.promote_types(table_dtype, y.dtype)))


@gated_residual_fwd.register_kernel("cuda")
def _(x, gate, y, row_index, table_dtype, row_order=None):
    return forward(x, gate, y, row_index, table_dtype, kernels_take(x, gate, y, row_index, table_dtype))


@torch.library.custom_op("adaln_lab::gated_residual_bwd", mutates_args=())
def gated_residual_bwd(dout: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor,
                       table_dtype: torch.dtype, row_order: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate (R, H) in gate's dtype, d_y (..., S, H) in y's dtype) (module docstring); row_order: see
    `adaln_lab.row_order` (the CUDA kernels' row order, sorted here when None; the torch code ignores it)."""
    return backward(dout, gate, y, row_index, table_dtype, row_order, False)


@gated_residual_bwd.register_fake
def _(dout, gate, y, row_index, table_dtype, row_order=None):
    return gate.new_empty(gate.shape), y.new_empty(y.shape)


@gated_residual_bwd.register_kernel("cuda")
def _(dout, gate, y, row_index, table_dtype, row_order=None):
    # dout is bf16 exactly when the forward's output was (bf16 x, y and table dtype)
    kernels = kernels_take(y, gate, y, row_index, table_dtype, dout=dout)
    return backward(dout, gate, y, row_index, table_dtype, row_order, kernels)


def _setup_context(ctx, inputs, output):
    x, gate, y, row_index, table_dtype, row_order = inputs
    ctx.x_dtype, ctx.table_dtype = x.dtype, table_dtype
    ctx.save_for_backward(gate, y, row_index, row_order)


def _backward(ctx, dout):
    gate, y, row_index, row_order = ctx.saved_tensors
    d_gate, d_y = gated_residual_bwd(dout.contiguous(), gate, y, row_index, ctx.table_dtype, row_order)
    return dout.to(ctx.x_dtype), d_gate, d_y, None, None, None


gated_residual_fwd.register_autograd(_backward, setup_context=_setup_context)


class GatedResidual(torch.autograd.Function):
    """The lean eager path: forward(x, gate, y, row_index, table_dtype, row_order, kernels, table=None,
    table_grad=None) -> out; backward(dout) -> dx (dout itself, in x's dtype: the residual's identity), d_gate,
    d_y. A block passes its table and TableGradient with gate detached: d_gate goes into the table gradient
    (`ops.table_gradient`)."""

    @staticmethod
    def forward(ctx, x, gate, y, row_index, table_dtype, row_order, kernels, table=None, table_grad=None):
        ctx.x_dtype, ctx.table_dtype, ctx.kernels, ctx.table_grad = x.dtype, table_dtype, kernels, table_grad
        ctx.save_for_backward(gate, y, row_index, row_order)
        return forward(x, gate, y, row_index, table_dtype, kernels)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        gate, y, row_index, row_order = ctx.saved_tensors
        dout = dout.contiguous()
        table_grad, d_table = ctx.table_grad, None
        # compiled autograd traces this backward: no writes into the table gradient, a tensor of its own instead
        in_place = table_grad is not None and not torch.compiler.is_compiling()
        d_gate, d_y = backward(dout, gate, y, row_index, ctx.table_dtype, row_order, ctx.kernels,
                               (table_grad, GATE_MLP) if in_place else None)
        if table_grad is not None and not in_place:
            d_table, d_gate = table_grad.as_table(GATE_MLP, d_gate), None
        return tensors.as_dtype(dout, ctx.x_dtype), d_gate, d_y, None, None, None, None, d_table, None


def gated_residual_op(x, gate, y, row_index, table_dtype, row_order, kernels: bool, table=None,
                      table_grad=None) -> torch.Tensor:
    """Checked inputs: the custom op under torch.compile, else the eager node (kernels decided; a block's table and
    TableGradient passed on)."""
    if torch.compiler.is_compiling():
        return gated_residual_fwd(x, gate, y, row_index, table_dtype, row_order)
    return apply(GatedResidual, x, gate, y, row_index, table_dtype, row_order, kernels, table, table_grad)


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor, *,
                   table_dtype: torch.dtype | None = None, row_order: torch.Tensor | None = None) -> torch.Tensor:
    """`x + gate[row_index] * y` with diffusers' rounding, differentiable.

    Args:
        x: (..., S, H) residual stream, any float dtype (the CUDA kernels take bf16).
        gate: (R, H) table chunk (any strides), float32 holding `table_dtype` values.
        y: (..., S, H) the branch output (attention or feed-forward), x's shape.
        row_index: (S,) int64 in [0, R): the table row of each row of x (for every leading index).
        table_dtype: the projection's dtype gate is cast back to before diffusers' ops (default x's).
        row_order: None, or `adaln_lab.row_order(row_index, R, H)` computed once for several ops (the CUDA
            backward's row order).

    Returns:
        (..., S, H) tensor of dtype promote_types(x.dtype, table_dtype, y.dtype), diffusers' output.
    """
    check_rows("gated_residual", x, row_index, y=y, gate=gate)
    check_order("gated_residual", row_order, row_index, gate.shape[0])
    table_dtype = x.dtype if table_dtype is None else table_dtype
    compiling = torch.compiler.is_compiling()  # the custom op then decides inside
    return gated_residual_op(x, gate, y, row_index, table_dtype, row_order,
                             not compiling and kernels_take(x, gate, y, row_index, table_dtype))
