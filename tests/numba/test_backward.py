"""The Numba twin of the backward (adaln_lab.ops.final_adaln_out.twin.backward): on a CPU through numba's CUDA simulator
(tiny shapes), on a GPU against kernels_cu bit for bit (`gpu` mark).

What the simulator can and cannot show. It runs the twin's geometry, pass logic and order of every
sum, but `cuda.fma` rounds twice there (a * b + c) and the exponentials are the C library's, not
libdevice's; so here gradients are checked against error bounds, and bits only where no fma or exp
is involved (row invariance and repeatability, which compare the twin with itself; the ordered
sums of reduce_partials against a transcription of the kernel; zeros; NaN poisoning).
`test_twin_equals_kernels_cu_bit_for_bit` is the bitwise check against the CUDA kernels: it needs
a GPU.

The per-element error bounds the gradients are held to: tests/numba/bounds.py.
"""

from fractions import Fraction

import pytest
import torch

from adaln_lab.core.plan import TUNING, plan as make_plan
from adaln_lab.harness.inputs import make, upstream
from adaln_lab.ops.final_adaln_out.twin import backward as numba_backward

from .bounds import (DEVICE, EPS, HALF_BF16, NAMES, Depths, assert_within, error_bounds, golden_tolerances,
                     launch_backward, make_case, same_bits, saved_tensors, simulating)

pytestmark = pytest.mark.integration  # the Numba twin in numba's CUDA simulator (a few thousand threads a second)

TINY = {"H": 64, "D": 32, "T": 3}  # the simulator runs a few thousand threads a second: keep grids tiny
ROW_TIMESTEPS = [2, 0, 1, 2, 0, 1]  # 6 rows: S = 3 twice over (test_leading_dims_use_index_r_mod_S)


one_worker = pytest.mark.xdist_group("numba_backward")  # the tests of the module fixture `case`: built once


@pytest.fixture(scope="module")
def case():
    return make_case(5, ROW_TIMESTEPS, **TINY)


# ---------------------------------------------------------------- (a), (b): accuracy within the bounds

@one_worker
def test_gradients_within_the_bounds_of_the_float64_golden(case):
    golden, tol = golden_tolerances(case)
    for name, value in zip(NAMES, case.grads):
        assert value.dtype == (torch.float32 if name == "d_temb" else torch.bfloat16), name
        assert_within(name, value, golden[name], tol[name])
        # the bounds mean something: a few bf16 half-ulps of the gradient's scale at most
        assert float(tol[name].max()) <= 2.0 ** -5 * float(golden[name].abs().max()), name


@one_worker
def test_gradients_within_the_bounds_of_the_analytic_cpu_backward(case):
    i = case.inputs
    ref = launch_backward(case.dy.cpu(), i.x.cpu(), i.norm_weight.cpu(), i.temb.cpu(), i.weight.cpu(),
                          i.timestep_indices.cpu(), case.table_f32.cpu(), case.rstd.cpu())
    H = i.x.shape[-1]
    plan = make_plan(H, i.temb.shape[1], i.temb.shape[0])
    rows = i.x.shape[0]
    depths = Depths.twin(plan, rows).max(Depths.analytic_cpu(plan, rows))
    zero = torch.zeros(i.temb.shape[0], H, dtype=torch.float64)
    e = error_bounds(i, case.dy, case.rstd, case.table_f32, 0.0, zero, depths)
    for name, value, expected in zip(NAMES, case.grads, ref):
        assert value.dtype == expected.dtype and value.shape == expected.shape, name
        both = value.double().cpu().abs() + expected.double().abs()
        rounding = 0.0 if name == "d_temb" else HALF_BF16 * 1.01 * both  # the two bf16 roundings
        assert_within(name, value, expected, 2 * e[name] + rounding)


# ---------------------------------------------------------------- (c): invariance

