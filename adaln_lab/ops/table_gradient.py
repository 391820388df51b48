"""`TableGradient`: one H3 block's table gradient, written in place by the block's three row ops.

The block's table (T, 18H), viewed (3T, 6H), holds six column chunks per row: shift_msa | scale_msa | gate_msa |
shift_mlp | scale_mlp | gate_mlp (`reference.block.CHUNKS`). Through autograd's `chunk`, each op's backward would
return its chunks' gradients as (3T, H) tensors of their own and autograd would cat the six into the table's
gradient. Instead `block_adaln_path` hands the ops the chunks detached, the table itself and one TableGradient;
each op's backward writes its chunks' gradients into the columns of one (T, 18H) buffer where they lie (the CUDA
reduces write with the row stride 6H), and norm1's op returns the buffer as the table's gradient, the two others
None: one allocation for the six, no cat, no split node.

Why norm1's op: in any backward pass it runs after the two others that run in that pass (both lie downstream of
it in the forward, fed by the x it hands on), and it runs whenever the table's gradient is wanted (the table is
its input). Columns no op wrote in the pass (a loss on norm1's output alone) are zeros, as autograd's cat gives
for a chunk without gradient. One buffer per backward pass, keyed by the pass (`torch.autograd.backward` or
`torch.autograd.grad`, retain_graph included, each thread's passes apart): norm1's op takes it, so a pass never
sees another's columns; the buffer of a pass that stopped short of norm1 (only the attention's parameters wanted)
stays with the graph until it is freed.

Where the block's row ops run on the kernels, the pass's buffer also holds their row workspaces after the
table (`workspaces`): one region per op that writes chunk columns (norm1's row partials, gated_residual_norm's norm
and gate partials, gated_residual's gate partials), so the block's backward makes one allocation for the table
gradient and the four workspaces (they stay with the buffer until the table's backward has read it).

Under compiled autograd the backward is traced, and side effects do not belong there: each op then returns its
chunks' gradients as a table-shaped gradient of its own (`as_table`: zeros elsewhere), which autograd adds.
"""

from __future__ import annotations

import torch

from ..reference.block import CHUNKS

_task_id = torch._C._current_graph_task_id  # the backward pass running on this thread (torch.utils.checkpoint's)


SHIFT_MSA = CHUNKS.index("shift_msa")  # norm1's chunks: shift_msa | scale_msa
GATE_MSA = CHUNKS.index("gate_msa")  # gated_residual_norm's: gate_msa | shift_mlp | scale_mlp
SHIFT_MLP = CHUNKS.index("shift_mlp")  # gated_residual_norm's norm: shift_mlp | scale_mlp
GATE_MLP = CHUNKS.index("gate_mlp")  # gated_residual's


class TableGradient:
    """The (T, 18H) gradient of one block's `table`, filled by chunk columns (module docstring).

    `columns(first, count)` -> the (3T, count * H) view of this pass's buffer over chunks first .. first + count - 1;
    `pointer(first, count)` -> (address of that view, its row stride in elements) for the kernels, without making
    the view; `write(first, *grads)` copies (3T, H) gradients there. Each marks those chunks written in this
    backward pass (its buffer made at its first call). `take()` -> this pass's buffer, zeros in the chunks no op
    of the pass wrote, and forgets it. `as_table(first, *grads)` -> the table-shaped gradient of those chunks alone
    (zeros elsewhere), no buffer touched: compiled autograd's way. `workspace(first)` -> the address of the row
    workspace of the op writing chunk `first` in this pass's buffer (None without `workspaces`).

    workspaces: None, or (norm, gate), the floats of a norm's and a gated residual's row workspace
    (`core.tensors.row_workspaces` of the block's rows): each pass's buffer then holds four after the table.
    """

    def __init__(self, table: torch.Tensor, hidden_size: int, workspaces: tuple[int, int] | None = None):
        self.shape, self.dtype, self.device = table.shape, table.dtype, table.device
        self.H = hidden_size
        self.row_stride = len(CHUNKS) * hidden_size  # of the (3T, 6H) view
        self._numel = table.numel()
        self._offsets: dict[int, int] = {}  # chunk first written by an op -> float offset of that op's workspace
        end = self._numel
        if workspaces is not None and self.dtype == torch.float32 and self._numel % 4 == 0:  # 16-byte aligned
            norm, gate = workspaces
            for first, floats in ((SHIFT_MSA, norm), (SHIFT_MLP, norm), (GATE_MSA, gate), (GATE_MLP, gate)):
                self._offsets[first], end = end, end + floats
        self._size = end
        self._passes: dict[int, tuple[torch.Tensor, set[int]]] = {}  # backward pass -> (table view, chunks written)

    def _claim(self, first: int, count: int) -> torch.Tensor:
        task = _task_id()
        entry = self._passes.get(task)
        if entry is None:
            buffer = torch.empty(self._size, dtype=self.dtype, device=self.device)
            table = buffer.view(self.shape) if self._size == self._numel else buffer[:self._numel].view(self.shape)
            entry = self._passes[task] = (table, set())
        entry[1].update(range(first, first + count))
        return entry[0]

    def workspace(self, first: int) -> int | None:
        offset = self._offsets.get(first)
        if offset is None:
            return None
        return self._claim(first, 0).data_ptr() + 4 * offset

    def columns(self, first: int, count: int) -> torch.Tensor:
        rows = self._claim(first, count).view(-1, self.row_stride)
        return rows[:, first * self.H:(first + count) * self.H]

    def pointer(self, first: int, count: int) -> tuple[int, int]:
        if self.dtype != torch.float32:
            raise TypeError(f"the kernels write a float32 table gradient, the table is {self.dtype}")
        return self._claim(first, count).data_ptr() + first * self.H * 4, self.row_stride

    def write(self, first: int, *grads: torch.Tensor) -> None:
        """Copy the (3T, H) gradients of chunks first, first + 1, ... into their columns (the torch code's way)."""
        columns = self.columns(first, len(grads))
        for i, grad in enumerate(grads):
            columns[:, i * self.H:(i + 1) * self.H].copy_(grad)

    def take(self) -> torch.Tensor:
        entry = self._passes.pop(_task_id(), None)
        if entry is None:  # norm1's op writes its columns first
            raise RuntimeError("TableGradient.take before any columns of this backward pass were written")
        buffer, written = entry
        rows = buffer.view(-1, self.row_stride)
        for chunk in set(range(len(CHUNKS))) - written:
            rows[:, chunk * self.H:(chunk + 1) * self.H].zero_()
        return buffer

    def as_table(self, first: int, *grads: torch.Tensor | None) -> torch.Tensor:
        rows = self.shape[0] * self.shape[1] // self.row_stride  # 3T
        zeros = (lambda chunks: torch.zeros(rows, chunks * self.H, dtype=self.dtype, device=self.device))
        parts = ([zeros(first)] if first else []) + [zeros(1) if g is None else g.to(self.dtype) for g in grads]
        rest = len(CHUNKS) - first - len(grads)
        return torch.cat(parts + ([zeros(rest)] if rest else []), dim=1).view(self.shape)
