"""adaln_lab.core.exact: the exact sum of float32 terms, rounded once, against Python's exact fractions and an
independent nearest-even choice between float neighbours; the same bits for every order, split and merge order; a
planted float32 accumulation fails the same check; non-finite terms and overfull adds refused."""

import math
import random
from fractions import Fraction

import pytest
import torch

from adaln_lab.core import exact
from adaln_lab.core.exact import E_MIN, LIMB_BITS, LIMBS, ExactSum, round_scaled, rounded


def terms(n: int, cols: int, seed: int) -> torch.Tensor:
    """float32 terms spread over the whole exponent range (subnormals, huge values, exact cancellations)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, cols, generator=g)
    scale = torch.randint(-140, 100, (n, cols), generator=g).float()
    t = (base * torch.exp2(scale)).float()
    t[: n // 4] = torch.randn(n // 4, cols, generator=g)  # ordinary magnitudes
    t[n // 4: n // 4 + 2] = torch.tensor(2.0 ** -149)      # the least subnormal
    t[-2:] = -t[:2]                                        # cancels the first two exactly
    return t


def nearest_even(x: Fraction, dtype) -> float:
    """The finite `dtype` value nearest to x, ties to the even significand, chosen by exact comparisons among the
    neighbours (bit patterns +-1) of x's float64 rounded to dtype (independent of exact.round_scaled)."""
    bits = torch.tensor(float(x), dtype=torch.float64).to(dtype).view(INTS[dtype])
    candidates = [(bits + step).view(dtype) for step in (-1, 0, 1)]
    finite = [c for c in candidates if bool(torch.isfinite(c))]
    best = min(finite, key=lambda c: (abs(Fraction(c.item()) - x), int(c.view(INTS[dtype]).item()) & 1))
    return best.item()


INTS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def exact_sums(t: torch.Tensor) -> list[Fraction]:
    columns = t.double().T.tolist()
    return [sum((Fraction(v) for v in col), Fraction(0)) for col in columns]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_is_the_exact_sum_rounded_once(seed, dtype):
    t = terms(200, 24, seed)
    got = ExactSum((24,)).add(t).value(dtype)
    for c, x in enumerate(exact_sums(t)):
        assert got[c].item() == nearest_even(x, dtype), (c, float(x))


def test_ties_round_to_even_and_overflow_is_inf():
    one, ulp = 1.0, 2.0 ** -23
    cases = torch.tensor([[one, one + ulp, 3.0e38], [ulp / 2, ulp / 2, 3.0e38]], dtype=torch.float32)
    got = ExactSum((3,)).add(cases).value()
    assert got[0].item() == one                  # 1 + ulp/2: a tie, down to the even 1
    assert got[1].item() == one + 2 * ulp        # (1 + ulp) + ulp/2: a tie, up to the even 1 + 2 ulp
    assert got[2].item() == math.inf             # 6e38 past float32's largest
    assert exact.round_scaled(-(1 << 200), 0, 24) == -math.inf


def test_same_bits_for_every_order_split_and_merge_order():
    t = terms(301, 16, 7)
    whole = ExactSum((16,)).add(t)
    rng = random.Random(0)
    for parts in (2, 3, 8):
        order = list(range(t.shape[0]))
        rng.shuffle(order)
        shuffled = t[order]
        cuts = sorted(rng.sample(range(1, t.shape[0]), parts - 1))
        states = [ExactSum((16,)).add(piece) for piece in torch.tensor_split(shuffled, cuts)]
        rng.shuffle(states)
        merged = ExactSum((16,))
        for state in states:
            merged.merge(state)
        assert torch.equal(merged.limbs, whole.limbs)
        assert torch.equal(merged.value(), whole.value())


def test_a_planted_float32_accumulation_fails_the_same_check():
    t = terms(301, 16, 7)
    planted_whole = t.sum(0)
    halves = [t[:150].sum(0), t[150:].sum(0)]
    planted_split = halves[0] + halves[1]
    assert not torch.equal(planted_whole, planted_split)  # what the split check catches
    assert torch.equal(ExactSum((16,)).add(t[:150]).merge(ExactSum((16,)).add(t[150:])).value(),
                       ExactSum((16,)).add(t).value())


