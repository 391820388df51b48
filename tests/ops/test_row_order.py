"""Tests of `adaln_lab.row_order` (kernels_cu/row_order.cu: the rows in table-row order) and of the H3 blocks'
backward row passes that walk it (norm_modulate_bwd.cu's sorted passes, gated_residual.cu's backward). CPU: the
torch reference against a plain Python sort, the argument checks. GPU: the kernel against the reference, and the
passes over a batch of several sequences, an index outside the table and a table row without rows, against
float64 and row by row against one sequence; one order shared by a block's ops gives each op's own bits. The
passes run through the ops' launch bodies on route "cupy" (tests/core/test_tensors.py's helpers)."""

import pytest
import torch

from adaln_lab import gated_residual, gated_residual_norm, row_order
from adaln_lab.core.plan import T_MAX, supported
from adaln_lab.ops.modulated_rms_norm import modulated_rms_norm_and_residual
from adaln_lab.ops.row_order import order_torch
from adaln_lab.ops.row_order.op import launch as row_order_launch

from ..core.test_tensors import gr_bwd, norm_bwd, norm_fwd

gpu = pytest.mark.gpu
H = 1024


def kernel_order(row_index: torch.Tensor, T: int) -> torch.Tensor:
    """The row_order launch op on an order allocated here: row_order.cu on CUDA tensors of a width and table the
    plan takes (checked, so that the kernel, not the torch fallback, is what runs)."""
    assert row_index.is_cuda and supported(H, 8, max(T, 1))
    order = torch.empty(T + 1 + row_index.shape[0], dtype=torch.int32, device=row_index.device)
    row_order_launch(row_index, T, H, order)
    return order


def expected_order(row_index: torch.Tensor, T: int) -> torch.Tensor:
    """row_offsets | order by the definition, in Python: positions by (table row, position), invalid -> row 0."""
    key = [i if 0 <= i < T else 0 for i in row_index.tolist()]
    offsets = [sum(k < t for k in key) for t in range(T + 1)]
    return torch.tensor(offsets + sorted(range(len(key)), key=lambda s: (key[s], s)), dtype=torch.int32)


