"""The torch side of every launch: torch allocates, `launchers` launch on torch's current stream of the tensors'
device. What the ops' launch modules (`ops/<op>/launch.py`) share:

- `current_stream`, `promoted`, `as_dtype`, `aligned` / `all_aligned` / `aligned_addresses` (contiguous and 16-byte
  aligned: the kernels load 8 bf16 at a time);
- `context(device, H, D, T, rows, ...)`: (plan, its Rows, the compiled kernels) of one call's shapes, one cache
  lookup keyed on integers (the eager host time); `row_setup` / `table_setup`: the row kernels' and the table
  kernels' (plan, ..., kernels, stream);
- how the row kernels read the table chunks: `shift_scale` (shift | scale as one fp32 table, read where a block's
  chunks lie, row stride 6H, else gathered), `shift_scale_bf16` (the contiguous bf16 table the forward reads),
  `row_table_address` (a block's bf16 row table, which the table kernel writes), `gate_pointer`;
- `row_order(row_index, plan)`: row_order.cu's order of the rows by table row;
- `table`, `norm_modulate`: norm_out's two forward kernels alone (tests and tools).

Plans: norm_out's is `plan(H, D, T)`; a table's `plan(8, D, T, table_n=N, table_f32_rounded=True,
table_row_tables=row_tables_fit(N))` (its row kernels unused); the rows' `plan(H, 8, R)` (its table kernels unused).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import launchers
from .plan import plan as make_plan, row_tables_fit

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def gpu(t: torch.Tensor) -> bool:
    """Whether a launch body runs the kernels for t's device (CUDA tensors; a CPU stand-in of the GPU says yes for
    CPU tensors: `adaln_lab.bench.host_model`)."""
    return t.is_cuda


def current_stream(device_index: int) -> int:
    """torch's current CUDA stream on a device, as a raw handle."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: t itself when it has it (a no-op `.to` still costs microseconds of host time per call)."""
    return t if t.dtype == dtype else t.to(dtype)


