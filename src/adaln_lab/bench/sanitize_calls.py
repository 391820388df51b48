"""The workload the evidence runner's `sanitize` step runs under each compute-sanitizer tool (memcheck,
racecheck, initcheck, synccheck; `python3 -m adaln_lab.bench.sanitize_calls` runs it plainly): every CUDA kernel
of adaln_lab at small shapes, 0 and 1 rows included.

- `final_adaln_out` (backend "cupy"), forward+backward: (H, D, T) = (264, 64, 3), (1024, 256, 1), the real
  (5376, 2688, 3), (1024, 256, 12) and (264, 64, 32) (the sorted backward, table_bwd's narrower lanes), at 0, 1, 7
  and 300 rows (300 not at the real size), plus x (2, 7, H) (leading dims);
- norm_out's exact route (inside `adaln_lab.nn.ExactGradients`: exact_row_pass.cu) at (264, 64, 3) and (1024, 256, 12),
  0, 1, 7 and 300 rows;
- the blocks' kernels through the ops' launch ops (route "cupy"): modulation_table (H 264, D 64, T 3, N = 18H; the
  table also on three other tile shapes, the same bits), modulated_rms_norm (with and without d_residual),
  gated_residual and gated_residual_norm on R = 3T table rows (strided shift / scale / gate slices of the table; and
  as a block calls them: the table kernel's row tables read, a table gradient written at the chunks' columns, row
  stride 6H) at 0, 1, 7 and 300 rows;
- a block's exact route (inside ExactGradients: the norms' and gates' sorted passes with exact sums, the carries,
  write's exact_state.cu and exact_products.cu: d_weight's and d_temb's products) at H 264, D 64, T 3, 0, 1, 7 and
  300 rows, with bf16 parameters and with float32 masters under autocast;
- both exact routes again with TUNING's EXACT_ROW_DOUBLE 1 (exact_row_windows.cu and its fixup kernels), dy spread
  over 100 binades so that windows are refused and the fixups run; norm_out's with EXACT_CLOSE_STAGED 1 (its closes
  through the stages' shared memory: racecheck's) and EXACT_SORTED_MIN_T 1 (its sorted pass) too.
Every result is checked finite (and, for 0 rows, the parameter gradients exactly zero), so a workload that
computes garbage fails here too. Prints one line per part and "small calls done".
"""

import torch

from adaln_lab import final_adaln_out
from adaln_lab.core.launchers import tuned
from adaln_lab.harness.inputs import make, upstream

# the last two: norm_out's sorted backward (T >= 10) and table_bwd's narrower lanes (4 columns at T 12, 2 at T 32)
OP_SHAPES = (dict(H=264, D=64, T=3), dict(H=1024, D=256, T=1), dict(H=5376, D=2688, T=3),
             dict(H=1024, D=256, T=12), dict(H=264, D=64, T=32))
ROWS = (0, 1, 7, 300)


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


def spread(dy: torch.Tensor, on: bool) -> torch.Tensor:
    """dy, or (on) dy times 2^-k with k in [0, 100) per element (bf16: exact): columns whose terms span more
    binades than a float64 window holds, so that exact_row_windows.cu's checks refuse windows and its fixups run."""
    if not on:
        return dy
    g = torch.Generator(device="cuda").manual_seed(dy.numel())
    k = torch.randint(0, 100, dy.shape, device="cuda", generator=g)
    return dy * torch.exp2(-k.float()).to(dy.dtype)


def exact_calls(wide: bool = False) -> None:
    """norm_out's exact route: forward, backward (exact_row_pass.cu), write; every gradient finite (wide: dy
    `spread`)."""
    from adaln_lab.nn import ExactGradients

    for shape in (OP_SHAPES[0], OP_SHAPES[3]):
        for rows in ROWS:
            inputs = make(3, rows, "cuda", **shape)
            leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
            acc = ExactGradients()
            with acc:
                out = final_adaln_out(*leaves, inputs.timestep_indices, backend="cupy")
                out.backward(spread(upstream(1, out), wide))
            acc.write()
            _finite(*(leaf.grad for leaf in leaves))
    print("final_adaln_out, exact: done")


def other_table_tiles(table_fwd, temb, weight, bias, table) -> None:
    """table.cu on every other tile shape (64-row and 32-timestep tiles, tails in both): the same bits."""
    for tile in ((32, 4, 1, 2), (32, 2, 4, 3), (32, 1, 2, 4)):
        with tuned(TABLE_TILES=(tile,)):
            assert torch.equal(table_fwd(temb, weight, bias)[0], table), f"the tile {tile} changed the table"


