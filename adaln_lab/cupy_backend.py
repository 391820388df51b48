"""The CUDA backend: kernels_cu/ compiled at run time by CuPy RawModule (NVRTC), one autograd node.

Loader: the .cu files are joined into one translation unit, each preceded by `#line 1 "<file>"` so
compile errors name the real file and line, and the whole text starts with its SHA-256 so an
edited header can never reuse a stale binary (CuPy's disk cache keys on the text). The problem's
shapes (H, D, T) and the row kernels' block size are macros: one module per shape and device,
compiled on first use. Launch geometry is a function of those shapes (and, for the number of row
ranges of the backward, of the number of rows), never of the GPU.

Launchers take and return torch tensors (allocated by torch) and pass raw device pointers; every
launch goes on torch's current stream.
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .reference import table_reference

KERNEL_FILES = ("adaln_common.cuh", "table.cu", "norm_modulate.cu", "norm_modulate_bwd.cu",
                "reduce_partials.cu", "table_bwd.cu")
INCLUDE_LINE = '#include "adaln_common.cuh"'
FWD_THREADS_MAX, BWD_THREADS_MAX = 256, 1024   # row kernels' block size caps (bench/NOTES.md, v4)
ROW_RANGES = 132          # row ranges of the backward row pass: a constant, never read from the GPU
# Constants of the kernels, emitted into the unit as `#define ADALN_<NAME>`: the one place they live
# (bench/NOTES.md v5: the variants tried against these and why they lost).
TUNING = {
    "TABLE_THREADS": 512,       # table.cu: block size
    "TABLE_ROWS_PER_WARP": 4,   # table.cu: output rows j per warp
    "ROW_LIST_MAX": 2048,       # norm_modulate_bwd.cu: most rows of one range (their timesteps sit in shared memory)
    "BWD_STAGES": 4,            # norm_modulate_bwd.cu: rows of x and dy in flight (cp.async), at most
    "TB_THREADS": 256,          # table_bwd.cu: block size
    "TB_ROWS": 128,             # table_bwd.cu: weight rows j per block
    "SUM_GROUPS": 16,           # adaln_common.cuh: row groups of an ordered column sum
}
STATIC_SMEM_LIMIT = 48 * 1024
STAGE_SMEM_BUDGET = 200 * 1024   # dynamic shared memory of a row kernel's stages (an H200/B200 SM has 227 KiB)


def kernel_dir() -> Path:
    """kernels_cu/: inside the installed package, or beside it in a source checkout."""
    packaged = Path(str(resources.files("adaln_lab") / "kernels_cu"))
    if (packaged / KERNEL_FILES[0]).is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "kernels_cu"


def row_geometry(H: int, threads_max: int) -> tuple[int, int]:
    """(threads, 8-wide vectors per thread) of a row kernel whose blocks hold at most threads_max, from H alone."""
    nvec = H // 8
    vpt = math.ceil(nvec / threads_max)
    threads = 32 * math.ceil(math.ceil(nvec / vpt) / 32)
    return threads, vpt


def rows_per_block(rows: int) -> int:
    """Rows of one backward row range: ROW_RANGES ranges, each of at most TUNING['ROW_LIST_MAX'] rows."""
    return max(1, min(TUNING["ROW_LIST_MAX"], math.ceil(rows / ROW_RANGES)))


def stage_bytes(H: int) -> int:
    """Shared memory of one pipeline stage of norm_modulate_bwd: one row of x and one of dy."""
    threads, vpt = row_geometry(H, BWD_THREADS_MAX)
    return 2 * threads * vpt * 16


def stages(H: int) -> int:
    """Pipeline stages of norm_modulate_bwd: TUNING's, fewer where H leaves no room."""
    return min(TUNING["BWD_STAGES"], STAGE_SMEM_BUDGET // stage_bytes(H))


@lru_cache(maxsize=None)
def check_shapes(H: int, D: int, T: int) -> None:
    """The shapes the CUDA kernels support; a clear error (naming the argument) otherwise."""
    if H % 8:
        raise ValueError(f"backend='cupy' needs H (x.shape[-1]) divisible by 8, got {H}; use backend='torch'")
    if D % 8:
        raise ValueError(f"backend='cupy' needs D (temb.shape[1]) divisible by 8, got {D}; use backend='torch'")
    if stages(H) < 1:
        raise ValueError(f"backend='cupy' needs H (x.shape[-1]) <= {STAGE_SMEM_BUDGET // 4}, got {H}; "
                         "use backend='torch'")
    if T * D * 2 > STATIC_SMEM_LIMIT:
        raise ValueError(f"backend='cupy' needs T * D <= {STATIC_SMEM_LIMIT // 2} (temb is {T} x {D}); "
                         "use backend='torch'")


@lru_cache(maxsize=None)
def source(H: int, D: int, T: int) -> str:
    """The translation unit for one shape: defines, then every file behind its #line marker."""
    directory = kernel_dir()
    parts = []
    for name in KERNEL_FILES:
        text = (directory / name).read_text()
        text = text.replace(INCLUDE_LINE, "")  # the header is already part of the unit
        parts.append(f'#line 1 "kernels_cu/{name}"\n{text}')
    body = "\n".join(parts)
    digest = hashlib.sha256(body.encode()).hexdigest()
    fwd_threads, fwd_vpt = row_geometry(H, FWD_THREADS_MAX)
    bwd_threads, bwd_vpt = row_geometry(H, BWD_THREADS_MAX)
    values = dict(H=H, D=D, T=T, FWD_THREADS=fwd_threads, FWD_VPT=fwd_vpt, BWD_THREADS=bwd_threads,
                  BWD_VPT=bwd_vpt, **{**TUNING, "BWD_STAGES": stages(H)})
    defines = "".join(f"#define ADALN_{name} {value}\n" for name, value in values.items())
    return f"// adaln_lab kernels_cu sha256 {digest}\n{defines}{body}"


COMPILE_OPTIONS = ("--std=c++17",)
KERNELS = ("table_bf16", "norm_modulate_bf16", "norm_modulate_bwd_bf16", "reduce_partials_bf16",
           "table_bwd_bf16", "table_bwd_reduce")


@lru_cache(maxsize=None)
def _module(device_index: int, H: int, D: int, T: int):
    import cupy

    check_shapes(H, D, T)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=source(H, D, T), options=COMPILE_OPTIONS)
        kernels = {name: module.get_function(name) for name in KERNELS}
        # opt in: static plus dynamic shared memory may pass 48 KiB
        kernels["norm_modulate_bwd_bf16"].max_dynamic_shared_size_bytes = dynamic_smem(H)
        return kernels


