"""torch glue of the CUDA kernels: torch allocates every output and workspace, `launchers` launch on torch's
current stream of the tensors' device. One function per op and direction; inputs are validated and
supported (`adaln_lab.core.support`) before they come here.

norm_out (`final_adaln_out`): x (..., S, H) bf16, norm_weight (H,) bf16, temb (T, D) fp32, weight (2H, D)
bf16, bias (2H,) bf16, timestep_indices (S,) int64; row s of every leading index of x is modulated by
table[timestep_indices[s]], table = linear(bf16(silu(temb)), weight, bias) (T, 2H) = shift | scale.
- `forward_tensors` -> out and what the backward needs (table_f32 (T, 2H) fp32, the table before its bf16
  rounding, and rstd (rows,) fp32); `backward_tensors` -> dx (..., S, H) bf16, d_norm_weight (H,) bf16,
  d_temb (T, D) fp32, d_weight (2H, D) bf16, d_bias (2H,) bf16, every reduction in a fixed order.

The H3 blocks' ops (the row kernels with the R = 3T table rows as their "timesteps"):
- `modulation_table_fwd(temb (T, D) fp32, weight (N, D) bf16, bias (N,) bf16, row_tables=False) -> table (T, N)
  fp32` holding bf16 values (table.cu with N columns: the fixed-order GEMV, each row T-invariant); with
  row_tables (a block's table, N = 18H), (table, the norms' bf16 row tables (2, 3T, 2H)) (`plan`'s
  table_row_tables); `modulation_table_bwd(d_table, temb, weight) -> d_temb (T, D) fp32, d_weight (N, D) bf16,
  d_bias (N,) bf16`.
- `modulated_rms_norm_fwd(x, norm_weight, shift (R, H), scale (R, H), row_index (S,), eps, row_table=None) -> out,
  rstd` and `modulated_rms_norm_bwd(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None, order=None,
  into=None) -> dx, d_norm_weight (H,) bf16, d_shift (R, H) fp32, d_scale (R, H) fp32` (with d_residual, x's
  shape: dx = bf16(bf16(the norm's dx) + d_residual), in the row pass where three rows fit its stages, else
  torch's add). The backward passes walk the rows in table-row order (`row_order(row_index, plan) -> (R + 1 + S,)
  int32`, row_order.cu), so a row range sums the few table rows its positions span instead of R. shift | scale is
  one table (`_shift_scale`): the blocks' chunks, where scale follows shift in each row of the (3T, 6H) view,
  are read where they lie (row stride 6H); other shift and scale are gathered into an (R, 2H) array. The
  forward reads a contiguous bf16 shift | scale: a block's row table (row_table) or a cast of the chunks (one
  small cast: bench/NOTES.md v6). into: where the backward writes d_shift | d_scale instead (a block's table
  gradient, `ops.table_gradient`), as (address, row stride in floats).
- `gated_residual_fwd(x, gate (R, H) fp32, y, row_index) -> out`, `gated_residual_bwd(dout, gate, y,
  row_index, order=None, into=None) -> d_gate (R, H) fp32, d_y`; gate may be a column slice of the table.
- `gated_residual_norm_fwd(..., row_table=None) -> x_out, out, rstd` (one kernel) and
  `gated_residual_norm_bwd(..., into=None) -> dx, d_gate, d_y, d_norm_weight, d_shift, d_scale`: the two ops
  composed, the residual gradient summed in the norm's row pass: the bits of the ops one after the other with
  autograd's bf16 add between.

Plans: the table's is `plan(8, D, T, table_n=N, table_f32_rounded=True, table_row_tables=row_tables_fit(N))` (its
row kernels unused), the rows' `plan(H, 8, R)` (its table kernels unused); see `adaln_lab.core.plan`.
"""

from __future__ import annotations

import functools
from functools import lru_cache

import torch

from . import launchers
from .plan import plan as make_plan, row_tables_fit

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def current_device() -> int:
    """torch's current CUDA device index (torch.cuda.current_device without its lazy-init check: the callers hold
    CUDA tensors, so CUDA is initialised)."""
    return _get_device() if _get_device is not None else torch.cuda.current_device()


