"""The workload the evidence runner's `sanitize` step runs under each compute-sanitizer tool (memcheck,
racecheck, initcheck, synccheck; `python3 -m adaln_lab.bench.sanitize_calls` runs it plainly): every CUDA kernel of adaln_lab at small shapes, 0 and 1 rows included.

- `final_adaln_out` (backend "cupy"), forward+backward: (H, D, T) = (264, 64, 3), (1024, 256, 1) and the
  real (5376, 2688, 3), at 0, 1, 7 and 300 rows (300 not at the real size), plus x (2, 7, H) (leading dims);
- the blocks' kernels through adaln_lab/cuda/tensors.py: modulation_table_fwd/bwd (H 264,
  D 64, T 3, N = 18H; the table also on 2 persistent blocks), modulated_rms_norm_fwd/bwd (with and without d_residual), gated_residual_fwd/bwd and
  gated_residual_norm_fwd/bwd on R = 3T table rows (strided shift / scale / gate slices of the table; and as a
  block's eager path calls them: the table kernel's row tables read, a table gradient written in place) at 0, 1,
  7 and 300 rows.
Every result is checked finite (and, for 0 rows, the parameter gradients exactly zero), so a workload that
computes garbage fails here too. Prints one line per part and "small calls done".
"""

import torch

from adaln_lab import final_adaln_out
from adaln_lab.harness.inputs import make, upstream

OP_SHAPES = (dict(H=264, D=64, T=3), dict(H=1024, D=256, T=1), dict(H=5376, D=2688, T=3))
ROWS = (0, 1, 7, 300)
BLOCK_FUNCTIONS = ("modulation_table_fwd", "modulation_table_bwd", "modulated_rms_norm_fwd",
                   "modulated_rms_norm_bwd", "gated_residual_fwd", "gated_residual_bwd", "gated_residual_norm_fwd",
                   "gated_residual_norm_bwd")


def _finite(*tensors) -> None:
    torch.cuda.synchronize()
    for t in tensors:
        assert torch.isfinite(t.float()).all(), t.shape


def _op(inputs, x=None, idx=None) -> None:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    if x is not None:
        leaves[0] = x.detach().clone().requires_grad_(True)
    idx = inputs.timestep_indices if idx is None else idx
    out = final_adaln_out(*leaves, idx, backend="cupy")
    out.backward(upstream(1, out))
    _finite(out, *(leaf.grad for leaf in leaves))
    if out.numel() == 0:
        assert not any(leaf.grad.any() for leaf in leaves[1:])


def op_calls() -> None:
    for shape in OP_SHAPES:
        for rows in ROWS:
            if shape["H"] == 5376 and rows == 300:
                continue
            _op(make(1, rows, "cuda", **shape))
    inputs = make(2, 14, "cuda", **OP_SHAPES[0])
    _op(inputs, x=inputs.x.view(2, 7, -1), idx=inputs.timestep_indices[:7].contiguous())
    print("final_adaln_out: done")


def persistent_table(table_fwd, temb, weight, bias, table) -> None:
    """table.cu's persistent schedule (the real block's; small tables take a task per warp) on 2 blocks."""
    from adaln_lab.core import launchers, plan as plan_module

    saved = dict(plan_module.TUNING)
    try:
        plan_module.TUNING.update(TABLE_BLOCKS=2, TABLE_PERSISTENT_MIN_ROUNDS=1)
        launchers.forget_compiled()
        assert torch.equal(table_fwd(temb, weight, bias), table), "the persistent schedule changed the table"
    finally:
        plan_module.TUNING.clear()
        plan_module.TUNING.update(saved)
        launchers.forget_compiled()


