"""The modulation table's two launch ops, writing outputs the caller allocated (`core.library.library_op`):

    forward(temb, weight, bias, route, table_backend, table, table_bf16)
    backward(d_table, temb, weight, route, d_temb, d_weight, d_bias)

Shapes: temb, d_temb (T, D); weight, d_weight (N, D); bias, d_bias (N,); table, d_table (T, N) float32 (float64 for
float64 parameters) holding values of weight's dtype; table_bf16: None, or (route "cupy") a flat bf16 buffer of
`bf16_elements(T, N, D)`: the table kernel's bf16 output, the two (3T, 2H) row tables one after the other for a
block's table of N = 18H columns (what the norms read: `core.plan.row_tables_fit`, `core.tensors.row_table_address`),
else (T, N), then its (T, D) act scratch.

route "cupy": table.cu (tensor cores in an order fixed by D: each row independent of T) and table_bwd.cu (temb
widened to float32 where it has weight's dtype: `core.support.kernel_temb`); route "torch": diffusers' table upcast,
and the exact derivative in float64 (`reference.backward.modulation_table_backward`), one rounding per output.
"""

from __future__ import annotations

import torch

from ...core import launchers, support, tensors
from ...core.plan import row_tables_fit
from ...core.library import library_op
from ...reference.backward import modulation_table_backward
from ...reference.block import replay_table


def bf16_elements(T: int, N: int, D: int) -> int:
    """Elements of the forward's bf16 buffer for temb (T, D) and N columns: the table kernel's bf16 output (a block's
    two (3T, 2H) row tables where `row_tables_fit(N)`, else (T, N)), then its (T, D) act scratch. The output's size
    is a 16-byte multiple (N % 8 == 0), so act starts 16-byte aligned."""
    return (12 * T * (N // 18) if row_tables_fit(N) else T * N) + T * D


@library_op("adaln_lab::modulation_table_fwd", mutates_args=("table", "table_bf16"))
def forward(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, route: str, table_backend: str,
            table: torch.Tensor, table_bf16: torch.Tensor | None) -> None:
    """table (T, N) and, on the kernels, table_bf16: the bf16 output and the act scratch (module docstring)."""
    if route != "cupy" or table_backend == "torch":
        table.copy_(replay_table(temb, weight, bias))
        return
    # table.cu loads temb 16 bytes at a time
    (temb, weight, bias), at = tensors.aligned_addresses(support.kernel_temb(temb, weight), weight, bias)
    T, D = temb.shape
    N = weight.shape[0]
    need = bf16_elements(T, N, D)
    if (table_bf16 is None or table_bf16.numel() < need or table_bf16.dtype != torch.bfloat16
            or table_bf16.data_ptr() % 16):
        got = "None" if table_bf16 is None else f"{table_bf16.numel()} {table_bf16.dtype} elements"
        raise ValueError(f"modulation_table_fwd: table_bf16 must be a 16-byte aligned bf16 buffer of bf16_elements(T, "
                         f"N, D) = {need} elements on route 'cupy', got {got}")
    plan, k, stream = tensors.table_setup(temb, N)
    base = table_bf16.data_ptr()  # the bf16 output, then the act scratch
    launchers.launch_table(k, plan, stream, at[0], at[1], at[2], base, table.data_ptr(), base + 2 * (need - T * D))


@library_op("adaln_lab::modulation_table_bwd", mutates_args=("d_temb", "d_weight", "d_bias"))
def backward(d_table: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, route: str, d_temb: torch.Tensor,
             d_weight: torch.Tensor, d_bias: torch.Tensor) -> None:
    """d_temb (in temb's dtype), d_weight, d_bias (in the parameters' dtypes) from d_table (module docstring)."""
    if route != "cupy":
        for output, grad in zip((d_temb, d_weight, d_bias),
                                modulation_table_backward(d_table, temb, weight, d_bias.dtype)):
            output.copy_(grad)
        return
    wide = support.kernel_temb(temb, weight).contiguous()
    T, D = wide.shape
    plan, k, stream = tensors.table_setup(wide, weight.shape[0])
    (d_table, weight), at = tensors.aligned_addresses(tensors.as_dtype(d_table, torch.float32), weight)
    d_wide = d_temb if d_temb.dtype == torch.float32 else torch.empty_like(wide)
    dact_partials = wide.new_empty(plan.tb_bytes, dtype=torch.uint8)  # and table_bwd's terms
    launchers.launch_table_bwd(k, plan, stream, at[0], wide.data_ptr(), at[1], d_weight.data_ptr(),
                               dact_partials.data_ptr(), d_wide.data_ptr(), d_bias.data_ptr())
    if d_wide is not d_temb:
        d_temb.copy_(d_wide)