def current_stream(device_index: int) -> int:
    """torch's current CUDA stream on a device, as a raw handle."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: t itself when it has it (a no-op `.to` still costs microseconds of host time per call)."""
    return t if t.dtype == dtype else t.to(dtype)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and starting on a 16-byte boundary (the kernels load 8 bf16 at a time); a copy only if not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


@lru_cache(maxsize=4096)
def context(device_index: int, H: int, D: int, T: int, rows: int, table_n: int = 0, rounded: bool = False,
            row_tables: bool = False):
    """(plan, its Rows for `rows` rows, {name: Kernel} on the device) of one call's shapes, from one cache lookup
    keyed on integers (the eager path's host time)."""
    plan = make_plan(H, D, T, table_n, rounded, row_tables)
    return plan, plan.rows(rows), launchers.kernels(device_index, plan)


launchers.on_forget(context.cache_clear)


def table(temb, weight, bias):
    """table (T, 2H) bf16 and table_f32 (T, 2H) fp32 by kernels_cu/table.cu (one kernel, for tests and tools)."""
    T, D = temb.shape
    H = weight.shape[0] // 2
    plan = make_plan(H, D, T)
    out = torch.empty(T, 2 * H, dtype=torch.bfloat16, device=temb.device)
    out_f32 = torch.empty(T, 2 * H, dtype=torch.float32, device=temb.device)
    launchers.bind(temb.device.index)
    launchers.launch_table(launchers.kernels(temb.device.index, plan), plan, current_stream(temb.device.index),
                           temb.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(), out_f32.data_ptr())
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


def keeps_device(fn):
    """fn's launches bind the device of its first tensor argument; the caller's current device is back after (a
    block on cuda:1 run while cuda:0 is current leaves cuda:0 current). CPU tensors: fn as it is."""

    @functools.wraps(fn)
    def on_its_device(first, *args, **kwargs):
        if not first.is_cuda or first.get_device() == current_device():
            return fn(first, *args, **kwargs)
        with torch.cuda.device(first.device):
            return fn(first, *args, **kwargs)

    return on_its_device


def _setup(device: torch.device, plan):
    launchers.bind(device.index)
    return launchers.kernels(device.index, plan), current_stream(device.index)


def _table_setup(temb: torch.Tensor, N: int):
    """(plan, kernels, stream) of the table kernels for temb (T, D) and N columns (a block's, N = 18H with H
    divisible by 8: its bf16 output is the two row tables)."""
    index = temb.device.index
    plan, _, k = context(index, 8, temb.shape[1], temb.shape[0], 0, N, True, row_tables_fit(N))
    launchers.bind(index)
    return plan, k, current_stream(index)


