"""The Numba-CUDA twin of the backward: kernels_cu/norm_modulate_bwd.cu, reduce_partials.cu and table_bwd.cu.

Written for reading, like `adaln_lab.ops.final_adaln_out.twin.forward` (the forward's twin, whose device functions the
kernels import): the same launch geometry (every number from `adaln_lab.core.plan`), the same reduction
order and the same rounding points as the CUDA C++ kernels, launched in the order of
`adaln_lab.core.launchers.launch_backward`:

    norm_modulate_bwd   grid Rows.bwd_ranges, block plan.bwd_threads        -> dx, row_partials
    reduce_partials     grid ceil(H / 32), block (32, plan.sum_groups)      -> d_table, d_norm_weight, d_bias
    table_bwd           grid plan.tb_grid, block plan.tb_threads            -> d_weight, dact_partials
    table_bwd_reduce    grid (ceil(D / 32), T), block (32, plan.sum_groups) -> d_temb

This is the unsorted row pass, which launch_backward runs below plan.bwd_sorted's BWD_SORTED_MIN_T timesteps; from
there on the kernels take the rows in timestep order (row_order.cu and the blocks' sorted pass), which the twin does
not mirror: its dx is the same bits, its parameter sums another association. Nor does it mirror table_bwd's halves
on tensor cores (table_bwd_mma.cu, from plan.tb_mma's T on): its table_bwd is table_bwd.cu's CUDA-core order.

The kernels are `adaln_lab.ops.final_adaln_out.twin.backward_kernels`, whose docstring says what is the kernels' and
what is not (the fma contractions, the loads and the warp shuffles); this module allocates the outputs and launches.

On a GPU the twin is meant to equal the kernels bit for bit (tests/numba/test_backward.py checks it there, `gpu`
mark). Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, a CPU) it runs on tiny shapes, with these
differences from a GPU: `cuda.fma` rounds twice (a * b + c), the exponentials are the C library's (SiLU's expf,
table_bwd_reduce's exp), not libdevice's (the simulator's libdevice functions return NaN, so the twin uses
none). Simulated values that pass through neither have the kernels' bits (row_partials' sums of dy, d_shift and
so d_bias's shift half, the zeros of empty passes, NaN poisoning); dx, the sums of dy * xhat and every other
gradient do not, although their order of operations is the kernels' all the same.

Tensors: bf16 tensors travel as their 16-bit patterns (uint16), fp32 / fp64 as themselves; on a CPU
as numpy views of torch tensors (the simulator), on a GPU as torch CUDA tensors.
Run: `backward(dy, x, rstd, norm_weight, table_f32, timestep_indices, temb, weight)`.
"""

from __future__ import annotations

import numpy as np
import torch

from .backward_kernels import (norm_modulate_bwd_kernel, reduce_partials_kernel, table_bwd_kernel,
                               table_bwd_reduce_kernel)
from .forward import bits, plain
from ....core.plan import plan as make_plan


