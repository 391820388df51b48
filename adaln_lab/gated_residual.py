"""`gated_residual`: an H3 block's `x + gate[row_index] * y` as a custom op.

    out = gated_residual(x (..., S, H), gate (R, H), y (..., S, H), row_index (S,))

Broadcast: row s of every leading index uses table row row_index[s]; y has x's shape (the attention or
feed-forward output). gate is usually a column chunk of `modulation_table`'s float32 table viewed
(3T, 6H) (any strides), holding values of the projection's dtype `table_dtype` (default x's dtype). The
forward casts it back (exact) and replays diffusers: the product `gate[i] * y` rounded to its dtype, then
the sum, so it is diffusers' output bit for bit on the CPU; out has dtype promote_types(x, table_dtype, y).

Layers (as `adaln_lab.cuda_op`):
- `torch.ops.adaln_lab.gated_residual_fwd(x, gate, y, row_index, table_dtype) -> out` and
  `torch.ops.adaln_lab.gated_residual_bwd(dout, gate, y, row_index, table_dtype) -> (d_gate (R, H), d_y)`: custom ops
  with fake kernels and `register_autograd`. A custom op's outputs cannot alias its inputs, so the
  backward op leaves dx out and the autograd formula passes dout itself on as dx (cast to x's dtype
  if they differ): the residual's gradient is the identity, with no copy.
- Default (CPU) kernels, torch code: the forward is the replay; the backward is the exact derivative,
      d_y = dout * gate[i]  (gate in table_dtype as in the forward; one rounding to y's dtype: torch's own),
      d_gate[r] = sum_{i(s)=r} dout * y  (float64, rows in order, rounded once to gate's dtype).
- CUDA kernels (`adaln_lab.block_cuda`: gated_residual.cu, ordered per-range sums) for bf16 x, y and
  table_dtype with supported shapes; anything else runs the torch code.
"""

from __future__ import annotations

import torch

from .block_reference import replay_gated_residual
from .modulated_rms_norm import _kernels_refuse, _rows_index, check_rows
from .row_order import check_order


def _fwd_torch(x, gate, y, row_index, table_dtype):
    return replay_gated_residual(x, gate.to(table_dtype), y, row_index).contiguous()


def _bwd_torch(dout, gate, y, row_index, table_dtype):
    H, R = y.shape[-1], gate.shape[0]
    c = torch.promote_types(torch.promote_types(dout.dtype, y.dtype), torch.promote_types(gate.dtype, torch.float32))
    idx = _rows_index(row_index, y)
    doutc = dout.to(c).reshape(-1, H)
    d_y = (doutc * gate.to(table_dtype).to(c).index_select(0, idx)).to(y.dtype).reshape(y.shape).contiguous()
    f64 = torch.float64
    d_gate = torch.zeros(R, H, dtype=f64, device=y.device).index_add_(0, idx, doutc.to(f64) * y.reshape(-1, H).to(f64))
    return d_gate.to(gate.dtype), d_y


@torch.library.custom_op("adaln_lab::gated_residual_fwd", mutates_args=())
def gated_residual_fwd(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor,
                       table_dtype: torch.dtype, row_order: torch.Tensor | None = None) -> torch.Tensor:
    """out (..., S, H) = x + gate[row_index] * y, diffusers' rounding (module docstring); row_order is only
    kept for the backward."""
    return _fwd_torch(x, gate, y, row_index, table_dtype)


@gated_residual_fwd.register_fake
def _(x, gate, y, row_index, table_dtype, row_order=None):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, torch.promote_types(table_dtype, y.dtype)))


@gated_residual_fwd.register_kernel("cuda")
def _(x, gate, y, row_index, table_dtype, row_order=None):
    if _kernels_refuse(x, gate.shape[0], table_dtype, gate, row_index, y=y):
        return _fwd_torch(x, gate, y, row_index, table_dtype)
    from . import block_cuda

    with torch.cuda.device(x.device):
        return block_cuda.gated_residual_fwd(x, gate, y, row_index)


@torch.library.custom_op("adaln_lab::gated_residual_bwd", mutates_args=())
def gated_residual_bwd(dout: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, row_index: torch.Tensor,
                       table_dtype: torch.dtype, row_order: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate (R, H) in gate's dtype, d_y (..., S, H) in y's dtype) (module docstring); row_order: see
    `adaln_lab.row_order` (the CUDA kernels' row order, sorted here when None; the torch code ignores it)."""
    return _bwd_torch(dout, gate, y, row_index, table_dtype)


@gated_residual_bwd.register_fake
def _(dout, gate, y, row_index, table_dtype, row_order=None):
    return gate.new_empty(gate.shape), y.new_empty(y.shape)


@gated_residual_bwd.register_kernel("cuda")
def _(dout, gate, y, row_index, table_dtype, row_order=None):
    # dout is bf16 exactly when the forward's output was (bf16 x, y and table dtype)
    if _kernels_refuse(y, gate.shape[0], table_dtype, gate, row_index, dout=dout):
        return _bwd_torch(dout, gate, y, row_index, table_dtype)
    from . import block_cuda

    with torch.cuda.device(y.device):
        d_gate, d_y = block_cuda.gated_residual_bwd(dout, gate, y, row_index, order=row_order)
    return d_gate.to(gate.dtype), d_y


def _setup_context(ctx, inputs, output):
    x, gate, y, row_index, table_dtype, row_order = inputs
    ctx.x_dtype, ctx.table_dtype = x.dtype, table_dtype
    ctx.save_for_backward(gate, y, row_index, row_order)


def _backward(ctx, dout):
    gate, y, row_index, row_order = ctx.saved_tensors
    d_gate, d_y = gated_residual_bwd(dout.contiguous(), gate, y, row_index, ctx.table_dtype, row_order)
    return dout.to(ctx.x_dtype), d_gate, d_y, None, None, None


gated_residual_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    return gated_residual_fwd(x, gate, y, row_index, table_dtype, row_order)
