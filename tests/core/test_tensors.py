"""GPU tests of the torch glue of the CUDA kernels on their own: adaln_lab/core/tensors.py and the ops' launch
bodies on route "cupy" (`ops/<op>/launch.py`), called with outputs allocated here as the ops' Functions allocate
them (the helpers below, which tests/ops/test_row_order.py and test_modulation_table.py use too).

norm_out's (`table`, `norm_modulate`): the table within the dot product's error bound and T-invariant, the
staged and row-per-block forward kernels bit for bit. The H3 blocks' AdaLN ops: the N-column table against
diffusers' and T-invariant, the modulated norm bitwise equal to norm_out's kernels, the gated residual
bitwise equal to diffusers' bf16 ops, every gradient against float64, repeatable, row-invariant, and
exactly zero for an empty batch."""

import pytest
import torch
import torch.nn.functional as F

from adaln_lab import final_adaln_out
from adaln_lab.core import tensors
from adaln_lab.harness.accuracy import bf16_ulp
from adaln_lab.harness.inputs import make
from adaln_lab.ops.gated_residual import launch as residual_launch
from adaln_lab.ops.gated_residual_norm import launch as pair_launch
from adaln_lab.ops.modulated_rms_norm import launch as norm_launch
from adaln_lab.ops.modulation_table import launch as table_launch

pytestmark = pytest.mark.gpu
H, D, T = 1024, 256, 3
R = 3 * T
BF16 = torch.bfloat16


# ---------------------------------------------------------------- the launch bodies on route "cupy"

def table_fwd(temb, weight, bias):
    """table (T, N) fp32 holding bf16 values: table.cu (modulation_table.launch.forward), its bf16 buffer (the
    block's two row tables (3T, 2H) for N = 18H, else (T, N), then act) allocated as ModulationTable does."""
    T_, N = temb.shape[0], weight.shape[0]
    table = torch.empty(T_, N, dtype=torch.float32, device=temb.device)
    table_bf16 = torch.empty(table_launch.bf16_elements(T_, N, temb.shape[1]), dtype=BF16, device=temb.device)
    table_launch.forward(temb, weight, bias, "cupy", "cuda", table, table_bf16)
    return table


def table_bwd(d_table, temb, weight):
    """(d_temb, d_weight, d_bias): table_bwd.cu (modulation_table.launch.backward), d_bias in weight's dtype."""
    grads = (torch.empty_like(temb), torch.empty_like(weight), weight.new_empty(weight.shape[:1]))
    table_launch.backward(d_table, temb, weight, "cupy", *grads)
    return grads


