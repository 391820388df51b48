"""An H3 block's AdaLN under adaln_lab.nn.ExactGradients: on the CPU (the ops' torch code) diffusers' forward bits
and the ops' dx; the AdaLN parameters' gradients the same bits for one batch, its rows permuted, and micro-batches
of 2, 3 and 8 parts by sample and within samples in any order (attn and ff row-wise, so a split changes no row's
terms), on the CPU and on the kernels (backend "cupy", GPU); each gradient the correctly rounded exact function of
its row terms; a planted float32 accumulation caught; misuse refused."""

import re
from fractions import Fraction

import pytest
import torch

from adaln_lab import block_adaln_path
from adaln_lab.core import plan
from adaln_lab.core.exact import round_scaled
from adaln_lab.nn import ExactGradients
from adaln_lab.ops.row_sums import torch_terms
from adaln_lab.reference.backward import (gated_residual_backward, modulated_rms_norm_backward, rows_index,
                                          rstd_of)
from adaln_lab.reference.block import (replay_block_adaln, replay_gated_residual, replay_modulated_rms_norm,
                                       table_chunks)
from adaln_lab.reference.final_adaln_out import rms_norm, table_rows

from ..exact_parts import block_params, by_sample, time_embedding, within

B, S, H, D, T = 8, 18, 16, 8, 2


def model(seed: int = 0, dtype=torch.bfloat16, device="cpu"):
    """(params: weight, bias, norm1_weight, norm2_weight, the time embedding's Linear), row-wise attn and ff, the
    batch (x, timestep features, row_index, cotangent), on `device` (CUDA: attn elementwise, as a matmul's rows on
    cuBLAS depend on the batch)."""
    g = torch.Generator().manual_seed(seed)
    params = block_params(g, H, D, dtype)
    embed = time_embedding(g, D)
    mix = (torch.randn(H, H, generator=g) / H ** 0.5).to(dtype)
    attn = (lambda h: torch.tanh(h @ mix)) if device == "cpu" else torch.tanh
    ff = (lambda h: h * torch.sigmoid(h))
    x = (torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-3, 4, (B, S, 1), generator=g))).to(dtype)
    feats = torch.randn(T, 4, generator=g)
    row_index = torch.randint(0, 3 * T, (S,), generator=g)
    cot = torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-10, 4, (B, S, H), generator=g))
    params = [torch.nn.Parameter(p.detach().to(device)) for p in params]
    return params, embed.to(device), (attn, ff), tuple(t.to(device) for t in (x, feats, row_index, cot))


def step(params, embed, maps, parts, exact=True, order=None, backend="torch"):
    """Forward and backward of each part, then (weight, bias, norm1, norm2, embed.weight) gradients and the parts'
    outputs and x gradients."""
    for p in [*params, *embed.parameters()]:
        p.grad = None
    acc, outs = ExactGradients(), []
    for k in order or range(len(parts)):
        x, feats, row_index, cot = parts[k]
        x = x.detach().requires_grad_(True)
        with acc if exact else torch.enable_grad():
            out = block_adaln_path(x, embed(feats), *params, row_index, *maps, backend=backend)
            (out.float() * cot).sum().backward()
        outs.append((out.detach(), x.grad))
    if exact:
        acc.write()
    return [p.grad for p in params] + [embed.weight.grad], outs


def same(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a[:4], b[:4]))