@one_worker
def test_a_rows_dx_does_not_depend_on_the_other_rows(case):
    i = case.inputs
    dx = case.grads[0]
    D = i.temb.shape[1]
    for r in (0, 1, 5):  # timesteps 2, 0, 1
        alone, _ = numba_backward.norm_modulate_bwd(case.dy[r:r + 1], i.x[r:r + 1], case.rstd[r:r + 1], i.norm_weight,
                                                    case.table_f32, i.timestep_indices[r:r + 1], D)
        assert same_bits(alone[0], dx[r]), r
    # the same rows in other ranges: 2 rows each (every range has a pass without rows), all 6 in one
    # (two rows in every pass): the same dx
    dyf = case.dy.float().cpu()
    ts = i.timestep_indices.tolist()
    for per in (2, 6):
        ranged, partials = numba_backward.norm_modulate_bwd(case.dy, i.x, case.rstd, i.norm_weight, case.table_f32,
                                                            i.timestep_indices, D, rows_per_range=per)
        assert same_bits(ranged, dx), per
        # partials[b, t, 1] is the fp32 sum of dy over range b's rows of t in row order (no fma: exact bits)
        for b in range(partials.shape[0]):
            for t in range(i.temb.shape[0]):
                expect = torch.zeros(i.x.shape[1])
                members = [r for r in range(per * b, min(per * b + per, len(ts))) if ts[r] == t]
                for r in members:
                    expect = expect + dyf[r]
                assert same_bits(partials[b, t, 1].cpu(), expect), (per, b, t)
                if not members:
                    assert same_bits(partials[b, t].cpu(), torch.zeros_like(partials[b, t].cpu())), (per, b, t)


@one_worker
def test_leading_dims_use_index_r_mod_S(case):
    """x (2, 3, H) with 3 indices is x (6, H) with the indices repeated, bit for bit, every gradient."""
    i = case.inputs
    H = i.x.shape[-1]
    idx = i.timestep_indices[:3]
    assert torch.equal(idx.repeat(2), i.timestep_indices)
    flat = case.grads
    nested = numba_backward.backward(**case.args(dy=case.dy.view(2, 3, H), x=i.x.view(2, 3, H), timestep_indices=idx))
    assert nested[0].shape == (2, 3, H)
    assert same_bits(nested[0].reshape(6, H), flat[0])
    for name, a, b in zip(NAMES[1:], nested[1:], flat[1:]):
        assert same_bits(a, b), name


@one_worker
@pytest.mark.slow  # a plain second call: test_leading_dims_use_index_r_mod_S already runs the same sums again and
# compares all five gradients bit for bit, as tests/numba/test_op.py's test_op_is_the_twins_kernels_composed does
def test_parameter_gradients_repeat_bit_for_bit(case):
    again = numba_backward.backward(**case.args())
    for name, first, second in zip(NAMES, case.grads, again):
        assert same_bits(first, second), name


# ---------------------------------------------------------------- (d): empty batch

@one_worker
def test_an_empty_batch_gives_zero_parameter_gradients(case):
    i = case.inputs
    H = i.x.shape[-1]
    empty = i.x[:0]
    grads = numba_backward.backward(**case.args(dy=case.dy[:0], x=empty, rstd=case.rstd[:0],
                                                 timestep_indices=i.timestep_indices[:0]))
    assert grads[0].shape == (0, H)
    for name, g, like in zip(NAMES[1:], grads[1:], (i.norm_weight, i.temb, i.weight, torch.empty(2 * H))):
        assert g.shape == like.shape, name
        assert bool((g == 0).all()), name


# ---------------------------------------------------------------- (e): the helpers catch planted errors

@one_worker
def test_the_comparison_helpers_fail_on_planted_errors(case):
    golden, tol = golden_tolerances(case)
    dx, d_nw, d_temb, d_weight, d_bias = (g.detach().cpu().clone() for g in case.grads)
    assert_within("dx", dx, golden["dx"], tol["dx"])  # the unplanted gradient passes

    def fails(name, planted):
        with pytest.raises(AssertionError):
            assert_within(name, planted, golden[name], tol[name])

    at = divmod(int(golden["dx"].abs().argmax()), dx.shape[1])
    flipped = dx.clone()
    flipped[at] = -flipped[at]
    fails("dx", flipped)  # a sign error in one element

    j = int(golden["d_weight"].abs().argmax())
    nudged = d_weight.clone().view(-1).view(torch.int16)
    nudged[j] += 3  # three bf16 ulps off in one element
    fails("d_weight", nudged.view(torch.bfloat16).view(d_weight.shape))

    fails("d_temb", d_temb[[1, 0, 2]])  # timesteps swapped

    i = case.inputs
    last = (i.timestep_indices == 2).cpu()
    x, dy, nw = i.x.double().cpu(), case.dy.double().cpu(), i.norm_weight.double().cpu()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    dropped = golden["d_bias"] - torch.cat([dy[last].sum(0), (dy * x * r)[last].sum(0) * nw])
    fails("d_bias", dropped.to(torch.bfloat16))  # one timestep left out of the sum

    scale_only = golden["d_norm_weight"] - (dy * x * r).sum(0)  # sum_t scale * A: the 1 of 1 + scale forgotten
    fails("d_norm_weight", scale_only.to(torch.bfloat16))

    poisoned = d_nw.clone()
    poisoned[3] = float("nan")
    fails("d_norm_weight", poisoned)

    flipped_bit = d_weight.clone().view(-1).view(torch.int16)
    flipped_bit[j] ^= 1
    assert same_bits(d_weight, d_weight.clone())
    assert not same_bits(flipped_bit.view(torch.bfloat16).view(d_weight.shape), d_weight)
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))


