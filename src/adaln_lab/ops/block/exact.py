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
from ...reference.backward import rows_index
from ...reference.block import CHUNKS, MODALITIES, replay_gated_residual, replay_modulated_rms_norm, table_chunks
from ...reference.final_adaln_out import rms_norm, table_rows
from ..final_adaln_out.exact import normed_terms


class BlockSums:
    """A block's exact states for one part: `chunks`, six ExactSum (3T, H) (CHUNKS order); `norms`, two ExactSum
    (H,) (norm1, norm2)."""

    def __init__(self, T: int, H: int, device=None):
        self.T, self.H = T, H
        self.chunks = [ExactSum((MODALITIES * T, H), device) for _ in CHUNKS]
        self.norms = [ExactSum((H,), device) for _ in range(2)]
        self.closed = False  # set when the accumulator folds these states in (its `with` ended)

    def add(self, state: ExactSum, terms: torch.Tensor, index=None) -> None:
        """state.add(terms, index), for a hook of this part's backward; refused once the states were folded in."""
        if self.closed:
            raise RuntimeError("block_adaln_path: this part's backward ran after its `with ExactGradients()` ended; "
                               "run the backward inside the `with`")
        state.add(terms, index)

    def table(self) -> ExactSum:
        """The table gradient's state (T, 18H): chunk c of the (3T, 6H) view's row 3t + m is columns
        m 6H + c H .. of table row t (diffusers' `view(-1, 6H).chunk(6)`)."""
        return ExactSum.from_limbs(torch.cat([c.limbs for c in self.chunks], dim=2).reshape(LIMBS, self.T, -1))


class _Gathered:
    """Chunk `c` standing in for the replay's `chunk.index_select(0, row_index)`: the rows expanded to x's leading
    dimensions `lead` (the values the replay broadcasts), with a hook that adds each row's own gradient (before the
    expand's backward sums the samples) to sums.chunks[c]."""

    def __init__(self, chunk: torch.Tensor, sums: BlockSums, c: int, lead: tuple):
        self.chunk, self.sums, self.c, self.lead = chunk, sums, c, lead

    def index_select(self, dim: int, row_index: torch.Tensor) -> torch.Tensor:
        rows = self.chunk.index_select(dim, row_index)
        rows = rows.expand(*self.lead, *rows.shape)

        def record(grad):
            terms = grad.reshape(-1, grad.shape[-1]).float()  # bf16 or float32: exact in float32
            self.sums.add(self.sums.chunks[self.c], terms, rows_index(row_index, grad))

        rows.register_hook(record)
        return rows


def _norm(sums: BlockSums, k: int):
    """A stand-in for `rms_norm` in the replay: rms_norm itself (its graph, so dx is autograd's), with a hook on
    its output that adds norm k's per-row terms (module docstring) to sums.norms[k]."""

    def norm(x, norm_weight, eps):
        out = rms_norm(x, norm_weight, eps)
        xs = x.detach()
        out.register_hook(lambda dy: sums.add(sums.norms[k], normed_terms(xs, dy, eps)[0]))
        return out

    return norm


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A detached copy that wants a gradient: the hooks run even where x wants none (a frozen model's first
    block); what reaches the copy is dropped with it."""
    return t.detach().requires_grad_(True)


def block_exact(x, temb, weight, bias, norm1_weight, norm2_weight, row_index, attn, ff, eps1: float, eps2: float,
                recorder, adapt_table=None):
    """The block's forward (diffusers' bits), recording its exact sums with `recorder` (module docstring).
    adapt_table: None, or `block_adaln_path`'s (LoRA adapters' terms, applied to each table row's values without a
    graph: the recorder forms the adapters' gradients from the exact table gradient)."""
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
    table = table_rows(temb.detach(), weight.detach(), bias.detach())
    if adapt_table is not None:
        with torch.no_grad():
            table = adapt_table(table.float()).to(table.dtype)
    table = _leaf(table)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        _Gathered(chunk, sums, c, tuple(x.shape[:-2])) for c, chunk in enumerate(table_chunks(table, H)))
    h = replay_modulated_rms_norm(x, _leaf(norm1_weight), shift_msa, scale_msa, row_index, eps1,
                                  norm=_norm(sums, 0))
    x = replay_gated_residual(x, gate_msa, attn(h), row_index)
    h = replay_modulated_rms_norm(x, _leaf(norm2_weight), shift_mlp, scale_mlp, row_index, eps2,
                                  norm=_norm(sums, 1))
    return replay_gated_residual(x, gate_mlp, ff(h), row_index)