def promoted(a: torch.dtype, b: torch.dtype, c: torch.dtype | None = None) -> torch.dtype:
    """torch.promote_types over two or three dtypes, without the call where they agree (the eager host time)."""
    ab = a if a == b else torch.promote_types(a, b)
    return ab if c is None or c == ab else torch.promote_types(ab, c)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and starting on a 16-byte boundary (the kernels load 16 bytes at a time: 8 bf16, 4 fp32); a copy
    only if not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def all_aligned(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`aligned` of each of ts, in one call: ts themselves where all are contiguous and 16-byte aligned (the eager
    host time: no call per tensor)."""
    for t in ts:
        if not t.is_contiguous() or t.data_ptr() % 16:
            return tuple(aligned(t) for t in ts)
    return ts


def aligned_addresses(*ts: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """(`all_aligned(*ts)`, their data pointers): each pointer read once (the eager host time). The tensors, copies
    where `aligned` made one, must stay referenced until their kernels are launched."""
    addresses = []
    for t in ts:
        address = t.data_ptr()
        if address % 16 or not t.is_contiguous():
            ts = tuple(aligned(t) for t in ts)
            return ts, tuple(t.data_ptr() for t in ts)
        addresses.append(address)
    return ts, tuple(addresses)


@lru_cache(maxsize=4096)
def context(device_index: int, H: int, D: int, T: int, rows: int, table_n: int = 0, rounded: bool = False,
            row_tables: bool = False):
    """(plan, its Rows for `rows` rows, {name: Kernel} on the device) of one call's shapes, from one cache lookup
    keyed on integers (the eager path's host time)."""
    plan = make_plan(H, D, T, table_n, rounded, row_tables)
    return plan, plan.rows(rows), launchers.kernels(device_index, plan)


launchers.on_forget(context.cache_clear)


def table_launch(k: dict, plan, stream: int, temb: torch.Tensor, weight: int, bias: int, table_bf16: int,
                 table_f32: int, act: int = 0) -> None:
    """launchers.launch_table on temb (T, D) fp32. act: the address of its (T, D) bf16 scratch (bf16(silu(temb)),
    the SiLU taken once: norm_out's forward workspace), or 0: a tensor made here, which torch's caching allocator
    hands out again only after `stream`'s work (a stream other than torch's current one is recorded on it)."""
    if not act:
        scratch = torch.empty(temb.shape, dtype=torch.bfloat16, device=temb.device)
        if stream != current_stream(temb.get_device()):  # dlpack's stream: torch reuses it only after that stream
            scratch.record_stream(torch.cuda.ExternalStream(stream, device=temb.device))
        act = scratch.data_ptr()
    launchers.launch_table(k, plan, stream, temb.data_ptr(), weight, bias, table_bf16, table_f32, act)


def table(temb, weight, bias):
    """table (T, 2H) bf16 and table_f32 (T, 2H) fp32 by kernels_cu/table.cu (one kernel, for tests and tools)."""
    T, D = temb.shape
    H = weight.shape[0] // 2
    temb = aligned(temb)
    plan = make_plan(H, D, T)
    out = torch.empty(T, 2 * H, dtype=torch.bfloat16, device=temb.device)
    out_f32 = torch.empty(T, 2 * H, dtype=torch.float32, device=temb.device)
    launchers.bind(temb.device.index)
    table_launch(launchers.kernels(temb.device.index, plan), plan, current_stream(temb.device.index), temb,
                 weight.data_ptr(), bias.data_ptr(), out.data_ptr(), out_f32.data_ptr())
    return out, out_f32


def norm_modulate(x, norm_weight, table_bf16, timestep_indices, eps: float, D: int):
    """out (..., S, H) bf16 and rstd (rows,) fp32 by kernels_cu/norm_modulate.cu (one kernel, for tests and tools)."""
    H, T = x.shape[-1], table_bf16.shape[0]
    plan = make_plan(H, D, T)
    rows = plan.rows(x.numel() // H)
    out = torch.empty_like(x)
    rstd = torch.empty(rows.rows, dtype=torch.float32, device=x.device)
    launchers.bind(x.device.index)
    launchers.launch_norm_modulate(launchers.kernels(x.device.index, plan), plan, rows, current_stream(x.device.index),
                                   x.data_ptr(), norm_weight.data_ptr(), table_bf16.data_ptr(),
                                   timestep_indices.data_ptr(), out.data_ptr(), rstd.data_ptr(), x.shape[-2], eps)
    return out, rstd


def table_setup(temb: torch.Tensor, N: int):
    """(plan, kernels, stream) of the table kernels for temb (T, D) and N columns (a block's, N = 18H with H
    divisible by 8: its bf16 output is the two row tables)."""
    index = temb.device.index
    plan, _, k = context(index, 8, temb.shape[1], temb.shape[0], 0, N, True, row_tables_fit(N))
    launchers.bind(index)
    return plan, k, current_stream(index)


def row_setup(x: torch.Tensor, table_rows: int):
    """(plan, rows, kernels, stream) of the row kernels for x (..., S, H) and `table_rows` table rows."""
    H, index = x.shape[-1], x.device.index
    plan, rows, k = context(index, H, 8, table_rows, x.numel() // H)
    launchers.bind(index)
    return plan, rows, k, current_stream(index)


def row_partials_floats(x: torch.Tensor, table_rows: int) -> int:
    """Floats of the scratch a row op's sorted backward on x (..., S, H) and `table_rows` table rows needs
    (`partials_floats` of its plan)."""
    H = x.shape[-1]
    plan, rows, _ = context(x.device.index, H, 8, table_rows, x.numel() // H)
    return partials_floats(plan, rows)


def partials_floats(plan, rows, gate: bool = False) -> int:
    """Floats of a sorted row pass's partials: the norm's (slots x 2H, then the reduce's unused d_bias slot, H), or
    with `gate` the gated residual's (slots x H), half of them."""
    slots = launchers.sorted_slots(plan, rows)
    return slots * plan.H if gate else slots * 2 * plan.H + plan.H


def scratch(partials: torch.Tensor | None, floats: int, device) -> torch.Tensor:
    """partials where it holds `floats` floats from a 16-byte boundary (the kernels store float4), else a new float32
    tensor of that size."""
    if partials is None or partials.numel() < floats or partials.data_ptr() % 16:
        return torch.empty(floats, dtype=torch.float32, device=device)
    return partials


def shift_scale(shift: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """shift | scale (R, H) each as the one fp32 table the row kernels read: (tensor whose data starts at row 0's
    shift, row stride in floats). Where scale follows shift within each row (the blocks' chunks of the (3T, 6H)
    table view, row stride 6H) the table is read where it lies; anything else is gathered into an (R, 2H) array."""
    R, H = shift.shape
    if (shift.dtype == scale.dtype == torch.float32 and shift.stride() == scale.stride() and shift.stride(1) == 1
            and scale.data_ptr() == shift.data_ptr() + 4 * H and shift.data_ptr() % 16 == 0
            and (R == 1 or 2 * H <= shift.stride(0) < 2 ** 31) and shift.stride(0) % 4 == 0):
        return shift, shift.stride(0) if R > 1 else 2 * H
    return torch.cat([shift, scale], dim=1).float().contiguous(), 2 * H


def shift_scale_bf16(shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """shift | scale as the contiguous (R, 2H) bf16 table the forward kernels read (one cast kernel)."""
    table, stride = shift_scale(shift, scale)
    R, H = shift.shape
    return table.as_strided((R, 2 * H), (stride, 1)).to(torch.bfloat16).contiguous()


def row_table_address(shift: torch.Tensor, row_table) -> int:
    """Address of row table `row_table[1]` (0 or 1) of a block's row tables `row_table[0]`: the table kernel's bf16
    buffer (`ops.modulation_table.launch.bf16_elements`) starting with the two (R, 2H) row tables, the contiguous
    shift | scale the forward kernels read, the values of the fp32 chunks shift and scale."""
    tables, which = row_table
    R, H = shift.shape
    if tables.numel() < 4 * R * H or tables.dtype != torch.bfloat16:
        raise ValueError(f"row tables of at least 2 x {R} x {2 * H} bf16 elements needed, got {tables.numel()} "
                         f"{tables.dtype}")
    return tables.data_ptr() + which * R * 2 * H * 2


def gate_pointer(gate: torch.Tensor) -> tuple[torch.Tensor, int]:
    """gate as fp32 rows of H contiguous floats, 16-byte aligned rows: (tensor, row stride in floats)."""
    gate = as_dtype(gate, torch.float32)
    if gate.stride(-1) != 1 or gate.stride(0) % 4 or gate.data_ptr() % 16:
        gate = gate.contiguous()
    return gate, gate.stride(0)
