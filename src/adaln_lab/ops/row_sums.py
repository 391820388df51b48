"""The exact per-table-row sums that the row ops' parameter gradients are fixed functions of.

For rows x, dy (..., S, H), their rstd (rows,) and row_index (S,) int64 in [0, R) (row i of x in table row
r = row_index[i % S]), per table row r and column h, over the rows of r:

    B[r] = exact sum of dy_i        A[r] = exact sum of p_i = float32(dy_i float32(x_i rstd_i))

each a float32 term of one row alone (each product rounded once, no contraction), kept as a `core.exact.ExactSum`
state (R, 2H), B | A. A modulated norm's d_shift is B, its d_scale w A and its d_norm_weight sum_r s1[r] A[r]
(w the norm weight, s1 = float32(1 + scale[r]); `core.exact.products` takes both exactly); a gated residual's
d_gate is A with x = y and rstd = 1 (dy y: exact for bf16 dy and y). The states are integers, so every order of the
rows, split into calls and merge of the calls' states gives the same sums.

    state, flags = row_sums(x, dy, rstd, row_index, R, kernels)
    raise_flags(flags, op)            # what the kernels flagged (a host read)

kernels True (CUDA, bf16 x and dy, float32 rstd): kernels_cu/exact_sums.cu (`exact_sums_bf16`, rows walked in
table-row order, `exact_row_order`; limbs added by integer atomics, then carried by exact_state.cu's `exact_carry`);
its flags (1,) int32 say what went wrong (bit 0 a non-finite term, bit 1 an index outside [0, R)) and are read by
`raise_flags` later, so that no host sync sits in the backward. kernels False: the same formulas in torch code
(flags None; ExactSum.add raises at once). At most MAX_TERMS rows a call (ValueError).
"""

from __future__ import annotations

import torch

from ..core import tensors
from ..core.exact import LIMBS, MAX_TERMS, ExactSum
from ..core.exact_kernels import ExactKernels