def _empty(shape, dtype, device) -> torch.Tensor:
    """A contiguous output (an empty_like of a strided input would be copied by bits, and the copy written)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def norm_modulate_bwd(dy, x, rstd, norm_weight, table_f32, timestep_indices, D: int, *,
                      rows_per_range: int | None = None, stream=0):
    """dx (rows, H) bf16 and row_partials (max(ranges, 1), T, 2, H) fp32 (zeros when rows == 0, as
    launch_backward's memset) from dy, x (rows, H) bf16, rstd (rows,) fp32, norm_weight (H,) bf16,
    table_f32 (T, 2H) fp32, timestep_indices (S,) int64 (row r uses index r % S); D picks the plan.

    rows_per_range: None takes the plan's (Rows.bwd_rows_per_range, what launch_backward passes); the
    kernel takes any, like the CUDA one, so a test can give a few rows several ranges' worth of work.
    stream (here and in the other wrappers): the numba stream to launch on (0: numba's default;
    `adaln_lab.ops.final_adaln_out.twin.op` passes torch's current one, on which the outputs are allocated and zeroed).
    """
    rows, H = x.shape
    T = table_f32.shape[0]
    plan = make_plan(H, D, T)
    if rows_per_range is None:
        geometry = plan.rows(rows)
        per, ranges = geometry.bwd_rows_per_range, geometry.bwd_ranges
    else:
        per, ranges = rows_per_range, -(-rows // rows_per_range)
    dx = _empty(x.shape, x.dtype, x.device)
    row_partials = torch.zeros(max(ranges, 1), T, 2, H, dtype=torch.float32, device=x.device)
    if rows:
        norm_modulate_bwd_kernel(plan)[ranges, plan.bwd_threads, stream](
            bits(dy), bits(x), plain(rstd), bits(norm_weight), plain(table_f32), plain(timestep_indices),
            bits(dx), plain(row_partials), np.int64(timestep_indices.shape[0]), np.int64(rows), np.int64(per))
    return dx, row_partials


def reduce_partials(row_partials, norm_weight, table_f32, D: int, *, stream=0):
    """d_table (T, 2H) fp32 (d_shift | d_scale), d_norm_weight (H,) bf16 and d_bias (2H,) bf16 from
    row_partials (nblocks, T, 2, H) fp32, norm_weight (H,) bf16 and table_f32 (T, 2H) fp32."""
    nblocks, T, _, H = row_partials.shape
    plan = make_plan(H, D, T)
    d_table = torch.empty(T, 2 * H, dtype=torch.float32, device=row_partials.device)
    d_norm_weight = _empty(norm_weight.shape, norm_weight.dtype, row_partials.device)
    d_bias = torch.empty(2 * H, dtype=norm_weight.dtype, device=row_partials.device)
    reduce_partials_kernel(plan)[-(-H // 32), (32, plan.sum_groups), stream](
        plain(row_partials), bits(norm_weight), plain(table_f32), plain(d_table), bits(d_norm_weight),
        bits(d_bias), np.int64(nblocks))
    return d_table, d_norm_weight, d_bias


def table_bwd(d_table, temb, weight, *, stream=0):
    """d_weight (2H, D) bf16 and dact_partials (plan.blocks_j, T, D) fp32 from d_table (T, 2H) fp32,
    temb (T, D) fp32 and weight (2H, D) bf16."""
    plan = make_plan(weight.shape[0] // 2, temb.shape[1], temb.shape[0])
    d_weight = _empty(weight.shape, weight.dtype, weight.device)
    dact_partials = torch.empty(plan.blocks_j, plan.T, plan.D, dtype=torch.float32, device=weight.device)
    table_bwd_kernel(plan)[plan.tb_grid, plan.tb_threads, stream](
        plain(d_table), plain(temb), bits(weight), bits(d_weight), plain(dact_partials))
    return d_weight, dact_partials


def table_bwd_reduce(dact_partials, temb, H: int, *, stream=0):
    """d_temb (T, D) fp32 from dact_partials (nblocks, T, D) fp32 and temb (T, D) fp32; H picks the plan."""
    T, D = temb.shape
    plan = make_plan(H, D, T)
    d_temb = _empty(temb.shape, temb.dtype, temb.device)
    table_bwd_reduce_kernel(plan)[(-(-D // 32), T), (32, plan.sum_groups), stream](
        plain(dact_partials), plain(temb), plain(d_temb), np.int64(dact_partials.shape[0]))
    return d_temb


def backward(dy, x, rstd, norm_weight, table_f32, timestep_indices, temb, weight, *, stream=0):
    """The twin's whole backward, in launch_backward's order.

    Args:
        dy, x: (..., S, H) bf16 (upstream gradient and the forward's input); rows = x.numel() / H and
            row r uses timestep_indices[r % S].
        rstd: (rows,) fp32, the forward's saved 1 / sqrt(mean(x^2) + eps).
        norm_weight: (H,) bf16. table_f32: (T, 2H) fp32, the forward's table before its bf16 rounding
            (shift | scale). timestep_indices: (S,) int64; an index outside [0, T) makes that row's dx
            and every parameter gradient that sums it NaN, as the kernels do.
        temb: (T, D) fp32. weight: (2H, D) bf16.
        stream: the numba stream of the four launches (0: numba's default).

    Returns:
        dx (..., S, H) bf16, d_norm_weight (H,) bf16, d_temb (T, D) fp32, d_weight (2H, D) bf16,
        d_bias (2H,) bf16. With no rows: an empty dx and zero parameter gradients.
    """
    for name, t, dtype in (("dy", dy, torch.bfloat16), ("x", x, torch.bfloat16), ("rstd", rstd, torch.float32),
                           ("norm_weight", norm_weight, torch.bfloat16), ("table_f32", table_f32, torch.float32),
                           ("timestep_indices", timestep_indices, torch.int64), ("temb", temb, torch.float32),
                           ("weight", weight, torch.bfloat16)):
        if t.dtype != dtype:
            raise TypeError(f"the backward twin takes {name} in {dtype}, got {t.dtype}")
    H = x.shape[-1]
    shape = x.shape
    x2, dy2 = x.reshape(-1, H), dy.reshape(-1, H)
    dx, row_partials = norm_modulate_bwd(dy2, x2, rstd, norm_weight, table_f32, timestep_indices, temb.shape[1],
                                         stream=stream)
    d_table, d_norm_weight, d_bias = reduce_partials(row_partials, norm_weight, table_f32, temb.shape[1],
                                                     stream=stream)
    d_weight, dact_partials = table_bwd(d_table, temb, weight, stream=stream)
    d_temb = table_bwd_reduce(dact_partials, temb, H, stream=stream)
    return dx.reshape(shape), d_norm_weight, d_temb, d_weight, d_bias
