"""The CUDA op: torch allocates, `launchers` compute on torch's current stream, autograd wires it up.

Layers, one job each (as flash-attention's interface):
- `final_adaln_out` (called by `adaln_lab.op` after validation): eager calls go straight to the
  autograd node `FinalAdaLNOut` (the lean host path: two allocations and two launches forward; one
  allocation per gradient plus one workspace and four launches backward); under `torch.compile`
  the same computation goes through the custom ops below, which the compiler can trace.
- `torch.ops.adaln_lab.final_adaln_out_fwd` / `final_adaln_out_bwd`: torch.library custom ops
  with fake kernels and `register_autograd`, so `torch.compile(fullgraph=True)`, CUDA graphs and
  `torch.library.opcheck` take the op. Their CPU kernels compute the same function with torch ops
  (the diffusers replay forward; the analytic backward with the kernels' formulas in fp32 / fp64 and
  torch's reduction order, so close to the CUDA kernels but not bitwise), for tests and CPU users.
- `forward_tensors` / `backward_tensors`: allocate with torch and launch.

Shapes and broadcast: x (..., S, H) bf16, norm_weight (H,) bf16, temb (T, D) fp32, weight (2H, D)
bf16, bias (2H,) bf16, timestep_indices (S,) int64; row s of every leading index of x is modulated
by table[timestep_indices[s]], table = linear(bf16(silu(temb)), weight, bias) (T, 2H) = shift | scale.
The forward saves table_f32 (T, 2H) fp32 (the table before its bf16 rounding) and rstd (rows,) fp32.
Gradients: dx (..., S, H) bf16, d_norm_weight (H,) bf16, d_temb (T, D) fp32, d_weight (2H, D) bf16,
d_bias (2H,) bf16; every reduction over rows and timesteps in a fixed order (kernels_cu/).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import launchers
from .plan import check_shapes, plan as make_plan
from .reference import replay

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """torch's current CUDA stream on a device, as a raw handle."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _table_from_torch(temb, weight, bias):
    """The table by F.linear (cuBLAS), diffusers' bits, and its fp32 twin: the same sums unrounded (as
    table.cu's table_f32), which the backward uses. Tensors to keep alive."""
    act = F.silu(temb).to(weight.dtype)
    return F.linear(act, weight, bias), F.linear(act.float(), weight.float(), bias.float())


