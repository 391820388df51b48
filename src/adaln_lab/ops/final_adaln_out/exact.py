"""norm_out's cross-row sums as exact states: the same bits for any order of the rows and any split into parts.

Per row r of table row t = timestep_indices[s] (s the row's position in its sequence), the float32 terms the
row alone gives (the CUDA row pass's: xhat = x rstd, rstd the forward's `rms_norm` one, products rounded to
float32 as written):

    shift term   dy_r                          d_shift[t]     = float32(exact sum over the rows of t)
    scale term   (dy_r xhat_r) norm_weight     d_scale[t]     = float32(exact sum over the rows of t)
    weight term  (dy_r xhat_r) (1 + scale[t])  d_norm_weight  = exact sum over every row, rounded once
    d_bias[j] = the exact sum over every row of the table terms of column j (d_shift | d_scale), rounded once.

    sums = NormOutSums(T, H)
    sums.add(x, dy, norm_weight, table_f32, timestep_indices, eps)   # a part's rows (any number of calls)
    sums.merge(other)                                                # another part's state, in any order
    d_table, d_norm_weight, d_bias = sums.gradients(torch.bfloat16)  # (T, 2H) fp32, (H,), (2H,) rounded once

Shapes: x, dy (..., S, H); norm_weight (H,); table_f32 (T, 2H) float32 (shift | scale); timestep_indices (S,)
int64 in [0, T). The states are integers (core.exact.ExactSum), so merging parts is associative: micro-batches and
ranks give one answer. The CPU reference of the exact-gradient contract; the kernels are to give its bits.
"""

from __future__ import annotations

import torch

from ...core.exact import ExactSum
from ...reference.backward import rows_index
from ...reference.final_adaln_out import replay, table_rows


def normed_terms(x, dy, eps):
    """(rows, H) float32 float32(dy_r float32(x_r rstd_r)), rstd_r = rsqrt(mean(x_r^2) + eps) in float32, and dy's
    rows in float32: each row's own (x, dy (..., S, H)). A norm weight's per-row terms."""
    H = x.shape[-1]
    xf, g = x.reshape(-1, H).float(), dy.reshape(-1, H).float()
    return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)), g


def row_terms(x, dy, norm_weight, table_f32, timestep_indices, eps):
    """(rows, 2H) table terms (shift | scale), (rows, H) weight terms, (rows,) table rows t: float32, per row."""
    H = x.shape[-1]
    p, g = normed_terms(x, dy, eps)
    t = rows_index(timestep_indices, x)
    table = torch.cat([g, p * norm_weight.float()], dim=1)
    return table, p * (1.0 + table_f32[t, H:]), t


class NormOutSums:
    """Exact states of norm_out's cross-row sums (module docstring): `table` (T, 2H), `norm_weight` (H,)."""

    def __init__(self, T: int, H: int, device=None):
        self.table = ExactSum((T, 2 * H), device)
        self.norm_weight = ExactSum((H,), device)

    def add(self, x, dy, norm_weight, table_f32, timestep_indices, eps: float = 1e-5) -> "NormOutSums":
        """Add the rows of x and dy (..., S, H) (their terms, module docstring)."""
        table, weight, t = row_terms(x, dy, norm_weight, table_f32, timestep_indices, eps)
        self.table.add(table, t)
        self.norm_weight.add(weight)
        return self

    def merge(self, other: "NormOutSums") -> "NormOutSums":
        """Add another part's states (any order of merging gives the same state)."""
        self.table.merge(other.table)
        self.norm_weight.merge(other.norm_weight)
        return self

    def gradients(self, dtype: torch.dtype = torch.bfloat16):
        """(d_table (T, 2H) float32, d_norm_weight (H,), d_bias (2H,)) in `dtype`, each rounded once from its
        exact sum."""
        return self.table.value(torch.float32), self.norm_weight.value(dtype), self.table.total().value(dtype)


class ExactNormOut(torch.autograd.Function):
    """norm_out recording its exact sums (inside `adaln_lab.nn.ExactGradients`): forward(x, norm_weight, temb, weight,
    bias, timestep_indices, eps, recorder, params) -> the replay's out on the table computed a row at a time
    (`table_rows`: diffusers' bits for each row alone); backward(dy) -> dx (the replay's, at once)
    and no other gradient: the recorder gets this part's NormOutSums under `params` (the caller's norm_weight,
    weight, bias) and writes them all once (`ExactGradients.write`). temb comes detached: the recorder keeps the
    caller's (`keep_temb`) and sends d_temb through it when it writes."""

    @staticmethod
    def forward(ctx, x, norm_weight, temb, weight, bias, timestep_indices, eps, recorder, params):
        table = table_rows(temb, weight, bias)  # each row's bits whatever T (the parts may hold other timesteps)
        out = replay(x, norm_weight, temb, weight, bias, timestep_indices, eps, table=table)
        ctx.save_for_backward(x, norm_weight, temb, table, timestep_indices)
        ctx.eps, ctx.recorder, ctx.params = eps, recorder, params
        return out

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, temb, table, timestep_indices = ctx.saved_tensors
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            out = replay(xg, norm_weight.detach(), temb, None, None, timestep_indices, ctx.eps, table=table)
            (dx,) = torch.autograd.grad(out, xg, dy)
        with torch.no_grad():
            sums = NormOutSums(temb.shape[0], x.shape[-1], x.device).add(x, dy, norm_weight, table.float(),
                                                                         timestep_indices, ctx.eps)
        ctx.recorder.add_norm_out(ctx.params, temb, sums)
        return dx, None, None, None, None, None, None, None, None