def test_refuses_non_finite_terms_wrong_shapes_and_dtypes():
    state = ExactSum((2,))
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite"):
            state.add(torch.tensor([[1.0, bad]]))
    with pytest.raises(ValueError, match=r"float32 of shape \(n, 2\)"):
        state.add(torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="cannot merge"):
        state.merge(ExactSum((3,)))
    with pytest.raises(ValueError, match="bfloat16"):
        state.value(torch.float16)
    assert torch.equal(state.limbs, torch.zeros_like(state.limbs))  # nothing added by a refused call


def test_rounds_once_where_rounding_through_float64_would_round_twice():
    """1 + 2^-8 + 2^-60: float64 rounds it to 1 + 2^-8, a bfloat16 tie, which goes down to 1; the exact sum is just
    above the tie and goes up to 1 + 2^-7."""
    t = torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -60]])
    assert t.double().sum(0).to(torch.bfloat16).item() == 1.0
    assert ExactSum((1,)).add(t).value(torch.bfloat16).item() == 1 + 2.0 ** -7


def test_grouped_sums_are_each_groups_exact_sum_in_any_row_order():
    """add(terms, index): row i's terms go to group index[i] (a timestep's table-gradient row), the same as summing
    each group alone; the rows' order and their split do not matter."""
    t = terms(120, 8, 3)
    index = torch.randint(0, 5, (120,), generator=torch.Generator().manual_seed(3))
    grouped = ExactSum((5, 8)).add(t, index)
    for r in range(5):
        alone = ExactSum((8,)).add(t[index == r])
        assert torch.equal(grouped.limbs[:, r], alone.limbs)
    order = torch.randperm(120, generator=torch.Generator().manual_seed(4))
    parts = ExactSum((5, 8)).add(t[order[:50]], index[order[:50]]).merge(
        ExactSum((5, 8)).add(t[order[50:]], index[order[50:]]))
    assert torch.equal(parts.limbs, grouped.limbs)
    with pytest.raises(ValueError, match=r"index must be int64 of shape \(120,\) in \[0, 5\)"):
        ExactSum((5, 8)).add(t, index + 1)


def test_the_vectorised_rounding_is_round_scaled_on_every_kind_of_integer():
    """`rounded` (ExactSum.value's torch integer ops) against the Python-integer reference `round_scaled`: zero,
    subnormal and normal results, ties and near ties at the rounding bit, negatives, huge states (inf), for float32's
    24 and bfloat16's 8 bits."""
    rng = random.Random(3)
    ns = [0, 1, -1, 2 ** 23, 2 ** 24 - 1, 2 ** 24 + 1, 2 ** 25 + 3, -(2 ** 40 + 2 ** 16), 2 ** 277, -(2 ** 300)]
    for _ in range(3000):
        n = rng.getrandbits(rng.choice([rng.randint(1, 40), rng.randint(40, 310)]))
        if rng.random() < 0.3:  # the bits below the rounding point set to a tie, or one off it
            n = (n >> 20 << 20) | rng.choice([0, 1 << 19, (1 << 19) - 1, (1 << 19) + 1])
        ns.append(-n if rng.random() < 0.5 else n)
    limbs = as_limbs(ns, LIMBS)
    for precision in (24, 8):
        want = torch.tensor([round_scaled(n, E_MIN, precision) for n in ns], dtype=torch.float64)
        assert torch.equal(rounded(limbs, precision), want)


def as_limbs(ns, count: int) -> torch.Tensor:
    """Python integers as carried limbs (count, len(ns)): LIMB_BITS-bit limbs, the top one signed."""
    limbs = torch.zeros(count, len(ns), dtype=torch.int64)
    for i, n in enumerate(ns):
        for k in range(count - 1):
            limbs[k, i] = n & (2 ** LIMB_BITS - 1)
            n >>= LIMB_BITS
        limbs[count - 1, i] = n
    return limbs


