"""An H3 block's AdaLN under adaln_lab.nn.ExactGradients (the torch route, CPU): diffusers' forward and dx, bit for bit;
the AdaLN parameters' gradients the same bits for one batch, its rows permuted, and micro-batches of 2, 3 and 8
parts by sample and within samples in any order (attn and ff row-wise, so a split changes no row's terms); each sum
the correctly rounded exact sum of its terms; a planted float32 accumulation caught; misuse refused."""

from fractions import Fraction

import pytest
import torch

from adaln_lab import block_adaln_path
from adaln_lab.core.exact import round_scaled
from adaln_lab.nn import ExactGradients
from adaln_lab.reference.block import (replay_block_adaln, replay_gated_residual, replay_modulated_rms_norm,
                                       table_chunks)
from adaln_lab.reference.final_adaln_out import rms_norm, table_rows

from ..exact_parts import block_params, by_sample, time_embedding, within

B, S, H, D, T = 8, 18, 16, 8, 2


def model(seed: int = 0, dtype=torch.bfloat16):
    """(params: weight, bias, norm1_weight, norm2_weight, the time embedding's Linear), row-wise attn and ff, the
    batch (x, timestep features, row_index, cotangent)."""
    g = torch.Generator().manual_seed(seed)
    params = block_params(g, H, D, dtype)
    embed = time_embedding(g, D)
    mix = (torch.randn(H, H, generator=g) / H ** 0.5).to(dtype)
    attn, ff = (lambda h: torch.tanh(h @ mix)), (lambda h: h * torch.sigmoid(h))
    x = (torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-3, 4, (B, S, 1), generator=g))).to(dtype)
    feats = torch.randn(T, 4, generator=g)
    row_index = torch.randint(0, 3 * T, (S,), generator=g)
    cot = torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-10, 4, (B, S, H), generator=g))
    return params, embed, (attn, ff), (x, feats, row_index, cot)


def step(params, embed, maps, parts, exact=True, order=None):
    """Forward and backward of each part, then (weight, bias, norm1, norm2, embed.weight) gradients and the parts'
    outputs and x gradients."""
    for p in [*params, *embed.parameters()]:
        p.grad = None
    acc, outs = ExactGradients(), []
    for k in order or range(len(parts)):
        x, feats, row_index, cot = parts[k]
        x = x.detach().requires_grad_(True)
        with acc if exact else torch.enable_grad():
            out = block_adaln_path(x, embed(feats), *params, row_index, *maps, backend="torch")
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
def test_forward_and_dx_are_diffusers_bits_on_the_rowwise_table(dtype):
    """The output and dx are diffusers' block on a table computed a temb row at a time (each row diffusers' bits for
    that row alone); with one timestep that is diffusers' block itself."""
    params, embed, maps, (x, feats, row_index, cot) = model(dtype=dtype)
    for T_used, idx in ((T, row_index), (1, torch.zeros_like(row_index))):
        f = feats[:T_used]
        grads, [(out, dx)] = step(params, embed, maps, [(x, f, idx, cot)])
        xr = x.detach().requires_grad_(True)
        want = replay_rows(xr, embed(f).detach(), *[p.detach() for p in params], idx, *maps)
        (want.float() * cot).sum().backward()
        assert torch.equal(out, want.detach()) and torch.equal(dx, xr.grad)
        assert all(g is not None and bool(torch.isfinite(g.float()).all()) for g in grads)
        if T_used == 1:
            plain = replay_block_adaln(x, embed(f).detach(), *[p.detach() for p in params], idx, *maps)
            assert torch.equal(out, plain.detach())


def test_permutations_and_micro_batches_give_the_same_bits():
    params, embed, maps, batch = model()
    one, _ = step(params, embed, maps, [batch])
    x, feats, row_index, cot = batch
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(1))
    assert same(step(params, embed, maps, [(x[:, perm], feats, row_index[perm], cot[:, perm])])[0], one)
    for n in (2, 3, 8):
        for parts in (by_sample(batch, n), within(batch, n)):
            for order in (None, list(reversed(range(len(parts))))):
                got, _ = step(params, embed, maps, parts, order=order)
                assert same(got, one), (n, order)
                assert torch.allclose(got[4], one[4], rtol=1e-4, atol=1e-5)  # temb's producer: reached


def test_a_planted_float32_accumulation_fails_the_same_check():
    params, embed, maps, batch = model()
    one, _ = step(params, embed, maps, [batch], exact=False)
    assert any(not same(step(params, embed, maps, parts, exact=False)[0], one)
               for n in (2, 3, 8) for parts in (by_sample(batch, n), within(batch, n)))


def test_the_norm_weights_gradients_are_the_correctly_rounded_exact_sums_of_their_terms():
    """float32 parameters: each norm weight's gradient equals the exact (Fraction) sum of its per-row terms, rounded
    once; the terms from the norm's own input and output gradient, captured on a plain replay."""
    params, embed, maps, (x, feats, row_index, cot) = model(dtype=torch.float32)
    x = x.float()
    grads, _ = step(params, embed, maps, [(x, feats, row_index, cot)])
    weight, bias, n1, n2 = (p.detach() for p in params)
    seen = {}

    def norm(xn, w, eps):  # rms_norm, its input and output gradient kept (the k-th norm's under key k)
        k = len(seen)
        seen[k] = None
        out = rms_norm(xn, w, eps)
        out.register_hook(lambda g: seen.update({k: (xn.detach(), g)}))
        return out

    xr = x.detach().requires_grad_(True)
    out = replay_rows(xr, embed(feats).detach(), weight, bias, n1, n2, row_index, *maps, norm=norm)
    (out.float() * cot).sum().backward()
    for got, (xn, dy) in zip((grads[2], grads[3]), (seen[0], seen[1])):
        xf = xn.reshape(-1, H).float()
        terms = dy.reshape(-1, H).float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))
        exact = [sum(Fraction(v) for v in terms[:, h].tolist()) * 2 ** 149 for h in range(H)]
        assert all(e.denominator == 1 for e in exact)
        want = torch.tensor([round_scaled(int(e), -149, 24) for e in exact], dtype=torch.float64).float()
        assert torch.equal(got, want)


def test_backend_cupy_refuses_to_record():
    params, embed, maps, (x, feats, row_index, cot) = model()
    with ExactGradients(), pytest.raises(NotImplementedError, match="backend='torch'"):
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