def norm_fwd(x, norm_weight, shift, scale, row_index, eps):
    """(out, rstd): norm_modulate.cu on shift | scale (modulated_rms_norm.launch.forward, table dtype bf16)."""
    out = torch.empty_like(x)
    rstd = torch.empty(x.numel() // x.shape[-1], dtype=torch.float32, device=x.device)
    norm_launch.forward(x, norm_weight, shift, scale, row_index, float(eps), BF16, "cupy", None, 0, out, rstd)
    return out, rstd


def norm_bwd(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual=None, order=None):
    """(dx, d_norm_weight, d_shift, d_scale): the sorted row pass and its reduce (modulated_rms_norm.launch.backward),
    d_shift | d_scale written side by side into one (R, 2H) fp32 table gradient, as the op's own buffer."""
    R_, H_ = shift.shape
    dx, d_norm_weight = torch.empty_like(x), torch.empty_like(norm_weight)
    d_table = torch.empty(R_, 2 * H_, dtype=torch.float32, device=x.device)
    norm_launch.backward(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, order, "cupy", dx,
                         d_norm_weight, d_table, 0, None)
    return dx, d_norm_weight, d_table[:, :H_], d_table[:, H_:]


def gr_fwd(x, gate, y, row_index):
    """out = x + gate[row_index] * y: gated_residual.cu (gated_residual.launch.forward, table dtype bf16)."""
    out = torch.empty_like(x)
    residual_launch.forward(x, gate, y, row_index, BF16, "cupy", out)
    return out


def gr_bwd(dout, gate, y, row_index, order=None):
    """(d_gate (R, H) fp32, d_y): gated_residual.cu's sorted backward (gated_residual.launch.backward)."""
    d_y = torch.empty_like(y)
    d_gate = torch.empty(gate.shape, dtype=torch.float32, device=y.device)
    residual_launch.backward(dout, gate, y, row_index, order, BF16, "cupy", d_y, d_gate, 0, None)
    return d_gate, d_y


def grn_fwd(x, gate, y, row_index, norm_weight, shift, scale, eps):
    """(x_out, out, rstd): gated_residual_norm.cu (gated_residual_norm.launch.forward, route "cupy")."""
    x_out, out = torch.empty_like(x), torch.empty_like(x)
    rstd = torch.empty(x.numel() // x.shape[-1], dtype=torch.float32, device=x.device)
    pair_launch.forward(x, gate, y, row_index, norm_weight, shift, scale, float(eps), BF16, "cupy", None, x_out,
                        out, rstd)
    return x_out, out, rstd


def _table_inputs(T_=T, N=18 * H, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    temb = torch.randn(T_, D, device="cuda", generator=g)
    weight = (torch.randn(N, D, device="cuda", generator=g) * 0.02).bfloat16()
    bias = (torch.randn(N, device="cuda", generator=g) * 0.1).bfloat16()
    return temb, weight, bias


def _rows(S, seed=1):
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(S, H, device="cuda", generator=g).bfloat16()
    y = torch.randn(S, H, device="cuda", generator=g).bfloat16()
    dy = torch.randn(S, H, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, R, (S,), device="cuda", generator=g)
    return x, y, dy, idx


def assert_table_within_the_dot_product_bound(table, temb, weight, bias):
    """table (T, N) holds, per entry, the exact linear(bf16(silu(temb)), weight, bias) summed in fp32 in some
    order and rounded to bf16 once: within (D + 2) 2^-24 sum|terms| of the exact value (any fp32 order, the
    bias add included), then one bf16 ulp of rounding. Entries near cancellation can differ from another
    order's (cuBLAS's) by more than one ulp of their own tiny size; this bound holds for both."""
    act = F.silu(temb).to(torch.bfloat16).double()
    w, b = weight.double(), bias.double()
    exact = act @ w.T + b
    bound = (temb.shape[1] + 2) * 2.0 ** -24 * (act.abs() @ w.abs().T + b.abs())
    error = (table.double() - exact).abs()
    assert bool((error <= bound + bf16_ulp(exact.abs() + bound)).all()), float((error - bound).max())


# ---------------------------------------------------------------- norm_out's table and forward

def test_cuda_table_within_the_dot_product_error_bound():
    """table_f32 is within the fp32 summation bound of the exact table; table is it rounded once."""
    inputs = make(1, 4, "cuda", T=5)
    table_bf16, table_f32 = tensors.table(inputs.temb, inputs.weight, inputs.bias)
    act = torch.nn.functional.silu(inputs.temb).to(torch.bfloat16).double()
    w = inputs.weight.double()
    exact = act @ w.T + inputs.bias.double()
    bound = (inputs.temb.shape[1] + 2) * 2.0 ** -24 * ((act.abs() @ w.abs().T) + inputs.bias.double().abs())
    assert bool(((table_f32.double() - exact).abs() <= bound).all())
    assert torch.equal(table_bf16, table_f32.to(torch.bfloat16))


def test_table_rows_are_T_invariant():
    full = make(1, 4, "cuda", H=5376, D=2688, T=8)
    table_bf16, table_f32 = tensors.table(full.temb, full.weight, full.bias)
    for picked in ([0], [5, 2], [7, 0, 3], [1, 2, 3, 4, 5, 6]):
        sub_bf16, sub_f32 = tensors.table(full.temb[picked].contiguous(), full.weight, full.bias)
        assert torch.equal(sub_bf16, table_bf16[picked])
        assert torch.equal(sub_f32.view(torch.int32), table_f32[picked].view(torch.int32))


def test_staged_and_row_per_block_forward_agree_bit_for_bit(monkeypatch):
    """The staged kernel and the row-per-block fallback share the thread map and tree: same bits per row."""
    from adaln_lab.core import launchers, plan as plan_module

    inputs = make(3, 1500, "cuda")
    tab, _ = tensors.table(inputs.temb, inputs.weight, inputs.bias)
    monkeypatch.setitem(plan_module.TUNING, "FWD_WARP_VECTORS_MAX", 0)  # the row-block kernels, not the warp's
    launchers.forget_compiled()
    assert plan_module.plan(5376, 2688, 3).fwd_staged and not plan_module.plan(5376, 2688, 3).fwd_warp
    out, rstd = tensors.norm_modulate(inputs.x, inputs.norm_weight, tab, inputs.timestep_indices, 1e-5,
                                      inputs.temb.shape[1])
    monkeypatch.setitem(plan_module.TUNING, "FWD_STAGES", 1)  # below 2 stages: the row-per-block kernel
    launchers.forget_compiled()
    try:
        assert not plan_module.plan(5376, 2688, 3).fwd_staged
        out2, rstd2 = tensors.norm_modulate(inputs.x, inputs.norm_weight, tab, inputs.timestep_indices, 1e-5,
                                            inputs.temb.shape[1])
    finally:
        monkeypatch.undo()
        launchers.forget_compiled()
    assert torch.equal(out, out2) and torch.equal(rstd, rstd2)


@pytest.mark.parametrize("H", [8, 1000, 2056, 5376, 6144])
def test_row_per_warp_forward_agrees_with_the_row_block_bit_for_bit(monkeypatch, H):
    """norm_modulate_warp_bf16 plays the row block's threads lane by lane (the same per-thread sums, warp
    butterflies and last step): the same out and rstd bits as the row-block kernels, an invalid index included,
    at widths whose last vectors leave threads of the row block idle."""
    from adaln_lab.core import launchers, plan as plan_module

    inputs = make(3, 67, "cuda", H=H, D=64, T=3)
    idx = inputs.timestep_indices.clone()
    idx[5] = 3  # outside [0, T): a NaN row
    tab, _ = tensors.table(inputs.temb, inputs.weight, inputs.bias)
    outs = {}
    try:
        for warp in (0, 64):
            monkeypatch.setitem(plan_module.TUNING, "FWD_WARP_VECTORS_MAX", warp)
            launchers.forget_compiled()
            assert plan_module.plan(H, 64, 3).fwd_warp == bool(warp)
            outs[warp] = tensors.norm_modulate(inputs.x, inputs.norm_weight, tab, idx, 1e-5, 64)
    finally:  # no plan built under the override outlives the test
        monkeypatch.undo()
        launchers.forget_compiled()
    (out, rstd), (out2, rstd2) = outs[0], outs[64]
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(rstd, rstd2)
    assert bool(out[5].isnan().all())


# ---------------------------------------------------------------- the blocks' ops

def test_table_matches_diffusers_and_is_t_invariant():
    temb, weight, bias = _table_inputs()
    table = table_fwd(temb, weight, bias)
    assert table.dtype == torch.float32 and table.shape == (T, 18 * H)
    assert torch.equal(table, table.bfloat16().float())  # bf16 values
    diffusers = F.linear(F.silu(temb).bfloat16(), weight, bias).float()
    assert (table == diffusers).float().mean().item() >= 0.999
    assert_table_within_the_dot_product_bound(table, temb, weight, bias)
    assert_table_within_the_dot_product_bound(diffusers, temb, weight, bias)
    for rows in ([1], [2, 0], [0]):
        sub = table_fwd(temb[rows].contiguous(), weight, bias)
        assert torch.equal(sub, table[rows])


def test_table_backward_against_float64_and_repeatable():
    temb, weight, bias = _table_inputs()
    d_table = torch.randn(T, 18 * H, device="cuda")
    d_temb, d_weight, d_bias = table_bwd(d_table, temb, weight)
    again = table_bwd(d_table, temb, weight)
    assert all(torch.equal(a, b) for a, b in zip((d_temb, d_weight, d_bias), again))
    t64 = temb.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    b64 = bias.double().requires_grad_(True)
    (F.linear(F.silu(t64), w64, b64) * d_table.double()).sum().backward()
    assert torch.allclose(d_weight.double(), w64.grad, rtol=2 ** -8, atol=1e-6)
    assert torch.allclose(d_bias.double(), b64.grad, rtol=2 ** -8, atol=1e-6)
    assert torch.allclose(d_temb.double(), t64.grad, rtol=1e-4, atol=1e-4)


def table_bwd_case(rows: int, N: int = 18 * H + 72, D_: int = 264):
    """(d_table (rows, N) fp32, temb (rows, D_) fp32, weight (N, D_) bf16) on the GPU, seeded by rows: N not a
    multiple of the row blocks, D_ not of the column tiles."""
    g = torch.Generator("cuda").manual_seed(rows)
    temb = torch.randn(rows, D_, device="cuda", generator=g)
    weight = (torch.randn(N, D_, device="cuda", generator=g) * 0.02).bfloat16()
    return torch.randn(rows, N, device="cuda", generator=g), temb, weight


@pytest.mark.parametrize("rows", [3, 9])
def test_split_and_fused_table_backward_agree_bit_for_bit(monkeypatch, rows):
    """table_bwd_bf16 and its two halves (plan.tb_split, T >= TB_SPLIT_MIN_T) sum the same terms in the
    same order on the same row blocks: the same d_weight and d_temb bits, at T below and above the split, N
    not a multiple of TB_ROWS (a ragged last row block) and D not a multiple of the 256-column tile. (The
    shipped plan gives the halves other row blocks, TB_SPLIT_ROWS; here both take TB_ROWS, so that the one
    difference left is the kernels'.)"""
    from adaln_lab.core import launchers, plan as plan_module

    d_table, temb, weight = table_bwd_case(rows)
    N, D_ = weight.shape
    results = {}
    try:
        for split_min_t in (rows, rows + 1):  # split, then fused
            monkeypatch.setitem(plan_module.TUNING, "TB_SPLIT_MIN_T", split_min_t)
            monkeypatch.setitem(plan_module.TUNING, "TB_SPLIT_ROWS", plan_module.TUNING["TB_ROWS"])
            launchers.forget_compiled()
            split = plan_module.plan(8, D_, rows, table_n=N, table_f32_rounded=True).tb_split
            assert split == (split_min_t == rows)  # the path asked for is the path taken
            results[split] = table_bwd(d_table, temb, weight)
    finally:
        monkeypatch.undo()
        launchers.forget_compiled()
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    exact = d_table.double().T @ F.silu(temb.double())  # d_weight in float64: both are it rounded once
    assert torch.allclose(results[True][1].double(), exact, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("rows", [3, 17])
def test_every_lane_width_of_the_table_backward_gives_the_same_bits(monkeypatch, rows):
    """table_bwd.cu's columns per lane (plan.tb_vec: 8, 4 or 2, by TB_ACC_MAX) are speed only: each column's sums
    have the same terms in the same order, so d_weight, d_temb and d_bias are the same bits for every width, in
    the one kernel (T = 3) and its halves (T = 17); D = 264 not a multiple of the 64-column tiles."""
    from adaln_lab.core import launchers, plan as plan_module

    d_table, temb, weight = table_bwd_case(rows)
    N, D_ = weight.shape
    results = {}
    try:
        monkeypatch.setitem(plan_module.TUNING, "TB_MMA_MIN_T", 1000)  # the CUDA-core halves, not table_bwd_mma.cu
        for vec in (8, 4, 2):
            fused = 2 if rows < plan_module.TUNING["TB_SPLIT_MIN_T"] else 1  # the one kernel keeps both halves'
            monkeypatch.setitem(plan_module.TUNING, "TB_ACC_MAX", fused * rows * vec if vec > 2 else 0)
            launchers.forget_compiled()
            assert plan_module.plan(8, D_, rows, table_n=N, table_f32_rounded=True).tb_vec == vec
            results[vec] = table_bwd(d_table, temb, weight)
    finally:
        monkeypatch.undo()
        launchers.forget_compiled()
    assert all(torch.equal(a, b) for vec in (4, 2) for a, b in zip(results[8], results[vec]))


@pytest.mark.parametrize("rows", [12, 32])
def test_table_backward_on_tensor_cores_within_its_derived_bounds_and_dact_rows_t_invariant(rows):
    """table_bwd_mma.cu (plan.tb_mma, from TB_MMA_MIN_T table rows) against float64, within the bounds its sums
    allow: the fp32 SiLU within 2^-21 of silu; each product exact but for the split's dropped terms (<= 3 x 2^-24
    of it); each mma's sum within 2^-21 of the sum of |terms| it has added (the published models of tensor-core
    accumulation: 16 products and c aligned to the largest, a few extra bits, truncated: <= 1.5 x 2^-22 with 3;
    6 mma a k step for d_weight over ceil(T / 16) steps, 3 a step for dact over TB_SPLIT_ROWS / 16 steps a row
    block, the blocks added in double); d_weight is then rounded once to bf16, so it lies between the roundings of
    the exact value -+ that bound. d_bias is table_bwd.cu's double sum: its rounding alone. A timestep's
    d_temb is the same bits in another batch of T >= TB_MMA_MIN_T rows (dact's rows are independent). N not a
    multiple of 64, D = 264 not a multiple of the 64- or 128-column tiles."""
    from adaln_lab.core import plan as plan_module

    d_table, temb, weight = table_bwd_case(rows, N=18 * H + 48)
    N, D_ = weight.shape
    g = torch.Generator("cuda").manual_seed(rows + 1000)  # the other batch's extra rows
    p = plan_module.plan(8, D_, rows, table_n=N, table_f32_rounded=True)
    assert p.tb_mma and p.blocks_j == -(-N // plan_module.TUNING["TB_SPLIT_ROWS"])
    d_temb, d_weight, d_bias = table_bwd(d_table, temb, weight)
    act, gd, wd = F.silu(temb.double()), d_table.double(), weight.double()
    exact_w, terms_w = gd.T @ act, gd.abs().T @ act.abs()
    err_w = (2 ** -21 + 3 * 2 ** -24 + 6 * -(-rows // 16) * 2 ** -21) * terms_w  # 2^-21: fp32 SiLU, a few ulps
    # the fp32 sum y lies in exact -+ err_w, and rounding is monotone: bf16(y) between the bounds' roundings
    low, high = (exact_w - err_w).float().bfloat16(), (exact_w + err_w).float().bfloat16()
    assert bool(((low <= d_weight) & (d_weight <= high)).all())
    assert torch.equal(d_bias, gd.sum(0).float().bfloat16())
    s = torch.sigmoid(temb.double())
    slope = s * (1 + temb.double() * (1 - s))  # silu'
    exact_t, terms_t = (gd @ wd) * slope, (gd.abs() @ wd.abs()) * slope.abs()
    steps = plan_module.TUNING["TB_SPLIT_ROWS"] // 16
    assert bool(((d_temb.double() - exact_t).abs() <= (3 * 2 ** -24 + 3 * steps * 2 ** -21) * terms_t + 1e-30).all())
    if rows + 8 <= plan_module.T_MAX:  # the same rows with 8 more after them (dact's passes: 1 m-tile, then 2)
        more = table_bwd(torch.cat([d_table, torch.randn(8, N, device="cuda", generator=g)]),
                         torch.cat([temb, torch.randn(8, D_, device="cuda", generator=g)]), weight)[0]
        assert torch.equal(more[:rows], d_temb)
    else:  # the rows without the first 3
        assert torch.equal(table_bwd(d_table[3:].contiguous(), temb[3:].contiguous(), weight)[0], d_temb[3:])


EVERY_TILE = ((32, 1, 1, 2), (32, 2, 2, 4), (32, 2, 4, 3), (32, 4, 1, 2), (32, 1, 4, 1), (32, 1, 8, 2))


@pytest.mark.parametrize("T_", [3, 9, 17])
def test_every_table_tile_gives_the_same_bits_and_rows_alone_their_batchs(monkeypatch, T_):
    """table.cu's tile shapes (TABLE_TILES: 16 MT rows x 8 NT timesteps, AHEAD steps in flight) are speed only:
    every shape gives every table element the same bits, and a timestep computed alone (T = 1, at another
    position of its tile) or a slice of the columns computed alone gives the batch's bits. N not a multiple of
    any tile's rows (ragged last tiles), D = 264 not a multiple of the 32 k of a step (lanes past D in the last).
    Every tile at T 17 (full and ragged timestep tiles of 8 and 16, ragged ones of 32 and 64: each tile one unit
    compiled); at T 3 and 9 the plan's own tile alone."""
    from adaln_lab.core import launchers, plan as plan_module

    g = torch.Generator("cuda").manual_seed(T_)
    N, D_ = 18 * H + 72, 264
    temb = torch.randn(T_, D_, device="cuda", generator=g)
    weight = (torch.randn(N, D_, device="cuda", generator=g) * 0.05).bfloat16()
    bias = (torch.randn(N, device="cuda", generator=g) * 0.1).bfloat16()
    tables = {}
    if T_ == 17:
        try:
            for tile in EVERY_TILE:
                monkeypatch.setitem(plan_module.TUNING, "TABLE_TILES", (tile,))
                launchers.forget_compiled()
                assert plan_module.plan(8, D_, T_, table_n=N, table_f32_rounded=True).table_tile == tile[1:]
                tables[tile] = table_fwd(temb, weight, bias)
        finally:
            monkeypatch.undo()
            launchers.forget_compiled()
    tables["shipped"] = table_fwd(temb, weight, bias)
    first = next(iter(tables.values()))
    assert all(torch.equal(t, first) for t in tables.values())
    for t in range(T_):  # alone, and in a window of two at the other position of a pair
        assert torch.equal(table_fwd(temb[t:t + 1], weight, bias), first[t:t + 1])
        if t + 2 <= T_:
            assert torch.equal(table_fwd(temb[t:t + 2], weight, bias), first[t:t + 2])
    for a, b in ((8, 40), (72, 18 * H), (N - 24, N)):  # column slices alone
        assert torch.equal(table_fwd(temb, weight[a:b].contiguous(), bias[a:b].contiguous()), first[:, a:b])
    exact = F.linear(F.silu(temb.double()).bfloat16().double(), weight.double(), bias.double())
    assert torch.allclose(first.double(), exact, rtol=2 ** -7, atol=1e-3)


def test_modulated_norm_is_norm_outs_kernels():
    """With norm_out's table split into shift and scale, the forward is final_adaln_out's, bit for bit."""
    inputs = make(1, 300, "cuda", H=H, D=D, T=T)
    table = table_fwd(inputs.temb, inputs.weight, inputs.bias)
    shift, scale = table[:, :H], table[:, H:]
    out, rstd = norm_fwd(inputs.x, inputs.norm_weight, shift, scale, inputs.timestep_indices, 1e-5)
    expected = final_adaln_out(*inputs.args, 1e-5, backend="cupy")
    assert torch.equal(out, expected)
    assert rstd.shape == (inputs.x.numel() // H,)


def test_modulated_norm_backward_against_float64_repeatable_and_row_invariant():
    x, _, dy, idx = _rows(700)
    temb, weight, bias = _table_inputs()
    table = table_fwd(temb, weight, bias).view(R, 6 * H)
    shift, scale = table[:, 3 * H:4 * H], table[:, 4 * H:5 * H]  # norm2's chunks: strided views
    nw = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
    out, rstd = norm_fwd(x, nw, shift, scale, idx, 1e-5)
    grads = norm_bwd(dy, x, nw, shift, scale, idx, rstd)
    again = norm_bwd(dy, x, nw, shift, scale, idx, rstd)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    dx, d_nw, d_shift, d_scale = grads
    perm = torch.randperm(700, device="cuda")[:333]
    out_p, rstd_p = norm_fwd(x[perm], nw, shift, scale, idx[perm], 1e-5)
    dx_p = norm_bwd(dy[perm], x[perm], nw, shift, scale, idx[perm], rstd_p)[0]
    assert torch.equal(out_p, out[perm]) and torch.equal(dx_p, dx[perm])
    x64, nw64 = x.double().requires_grad_(True), nw.double().requires_grad_(True)
    sh64, sc64 = shift.double().requires_grad_(True), scale.double().requires_grad_(True)
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * nw64
    (normed * (1 + sc64[idx]) + sh64[idx]).backward(dy.double())
    assert torch.allclose(dx.double(), x64.grad, rtol=2 ** -7, atol=1e-3)
    assert torch.allclose(d_shift.double(), sh64.grad, rtol=1e-5, atol=1e-4)
    assert torch.allclose(d_scale.double(), sc64.grad, rtol=1e-5, atol=1e-4)
    assert torch.allclose(d_nw.double(), nw64.grad, rtol=2 ** -7, atol=1e-2)


def test_shift_and_scale_read_in_place_or_gathered_give_the_same_bits():
    """The blocks' chunks (scale right after shift in each row of the (3T, 6H) table view) are read in place,
    any other shift and scale gathered into an (R, 2H) array: forward, gated-residual forward and backward give
    the same bits either way; a shift and scale swapped (a planted layout mix-up) change the output."""
    x, y, dy, idx = _rows(300)
    temb, weight, bias = _table_inputs()
    table = table_fwd(temb, weight, bias).view(R, 6 * H)
    shift, scale, gate = table[:, 3 * H:4 * H], table[:, 4 * H:5 * H], table[:, 2 * H:3 * H]
    nw = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
    assert tensors.shift_scale(shift, scale) == (shift, 6 * H)  # in place: the same tensor, row stride 6H
    layouts = {"in place": (shift, scale), "copies": (shift.clone(), scale.clone()),
               "bf16": (shift.bfloat16(), scale.bfloat16())}
    assert tensors.shift_scale(*layouts["copies"])[1] == 2 * H
    results = {}
    for name, (sh, sc) in layouts.items():
        out, rstd = norm_fwd(x, nw, sh, sc, idx, 1e-5)
        grads = norm_bwd(dy, x, nw, sh, sc, idx, rstd, d_residual=y)
        fused = grn_fwd(x, gate, y, idx, nw, sh, sc, 1e-5)
        results[name] = [out, rstd, *grads, *fused]
    for name in ("copies", "bf16"):
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["in place"])), name
    swapped, _ = norm_fwd(x, nw, scale, shift, idx, 1e-5)
    assert not torch.equal(swapped, results["in place"][0])


def test_gated_residual_matches_diffusers_bitwise():
    x, y, dy, idx = _rows(513)
    temb, weight, bias = _table_inputs()
    gate = table_fwd(temb, weight, bias).view(R, 6 * H)[:, 2 * H:3 * H]  # gate_msa
    gate_bf16 = gate.bfloat16()
    out = gr_fwd(x, gate, y, idx)
    assert torch.equal(out, x + gate_bf16.index_select(0, idx) * y)
    d_gate, d_y = gr_bwd(dy, gate, y, idx)
    assert torch.equal(d_y, dy * gate_bf16.index_select(0, idx))
    exact = torch.zeros(R, H, dtype=torch.float64, device="cuda").index_add_(0, idx, dy.double() * y.double())
    assert torch.allclose(d_gate.double(), exact, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip((d_gate, d_y), gr_bwd(dy, gate, y, idx)))
    perm = torch.randperm(513, device="cuda")[:200]
    assert torch.equal(gr_bwd(dy[perm], gate, y[perm], idx[perm])[1], d_y[perm])


@pytest.mark.parametrize("threads", [96, 128])
def test_gated_residual_bits_do_not_depend_on_its_block_size(monkeypatch, threads):
    """GR_THREADS_MAX (a TUNING knob, bench/scripts/block_ab.py) picks how columns split over blocks; each column's
    sums still run over the same rows in the same order: out, d_y and d_gate keep their bits (H 5376 and
    1032 rows: a column tile left partly empty at every block size)."""
    from adaln_lab.core import launchers, plan as plan_module

    g = torch.Generator("cuda").manual_seed(threads)
    H_, S = 5376, 1032
    x, y, dy = (torch.randn(S, H_, device="cuda", generator=g).bfloat16() for _ in range(3))
    idx = torch.randint(0, R, (S,), device="cuda", generator=g)
    gate = torch.randn(R, H_, device="cuda", generator=g).bfloat16().float()
    results = {}
    try:
        for value in (plan_module.TUNING["GR_THREADS_MAX"], threads):
            monkeypatch.setitem(plan_module.TUNING, "GR_THREADS_MAX", value)
            launchers.forget_compiled()
            out = gr_fwd(x, gate, y, idx)
            results[value] = (out, *gr_bwd(dy, gate, y, idx))
    finally:
        monkeypatch.undo()
        launchers.forget_compiled()
    shipped, other = results.values()
    assert all(torch.equal(a, b) for a, b in zip(shipped, other))


def test_empty_batch_gives_zero_gradients():
    x, y, dy, idx = (t[:0] for t in _rows(4))
    temb, weight, bias = _table_inputs()
    table = table_fwd(temb, weight, bias).view(R, 6 * H)
    gate, shift, scale = table[:, 2 * H:3 * H], table[:, :H], table[:, H:2 * H]
    assert gr_fwd(x, gate, y, idx).shape == (0, H)
    d_gate, d_y = gr_bwd(dy, gate, y, idx)
    assert d_y.shape == (0, H) and torch.equal(d_gate, torch.zeros_like(d_gate))
    nw = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    out, rstd = norm_fwd(x, nw, shift, scale, idx, 1e-5)
    dx, d_nw, d_shift, d_scale = norm_bwd(dy, x, nw, shift, scale, idx, rstd)
    assert out.shape == (0, H) and dx.shape == (0, H)
    assert not d_nw.any() and not d_shift.any() and not d_scale.any()


def test_out_of_range_index_gives_nan_not_a_wild_read():
    x, y, dy, idx = _rows(64)
    idx = idx.clone()
    idx[5] = R + 7
    temb, weight, bias = _table_inputs()
    gate = table_fwd(temb, weight, bias).view(R, 6 * H)[:, 2 * H:3 * H]
    out = gr_fwd(x, gate, y, idx)
    assert out[5].isnan().all() and not out[4].isnan().any()
    d_gate, d_y = gr_bwd(dy, gate, y, idx)
    assert d_y[5].isnan().all() and d_gate.isnan().any()


def test_a_scratch_is_taken_only_where_it_holds_the_floats_from_a_16_byte_boundary():
    """tensors.scratch: the partials given where they hold the floats from a 16-byte boundary (the kernels store
    float4), else a new float32 tensor of that size (None, too short, or misaligned)."""
    given = torch.empty(104, dtype=torch.float32)
    assert tensors.scratch(given, 100, given.device) is given
    for other in (None, given[:99], given[1:]):
        made = tensors.scratch(other, 100, given.device)
        assert made is not other and made.numel() == 100 and made.dtype == torch.float32