@pytest.mark.parametrize("S, T", [(0, 3), (1, 1), (50, 4), (300, 9)])
def test_the_torch_order_is_the_definition(S, T):
    g = torch.Generator().manual_seed(S)
    row_index = torch.randint(-1, T + 1, (S,), generator=g)
    assert torch.equal(order_torch(row_index, T), expected_order(row_index, T))
    assert torch.equal(row_order(row_index, T, H), expected_order(row_index, T))  # the op's CPU kernel


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_custom_ops_pass_opcheck_with_an_order(device):
    """The row_order launch op, and the launch ops of an op taking an order (the gated residual's: its backward
    takes it; the route the device runs, the kernels on CUDA), their no-op fakes and autograd registration; and
    the op's autograd node given the order gives the gradients it gives sorting on its own."""
    from adaln_lab.ops.gated_residual import launch

    route = "cupy" if device == "cuda" else "torch"
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 3, (37,), generator=g).to(device)
    torch.library.opcheck(row_order_launch.op, (idx, 3, 16, torch.empty(3 + 1 + 37, dtype=torch.int32,
                                                                         device=device)))
    order = row_order(idx, 3, 16)
    x, y, dout = (torch.randn(37, 16, generator=g).bfloat16().to(device) for _ in range(3))
    gate = torch.randn(3, 16, generator=g).bfloat16().float().to(device)
    torch.library.opcheck(launch.forward.op, (x.requires_grad_(True), gate.requires_grad_(True), y, idx,
                                              torch.bfloat16, route, torch.empty_like(x)))
    d_table = torch.empty(3, 16, dtype=torch.float32, device=device)
    torch.library.opcheck(launch.backward.op, (dout, gate.detach(), y, idx, order, torch.bfloat16, route,
                                               torch.empty_like(y), d_table, 0, None))
    grads = []
    for given in (None, order):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate, y)]
        gated_residual(*leaves[:2], leaves[2], idx, row_order=given).backward(dout)
        grads.append([leaf.grad for leaf in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_row_order_and_the_ops_refuse_a_wrong_order():
    x = torch.randn(5, 16).bfloat16()
    table = torch.zeros(3, 16)
    idx = torch.tensor([0, 2, 1, 1, 0])
    with pytest.raises(ValueError, match="row_order needs row_index of shape"):
        row_order(idx.int(), 3, 16)
    with pytest.raises(ValueError, match=r"needs row_order = adaln_lab.row_order\(row_index, 3, H\): \(9,\) int32"):
        gated_residual(x, table, x, idx, row_order=torch.zeros(8, dtype=torch.int32))
    assert gated_residual(x, table, x, idx, row_order=row_order(idx, 3, 16)).shape == x.shape


@gpu
@pytest.mark.parametrize("S, T", [(0, 9), (1, 9), (37, 1), (4097, 9), (65536, 9), (70001, 9), (5000, T_MAX)])
def test_row_order_kernel_is_the_torch_order(S, T):
    g = torch.Generator("cuda").manual_seed(S + T)
    row_index = torch.randint(0, T, (S,), device="cuda", generator=g)
    if S > 10:
        row_index[3], row_index[7] = T + 5, -2  # outside the table: sorted with table row 0
        if T > 1:
            row_index[row_index == T - 1] = 0  # a table row without rows
    order = kernel_order(row_index, T)
    assert torch.equal(order, order_torch(row_index, T))
    assert torch.equal(kernel_order(row_index, T), order)
    assert torch.equal(row_order(row_index, T, H), order)  # the op's CUDA kernel


@gpu
@pytest.mark.parametrize("S, T", [(0, 33), (1, 64), (1023, 64), (1025, 40), (8192, 1024), (70001, 257),
                                  (1 << 20, 3072), ((1 << 20) + 4097, 96)])
def test_many_table_rows_take_the_wide_kernels_and_the_same_order(monkeypatch, S, T):
    """More than 32 table rows (plan.row_order_wide): row_order.cu's count, scan and scatter over chunks of
    positions give the torch order (stable): one chunk or many, a chunk of its own past 2^20 positions (chunks
    longer than 1024), table rows without rows, indices outside the table. The T the plan takes is raised here
    alone (plan.T_MAX is the T the whole suite covers)."""
    from adaln_lab.core import launchers, plan as plan_module

    monkeypatch.setattr(plan_module, "T_MAX", 4096)
    try:
        assert plan_module.plan(H, 8, T).row_order_wide and not plan_module.plan(H, 8, 32).row_order_wide
        g = torch.Generator("cuda").manual_seed(S + T)
        row_index = torch.randint(0, T, (S,), device="cuda", generator=g)
        if S > 10:
            row_index[3], row_index[7] = T + 5, -2  # outside the table: sorted with table row 0
            row_index[row_index == T - 1] = 0  # a table row without rows
        order = kernel_order(row_index, T)
        assert torch.equal(order, order_torch(row_index, T))
        assert torch.equal(kernel_order(row_index, T), order)
    finally:
        launchers.forget_compiled()  # the plans made past T_MAX


@gpu
def test_the_order_check_catches_an_unstable_order():
    """The comparison above tells a stable order from an unstable one: an order with two positions of one table
    row swapped (planted) is a valid sort by table row, yet differs from the reference."""
    row_index = torch.tensor([2, 0, 2, 1, 0], device="cuda")
    order = kernel_order(row_index, 3)
    planted = order.clone()
    planted[4:6] = planted[4:6].flip(0)  # the two positions of table row 0, swapped
    assert torch.equal(order, order_torch(row_index, 3)) and not torch.equal(planted, order_torch(row_index, 3))


def _batch(B, S, R, seed=3):
    g = torch.Generator("cuda").manual_seed(seed)
    x, y, dy, d_res = (torch.randn(B, S, H, device="cuda", generator=g).bfloat16() for _ in range(4))
    idx = torch.randint(0, R - 1, (S,), device="cuda", generator=g)  # table row R - 1 gets no rows
    table = torch.randn(R, 6 * H, device="cuda", generator=g).bfloat16().float() * 0.3
    nw = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    return x, y, dy, d_res, idx, table, nw


@gpu
@pytest.mark.parametrize("B, S", [(2, 700), (3, 1365)])
def test_sorted_passes_over_several_sequences(B, S):
    """x (B, S, H) with row_index (S,): the rows run through the passes in table-row order across the B
    sequences; d_shift, d_scale, d_norm_weight and d_gate agree with float64, every row's dx and d_y with the
    same row's in a call on its sequence alone, and a table row without rows gets exactly zero gradients."""
    R = 9
    x, y, dy, d_res, idx, table, nw = _batch(B, S, R)
    shift, scale, gate = table[:, :H], table[:, H:2 * H], table[:, 2 * H:3 * H]
    out, rstd = norm_fwd(x, nw, shift, scale, idx, 1e-5)
    dx, d_nw, d_shift, d_scale = norm_bwd(dy, x, nw, shift, scale, idx, rstd, d_residual=d_res)
    d_gate, d_y = gr_bwd(dy, gate, y, idx)
    for b in range(B):
        _, rstd_b = norm_fwd(x[b], nw, shift, scale, idx, 1e-5)
        dx_b = norm_bwd(dy[b], x[b], nw, shift, scale, idx, rstd_b, d_residual=d_res[b])[0]
        assert torch.equal(dx_b, dx[b])
        assert torch.equal(gr_bwd(dy[b], gate, y[b], idx)[1], d_y[b])
    assert not d_shift[R - 1].any() and not d_scale[R - 1].any() and not d_gate[R - 1].any()
    x64, nw64 = x.double().requires_grad_(True), nw.double().requires_grad_(True)
    sh64, sc64 = shift.double().requires_grad_(True), scale.double().requires_grad_(True)
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * nw64
    (normed * (1 + sc64[idx]) + sh64[idx]).backward(dy.double())
    assert torch.allclose(dx.double(), (x64.grad + d_res.double()), rtol=2 ** -7, atol=2e-2)
    assert torch.allclose(d_shift.double(), sh64.grad, rtol=1e-5, atol=1e-4)
    assert torch.allclose(d_scale.double(), sc64.grad, rtol=1e-5, atol=1e-4)
    assert torch.allclose(d_nw.double(), nw64.grad, rtol=2 ** -7, atol=1e-2)
    exact = torch.zeros(R, H, dtype=torch.float64, device="cuda").index_add_(
        0, idx.repeat(B), (dy.double() * y.double()).reshape(-1, H))
    assert torch.allclose(d_gate.double(), exact, rtol=1e-5, atol=1e-5)


@gpu
def test_sorted_passes_poison_only_through_table_row_0():
    """An index outside [0, R) sorts with table row 0: its row's dx and d_y are NaN and so are table row 0's
    d_shift, d_scale and d_gate; the other table rows' gradients stay finite."""
    R = 9
    x, y, dy, d_res, idx, table, nw = _batch(1, 300, R)
    idx = idx.clone()
    idx[11] = R + 4
    shift, scale, gate = table[:, :H], table[:, H:2 * H], table[:, 2 * H:3 * H]
    out, rstd = norm_fwd(x, nw, shift, scale, idx, 1e-5)
    dx, d_nw, d_shift, d_scale = norm_bwd(dy, x, nw, shift, scale, idx, rstd)
    d_gate, d_y = gr_bwd(dy, gate, y, idx)
    assert dx[0, 11].isnan().all() and d_y[0, 11].isnan().all() and not dx[0, 10].isnan().any()
    for grad in (d_shift, d_scale, d_gate):
        assert grad[0].isnan().all() and not grad[1:].isnan().any()


@gpu
def test_one_order_for_the_blocks_ops_gives_each_ops_own_bits():
    """The three ops of a block given one row_order (as block_adaln_path does) or sorting in their own
    backward: the same gradients, bit for bit; a wrong order (planted: the positions shifted by one) changes
    them, so the comparison can fail: x's gradient has NaN rows (rows whose index is not their position's
    table row) and the table's gradient NaN rows, the same on every run."""
    R = 9
    x, y, dy, _, idx, table, nw = _batch(1, 1000, R)
    x = x[0]
    table = table.requires_grad_(True)
    shift, scale, gate = table[:, :H], table[:, H:2 * H], table[:, 2 * H:3 * H]

    def grads(order):
        xr = x.clone().requires_grad_(True)
        h, x1 = modulated_rms_norm_and_residual(xr, nw, shift, scale, idx, 1e-5, row_order=order)
        x2, h2 = gated_residual_norm(x1, gate, h * 0.5, nw, shift, scale, idx, 1e-5, row_order=order)
        out = gated_residual(x2, gate, h2, idx, row_order=order)
        return torch.autograd.grad(out, (xr, table), dy[0])

    own, shared = grads(None), grads(row_order(idx, R, H))
    assert all(torch.equal(a, b) for a, b in zip(own, shared))
    wrong = row_order(idx, R, H)
    wrong[R + 1:] = wrong[R + 1:].roll(1)
    assert not all(torch.equal(a, b) for a, b in zip(own, grads(wrong)))
    poisoned, again = grads(wrong), grads(wrong)
    assert poisoned[0].isnan().any() and poisoned[1].isnan().any()
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
               for a, b in zip(poisoned, again))


@gpu
def test_sorted_passes_with_ranges_across_many_table_rows():
    """Table rows of one row each (R = 30, 4097 rows: 32 rows per range), so one range spans many table rows
    and writes a slot for each: d_shift, d_scale, d_norm_weight and d_gate still agree with float64."""
    R = 30
    x, y, dy, d_res, _, table, nw = _batch(1, 4097, R)
    idx = torch.full((4097,), R - 1, device="cuda")
    idx[torch.randperm(4097, device="cuda")[:R - 2]] = torch.arange(R - 2, device="cuda")  # rows 0..27: one each
    shift, scale, gate = table[:, :H], table[:, H:2 * H], table[:, 2 * H:3 * H]
    out, rstd = norm_fwd(x, nw, shift, scale, idx, 1e-5)
    dx, d_nw, d_shift, d_scale = norm_bwd(dy, x, nw, shift, scale, idx, rstd)
    d_gate, _ = gr_bwd(dy, gate, y, idx)
    x64, nw64 = x.double().requires_grad_(True), nw.double().requires_grad_(True)
    sh64, sc64 = shift.double().requires_grad_(True), scale.double().requires_grad_(True)
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * nw64
    (normed * (1 + sc64[idx]) + sh64[idx]).backward(dy.double())
    assert torch.allclose(d_shift.double(), sh64.grad, rtol=1e-5, atol=1e-4)
    assert torch.allclose(d_scale.double(), sc64.grad, rtol=1e-5, atol=1e-4)
    assert torch.allclose(d_nw.double(), nw64.grad, rtol=2 ** -7, atol=1e-2)
    exact = torch.zeros(R, H, dtype=torch.float64, device="cuda").index_add_(
        0, idx, (dy.double() * y.double()).reshape(-1, H))
    assert torch.allclose(d_gate.double(), exact, rtol=1e-5, atol=1e-5)
