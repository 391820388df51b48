"""`final_adaln_out`: MiniMax-H3's norm_out as one differentiable op.

    table = linear(silu(temb).to(weight.dtype), weight, bias)          (T, 2H): shift | scale
    out   = rms_norm(x, norm_weight, eps) * (1 + scale[timestep_indices]) + shift[timestep_indices]

Broadcast rule: x is (..., S, H); row s of every leading index uses timestep_indices[s]. Shapes: norm_weight
(H,), temb (T, D), weight (2H, D), bias (2H,), timestep_indices (S,) int64 in [0, T).

One way through: `final_adaln_out` validates once (`core.checks.validate`) and decides the route once
(`core.support.route`: the kernels, with the reason where not): "torch" is the diffusers replay (torch's
autograd); "cupy" and "numba" go to the one autograd node `FinalAdaLNOut`, in eager and compiled code alike.
Its forward allocates the output and the forward workspace and calls the launch op `launch.forward`; its backward
allocates the five gradients and calls `launch.backward` (`torch.ops.adaln_lab.final_adaln_out_fwd / _bwd` while
torch.compile traces, the same Python bodies called directly in eager code: `core.library`).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...core import exact, support
from ...core.autocast import autocast_params
from ...core.checks import BACKENDS, NUMERICS, TABLE_BACKENDS, check_option, validate
from ...core.library import apply
from ...core.plan import forward_bytes
from ...reference.final_adaln_out import replay
from . import launch
from .exact import record


class FinalAdaLNOut(torch.autograd.Function):
    """The autograd node of routes "cupy" and "numba": forward(x, norm_weight, temb, weight, bias, timestep_indices,
    eps, route, table_backend) -> out (..., S, H); backward(dy) -> dx, d_norm_weight, d_temb, d_weight, d_bias.
    Takes contiguous inputs the route can run. Saves x, norm_weight, temb, weight, timestep_indices and the forward
    workspace (the bf16 table, table_f32, rstd and the table's scratch: `core.plan.forward_workspace`)."""

    @staticmethod
    def forward(ctx, x, norm_weight, temb, weight, bias, timestep_indices, eps, route, table_backend):
        (T, D), H = temb.shape, x.shape[-1]
        out = torch.empty_like(x)
        workspace = x.new_empty(forward_bytes(T, H, x.numel() // H, D), dtype=torch.uint8)
        launch.forward(x, norm_weight, temb, weight, bias, timestep_indices, eps, route, table_backend, out, workspace)
        ctx.route = route
        ctx.save_for_backward(x, norm_weight, temb, weight, timestep_indices, workspace)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, norm_weight, temb, weight, timestep_indices, workspace = ctx.saved_tensors
        route = ctx.route
        if route == "cupy":
            support.check_saved("final_adaln_out", x, norm_weight=norm_weight, weight=weight)
        grads = (torch.empty_like(x), torch.empty_like(norm_weight), torch.empty_like(temb), torch.empty_like(weight),
                 weight.new_empty(weight.shape[0]))
        launch.backward(dy.contiguous(), x, norm_weight, temb, weight, timestep_indices, workspace, route, *grads)
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None)


def _kernels(x, norm_weight, temb, weight, bias, timestep_indices, eps, route, table_backend):
    """Routes "cupy" and "numba": the autograd node on contiguous inputs."""
    return apply(FinalAdaLNOut, x.contiguous(), norm_weight.contiguous(), temb.contiguous(), weight.contiguous(),
                 bias.contiguous(), timestep_indices.contiguous(), float(eps), route, table_backend)


def dense(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The arguments as dense tensors (a no-op for contiguous ones): torch's CPU kernels may take another code
    path, with other roundings, for a broadcast (stride-0) or strided operand (a scalar silu instead of the
    vectorised one, seen for an expanded temb), so the replay runs on dense copies and every layout of the
    same values gives the same bits, as the kernels' launch (which takes contiguous inputs) does."""
    return tuple(t.contiguous() for t in tensors)


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
            kernels_cu, `adaln_lab.ops.final_adaln_out.twin.op`: the same inputs and bits as "cupy", for reading and
            exploring the kernels in Python; also T * D <= 11776; CPU tensors under numba's CUDA
            simulator, NUMBA_ENABLE_CUDASIM=1, at tiny shapes; numba is imported on the first call),
            or "auto": "cupy" where it can run (CUDA tensors of those dtypes and shapes), "torch"
            otherwise ("auto" never picks "numba").
        Under torch.autocast("cuda", torch.bfloat16) with bf16 CUDA x, fp32 parameters are cast to bf16 for the
        kernels as autocast casts a linear's (`adaln_lab.core.autocast`: the rounding contract then).
        numerics: "diffusers" rounds where diffusers rounds (SiLU cast, bf16 table, rms_norm
            output, then `1 + scale`, the product and `+ shift` each to x's dtype). One known
            difference of backend "cupy": CuPy compiles the kernels with -ftz=true, so fp32 subnormals
            flush to zero; a row of bf16-subnormal x (|x| < 2^-126) loses its normalised value (its
            output is the shift alone) where torch keeps it (tests/ops/test_final_adaln_out_fuzz.py pins this).
        table_backend: cupy and numba backends only: "cuda" computes the table with kernels_cu's
            table.cu on tensor cores, in an order fixed by D (T-invariant rows; numba: the twin's own
            fixed-order GEMV), "torch" with F.linear (bitwise diffusers' table on the same GPU, but
            cuBLAS's reduction order).
        check_indices: check that every timestep index lies in [0, T) and raise IndexError if not.
            Default (None): check on the CPU, where it is free, but not on CUDA, where it would
            wait for the GPU (one host synchronisation per call, and no CUDA-graph capture).
            Under torch.compile nothing is read back to the host: on CPU tensors the check is an
            assert in the graph (RuntimeError), on CUDA it is skipped. An unchecked index outside
            [0, T), by backend: "cupy" and "numba" never read outside the table: that row's output
            and dx are NaN and so are the parameter gradients (the error shows instead of hiding);
            "torch" on CPU tensors raises torch's IndexError ("index out of range", from the replay's
            index_select), and on CUDA hits torch's device-side assert; compiled code does what the
            compiler emits (inductor on CPU raises RuntimeError for an index >= T and wraps a negative one).

    Returns:
        (..., S, H) tensor of dtype torch.promote_types(x.dtype, norm_weight.dtype), as diffusers
        returns it: x's dtype when x and the parameters agree (always, for the cupy and numba backends).
    """
    if check_indices is None:
        check_indices = not getattr(x, "is_cuda", False)
    validate(x, norm_weight, temb, weight, bias, timestep_indices, eps, check_indices=check_indices)
    if backend not in BACKENDS:
        check_option("backend", backend, BACKENDS)
    if numerics not in NUMERICS:
        check_option("numerics", numerics, NUMERICS)
    if table_backend not in TABLE_BACKENDS:
        check_option("table_backend", table_backend, TABLE_BACKENDS)
    exact_recorder = exact.recorder() if torch.is_grad_enabled() else None
    if backend == "numba":
        if exact_recorder is not None:
            raise NotImplementedError("final_adaln_out: exact gradients (adaln_lab.nn.ExactGradients) run on routes "
                                      "'cupy' and 'torch', not on the Numba twin; pass backend='auto'")
        from .twin import op as twin

        simulating = twin.simulating()
        support.refuse(support.numba_final_adaln_out(x, norm_weight, temb, weight, bias, simulating=simulating))
        return _kernels(x, norm_weight, temb, weight, bias, timestep_indices, eps, "numba", table_backend)
    route, cast = "torch", None
    if backend == "cupy" or (backend == "auto" and x.is_cuda):  # "cupy" on what the kernels refuse raises here
        cast = autocast_params(x, norm_weight, weight, bias)  # fp32 parameters under autocast (`core.autocast`)
        error = support.final_adaln_out(x, cast[0], temb, cast[1], cast[2])
        route = support.route("final_adaln_out", backend, x, error)
    if exact_recorder is not None:  # inside adaln_lab.nn.ExactGradients: the exact node on the same route
        return record(x, norm_weight, temb, weight, bias, timestep_indices, eps, exact_recorder, route, cast)
    if route == "torch":
        return replay(*dense(x, norm_weight, temb, weight, bias, timestep_indices), eps)
    norm_weight, weight, bias = cast
    return _kernels(x, norm_weight, temb, weight, bias, timestep_indices, eps, route, table_backend)
