"""`row_order`: the rows of a batch in table-row order (kernels_cu/row_order.cu).

    order = row_order(row_index (S,) int64, table_rows R, H) -> (R + 1 + S,) int32

order[:R + 1] are the first positions of table rows 0 .. R-1 and S; order[R + 1:] the positions s of row_index
sorted by table row, stably (s ascending inside a table row); an index outside [0, R) sorts with table row 0.
The H3 blocks' backward row passes (modulated_rms_norm, gated_residual_norm, gated_residual on the CUDA
kernels) walk the rows in this order so that a range of rows sums the few table rows its positions span
(one or two where every table row holds more rows than a range) instead of R. Each of those ops sorts in its
backward unless given the order (`row_order=`): `block_adaln_path` sorts once per block. The order is a
function of row_index alone (integers: no rounding, no timing).

A `row_order=` argument must be this function's output for that very row_index (checked: shape, dtype,
device). With an order of another row_index of the same length the CUDA backward poisons the rows whose
index is not their position's table row: their dx is NaN and so are the gradients of their positions'
table rows, the same bits on every run; an order whose offsets name no row for a position reads and writes
nothing for it. Offsets that are not sorted are undefined.

`row_order` allocates the order and calls the launch op `torch.ops.adaln_lab.row_order` (`core.library.library_op`,
which writes the caller's tensor): on CPU tensors (and shapes the kernel does not take, more than plan.ROWS_MAX
positions or a width the plan refuses) torch's stable argsort and bincount; on CUDA row_order.cu (one block), compiled
in the row kernels' unit of width H (`plan(H, 8, R)`: H picks the unit only).
"""

from __future__ import annotations

import torch

from ...core import launchers, tensors
from ...core.library import library_op
from ...core.plan import ROWS_MAX, supported


def order_torch(row_index: torch.Tensor, table_rows: int) -> torch.Tensor:
    """row_order with torch ops (any device): the reference the kernel is tested against."""
    key = torch.where((row_index >= 0) & (row_index < table_rows), row_index, 0)
    counts = torch.bincount(key, minlength=table_rows)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return torch.cat([offsets, torch.argsort(key, stable=True)]).int()


def launch_in(k: dict, plan, stream: int, row_index: torch.Tensor, order: torch.Tensor, S: int) -> None:
    """row_order.cu into order (plan.T + 1 + S,) int32 over the first S positions of row_index (S,) int64 (CUDA),
    from a compiled unit `k` of `plan` (any of the unit's plans of the same T: the kernel reads T alone), its
    scratch allocated here where plan.row_order_wide."""
    nbytes = plan.row_order_scratch(S)  # 0 for the one-block kernel: no allocation
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=row_index.device) if nbytes else None
    launchers.launch_row_order(k, plan, stream, row_index.data_ptr(), order.data_ptr(), S,
                               scratch.data_ptr() if nbytes else 0)


@library_op("adaln_lab::row_order", mutates_args=("order",))
def launch(row_index: torch.Tensor, table_rows: int, H: int, order: torch.Tensor) -> None:
    """order (R + 1 + S,) int32 of row_index (S,) int64 (module docstring)."""
    if tensors.gpu(row_index) and row_index.shape[0] <= ROWS_MAX and supported(H, 8, max(table_rows, 1)):
        device = row_index.get_device()
        plan, _, k = tensors.context(device, H, 8, table_rows, 0)
        launchers.bind(device)
        launch_in(k, plan, tensors.current_stream(device), row_index, order, row_index.shape[0])
        return
    order.copy_(order_torch(row_index, table_rows))


def row_order(row_index: torch.Tensor, table_rows: int, H: int) -> torch.Tensor:
    """The rows' table-row order of row_index (S,) int64 for a table of `table_rows` rows and rows of width H:
    (table_rows + 1 + S,) int32 (module docstring)."""
    if row_index.dim() != 1 or row_index.dtype != torch.int64:
        raise ValueError(f"row_order needs row_index of shape (S,) and dtype int64, got {tuple(row_index.shape)} "
                         f"{row_index.dtype}")
    if table_rows < 1:
        raise ValueError(f"row_order needs table_rows >= 1 (the table's rows), got {table_rows}")
    order = row_index.new_empty(table_rows + 1 + row_index.shape[0], dtype=torch.int32)
    launch(row_index.contiguous(), int(table_rows), int(H), order)
    return order

