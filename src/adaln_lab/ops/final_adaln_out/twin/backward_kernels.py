"""The kernels of the Numba-CUDA twin of the backward: numba jit functions, built once per plan.

`*_kernel(plan)` twins norm_modulate_bwd, reduce_partials (kernels_cu/norm_modulate_bwd.cu, reduce_partials.cu),
table_bwd and table_bwd_reduce (table_bwd.cu); each docstring gives the launch, which
`adaln_lab.ops.final_adaln_out.twin.backward` makes. What is the kernels' and what is not:
- Arithmetic: every fp32 / fp64 operation of the kernels in their order. Where the kernels' source
  writes `fmaf`, or where NVRTC (default --fmad=true) contracts a product into an add, the twin writes
  `cuda.fma`; the contractions, read from the SASS of the compiled unit (sm_90, CUDA 13.5):
    dx = rstd * fma(-xhat, mean_dot, g)                     (norm_modulate_bwd: `rstd * (g - xhat * mean_dot)`)
    d_nw = fma(1 + scale, a, d_nw)                          (reduce_partials, in double)
    d_temb = (dact * s) * fma(v, 1 - s, 1)                  (table_bwd_reduce, in double)
  Nowhere else does a product feed an add, so NVVM's own contraction choices cannot change a bit.
- Not the kernels': the cp.async pipeline of the row pass (it changes when x and dy arrive, not what
  is summed), the vector loads and stores, the warp shuffles (the simulator has none: every butterfly
  is written as shared-memory steps of `warp_sum_lane0`'s association, lane l adding lane l + offset).
"""

from __future__ import annotations

import math
from functools import lru_cache

from .forward import cuda, device_functions
from ....core.plan import Plan

VEC = 8  # ADALN_VEC (adaln_common.cuh): bf16 values of one 16-byte vector


nc = None  # numba.cuda once _nc() ran; kernels name it as a module global so the simulator can swap it


def _nc():
    """`numba.cuda` (after numba.forward's numpy shim), bound to this module's global `nc`."""
    global nc
    if nc is None:
        nc = cuda()
    return nc