def test_the_rounding_of_wide_states_in_other_units_is_round_scaled():
    """`rounded` of 2 LIMBS limbs in units 2^(2 E_MIN) (the product states): results far below float32's least
    subnormal (zero), at its half (ties), subnormal, normal, inf, with the round bit in every limb."""
    rng = random.Random(4)
    ns = [0, 1, -1, 2 ** 148, 2 ** 148 + 1, 3 * 2 ** 148, 2 ** 149, 2 ** 620, -(2 ** 447 + 2 ** 200)]
    for _ in range(3000):
        n = rng.getrandbits(rng.randint(1, 630))
        if rng.random() < 0.3:
            cut = rng.randint(1, max(1, n.bit_length() - 1))
            n = (n >> cut << cut) | rng.choice([0, 1 << (cut - 1), (1 << (cut - 1)) - 1, (1 << (cut - 1)) + 1])
        ns.append(-n if rng.random() < 0.5 else n)
    limbs = as_limbs(ns, 2 * LIMBS)
    for precision in (24, 8):
        want = torch.tensor([round_scaled(n, 2 * E_MIN, precision) for n in ns], dtype=torch.float64)
        assert torch.equal(rounded(limbs, precision, 2 * E_MIN), want)
    for count, e_min in ((1, -149), (2, -200), (3, -298), (LIMBS, 2 * E_MIN)):  # a top limb past 32 bits too
        few = [n for n in ns if abs(n) < 2 ** (LIMB_BITS * (count - 1) + 60)]
        for precision in (24, 8):
            want = torch.tensor([round_scaled(n, e_min, precision) for n in few], dtype=torch.float64)
            assert torch.equal(rounded(as_limbs(few, count), precision, e_min), want), (count, e_min)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_are_the_exact_products_rounded_once(dtype):
    """products(state, factors): each value the exact sum times the exact factor, rounded once (Fractions), for
    factors of every kind (subnormal, tiny, huge, negative, zero), a state's total of products the exact sum of the
    products; a planted product of the rounded sum is caught; products of a product state refused."""
    t = terms(120, 24, 5)
    g = torch.Generator().manual_seed(9)
    factors = torch.randn(24, generator=g) * torch.exp2(torch.randint(-60, 20, (24,), generator=g).float())
    factors[:4] = torch.tensor([2.0 ** -149, -3 * 2.0 ** -140, 0.0, 2.0 ** 20])  # the sums stay below 2^108
    state = ExactSum((24,)).add(t)
    got = exact.products(state, factors).value(dtype)
    want = [nearest_even(x * Fraction(f), dtype) for x, f in zip(exact_sums(t), factors.tolist())]
    assert got.tolist() == want
    planted = (state.value(dtype).double() * factors.double()).to(dtype)  # the sum rounded first: twice
    assert not torch.equal(planted, got)
    rows = ExactSum((3, 24)).add(t, torch.arange(120) % 3)
    by_row = factors[None] * torch.tensor([1.0, -0.5, 3.0])[:, None]
    total = exact.products(rows, by_row).total().value(dtype)
    sums = [exact_sums(t[r::3]) for r in range(3)]
    want = [nearest_even(sum((sums[r][c] * Fraction(by_row[r, c].item()) for r in range(3)), Fraction(0)), dtype)
            for c in range(24)]
    assert total.tolist() == want
    huge = exact.products(state, torch.full((24,), 2.0 ** 127)).value(dtype)
    big = [c for c, x in enumerate(exact_sums(t)) if abs(x) >= 2]  # times 2^127: past the largest finite value
    assert big and bool(huge[big].isinf().all())
    with pytest.raises(ValueError, match="sum of terms"):
        exact.products(exact.products(state, factors), factors)
    with pytest.raises(ValueError, match="finite"):
        exact.products(state, torch.full((24,), float("nan")))


def _fixed_point_words(t: torch.Tensor, q: int, rows_per: int):
    """Each block of rows_per rows of t (n, cols) summed as the integer in units of 2^q a kernel's 128-bit state
    holds (every term a multiple of 2^q), as that state's two int64 words (low two's complement, high signed):
    (low (blocks, cols), high (blocks, cols))."""
    low, high = [], []
    for start in range(0, t.shape[0], rows_per):
        block = t[start:start + rows_per].double().T.tolist()
        sums = [sum(int(Fraction(v) / Fraction(2) ** q) for v in col) for col in block]
        low.append([(s % 2 ** 64) - (2 ** 64 if s % 2 ** 64 >= 2 ** 63 else 0) for s in sums])
        high.append([s >> 64 for s in sums])
    return torch.tensor(low, dtype=torch.int64), torch.tensor(high, dtype=torch.int64)


