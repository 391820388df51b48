"""One H3 block's table gradient: an ordinary buffer handed from op to op by autograd, each op writing its columns.

The block's table (T, 18H), viewed (3T, 6H), holds six column chunks per row, in `CHUNKS` order. Through
autograd's `chunk`, each row op's backward would return its chunks' gradients as (3T, H) tensors of their own and
autograd would cat the six. Instead `block_adaln_path` passes the table itself to its three row ops in turn, each
taking it as an input and handing it on as an output (a link: the tensor itself, no copy):

    h, x, link = norm1(x, ..., table)            chunks 0, 1    (shift_msa | scale_msa)
    x, h, link = gated_residual_norm(x, ..., link) chunks 2, 3, 4 (gate_msa | shift_mlp | scale_mlp)
    x = gated_residual(x, ..., link)             chunk 5        (gate_mlp)

so that in the backward the gradient of each link reaches the op that made it. The op whose backward runs first in
a pass gets no link gradient and makes the (T, 18H) buffer (`for_op`, zeroing the chunks of the ops after it, which
did not run in this pass: a loss on norm1's output alone); each op writes its chunks' gradients into the buffer's
columns (the CUDA reduces with the row stride 6H, the torch code by copies) and returns the buffer as its link
input's gradient, so the first op's backward returns the whole table gradient: one allocation for the six, no cat.
Every op before the one that made the buffer runs in that pass too (its link output has a gradient), so no column
is left unwritten. It is autograd's own data flow, so eager and compiled code (torch.compile, compiled autograd),
`retain_graph` passes and concurrent passes need nothing more.
"""

from __future__ import annotations

import torch

from .library import eager
from .tensors import row_partials_floats

CHUNKS = ("shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp")
SHIFT_MSA, GATE_MSA, SHIFT_MLP, GATE_MLP = 0, 2, 3, 5  # the first chunk each op (or op part) writes
SCALE_MSA, SCALE_MLP = SHIFT_MSA + 1, SHIFT_MLP + 1  # the modulated norms' scale chunks


def for_op(d_link: torch.Tensor | None, table: tuple, hidden_size: int, end: int, partials: int = 0) -> torch.Tensor:
    """The (T, 18H) buffer an op writing chunks before `end` writes into: `d_link` (the gradient of its link
    output: the buffer of the ops after it), or a new buffer, of the table's (shape, dtype, device), whose chunks
    from `end` on are zero. partials: float32 floats of scratch the block's row ops share after the table in the
    same allocation (`partials_of`; each op's backward runs after the one that handed it the buffer, on the stream
    autograd orders them by), 0 for none."""
    if d_link is not None:
        return d_link
    (T, N), dtype, device = table
    if partials:  # (views by as_strided: a slice and a view cost the eager host a few microseconds more)
        both = torch.empty(T * N + partials, dtype=dtype, device=device)
        buffer = both.as_strided((T, N), (N, 1))
        buffer.adaln_partials = both.as_strided((partials,), (1,), T * N)  # `partials_of`: this buffer's own scratch
    else:
        buffer = torch.empty(T, N, dtype=dtype, device=device)
    if end < len(CHUNKS):
        buffer.view(-1, len(CHUNKS) * hidden_size)[:, end * hidden_size:].zero_()
    return buffer


def partials_of(buffer: torch.Tensor) -> torch.Tensor | None:
    """The float32 scratch after the table in `buffer`'s allocation where for_op made it with `partials`, else None
    (a gradient autograd summed, or one compiled code made: the launches then allocate their own; they also check
    its size). Marked on the buffer itself, never guessed from a view's base, whose tail may hold live data."""
    return getattr(buffer, "adaln_partials", None)


def for_row_op(d_link: torch.Tensor | None, table: tuple, hidden_size: int, end: int, route: str, x: torch.Tensor,
               table_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(for_op's buffer, the row partials' scratch after it or None) for a row op on x (..., S, H) and `table_rows`
    table rows: on route "cupy" in eager code the buffer the first op makes also holds the scratch the three row
    ops' sorted passes share (`core.tensors.row_partials_floats`), so a block's backward allocates once for the
    table gradient and the partials; in compiled code each launch allocates its own."""
    if route != "cupy":
        return for_op(d_link, table, hidden_size, end), None
    if d_link is None:  # this op's backward runs first: the buffer is made here
        floats = row_partials_floats(x, table_rows) if table[1] == torch.float32 and eager() else 0
        d_link = for_op(None, table, hidden_size, end, floats)
    return d_link, partials_of(d_link)


def columns(buffer: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """The (3T, 6H) view of `buffer` (T, 18H): the six chunks of each of the 3T table rows side by side, where the
    ops write their chunks' columns (row stride 6H)."""
    return buffer.view(-1, len(CHUNKS) * hidden_size)


def standalone(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An op's own (R, width) gradient buffer for its table chunks where it runs outside a block (no link): float32
    on the kernels, the chunks' dtype in the torch code."""
    return torch.empty(rows, width, dtype=dtype, device=device)