class Calls:
    """The blocks' launch ops on route "cupy", each with its outputs allocated here as the ops' Functions do."""

    def __init__(self, R: int, H: int):
        from adaln_lab.ops.gated_residual import launch as residual
        from adaln_lab.ops.gated_residual_norm import launch as pair
        from adaln_lab.ops.modulated_rms_norm import launch as norm
        from adaln_lab.ops.modulation_table import launch as table

        self.R, self.H, self.table, self.norm, self.residual, self.pair = R, H, table, norm, residual, pair

    def table_fwd(self, temb, weight, bias):
        T, N = temb.shape[0], weight.shape[0]
        table = torch.empty(T, N, device="cuda")
        bf16 = torch.empty(self.table.bf16_elements(T, N, temb.shape[1]), dtype=torch.bfloat16, device="cuda")
        self.table.forward(temb, weight, bias, "cupy", "cuda", table, bf16)  # the row tables, then act's scratch
        return table, bf16[:12 * T * (N // 18)].view(2, 3 * T, 2 * (N // 18))

    def table_bwd(self, d_table, temb, weight):
        grads = (torch.empty_like(temb), torch.empty_like(weight), torch.empty(weight.shape[0], dtype=weight.dtype,
                                                                                 device="cuda"))
        self.table.backward(d_table, temb, weight, "cupy", *grads)
        return grads

    def norm_fwd(self, x, norm_weight, shift, scale, idx, row_tables=None):
        out, rstd = torch.empty_like(x), torch.empty(x.shape[0], device="cuda")
        self.norm.forward(x, norm_weight, shift, scale, idx, 1e-5, torch.bfloat16, "cupy", row_tables, 1, out, rstd)
        return out, rstd

    def norm_bwd(self, dy, x, norm_weight, shift, scale, idx, rstd, d_residual=None, d_table=None, column=0):
        d_table = torch.empty(self.R, 2 * self.H, device="cuda") if d_table is None else d_table
        dx, d_norm_weight = torch.empty_like(x), torch.empty_like(norm_weight)
        self.norm.backward(dy, x, norm_weight, shift, scale, idx, rstd, d_residual, None, "cupy", dx, d_norm_weight,
                           d_table, column, None)
        return dx, d_norm_weight, d_table[:, column:column + self.H], d_table[:, column + self.H:column + 2 * self.H]

    def residual_fwd(self, x, gate, y, idx):
        out = torch.empty_like(x)
        self.residual.forward(x, gate, y, idx, torch.bfloat16, "cupy", out)
        return out

    def residual_bwd(self, dout, gate, y, idx, d_table=None, column=0):
        d_table = torch.empty(self.R, self.H, device="cuda") if d_table is None else d_table
        d_y = torch.empty_like(y)
        self.residual.backward(dout, gate, y, idx, None, torch.bfloat16, "cupy", d_y, d_table, column, None)
        return d_table[:, column:column + self.H], d_y

    def pair_fwd(self, x, gate, y, idx, norm_weight, shift, scale, row_tables=None):
        x_out, out, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(x.shape[0], device="cuda")
        self.pair.forward(x, gate, y, idx, norm_weight, shift, scale, 1e-5, torch.bfloat16, "cupy", row_tables, x_out,
                          out, rstd)
        return x_out, out, rstd

    def pair_bwd(self, d_x_out, d_out, x_out, gate, y, idx, norm_weight, shift, scale, rstd, d_table=None, column=0):
        d_table = torch.empty(self.R, 3 * self.H, device="cuda") if d_table is None else d_table
        dx, d_y, d_norm_weight = torch.empty_like(x_out), torch.empty_like(y), torch.empty_like(norm_weight)
        self.pair.backward(d_x_out, d_out, x_out, gate, y, idx, norm_weight, shift, scale, rstd, None, torch.bfloat16,
                           "cupy", dx, d_y, d_norm_weight, d_table, column, None)
        H = self.H
        return (dx, d_table[:, column:column + H], d_y, d_norm_weight, d_table[:, column + H:column + 2 * H],
                d_table[:, column + 2 * H:column + 3 * H])


def block_calls() -> None:
    H, D, T = 264, 64, 3
    R = 3 * T
    calls = Calls(R, H)
    g = torch.Generator("cuda").manual_seed(0)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    temb = randn(T, D)
    weight, bias = randn(18 * H, D, scale=0.02, dtype=torch.bfloat16), randn(18 * H, scale=0.1, dtype=torch.bfloat16)
    table, row_tables = calls.table_fwd(temb, weight, bias)
    _finite(table, *calls.table_bwd(randn(T, 18 * H), temb, weight))
    other_table_tiles(calls.table_fwd, temb, weight, bias, table)
    rows6 = table.view(R, 6 * H)
    shift, scale, gate = rows6[:, 3 * H:4 * H], rows6[:, 4 * H:5 * H], rows6[:, 2 * H:3 * H]
    norm_weight = (1 + 0.1 * randn(H)).to(torch.bfloat16)
    # as a block calls them: the norms read the table kernel's row tables (norm2's: table 1), the backwards write into
    # one table gradient (core.table_gradient) at the chunks' columns, row stride 6H; the same bits as alone
    grad_table = torch.empty(R, 6 * H, device="cuda")

    def columns(chunk, count=1):
        return grad_table[:, chunk * H:(chunk + count) * H]
    for rows in ROWS:
        x, y, dy = (randn(rows, H, dtype=torch.bfloat16) for _ in range(3))
        idx = torch.randint(0, R, (rows,), device="cuda", generator=g)
        out, rstd = calls.norm_fwd(x, norm_weight, shift, scale, idx)
        grads = calls.norm_bwd(dy, x, norm_weight, shift, scale, idx, rstd)
        grads_res = calls.norm_bwd(dy, x, norm_weight, shift, scale, idx, rstd, d_residual=y)
        gated = calls.residual_fwd(x, gate, y, idx)
        d_gate, d_y = calls.residual_bwd(dy, gate, y, idx)
        x_out, out2, rstd2 = calls.pair_fwd(x, gate, y, idx, norm_weight, shift, scale)
        fused = calls.pair_bwd(y, dy, x_out, gate, y, idx, norm_weight, shift, scale, rstd2)
        _finite(out, rstd, *grads, *grads_res, gated, d_gate, d_y, x_out, out2, rstd2, *fused)
        read = calls.norm_fwd(x, norm_weight, shift, scale, idx, row_tables=row_tables)
        read_fused = calls.pair_fwd(x, gate, y, idx, norm_weight, shift, scale, row_tables=row_tables)
        assert all(torch.equal(a, b) for a, b in zip((*read, *read_fused), (out, rstd, x_out, out2, rstd2)))
        grad_table.fill_(float("nan"))
        written = calls.norm_bwd(dy, x, norm_weight, shift, scale, idx, rstd, d_table=grad_table, column=3 * H)
        assert torch.equal(written[0], grads[0]) and torch.equal(columns(3, 2), torch.cat(grads[2:], dim=1))
        assert torch.equal(calls.residual_bwd(dy, gate, y, idx, d_table=grad_table, column=2 * H)[1], d_y)
        assert torch.equal(columns(2), d_gate)
        grad_table.fill_(float("nan"))
        written = calls.pair_bwd(y, dy, x_out, gate, y, idx, norm_weight, shift, scale, rstd2, d_table=grad_table,
                                 column=2 * H)
        assert torch.equal(written[0], fused[0]) and torch.equal(columns(2, 3), torch.cat(
            (fused[1], fused[4], fused[5]), dim=1)), "the table gradient's columns differ from the gradients"
        if rows == 0:
            assert not any(t.any() for t in (*grads[1:], *grads_res[1:], d_gate, *fused[1:2], *fused[3:]))
    print("block kernels: done")


def block_exact_calls(wide: bool = False) -> None:
    """A block's exact route (backend "cupy", identity attn and ff), one part and write, with bf16 parameters and
    with float32 masters under autocast (write's d_weight and d_temb products of each weight dtype), and a temb that
    wants its gradient (d_temb's input passes); every gradient finite (wide: dy `spread`)."""
    from adaln_lab import block_adaln_path
    from adaln_lab.nn import ExactGradients

    H, D, T = 264, 64, 3
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        params = [torch.nn.Parameter((scale * torch.randn(shape, device="cuda", generator=g) + shift).to(dtype))
                  for shape, scale, shift in (((18 * H, D), 0.02, 0.0), ((18 * H,), 0.02, 0.0), ((H,), 0.1, 1.0),
                                              ((H,), 0.1, 1.0))]
        for rows in ROWS:
            x = torch.randn(1, rows, H, device="cuda", generator=g).bfloat16().requires_grad_(True)
            temb = torch.randn(T, D, device="cuda", generator=g).requires_grad_(True)
            idx = torch.randint(0, 3 * T, (rows,), device="cuda", generator=g)
            for p in params:
                p.grad = None
            acc = ExactGradients()
            with acc, torch.autocast("cuda", torch.bfloat16, enabled=dtype == torch.float32):
                out = block_adaln_path(x, temb, *params, idx, lambda h: h, lambda h: h, backend="cupy")
                out.backward(spread(upstream(1, out), wide))
            acc.write()
            _finite(x.grad, temb.grad, *(p.grad for p in params))
            assert rows or not any(bool(p.grad.any()) for p in params), "0 rows: nonzero parameter gradients"
    print("block kernels, exact: done")


if __name__ == "__main__":
    op_calls()
    exact_calls()
    block_calls()
    block_exact_calls()
    with tuned(EXACT_ROW_DOUBLE=1):  # exact_row_windows.cu's float64 windows and fixups, dy spread to refuse some
        exact_calls(wide=True)
        block_exact_calls(wide=True)
    for knobs in ({"EXACT_CLOSE_STAGED": 1}, {"EXACT_SORTED_MIN_T": 1}):  # norm_out's other passes (TUNING)
        with tuned(EXACT_ROW_DOUBLE=1, **knobs):
            exact_calls(wide=True)
    print("small calls done")
