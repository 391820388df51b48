"""The workspaces of a plan: the pieces each launch needs, laid out one after another (plan.py computes the rest).

Integer arithmetic on the plan's numbers; `forward_workspace` takes no plan and no cache, so that torch.compile
traces it on symbolic sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan

ROWS_MAX = 2 ** 31 - 2 ** 15      # rows and S travel as int32; a range's end (p0 + rows per range) must fit too,
                                  # and row_order.cu's last chunk end (up to S + 16383: chunks rounded up to 16)

ALIGN = 256  # bytes: every piece of a workspace starts on this boundary


def aligned(nbytes: int) -> int:
    """nbytes rounded up to a multiple of ALIGN (where the next piece may start)."""
    return -(-nbytes // ALIGN) * ALIGN


def layout(sizes: dict) -> tuple[dict, int]:
    """Byte offsets of named pieces laid out one after another (each ALIGN-aligned), and the total."""
    offsets, total = {}, 0
    for name, nbytes in sizes.items():
        offsets[name] = total
        total += aligned(nbytes)
    return offsets, max(total, ALIGN)


def forward_pieces(T: int, H: int, rows: int, D: int) -> tuple[int, int, int, int]:
    """Bytes of norm_out's forward workspace pieces, in their order: `table` (T, 2H) bf16, `table_f32` (T, 2H) fp32,
    `rstd` (rows,) fp32 and `act` (T, D) bf16 (the table kernel's scratch: bf16(silu(temb)))."""
    return T * 2 * H * 2, T * 2 * H * 4, rows * 4, T * D * 2


def forward_workspace(T: int, H: int, rows: int, D: int) -> tuple[dict, int]:
    """norm_out's forward workspace (`forward_pieces`) laid out one after another: (byte offsets, total bytes).
    Integer arithmetic alone, no cache, so that torch.compile traces it on symbolic sizes."""
    return layout(dict(zip(("table", "table_f32", "rstd", "act"), forward_pieces(T, H, rows, D))))


def forward_bytes(T: int, H: int, rows: int, D: int) -> int:
    """forward_workspace(T, H, rows, D)'s total alone, without building the offsets or calling forward_pieces (the
    op's Function allocates the workspace in eager and compiled code alike: a call's host time)."""
    # forward_pieces' bytes (4TH, 8TH, 4 rows, 2TD), each rounded up to ALIGN as `aligned` does: -(-n // ALIGN) units
    th = T * H
    return max(-(-4 * th // ALIGN) - (-8 * th // ALIGN) - (-4 * rows // ALIGN) - (-2 * T * D // ALIGN), 1) * ALIGN


@dataclass(frozen=True)
class Rows:
    """The parts of a plan that depend on the number of rows (x.numel() / H): row ranges and workspaces.

    fwd_offsets / fwd_bytes: one forward workspace (`forward_workspace`): `table` (T, 2H) bf16, `table_f32` (T, 2H)
    fp32, `rstd` (rows,) fp32 and `act` (T, D) bf16. bwd_offsets / bwd_bytes: one backward workspace holding
    `row_partials` (bwd_ranges, T, 2, H) fp32 (plan.bwd_sorted: (bwd_ranges + T, 2, H)), `d_table` (T, 2H) fp32,
    `dact_partials` (plan.tb_bytes: table_bwd's (blocks_j, T, D) fp32 partials, then on tensor cores its operands'
    terms), and where
    plan.bwd_sorted `row_order` (T + 1 + rows,) int32 (row_order.cu's layout, S <= rows), and where
    plan.row_order_wide its scratch `row_order_scratch` (plan.row_order_scratch(rows) bytes).
    """

    rows: int
    fwd_rows_per_range: int
    fwd_ranges: int
    bwd_rows_per_range: int
    bwd_ranges: int
    fwd_offsets: dict
    fwd_bytes: int
    bwd_offsets: dict
    bwd_bytes: int


@lru_cache(maxsize=4096)
def rows_of(plan: Plan, rows: int) -> Rows:
    """plan.rows(rows): the row ranges and workspaces of `rows` rows (Rows)."""
    if rows > ROWS_MAX:
        raise ValueError(f"the CUDA kernels take at most {ROWS_MAX} rows (x.numel() / H), got {rows}; split the batch")
    t = dict(plan.tuning)
    fwd_per = max(1, min(t["FWD_ROW_LIST_MAX"], max(t["FWD_MIN_ROWS"], math.ceil(rows / t["FWD_RANGES"]))))
    bwd_per = max(1, min(t["ROW_LIST_MAX"], math.ceil(rows / t["BWD_RANGES"])))
    bwd_ranges = math.ceil(rows / bwd_per) if rows else 0
    T, H = plan.T, plan.H
    fwd_offsets, fwd_bytes = forward_workspace(T, H, rows, plan.D)
    slots = max(bwd_ranges, 1) + T if plan.bwd_sorted else max(bwd_ranges, 1) * T
    parts = {"row_partials": slots * 2 * H * 4, "d_table": T * 2 * H * 4, "dact_partials": plan.tb_bytes}
    if plan.bwd_sorted:
        parts["row_order"] = (T + 1 + rows) * 4
        if plan.row_order_wide:
            parts["row_order_scratch"] = plan.row_order_scratch(rows)
    bwd_offsets, bwd_bytes = layout(parts)
    return Rows(rows, fwd_per, math.ceil(rows / fwd_per) if rows else 0, bwd_per, bwd_ranges,
                fwd_offsets, fwd_bytes, bwd_offsets, bwd_bytes)
