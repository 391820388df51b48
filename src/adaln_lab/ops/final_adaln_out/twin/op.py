"""The Numba backend of `final_adaln_out`: the Numba-CUDA twin of kernels_cu, as the bodies of the op's launch ops.

`final_adaln_out(..., backend="numba")` (validated by `adaln_lab.ops.final_adaln_out`) takes route "numba" through the
op's one autograd node, whose launch ops (`..launch`) call `forward_tensors` and `backward_tensors` here. The forward runs the
twin's table and norm_modulate kernels (`adaln_lab.ops.final_adaln_out.twin.forward`), the backward its norm_modulate_bwd,
reduce_partials, table_bwd and table_bwd_reduce (`adaln_lab.ops.final_adaln_out.twin.backward`), launched in
launch_backward's order. Same contract as the cupy backend (`adaln_lab.ops.final_adaln_out`):

- Inputs: x (..., S, H) bf16, norm_weight (H,) bf16, temb (T, D) fp32, weight (2H, D) bf16, bias (2H,)
  bf16, timestep_indices (S,) int64; row s of every leading index of x is modulated by
  table[timestep_indices[s]]. Anything the kernels cannot take is refused by `core.support.numba_final_adaln_out`
  with an error naming the argument (the cupy rule, plus one limit of the twin's table kernel: `twin_td_max`).
- Output (..., S, H) bf16; gradients dx (..., S, H) bf16, d_norm_weight (H,) bf16, d_temb (T, D) fp32,
  d_weight (2H, D) bf16, d_bias (2H,) bf16, every reduction in the kernels' fixed order.
- Saved for the backward: x, norm_weight, temb, weight, timestep_indices and the forward's table_f32
  (T, 2H) fp32 (the table before its bf16 rounding) and rstd (rows,) fp32, as the cupy backend saves them.
- Rounding: the twin's, meant to be the CUDA kernels' bit for bit on a GPU with table_backend "torch" and T below
  plan.bwd_sorted's (tests/numba/test_op.py checks every output and gradient against backend="cupy" there); its
  table (table_backend "cuda": a fixed-order GEMV, not table.cu's tensor cores) and, from that T, its parameter sums
  (the unsorted row pass) are its own orders.
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

from ....reference.final_adaln_out import table_from_torch


def _numba_cuda():
    """`numba.cuda`, imported (after numba.forward's numpy shim) on first use."""
    from . import forward

    return forward.cuda()


def simulating() -> bool:
    """Whether numba runs its CUDA simulator (NUMBA_ENABLE_CUDASIM=1 when numba was imported)."""
    _numba_cuda()
    from numba import config

    return bool(config.ENABLE_CUDASIM)


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
    from . import forward

    H = x.shape[-1]
    with _launching(x.device) as stream:
        if table_backend == "torch":
            table_bf16, table_f32 = table_from_torch(temb, weight, bias)
        else:
            table_bf16, table_f32 = forward.table(temb, weight, bias, stream=stream)
        out, rstd = forward.norm_modulate(x.reshape(-1, H), norm_weight, table_bf16, timestep_indices, eps,
                                                stream=stream)
    return out.view(x.shape), table_f32, rstd


def backward_tensors(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd):
    """dx, d_norm_weight, d_temb, d_weight, d_bias (see the module docstring) for one forward's saved tensors."""
    from . import backward

    with _launching(x.device) as stream:
        return backward.backward(dy.contiguous(), x, rstd, norm_weight, table_f32, timestep_indices, temb,
                                       weight, stream=stream)
