"""The Numba backend of `final_adaln_out`: the Numba-CUDA twin of kernels_cu behind an autograd node.

`final_adaln_out(..., backend="numba")` (validated by `adaln_lab.op`) comes here. The forward runs the
twin's table and norm_modulate kernels (`adaln_lab.numba_backend`), the backward its norm_modulate_bwd,
reduce_partials, table_bwd and table_bwd_reduce (`adaln_lab.numba_backward`), launched in
launch_backward's order. Same contract as the cupy backend (`adaln_lab.cuda_op`):

- Inputs: x (..., S, H) bf16, norm_weight (H,) bf16, temb (T, D) fp32, weight (2H, D) bf16, bias (2H,)
  bf16, timestep_indices (S,) int64; row s of every leading index of x is modulated by
  table[timestep_indices[s]]. Anything the kernels cannot take is refused by `unsupported` with an error
  naming the argument (the cupy rule, plus one limit of the twin's table kernel: see `twin_td_max`).
- Output (..., S, H) bf16; gradients dx (..., S, H) bf16, d_norm_weight (H,) bf16, d_temb (T, D) fp32,
  d_weight (2H, D) bf16, d_bias (2H,) bf16, every reduction in the kernels' fixed order.
- Saved for the backward: x, norm_weight, temb, weight, timestep_indices and the forward's table_f32
  (T, 2H) fp32 (the table before its bf16 rounding) and rstd (rows,) fp32, as the cupy backend saves them.
- Rounding: the twin's, which is meant to be the CUDA kernels' bit for bit on a GPU
  (tests/test_numba_op.py checks every output and gradient against backend="cupy" there).
- table_backend "cuda": the twin's fixed-order GEMV; "torch": F.linear, as the cupy backend.

Where it runs:
- On CUDA tensors, through numba-cuda (the tensors travel through `__cuda_array_interface__`, bf16 as its
  16-bit patterns), every kernel launched on torch's current stream of x's device, with that device's
  primary context current (the backward runs on autograd's own thread). Eager only: under
  torch.compile the call is a graph break.
- On CPU tensors under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1 before numba is imported): the
  same kernels on the CPU, slowly (a few thousand threads a second: tiny shapes only), with the
  simulator's differences (`cuda.fma` rounds twice, rsqrt is 1 / sqrt, the C library's exp); that is
  what lets CI run this backend. numba is imported on the first call, never at import.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

from .plan import ROWS_MAX, check_shapes, plan as make_plan

STATIC_SHARED_MAX = 48 * 1024  # bytes of static shared memory one CUDA block may declare


def _numba_cuda():
    """`numba.cuda`, imported (after numba_backend's numpy shim) on first use."""
    from . import numba_backend

    return numba_backend.cuda()


def simulating() -> bool:
    """Whether numba runs its CUDA simulator (NUMBA_ENABLE_CUDASIM=1 when numba was imported)."""
    _numba_cuda()
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def twin_td_max(H: int, D: int, T: int) -> int:
    """The largest T * D the twin's table kernel takes: it keeps bf16(silu(temb)) as T * D fp32 values in
    static shared memory beside its (warps, 32) fp32 butterfly slots, within 48 KiB (11776 at the plan's
    512 threads), where table.cu keeps them as bf16 (plan.TD_MAX)."""
    threads = make_plan(H, D, T).table_threads
    return (STATIC_SHARED_MAX - threads * 4) // 4


def unsupported(x, norm_weight, temb, weight, bias=None) -> Exception | None:
    """Why backend "numba" cannot take these (validated) inputs, as the error to raise (TypeError for a
    dtype, ValueError for a device or a shape, naming the argument); None if it can.

    The cupy rule (`cuda_op.unsupported`: bf16 x / norm_weight / weight / bias, fp32 temb, H and D
    divisible by 8, H <= H_MAX, T <= T_MAX, T * D <= TD_MAX, at most 2^31 - 2^12 rows) on CUDA tensors, or
    on CPU tensors under numba's CUDA simulator; and T * D <= `twin_td_max`.
    """
    for name, t in (("x", x), ("norm_weight", norm_weight), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != torch.bfloat16:
            return TypeError(f"backend='numba' needs {name} in bfloat16, got {t.dtype}; use backend='torch'")
    if temb.dtype != torch.float32:
        return TypeError(f"backend='numba' needs temb in float32, got {temb.dtype}; use backend='torch'")
    if simulating():
        if x.device.type != "cpu":
            return ValueError(f"backend='numba' under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) needs CPU "
                              f"tensors, but x is on {x.device}; unset NUMBA_ENABLE_CUDASIM to run on the GPU")
    elif x.device.type != "cuda":
        return ValueError(f"backend='numba' needs CUDA tensors (or CPU tensors under numba's CUDA simulator, "
                          f"NUMBA_ENABLE_CUDASIM=1), but x is on {x.device}")
    H = x.shape[-1]
    T, D = temb.shape
    try:
        check_shapes(H, D, T)
    except ValueError as error:
        return ValueError(str(error).replace("backend='cupy'", "backend='numba'"))
    if T * D > twin_td_max(H, D, T):
        return ValueError(f"backend='numba' needs T * D <= {twin_td_max(H, D, T)} (temb is {T} x {D}: the twin's "
                          "table kernel keeps T * D fp32 activations in 48 KiB of static shared memory); use "
                          "backend='cupy' or 'torch'")
    rows = x.numel() // H
    if rows > ROWS_MAX:
        return ValueError(f"backend='numba' takes at most {ROWS_MAX} rows (x.numel() / H), got {rows}; split the batch")
    return None


@contextlib.contextmanager
def _launching(device: torch.device):
    """The numba stream to launch on: torch's current stream of `device` (its primary context current
    meanwhile); 0 for CPU tensors (the simulator has no external streams, and runs synchronously)."""
    if device.type != "cuda":
        yield 0
        return
    nc = _numba_cuda()
    with nc.gpus[device.index]:
        yield nc.external_stream(torch.cuda.current_stream(device).cuda_stream)


def forward_tensors(x, norm_weight, temb, weight, bias, timestep_indices, eps: float, table_backend: str = "cuda"):
    """(out (..., S, H) bf16, table_f32 (T, 2H) fp32, rstd (rows,) fp32) from contiguous inputs."""
    from . import numba_backend

    H = x.shape[-1]
    with _launching(x.device) as stream:
        if table_backend == "torch":
            from .cuda_op import _table_from_torch

            table_bf16, table_f32 = _table_from_torch(temb, weight, bias)
        else:
            table_bf16, table_f32 = numba_backend.table(temb, weight, bias, stream=stream)
        out, rstd = numba_backend.norm_modulate(x.reshape(-1, H), norm_weight, table_bf16, timestep_indices, eps,
                                                stream=stream)
    return out.view(x.shape), table_f32, rstd


def backward_tensors(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd):
    """dx, d_norm_weight, d_temb, d_weight, d_bias (see the module docstring) for one forward's saved tensors."""
    from . import numba_backward

    with _launching(x.device) as stream:
        return numba_backward.backward(dy.contiguous(), x, rstd, norm_weight, table_f32, timestep_indices, temb,
                                       weight, stream=stream)


class FinalAdaLNOutNumba(torch.autograd.Function):
    """The autograd node of backend "numba": forward(x, norm_weight, temb, weight, bias, timestep_indices,
    eps, table_backend) -> out; backward(dy) -> dx, d_norm_weight, d_temb, d_weight, d_bias (shapes and
    broadcast in the module docstring). Takes contiguous, supported inputs (`final_adaln_out` sees to it).
    Saves x, norm_weight, temb, weight, timestep_indices, table_f32 and rstd."""

    @staticmethod
    def forward(ctx, x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend):
        out, table_f32, rstd = forward_tensors(x, norm_weight, temb, weight, bias, timestep_indices, eps,
                                               table_backend)
        ctx.save_for_backward(x, norm_weight, temb, weight, timestep_indices, table_f32, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, norm_weight, temb, weight, timestep_indices, table_f32, rstd = ctx.saved_tensors
        grads = backward_tensors(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd)
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads, needs)), None, None, None)


def _refuse_unsupported(x, norm_weight, temb, weight, bias=None) -> None:
    error = unsupported(x, norm_weight, temb, weight, bias)
    if error is not None:
        raise error


@torch.compiler.disable
def final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices, eps, *, table_backend="cuda"):
    """The Numba backend of `adaln_lab.final_adaln_out` (inputs already validated by `adaln_lab.op`)."""
    _refuse_unsupported(x, norm_weight, temb, weight, bias)
    return FinalAdaLNOutNumba.apply(x.contiguous(), norm_weight.contiguous(), temb.contiguous(), weight.contiguous(),
                                    bias.contiguous(), timestep_indices.contiguous(), float(eps), table_backend)