def forward_tensors(x, norm_weight, temb, weight, bias, timestep_indices, eps: float, table_backend: str,
                    fused_workspace: bool = True):
    """(out, saved): out (..., S, H) and what the backward needs.

    saved = (plan, rows, keep, table_f32_ptr, rstd_ptr). With `fused_workspace` the bf16 table,
    table_f32 and rstd share one allocation (the eager path); otherwise `keep` is the tuple
    (table_f32 (T, 2H), rstd (rows,)) of separate tensors (the custom op's outputs).
    """
    x, norm_weight, weight, bias = _aligned(x), _aligned(norm_weight), _aligned(weight), _aligned(bias)
    H = x.shape[-1]
    T, D = temb.shape
    plan = make_plan(H, D, T)
    rows = plan.rows(x.numel() // H)
    device = x.device
    k = launchers.kernels(device.index, plan)
    launchers.bind(device.index)
    stream = current_stream(device.index)
    out = torch.empty_like(x)
    if fused_workspace:
        keep = torch.empty(rows.fwd_bytes, dtype=torch.uint8, device=device)
        base, o = keep.data_ptr(), rows.fwd_offsets
        table, table_f32, rstd = base + o["table"], base + o["table_f32"], base + o["rstd"]
    else:
        table_f32_t = torch.empty(T, 2 * H, dtype=torch.float32, device=device)
        rstd_t = torch.empty(rows.rows, dtype=torch.float32, device=device)
        keep = (table_f32_t, rstd_t)
        table_t = torch.empty(T, 2 * H, dtype=torch.bfloat16, device=device)
        table, table_f32, rstd = table_t.data_ptr(), table_f32_t.data_ptr(), rstd_t.data_ptr()
    if table_backend == "torch":
        table_t, table_f32_t = _table_from_torch(temb, weight, bias)
        if fused_workspace:
            keep = (keep, table_f32_t)
        else:
            keep[0].copy_(table_f32_t)
        table = table_t.data_ptr()
        table_f32 = table_f32_t.data_ptr() if fused_workspace else table_f32
    else:
        launchers.launch_table(k, plan, stream, temb.data_ptr(), weight.data_ptr(), bias.data_ptr(), table, table_f32)
    launchers.launch_norm_modulate(k, plan, rows, stream, x.data_ptr(), norm_weight.data_ptr(), table,
                                   timestep_indices.data_ptr(), out.data_ptr(), rstd, x.shape[-2], eps)
    return out, (plan, rows, keep, table_f32, rstd)


def backward_tensors(dy, x, norm_weight, temb, weight, timestep_indices, saved):
    """dx, d_norm_weight, d_temb, d_weight, d_bias (see the module docstring) for one forward's `saved`."""
    plan, rows, _, table_f32, rstd = saved
    x, norm_weight, weight = _aligned(x), _aligned(norm_weight), _aligned(weight)
    device = x.device
    k = launchers.kernels(device.index, plan)
    launchers.bind(device.index)
    stream = current_stream(device.index)
    dy = _aligned(dy)
    dx = torch.empty_like(x)
    d_norm_weight = torch.empty_like(norm_weight)
    d_temb = torch.empty_like(temb)
    d_weight = torch.empty_like(weight)
    d_bias = torch.empty(2 * plan.H, dtype=weight.dtype, device=device)
    workspace = torch.empty(rows.bwd_bytes, dtype=torch.uint8, device=device)
    launchers.launch_backward(k, plan, rows, stream, dy=dy.data_ptr(), x=x.data_ptr(), rstd=rstd,
                              norm_weight=norm_weight.data_ptr(), table_f32=table_f32,
                              timestep_indices=timestep_indices.data_ptr(), temb=temb.data_ptr(),
                              weight=weight.data_ptr(), workspace=workspace.data_ptr(), dx=dx.data_ptr(),
                              d_norm_weight=d_norm_weight.data_ptr(), d_temb=d_temb.data_ptr(),
                              d_weight=d_weight.data_ptr(), d_bias=d_bias.data_ptr(), S=x.shape[-2])
    return dx, d_norm_weight, d_temb, d_weight, d_bias


def table(temb, weight, bias):
    """table (T, 2H) bf16 and table_f32 (T, 2H) fp32 by kernels_cu/table.cu (one kernel, for tests and tools)."""
    T, D = temb.shape
    H = weight.shape[0] // 2
    plan = make_plan(H, D, T)
    out = torch.empty(T, 2 * H, dtype=torch.bfloat16, device=temb.device)
    out_f32 = torch.empty(T, 2 * H, dtype=torch.float32, device=temb.device)
    launchers.bind(temb.device.index)
    launchers.launch_table(launchers.kernels(temb.device.index, plan), plan, current_stream(temb.device.index),
                           temb.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(), out_f32.data_ptr())
    return out, out_f32


def norm_modulate(x, norm_weight, table_bf16, timestep_indices, eps: float, D: int):
    """out (..., S, H) bf16 and rstd (rows,) fp32 by kernels_cu/norm_modulate.cu (one kernel, for tests and tools)."""
    H, T = x.shape[-1], table_bf16.shape[0]
    plan = make_plan(H, D, T)
    rows = plan.rows(x.numel() // H)
    out = torch.empty_like(x)
    rstd = torch.empty(rows.rows, dtype=torch.float32, device=x.device)
    launchers.bind(x.device.index)
    launchers.launch_norm_modulate(launchers.kernels(x.device.index, plan), plan, rows, current_stream(x.device.index),
                                   x.data_ptr(), norm_weight.data_ptr(), table_bf16.data_ptr(),
                                   timestep_indices.data_ptr(), out.data_ptr(), rstd.data_ptr(), x.shape[-2], eps)
    return out, rstd


class FinalAdaLNOut(torch.autograd.Function):
    """The eager autograd node: forward(x, norm_weight, temb, weight, bias, timestep_indices, eps,
    table_backend) -> out; backward(dy) -> dx, d_norm_weight, d_temb, d_weight, d_bias (shapes and
    broadcast in the module docstring). Saves x, norm_weight, temb, weight, timestep_indices and the
    forward's workspace (table_f32, rstd)."""

    @staticmethod
    def forward(ctx, x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend):
        out, ctx.adaln_saved = forward_tensors(x, norm_weight, temb, weight, bias, timestep_indices, eps,
                                               table_backend)
        ctx.save_for_backward(x, norm_weight, temb, weight, timestep_indices)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, norm_weight, temb, weight, timestep_indices = ctx.saved_tensors
        grads = backward_tensors(dy, x, norm_weight, temb, weight, timestep_indices, ctx.adaln_saved)
        needs = ctx.needs_input_grad
        return (*(g if need else None for g, need in zip(grads, needs)), None, None, None)


# ---- torch.library custom ops: what torch.compile and CUDA graphs see ----

@torch.library.custom_op("adaln_lab::final_adaln_out_fwd", mutates_args=())
def final_adaln_out_fwd(x: torch.Tensor, norm_weight: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor, timestep_indices: torch.Tensor, eps: float,
                        table_backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (..., S, H), table_f32 (T, 2H) fp32, rstd (rows,) fp32) on CUDA through kernels_cu."""
    _refuse_unsupported(x, norm_weight, temb, weight, bias)
    with torch.cuda.device(x.device):
        out, (_, _, keep, _, _) = forward_tensors(x, norm_weight, temb.contiguous(), weight, bias,
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
    table_f32 = _table_from_torch(temb, weight, bias)[1]
    xf = x.float().reshape(-1, x.shape[-1])
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1) + eps)
    return out, table_f32, rstd


@torch.library.custom_op("adaln_lab::final_adaln_out_bwd", mutates_args=())
def final_adaln_out_bwd(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, temb: torch.Tensor,
                        weight: torch.Tensor, timestep_indices: torch.Tensor, table_f32: torch.Tensor,
                        rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
    """(dx, d_norm_weight, d_temb, d_weight, d_bias) on CUDA through kernels_cu."""
    _refuse_unsupported(x, norm_weight, temb, weight)
    H = x.shape[-1]
    T, D = temb.shape
    plan = make_plan(H, D, T)
    table_f32, rstd = _aligned(table_f32), rstd.contiguous()
    saved = (plan, plan.rows(x.numel() // H), None, table_f32.data_ptr(), rstd.data_ptr())
    with torch.cuda.device(x.device):
        return backward_tensors(dy, x, norm_weight, temb.contiguous(), weight, timestep_indices.contiguous(), saved)


@final_adaln_out_bwd.register_fake
def _(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd):
    return (x.new_empty(x.shape), norm_weight.new_empty(norm_weight.shape), temb.new_empty(temb.shape),
            weight.new_empty(weight.shape), weight.new_empty((weight.shape[0],)))


@final_adaln_out_bwd.register_kernel("cpu")
def _(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd):
    """The analytic backward in torch ops (fp32 rows, fp64 parameter sums), the kernels' formulas."""
    H = x.shape[-1]
    T = temb.shape[0]
    rows_idx = timestep_indices.repeat(x.numel() // H // max(x.shape[-2], 1)) if x.shape[-2] else timestep_indices
    xf, dyf = x.float().reshape(-1, H), dy.float().reshape(-1, H)
    xhat = xf * rstd[:, None]
    s1 = 1.0 + table_f32[:, H:]
    g = dyf * s1[rows_idx] * norm_weight.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    a = torch.zeros(T, H, dtype=torch.float64).index_add_(0, rows_idx, (dyf * xhat).double())
    b = torch.zeros(T, H, dtype=torch.float64).index_add_(0, rows_idx, dyf.double())
    d_table = torch.cat([b, norm_weight.double() * a], dim=-1).float()
    d_norm_weight = ((1.0 + table_f32[:, H:].double()) * a).sum(0)
    act = F.silu(temb.double())
    d_weight = d_table.double().T @ act
    sig = torch.sigmoid(temb.double())
    d_temb = (d_table.double() @ weight.double()) * sig * (1.0 + temb.double() * (1.0 - sig))
    return (dx.to(x.dtype).reshape(x.shape).contiguous(), d_norm_weight.to(norm_weight.dtype), d_temb.to(temb.dtype),
            d_weight.to(weight.dtype), d_table.double().sum(0).to(weight.dtype))


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


def unsupported(x, norm_weight, temb, weight, bias=None) -> Exception | None:
    """Why the CUDA kernels cannot take these (validated) inputs, as the error to raise (naming the
    argument: TypeError for a dtype, ValueError for a device or shape); None if they can. The one
    place this rule lives: backend "auto", backend "cupy", the custom ops and adaln_lab.dlpack ask it."""
    for name, t in (("x", x), ("norm_weight", norm_weight), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != torch.bfloat16:
            return TypeError(f"backend='cupy' needs {name} in bfloat16, got {t.dtype}; use backend='torch'")
    if temb.dtype != torch.float32:
        return TypeError(f"backend='cupy' needs temb in float32, got {temb.dtype}; use backend='torch'")
    if x.device.type != "cuda":
        return ValueError(f"backend='cupy' needs CUDA tensors, but x is on {x.device}")
    try:
        check_shapes(x.shape[-1], temb.shape[1], temb.shape[0])
    except ValueError as error:
        return error
    return None


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and starting on a 16-byte boundary (the kernels load 8 bf16 at a time); a copy only if not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _refuse_unsupported(x, norm_weight, temb, weight, bias=None) -> None:
    error = unsupported(x, norm_weight, temb, weight, bias)
    if error is not None:
        raise error


def final_adaln_out_op(x, norm_weight, temb, weight, bias, timestep_indices, eps, table_backend="cuda"):
    """The op through torch.library (what torch.compile traces): out (..., S, H)."""
    return final_adaln_out_fwd(x, norm_weight, temb, weight, bias, timestep_indices, float(eps), table_backend)[0]


def final_adaln_out(x, norm_weight, temb, weight, bias, timestep_indices, eps, *, table_backend="cuda"):
    """The CUDA backend of `adaln_lab.final_adaln_out` (inputs already validated by `adaln_lab.op`)."""
    _refuse_unsupported(x, norm_weight, temb, weight, bias)
    args = (x.contiguous(), norm_weight.contiguous(), temb.contiguous(), weight.contiguous(), bias.contiguous(),
            timestep_indices.contiguous(), float(eps), table_backend)
    if torch.compiler.is_compiling():
        return final_adaln_out_op(*args)
    if x.device.index == torch.cuda.current_device():
        return FinalAdaLNOut.apply(*args)
    with torch.cuda.device(x.device):  # kernels and allocations must see x's device as current
        return FinalAdaLNOut.apply(*args)
