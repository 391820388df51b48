"""Ground truth for the blocks' AdaLN ops: diffusers' `MiniMaxH3TransformerBlock` replayed op for op, and
float64 goldens.

The AdaLN path of one block (diffusers 0.42, `transformer_minimax_h3.py`), attention and feed-forward
being any maps `attn`, `ff` of (..., S, H) tensors:

    table = adaln_proj.linear(silu(temb).to(weight.dtype))      (T, 18H), in the projection's dtype
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table.view(3T, 6H).chunk(6, -1)
    h = norm1(x) * (1 + scale_msa[row_index]) + shift_msa[row_index];  x = x + gate_msa[row_index] * attn(h)
    h = norm2(x) * (1 + scale_mlp[row_index]) + shift_mlp[row_index];  x = x + gate_mlp[row_index] * ff(h)

Shapes: temb (T, D); weight (18H, D), bias (18H,) (adaln_proj.linear); norm1_weight, norm2_weight (H,);
x (..., S, H); row_index (S,) int64 in [0, 3T), diffusers' `adaln_indices = timestep_indices * 3 +
token_tags`. Table row t holds the three modalities' six chunks: the (3T, 6H) view's row 3t + m is
modality m of timestep t, each chunk a (3T, H) view with row stride 6H. Broadcast: row s of every leading
index of x uses table row row_index[s].

- `replay_*`: diffusers' very ops in its order and dtypes (each product and sum rounded to the stream
  dtype); the ops' torch route (their launch ops' "torch" bodies) runs these functions.
- `golden_*`: the same functions in float64 on the upcast inputs, rounding nowhere; differentiable, the
  accuracy reference for gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .final_adaln_out import rms_norm, table_reference

MODALITIES = 3
_NARROW = frozenset((torch.bfloat16, torch.float16, torch.float32))  # promote_types(dtype, float32) is float32
CHUNKS = ("shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp")


def table_dtype_of(weight: torch.Tensor) -> torch.dtype:
    """The dtype of `modulation_table`'s output: float32, or float64 for float64 parameters (exact upcast)."""
    dtype = weight.dtype
    return torch.float32 if dtype in _NARROW else torch.promote_types(dtype, torch.float32)  # no call (host time)


replay_table = table_reference
"""diffusers' `adaln_proj` table: `linear(silu(temb).to(weight.dtype), weight, bias)`, (T, N) in weight's dtype
(SiLU at temb's own precision, then one cast): norm_out's `reference.table_reference`, any N."""


def table_chunks(table: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, ...]:
    """The six (3T, H) chunks of a (T, 18H) table, diffusers' `view(-1, 6H).chunk(6, dim=-1)` (views, row
    stride 6H), in `CHUNKS` order."""
    return table.view(-1, 6 * hidden_size).chunk(6, dim=-1)


def replay_modulated_rms_norm(x, norm_weight, shift, scale, row_index, eps, norm=rms_norm):
    """`norm(x) * (1 + scale[row_index]) + shift[row_index]` as diffusers computes it: `F.rms_norm` (x's dtype),
    then `1 + scale` in the table's dtype, the product and the sum in the promoted dtype, each rounded.
    shift, scale (R, H) in the table's dtype; x (..., S, H); row_index (S,). `norm`: rms_norm's stand-in, same bits
    (the exact-gradient block's recording norm)."""
    normed = norm(x, norm_weight, eps)
    return normed * (1.0 + scale.index_select(0, row_index)) + shift.index_select(0, row_index)


def replay_gated_residual(x, gate, y, row_index):
    """`x + gate[row_index] * y` as diffusers computes it (the product rounded, then the sum). gate (R, H) in
    the table's dtype; x, y (..., S, H); row_index (S,)."""
    return x + gate.index_select(0, row_index) * y


def replay_block_adaln(x, temb, weight, bias, norm1_weight, norm2_weight, row_index, attn, ff,
                       eps1: float = 1e-5, eps2: float = 1e-5):
    """One block's forward with `attn` and `ff` as given, diffusers' ops in diffusers' order (module docstring).
    Differentiable by torch autograd, so its gradients are diffusers' gradients."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table_chunks(
        replay_table(temb, weight, bias), x.shape[-1])
    h = replay_modulated_rms_norm(x, norm1_weight, shift_msa, scale_msa, row_index, eps1)
    x = replay_gated_residual(x, gate_msa, attn(h), row_index)
    h = replay_modulated_rms_norm(x, norm2_weight, shift_mlp, scale_mlp, row_index, eps2)
    return replay_gated_residual(x, gate_mlp, ff(h), row_index)


def _f64(*tensors):
    return tuple(t.to(torch.float64) for t in tensors)


def golden_table(temb, weight, bias):
    """float64 `linear(silu(temb), weight, bias)`, (T, N), no rounding."""
    temb, weight, bias = _f64(temb, weight, bias)
    return F.linear(F.silu(temb), weight, bias)


def golden_modulated_rms_norm(x, norm_weight, shift, scale, row_index, eps):
    """float64 `x * rsqrt(mean(x^2) + eps) * norm_weight * (1 + scale[i]) + shift[i]`, no rounding."""
    x, norm_weight, shift, scale = _f64(x, norm_weight, shift, scale)
    normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight
    return normed * (1.0 + scale[row_index]) + shift[row_index]


def golden_gated_residual(x, gate, y, row_index):
    """float64 `x + gate[row_index] * y`, no rounding."""
    x, gate, y = _f64(x, gate, y)
    return x + gate[row_index] * y


def golden_block_adaln(x, temb, weight, bias, norm1_weight, norm2_weight, row_index, attn, ff,
                       eps1: float = 1e-5, eps2: float = 1e-5):
    """`replay_block_adaln` in float64 on the upcast inputs (attn and ff receive and return float64 tensors)."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table_chunks(
        golden_table(temb, weight, bias), x.shape[-1])
    x = x.to(torch.float64)
    h = golden_modulated_rms_norm(x, norm1_weight, shift_msa, scale_msa, row_index, eps1)
    x = golden_gated_residual(x, gate_msa, attn(h), row_index)
    h = golden_modulated_rms_norm(x, norm2_weight, shift_mlp, scale_mlp, row_index, eps2)
    return golden_gated_residual(x, gate_mlp, ff(h), row_index)
