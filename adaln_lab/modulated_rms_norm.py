"""`modulated_rms_norm`: an H3 block's `norm(x) * (1 + scale[row_index]) + shift[row_index]` as a custom op.

    out = modulated_rms_norm(x (..., S, H), norm_weight (H,), shift (R, H), scale (R, H), row_index (S,), eps)

Broadcast: row s of every leading index of x is modulated by table row row_index[s] (R = 3T table rows
for a block: `adaln_indices = timestep_indices * 3 + token_tags`). shift and scale are usually column
chunks of `modulation_table`'s (T, 18H) float32 table viewed (3T, 6H): any strides, float32 holding values
of the projection's dtype `table_dtype` (default x's dtype). The forward casts them back to `table_dtype`
(exact) and replays diffusers (`F.rms_norm` in x's dtype, `1 + scale` in table_dtype, then the product and
`+ shift`, each rounded), so it is diffusers' output bit for bit on the CPU; out has dtype
promote_types(x.dtype, table_dtype).

Layers (as `adaln_lab.cuda_op`):
- `torch.ops.adaln_lab.modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, eps, table_dtype)
  -> (out (..., S, H), rstd (rows,))` and `torch.ops.adaln_lab.modulated_rms_norm_bwd(dy, x, norm_weight,
  shift, scale, row_index, rstd, d_residual=None) -> (dx, d_norm_weight, d_shift, d_scale)` (with d_residual,
  x's shape, dx is the norm's dx plus d_residual, added in x's dtype): custom ops with fake kernels and
  `register_autograd`. rows = x.numel() / H; rstd = rsqrt(mean(x^2) + eps) per row, in
  promote_types(x.dtype, float32).
- `modulated_rms_norm_and_residual(x, ...) -> (out, x)`: the norm, and x itself handed on down the residual
  stream, whose gradient is summed inside the norm's backward (an autograd.Function over the two ops).
- Default (CPU) kernels, torch code: the forward is the replay; the backward the exact derivative of
  the unrounded function at the given inputs (the forward's roundings, of `1 + scale` and of the
  normalised rows, left out: the float64 golden's derivative), per row in float32 (float64 for float64 x):
      xhat = x * rstd,  g = dy * (1 + scale[i]) * norm_weight,  dx = rstd * (g - xhat * mean(g * xhat))
  (dx of a row depends on that row only), and the parameter sums in float64, each in a fixed order
  (rows in order into their table row, then table rows in order), rounded once:
      d_shift[r] = sum_{i(s)=r} dy,  d_scale[r] = norm_weight * sum_{i(s)=r} dy * xhat,
      d_norm_weight = sum_r (1 + scale[r]) * sum_{i(s)=r} dy * xhat.
- CUDA kernels (`adaln_lab.block_cuda`: norm_out's row kernels with the R table rows as timesteps) for
  bf16 x, norm_weight and table_dtype with supported shapes; anything else runs the torch code.

Gradients: dx in x's dtype, d_norm_weight in norm_weight's, d_shift / d_scale (R, H) in shift's / scale's
(float32 for the table's chunks, so autograd adds the chunks' gradients into the table in float32).
"""

from __future__ import annotations

import torch

from .block_reference import replay_modulated_rms_norm
from .row_order import check_order