# ---------------------------------------------------------------- the kernels' other behaviours

@one_worker
def test_an_invalid_index_poisons_its_row_and_the_sums_that_hold_it(case):
    """Indices 9 and -1 (outside [0, 3)): those rows' dx and every sum over pass 0 of their ranges are NaN;
    the other rows' dx keep their bits (ranges of 3 rows: in range 0 a valid row follows the invalid one
    in pass 0)."""
    i = case.inputs
    bad = list(ROW_TIMESTEPS)
    bad[1], bad[4] = 9, -1  # range 0 = rows 0..2 (2, 9, 0); range 1 = rows 3..5 (2, -1, 1)
    idx = torch.tensor(bad, device=DEVICE)
    D, H = i.temb.shape[1], i.x.shape[1]
    dx, partials = numba_backward.norm_modulate_bwd(case.dy, i.x, case.rstd, i.norm_weight, case.table_f32, idx, D,
                                                    rows_per_range=3)
    nan_rows = dx.float().isnan().all(-1).cpu()
    assert nan_rows.tolist() == [r in (1, 4) for r in range(len(bad))]
    good = (~nan_rows).to(dx.device)
    assert same_bits(dx[good], case.grads[0][good])
    assert bool(partials[:, 0].isnan().all()) and not bool(partials[:, 1:].isnan().any())
    d_table, d_nw, d_bias = numba_backward.reduce_partials(partials, i.norm_weight, case.table_f32, D)
    d_weight, dact_partials = numba_backward.table_bwd(d_table, i.temb, i.weight)
    d_temb = numba_backward.table_bwd_reduce(dact_partials, i.temb, H)
    assert bool(d_table[0].isnan().all()) and not bool(d_table[1:].isnan().any())
    for g in (d_nw, d_bias, d_weight):
        assert bool(g.float().isnan().all())
    assert bool(d_temb[0].isnan().all()) and not bool(d_temb[1:].isnan().any())


