"""CUDA implementations (kernels_cu) of the H3 blocks' AdaLN ops, on torch tensors and torch's current stream.

The ops (adaln_lab/modulation_table.py, modulated_rms_norm.py, gated_residual.py) define shapes,
rounding and autograd; these functions are their CUDA kernels:

- `modulation_table_fwd(temb (T, D) fp32, weight (N, D) bf16, bias (N,) bf16) -> table (T, N) fp32`
  holding bf16 values (table.cu with N columns: the fixed-order GEMV, each row T-invariant).
- `modulation_table_bwd(d_table (T, N) fp32, temb, weight) -> d_temb (T, D) fp32, d_weight (N, D) bf16,
  d_bias (N,) bf16` (table_bwd.cu in a fixed order; d_bias: the T values of a column summed in
  order in double by table_bwd's blocks, rounded once).
- `modulated_rms_norm_fwd(x (..., S, H) bf16, norm_weight (H,) bf16, shift (R, H), scale (R, H),
  row_index (S,) int64, eps) -> out (..., S, H) bf16, rstd (rows,) fp32`, and
  `modulated_rms_norm_bwd(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None) -> dx,
  d_norm_weight (H,) bf16, d_shift (R, H) fp32, d_scale (R, H) fp32` (with d_residual, x's shape: dx =
  bf16(bf16(the norm's dx) + d_residual), in the row pass where three rows fit its stages, else torch's add):
  norm_out's row kernels (norm_modulate.cu; backward: norm_modulate_bwd.cu's sorted passes and
  reduce_partials.cu's sorted reduce) with the R table rows as their "timesteps". The backward passes walk
  the rows in table-row order (`row_order(row_index, plan) -> (R + 1 + S,) int32`, row_order.cu), so a row
  range sums the few table rows its positions span (one or two where each table row holds more rows than a
  range) instead of R; per row the bits are norm_out's. shift | scale
  is one table (`_shift_scale`): the blocks' chunks, where scale follows shift in each row of the
  (3T, 6H) view, as they lie (row stride 6H); other shift and scale (any strides, values in bf16)
  gathered into an (R, 2H) array. The backward reads that fp32 table in place; the forward reads a
  contiguous bf16 copy (one small cast: its row-per-block kernel reads a table row per row, from L2,
  and an fp32 one cost 10 % more time, bench/NOTES.md v6).
- `gated_residual_fwd(x, gate (R, H) fp32, y, row_index) -> out` and
  `gated_residual_bwd(dout, gate, y, row_index) -> d_gate (R, H) fp32, d_y` (gated_residual.cu; the backward in
  table-row order too); gate may be a column slice of the table (row stride of 6H floats).
- `gated_residual_norm_fwd(x, gate, y, row_index, norm_weight, shift, scale, eps) -> x_out, out, rstd` (one
  kernel, gated_residual_norm.cu) and `gated_residual_norm_bwd(d_x_out, d_out, x_out, gate, y, row_index,
  norm_weight, shift, scale, rstd) -> dx, d_gate, d_y, d_norm_weight, d_shift, d_scale`: the two ops above
  composed, with the residual gradient summed in the norm's row pass (`modulated_rms_norm_bwd(...,
  d_residual=)`): the same bits as the ops one after the other with autograd's bf16 add between.

Plans: the table's plan is `plan(8, D, T, table_n=N, table_f32_rounded=True)` (its row kernels
unused), the rows' plan `plan(H, 8, R)` (its table kernels unused); see adaln_lab/plan.py.
Inputs are validated by the ops; `unsupported_*` say why these kernels cannot take them.
"""

from __future__ import annotations

import torch

from . import launchers
from .cuda_op import _aligned, current_stream
from .plan import T_MAX, check_shapes
from .plan import plan as make_plan


def _setup(device: torch.device, plan):
    launchers.bind(device.index)
    return launchers.kernels(device.index, plan), current_stream(device.index)


def _bf16(name: str, t: torch.Tensor) -> Exception | None:
    if t.dtype != torch.bfloat16:
        return TypeError(f"the CUDA kernels need {name} in bfloat16, got {t.dtype}")
    return None


def unsupported_table(temb, weight, bias) -> Exception | None:
    """Why table.cu cannot take these inputs (None if it can)."""
    if not temb.is_cuda:
        return ValueError(f"the CUDA kernels need CUDA tensors, but temb is on {temb.device}")
    if temb.dtype != torch.float32:
        return TypeError(f"the CUDA kernels need temb in float32, got {temb.dtype}")
    error = _bf16("weight", weight) or _bf16("bias", bias)
    if error is not None:
        return error
    try:
        make_plan(8, temb.shape[1], temb.shape[0], table_n=weight.shape[0], table_f32_rounded=True)
    except ValueError as err:
        return err
    return None