def _rows_index(row_index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The table row of each of the x.numel() / H rows of x (row_index repeated over the leading dims)."""
    S, H = x.shape[-2], x.shape[-1]
    lead = x.numel() // H // S if S else 0
    return row_index.repeat(lead) if S else row_index


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _fwd_torch(x, norm_weight, shift, scale, row_index, eps, table_dtype):
    out = replay_modulated_rms_norm(x, norm_weight, shift.to(table_dtype), scale.to(table_dtype), row_index, eps)
    xc = x.to(_compute_dtype(x)).reshape(-1, x.shape[-1])
    rstd = torch.rsqrt(xc.pow(2).mean(dim=-1) + eps)
    return out.contiguous(), rstd


def _check_residual(x, d_residual) -> None:
    if d_residual is not None and d_residual.shape != x.shape:
        raise ValueError(f"modulated_rms_norm_bwd needs d_residual of x's shape {tuple(x.shape)}, got "
                         f"{tuple(d_residual.shape)}")


def _bwd_torch(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None):
    _check_residual(x, d_residual)
    H, R = x.shape[-1], shift.shape[0]
    c = rstd.dtype
    idx = _rows_index(row_index, x)
    xc, dyc = x.to(c).reshape(-1, H), dy.to(c).reshape(-1, H)
    xhat = xc * rstd[:, None]
    g = dyc * (1.0 + scale.to(c)).index_select(0, idx) * norm_weight.to(c)
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    f64 = torch.float64
    a = torch.zeros(R, H, dtype=f64, device=x.device).index_add_(0, idx, (dyc * xhat).to(f64))
    b = torch.zeros(R, H, dtype=f64, device=x.device).index_add_(0, idx, dyc.to(f64))
    d_scale = norm_weight.to(f64) * a
    d_norm_weight = ((1.0 + scale.to(f64)) * a).sum(0)
    dx = dx.to(x.dtype).reshape(x.shape).contiguous()
    if d_residual is not None:
        dx = dx + d_residual.to(x.dtype)  # autograd's sum of x's two gradients
    return dx, d_norm_weight.to(norm_weight.dtype), b.to(shift.dtype), d_scale.to(scale.dtype)


def _kernels_refuse(x, table_rows, table_dtype, *others, **bf16_tensors) -> bool:
    """Whether the CUDA kernels cannot take these inputs: a table dtype other than bf16, `block_cuda`'s rule
    for x and the bf16 tensors, or any tensor (`others` too) off x's device (torch's code then raises)."""
    from . import block_cuda

    if table_dtype != torch.bfloat16 or any(t.device != x.device for t in (*others, *bf16_tensors.values())):
        return True
    return block_cuda.unsupported_rows(x, table_rows, **bf16_tensors) is not None


@torch.library.custom_op("adaln_lab::modulated_rms_norm_fwd", mutates_args=())
def modulated_rms_norm_fwd(x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                           row_index: torch.Tensor, eps: float,
                           table_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (..., S, H), rstd (rows,)): diffusers' replay and the rows' rstd (module docstring)."""
    return _fwd_torch(x, norm_weight, shift, scale, row_index, eps, table_dtype)


