"""An H3 block's AdaLN recording its exact cross-row sums (inside `adaln_lab.nn.ExactGradients`; the torch route).

The forward is diffusers' (`reference.block.replay_block_adaln` on detached copies of the parameters and temb, its
table computed a temb row at a time: each row diffusers' bits for that row alone, whatever T), so x's, attn's and
ff's gradients are diffusers' autograd's, and nothing reaches the AdaLN parameters or temb: hooks keep each of
their cross-row sums as an exact state (`core.exact.ExactSum`) of per-row float32 terms,
each the row's own:

    chunk c of table row r = row_index[s]   the gradient of row s's gathered chunk (autograd's, table dtype)
    norm1_weight, norm2_weight              float32(dy_s float32(x_s rstd_s)), rstd_s = rsqrt(mean(x_s^2) + eps)
                                            in float32, dy_s the gradient of the norm's output

    sums = BlockSums(T, H, device)     # a part's states; the ops add to them in their backward
    sums.table()                       # ExactSum (T, 18H): the six (3T, H) chunk states as the table's columns
    block_exact(x, temb, weight, bias, norm1_weight, norm2_weight, row_index, attn, ff, eps1, eps2, recorder)

The recorder (`adaln_lab.nn.ExactGradients`) rounds each sum once at write: the table's over the distinct temb
rows, then d_weight, d_bias and d_temb from it (`ops/modulation_table/exact.py`), and the two norm weights'.
float32 and bfloat16 parameters (their gradients are rounded from the exact sums to their dtype).
"""

from __future__ import annotations

import torch

from ...core.exact import LIMBS, ExactSum
from ...reference.block import CHUNKS, MODALITIES, replay_gated_residual, replay_modulated_rms_norm, table_chunks
from ...reference.final_adaln_out import rms_norm, table_rows


class BlockSums:
    """A block's exact states for one part: `chunks`, six ExactSum (3T, H) (CHUNKS order); `norms`, two ExactSum
    (H,) (norm1, norm2)."""

    def __init__(self, T: int, H: int, device=None):
        self.T, self.H = T, H
        self.chunks = [ExactSum((MODALITIES * T, H), device) for _ in CHUNKS]
        self.norms = [ExactSum((H,), device) for _ in range(2)]

    def table(self) -> ExactSum:
        """The table gradient's state (T, 18H): chunk c of the (3T, 6H) view's row 3t + m is columns
        m 6H + c H .. of table row t (diffusers' `view(-1, 6H).chunk(6)`)."""
        out = ExactSum((self.T, 6 * MODALITIES * self.H), self.chunks[0].limbs.device)
        out.limbs = torch.cat([c.limbs for c in self.chunks], dim=2).reshape(LIMBS, self.T, -1)
        return out


def _row_index(row_index: torch.Tensor, rows: int) -> torch.Tensor:
    """Each of `rows` flattened rows' table row: row_index repeated over the leading dimensions of x."""
    return row_index.repeat(rows // max(row_index.shape[0], 1))


class _Gathered:
    """A chunk standing in for the replay's `chunk.index_select(0, row_index)`: the rows expanded to x's leading
    dimensions `lead` (the values the replay broadcasts), with a hook that adds each row's own gradient (before
    the expand's backward sums the samples) to `state`."""

    def __init__(self, chunk: torch.Tensor, state: ExactSum, lead: tuple):
        self.chunk, self.state, self.lead = chunk, state, lead

    def index_select(self, dim: int, row_index: torch.Tensor) -> torch.Tensor:
        rows = self.chunk.index_select(dim, row_index)
        rows = rows.expand(*self.lead, *rows.shape)

        def record(grad):
            terms = grad.reshape(-1, grad.shape[-1]).float()  # bf16 or float32: exact in float32
            self.state.add(terms, _row_index(row_index, terms.shape[0]))

        rows.register_hook(record)
        return rows


def _norm(state: ExactSum):
    """A stand-in for `rms_norm` in the replay: rms_norm itself (its graph, so dx is autograd's), with a hook on
    its output that adds the norm weight's per-row terms (module docstring) to `state`."""

    def norm(x, norm_weight, eps):
        out = rms_norm(x, norm_weight, eps)
        xs = x.detach()

        def record(dy):
            xf = xs.reshape(-1, xs.shape[-1]).float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            state.add(dy.reshape(xf.shape).float() * (xf * rstd))

        out.register_hook(record)
        return out

    return norm


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A detached copy that wants a gradient: the hooks run even where x wants none (a frozen model's first
    block); what reaches the copy is dropped with it."""
    return t.detach().requires_grad_(True)


def block_exact(x, temb, weight, bias, norm1_weight, norm2_weight, row_index, attn, ff, eps1: float, eps2: float,
                recorder):
    """The block's forward (diffusers' bits), recording its exact sums with `recorder` (module docstring)."""
    for name, p in (("weight", weight), ("bias", bias), ("norm1_weight", norm1_weight),
                    ("norm2_weight", norm2_weight)):
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"block_adaln_path: exact gradients take float32 or bfloat16 parameters, got {name} "
                             f"{p.dtype}")
    T, H = temb.shape[0], x.shape[-1]
    sums = BlockSums(T, H, x.device)
    recorder.add_block((weight, bias, norm1_weight, norm2_weight), temb, sums)
    # the table a temb row at a time (its rows' bits whatever T), from detached inputs, as a leaf (_leaf): the hooks
    # record, nothing reaches weight, bias or temb
    table = _leaf(table_rows(temb.detach(), weight.detach(), bias.detach()))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        _Gathered(c, s, tuple(x.shape[:-2])) for c, s in zip(table_chunks(table, H), sums.chunks))
    h = replay_modulated_rms_norm(x, _leaf(norm1_weight), shift_msa, scale_msa, row_index, eps1,
                                  norm=_norm(sums.norms[0]))
    x = replay_gated_residual(x, gate_msa, attn(h), row_index)
    h = replay_modulated_rms_norm(x, _leaf(norm2_weight), shift_mlp, scale_mlp, row_index, eps2,
                                  norm=_norm(sums.norms[1]))
    return replay_gated_residual(x, gate_mlp, ff(h), row_index)
