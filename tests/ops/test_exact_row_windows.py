"""exact_row_windows.cu (TUNING's EXACT_ROW_DOUBLE 1): the exact row passes' sums in float64 windows checked at their
close, refused windows added by the fixup kernels.

On the CPU: the two checks of the kernel's header, replayed on float64 sums with their roundings (rounded down / up /
to nearest from exact fractions), accept only windows whose sum is exact, and a planted bound (B's terms taken as
53-bit numbers, not 8-bit ones) is caught; `row_sums.fixup_capacity` counts every window of both passes' layouts. On
the GPU: norm_out's exact pass, a block's sorted norm passes and its gates' pass with the float64 windows give the
torch code's integers and the plain passes' dx, with windows refused on purpose (terms over 100 binades, subnormal
dy) and the fixup's entries seen; a pass whose fixups are dropped is caught by the same comparison."""

from __future__ import annotations

import math
import random
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from adaln_lab.core import loader, plan as plan_module
from adaln_lab.ops.row_sums import FIXUPS_MAX, fixup_capacity

# exact_row_windows.cu's EXACT_B_BITS (53 - 8), read from the kernel's source
B_BITS = int(re.search(r"#define EXACT_B_BITS (\d+)", (loader.kernel_dir() / "exact_row_windows.cu").read_text())[1])


def rounded(exact: Fraction, mode: str) -> float:
    """The float64 nearest `exact` (mode "rn"), or the one below ("rd") or above ("ru")."""
    near = float(exact)
    if mode == "rd" and Fraction(near) > exact:
        return math.nextafter(near, -math.inf)
    if mode == "ru" and Fraction(near) < exact:
        return math.nextafter(near, math.inf)
    return near


def window_sum(terms: list[float], mode: str) -> float:
    """The float64 sum of float32 `terms` in order, each addition rounded by `mode` (DADD.RM / RP / RN)."""
    s = 0.0
    for t in terms:
        s = rounded(Fraction(s) + Fraction(t), mode)
    return s


def a_accepts(terms: list[float]) -> bool:
    """A's check: the sums rounded down and up agree (and are finite)."""
    lo, hi = window_sum(terms, "rd"), window_sum(terms, "ru")
    return lo == hi and math.isfinite(lo)


def b_accepts(terms: list[float], bits: int = B_BITS) -> bool:
    """B's check for one vector's terms (row by row, 8 columns a row: column e is terms[e::8]): DoubleRowSums.b_exact
    on the float32 bits, as the kernel tracks them (the largest |dy|, the least 2 bits - 1 mod 2^32)."""
    u = np.array(terms, dtype=np.float32).view(np.uint32)
    low = (u * np.uint32(2) - np.uint32(1)).min()
    if low == np.uint32(0xFFFFFFFF):
        return True  # every term zero
    emax = max(int(np.abs(np.array(terms, dtype=np.float32)).max().view(np.uint32)) >> 23, 1)
    emin = max(int((low + np.uint32(1)) >> np.uint32(24)), 1)
    n = len(terms) // 8  # rows: 8 columns a row
    d = emax - emin
    return d <= bits and (n << max(d, 0)) <= (1 << bits)


def f32(x: float) -> float:
    return float(np.float32(x))


def bf16(x: float) -> float:
    return float(torch.tensor(x).bfloat16().float())


