"""`final_adaln_out`: validate, then dispatch to one backend. The autograd node lives with its backend.

    table = linear(silu(temb).to(weight.dtype), weight, bias)          (T, 2H): shift | scale
    out   = rms_norm(x, norm_weight, eps) * (1 + scale[timestep_indices]) + shift[timestep_indices]

Broadcast rule: x is (..., S, H); row s of every leading index uses timestep_indices[s].
"""

from __future__ import annotations

import torch

from .reference import replay
from .validate import validate

BACKENDS = ("auto", "torch", "cupy", "numba")
NUMERICS = ("diffusers",)
TABLE_BACKENDS = ("cuda", "torch")


def final_adaln_out(x: torch.Tensor, norm_weight: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor, timestep_indices: torch.Tensor, eps: float = 1e-5, *,
                    backend: str = "auto", numerics: str = "diffusers", table_backend: str = "cuda",
                    check_indices: bool | None = None) -> torch.Tensor:
    """MiniMax-H3's final AdaLN output (diffusers `MiniMaxH3AdaLayerNormOut`), differentiable.

    Args:
        x: (..., S, H) hidden states, any float dtype (bf16 for the cupy and numba backends).
        norm_weight: (H,) RMSNorm weight; norm_weight, weight and bias share one dtype (one module's).
        temb: (T, D) float32, float64 or the parameters' dtype, one row per distinct timestep.
        weight: (2H, D) projection weight; bias: (2H,) projection bias.
        timestep_indices: (S,) int64 in [0, T): which table row modulates each row of x.
        eps: RMSNorm epsilon.
        backend: "torch" (the diffusers replay, any device, any float dtype), "cupy" (kernels_cu:
            CUDA, bf16 x / norm_weight / weight / bias, fp32 temb, H and D divisible by 8; anything
            else is refused with an error naming the argument), "numba" (the Numba-CUDA twin of
            kernels_cu, `adaln_lab.numba_op`: the same inputs and bits as "cupy", for reading and
            exploring the kernels in Python; also T * D <= 11776; CPU tensors under numba's CUDA
            simulator, NUMBA_ENABLE_CUDASIM=1, at tiny shapes; numba is imported on the first call),
            or "auto": "cupy" where it can run (CUDA tensors of those dtypes and shapes), "torch"
            otherwise ("auto" never picks "numba").
        numerics: "diffusers" rounds where diffusers rounds (SiLU cast, bf16 table, rms_norm
            output, then `1 + scale`, the product and `+ shift` each to x's dtype). One known
            difference of backend "cupy": CuPy compiles the kernels with -ftz=true, so fp32 subnormals
            flush to zero; a row of bf16-subnormal x (|x| < 2^-126) loses its normalised value (its
            output is the shift alone) where torch keeps it (tests/test_fuzz.py pins this).
        table_backend: cupy and numba backends only: "cuda" computes the table with the
            fixed-order GEMV of kernels_cu (numba: its twin; T-invariant rows), "torch" with F.linear
            (bitwise diffusers' table on the same GPU, but cuBLAS's reduction order).
        check_indices: check that every timestep index lies in [0, T) and raise IndexError if not.
            Default (None): check on the CPU, where it is free, but not on CUDA, where it would
            wait for the GPU (one host synchronisation per call, and no CUDA-graph capture).
            Unchecked on CUDA, an index outside [0, T) never reads outside the table: with
            backends "cupy" and "numba" that row's output and dx are NaN and so are the parameter
            gradients (the error shows instead of hiding); backend "torch" hits torch's device-side assert.

    Returns:
        (..., S, H) tensor of dtype torch.promote_types(x.dtype, norm_weight.dtype), as diffusers
        returns it: x's dtype when x and the parameters agree (always, for the cupy and numba backends).
    """
    if check_indices is None:
        check_indices = not getattr(x, "is_cuda", False)
    validate(x, norm_weight, temb, weight, bias, timestep_indices, eps, check_indices=check_indices)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if table_backend not in TABLE_BACKENDS:
        raise ValueError(f"table_backend must be one of {TABLE_BACKENDS}, got {table_backend!r}")
    if backend == "auto":
        backend = "cupy" if _cupy_can_run(x, norm_weight, temb, weight, bias) else "torch"
    if backend == "torch":
        return replay(x, norm_weight, temb, weight, bias, timestep_indices, eps)
    if backend == "numba":
        from . import numba_op

        return numba_op.final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices, eps,
                                        table_backend=table_backend)
    from . import cuda_op

    return cuda_op.final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices, eps,
                                   table_backend=table_backend)


def _cupy_can_run(x, norm_weight, temb, weight, bias) -> bool:
    """Whether the CUDA kernels take these inputs (backend="auto" picks them then)."""
    if not x.is_cuda:
        return False
    from .cuda_op import unsupported

    return unsupported(x, norm_weight, temb, weight, bias) is None