@lru_cache(maxsize=None)
def dynamic_smem(H: int) -> int:
    """Dynamic shared memory (bytes) of norm_modulate_bwd: its pipeline stages."""
    return stage_bytes(H) * stages(H)


_streams: dict[int, object] = {}


def _current_stream_handle(device: torch.device) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device.index) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def _stream(device: torch.device):
    """torch's current stream as a CuPy stream object (cached per stream handle)."""
    import cupy

    handle = _current_stream_handle(device)
    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return stream


class _StreamHandle:
    """A raw CUDA stream handle in the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@lru_cache(maxsize=None)
def _functions(device_index: int, H: int, D: int, T: int) -> dict:
    """The launchable cupy Function of every kernel of one module (resolved once, not per launch)."""
    import cupy

    with cupy.cuda.Device(device_index):
        return {name: kernel.kernel for name, kernel in _module(device_index, H, D, T).items()}


def clear_caches() -> None:
    """Forget compiled modules and sources, e.g. after changing TUNING (bench/dev/sweep.py)."""
    for cached in (source, check_shapes, dynamic_smem, _module, _functions):
        cached.cache_clear()


def _launch(device: torch.device, H: int, D: int, T: int, name: str, grid, block, args, shared_mem: int = 0) -> None:
    """Launch one kernel of the (device, H, D, T) module on torch's current stream."""
    _functions(device.index, H, D, T)[name](grid, block, args, shared_mem=shared_mem, stream=_stream(device))


