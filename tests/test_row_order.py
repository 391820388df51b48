"""GPU tests of kernels_cu/row_order.cu (the rows in table-row order) and of the H3 blocks' backward row passes
that walk it (norm_modulate_bwd.cu's sorted passes, gated_residual.cu's backward): the order against torch's
stable argsort, and the passes over a batch of several sequences, an index outside the table and a table row
without rows, against float64 and row by row against one sequence."""

import pytest
import torch

from adaln_lab import block_cuda
from adaln_lab.plan import T_MAX
from adaln_lab.plan import plan as make_plan

pytestmark = pytest.mark.gpu
H = 1024


def expected_order(row_index: torch.Tensor, T: int) -> torch.Tensor:
    """row_offsets | order as row_order.cu defines it, from torch: an index outside [0, T) sorts with row 0."""
    key = torch.where((row_index >= 0) & (row_index < T), row_index, 0)
    counts = torch.bincount(key, minlength=T)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return torch.cat([offsets, torch.argsort(key, stable=True)]).int()


@pytest.mark.parametrize("S, T", [(0, 9), (1, 9), (37, 1), (4097, 9), (70001, 9), (5000, T_MAX)])
def test_row_order_is_torchs_stable_sort_by_table_row(S, T):
    g = torch.Generator("cuda").manual_seed(S + T)
    row_index = torch.randint(0, T, (S,), device="cuda", generator=g)
    if S > 10:
        row_index[3], row_index[7] = T + 5, -2  # outside the table: sorted with table row 0
        if T > 1:
            row_index[row_index == T - 1] = 0  # a table row without rows
    order = block_cuda.row_order(row_index, make_plan(H, 8, T))
    assert torch.equal(order, expected_order(row_index, T))
    assert torch.equal(block_cuda.row_order(row_index, make_plan(H, 8, T)), order)


def test_the_order_check_catches_an_unstable_order():
    """The comparison above fails on an order that swaps two positions of one table row (planted)."""
    row_index = torch.tensor([2, 0, 2, 1, 0], device="cuda")
    order = block_cuda.row_order(row_index, make_plan(H, 8, 3))
    planted = order.clone()
    planted[4:6] = planted[4:6].flip(0)  # the two positions of table row 0, swapped
    assert torch.equal(order, expected_order(row_index, 3)) and not torch.equal(planted, expected_order(row_index, 3))


def _batch(B, S, R, seed=3):
    g = torch.Generator("cuda").manual_seed(seed)
    x, y, dy, d_res = (torch.randn(B, S, H, device="cuda", generator=g).bfloat16() for _ in range(4))
    idx = torch.randint(0, R - 1, (S,), device="cuda", generator=g)  # table row R - 1 gets no rows
    table = torch.randn(R, 6 * H, device="cuda", generator=g).bfloat16().float() * 0.3
    nw = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    return x, y, dy, d_res, idx, table, nw


@pytest.mark.parametrize("B, S", [(2, 700), (3, 1365)])
def test_sorted_passes_over_several_sequences(B, S):
    """x (B, S, H) with row_index (S,): the rows run through the passes in table-row order across the B
    sequences; d_shift, d_scale, d_norm_weight and d_gate agree with float64, every row's dx and d_y with the
    same row's in a call on its sequence alone, and a table row without rows gets exactly zero gradients."""
    R = 9
    x, y, dy, d_res, idx, table, nw = _batch(B, S, R)
    shift, scale, gate = table[:, :H], table[:, H:2 * H], table[:, 2 * H:3 * H]
    out, rstd = block_cuda.modulated_rms_norm_fwd(x, nw, shift, scale, idx, 1e-5)
    dx, d_nw, d_shift, d_scale = block_cuda.modulated_rms_norm_bwd(dy, x, nw, shift, scale, idx, rstd, d_residual=d_res)
    d_gate, d_y = block_cuda.gated_residual_bwd(dy, gate, y, idx)
    for b in range(B):
        _, rstd_b = block_cuda.modulated_rms_norm_fwd(x[b], nw, shift, scale, idx, 1e-5)
        dx_b = block_cuda.modulated_rms_norm_bwd(dy[b], x[b], nw, shift, scale, idx, rstd_b, d_residual=d_res[b])[0]
        assert torch.equal(dx_b, dx[b])
        assert torch.equal(block_cuda.gated_residual_bwd(dy[b], gate, y[b], idx)[1], d_y[b])
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


def test_sorted_passes_poison_only_through_table_row_0():
    """An index outside [0, R) sorts with table row 0: its row's dx and d_y are NaN and so are table row 0's
    d_shift, d_scale and d_gate; the other table rows' gradients stay finite."""
    R = 9
    x, y, dy, d_res, idx, table, nw = _batch(1, 300, R)
    idx = idx.clone()
    idx[11] = R + 4
    shift, scale, gate = table[:, :H], table[:, H:2 * H], table[:, 2 * H:3 * H]
    out, rstd = block_cuda.modulated_rms_norm_fwd(x, nw, shift, scale, idx, 1e-5)
    dx, d_nw, d_shift, d_scale = block_cuda.modulated_rms_norm_bwd(dy, x, nw, shift, scale, idx, rstd)
    d_gate, d_y = block_cuda.gated_residual_bwd(dy, gate, y, idx)
    assert dx[0, 11].isnan().all() and d_y[0, 11].isnan().all() and not dx[0, 10].isnan().any()
    for grad in (d_shift, d_scale, d_gate):
        assert grad[0].isnan().all() and not grad[1:].isnan().any()