@modulated_rms_norm_fwd.register_fake
def _(x, norm_weight, shift, scale, row_index, eps, table_dtype):
    H = x.shape[-1]
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, table_dtype)),
            x.new_empty((x.numel() // H,), dtype=_compute_dtype(x)))


@modulated_rms_norm_fwd.register_kernel("cuda")
def _(x, norm_weight, shift, scale, row_index, eps, table_dtype):
    if _kernels_refuse(x, shift.shape[0], table_dtype, shift, scale, row_index, norm_weight=norm_weight):
        return _fwd_torch(x, norm_weight, shift, scale, row_index, eps, table_dtype)
    from . import block_cuda

    with torch.cuda.device(x.device):
        return block_cuda.modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, eps)


@torch.library.custom_op("adaln_lab::modulated_rms_norm_bwd", mutates_args=())
def modulated_rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, shift: torch.Tensor,
                           scale: torch.Tensor, row_index: torch.Tensor, rstd: torch.Tensor,
                           d_residual: torch.Tensor | None = None, row_order: torch.Tensor | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx (..., S, H), d_norm_weight (H,), d_shift (R, H), d_scale (R, H)) (module docstring); with d_residual
    (x's shape) dx is the norm's dx plus d_residual, added in x's dtype as autograd would. row_order: see
    `adaln_lab.row_order` (the CUDA kernels' row order, sorted here when None; the torch code ignores it)."""
    return _bwd_torch(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual)


@modulated_rms_norm_bwd.register_fake
def _(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None, row_order=None):
    return (x.new_empty(x.shape), norm_weight.new_empty(norm_weight.shape), shift.new_empty(shift.shape),
            scale.new_empty(scale.shape))


@modulated_rms_norm_bwd.register_kernel("cuda")
def _(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None, row_order=None):
    # dy is bf16 exactly when the forward's output was, i.e. when the forward ran the kernels
    _check_residual(x, d_residual)
    more = {} if d_residual is None else {"d_residual": d_residual}
    if (_kernels_refuse(x, shift.shape[0], torch.bfloat16, shift, scale, row_index, rstd, norm_weight=norm_weight,
                        dy=dy, **more) or rstd.dtype != torch.float32):
        return _bwd_torch(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual)
    from . import block_cuda

    with torch.cuda.device(x.device):
        dx, d_norm_weight, d_shift, d_scale = block_cuda.modulated_rms_norm_bwd(dy, x, norm_weight, shift, scale,
                                                                               row_index, rstd, d_residual,
                                                                               order=row_order)
    return dx, d_norm_weight, d_shift.to(shift.dtype), d_scale.to(scale.dtype)


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


class _NormKeepingX(torch.autograd.Function):
    """(out, x): the modulated norm of x and x itself (returned as is: autograd gives the caller a view), so
    that x's gradient from the residual stream reaches this backward, which sums it inside the norm's row
    pass (`modulated_rms_norm_bwd(..., d_residual)`) instead of autograd adding it in a kernel of its own."""

    @staticmethod
    def forward(ctx, x, norm_weight, shift, scale, row_index, eps, table_dtype, row_order):
        out, rstd = modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, eps, table_dtype)
        ctx.save_for_backward(x, norm_weight, shift, scale, row_index, rstd, row_order)
        return out, x

    @staticmethod
    def backward(ctx, d_out, d_x):
        x, norm_weight, shift, scale, row_index, rstd, row_order = ctx.saved_tensors
        grads = modulated_rms_norm_bwd(d_out.contiguous(), x, norm_weight, shift, scale, row_index, rstd,
                                       d_x.to(x.dtype).contiguous(), row_order)
        return (*grads, None, None, None, None)


def check_rows(op: str, x: torch.Tensor, row_index: torch.Tensor, *, y: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, **tables: torch.Tensor) -> None:
    """Raise ValueError / TypeError naming the argument unless x (..., S, H), row_index (S,) int64, each
    table argument (R, H) (one R for all) and, where given, y (x's shape, floating point) and norm_weight
    (H,) fit."""
    if x.dim() < 2:
        raise ValueError(f"{op} needs x of shape (..., S, H), got {tuple(x.shape)}")
    S, H = x.shape[-2], x.shape[-1]
    if row_index.shape != (S,):
        raise ValueError(f"{op} needs row_index of shape (S,) = ({S},), got {tuple(row_index.shape)}")
    if row_index.dtype != torch.int64:
        raise TypeError(f"{op} needs row_index of dtype int64, got {row_index.dtype}")
    rows = {t.shape[0] for t in tables.values() if t.dim() == 2}
    for name, t in tables.items():
        if t.dim() != 2 or t.shape[1] != H or len(rows) != 1:
            raise ValueError(f"{op} needs {', '.join(tables)} of one shape (R, H) with H = {H}, got {name} "
                             f"{tuple(t.shape)}")
    if y is not None and y.shape != x.shape:
        raise ValueError(f"{op} needs y of x's shape {tuple(x.shape)}, got {tuple(y.shape)}")
    if norm_weight is not None and norm_weight.shape != (H,):
        raise ValueError(f"{op} needs norm_weight of shape ({H},), got {tuple(norm_weight.shape)}")
    for name, t in (("x", x), *tables.items(), *((("y", y),) if y is not None else ())):
        if not t.dtype.is_floating_point:
            raise TypeError(f"{op} needs a floating-point {name}, got {t.dtype}")


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
    return modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, float(eps), table_dtype)[0]


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
    return _NormKeepingX.apply(x, norm_weight, shift, scale, row_index, float(eps), table_dtype, row_order)