def kernel_resources(device_index: int, H: int, D: int, T: int) -> dict:
    """Registers per thread and local (spill) bytes of every kernel of one module."""
    return {name: {"registers": k.num_regs, "local_bytes": k.local_size_bytes}
            for name, k in _module(device_index, H, D, T).items()}


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def table(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, 2H) bf16 table and its (T, 2H) fp32 twin. temb (T, D) fp32, weight (2H, D), bias (2H,) bf16."""
    T, D = temb.shape
    H = weight.shape[0] // 2
    out = torch.empty(T, 2 * H, dtype=torch.bfloat16, device=temb.device)
    out_f32 = torch.empty(T, 2 * H, dtype=torch.float32, device=temb.device)
    threads = TUNING["TABLE_THREADS"]
    grid = (math.ceil(2 * H / (threads // 32 * TUNING["TABLE_ROWS_PER_WARP"])),)
    _launch(temb.device, H, D, T, "table_bf16", grid, (threads,),
            (_ptr(temb), _ptr(weight), _ptr(bias), _ptr(out), _ptr(out_f32)))
    return out, out_f32


def norm_modulate(x, norm_weight, table_bf16, timestep_indices, eps: float, D: int):
    """out (..., S, H) bf16 and rstd (rows,) fp32 from x (..., S, H) and the bf16 table (T, 2H)."""
    H, S = x.shape[-1], x.shape[-2]
    T = table_bf16.shape[0]
    rows = x.numel() // H
    out = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        threads, _ = row_geometry(H, FWD_THREADS_MAX)
        _launch(x.device, H, D, T, "norm_modulate_bf16", (rows,), (threads,),
                (_ptr(x), _ptr(norm_weight), _ptr(table_bf16), _ptr(timestep_indices), _ptr(out), _ptr(rstd),
                 np.int32(S), np.float32(eps)))
    return out, rstd


def norm_modulate_bwd(dy, x, rstd, norm_weight, table_f32, timestep_indices, D: int):
    """dx (..., S, H) bf16 and row_partials (ranges, T, 2, H) fp32 (see kernels_cu/norm_modulate_bwd.cu)."""
    H, S = x.shape[-1], x.shape[-2]
    T = table_f32.shape[0]
    rows = x.numel() // H
    per = rows_per_block(rows)
    ranges = math.ceil(rows / per) if rows else 0
    dx = torch.empty_like(x)
    row_partials = torch.empty(max(ranges, 1), T, 2, H, dtype=torch.float32, device=x.device)
    if rows:
        threads, _ = row_geometry(H, BWD_THREADS_MAX)
        _launch(x.device, H, D, T, "norm_modulate_bwd_bf16", (ranges,), (threads,),
                (_ptr(dy), _ptr(x), _ptr(rstd), _ptr(norm_weight), _ptr(table_f32), _ptr(timestep_indices),
                 _ptr(dx), _ptr(row_partials), np.int32(S), np.int32(rows), np.int32(per)), dynamic_smem(H))
    return dx, row_partials


def reduce_partials(row_partials, norm_weight, table_f32, D: int):
    """d_table (T, 2H) fp32, d_norm_weight (H,) bf16, d_bias (2H,) bf16 from row_partials (ranges, T, 2, H)."""
    ranges, T, _, H = row_partials.shape
    d_table = torch.empty(T, 2 * H, dtype=torch.float32, device=row_partials.device)
    d_norm_weight = torch.empty(H, dtype=torch.bfloat16, device=row_partials.device)
    d_bias = torch.empty(2 * H, dtype=torch.bfloat16, device=row_partials.device)
    _launch(row_partials.device, H, D, T, "reduce_partials_bf16", (math.ceil(H / 32),), (32, TUNING["SUM_GROUPS"]),
            (_ptr(row_partials), _ptr(norm_weight), _ptr(table_f32), _ptr(d_table), _ptr(d_norm_weight),
             _ptr(d_bias), np.int32(ranges)))
    return d_table, d_norm_weight, d_bias


def table_bwd(d_table, temb, weight):
    """d_weight (2H, D) bf16 and d_temb (T, D) fp32 from the fp32 table gradient d_table (T, 2H)."""
    T, D = temb.shape
    H = weight.shape[0] // 2
    blocks_j = math.ceil(2 * H / TUNING["TB_ROWS"])
    d_weight = torch.empty_like(weight)
    dact_partials = torch.empty(blocks_j, T, D, dtype=torch.float32, device=temb.device)
    d_temb = torch.empty(T, D, dtype=torch.float32, device=temb.device)
    _launch(temb.device, H, D, T, "table_bwd_bf16", (math.ceil(D / (32 * 8)), blocks_j), (TUNING["TB_THREADS"],),
            (_ptr(d_table), _ptr(temb), _ptr(weight), _ptr(d_weight), _ptr(dact_partials)))
    _launch(temb.device, H, D, T, "table_bwd_reduce", (math.ceil(D / 32), T), (32, TUNING["SUM_GROUPS"]),
            (_ptr(dact_partials), _ptr(temb), _ptr(d_temb), np.int32(blocks_j)))
    return d_weight, d_temb


class FinalAdaLNOut(torch.autograd.Function):
    """One autograd node for the whole op on CUDA (bf16 x, norm_weight, weight, bias; fp32 temb).

    forward(x (..., S, H), norm_weight (H,), temb (T, D), weight (2H, D), bias (2H,),
            timestep_indices (S,), eps, table_backend) -> out (..., S, H)
    Broadcast: row s of every leading index of x is modulated by table[timestep_indices[s]].
    backward(dy (..., S, H)) -> dx (..., S, H) bf16, d_norm_weight (H,) bf16, d_temb (T, D) fp32,
            d_weight (2H, D) bf16, d_bias (2H,) bf16; every reduction in a fixed order.
    Saved: x, norm_weight, temb, weight, the fp32 table, timestep_indices, rstd (rows,).
    """

    @staticmethod
    def forward(ctx, x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend):
        D = temb.shape[1]
        if table_backend == "torch":
            table_bf16 = table_reference(temb, weight, bias)
            table_f32 = table_bf16.float()
        else:
            table_bf16, table_f32 = table(temb, weight, bias)
        out, rstd = norm_modulate(x, norm_weight, table_bf16, timestep_indices, eps, D)
        ctx.save_for_backward(x, norm_weight, temb, weight, table_f32, timestep_indices, rstd)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, norm_weight, temb, weight, table_f32, timestep_indices, rstd = ctx.saved_tensors
        D = temb.shape[1]
        dx, row_partials = norm_modulate_bwd(dy.contiguous(), x, rstd, norm_weight, table_f32, timestep_indices, D)
        d_table, d_norm_weight, d_bias = reduce_partials(row_partials, norm_weight, table_f32, D)
        d_weight, d_temb = table_bwd(d_table, temb, weight)
        return dx, d_norm_weight, d_temb.to(temb.dtype), d_weight, d_bias, None, None, None


def final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices, eps, *, table_backend="cuda"):
    """The cupy backend of `adaln_lab.final_adaln_out` (inputs already validated)."""
    for name, t in (("x", x), ("norm_weight", norm_weight), ("weight", weight), ("bias", bias)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"backend='cupy' needs {name} in bfloat16, got {t.dtype}; use backend='torch'")
    if temb.dtype != torch.float32:
        raise TypeError(f"backend='cupy' needs temb in float32, got {temb.dtype}; use backend='torch'")
    check_shapes(x.shape[-1], temb.shape[1], temb.shape[0])
    args = (x.contiguous(), norm_weight.contiguous(), temb.contiguous(), weight.contiguous(), bias.contiguous(),
            timestep_indices.contiguous(), float(eps), table_backend)
    if x.device.index == torch.cuda.current_device():
        return FinalAdaLNOut.apply(*args)
    with torch.cuda.device(x.device):  # kernels and allocations must see x's device as current
        return FinalAdaLNOut.apply(*args)
