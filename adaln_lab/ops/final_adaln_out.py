"""`final_adaln_out`: MiniMax-H3's norm_out as one differentiable op.

    table = linear(silu(temb).to(weight.dtype), weight, bias)          (T, 2H): shift | scale
    out   = rms_norm(x, norm_weight, eps) * (1 + scale[timestep_indices]) + shift[timestep_indices]

Broadcast rule: x is (..., S, H); row s of every leading index uses timestep_indices[s]. Shapes: norm_weight
(H,), temb (T, D), weight (2H, D), bias (2H,), timestep_indices (S,) int64 in [0, T).

Layers (as flash-attention's interface):
- `final_adaln_out`: validate once (`checks.validate`), resolve the backend (`support.final_adaln_out`, the
  one kernel rule), dispatch: "torch" -> the diffusers replay; "numba" -> `adaln_lab.numba.op`; "cupy" ->
  eager calls go to the autograd node `FinalAdaLNOut` straight onto the launchers (`core.tensors`: two
  allocations and two launches forward; the gradients, one workspace and four launches backward), and
  under `torch.compile` to the custom ops below.
- `torch.ops.adaln_lab.final_adaln_out_fwd` / `final_adaln_out_bwd`: torch.library custom ops with fake
  kernels and `register_autograd`, so `torch.compile(fullgraph=True)`, CUDA graphs and
  `torch.library.opcheck` take the op. Their CPU kernels compute the same function with torch ops (the
  diffusers replay forward; `reference.backward.final_adaln_out_backward`), for tests and CPU users.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..core import tensors
from ..core.plan import plan as make_plan
from ..reference.backward import final_adaln_out_backward
from ..reference.final_adaln_out import replay
from ..core import support
from ..core.autocast import autocast_params
from ..core.checks import BACKENDS, NUMERICS, TABLE_BACKENDS, check_option, validate
from .eager import apply


class FinalAdaLNOut(torch.autograd.Function):
    """The eager autograd node on the CUDA kernels: forward(x, norm_weight, temb, weight, bias,
    timestep_indices, eps, table_backend) -> out; backward(dy) -> dx, d_norm_weight, d_temb, d_weight,
    d_bias (shapes and broadcast in the module docstring). Takes contiguous, supported inputs. Saves x,
    norm_weight, temb, weight, timestep_indices and the forward's workspace (table_f32, rstd)."""

    @staticmethod
    def forward(ctx, x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend):
        out, ctx.adaln_saved = tensors.forward_tensors(x, norm_weight, temb, weight, bias, timestep_indices, eps,
                                                       table_backend)
        ctx.save_for_backward(x, norm_weight, temb, weight, timestep_indices)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, norm_weight, temb, weight, timestep_indices = ctx.saved_tensors
        support.check_saved("final_adaln_out", x, norm_weight=norm_weight, weight=weight)
        grads = tensors.backward_tensors(dy, x, norm_weight, temb, weight, timestep_indices, ctx.adaln_saved)
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads, needs)), None, None, None)


# ---- torch.library custom ops: what torch.compile and CUDA graphs see ----

