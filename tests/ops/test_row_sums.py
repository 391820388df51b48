"""The per-table-row exact sums of the row ops (ops/row_sums.py): on the CPU each state the exact (Fraction) sum of
its float32 terms; on the GPU exact_sums.cu's states equal the torch code's limb for limb on a block's table rows
(R = 3T, the gate form with rstd 1 too), for any order of the rows, and its flags raise."""

from fractions import Fraction

import pytest
import torch

from adaln_lab.core.exact import E_MIN
from adaln_lab.ops.row_sums import half, raise_flags, row_sums, torch_terms

B, S, H, R = 3, 41, 24, 6  # 123 rows: chunks that end inside a group of EXACT_AHEAD rows


def case(seed: int, device="cpu"):
    """x, dy (B, S, H) bf16 over wide binades, rstd (rows,) float32, row_index (S,) in [0, R)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-8, 8, (B, S, 1), generator=g))).bfloat16()
    dy = (torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-30, 6, (B, S, H), generator=g))).bfloat16()
    rstd = torch.rand(B * S, generator=g) * 4 + 0.25
    idx = torch.randint(0, R, (S,), generator=g)
    return tuple(t.to(device) for t in (x, dy, rstd, idx))


def exact_sums(x, dy, rstd, idx) -> list[list[Fraction]]:
    """[r][column] the exact sums of torch_terms over the rows of table row r (Python fractions)."""
    terms, rows = torch_terms(x, dy, rstd).tolist(), idx.repeat(B).tolist()
    sums = [[Fraction(0)] * (2 * H) for _ in range(R)]
    for r, row in zip(rows, terms):
        sums[r] = [a + Fraction(v) for a, v in zip(sums[r], row)]
    return sums


def as_fractions(state) -> list[list[Fraction]]:
    limbs = state.limbs.cpu().tolist()
    return [[Fraction(sum(limbs[k][r][c] << (32 * k) for k in range(len(limbs))), 2 ** -E_MIN)
             for c in range(2 * H)] for r in range(R)]


@pytest.mark.parametrize("gate", [False, True])
def test_the_torch_states_are_the_exact_sums_of_the_terms(gate):
    x, dy, rstd, idx = case(0)
    rstd = None if gate else rstd
    state, flags = row_sums(x, dy, rstd, idx, R, kernels=False)
    assert flags is None and state.shape == (R, 2 * H)
    assert as_fractions(state) == exact_sums(x, dy, rstd, idx)
    assert half(state, 0).shape == half(state, 1).shape == (R, H)


def test_a_planted_float32_sum_differs_from_the_exact_state():
    x, dy, rstd, idx = case(1)
    terms = torch_terms(x, dy, rstd)
    planted = torch.zeros(R, 2 * H).index_add_(0, idx.repeat(B), terms)  # float32 accumulation
    exact = row_sums(x, dy, rstd, idx, R, kernels=False)[0].value(torch.float32)
    assert not torch.equal(planted, exact)


def test_the_torch_code_refuses_a_non_finite_term():
    x, dy, rstd, idx = case(2)
    dy[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        row_sums(x, dy, rstd, idx, R, kernels=False)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gate", [False, True])
def test_the_kernels_states_equal_the_torch_codes_in_any_row_order(seed, gate):
    x, dy, rstd, idx = case(seed, "cuda")
    rstd = None if gate else rstd
    want = row_sums(x, dy, rstd, idx, R, kernels=False)[0].limbs
    state, flags = row_sums(x, dy, rstd, idx, R, kernels=True)
    raise_flags(flags, "test")
    assert torch.equal(state.limbs, want)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(seed), device="cpu").cuda()
    moved = row_sums(x[:, perm], dy[:, perm], None if gate else rstd.view(B, S)[:, perm].reshape(-1), idx[perm], R,
                     kernels=True)[0]
    assert torch.equal(moved.limbs, want)


@pytest.mark.gpu
def test_the_kernels_flag_a_non_finite_term_and_an_index_outside_the_table():
    x, dy, rstd, idx = case(3, "cuda")
    bad = dy.clone()
    bad[1, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        raise_flags(row_sums(x, bad, rstd, idx, R, kernels=True)[1], "test")
    far = idx.clone()
    far[4] = R
    with pytest.raises(IndexError, match="outside"):
        raise_flags(row_sums(x, dy, rstd, far, R, kernels=True)[1], "test")


@pytest.mark.gpu
def test_the_kernels_refuse_other_dtypes_by_name():
    x, dy, rstd, idx = case(4, "cuda")
    with pytest.raises(ValueError, match="bf16 x and dy"):
        row_sums(x.float(), dy, rstd, idx, R, kernels=True, op="test")


def long_case(H: int, R: int = 6, S: int = 20000, seed: int = 5):
    """One sequence of S rows (ranges of 128+ rows, crossing table rows; windows past 127 rows) on CUDA: x, dy,
    d_residual (1, S, H) bf16, rstd (S,), row_index (S,), norm_weight (H,) bf16, a table (R, 2H) of bf16 values and a
    gate (R, H)."""
    g = torch.Generator().manual_seed(seed)
    x, dy, res = (torch.randn(1, S, H, generator=g).bfloat16() for _ in range(3))
    rstd = torch.rand(S, generator=g) + 0.5
    idx = torch.randint(0, R, (S,), generator=g)
    weight = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    table = (0.2 * torch.randn(R, 3 * H, generator=g)).bfloat16().float()
    return tuple(t.cuda() for t in (x, dy, res, rstd, idx, weight, table))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 2056])  # 2056: two column tiles of the gate's pass, the second one vector wide
def test_the_ops_passes_with_exact_sums_give_the_torch_codes_states_and_the_plain_dx(H):
    """modulated_rms_norm.launch.backward_exact (with and without a residual gradient) and
    gated_residual.launch.backward_exact on ranges that cross table rows and windows past 127 rows: their states are
    the torch code's limb for limb, their dx and d_y the plain passes' bit for bit, no flag."""
    from adaln_lab.ops.gated_residual import launch as gate_launch
    from adaln_lab.ops.modulated_rms_norm import launch as norm_launch

    x, dy, res, rstd, idx, weight, table = long_case(H)
    R = table.shape[0]
    shift, scale, gate = table[:, :H], table[:, H:2 * H], table[:, 2 * H:]
    want = row_sums(x, dy, rstd, idx, R, kernels=False)[0].limbs
    for d_residual in (None, res):
        dx, plain_dx = torch.empty_like(x), torch.empty_like(x)
        state, flags = norm_launch.backward_exact(dy, x, weight, shift, scale, idx, rstd, d_residual, None, dx)
        norm_launch.backward(dy, x, weight, shift, scale, idx, rstd, d_residual, None, "cupy", plain_dx,
                             torch.empty_like(weight), torch.empty(R, 2 * H, device="cuda"), 0, None)
        assert int(flags) == 0 and torch.equal(state.limbs, want) and torch.equal(dx, plain_dx)
    d_y, plain_d_y = torch.empty_like(x), torch.empty_like(x)
    state, flags = gate_launch.backward_exact(dy, gate, x, idx, None, d_y)
    gate_launch.backward(dy, gate, x, idx, None, torch.bfloat16, "cupy", plain_d_y, torch.empty(R, H, device="cuda"),
                         0, None)
    assert int(flags) == 0 and torch.equal(d_y, plain_d_y)
    assert torch.equal(state.limbs, half(row_sums(x, dy, None, idx, R, kernels=False)[0], 1).limbs)


@pytest.mark.gpu
def test_the_ops_passes_with_exact_sums_flag_a_non_finite_term_and_a_row_outside_the_table():
    from adaln_lab.ops.gated_residual import launch as gate_launch
    from adaln_lab.ops.modulated_rms_norm import launch as norm_launch

    x, dy, res, rstd, idx, weight, table = long_case(16, S=600)
    R, H = table.shape[0], 16
    bad, far = dy.clone(), idx.clone()
    bad[0, 7, 3] = float("nan")
    far[11] = R
    for dout, rows, bit in ((bad, idx, 1), (dy, far, 2)):
        _, flags = norm_launch.backward_exact(dout, x, weight, table[:, :H], table[:, H:2 * H], rows, rstd, None,
                                              None, torch.empty_like(x))
        assert int(flags) & bit
        _, flags = gate_launch.backward_exact(dout, table[:, 2 * H:], x, rows, None, torch.empty_like(x))
        assert int(flags) & bit