def exact_row_order(row_index: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) int32: the rows of x (..., S, H) stably sorted by their table row row_index[i % S] (exact_sums.cu
    walks them in this order: a chunk's table row changes at most R times)."""
    S = row_index.shape[0]
    if rows == 0:
        return row_index.new_empty(0, dtype=torch.int32)
    return torch.sort(row_index.repeat(rows // S), stable=True).indices.to(torch.int32)


def launch_sums(k: dict, plan, stream: int, x: int, dy: int, rstd: int, row_index: int, order: int,
                table_limbs: int, flags: int, rows: int, S: int) -> None:
    """exact_sums.cu: the sums (B | A) as uncarried int64 limbs added into table_limbs (LIMBS, R, 2H) (R the plan's
    T), flags (1,) int32 or'd (the caller zeroes both), over the rows in the order `order` (rows,) int32
    (`exact_row_order`); nothing with no rows."""
    columns, chunks, per_chunk = plan.exact_grid(rows)
    if chunks:
        k["exact_sums_bf16"]((columns, chunks, 1), (dict(plan.tuning)["EXACT_THREADS"], 1, 1), plan.exact_smem,
                             stream, x, dy, rstd, row_index, order, table_limbs, flags, rows, S, per_chunk)


FIXUPS_MAX = 2 ** 20  # fixup entries (a window's 8 columns each) a pass may append at most (16 MB)


def fixup_capacity(plan, rows, sorted_rows: bool) -> int:
    """Fixup entries an exact row pass may append (exact_row_windows.cu, plan.exact_row_double; 0 without): one
    a vector of 8 columns of every window, a block's rows of one table row, at most FIXUPS_MAX. norm_out's pass
    (sorted_rows False) has at most min(T, rows a block) windows a block; a sorted pass's table rows (a block's
    norms' and its gates') run in order, so its blocks hold at most bwd_ranges + R - 1 windows in all."""
    if not plan.exact_row_double or not rows.rows:
        return 0
    windows = rows.bwd_ranges + plan.T - 1 if sorted_rows else rows.bwd_ranges * min(plan.T, rows.bwd_rows_per_range)
    return min(windows * (plan.H // 8), FIXUPS_MAX)


def pass_buffers(plan, rows, sorted_rows: bool, device, width: int = 0, joined: bool = False) -> tuple:
    """(table_limbs (LIMBS, R, width) int64 (width 2H, or H for a gate's sums), flags (2,) int32, fixups (capacity, 4)
    int32) of an exact row pass: the limbs and flags zeroed (flags[0] the kernels' flags, `raise_flags` reads
    flags[:1]; flags[1] the fixup entries appended), the entries written before they are read; with no capacity
    (int64 windows) fixups is flags, which the pass then never reads as entries (one allocation less a call).
    joined: the flags are the limbs' buffer's last 8 bytes, zeroed with them in one launch (where the flags live
    no longer than the limbs: a kept flag keeps them)."""
    width = width or 2 * plan.H
    if joined:
        buffer = torch.zeros(LIMBS * plan.T * width + 1, dtype=torch.int64, device=device)
        limbs, flags = buffer[:-1].view(LIMBS, plan.T, width), buffer[-1:].view(torch.int32)
    else:
        limbs = torch.zeros((LIMBS, plan.T, width), dtype=torch.int64, device=device)
        flags = torch.zeros(2, dtype=torch.int32, device=device)
    capacity = fixup_capacity(plan, rows, sorted_rows)
    fixups = torch.empty((capacity, 4), dtype=torch.int32, device=device) if capacity else flags
    return limbs, flags, fixups


def launch_fixups(k: dict, plan, stream: int, name: str, capacity: int, *args) -> None:
    """exact_row_windows.cu's fixup kernel `name` after its pass (capacity 0: no float64 windows, nothing): args the
    kernel's before (S, rows, rows_per_block, capacity), which follow them. A fixed grid whatever the entries'
    count (on the device): integer additions, so any grid gives the same integers."""
    if capacity:
        k[name]((dict(plan.tuning)["EXACT_FIXUP_BLOCKS"], 1, 1), (256, 1, 1), 0, stream, *args, capacity)


def launch_sorted_row_sums(k: dict, plan, rows, stream: int, dy: int, x: int, rstd: int, norm_weight: int,
                           table_f32: int, row_index: int, row_order: int, dx: int, table_limbs: int, flags: int,
                           fixups: int, S: int, d_residual: int = 0, table_stride: int = 0) -> None:
    """exact_row_pass.cu's norm_modulate_bwd_(residual_)sorted_exact_bf16: a block's sorted row pass (dx as
    launchers.launch_sorted_row_pass writes it, with d_residual where given) with its two column sums a table row
    added exactly into table_limbs (LIMBS, R, 2H) (uncarried), flags (2,) int32 and fixups as `pass_buffers` makes
    them, then exact_fixup_sorted_bf16 where plan.exact_row_double; nothing with no rows."""
    if not rows.rows:
        return
    stride = table_stride or 2 * plan.H
    grid, block = (rows.bwd_ranges, 1, 1), (plan.bwd_threads, 1, 1)
    capacity, per = fixup_capacity(plan, rows, True), rows.bwd_rows_per_range
    if d_residual:
        k["norm_modulate_bwd_residual_sorted_exact_bf16"](grid, block, plan.bwd_res_smem, stream, dy, x, d_residual,
                                                          rstd, norm_weight, table_f32, row_index, row_order, dx,
                                                          table_limbs, flags, fixups, S, rows.rows, per, stride,
                                                          capacity)
    else:
        k["norm_modulate_bwd_sorted_exact_bf16"](grid, block, plan.bwd_smem, stream, dy, x, rstd, norm_weight,
                                                 table_f32, row_index, row_order, dx, table_limbs, flags, fixups, S,
                                                 rows.rows, per, stride, capacity)
    launch_fixups(k, plan, stream, "exact_fixup_sorted_bf16", capacity, x, dy, rstd, row_index, row_order, fixups,
                  flags, table_limbs, S, rows.rows, per)


def check_rows(rows: int, op: str) -> None:
    if rows > MAX_TERMS:
        raise ValueError(f"{op}: exact gradients take at most {MAX_TERMS} rows a call (every limb of the integer "
                         f"states below 2^62), got {rows}: split the batch into micro-batches")


def raise_flags(flags: torch.Tensor, op: str, index: str = "a row index outside [0, R)") -> None:
    """Raise what the kernels flagged in `flags` (1,) int32 (a host read): ValueError for a non-finite term,
    IndexError for `index` (bit 1: a row index outside [0, R), its row left out), RuntimeError for a fixup entry
    with no room (bit 2, exact_row_windows.cu: more than FIXUPS_MAX windows refused); the states are then not sums of
    every term."""
    bits = int(flags)
    if bits & 4:
        raise RuntimeError(f"{op}: an exact row pass refused more windows than its fixup list holds ({FIXUPS_MAX} "
                           "entries of a window's 8 columns; terms over about 50 binades in most columns); the sums "
                           "are not complete. Set adaln_lab.core.plan.TUNING['EXACT_ROW_DOUBLE'] = 0 (int64 windows) "
                           "for such inputs")
    if bits & 1:
        raise ValueError(f"{op}: a non-finite gradient term (inf or NaN in x, dy or the table): an exact sum of it "
                         "does not exist")
    if bits & 2:
        raise IndexError(f"{op}: {index}")


def torch_terms(x: torch.Tensor, dy: torch.Tensor, rstd: torch.Tensor | None) -> torch.Tensor:
    """(rows, 2H) float32 terms dy | float32(dy float32(x rstd)) of x, dy (..., S, H) and rstd (rows,) (None: 1)."""
    H = x.shape[-1]
    xf, g = x.reshape(-1, H).float(), dy.reshape(-1, H).float()
    xhat = xf if rstd is None else xf * rstd.float()[:, None]
    return torch.cat([g, g * xhat], dim=1)


def row_sums(x: torch.Tensor, dy: torch.Tensor, rstd: torch.Tensor | None, row_index: torch.Tensor, R: int,
             kernels: bool, op: str = "row_sums") -> tuple[ExactSum, torch.Tensor | None]:
    """(the state (R, 2H) B | A, the kernels' flags (1,) int32 or None) of x, dy (..., S, H) with rstd (rows,)
    (None: 1) and row_index (S,) int64 (module docstring); `kernels`: on exact_sums.cu (CUDA bf16 x and dy)."""
    H = x.shape[-1]
    rows = x.numel() // H
    check_rows(rows, op)
    if not kernels:
        index = row_index.repeat(rows // x.shape[-2]) if rows else row_index[:0]
        return ExactSum((R, 2 * H), x.device).add(torch_terms(x, dy, rstd), index), None
    if x.dtype != torch.bfloat16 or dy.dtype != torch.bfloat16 or dy.shape != x.shape:
        raise ValueError(f"{op}: the exact sums' kernel takes bf16 x and dy of one shape, got {x.dtype} "
                         f"{tuple(x.shape)} and {dy.dtype} {tuple(dy.shape)}")
    plan, _, k, stream = tensors.row_setup(x, R)
    rstd = torch.ones(rows, dtype=torch.float32, device=x.device) if rstd is None else rstd.float().contiguous()
    row_index = row_index.contiguous()
    table = torch.zeros((LIMBS, R, 2 * H), dtype=torch.int64, device=x.device)
    flags = torch.zeros(1, dtype=torch.int32, device=x.device)
    (x, dy), at = tensors.aligned_addresses(x, dy)
    order = exact_row_order(row_index, rows)
    launch_sums(k, plan, stream, at[0], at[1], rstd.data_ptr(), row_index.data_ptr(), order.data_ptr(),
                table.data_ptr(), flags.data_ptr(), rows, x.shape[-2])
    return ExactSum.from_limbs(table, kernels=ExactKernels(k, x.device.index)).carried(), flags


def half(state: ExactSum, k: int) -> ExactSum:
    """The B (k = 0) or A (k = 1) half of a (R, 2H) state, (R, H)."""
    H = state.shape[-1] // 2
    return ExactSum.from_limbs(state.limbs[..., k * H:(k + 1) * H], kernels=state.kernels)