@torch.library.custom_op("adaln_lab::final_adaln_out_fwd", mutates_args=())
def final_adaln_out_fwd(x: torch.Tensor, norm_weight: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor, timestep_indices: torch.Tensor, eps: float,
                        table_backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (..., S, H), table_f32 (T, 2H) fp32, rstd (rows,) fp32) on CUDA through kernels_cu."""
    support.refuse(support.final_adaln_out(x, norm_weight, temb, weight, bias))
    with torch.cuda.device(x.device):
        out, (_, _, keep, _, _) = tensors.forward_tensors(x, norm_weight, temb.contiguous(), weight, bias,
                                                          timestep_indices.contiguous(), eps, table_backend,
                                                          fused_workspace=False)
    return out, keep[0], keep[1]


@final_adaln_out_fwd.register_fake
def _(x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend):
    T, H = temb.shape[0], x.shape[-1]
    rows = x.numel() // H
    return (x.new_empty(x.shape), x.new_empty((T, 2 * H), dtype=torch.float32),
            x.new_empty((rows,), dtype=torch.float32))


@final_adaln_out_fwd.register_kernel("cpu")
def _(x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend):
    out = replay(x, norm_weight, temb, weight, bias, timestep_indices, eps).contiguous()
    table_f32 = tensors.table_from_torch(temb, weight, bias)[1]
    xf = x.float().reshape(-1, x.shape[-1])
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1) + eps)
    return out, table_f32, rstd


@torch.library.custom_op("adaln_lab::final_adaln_out_bwd", mutates_args=())
def final_adaln_out_bwd(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, temb: torch.Tensor,
                        weight: torch.Tensor, timestep_indices: torch.Tensor, table_f32: torch.Tensor,
                        rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
    """(dx, d_norm_weight, d_temb, d_weight, d_bias) on CUDA through kernels_cu."""
    support.refuse(support.final_adaln_out(x, norm_weight, temb, weight))
    H = x.shape[-1]
    T, D = temb.shape
    plan = make_plan(H, D, T)
    table_f32, rstd = tensors.aligned(table_f32), rstd.contiguous()
    saved = (plan, plan.rows(x.numel() // H), None, table_f32.data_ptr(), rstd.data_ptr())
    with torch.cuda.device(x.device):
        return tensors.backward_tensors(dy, x, norm_weight, temb.contiguous(), weight, timestep_indices.contiguous(),
                                        saved)


@final_adaln_out_bwd.register_fake
def _(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd):
    return (x.new_empty(x.shape), norm_weight.new_empty(norm_weight.shape), temb.new_empty(temb.shape),
            weight.new_empty(weight.shape), weight.new_empty((weight.shape[0],)))


@final_adaln_out_bwd.register_kernel("cpu")
def _(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd):
    """The analytic backward in torch ops (`reference.backward`): fp32 rows, fp64 parameter sums."""
    return final_adaln_out_backward(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd)


def _setup_context(ctx, inputs, output):
    x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend = inputs
    _, table_f32, rstd = output
    ctx.mark_non_differentiable(table_f32, rstd)
    ctx.save_for_backward(x, norm_weight, temb, weight, timestep_indices, table_f32, rstd)


def _backward(ctx, d_out, d_table_f32, d_rstd):
    x, norm_weight, temb, weight, timestep_indices, table_f32, rstd = ctx.saved_tensors
    grads = final_adaln_out_bwd(d_out.contiguous(), x, norm_weight, temb, weight, timestep_indices, table_f32, rstd)
    return (*grads, None, None, None)


final_adaln_out_fwd.register_autograd(_backward, setup_context=_setup_context)


def final_adaln_out_op(x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend="cuda"):
    """The op through torch.library (what torch.compile traces): out (..., S, H)."""
    return final_adaln_out_fwd(x, norm_weight, temb, weight, bias, timestep_indices, float(eps), table_backend)[0]


def _cuda(x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend):
    """backend "cupy" on supported inputs: the custom op under torch.compile, else the eager node."""
    args = (x.contiguous(), norm_weight.contiguous(), temb.contiguous(), weight.contiguous(), bias.contiguous(),
            timestep_indices.contiguous(), float(eps), table_backend)
    if torch.compiler.is_compiling():
        return final_adaln_out_op(*args)
    if x.get_device() == tensors.current_device():
        return apply(FinalAdaLNOut, *args)
    with torch.cuda.device(x.device):  # kernels and allocations must see x's device as current
        return apply(FinalAdaLNOut, *args)


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
            kernels_cu, `adaln_lab.numba.op`: the same inputs and bits as "cupy", for reading and
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
        table_backend: cupy and numba backends only: "cuda" computes the table with the
            fixed-order GEMV of kernels_cu (numba: its twin; T-invariant rows), "torch" with F.linear
            (bitwise diffusers' table on the same GPU, but cuBLAS's reduction order).
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
    if backend == "torch" or (backend == "auto" and not x.is_cuda):
        return replay(*dense(x, norm_weight, temb, weight, bias, timestep_indices), eps)
    if backend == "numba":
        from ..numba import op as numba_op

        return numba_op.final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices, eps,
                                        table_backend=table_backend)
    cast = autocast_params(x, norm_weight, weight, bias)  # fp32 parameters under autocast (`core.autocast`)
    error = support.final_adaln_out(x, *cast[:1], temb, *cast[1:])
    if error is not None:
        if backend == "cupy":
            raise error
        support.warn_fallback("final_adaln_out", x, error)
        return replay(*dense(x, norm_weight, temb, weight, bias, timestep_indices), eps)
    norm_weight, weight, bias = cast
    return _cuda(x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend)