def test_fixed_point_words_add_to_the_same_state_as_the_terms():
    """add_words: a kernel's per-block fixed-point states (a 128-bit integer in units of 2^q as two int64 words, or
    two int64 states of quanta 2^(q + 40) and 2^q) give the limbs of adding the terms themselves."""
    g = torch.Generator().manual_seed(7)
    t = (torch.randn(50, 6, generator=g) * torch.exp2(torch.randint(-40, 10, (50, 6), generator=g).float())).float()
    t[5] = -t[4]  # an exact cancellation
    q = -100  # below every term's lowest bit (2^-40 scale, 24 bits: >= 2^-70), the top below 2^(q + 112)
    direct = ExactSum((6,)).add(t)
    low, high = _fixed_point_words(t, q, rows_per=7)
    wide = ExactSum((6,)).add_words(low, q).add_words(high + (low < 0), q + 64)
    assert torch.equal(wide.limbs, direct.limbs)
    # the two-state form, P = hi 2^(q2 + 40) + lo 2^q2, on terms inside its narrower window (multiples of 2^-20)
    q2 = -20
    t2 = (torch.randint(-2 ** 23, 2 ** 23, (50, 6), generator=g).double()
          * torch.exp2(torch.randint(-20, 10, (50, 6), generator=g).double())).float()
    low2, high2 = _fixed_point_words(t2, q2, rows_per=7)
    values = [[h * 2 ** 64 + (v % 2 ** 64) for h, v in zip(hr, lr)] for hr, lr in zip(high2.tolist(), low2.tolist())]
    hi = torch.tensor([[v >> 40 for v in row] for row in values], dtype=torch.int64)
    lo = torch.tensor([[v & (2 ** 40 - 1) for v in row] for row in values], dtype=torch.int64)
    assert torch.equal(ExactSum((6,)).add_words(hi, q2 + 40).add_words(lo, q2).limbs, ExactSum((6,)).add(t2).limbs)
    planted = low.clone()
    planted[0, 0] += 1  # one unit of 2^q off in one block's state: caught
    assert not torch.equal(ExactSum((6,)).add_words(planted, q).add_words(high + (planted < 0), q + 64).limbs,
                           direct.limbs)


def test_add_words_refuses_what_the_state_cannot_hold():
    state = ExactSum((3,))
    with pytest.raises(ValueError, match="int64"):
        state.add_words(torch.zeros(2, 3, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=str(E_MIN)):
        state.add_words(torch.zeros(2, 3, dtype=torch.int64), E_MIN - 1)
    with pytest.raises(ValueError, match=str(E_MIN)):
        state.add_words(torch.zeros(2, 3, dtype=torch.int64), E_MIN + LIMB_BITS * (LIMBS - 2))


def test_all_finite_finds_one_inf_or_nan_among_many_in_every_dtype():
    """exact.all_finite (numpy's pass on CPU float32 / float64, torch's otherwise) against torch.isfinite: one
    non-finite value planted at either end or in the middle of 96768 is found, the largest finite and subnormal
    values are finite."""
    from adaln_lab.core.exact import all_finite

    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        values = torch.randn(96768, generator=torch.Generator().manual_seed(0)).to(dtype)
        values[:2] = torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).smallest_normal / 4], dtype=dtype)
        assert all_finite(values) and all_finite(values[:0])
        for bad in (float("inf"), float("-inf"), float("nan")):
            for at in (0, 48384, 96767):
                planted = values.clone()
                planted[at] = bad
                assert not all_finite(planted) and not bool(torch.isfinite(planted).all()), (dtype, bad, at)
    values = torch.tensor([1.0, float("inf")])
    assert not all_finite(values.neg().conj()) and not all_finite(torch._neg_view(values))  # a view with the neg bit