def unsupported_rows(x, table_rows: int, **bf16_tensors) -> Exception | None:
    """Why the row kernels cannot take x (..., S, H) with `table_rows` table rows (None if they can)."""
    if not x.is_cuda:
        return ValueError(f"the CUDA kernels need CUDA tensors, but x is on {x.device}")
    for name, t in (("x", x), *bf16_tensors.items()):
        error = _bf16(name, t)
        if error is not None:
            return error
    if table_rows > T_MAX:
        return ValueError(f"the CUDA kernels take at most {T_MAX} table rows, got {table_rows} (an H3 block has "
                          f"3 per timestep: T = temb.shape[0] <= {T_MAX // 3})")
    try:
        check_shapes(x.shape[-1], 8, max(table_rows, 1))
    except ValueError as err:
        return err
    return None


def modulation_table_fwd(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    T, D = temb.shape
    N = weight.shape[0]
    plan = make_plan(8, D, T, table_n=N, table_f32_rounded=True)
    temb, weight, bias = temb.contiguous(), _aligned(weight), _aligned(bias)
    k, stream = _setup(temb.device, plan)
    table = torch.empty(T, N, dtype=torch.float32, device=temb.device)
    table_bf16 = torch.empty(T, N, dtype=torch.bfloat16, device=temb.device)
    launchers.launch_table(k, plan, stream, temb.data_ptr(), weight.data_ptr(), bias.data_ptr(),
                           table_bf16.data_ptr(), table.data_ptr())
    return table


def modulation_table_bwd(d_table: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor):
    T, D = temb.shape
    N = weight.shape[0]
    plan = make_plan(8, D, T, table_n=N, table_f32_rounded=True)
    d_table, temb, weight = d_table.float().contiguous(), temb.contiguous(), _aligned(weight)
    k, stream = _setup(temb.device, plan)
    d_temb = torch.empty_like(temb)
    d_weight = torch.empty_like(weight)
    d_bias = torch.empty(N, dtype=weight.dtype, device=temb.device)
    dact_partials = torch.empty(plan.blocks_j, T, D, dtype=torch.float32, device=temb.device)
    launchers.launch_table_bwd(k, plan, stream, d_table.data_ptr(), temb.data_ptr(), weight.data_ptr(),
                               d_weight.data_ptr(), dact_partials.data_ptr(), d_temb.data_ptr(), d_bias.data_ptr())
    return d_temb, d_weight, d_bias


def _row_plan(x: torch.Tensor, table_rows: int):
    H = x.shape[-1]
    plan = make_plan(H, 8, table_rows)
    return plan, plan.rows(x.numel() // H)


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


def modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, eps: float):
    R, H = shift.shape
    plan, rows = _row_plan(x, R)
    x, norm_weight = _aligned(x), _aligned(norm_weight)
    table = _shift_scale_bf16(shift, scale)
    row_index = row_index.contiguous()
    k, stream = _setup(x.device, plan)
    out = torch.empty_like(x)
    rstd = torch.empty(rows.rows, dtype=torch.float32, device=x.device)
    launchers.launch_norm_modulate(k, plan, rows, stream, x.data_ptr(), norm_weight.data_ptr(), table.data_ptr(),
                                   row_index.data_ptr(), out.data_ptr(), rstd.data_ptr(), x.shape[-2], float(eps))
    return out, rstd


def row_order(row_index: torch.Tensor, plan) -> torch.Tensor:
    """(T + 1 + S,) int32: row_order.cu's row_offsets | order of row_index (S,) int64, the positions sorted by
    table row (T = plan.T, a row plan's), stably; the backward row passes walk the rows in that order."""
    row_index = row_index.contiguous()
    k, stream = _setup(row_index.device, plan)
    order = torch.empty(plan.T + 1 + row_index.shape[0], dtype=torch.int32, device=row_index.device)
    launchers.launch_row_order(k, plan, stream, row_index.data_ptr(), order.data_ptr(), row_index.shape[0])
    return order


def modulated_rms_norm_bwd(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None, order=None):
    """order: `row_order(row_index, plan)` if the caller has it (one sort for several backward passes)."""
    R, H = shift.shape
    plan, rows = _row_plan(x, R)
    dy, x, norm_weight = _aligned(dy), _aligned(x), _aligned(norm_weight)
    table_f32, table_stride = _shift_scale(shift, scale)
    row_index, rstd = row_index.contiguous(), rstd.contiguous()
    order = row_order(row_index, plan) if order is None else order.contiguous()
    fused = d_residual is not None and plan.bwd_res_stages > 0
    d_residual = _aligned(d_residual) if fused else d_residual
    k, stream = _setup(x.device, plan)
    dx = torch.empty_like(x)
    d_norm_weight = torch.empty_like(norm_weight)
    d_shift = torch.empty(R, H, dtype=torch.float32, device=x.device)
    d_scale = torch.empty(R, H, dtype=torch.float32, device=x.device)
    d_sum_unused = torch.empty(2 * H, dtype=torch.bfloat16, device=x.device)
    row_partials = torch.empty(launchers.sorted_slots(plan, rows) * 2 * H, dtype=torch.float32, device=x.device)
    launchers.launch_sorted_row_pass(k, plan, rows, stream, dy.data_ptr(), x.data_ptr(), rstd.data_ptr(),
                                     norm_weight.data_ptr(), table_f32.data_ptr(), row_index.data_ptr(),
                                     order.data_ptr(), dx.data_ptr(), row_partials.data_ptr(), x.shape[-2],
                                     d_residual.data_ptr() if fused else 0, table_stride)
    launchers.launch_reduce_sorted_partials(k, plan, rows, stream, row_partials.data_ptr(), norm_weight.data_ptr(),
                                            table_f32.data_ptr(), d_shift.data_ptr(), d_scale.data_ptr(),
                                            d_norm_weight.data_ptr(), d_sum_unused.data_ptr(), order.data_ptr(),
                                            x.shape[-2], table_stride)
    if d_residual is not None and not fused:  # a row too wide for three staged inputs: torch's bf16 add, same bits
        dx = dx + d_residual
    return dx, d_norm_weight, d_shift, d_scale


def _gate_pointer(gate: torch.Tensor) -> tuple[torch.Tensor, int]:
    """gate as fp32 rows of H contiguous floats, 16-byte aligned rows: (tensor, row stride in floats)."""
    gate = gate.float()
    if gate.stride(-1) != 1 or gate.stride(0) % 4 or gate.data_ptr() % 16:
        gate = gate.contiguous()
    return gate, gate.stride(0)


def gated_residual_fwd(x, gate, y, row_index):
    R, H = gate.shape
    plan, rows = _row_plan(x, R)
    x, y, row_index = _aligned(x), _aligned(y), row_index.contiguous()
    gate, stride = _gate_pointer(gate)
    k, stream = _setup(x.device, plan)
    out = torch.empty_like(x)
    launchers.launch_gated_residual(k, plan, rows, stream, x.data_ptr(), gate.data_ptr(), y.data_ptr(),
                                    row_index.data_ptr(), out.data_ptr(), stride, x.shape[-2])
    return out


def gated_residual_bwd(dout, gate, y, row_index, order=None):
    """order: `row_order(row_index, plan)` if the caller has it."""
    R, H = gate.shape
    plan, rows = _row_plan(y, R)
    dout, y, row_index = _aligned(dout), _aligned(y), row_index.contiguous()
    order = row_order(row_index, plan) if order is None else order.contiguous()
    gate, stride = _gate_pointer(gate)
    k, stream = _setup(y.device, plan)
    d_y = torch.empty_like(y)
    d_gate = torch.empty(R, H, dtype=torch.float32, device=y.device)
    gate_partials = torch.empty(launchers.sorted_slots(plan, rows) * H, dtype=torch.float32, device=y.device)
    launchers.launch_gated_residual_bwd(k, plan, rows, stream, dout.data_ptr(), gate.data_ptr(), y.data_ptr(),
                                        row_index.data_ptr(), order.data_ptr(), d_y.data_ptr(),
                                        gate_partials.data_ptr(), d_gate.data_ptr(), stride, y.shape[-2])
    return d_gate, d_y


def gated_residual_norm_fwd(x, gate, y, row_index, norm_weight, shift, scale, eps: float):
    """(x_out, out, rstd): gated_residual_fwd then modulated_rms_norm_fwd of its output, in one kernel."""
    plan, rows = _row_plan(x, shift.shape[0])
    x, y, norm_weight, row_index = _aligned(x), _aligned(y), _aligned(norm_weight), row_index.contiguous()
    gate, stride = _gate_pointer(gate)
    table = _shift_scale_bf16(shift, scale)
    k, stream = _setup(x.device, plan)
    x_out, out = torch.empty_like(x), torch.empty_like(x)
    rstd = torch.empty(rows.rows, dtype=torch.float32, device=x.device)
    launchers.launch_gated_residual_norm(k, plan, rows, stream, x.data_ptr(), gate.data_ptr(), y.data_ptr(),
                                         row_index.data_ptr(), norm_weight.data_ptr(), table.data_ptr(),
                                         x_out.data_ptr(), out.data_ptr(), rstd.data_ptr(), stride, x.shape[-2],
                                         float(eps))
    return x_out, out, rstd


def gated_residual_norm_bwd(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, order=None):
    """(dx, d_gate, d_y, d_norm_weight, d_shift, d_scale): the norm's backward with the residual gradient
    d_x_out added in its row pass (norm_modulate_bwd_residual_sorted_bf16), then the gated residual's
    backward; one row_order for both."""
    order = row_order(row_index, _row_plan(x_out, shift.shape[0])[0]) if order is None else order.contiguous()
    dx, d_norm_weight, d_shift, d_scale = modulated_rms_norm_bwd(d_out, x_out, norm_weight, shift, scale, row_index,
                                                                 rstd, d_residual=d_x_out, order=order)
    d_gate, d_y = gated_residual_bwd(dx, gate, y, row_index, order=order)
    return dx, d_gate, d_y, d_norm_weight, d_shift, d_scale
