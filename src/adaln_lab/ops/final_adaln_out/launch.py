"""norm_out's two launch ops: each writes outputs its caller allocated, so their fakes are no-ops
(`core.library.library_op`): `torch.ops.adaln_lab.final_adaln_out_fwd` and `final_adaln_out_bwd`.

    forward(x, norm_weight, temb, weight, bias, timestep_indices, eps, route, table_backend, out, workspace)
    backward(dy, x, norm_weight, temb, weight, timestep_indices, workspace, route, dx, d_norm_weight, d_temb,
             d_weight, d_bias)

Shapes: x, out, dy, dx (..., S, H); norm_weight, d_norm_weight (H,); temb, d_temb (T, D); weight, d_weight (2H, D);
bias, d_bias (2H,); timestep_indices (S,) int64; workspace (bytes,) uint8, `plan.forward_workspace(T, H, rows, D)`:
the bf16 table (T, 2H), table_f32 (T, 2H) (the table before its bf16 rounding) and rstd (rows,), which the forward
writes and the backward reads, and the table kernel's act scratch (T, D) bf16. Inputs contiguous (the op's Function
sees to it).

route "cupy": kernels_cu on CUDA tensors (three launches forward, four to six backward by T, every reduction in a
fixed order; the backward's workspace is one allocation of its own); route "numba": the Numba twin (`twin.op`): the
same bits with table_backend "torch" for T below plan.bwd_sorted's, else the same dx (`twin.backward` says why);
route "torch", and CPU tensors (`core.tensors.gpu`), the reference: the diffusers replay forward, the analytic
backward of `reference.backward` (what `torch.library.opcheck` and the CPU tests exercise; the public op's own
torch route is the replay under torch's autograd).
"""

from __future__ import annotations

import torch

from ...core import launchers, tensors
from ...core.library import library_op
from ...core.plan import forward_workspace
from ...reference.backward import final_adaln_out_backward
from ...reference.final_adaln_out import replay, table_from_torch


def reference_forward(x, norm_weight, temb, weight, bias, timestep_indices, eps: float):
    """(out (..., S, H), table_f32 (T, 2H), rstd (rows,)) in torch code: the diffusers replay, and what the analytic
    backward (`reference.backward.final_adaln_out_backward`) reads."""
    rstd = torch.rsqrt(x.float().reshape(-1, x.shape[-1]).pow(2).mean(dim=-1) + eps)
    return replay(x, norm_weight, temb, weight, bias, timestep_indices, eps), table_from_torch(temb, weight, bias)[1], rstd


def saved_views(workspace: torch.Tensor, T: int, H: int, rows: int, D: int):
    """(table (T, 2H) bf16, table_f32 (T, 2H) fp32, rstd (rows,) fp32): the forward workspace's pieces as tensors."""
    offsets, total = forward_workspace(T, H, rows, D)
    if workspace.numel() < total:
        raise _short(workspace, total)

    def piece(name, dtype, shape):
        start = offsets[name]
        count = shape[0] * (shape[1] if len(shape) > 1 else 1)
        return workspace[start:start + count * dtype.itemsize].view(dtype).view(shape)

    return (piece("table", torch.bfloat16, (T, 2 * H)), piece("table_f32", torch.float32, (T, 2 * H)),
            piece("rstd", torch.float32, (rows,)))


def _short(workspace: torch.Tensor, needed: int) -> ValueError:
    """The error for a workspace of fewer than `needed` bytes (the callers compare: one comparison a call)."""
    return ValueError(f"final_adaln_out: a workspace of {workspace.numel()} bytes, the plan needs {needed} "
                      "(core.plan.forward_bytes(T, H, rows, D))")


@library_op("adaln_lab::final_adaln_out_fwd", mutates_args=("out", "workspace"))
def forward(x: torch.Tensor, norm_weight: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor, timestep_indices: torch.Tensor, eps: float, route: str, table_backend: str,
            out: torch.Tensor, workspace: torch.Tensor) -> None:
    """out (..., S, H) and the forward workspace (module docstring)."""
    H = x.shape[-1]
    T, D = temb.shape
    rows = x.numel() // H
    if route == "numba":
        from .twin import op as twin

        result, table_f32, rstd = twin.forward_tensors(x, norm_weight, temb, weight, bias, timestep_indices, eps,
                                                       table_backend)
        _, saved_f32, saved_rstd = saved_views(workspace, T, H, rows, D)
        out.copy_(result), saved_f32.copy_(table_f32), saved_rstd.copy_(rstd)
        return
    if route == "torch" or not tensors.gpu(x):
        _, saved_f32, saved_rstd = saved_views(workspace, T, H, rows, D)
        result, table_f32, rstd = reference_forward(x, norm_weight, temb, weight, bias, timestep_indices, eps)
        out.copy_(result), saved_f32.copy_(table_f32), saved_rstd.copy_(rstd)
        return
    device = x.get_device()
    plan, layout, k = tensors.context(device, H, D, T, rows)
    if workspace.numel() < layout.fwd_bytes:  # the kernels write every piece, act last
        raise _short(workspace, layout.fwd_bytes)
    launchers.bind(device)
    base, o = workspace.data_ptr(), layout.fwd_offsets
    table, table_written = base + o["table"], table_backend == "torch"
    if table_written:
        saved = saved_views(workspace, T, H, rows, D)
        for piece, value in zip(saved, table_from_torch(temb, weight, bias)):
            piece.copy_(value)
    kernels_forward(x, norm_weight, temb, weight, bias, timestep_indices, eps, out.data_ptr(), table,
                    base + o["table_f32"], base + o["rstd"], tensors.current_stream(device), table_written,
                    (plan, layout, k), base + o["act"])