def replay_rows(x, temb, weight, bias, n1, n2, row_index, attn, ff, norm=rms_norm):
    """diffusers' block (reference.block's replay) on the table computed a temb row at a time (`table_rows`)."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table_chunks(table_rows(temb, weight, bias), H)
    h = replay_modulated_rms_norm(x, n1, shift_msa, scale_msa, row_index, 1e-5, norm=norm)
    x = replay_gated_residual(x, gate_msa, attn(h), row_index)
    h = replay_modulated_rms_norm(x, n2, shift_mlp, scale_mlp, row_index, 1e-5, norm=norm)
    return replay_gated_residual(x, gate_mlp, ff(h), row_index)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_is_diffusers_bits_on_the_rowwise_table_and_dx_the_ops(dtype):
    """The output is diffusers' block on a table computed a temb row at a time (each row diffusers' bits for that row
    alone; with one timestep that is diffusers' block itself), and the output and dx are those of the block's ops
    outside ExactGradients on that table (their analytic derivative)."""
    params, embed, maps, (x, feats, row_index, cot) = model(dtype=dtype)
    for T_used, idx in ((T, row_index), (1, torch.zeros_like(row_index))):
        f = feats[:T_used]
        grads, [(out, dx)] = step(params, embed, maps, [(x, f, idx, cot)])
        temb, detached = embed(f).detach(), [p.detach() for p in params]
        want = replay_rows(x, temb, *detached, idx, *maps)
        assert torch.equal(out, want)
        xr = x.detach().requires_grad_(True)
        rowwise = table_rows(temb, detached[0], detached[1]).float()
        plain = block_adaln_path(xr, temb, *detached, idx, *maps, adapt_table=lambda table: rowwise)
        (plain.float() * cot).sum().backward()
        assert torch.equal(plain.detach(), out) and torch.equal(dx, xr.grad)
        assert all(g is not None and bool(torch.isfinite(g.float()).all()) for g in grads)
        if T_used == 1:
            assert torch.equal(out, replay_block_adaln(x, temb, *detached, idx, *maps))


ROUTES = [("cpu", "torch"), pytest.param("cuda", "cupy", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device, backend", ROUTES)
def test_permutations_and_micro_batches_give_the_same_bits(device, backend):
    params, embed, maps, batch = model(device=device)
    one, _ = step(params, embed, maps, [batch], backend=backend)
    x, feats, row_index, cot = batch
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(1)).to(device)
    assert same(step(params, embed, maps, [(x[:, perm], feats, row_index[perm], cot[:, perm])], backend=backend)[0],
                one)
    for n in (2, 3, 8):
        for parts in (by_sample(batch, n), within(batch, n)):
            for order in (None, list(reversed(range(len(parts))))):
                got, _ = step(params, embed, maps, parts, order=order, backend=backend)
                assert same(got, one), (n, order)
                assert torch.allclose(got[4], one[4], rtol=1e-4, atol=1e-5)  # temb's producer: reached


@pytest.mark.gpu
def test_on_the_kernels_each_ops_states_are_the_torch_codes_of_its_rows(monkeypatch):
    """Backend "cupy": each norm's and each gate's row pass with exact sums gives the state the torch code gives for
    the same tensors (x, the output's gradient, the saved rstd; y and the output's whole gradient, rstd 1), limb for
    limb (the wiring around them is the CPU-checked code), and no flag; dx is the plain block's, bit for bit; as a
    gross check (a wrong chunk, factor or rstd moves a gradient by a large part of its size), each gradient lies
    within 2^-6 of the largest of the plain kernels' (bf16 gradients, fixed-order float32 sums)."""
    from adaln_lab.ops.gated_residual import launch as gate_launch
    from adaln_lab.ops.modulated_rms_norm import launch as norm_launch
    from adaln_lab.ops.row_sums import half, row_sums

    seen = []
    gate_exact, norm_exact = gate_launch.backward_exact, norm_launch.backward_exact

    def gate_spy(dout, gate, y, row_index, order, d_y):
        state, flags = gate_exact(dout, gate, y, row_index, order, d_y)
        want = half(row_sums(y, dout, None, row_index, gate.shape[0], False)[0], 1)
        seen.append(("gate", int(flags) == 0, torch.equal(state.limbs, want.limbs)))
        return state, flags

    def norm_spy(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, order, dx):
        state, flags = norm_exact(dy, x, norm_weight, shift, scale, row_index, rstd, d_residual, order, dx)
        want = row_sums(x, dy, rstd, row_index, shift.shape[0], False)[0].limbs
        seen.append(("norm", int(flags) == 0, torch.equal(state.limbs, want)))
        return state, flags

    monkeypatch.setattr(gate_launch, "backward_exact", gate_spy)
    monkeypatch.setattr(norm_launch, "backward_exact", norm_spy)
    params, embed, maps, batch = model(device="cuda")
    exact, [(_, dx)] = step(params, embed, maps, [batch], backend="cupy")
    assert sorted(seen) == [("gate", True, True)] * 2 + [("norm", True, True)] * 2
    plain, [(_, plain_dx)] = step(params, embed, maps, [batch], exact=False, backend="cupy")
    assert torch.equal(dx, plain_dx)
    for e, p in zip(exact[:4], plain[:4]):
        assert float((e.float() - p.float()).abs().max()) <= 2 ** -6 * float(p.float().abs().max())