def _register_limit(threads: int) -> dict:
    """jit options that let a block of `threads` launch, as kernels_cu's __launch_bounds__ does: the
    launch bound itself (NVVM's maxntid, so ptxas fits the registers to the block) and at most
    65536 / threads registers per thread, in steps of 8. Without them numba lets the register count
    float and the row pass at H = 5376 (672 threads) fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
    (H200, 711d68c; max_registers alone did not help on 9cf210c). Register allocation changes no
    arithmetic. The simulator takes no such option."""
    from numba import config

    if config.ENABLE_CUDASIM:
        return {}
    return {"max_registers": min(255, 65536 // threads // 8 * 8), "launch_bounds": threads}


def _tuning(plan: Plan, name: str) -> int:
    return dict(plan.tuning)[name]


@lru_cache(maxsize=None)
def _block_sum():
    """block_sum of adaln_common.cuh as a device function: each warp's butterfly, then warp 0's over
    the warp sums (lanes beyond the warp count add 0.0). Every thread calls it; all get the same bits."""
    _nc()
    _, _, _, warp_sum_lane0, _ = device_functions()
    from numba import float32

    @nc.jit(device=True)
    def block_sum(value, lanes, warps, tid, nwarps):
        lane, warp = tid % 32, tid // 32
        lanes[tid] = value
        warp_sum_lane0(lanes[warp * 32:warp * 32 + 32], lane)
        if tid < 32:
            warps[tid] = lanes[tid * 32] if tid < nwarps else float32(0.0)
        return warp_sum_lane0(warps, tid)

    return block_sum


@lru_cache(maxsize=None)
def norm_modulate_bwd_kernel(plan: Plan):
    """Twin of norm_modulate_bwd_bf16: one block per row range, one pass per timestep t = 0 .. T-1 over
    the range's rows of t in row order (rows with an index outside [0, T) go with pass 0 and poison it).

    Launch: [rows.bwd_ranges, plan.bwd_threads](dy, x, rstd, norm_weight, table_f32, timestep_indices,
    dx, row_partials, S, rows, rows_per_range) with dy, x, dx (rows, H) uint16; rstd (rows,) fp32;
    norm_weight (H,) uint16; table_f32 (T, 2H) fp32; timestep_indices (S,) int64;
    row_partials (ranges, T, 2, H) fp32: [b, t, 0] = sum of dy * xhat, [b, t, 1] = sum of dy.
    """
    _nc()
    from numba import float32, int32

    bf16_to_float, float_to_bf16, _, _, _ = device_functions()
    block_sum = _block_sum()
    H, T = plan.H, plan.T
    threads, vpt = plan.bwd_threads, plan.bwd_vpt
    nwarps, nvec_h = threads // 32, H // VEC
    row_list_max = _tuning(plan, "ROW_LIST_MAX")

    @nc.jit(**_register_limit(threads))
    def kernel(dy, x, rstd, norm_weight, table_f32, timestep_indices, dx, row_partials, S, rows, rows_per_range):
        lanes = nc.shared.array(threads, float32)
        warps = nc.shared.array(32, float32)
        timesteps = nc.shared.array(row_list_max, int32)
        tid = nc.threadIdx.x
        r0 = nc.blockIdx.x * rows_per_range
        n = min(rows, r0 + rows_per_range) - r0
        for i in range(tid, n, threads):  # fill_row_timesteps: -1 where the index lies outside [0, T)
            ts = timestep_indices[(r0 + i) % S]
            timesteps[i] = -1 if (ts < 0 or ts >= T) else int32(ts)
        nc.syncthreads()

        w = nc.local.array((vpt, VEC), float32)
        s1 = nc.local.array((vpt, VEC), float32)
        sum_dy_xhat = nc.local.array((vpt, VEC), float32)
        sum_dy = nc.local.array((vpt, VEC), float32)
        xhat = nc.local.array((vpt, VEC), float32)
        g = nc.local.array((vpt, VEC), float32)
        for t in range(T):
            present = False
            for p in range(n):
                ts = timesteps[p]
                if ts == t or (ts < 0 and t == 0):
                    present = True
            if not present:  # no row of this timestep here: zeros, read nothing
                for i in range(tid, 2 * H, threads):
                    row_partials[nc.blockIdx.x, t, i // H, i % H] = float32(0.0)
                continue
            for i in range(vpt):  # norm_weight and 1 + scale[t] (fp32 table) for the pass
                v = tid + i * threads
                for e in range(VEC):
                    if v < nvec_h:
                        w[i, e] = bf16_to_float(norm_weight[v * VEC + e])
                        s1[i, e] = float32(1.0) + table_f32[t, H + v * VEC + e]
                    sum_dy_xhat[i, e] = float32(0.0)
                    sum_dy[i, e] = float32(0.0)
            for p in range(n):  # the pass: this timestep's rows in row order
                ts = timesteps[p]
                if not (ts == t or (ts < 0 and t == 0)):
                    continue
                row = r0 + p
                invalid = ts < 0
                row_rstd = rstd[row]
                dot = float32(0.0)  # this thread's vectors in order, 8 elements each in order
                for i in range(vpt):
                    v = tid + i * threads
                    if v < nvec_h:
                        for e in range(VEC):
                            h = v * VEC + e
                            dyv = bf16_to_float(dy[row, h])
                            xhat[i, e] = bf16_to_float(x[row, h]) * row_rstd
                            g[i, e] = (dyv * s1[i, e]) * w[i, e]
                            dot = nc.fma(g[i, e], xhat[i, e], dot)
                            sum_dy_xhat[i, e] = nc.fma(dyv, xhat[i, e], sum_dy_xhat[i, e])
                            sum_dy[i, e] = sum_dy[i, e] + dyv
                mean_dot = block_sum(dot, lanes, warps, tid, nwarps) / float32(H)
                for i in range(vpt):
                    v = tid + i * threads
                    if v < nvec_h:
                        for e in range(VEC):
                            # NVRTC contracts `g - xhat * mean_dot` into one fma (see the module docstring)
                            d = float32(math.nan) if invalid else row_rstd * nc.fma(-xhat[i, e], mean_dot, g[i, e])
                            dx[row, v * VEC + e] = float_to_bf16(d)
                if invalid:  # poison: this row belongs to no timestep
                    for i in range(vpt):
                        for e in range(VEC):
                            sum_dy_xhat[i, e] = float32(math.nan)
                            sum_dy[i, e] = float32(math.nan)
            for i in range(vpt):
                v = tid + i * threads
                if v < nvec_h:
                    for e in range(VEC):
                        row_partials[nc.blockIdx.x, t, 0, v * VEC + e] = sum_dy_xhat[i, e]
                        row_partials[nc.blockIdx.x, t, 1, v * VEC + e] = sum_dy[i, e]

    return kernel


@lru_cache(maxsize=None)
def reduce_partials_kernel(plan: Plan):
    """Twin of reduce_partials_bf16: one h per threadIdx.x, one row-range group (group_bounds) per
    threadIdx.y; each A[t, h], B[t, h] summed over its group's ranges in order in double, the groups in
    group order; then t = 0 .. T-1 in order.

    The kernel walks t in chunks of plan.rp_t timesteps to keep 2 * rp_t loads in flight; every
    A[t, h] and B[t, h] is still its own accumulator over the same ranges in the same order, and the
    t-sums still see t = 0 .. T-1 in order, so a plain loop over t has the same association (the
    tests transcribe the chunked loop and compare bit for bit).

    Launch: [ceil(H / 32), (32, plan.sum_groups)](row_partials, norm_weight, table_f32, d_table,
    d_norm_weight, d_bias, nblocks): row_partials (>= nblocks, T, 2, H) fp32; norm_weight (H,) uint16;
    table_f32 (T, 2H) fp32; d_table (T, 2H) fp32 = d_shift | d_scale; d_norm_weight (H,) uint16;
    d_bias (2H,) uint16.
    """
    _nc()
    from numba import float32, float64

    bf16_to_float, float_to_bf16, _, _, _ = device_functions()
    H, T, groups = plan.H, plan.T, plan.sum_groups

    @nc.jit(**_register_limit(32 * groups))
    def kernel(row_partials, norm_weight, table_f32, d_table, d_norm_weight, d_bias, nblocks):
        scratch = nc.shared.array((groups, 2, 32), float64)
        tx, ty = nc.threadIdx.x, nc.threadIdx.y
        h = nc.blockIdx.x * 32 + tx
        valid = h < H
        w = float64(bf16_to_float(norm_weight[h])) if valid else float64(0.0)
        per = (nblocks + groups - 1) // groups  # group_bounds
        b0 = min(nblocks, ty * per)
        b1 = min(nblocks, b0 + per)
        d_nw = float64(0.0)
        d_shift_sum = float64(0.0)
        d_scale_sum = float64(0.0)
        for t in range(T):
            sa = float64(0.0)
            sb = float64(0.0)
            if valid:
                for b in range(b0, b1):
                    sa += float64(row_partials[b, t, 0, h])
                    sb += float64(row_partials[b, t, 1, h])
            scratch[ty, 0, tx] = sa
            scratch[ty, 1, tx] = sb
            nc.syncthreads()
            if ty == 0 and valid:
                a = float64(0.0)
                bsum = float64(0.0)
                for gi in range(groups):
                    a += scratch[gi, 0, tx]
                    bsum += scratch[gi, 1, tx]
                d_shift = float32(bsum)
                d_scale = float32(w * a)
                d_table[t, h] = d_shift
                d_table[t, H + h] = d_scale
                # NVRTC contracts `d_nw += (1.0 + scale) * a` into one double fma
                d_nw = nc.fma(float64(1.0) + float64(table_f32[t, H + h]), a, d_nw)
                d_shift_sum += float64(d_shift)
                d_scale_sum += float64(d_scale)
            nc.syncthreads()
        if ty == 0 and valid:
            d_norm_weight[h] = float_to_bf16(float32(d_nw))
            d_bias[h] = float_to_bf16(float32(d_shift_sum))
            d_bias[H + h] = float_to_bf16(float32(d_scale_sum))

    return kernel


@lru_cache(maxsize=None)
def table_bwd_kernel(plan: Plan):
    """Twin of table_bwd_bf16: lane l covers the V = plan.tb_vec columns of vector blockIdx.x * 32 + l of a
    plan.tb_columns-column tile, warp w the TB_ROWS / W consecutive rows j from blockIdx.y * TB_ROWS + w * TB_ROWS /
    W, in order; d_weight[j, k] = bf16(fma over t in order of d_table[t, j] * silu(temb[t, k])) (SiLU
    unrounded); dact over the warp's rows by fma in row order; the W warps' dact added in warp order
    (threads striding over the tile's columns) into dact_partials[blockIdx.y, t, k].

    Launch: [plan.tb_grid, plan.tb_threads](d_table, temb, weight, d_weight, dact_partials):
    d_table (T, 2H) fp32; temb (T, D) fp32; weight, d_weight (2H, D) uint16;
    dact_partials (plan.blocks_j, T, D) fp32.
    """
    _nc()
    from numba import float32

    bf16_to_float, float_to_bf16, _, _, silu = device_functions()
    H, D, T = plan.H, plan.D, plan.T
    threads, tb_rows = plan.tb_threads, plan.tb_rows
    nwarps = threads // 32
    rows_per_warp = tb_rows // nwarps
    V, TB_COLUMNS = plan.tb_vec, plan.tb_columns
    nvec_d = D // V
    assert tb_rows % nwarps == 0 and TB_COLUMNS == 32 * V and D % V == 0  # the kernel's static_asserts

    @nc.jit(**_register_limit(threads))
    def kernel(d_table, temb, weight, d_weight, dact_partials):
        combine = nc.shared.array((nwarps, TB_COLUMNS), float32)
        act = nc.local.array((T, V), float32)
        dact = nc.local.array((T, V), float32)
        wv = nc.local.array(V, float32)
        gt = nc.local.array(T, float32)
        tid = nc.threadIdx.x
        lane, warp = tid % 32, tid // 32
        kv = nc.blockIdx.x * 32 + lane
        k0 = nc.blockIdx.x * TB_COLUMNS
        valid = kv < nvec_d
        for t in range(T):
            for e in range(V):
                act[t, e] = silu(temb[t, kv * V + e]) if valid else float32(0.0)
                dact[t, e] = float32(0.0)
        for i in range(rows_per_warp):
            j = nc.blockIdx.y * tb_rows + warp * rows_per_warp + i
            if not valid or j >= 2 * H:
                break
            for e in range(V):
                wv[e] = bf16_to_float(weight[j, kv * V + e])
            for t in range(T):
                gt[t] = d_table[t, j]
            for e in range(V):
                s = float32(0.0)
                for t in range(T):
                    s = nc.fma(gt[t], act[t, e], s)
                    dact[t, e] = nc.fma(gt[t], wv[e], dact[t, e])
                d_weight[j, kv * V + e] = float_to_bf16(s)
        for t in range(T):
            for e in range(V):
                combine[warp, lane * V + e] = dact[t, e]
            nc.syncthreads()
            for c in range(tid, TB_COLUMNS, threads):
                s = float32(0.0)
                for ww in range(nwarps):
                    s += combine[ww, c]
                if k0 + c < D:
                    dact_partials[nc.blockIdx.y, t, k0 + c] = s
            nc.syncthreads()

    return kernel


@lru_cache(maxsize=None)
def table_bwd_reduce_kernel(plan: Plan):
    """Twin of table_bwd_reduce: one (t, k) per threadIdx.x and blockIdx.y, ordered_column_sum over the
    row blocks (group_bounds groups in row order in double, then the groups in order), then
    d_temb = dact * silu'(temb) in double (s = 1 / (1 + exp(-v)); dact * s * (1 + v * (1 - s))), stored fp32.

    Launch: [(ceil(D / 32), T), (32, plan.sum_groups)](dact_partials, temb, d_temb, nblocks):
    dact_partials (>= nblocks, T, D) fp32; temb, d_temb (T, D) fp32.
    """
    _nc()
    from numba import float32, float64

    D, groups = plan.D, plan.sum_groups

    @nc.jit(**_register_limit(32 * groups))
    def kernel(dact_partials, temb, d_temb, nblocks):
        scratch = nc.shared.array((groups, 32), float64)
        tx, ty = nc.threadIdx.x, nc.threadIdx.y
        k, t = nc.blockIdx.x * 32 + tx, nc.blockIdx.y
        valid = k < D
        per = (nblocks + groups - 1) // groups  # ordered_column_sum: group_bounds, then the groups in order
        b0 = min(nblocks, ty * per)
        b1 = min(nblocks, b0 + per)
        s = float64(0.0)
        if valid:
            for b in range(b0, b1):
                s += float64(dact_partials[b, t, k])
        scratch[ty, tx] = s
        nc.syncthreads()
        dact = float64(0.0)
        if ty == 0:
            for gi in range(groups):
                dact += scratch[gi, tx]
        nc.syncthreads()
        if ty == 0 and valid:
            v = float64(temb[t, k])
            sig = float64(1.0) / (float64(1.0) + math.exp(-v))
            # NVRTC contracts `1.0 + v * (1.0 - s)` into one double fma
            d_temb[t, k] = float32(dact * sig * nc.fma(v, float64(1.0) - sig, float64(1.0)))

    return kernel