def kernels_of(x: torch.Tensor, temb: torch.Tensor):
    """(plan, its Rows, the compiled kernels) of norm_out on x (..., S, H) and temb (T, D), x's device bound."""
    device = x.get_device()
    plan, rows, k = tensors.context(device, x.shape[-1], temb.shape[1], temb.shape[0], x.numel() // x.shape[-1])
    launchers.bind(device)
    return plan, rows, k


def kernels_forward(x, norm_weight, temb, weight, bias, timestep_indices, eps: float, out: int, table: int,
                    table_f32: int, rstd: int, stream: int, table_written: bool = False, context=None,
                    act: int = 0) -> None:
    """table.cu (unless `table_written`: the bf16 table and table_f32 already at their addresses), then
    norm_modulate.cu, on `stream`, writing out, table, table_f32 and rstd at the given addresses (the op's workspace,
    or `adaln_lab.dlpack`'s arrays). context: `kernels_of(x, temb)` where the
    caller has it (its device bound). act: the table kernel's scratch address, or 0 (`tensors.table_launch` makes
    one)."""
    (x, norm_weight, temb, weight, bias), at = tensors.aligned_addresses(x, norm_weight, temb, weight, bias)
    plan, rows, k = context or kernels_of(x, temb)
    if not table_written:
        if act:  # the scratch given: straight to the launcher
            launchers.launch_table(k, plan, stream, at[2], at[3], at[4], table, table_f32, act)
        else:
            tensors.table_launch(k, plan, stream, temb, at[3], at[4], table, table_f32)
    launchers.launch_norm_modulate(k, plan, rows, stream, at[0], at[1], table, timestep_indices.data_ptr(), out, rstd,
                                   x.shape[-2], eps, not table_written)


@library_op("adaln_lab::final_adaln_out_bwd",
            mutates_args=("dx", "d_norm_weight", "d_temb", "d_weight", "d_bias"))
def backward(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor,
             timestep_indices: torch.Tensor, workspace: torch.Tensor, route: str, dx: torch.Tensor,
             d_norm_weight: torch.Tensor, d_temb: torch.Tensor, d_weight: torch.Tensor, d_bias: torch.Tensor) -> None:
    """dx, d_norm_weight, d_temb, d_weight, d_bias from one forward's workspace (module docstring)."""
    H = x.shape[-1]
    T, D = temb.shape
    rows = x.numel() // H
    outputs = (dx, d_norm_weight, d_temb, d_weight, d_bias)
    if route in ("numba", "torch") or not tensors.gpu(x):
        _, table_f32, rstd = saved_views(workspace, T, H, rows, D)
        if route == "numba":
            from .twin import op as twin

            grads = twin.backward_tensors(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd)
        else:
            grads = final_adaln_out_backward(dy, x, norm_weight, temb, weight, timestep_indices, table_f32, rstd)
        for output, grad in zip(outputs, grads):
            output.copy_(grad)
        return
    device = x.get_device()
    context = tensors.context(device, H, D, T, rows)
    launchers.bind(device)
    base, o = workspace.data_ptr(), context[1].fwd_offsets
    kernels_backward(dy, x, norm_weight, temb, weight, timestep_indices, base + o["table_f32"], base + o["rstd"],
                     outputs, tensors.current_stream(device), None, context)  # no workspace given: one made there


def kernels_backward(dy, x, norm_weight, temb, weight, timestep_indices, table_f32: int, rstd: int, outputs,
                     stream: int, workspace=None, context=None) -> None:
    """The four backward kernels on `stream`: outputs = (dx, d_norm_weight, d_temb, d_weight, d_bias) tensors,
    from the forward's table_f32 and rstd at their addresses; workspace: None (one torch allocation here), or a
    tensor of at least the plan's `bwd_bytes`. context: `kernels_of(x, temb)` where the caller has it."""
    (dy, x, norm_weight, weight), at = tensors.aligned_addresses(dy, x, norm_weight, weight)
    plan, rows, k = context or kernels_of(x, temb)
    if workspace is None:
        workspace = x.new_empty(rows.bwd_bytes, dtype=torch.uint8)
    dx, d_norm_weight, d_temb, d_weight, d_bias = outputs
    # by position, in launch_backward's order (a call of 16 keywords costs about 0.5 us of host time more)
    launchers.launch_backward(k, plan, rows, stream, at[0], at[1], rstd, at[2], table_f32, timestep_indices.data_ptr(),
                              temb.data_ptr(), at[3], workspace.data_ptr(), dx.data_ptr(), d_norm_weight.data_ptr(),
                              d_temb.data_ptr(), d_weight.data_ptr(), d_bias.data_ptr(), x.shape[-2])