@keeps_device
def modulation_table_fwd(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, row_tables: bool = False):
    """table (T, N) fp32 holding bf16 values; with row_tables (N = 18H, H divisible by 8), (table, the block's two
    bf16 row tables (2, 3T, 2H): norm1's shift_msa | scale_msa and norm2's shift_mlp | scale_mlp, `plan`)."""
    T, D = temb.shape
    N = weight.shape[0]
    plan, k, stream = _table_setup(temb, N)
    if row_tables and not plan.table_row_tables:
        raise ValueError(f"row tables need a block's table of 18H columns, H divisible by 8, got {N} columns")
    temb, weight, bias = temb.contiguous(), aligned(weight), aligned(bias)
    table = torch.empty(T, N, dtype=torch.float32, device=temb.device)
    shape = (2, 3 * T, 2 * (N // 18)) if plan.table_row_tables else (T, N)  # the bf16 output: row tables or table
    table_bf16 = torch.empty(shape, dtype=torch.bfloat16, device=temb.device)
    launchers.launch_table(k, plan, stream, temb.data_ptr(), weight.data_ptr(), bias.data_ptr(),
                           table_bf16.data_ptr(), table.data_ptr())
    return (table, table_bf16) if row_tables else table


@keeps_device
def modulation_table_bwd(d_table: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor):
    T, D = temb.shape
    N = weight.shape[0]
    plan, k, stream = _table_setup(temb, N)
    d_table, temb, weight = as_dtype(d_table, torch.float32).contiguous(), temb.contiguous(), aligned(weight)
    d_temb = torch.empty_like(temb)
    d_weight = torch.empty_like(weight)
    d_bias = torch.empty(N, dtype=weight.dtype, device=temb.device)
    dact_partials = torch.empty(plan.blocks_j, T, D, dtype=torch.float32, device=temb.device)
    launchers.launch_table_bwd(k, plan, stream, d_table.data_ptr(), temb.data_ptr(), weight.data_ptr(),
                               d_weight.data_ptr(), dact_partials.data_ptr(), d_temb.data_ptr(), d_bias.data_ptr())
    return d_temb, d_weight, d_bias


def _row_setup(x: torch.Tensor, table_rows: int):
    """(plan, rows, kernels, stream) of the row kernels for x (..., S, H) and `table_rows` table rows."""
    H, index = x.shape[-1], x.device.index
    plan, rows, k = context(index, H, 8, table_rows, x.numel() // H)
    launchers.bind(index)
    return plan, rows, k, current_stream(index)


def _shift_scale(shift: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """shift | scale (R, H) each as the one fp32 table the row kernels read: (tensor whose data starts at row 0's
    shift, row stride in floats). Where scale follows shift within each row (the blocks' chunks of the (3T, 6H)
    table view, row stride 6H) the table is read where it lies; anything else is gathered into an (R, 2H) array."""
    R, H = shift.shape
    if (shift.dtype == scale.dtype == torch.float32 and shift.stride() == scale.stride() and shift.stride(1) == 1
            and scale.data_ptr() == shift.data_ptr() + 4 * H and shift.data_ptr() % 16 == 0
            and (R == 1 or 2 * H <= shift.stride(0) < 2 ** 31) and shift.stride(0) % 4 == 0):
        return shift, shift.stride(0) if R > 1 else 2 * H
    return torch.cat([shift, scale], dim=1).float().contiguous(), 2 * H


def _shift_scale_bf16(shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """shift | scale as the contiguous (R, 2H) bf16 table the forward kernels read (one cast kernel)."""
    table, stride = _shift_scale(shift, scale)
    R, H = shift.shape
    return table.as_strided((R, 2 * H), (stride, 1)).to(torch.bfloat16).contiguous()


def _row_table(shift: torch.Tensor, row_table) -> int:
    """Address of row table `row_table[1]` of modulation_table_fwd's row tables `row_table[0]` (2, R, 2H) bf16: the
    contiguous shift | scale the forward kernels read, the values of the fp32 chunks shift and scale."""
    tables, which = row_table
    R, H = shift.shape
    if tables.shape != (2, R, 2 * H) or tables.dtype != torch.bfloat16:
        raise ValueError(f"row tables of shape (2, {R}, {2 * H}) bf16 needed, got {tuple(tables.shape)} {tables.dtype}")
    return tables.data_ptr() + which * R * 2 * H * 2


@keeps_device
def modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, eps: float, row_table=None):
    """row_table: None, or (the block's row tables (2, R, 2H) bf16, which): the forward reads its shift | scale
    there instead of casting shift and scale (`modulation_table_fwd`)."""
    plan, rows, k, stream = _row_setup(x, shift.shape[0])
    x, norm_weight = aligned(x), aligned(norm_weight)
    table = _shift_scale_bf16(shift, scale) if row_table is None else None
    table_ptr = table.data_ptr() if row_table is None else _row_table(shift, row_table)
    row_index = row_index.contiguous()
    out = torch.empty_like(x)
    rstd = torch.empty(rows.rows, dtype=torch.float32, device=x.device)
    launchers.launch_norm_modulate(k, plan, rows, stream, x.data_ptr(), norm_weight.data_ptr(), table_ptr,
                                   row_index.data_ptr(), out.data_ptr(), rstd.data_ptr(), x.shape[-2], float(eps))
    return out, rstd


@keeps_device
def row_order(row_index: torch.Tensor, plan) -> torch.Tensor:
    """(T + 1 + S,) int32: row_order.cu's row_offsets | order of row_index (S,) int64, the positions sorted by
    table row (T = plan.T, a row plan's), stably; the backward row passes walk the rows in that order."""
    row_index = row_index.contiguous()
    k, stream = _setup(row_index.device, plan)
    order = torch.empty(plan.T + 1 + row_index.shape[0], dtype=torch.int32, device=row_index.device)
    launchers.launch_row_order(k, plan, stream, row_index.data_ptr(), order.data_ptr(), row_index.shape[0])
    return order


def row_workspaces(x: torch.Tensor, table_rows: int) -> tuple[int, int]:
    """Floats of the workspaces (the row partials) of `modulated_rms_norm_bwd` and `gated_residual_bwd` on x (..., S,
    H) with `table_rows` table rows: what a caller passing `workspace` provides (16-byte multiples for H % 8 == 0)."""
    H = x.shape[-1]
    plan, rows, _ = context(x.device.index, H, 8, table_rows, x.numel() // H)
    slots = launchers.sorted_slots(plan, rows)
    return slots * 2 * H + H, slots * H


@keeps_device
def modulated_rms_norm_bwd(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None, order=None, into=None,
                           workspace=None):
    """order: `row_order(row_index, plan)` if the caller has it (one sort for several backward passes). into: None,
    or (address, row stride in floats) of fp32 memory taking d_shift | d_scale side by side (a block's table
    gradient, `ops.table_gradient`); d_shift and d_scale are then written there and returned as None. workspace:
    None, or the address of `row_workspaces(x, R)[0]` floats (16-byte aligned) for the row partials, in place of an
    allocation of its own."""
    R, H = shift.shape
    plan, rows, k, stream = _row_setup(x, R)
    dy, x, norm_weight = aligned(dy), aligned(x), aligned(norm_weight)
    table_f32, table_stride = _shift_scale(shift, scale)
    row_index, rstd = row_index.contiguous(), rstd.contiguous()
    order = row_order(row_index, plan) if order is None else order.contiguous()
    fused = d_residual is not None and plan.bwd_res_stages > 0
    d_residual = aligned(d_residual) if fused else d_residual
    dx = torch.empty_like(x)
    d_norm_weight = torch.empty_like(norm_weight)
    if into is None:
        d_shift = torch.empty(R, H, dtype=torch.float32, device=x.device)  # apart: custom-op outputs may not alias
        d_scale = torch.empty(R, H, dtype=torch.float32, device=x.device)
        d_shift_ptr, d_scale_ptr, d_stride = d_shift.data_ptr(), d_scale.data_ptr(), H
    else:
        d_shift = d_scale = None
        d_shift_ptr, d_stride = into
        d_scale_ptr = d_shift_ptr + 4 * H
    # the row partials, and after them room for the reduce's d_bias output (2H bf16), which the blocks do not use
    if workspace is None:
        partials = torch.empty(launchers.sorted_slots(plan, rows) * 2 * H + H, dtype=torch.float32, device=x.device)
        workspace = partials.data_ptr()
    d_sum_unused = workspace + 4 * launchers.sorted_slots(plan, rows) * 2 * H
    launchers.launch_sorted_row_pass(k, plan, rows, stream, dy.data_ptr(), x.data_ptr(), rstd.data_ptr(),
                                     norm_weight.data_ptr(), table_f32.data_ptr(), row_index.data_ptr(),
                                     order.data_ptr(), dx.data_ptr(), workspace, x.shape[-2],
                                     d_residual.data_ptr() if fused else 0, table_stride)
    launchers.launch_reduce_sorted_partials(k, plan, rows, stream, workspace, norm_weight.data_ptr(),
                                            table_f32.data_ptr(), d_shift_ptr, d_scale_ptr, d_norm_weight.data_ptr(),
                                            d_sum_unused, order.data_ptr(), x.shape[-2], table_stride, d_stride)
    if d_residual is not None and not fused:  # a row too wide for three staged inputs: torch's bf16 add, same bits
        dx = dx + d_residual
    return dx, d_norm_weight, d_shift, d_scale


def _gate_pointer(gate: torch.Tensor) -> tuple[torch.Tensor, int]:
    """gate as fp32 rows of H contiguous floats, 16-byte aligned rows: (tensor, row stride in floats)."""
    gate = as_dtype(gate, torch.float32)
    if gate.stride(-1) != 1 or gate.stride(0) % 4 or gate.data_ptr() % 16:
        gate = gate.contiguous()
    return gate, gate.stride(0)


@keeps_device
def gated_residual_fwd(x, gate, y, row_index):
    plan, rows, k, stream = _row_setup(x, gate.shape[0])
    x, y, row_index = aligned(x), aligned(y), row_index.contiguous()
    gate, stride = _gate_pointer(gate)
    out = torch.empty_like(x)
    launchers.launch_gated_residual(k, plan, rows, stream, x.data_ptr(), gate.data_ptr(), y.data_ptr(),
                                    row_index.data_ptr(), out.data_ptr(), stride, x.shape[-2])
    return out


@keeps_device
def gated_residual_bwd(dout, gate, y, row_index, order=None, into=None, workspace=None):
    """order: `row_order(row_index, plan)` if the caller has it. into: None, or (address, row stride in floats) of
    fp32 memory taking d_gate (a block's table gradient); d_gate is then written there and returned as None.
    workspace: None, or the address of `row_workspaces(y, R)[1]` floats (16-byte aligned) for the gate partials."""
    R, H = gate.shape
    plan, rows, k, stream = _row_setup(y, R)
    dout, y, row_index = aligned(dout), aligned(y), row_index.contiguous()
    order = row_order(row_index, plan) if order is None else order.contiguous()
    gate, stride = _gate_pointer(gate)
    d_y = torch.empty_like(y)
    d_gate = torch.empty(R, H, dtype=torch.float32, device=y.device) if into is None else None
    d_gate_ptr, d_stride = (d_gate.data_ptr(), H) if into is None else into
    if workspace is None:
        gate_partials = torch.empty(launchers.sorted_slots(plan, rows) * H, dtype=torch.float32, device=y.device)
        workspace = gate_partials.data_ptr()
    launchers.launch_gated_residual_bwd(k, plan, rows, stream, dout.data_ptr(), gate.data_ptr(), y.data_ptr(),
                                        row_index.data_ptr(), order.data_ptr(), d_y.data_ptr(), workspace, d_gate_ptr,
                                        stride, y.shape[-2], d_stride)
    return d_gate, d_y


@keeps_device
def gated_residual_norm_fwd(x, gate, y, row_index, norm_weight, shift, scale, eps: float, row_table=None):
    """(x_out, out, rstd): gated_residual_fwd then modulated_rms_norm_fwd of its output, in one kernel; row_table
    as modulated_rms_norm_fwd's."""
    plan, rows, k, stream = _row_setup(x, shift.shape[0])
    x, y, norm_weight, row_index = aligned(x), aligned(y), aligned(norm_weight), row_index.contiguous()
    gate, stride = _gate_pointer(gate)
    table = _shift_scale_bf16(shift, scale) if row_table is None else None
    table_ptr = table.data_ptr() if row_table is None else _row_table(shift, row_table)
    x_out, out = torch.empty_like(x), torch.empty_like(x)
    rstd = torch.empty(rows.rows, dtype=torch.float32, device=x.device)
    launchers.launch_gated_residual_norm(k, plan, rows, stream, x.data_ptr(), gate.data_ptr(), y.data_ptr(),
                                         row_index.data_ptr(), norm_weight.data_ptr(), table_ptr,
                                         x_out.data_ptr(), out.data_ptr(), rstd.data_ptr(), stride, x.shape[-2],
                                         float(eps))
    return x_out, out, rstd


@keeps_device
def gated_residual_norm_bwd(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, order=None,
                            into=None, workspaces=(None, None)):
    """(dx, d_gate, d_y, d_norm_weight, d_shift, d_scale): the norm's backward with the residual gradient
    d_x_out added in its row pass (norm_modulate_bwd_residual_sorted_bf16), then the gated residual's
    backward; one row_order for both. into: None, or (address, row stride in floats) of fp32 memory taking
    d_gate | d_shift | d_scale side by side; those three are then written there and returned as None.
    workspaces: the norm's and the gate's `workspace` (each None or an address, `row_workspaces`)."""
    order = row_order(row_index, _row_setup(x_out, shift.shape[0])[0]) if order is None else order.contiguous()
    norm_into = gate_into = None
    if into is not None:
        gate_into, norm_into = into, (into[0] + 4 * x_out.shape[-1], into[1])
    dx, d_norm_weight, d_shift, d_scale = modulated_rms_norm_bwd(d_out, x_out, norm_weight, shift, scale, row_index,
                                                                 rstd, d_residual=d_x_out, order=order, into=norm_into,
                                                                 workspace=workspaces[0])
    d_gate, d_y = gated_residual_bwd(dx, gate, y, row_index, order=order, into=gate_into, workspace=workspaces[1])
    return dx, d_gate, d_y, d_norm_weight, d_shift, d_scale