def test_twin_table_backward_gives_the_same_bits_for_every_lane_width(monkeypatch):
    """The twin's table_bwd at each columns-per-lane width (plan.tb_vec 8, 4, 2, by TB_ACC_MAX): the same d_weight
    and dact partials, as the kernel's (tests/core/test_tensors.py); D = 40 not a multiple of any tile; blocks of
    two warps (TB_THREADS 64), to keep the simulator's threads few."""
    from adaln_lab.core import launchers

    g = torch.Generator().manual_seed(3)
    T, D, N = 3, 40, 32
    d_table = torch.randn(T, N, generator=g).to(DEVICE)
    temb = torch.randn(T, D, generator=g).to(DEVICE)
    weight = (torch.randn(N, D, generator=g) * 0.1).bfloat16().to(DEVICE)
    results = {}
    try:
        for vec in (8, 4, 2):
            fused = 2 if T < TUNING["TB_SPLIT_MIN_T"] else 1  # the one kernel keeps both halves' accumulators
            monkeypatch.setitem(TUNING, "TB_ACC_MAX", fused * T * vec if vec > 2 else 0)
            monkeypatch.setitem(TUNING, "TB_THREADS", 64)
            launchers.forget_compiled()
            assert make_plan(N // 2, D, T).tb_vec == vec
            results[vec] = numba_backward.table_bwd(d_table, temb, weight)
    finally:
        monkeypatch.undo()
        launchers.forget_compiled()
    for vec in (4, 2):
        assert same_bits(results[vec][0], results[8][0]) and same_bits(results[vec][1], results[8][1])


def _fma64(a: float, b: float, c: float) -> float:
    """What cuda.fma does to doubles here: rounds twice in the simulator, once on a GPU."""
    if simulating():
        return a * b + c
    return float(Fraction(a) * Fraction(b) + Fraction(c))  # exact, then rounded once


def reduce_partials_transcribed(row_partials, norm_weight, table_f32, groups: int):
    """reduce_partials.cu line by line on the host: RP_T = min(T, RP_T_MAX) timesteps per chunk, each (t, half)
    its own double accumulator over the group's row ranges; returns d_table, d_norm_weight, d_bias."""
    nblocks, T, _, H = row_partials.shape
    p = row_partials.double().cpu().tolist()
    w = norm_weight.float().cpu().tolist()
    scale = table_f32.cpu()[:, H:].tolist()
    f32 = lambda v: torch.tensor(v, dtype=torch.float64).float().item()  # noqa: E731  (round to nearest even)
    rp_t = min(T, TUNING["RP_T_MAX"])
    per = (nblocks + groups - 1) // groups
    bounds = [(min(nblocks, g * per), min(nblocks, min(nblocks, g * per) + per)) for g in range(groups)]
    d_table = [[0.0] * (2 * H) for _ in range(T)]
    d_nw, d_bias = [0.0] * H, [0.0] * (2 * H)
    for h in range(H):
        nw_sum = shift_sum = scale_sum = 0.0
        for t0 in range(0, T, rp_t):
            scratch = []
            for b0, b1 in bounds:
                s = [0.0] * (2 * rp_t)
                for b in range(b0, b1):
                    for c in range(2 * rp_t):
                        if t0 + c // 2 < T:
                            s[c] += p[b][t0 + c // 2][c % 2][h]
                scratch.append(s)
            for tt in range(rp_t):
                t = t0 + tt
                if t >= T:
                    break
                a = bsum = 0.0
                for g in range(groups):
                    a += scratch[g][2 * tt]
                    bsum += scratch[g][2 * tt + 1]
                d_shift, d_scale = f32(bsum), f32(w[h] * a)
                d_table[t][h], d_table[t][H + h] = d_shift, d_scale
                nw_sum = _fma64(1.0 + scale[t][h], a, nw_sum)
                shift_sum += d_shift
                scale_sum += d_scale
        d_nw[h] = f32(nw_sum)
        d_bias[h], d_bias[H + h] = f32(shift_sum), f32(scale_sum)
    bf16 = lambda v: torch.tensor(v, dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    return torch.tensor(d_table, dtype=torch.float32), bf16(d_nw), bf16(d_bias)


def test_reduce_partials_has_the_association_of_the_kernels_chunked_loop():
    """T = 5 walks two chunks (4 + 1 timesteps); 37 row ranges in 16 groups of 3 leave the last groups
    short or empty. The twin's plain loop over t gives the chunked loop's bits."""
    shape = dict(H=64, D=32, T=5)
    plan = make_plan(**shape)
    g = torch.Generator().manual_seed(7)
    partials = torch.randn(37, 5, 2, 64, generator=g).to(DEVICE)
    inputs = make(1, 1, DEVICE, **shape)
    table_f32 = torch.randn(5, 128, generator=g).to(DEVICE) * 0.3
    twin = numba_backward.reduce_partials(partials, inputs.norm_weight, table_f32, shape["D"])
    host = reduce_partials_transcribed(partials, inputs.norm_weight, table_f32, plan.sum_groups)
    for name, a, b in zip(("d_table", "d_norm_weight", "d_bias"), twin, host):
        assert same_bits(a, b), name


# the backward's kernels for numba's real CUDA target (tests/numba/conftest.py: `twin_ptx_for_sm90` compiles them in one
# process with test_forward.py's)
SM90_SIGS = """
from adaln_lab.ops.final_adaln_out.twin import backward_kernels as nb
from adaln_lab.core.plan import plan as make_plan
nb._nc()
from numba import cuda, float32, int64, uint16
p = make_plan(5376, 2688, 3)
u2, f2 = uint16[:, ::1], float32[:, ::1]
sigs = {
    "norm_modulate_bwd": (nb.norm_modulate_bwd_kernel(p), (u2, u2, float32[::1], uint16[::1], f2, int64[::1], u2,
                                                           float32[:, :, :, ::1], int64, int64, int64), "fma.rn.f32"),
    "reduce_partials": (nb.reduce_partials_kernel(p), (float32[:, :, :, ::1], uint16[::1], f2, f2, uint16[::1],
                                                       uint16[::1], int64), "fma.rn.f64"),
    "table_bwd": (nb.table_bwd_kernel(p), (f2, f2, u2, u2, float32[:, :, ::1]), "fma.rn.f32"),
    "table_bwd_reduce": (nb.table_bwd_reduce_kernel(p), (float32[:, :, ::1], f2, f2, int64), "fma.rn.f64"),
}
"""


@pytest.mark.xdist_group("numba_sm90")  # with test_forward.py's: one process compiles both (`twin_ptx_for_sm90`)
def test_twin_backward_compiles_for_the_cuda_target_without_a_gpu(twin_ptx_for_sm90):
    """numba's real CUDA target (NVVM from the test extra), not the simulator, at the model's shape;
    the fma the twin writes survive as fma.rn instructions."""
    stdout = twin_ptx_for_sm90
    for name in ("norm_modulate_bwd", "reduce_partials", "table_bwd", "table_bwd_reduce"):
        assert f"{name} ok" in stdout, stdout


# ---------------------------------------------------------------- on a GPU: the kernels' bits

@pytest.mark.gpu
@pytest.mark.parametrize("shape, rows", [(dict(H=5376, D=2688, T=3), 4097), (dict(H=264, D=64, T=1), 7),
                                         (dict(H=1024, D=256, T=8), 300)], ids=str)
def test_twin_equals_kernels_cu_bit_for_bit(shape, rows):
    """The twin against launch_backward's four kernels (through the launch ops on route "cupy", on the forward
    launch op's table_f32 and rstd) and against the op's autograd (backend="cupy"), every gradient bit for bit.
    T = 8 walks reduce_partials in two chunks; 300 and 4097 rows put 3 and 32 rows in each row range."""
    from adaln_lab import final_adaln_out
    from adaln_lab.core.plan import forward_workspace
    from adaln_lab.ops.final_adaln_out import launch

    inputs = make(1, rows, "cuda", **shape)
    (T, D), H = inputs.temb.shape, inputs.x.shape[-1]
    out = torch.empty_like(inputs.x)
    workspace = torch.empty(forward_workspace(T, H, rows, D)[1], dtype=torch.uint8, device="cuda")
    launch.forward(*inputs.args, EPS, "cupy", "cuda", out, workspace)
    _, table_f32, rstd = launch.saved_views(workspace, T, H, rows, D)
    dy = upstream(1, out)
    kernels = launch_backward(dy, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight, inputs.timestep_indices,
                              table_f32, rstd)
    torch.cuda.synchronize()
    twin = numba_backward.backward(dy, inputs.x, rstd, inputs.norm_weight, table_f32, inputs.timestep_indices,
                                   inputs.temb, inputs.weight)
    torch.cuda.synchronize()
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs.leaves]
    final_adaln_out(*leaves, inputs.timestep_indices, EPS, backend="cupy").backward(dy)
    for name, a, b, leaf in zip(NAMES, twin, kernels, leaves):
        assert same_bits(a, b), name
        assert same_bits(a, leaf.grad), name


@pytest.mark.gpu
def test_twin_poisons_like_kernels_cu():
    """An index outside [0, T): the same NaN and the same bits elsewhere as the kernels."""
    inputs = make(2, 300, "cuda", H=264, D=64, T=3)
    idx = inputs.timestep_indices.clone()
    idx[5], idx[200] = 3, -1
    rstd, table_f32 = saved_tensors(inputs)
    dy = upstream(2, inputs.x)
    kernels = launch_backward(dy, inputs.x, inputs.norm_weight, inputs.temb, inputs.weight, idx, table_f32, rstd)
    twin = numba_backward.backward(dy, inputs.x, rstd, inputs.norm_weight, table_f32, idx, inputs.temb, inputs.weight)
    torch.cuda.synchronize()
    assert bool(twin[0][5].float().isnan().all())
    for name, a, b in zip(NAMES, twin, kernels):
        assert same_bits(a, b), name