def test_the_kernel_routes_glue_runs_on_the_cpu_with_the_gpu_stood_in(monkeypatch):
    """Backend "cupy" with the GPU stood in (`bench.host_model.gpu_stood_in`: each launch's argument block written
    against its signature, the driver call a no-op): the exact block's forward launches the plain block's kernels;
    its backward runs each norm's and each gate's sorted pass with exact sums in place of the plain pass and its
    reduce (with the float64 windows, each pass's fixup kernel after it), a carry per state (and the table's at the
    `with`'s end) and no table backward (formed at write); write launches exact_products.cu's one pass for the
    projection's gradient and exact_state.cu's carries, products and roundings (no torch integer code on the GPU),
    and sets the four gradients in their parameters' dtypes."""
    from adaln_lab.bench import host_model
    from adaln_lab.harness.block_report import make_block
    from adaln_lab.ops.block import op

    def zero_table(*args):  # the stood-in table kernel writes nothing: zeros, so that 1 + scale is finite
        table, row_tables = exact_table(*args)
        return table.detach().zero_().requires_grad_(True), row_tables

    exact_table = op.exact_table
    monkeypatch.setattr(op, "exact_table", zero_table)
    b = make_block(3, 64, "cpu", H=64, D=32)
    x, n1, n2, temb, w, bias = (t.detach().clone().requires_grad_(True) for t in b.leaves)

    def run(acc):
        with acc or torch.enable_grad():
            out = block_adaln_path(x, temb, w, bias, n1, n2, b.timestep_indices, lambda h: h, lambda h: h,
                                   backend="cupy")
            host_model.LAUNCHES.clear()
            out.backward(torch.ones_like(out))
        return sorted(host_model.LAUNCHES)

    with host_model.gpu_stood_in():
        plain = run(None)
        for p in (w, bias, n1, n2):
            p.grad = None
        acc = ExactGradients()
        exact = run(acc)
        host_model.LAUNCHES.clear()
        acc.write()
        written = sorted(host_model.LAUNCHES)
    # the projection's gradient in one pass and temb's in three (exact_products.cu: the products' tree of N = 18 H =
    # 1152 rows five levels a launch, 1152 -> 36 -> 2 -> 1); the states' integer steps one launch each
    # (exact_state.cu): carries of d_bias's total, the norm sums' total and their two norms' states; products of
    # d_table, d_bias and the norm sums; roundings of d_table, d_bias and the two norm weights
    assert written == sorted(["exact_carry"] * 4 + ["exact_products"] * 3 + ["exact_round"] * 4
                             + ["exact_weight_products_bf16", "exact_input_products_bf16"] + ["exact_input_fold"] * 2)
    pairs = (("norm_modulate_bwd_residual_sorted_bf16", "reduce_partials_sorted_bf16"),
             ("gated_residual_bwd_sorted_bf16", "gated_residual_reduce_sorted"))
    gone = [name for pair in pairs for name in pair] * 2 + ["table_bwd_bf16", "table_bwd_reduce"]
    added = ["norm_modulate_bwd_residual_sorted_exact_bf16", "gated_residual_bwd_sorted_exact_bf16"] * 2
    if plan.TUNING["EXACT_ROW_DOUBLE"]:  # float64 windows (exact_row_windows.cu): each pass's fixups after it
        added += ["exact_fixup_sorted_bf16", "exact_fixup_gates_bf16"] * 2
    for name in gone:
        plain.remove(name)
    # a carry per state, and one of the table's state when the `with` ends (the parts folded in)
    assert exact == sorted(plain + added + ["exact_carry"] * 5)
    assert [(p.grad.dtype, p.grad.shape) for p in (w, bias, n1, n2)] == [(p.dtype, p.shape) for p in (w, bias, n1, n2)]