def block_calls() -> None:
    from adaln_lab.core import tensors

    fns = {name: getattr(tensors, name) for name in BLOCK_FUNCTIONS}  # a missing one fails the workload
    H, D, T = 264, 64, 3
    R = 3 * T
    g = torch.Generator("cuda").manual_seed(0)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    temb = randn(T, D)
    weight, bias = randn(18 * H, D, scale=0.02, dtype=torch.bfloat16), randn(18 * H, scale=0.1, dtype=torch.bfloat16)
    table = fns["modulation_table_fwd"](temb, weight, bias)
    _finite(table, *fns["modulation_table_bwd"](randn(T, 18 * H), temb, weight))
    persistent_table(fns["modulation_table_fwd"], temb, weight, bias, table)
    rows6 = table.view(R, 6 * H)
    shift, scale, gate = rows6[:, 3 * H:4 * H], rows6[:, 4 * H:5 * H], rows6[:, 2 * H:3 * H]
    norm_weight = (1 + 0.1 * randn(H)).to(torch.bfloat16)
    # a block's eager path: the norms read the table kernel's row tables (norm2's: table 1), the backwards write into
    # one table gradient (ops.table_gradient) at the chunks' columns, row stride 6H; the same bits as above
    table_again, row_tables = fns["modulation_table_fwd"](temb, weight, bias, row_tables=True)
    assert torch.equal(table_again, table), "the row-tables plan changed the table"
    grad_table = torch.empty(R, 6 * H, device="cuda")

    def into(chunk):
        return grad_table.data_ptr() + 4 * chunk * H, 6 * H

    def columns(chunk, count=1):
        return grad_table[:, chunk * H:(chunk + count) * H]
    for rows in ROWS:
        x, y, dy = (randn(rows, H, dtype=torch.bfloat16) for _ in range(3))
        idx = torch.randint(0, R, (rows,), device="cuda", generator=g)
        out, rstd = fns["modulated_rms_norm_fwd"](x, norm_weight, shift, scale, idx, 1e-5)
        grads = fns["modulated_rms_norm_bwd"](dy, x, norm_weight, shift, scale, idx, rstd)
        grads_res = fns["modulated_rms_norm_bwd"](dy, x, norm_weight, shift, scale, idx, rstd, d_residual=y)
        gated = fns["gated_residual_fwd"](x, gate, y, idx)
        d_gate, d_y = fns["gated_residual_bwd"](dy, gate, y, idx)
        x_out, out2, rstd2 = fns["gated_residual_norm_fwd"](x, gate, y, idx, norm_weight, shift, scale, 1e-5)
        fused = fns["gated_residual_norm_bwd"](y, dy, x_out, gate, y, idx, norm_weight, shift, scale, rstd2)
        _finite(out, rstd, *grads, *grads_res, gated, d_gate, d_y, x_out, out2, rstd2, *fused)
        read = fns["modulated_rms_norm_fwd"](x, norm_weight, shift, scale, idx, 1e-5, row_table=(row_tables, 1))
        read_fused = fns["gated_residual_norm_fwd"](x, gate, y, idx, norm_weight, shift, scale, 1e-5,
                                                    row_table=(row_tables, 1))
        assert all(torch.equal(a, b) for a, b in zip((*read, *read_fused), (out, rstd, x_out, out2, rstd2)))
        # the block's workspaces given (regions of the table gradient's buffer there): exactly sized here
        norm_ws, gate_ws = (torch.empty(n, device="cuda") for n in tensors.row_workspaces(x, R))
        written = fns["modulated_rms_norm_bwd"](dy, x, norm_weight, shift, scale, idx, rstd, into=into(3),
                                                workspace=norm_ws.data_ptr())
        assert torch.equal(written[0], grads[0]) and torch.equal(columns(3, 2), torch.cat(grads[2:], dim=1))
        assert torch.equal(fns["gated_residual_bwd"](dy, gate, y, idx, into=into(2), workspace=gate_ws.data_ptr())[1],
                           d_y)
        assert torch.equal(columns(2), d_gate)
        grad_table.fill_(float("nan"))
        written = fns["gated_residual_norm_bwd"](y, dy, x_out, gate, y, idx, norm_weight, shift, scale, rstd2,
                                                 into=into(2), workspaces=(norm_ws.data_ptr(), gate_ws.data_ptr()))
        assert torch.equal(written[0], fused[0]) and torch.equal(columns(2, 3), torch.cat(
            (fused[1], fused[4], fused[5]), dim=1)), "the table gradient's columns differ from the gradients"
        if rows == 0:
            assert not any(t.any() for t in (*grads[1:], *grads_res[1:], d_gate, *fused[1:2], *fused[3:]))
    print("block kernels: done")


if __name__ == "__main__":
    op_calls()
    block_calls()
    print("small calls done")
