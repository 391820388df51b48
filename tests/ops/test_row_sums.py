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