def test_float32_parameters_with_bf16_rows_record_through_a_float32_residual():
    """fp32 parameters and bf16 x without autocast (x_out promoted to fp32 by the first gated residual): the gate's
    terms take x_out's whole gradient in fp32, and every split gives the same bits."""
    params, embed, maps, batch = model(dtype=torch.float32)
    batch = (batch[0].bfloat16(), *batch[1:])
    one, _ = step(params, embed, maps, [batch])
    assert all(g.dtype == torch.float32 and bool(g.any()) for g in one[:4])
    for parts in (by_sample(batch, 3), within(batch, 2)):
        assert same(step(params, embed, maps, parts)[0], one)


@pytest.mark.parametrize("device, backend", ROUTES)
def test_a_planted_float32_accumulation_fails_the_same_check(device, backend):
    """Plain autograd (backend "torch": diffusers' ops; "cupy": the kernels' fixed-order sums) over the same splits
    changes the gradients."""
    params, embed, maps, batch = model(device=device)
    one, _ = step(params, embed, maps, [batch], exact=False, backend=backend)
    assert any(not same(step(params, embed, maps, parts, exact=False, backend=backend)[0], one)
               for n in (2, 3, 8) for parts in (by_sample(batch, n), within(batch, n)))


def exact_round(values) -> torch.Tensor:
    """float32 of each exact Fraction, rounded once (every value a multiple of 2^-298: float32 terms times float32
    factors)."""
    scaled = [v * 2 ** 298 for v in values]
    assert all(v.denominator == 1 for v in scaled)
    return torch.tensor([round_scaled(int(v), -298, 24) for v in scaled], dtype=torch.float64).float()


def grouped(terms: torch.Tensor, rows: torch.Tensor, R: int) -> list[list[Fraction]]:
    """[r][h] the exact sum of terms (n, H) float32 over the rows i with rows[i] = r."""
    sums = [[Fraction(0)] * terms.shape[1] for _ in range(R)]
    for r, row in zip(rows.tolist(), terms.tolist()):
        sums[r] = [a + Fraction(v) for a, v in zip(sums[r], row)]
    return sums


