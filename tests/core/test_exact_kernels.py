"""core.exact_kernels (kernels_cu/exact_state.cu) against core/exact.py's torch code and its Python-integer reference:
the same limbs for carries and products, the same values (compared as integers: -0 is not +0) for roundings, on
integers of every kind (zero, ties and near ties at the rounding bit in every limb, subnormal, normal, inf, negative,
states of sums and of products); TableSums' write with the kernels against the torch code on the same states."""

from __future__ import annotations

import random

import pytest
import torch

from adaln_lab.core import exact
from adaln_lab.core.exact import E_MIN, LIMB_BITS, LIMBS, ExactSum, round_scaled, rounded

from .test_exact import as_limbs

pytestmark = pytest.mark.gpu


def integers(seed: int, bits: int, count: int = 4000) -> list[int]:
    """Signed integers below 2^bits: edges, random lengths, the bits below a random cut set to a tie or one off, and
    near ties at bfloat16's and float32's rounding bits."""
    rng = random.Random(seed)
    ns = [0, 1, -1, 2 ** 23, 2 ** 24 - 1, 2 ** 24 + 1, 2 ** 25 + 3, 2 ** 148, 2 ** 148 + 1, 3 * 2 ** 148, 2 ** 149,
          -(2 ** 40 + 2 ** 16), 2 ** (bits - 2), -(2 ** (bits - 2))]
    for _ in range(count):
        n = rng.getrandbits(rng.randint(1, bits - 1))
        if rng.random() < 0.4:
            cut = rng.randint(1, max(1, n.bit_length() - 1))
            n = (n >> cut << cut) | rng.choice([0, 1 << (cut - 1), (1 << (cut - 1)) - 1, (1 << (cut - 1)) + 1])
        ns.append(-n if rng.random() < 0.5 else n)
    for p in (8, 24):  # just below a tie at p bits, every lower bit set: a rounding through float64 makes it a tie
        for length in rng.sample(range(p + 60, bits), 20):
            ns.append(((rng.getrandbits(p - 1) | 1 << (p - 1)) << (length - p)) | ((1 << (length - p - 1)) - 1))
    return ns


def unit():
    from adaln_lab.core import tensors
    from adaln_lab.core.exact_kernels import ExactKernels

    return ExactKernels(tensors.context(0, 64, 8, 9, 1)[2], 0)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (floats compared as their integers)."""
    if a.dtype.is_floating_point:
        bits = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
        a, b = a.view(bits), b.view(bits)
    return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def test_carries_give_the_torch_codes_limbs():
    """Uncarried limbs (each below 2^61 in magnitude, as merges leave them), 10 and 20 of them, in place, also
    through a strided view."""
    g = torch.Generator().manual_seed(1)
    kernels = unit()
    for count in (LIMBS, 2 * LIMBS):
        raw = torch.randint(-(2 ** 61), 2 ** 61, (count, 3, 777), generator=g).cuda()
        want = ExactSum.from_limbs(raw.clone(), kernels=None)._carry().limbs
        got = ExactSum.from_limbs(raw.clone(), kernels=kernels)._carry().limbs
        assert same(got, want)
        view = raw.clone()[:, :, 100:400]  # not contiguous: carried in place through a copy
        state = ExactSum.from_limbs(view, kernels=kernels)._carry()
        assert state.limbs.data_ptr() == view.data_ptr() and same(view, want[:, :, 100:400].contiguous())


@pytest.mark.parametrize("count, e_min", [(LIMBS, E_MIN), (2 * LIMBS, 2 * E_MIN)])
def test_roundings_are_round_scaled(count, e_min):
    """exact_round against the Python-integer `round_scaled` and the torch `rounded`, for float32's 24 and
    bfloat16's 8 bits; a planted rounding through float64 and float32 (two or three times) differs on these
    integers."""
    ns = integers(count, LIMB_BITS * count - 10)
    limbs = as_limbs(ns, count).cuda()
    kernels = unit()
    for precision in (24, 8):
        want = torch.tensor([round_scaled(n, e_min, precision) for n in ns], dtype=torch.float64)
        got = kernels.rounded(limbs, precision, e_min)
        assert same(got, want) and same(got, rounded(limbs, precision, e_min))
        dtype = torch.float32 if precision == 24 else torch.bfloat16
        planted = torch.tensor([float(n) * 2.0 ** e_min for n in ns], dtype=torch.float64).float().to(dtype)
        assert not same(planted.double(), want)
    subnormal = (want.abs() < 2.0 ** -126) & (want != 0)
    assert bool(want.isinf().any()) and bool((want == 0).any()) and bool(subnormal.any())


def test_products_give_the_torch_codes_limbs_and_values():
    """exact_products against core.exact.products' torch code: states of every size and sign times float32 factors
    of every kind (zero, -0, subnormal, FLT_MIN, huge, negative), the same 2 LIMBS limbs, and their roundings."""
    ns = integers(7, 300, 3000)
    rng = random.Random(8)
    specials = [0.0, -0.0, 2.0 ** -149, -(2.0 ** -149), 3 * 2.0 ** -140, 2.0 ** -126, -(2.0 ** 127), 1.0, -1.5]
    factors = [rng.choice(specials) if rng.random() < 0.3 else rng.uniform(-1, 1) * 2.0 ** rng.randint(-149, 127)
               for _ in ns]
    factors = torch.tensor(factors, dtype=torch.float32).cuda()
    limbs = as_limbs(ns, LIMBS).cuda()
    plain = exact.products(ExactSum.from_limbs(limbs), factors)
    fast = exact.products(ExactSum.from_limbs(limbs, kernels=unit()), factors)
    assert fast.kernels is not None and fast.e_min == plain.e_min == 2 * E_MIN
    assert same(fast.limbs, plain.limbs)
    for dtype in (torch.float32, torch.bfloat16):
        assert same(fast.value(dtype), plain.value(dtype))


def test_table_sums_write_the_torch_codes_bits_with_the_kernels():
    """A TableSums of two parts (three temb rows, one in both) on the GPU, its states with and without the kernels
    (their adds' carries too): the same rows, d_temb, d_weight, d_bias and norm weight sums, bit for bit."""
    from adaln_lab.ops.modulation_table.exact import TableSums

    g = torch.Generator().manual_seed(3)
    T, N, D = 3, 96, 16
    temb = torch.randn(T, D, generator=g).cuda()
    weight = (torch.randn(N, D, generator=g) * 0.02).bfloat16().cuda()
    factors = torch.randn(N, generator=g) * 4
    scale = torch.randn(T, N // 2, generator=g).cuda()
    parts = [(slice(0, 2), torch.randn(500, N, generator=g) * 2.0 ** -10),
             (slice(1, 3), torch.randn(700, N, generator=g) * 2.0 ** 10)]

    def sums(kernels):
        out = TableSums()
        for rows, terms in parts:
            n = rows.stop - rows.start
            index = torch.arange(terms.shape[0]).cuda() % n
            state = ExactSum((n, N), "cuda", kernels).add(terms.cuda(), index)
            out.add(temb[rows], state, scale[rows], factors)
        return out

    plain, fast = sums(None), sums(unit())
    assert fast.kernels and not plain.kernels
    for a, b in zip(plain.gradients(weight, torch.bfloat16), fast.gradients(weight, torch.bfloat16)):
        assert same(b, a)
    for a, b in zip(plain.norm_weight_sums([slice(N // 2, N)]), fast.norm_weight_sums([slice(N // 2, N)])):
        assert same(b.limbs, a.limbs) and same(b.value(torch.bfloat16), a.value(torch.bfloat16))
