"""The Numba-CUDA twin of kernels_cu/table.cu and kernels_cu/norm_modulate.cu, for reading and exploring.

norm_modulate: the same launch geometry (from `adaln_lab.core.plan`: the plan of the shape), reduction order and
rounding points, written in Python; on a GPU its output and rstd equal the CUDA C++ kernel's bit for bit given the
same table (tests/numba/test_forward.py checks it there). The table: the same rounding points and a fixed order of
its own, the fp32 GEMV of table.cu up to v25, since the shipped table.cu sums on tensor cores (`table_kernel`).
Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, a CPU) it runs too, on tiny shapes: warp shuffles do not exist
there, so the twin writes every warp butterfly as shared-memory steps with the very association of `warp_sum_lane0`
(lane l adds lane l + offset for offset 16, 8, 4, 2, 1; lane 0's sum is kept). What the simulator cannot reproduce:
`cuda.fma` rounds twice there, and rsqrt is 1/sqrt.

numba-cuda 0.30.4 calls `numpy.row_stack` at its first launch, which numpy 2.5 removed; `cuda()`
puts `numpy.vstack` in its place before importing `numba.cuda`, and only when first called.

Scope: the forward (table and norm_modulate); the backward's twin is `adaln_lab.ops.final_adaln_out.twin.backward`.
Tensors: bf16 tensors travel as their 16-bit patterns (uint16), fp32 as fp32.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from ....core.plan import TWIN_TABLE_ROWS_PER_WARP as TABLE_ROWS_PER_WARP, TWIN_TABLE_THREADS as TABLE_THREADS
from ....core.plan import plan as make_plan


nc = None  # numba.cuda once cuda() ran; kernels name it as a module global so the simulator can swap it


def cuda():
    """`numba.cuda`, imported on first use, after the numpy >= 2.5 shim."""
    global nc
    if nc is None:
        if not hasattr(np, "row_stack"):
            np.row_stack = np.vstack
        from numba import cuda as numba_cuda

        nc = numba_cuda
    return nc


@lru_cache(maxsize=None)
def device_functions():
    """bf16 conversions, rounding, the warp butterfly and SiLU, as numba device functions."""
    cuda()
    from numba import float32, uint16, uint32

    @nc.jit(device=True)
    def bf16_to_float(bits):
        buf = nc.local.array(1, uint32)
        buf[0] = uint32(bits & 0xFFFF) << uint32(16)
        return buf.view(np.float32)[0]

    @nc.jit(device=True)
    def float_to_bf16(value):  # round to nearest even, like cvt.rn.bf16.f32
        buf = nc.local.array(1, float32)
        buf[0] = value
        u = buf.view(np.uint32)[0]
        if (u & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
            return uint16(0x7FFF)
        u = uint32(u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1)))
        return uint16(u >> uint32(16))

    @nc.jit(device=True)
    def round_bf16(value):
        return bf16_to_float(float_to_bf16(value))

    @nc.jit(device=True)
    def warp_sum_lane0(slots, lane):
        """Lane 0's butterfly sum of slots[0:32], as warp_sum_lane0 in adaln_common.cuh.

        Every thread of the block calls it (it syncs); only lanes below the offset write.
        """
        offset = 16
        while offset > 0:
            nc.syncthreads()
            if lane < offset:
                slots[lane] = slots[lane] + slots[lane + offset]
            offset //= 2
        nc.syncthreads()
        return slots[0]

    @nc.jit(device=True)
    def silu(v):
        return v / (float32(1.0) + float32(math.exp(-v)))

    return bf16_to_float, float_to_bf16, round_bf16, warp_sum_lane0, silu


@lru_cache(maxsize=None)
def table_kernel(H: int, D: int, T: int):
    """The twin's table: the fixed-order fp32 GEMV of table.cu up to v25 (bench/NOTES.md v26), not the shipped
    kernel's order. table.cu now sums on tensor cores (mma.sync), whose internal order numba cannot express; so the
    twin keeps its own fixed order: warp tasks of TABLE_ROWS_PER_WARP rows j, lane l summing the 8-wide k-vectors l,
    l + 32, ... in order (fma over the 8 elements in k order), then the warp butterfly, then the bias. Like the
    kernel's, a row's sum depends on D alone (T-invariant rows). Tests compare the twin's rows and backward with the
    kernels' given the same table (tests/numba), and its table with the float64 golden."""
    cuda()
    from numba import float32

    bf16_to_float, float_to_bf16, round_bf16, warp_sum_lane0, silu = device_functions()
    threads, rows_per_warp = TABLE_THREADS, TABLE_ROWS_PER_WARP
    nvec_d, act_size, warps_per_block = D // 8, T * D, threads // 32  # shared sizes: constants

    @nc.jit
    def kernel(temb, weight, bias, table, table_f32):
        act = nc.shared.array(act_size, float32)
        lanes = nc.shared.array((warps_per_block, 32), float32)
        tid = nc.threadIdx.x
        for i in range(tid, T * D, threads):
            act[i] = round_bf16(float32(silu(temb[i // D, i % D])))
        nc.syncthreads()
        lane, warp = tid % 32, tid // 32
        first = (nc.blockIdx.x * warps_per_block + warp) * rows_per_warp  # one task per warp
        for r in range(rows_per_warp):
            j = first + r
            for t in range(T):
                acc = float32(0.0)  # k-vectors lane, lane + 32, ... in order, 8 elements each in order
                if j < 2 * H:
                    for kv in range(lane, nvec_d, 32):
                        for e in range(8):
                            k = kv * 8 + e
                            acc = nc.fma(bf16_to_float(weight[j, k]), act[t * D + k], acc)
                lanes[warp, lane] = acc
                total = warp_sum_lane0(lanes[warp], lane)
                if lane == 0 and j < 2 * H:
                    value = total + bf16_to_float(bias[j])
                    table_f32[t, j] = value
                    table[t, j] = float_to_bf16(value)

    return kernel


@lru_cache(maxsize=None)
def norm_modulate_kernel(H: int, T: int):
    """Twin of the row math of kernels_cu/norm_modulate.cu: one row per block (the rowwise kernel's launch;
    the staged kernel walks ranges of rows with the same thread map and tree, so the same bits per row)."""
    cuda()
    from numba import float32, int64, uint16

    bf16_to_float, float_to_bf16, round_bf16, warp_sum_lane0, _ = device_functions()
    plan = make_plan(H, 8, T)
    threads, vpt = plan.fwd_threads, plan.fwd_vpt
    nwarps, nvec_h = threads // 32, H // 8
    simulated = _simulating()

    @nc.jit
    def kernel(x, norm_weight, table, timestep_indices, out, rstd, S, eps):
        lanes = nc.shared.array(threads, float32)
        warps = nc.shared.array(32, float32)
        row, tid = nc.blockIdx.x, nc.threadIdx.x
        lane, warp = tid % 32, tid // 32
        ss = float32(0.0)  # this thread's vectors in order, 8 elements each in order
        for i in range(vpt):
            v = tid + i * threads
            if v < nvec_h:
                for e in range(8):
                    xv = bf16_to_float(x[row, v * 8 + e])
                    ss = nc.fma(xv, xv, ss)
        lanes[tid] = ss  # block_sum: every warp's butterfly, then warp 0's over the warp sums
        warp_sum_lane0(lanes[warp * 32:warp * 32 + 32], lane)
        if tid < 32:
            warps[tid] = lanes[tid * 32] if tid < nwarps else float32(0.0)
        total = warp_sum_lane0(warps, tid)
        mean = total / float32(H)
        r = float32(1.0) / float32(math.sqrt(mean + eps)) if simulated else nc.libdevice.rsqrtf(mean + eps)
        if tid == 0:
            rstd[row] = r
        t = timestep_indices[row % S]
        valid = t >= 0 and t < T
        tt = t if valid else int64(0)
        for i in range(vpt):
            v = tid + i * threads
            if v < nvec_h:
                for e in range(8):
                    h = v * 8 + e
                    n = round_bf16((bf16_to_float(x[row, h]) * r) * bf16_to_float(norm_weight[h]))
                    p = round_bf16(n * round_bf16(float32(1.0) + bf16_to_float(table[tt, H + h])))
                    out[row, h] = float_to_bf16(p + bf16_to_float(table[tt, h])) if valid else uint16(0x7FC0)

    return kernel


def _simulating() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def bits(t: torch.Tensor):
    """A bf16 tensor's 16-bit patterns, as the kernel argument numba takes (numpy on CPU)."""
    t = t.detach().contiguous()
    return t.view(torch.int16).numpy().view(np.uint16) if t.device.type == "cpu" else t.view(torch.uint16)


def plain(t: torch.Tensor):
    t = t.detach().contiguous()
    return t.numpy() if t.device.type == "cpu" else t


def table(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, stream=0):
    """(T, 2H) bf16 table and (T, 2H) fp32 twin, as `core.tensors.table` computes them.

    stream: the numba stream to launch on (0: numba's default; `adaln_lab.ops.final_adaln_out.twin.op` passes torch's current one)."""
    T, D = temb.shape
    H = weight.shape[0] // 2
    kernel = table_kernel(H, D, T)
    out = torch.empty(T, 2 * H, dtype=torch.bfloat16, device=temb.device)
    out_f32 = torch.empty(T, 2 * H, dtype=torch.float32, device=temb.device)
    grid = -(-2 * H // (TABLE_THREADS // 32 * TABLE_ROWS_PER_WARP))
    kernel[grid, TABLE_THREADS, stream](plain(temb), bits(weight), bits(bias), bits(out), plain(out_f32))
    return out, out_f32


def norm_modulate(x: torch.Tensor, norm_weight: torch.Tensor, table_bf16: torch.Tensor,
                  timestep_indices: torch.Tensor, eps: float, *, stream=0):
    """out (rows, H) bf16 and rstd (rows,) fp32 from x (rows, H) and the bf16 table (T, 2H); row r uses
    timestep_indices[r % S]. No launch when rows == 0 (as launch_norm_modulate). stream: as in `table`."""
    rows, H = x.shape
    T = table_bf16.shape[0]
    kernel = norm_modulate_kernel(H, T)
    out = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        kernel[rows, make_plan(H, 8, T).fwd_threads, stream](
            bits(x), bits(norm_weight), bits(table_bf16), plain(timestep_indices), bits(out), plain(rstd),
            np.int64(timestep_indices.shape[0]), np.float32(eps))
    return out, rstd


def forward(x, norm_weight, temb, weight, bias, timestep_indices, eps: float = 1e-5):
    """The twin's whole forward: out (rows, H) bf16, rstd (rows,), table (T, 2H) bf16."""
    table_bf16, _ = table(temb, weight, bias)
    out, rstd = norm_modulate(x, norm_weight, table_bf16, timestep_indices, eps)
    return out, rstd, table_bf16