def random_terms(rng: random.Random, n: int, spread: int, to) -> list[float]:
    return [to(rng.choice((-1, 1)) * rng.random() * 2.0 ** -rng.randrange(spread)) if rng.random() > 0.1 else 0.0
            for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_an_accepted_windows_sum_is_the_exact_sum(seed):
    """Windows of float32 (A) and bf16 (B) terms over 2 to 120 binades: whatever either check accepts has the exact
    sum; both accept narrow windows and refuse some wide ones (the checks are not vacuous)."""
    rng = random.Random(seed)
    seen = {"a": set(), "b": set()}
    for spread in (2, 20, 40, 60, 120):
        for n in (1, 2, 8, 40):
            terms = random_terms(rng, n, spread, f32)
            accepted = a_accepts(terms)
            seen["a"].add(accepted)
            if accepted:
                assert Fraction(window_sum(terms, "rd")) == sum(map(Fraction, terms))
            dys = random_terms(rng, 8 * n, spread, bf16)
            accepted = b_accepts(dys)
            seen["b"].add(accepted)
            if accepted:
                for e in range(8):  # each column of the vector, rows in order
                    column = dys[e::8]
                    assert Fraction(window_sum(column, "rn")) == sum(map(Fraction, column))
    assert seen == {"a": {True, False}, "b": {True, False}}


def test_a_planted_bound_is_caught():
    """B's bound with 53 bits (the terms' 8 significant bits forgotten) accepts a window whose rounded sum is not
    exact (column 0: 1 + 2^-7 and (1 + 2^-7) 2^-47, 55 bits); the kernel's 45 refuses it. A refuses a window whose
    exact sum is a float64 (2^-60) but whose first addition rounds."""
    dys = [bf16(1 + 2.0 ** -7)] + [0.0] * 7 + [bf16((1 + 2.0 ** -7) * 2.0 ** -47)] + [0.0] * 7
    assert Fraction(window_sum(dys[0::8], "rn")) != sum(map(Fraction, dys[0::8]))
    assert b_accepts(dys, bits=53) and not b_accepts(dys)
    assert not a_accepts([1.0, 2.0 ** -60, -1.0]) and a_accepts([1.0, 2.0 ** -40, -1.0])


def test_b_accepts_only_exact_windows_at_the_edge_of_its_bound():
    """Windows built at B's bound (Emax - Emin = d from 34 to 47, n near 2^(45 - d) and 2^(46 - d) rows, up to 4096;
    n - 1 terms at Emax and one at Emin, all of one sign with all 8 significant bits set, the small one last): every
    window the kernel's bound accepts has an exact sum, it accepts some, and a bound one bit looser accepts one whose
    rounded sum is not exact."""
    top = bf16(255 / 128)  # 1.1111111b: the widest mantissa
    accepted, looser_caught = 0, False
    for d in range(34, 48):
        for n in sorted({max(2 ** (45 - d), 1), max(2 ** (45 - d), 1) + 1, max(2 ** (46 - d), 2)}):
            column = [top] * (n - 1) + [bf16(top * 2.0 ** -d)]
            dys = [v for t in column for v in (t, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)]
            exact = Fraction(window_sum(column, "rn")) == sum(map(Fraction, column))
            if b_accepts(dys):
                accepted += 1
                assert exact, (d, n)
            looser_caught |= b_accepts(dys, bits=B_BITS + 1) and not exact
    assert accepted > 0 and looser_caught


def windows(keys: np.ndarray, per: int) -> int:
    """Windows of a pass over rows with table rows `keys` in blocks of `per` positions: the distinct (block, key)."""
    return len(set(zip((np.arange(len(keys)) // per).tolist(), keys.tolist())))


@pytest.mark.parametrize("rows, T", [(1, 3), (7, 3), (300, 3), (4097, 12), (40000, 40), (50, 9)])
def test_the_fixup_capacity_counts_every_window(rows, T, monkeypatch):
    """fixup_capacity (EXACT_ROW_DOUBLE 1) is at least the windows of norm_out's pass (rows in order, any table
    rows) and of a sorted pass (rows in table-row order) times H / 8, for the worst and for random table rows; 0
    with EXACT_ROW_DOUBLE 0."""

    monkeypatch.setitem(plan_module.TUNING, "EXACT_ROW_DOUBLE", 1)
    monkeypatch.setattr(plan_module, "plan", plan_module.plan.__wrapped__)  # no cached plan in or out
    monkeypatch.setattr(plan_module, "rows_of", plan_module.rows_of.__wrapped__)
    p = plan_module.plan(64, 32, T)
    r = plan_module.rows_of(p, rows)
    nvec = 64 // 8
    rng = np.random.default_rng(rows)
    for keys in (np.arange(rows) % T, rng.integers(0, T, rows)):  # the first: every block holds every table row
        assert min(windows(keys, r.bwd_rows_per_range) * nvec, FIXUPS_MAX) <= fixup_capacity(p, r, False)
        assert min(windows(np.sort(keys), r.bwd_rows_per_range) * nvec, FIXUPS_MAX) <= fixup_capacity(p, r, True)
    monkeypatch.setitem(plan_module.TUNING, "EXACT_ROW_DOUBLE", 0)
    assert fixup_capacity(plan_module.plan(64, 32, T), r, False) == 0


# norm_out's exact pass, each way it may run: shipped, then each other close and the rows in table-row order
NORM_OUT_FORMS = [{}] + [knobs for knobs in ({"EXACT_CLOSE_STAGED": 1}, {"EXACT_CLOSE_STAGED": 0},
                                            {"EXACT_SORTED_MIN_T": 1})
                         if any(plan_module.TUNING[name] != value for name, value in knobs.items())]


def form_id(knobs: dict) -> str:
    return ",".join(f"{name}={value}" for name, value in knobs.items()) or "shipped"


@pytest.fixture
def double_windows(request):
    """TUNING's EXACT_ROW_DOUBLE 1 (exact_row_windows.cu) with the parameter's other knobs (a dict, where one is
    given: NORM_OUT_FORMS), every plan and kernel forgotten before and after."""
    from adaln_lab.core.launchers import tuned

    with tuned(EXACT_ROW_DOUBLE=1, **getattr(request, "param", {})):
        yield


def spread(t: torch.Tensor, seed: int, share: float = 0.05) -> torch.Tensor:
    """t with `share` of its elements times 2^-k, k in [40, 120) (some bf16 subnormals): columns whose terms span more
    binades than a float64 window holds."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    k = torch.randint(40, 120, t.shape, device=t.device, generator=g)
    pick = torch.rand(t.shape, device=t.device, generator=g) < share
    return torch.where(pick, t * torch.exp2(-k.float()).to(t.dtype), t)


def ftz(v: torch.Tensor) -> torch.Tensor:
    """float32 subnormals to zero, as the unit's -ftz products read and write them."""
    return torch.where(v.abs() < 2.0 ** -126, torch.zeros_like(v), v)


def exact_terms(x, dy, rstd, index, R):
    """The ExactSum (R, 2H) of the kernels' terms dy | dy xhat, the products flushed as the kernels' (-ftz)."""
    from adaln_lab.core.exact import ExactSum

    H = x.shape[-1]
    xf, g = x.reshape(-1, H).float(), dy.reshape(-1, H).float()
    p = ftz(ftz(g) * ftz(ftz(xf) * rstd[:, None]))
    return ExactSum((R, 2 * H), x.device).add(torch.cat([g, p], dim=1), index)


def norm_out_case(B_, S_, H_, D_, T_, wide: bool):
    from adaln_lab.core.plan import forward_bytes
    from adaln_lab.ops.final_adaln_out import launch

    g = torch.Generator(device="cuda").manual_seed(S_ * H_)
    x, dy = (torch.randn(B_, S_, H_, device="cuda", generator=g).bfloat16() for _ in range(2))
    if wide:
        x, dy = spread(x, 1), spread(dy, 2)
    nw = (1 + 0.1 * torch.randn(H_, device="cuda", generator=g)).bfloat16()
    temb = torch.randn(T_, D_, device="cuda", generator=g)
    weight = (0.1 * torch.randn(2 * H_, D_, device="cuda", generator=g)).bfloat16()
    bias = (0.1 * torch.randn(2 * H_, device="cuda", generator=g)).bfloat16()
    idx = torch.randint(0, T_, (S_,), device="cuda", generator=g)
    workspace = x.new_empty(forward_bytes(T_, H_, B_ * S_, D_), dtype=torch.uint8)
    launch.forward(x, nw, temb, weight, bias, idx, 1e-5, "cupy", "cuda", torch.empty_like(x), workspace)
    return x, dy, nw, temb, weight, idx, workspace


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 37, 64, 32, 3), (1, 300, 5376, 2688, 2), (3, 700, 264, 64, 12)])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("double_windows", NORM_OUT_FORMS, indirect=True, ids=form_id)
def test_norm_outs_pass_gives_the_exact_integers_and_the_plain_dx(shape, wide, double_windows):
    """norm_modulate_bwd_exact_bf16 with float64 windows and exact_fixup_rows_bf16 (closed either way), or its sorted
    pass: the torch code's integers of the kernels' terms limb for limb and the plain backward's dx; with terms over
    100 binades the fixups ran (entries appended)."""
    from adaln_lab.ops.final_adaln_out import launch
    from adaln_lab.ops.final_adaln_out.exact import kernel_sums

    B_, S_, H_, D_, T_ = shape
    x, dy, nw, temb, weight, idx, workspace = norm_out_case(*shape, wide)
    _, _, rstd = launch.saved_views(workspace, T_, H_, B_ * S_, D_)
    want = exact_terms(x, dy, rstd, idx.repeat(B_), T_)
    dx = torch.empty_like(x)
    got = kernel_sums(dy, x, nw, idx, workspace, T_, D_, dx=dx)
    got.check()
    got.ready()
    grads = (torch.empty_like(x), torch.empty_like(nw), torch.empty_like(temb), weight.clone(),
             weight.new_empty(2 * H_))
    launch.backward(dy, x, nw, temb, weight, idx, workspace, "cupy", *grads)
    assert torch.equal(got.table.limbs, want.limbs) and torch.equal(dx, grads[0])
    assert int(got.entries) > 0 or not wide  # random terms: refusals are rare, not none


@pytest.mark.gpu
@pytest.mark.parametrize("double_windows", NORM_OUT_FORMS, indirect=True, ids=form_id)
def test_a_pass_whose_fixups_are_dropped_is_caught(double_windows, monkeypatch):
    """The same comparison fails when the fixup kernel does not run (its windows' terms left out), and a NaN term
    (a refused window) raises through the fixup's flag, and an index outside the table through the pass's."""
    from adaln_lab.ops import row_sums
    from adaln_lab.ops.final_adaln_out import exact, launch

    shape = (2, 37, 64, 32, 3)
    x, dy, nw, temb, weight, idx, workspace = norm_out_case(*shape, True)
    _, _, rstd = launch.saved_views(workspace, 3, 64, 74, 32)
    want = exact_terms(x, dy, rstd, idx.repeat(2), 3)
    bad = dy.clone()
    bad[1, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        exact.kernel_sums(bad, x, nw, idx, workspace, 3, 32, dx=torch.empty_like(x)).check()
    out_of_range = idx.clone()
    out_of_range[4] = 3
    with pytest.raises(IndexError, match=r"outside \[0, T\)"):
        exact.kernel_sums(dy, x, nw, out_of_range, workspace, 3, 32, dx=torch.empty_like(x)).check()
    for module in (exact, row_sums):  # norm_out's pass and the sorted one (row_sums launches its fixups)
        monkeypatch.setattr(module, "launch_fixups", lambda *args: None)
    got = exact.kernel_sums(dy, x, nw, idx, workspace, 3, 32, dx=torch.empty_like(x))
    got.check()
    got.ready()
    assert not torch.equal(got.table.limbs, want.limbs)


@pytest.mark.gpu
@pytest.mark.parametrize("double_windows", NORM_OUT_FORMS, indirect=True, ids=form_id)
def test_a_full_fixup_list_raises(double_windows, monkeypatch):
    """A pass that refuses more windows than its list holds (FIXUPS_MAX 1 here, terms over 100 binades) raises
    RuntimeError naming the switch, never a wrong sum."""
    from adaln_lab.ops import row_sums
    from adaln_lab.ops.final_adaln_out import exact

    monkeypatch.setattr(row_sums, "FIXUPS_MAX", 1)
    x, dy, nw, temb, weight, idx, workspace = norm_out_case(2, 37, 64, 32, 3, True)
    with pytest.raises(RuntimeError, match="EXACT_ROW_DOUBLE"):
        exact.kernel_sums(dy, x, nw, idx, workspace, 3, 32, dx=torch.empty_like(x)).check()


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 264, 5376])  # 5376: the gates' pass over three column tiles
def test_a_blocks_passes_give_the_exact_integers_and_the_plain_dx(H, double_windows, monkeypatch):
    """modulated_rms_norm.launch.backward_exact with float64 windows and exact_fixup_sorted_bf16 (with and without
    a residual gradient) and gated_residual.launch.backward_exact with exact_fixup_gates_bf16, terms over 100
    binades in some columns: the integers of the kernels' terms and the plain passes' dx and d_y, no flag, entries
    appended; with the fixups dropped the integers differ."""
    from adaln_lab.ops import row_sums
    from adaln_lab.ops.gated_residual import launch as gate_launch
    from adaln_lab.ops.modulated_rms_norm import launch as norm_launch

    made = []  # each pass's flags (2,): flags[1] counts its entries
    buffers = row_sums.pass_buffers
    monkeypatch.setattr(row_sums, "pass_buffers", lambda *args: made.append(buffers(*args)) or made[-1])

    g = torch.Generator(device="cuda").manual_seed(H)
    S, R = 3000, 6
    x, dy, res = (spread(torch.randn(1, S, H, device="cuda", generator=g).bfloat16(), k) for k in range(3))
    rstd = torch.rand(S, device="cuda", generator=g) + 0.5
    idx = torch.randint(0, R, (S,), device="cuda", generator=g)
    weight = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    table = (0.2 * torch.randn(R, 2 * H, device="cuda", generator=g)).bfloat16().float()
    want = exact_terms(x, dy, rstd, idx, R).limbs
    for d_residual in (None, res):
        dx, plain_dx = torch.empty_like(x), torch.empty_like(x)
        state, flags = norm_launch.backward_exact(dy, x, weight, table[:, :H], table[:, H:], idx, rstd, d_residual,
                                                  None, dx)
        norm_launch.backward(dy, x, weight, table[:, :H], table[:, H:], idx, rstd, d_residual, None, "cupy",
                             plain_dx, torch.empty_like(weight), torch.empty(R, 2 * H, device="cuda"), 0, None)
        assert int(flags) == 0 and torch.equal(state.limbs, want) and torch.equal(dx, plain_dx)
        assert int(made[-1][1][1]) > 0
    gate = table[:, H:]
    want_gate = exact_terms(x, dy, torch.ones_like(rstd), idx, R)  # dout y: x as y, rstd 1
    d_y, plain_d_y = torch.empty_like(x), torch.empty_like(x)
    state, flags = gate_launch.backward_exact(dy, gate, x, idx, None, d_y)
    gate_launch.backward(dy, gate, x, idx, None, torch.bfloat16, "cupy", plain_d_y, torch.empty(R, H, device="cuda"),
                         0, None)
    assert int(flags) == 0 and torch.equal(d_y, plain_d_y) and int(made[-1][1][1]) > 0
    assert torch.equal(state.limbs, row_sums.half(want_gate, 1).limbs)
    monkeypatch.setattr(row_sums, "launch_fixups", lambda *args: None)
    state, _ = norm_launch.backward_exact(dy, x, weight, table[:, :H], table[:, H:], idx, rstd, None, None, dx)
    assert not torch.equal(state.limbs, want)
    state, _ = gate_launch.backward_exact(dy, gate, x, idx, None, d_y)
    assert not torch.equal(state.limbs, row_sums.half(want_gate, 1).limbs)