def test_the_gradients_are_the_correctly_rounded_exact_functions_of_the_row_terms():
    """float32 parameters: each norm weight's gradient is sum_r float32(1 + scale[r]) A[r] and each bias column's
    its factor (w for the scale chunks, else 1) times the sum of its terms over the rows (B = dy for the shifts,
    A = dy xhat for the scales, dy y for the gates; ops/block/exact.py), exact, rounded once; the terms from the
    block's values and its ops' analytic backward (`reference.backward`), recomputed here."""
    params, embed, (attn, ff), (x, feats, row_index, cot) = model(dtype=torch.float32)
    x, eps = x.float(), 1e-5
    grads, _ = step(params, embed, (attn, ff), [(x, feats, row_index, cot)])
    weight, bias, n1, n2 = (p.detach() for p in params)
    chunks = table_chunks(table_rows(embed(feats).detach(), weight, bias).float(), H)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks
    rows = rows_index(row_index, x)

    def back(f, h, dy):  # the branch's vjp, as autograd runs it between the ops
        h = h.detach().requires_grad_(True)
        return torch.autograd.grad(f(h), h, dy)[0]

    h1 = replay_modulated_rms_norm(x, n1, shift_msa, scale_msa, row_index, eps)
    y1 = attn(h1)
    x_out = replay_gated_residual(x, gate_msa, y1, row_index)
    h2 = replay_modulated_rms_norm(x_out, n2, shift_mlp, scale_mlp, row_index, eps)
    y2 = ff(h2)
    dout = cot.float()
    dy2 = back(ff, h2, gated_residual_backward(dout, gate_mlp, y2, row_index, torch.float32)[1])
    total = modulated_rms_norm_backward(dy2, x_out, n2, shift_mlp, scale_mlp, row_index, rstd_of(x_out, eps),
                                        dout)[0]
    dy1 = back(attn, h1, gated_residual_backward(total, gate_msa, y1, row_index, torch.float32)[1])
    terms = {}
    for k, (xn, dy) in enumerate(((x, dy1), (x_out, dy2))):
        t = torch_terms(xn, dy, rstd_of(xn, eps))
        terms[3 * k], terms[3 * k + 1] = t[:, :H], t[:, H:]
    terms[2], terms[5] = torch_terms(y1, total, None)[:, H:], torch_terms(y2, dout, None)[:, H:]
    sums = {c: grouped(t.reshape(-1, H), rows, 3 * T) for c, t in terms.items()}
    for k, (w, scale) in enumerate(((n1, scale_msa), (n2, scale_mlp))):
        s1 = (1.0 + scale).tolist()
        A = sums[3 * k + 1]
        want = exact_round([sum(Fraction(s1[r][h]) * A[r][h] for r in range(3 * T)) for h in range(H)])
        assert torch.equal(grads[2 + k], want), k
    factors = {1: n1.tolist(), 4: n2.tolist()}
    for m in range(3):
        for c in range(6):
            f = factors.get(c, [1.0] * H)
            column = [Fraction(f[h]) * sum(sums[c][3 * t + m][h] for t in range(T)) for h in range(H)]
            got = grads[1][m * 6 * H + c * H:m * 6 * H + (c + 1) * H]
            assert torch.equal(got, exact_round(column)), (m, c)


def test_backend_cupy_records_on_the_kernels_only_and_refuses_the_cpu_as_outside():
    params, embed, maps, (x, feats, row_index, cot) = model()
    with pytest.raises(Exception) as outside:
        block_adaln_path(x, embed(feats), *params, row_index, *maps, backend="cupy")
    with ExactGradients(), pytest.raises(type(outside.value), match=re.escape(str(outside.value))):
        block_adaln_path(x, embed(feats), *params, row_index, *maps, backend="cupy")


def test_parts_that_hold_only_their_own_timesteps_give_the_same_bits():
    """Within-sample parts passing only the temb rows their rows use (row_index remapped): the same AdaLN gradients
    as one batch with every timestep (the table is computed a temb row at a time)."""
    params, embed, maps, batch = model(dtype=torch.float32)
    x, feats, row_index, cot = batch

    def run(parts):
        for p in params:
            p.grad = None
        temb, acc = embed(feats), ExactGradients()  # one time embedding a step, its rows sliced by the parts
        for px, _, ri, pcot in parts:
            used = (ri // 3).unique()
            remapped = 3 * torch.searchsorted(used, ri // 3) + ri % 3
            with acc:
                out = block_adaln_path(px.float(), temb[used], *params, remapped, *maps, backend="torch")
                (out.float() * pcot).sum().backward()
        acc.write()
        return [p.grad for p in params]

    one = run([batch])
    assert any(len((ri // 3).unique()) < T for _, _, ri, _ in within(batch, 8))
    for n in (3, 8):
        assert all(torch.equal(a, b) for a, b in zip(run(within(batch, n)), one)), n


def test_a_backward_after_the_with_ended_is_refused():
    """The accumulator folds a part's states in when its `with` ends (so parts do not pile up): a backward that
    runs later raises instead of adding to states already folded."""
    params, embed, maps, (x, feats, row_index, cot) = model()
    acc = ExactGradients()
    with acc:
        out = block_adaln_path(x.requires_grad_(True), embed(feats), *params, row_index, *maps, backend="torch")
    with pytest.raises(RuntimeError, match="ran after its `with ExactGradients"):
        (out.float() * cot).sum().backward()
