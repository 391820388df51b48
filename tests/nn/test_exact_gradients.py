"""adaln_lab.nn.ExactGradients on the CPU (the torch route): norm_out's parameter gradients the same bits for one
batch, the rows permuted, the timesteps' temb rows permuted (indices remapped), and micro-batches of 2, 3 and 8
parts by sample and within samples, written in any order of the parts; temb's gradient reaches its producer; a
planted float32 accumulation (plain autograd over the same micro-batches) fails the same check; misuse refused."""

import warnings

import pytest
import torch

from adaln_lab import final_adaln_out
from adaln_lab.nn import ExactGradients

from ..exact_parts import by_sample, norm_out_batch, time_embedding, within

B, S, H, D, T = 8, 24, 16, 8, 3


def model(seed: int = 0):
    """(params: norm_weight, weight, bias, the time embedding's Linear) and the batch (x, timestep features, idx,
    cotangent)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((1 + 0.1 * torch.randn(H, generator=g)).bfloat16()),
              torch.nn.Parameter((0.1 * torch.randn(2 * H, D, generator=g)).bfloat16()),
              torch.nn.Parameter((0.1 * torch.randn(2 * H, generator=g)).bfloat16())]
    embed = time_embedding(g, D)
    return params, embed, norm_out_batch(g, B, S, H, T)


def step(params, embed, parts, exact=True, order=None):
    """Forward and backward of each part (x, feats, idx, cot), then the gradients: (norm_weight, weight, bias,
    embed.weight) grads."""
    for p in [*params, *embed.parameters()]:
        p.grad = None
    acc = ExactGradients()
    for k in order or range(len(parts)):
        x, feats, idx, cot = parts[k]
        temb = embed(feats)
        with acc if exact else torch.enable_grad():
            out = final_adaln_out(x, *params[:1], temb, *params[1:], idx)
            (out.float() * cot).sum().backward()
    if exact:
        acc.write()
    return [p.grad for p in params] + [embed.weight.grad]


def same(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a[:3], b[:3]))


def test_one_batch_permutations_and_micro_batches_give_the_same_bits():
    params, embed, batch = model()
    one = step(params, embed, [batch])
    assert all(g is not None and bool(torch.isfinite(g.float()).all()) for g in one)
    x, feats, idx, cot = batch
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(1))
    assert same(step(params, embed, [(x[:, perm], feats, idx[perm], cot[:, perm])]), one)
    remap = torch.tensor([2, 0, 1])  # table row t -> remap[t]
    moved = torch.empty_like(feats)
    moved[remap] = feats
    assert same(step(params, embed, [(x, moved, remap[idx], cot)]), one)
    for n in (2, 3, 8):
        for parts in (by_sample(batch, n), within(batch, n)):
            for order in (None, list(reversed(range(len(parts))))):
                got = step(params, embed, parts, order=order)
                assert same(got, one), (n, order)
                assert torch.allclose(got[3], one[3], rtol=1e-4, atol=1e-5)  # temb's producer: reached


def test_the_written_norm_weight_and_bias_gradients_are_the_reference_sums():
    """What write sets for norm_out's norm weight and bias (from the table's scale sums over the distinct temb rows)
    is NormOutSums.gradients' rounding of the same sums (checked against Python fractions in
    tests/ops/test_final_adaln_out_exact.py), for one batch and for micro-batches."""
    from adaln_lab.ops.final_adaln_out.exact import NormOutSums
    from adaln_lab.reference.final_adaln_out import table_rows

    params, embed, batch = model()
    x, feats, idx, cot = batch
    with torch.no_grad():
        table = table_rows(embed(feats), params[1], params[2]).float()
    _, d_nw, d_bias = NormOutSums(T, H).add(x, cot.bfloat16(), params[0], table, idx).gradients()
    for parts in ([batch], by_sample(batch, 3)):
        got = step(params, embed, parts)
        assert torch.equal(got[0], d_nw) and torch.equal(got[2], d_bias)


def test_parts_that_disagree_on_a_table_row_or_the_norm_weight_are_refused_untouched():
    """TableSums refuses another part's scale row for a temb row it holds, or other column factors, with
    ValueError, before merging anything; argument shapes are named."""
    from adaln_lab.core.exact import ExactSum
    from adaln_lab.ops.modulation_table.exact import TableSums

    temb = torch.randn(2, 4)
    state = ExactSum((2, 6)).add(torch.randn(5, 6), torch.tensor([0, 1, 1, 0, 1]))
    sums = TableSums().add(temb, state, torch.ones(2, 3), torch.ones(6))
    held = {k: v[1].limbs.clone() for k, v in sums.rows.items()}
    with pytest.raises(ValueError, match="two table rows"):
        sums.add(temb, state, torch.full((2, 3), 2.0), torch.ones(6))
    with pytest.raises(ValueError, match="column factors"):
        sums.merge(TableSums().add(temb, state, torch.ones(2, 3), torch.full((6,), 2.0)))
    assert all(torch.equal(sums.rows[k][1].limbs, v) for k, v in held.items())  # nothing merged
    with pytest.raises(ValueError, match="scale must be float32"):
        TableSums().add(temb, state, torch.ones(3, 3), torch.ones(6))
    with pytest.raises(ValueError, match="factors must be float32"):
        TableSums().add(temb, state, torch.ones(2, 3), torch.ones(5))
    with pytest.raises(ValueError, match="without its scale"):
        TableSums().add(temb, state).norm_weight_sums([slice(3, 6)])


def test_a_planted_float32_accumulation_fails_the_same_check():
    """Plain autograd over the same micro-batches (each part's gradients rounded, then added in the parameter's
    dtype): some split changes the bits, so the check above can fail."""
    params, embed, batch = model()
    one = step(params, embed, [batch], exact=False)
    assert any(not same(step(params, embed, parts, exact=False), one)
               for n in (2, 3, 8) for parts in (by_sample(batch, n), within(batch, n)))


def test_write_refuses_a_gradient_set_before_and_refusals_name_the_route():
    params, embed, (x, feats, idx, cot) = model()
    params[0].grad = torch.zeros_like(params[0])
    acc = ExactGradients()
    with acc:
        (final_adaln_out(x, *params[:1], embed(feats), *params[1:], idx).float() * cot).sum().backward()
    with pytest.raises(ValueError, match=r"norm_weight.grad is set already"):
        acc.write()
    with acc, pytest.raises(NotImplementedError, match="not on the Numba twin"):
        final_adaln_out(x, *params[:1], embed(feats), *params[1:], idx, backend="numba")
    with acc, pytest.raises(Exception, match="CUDA"):  # the kernels' own refusal, as without the recorder
        final_adaln_out(x, *params[:1], embed(feats), *params[1:], idx, backend="cupy")


def test_write_says_when_tembs_graph_was_freed_by_another_consumer():
    """A temb that another op also backpropagates through (an H3 model's blocks) has lost its graph by write: the
    error says so instead of torch's "backward through the graph a second time"."""
    params, embed, (x, feats, idx, cot) = model()
    acc = ExactGradients()
    with acc:
        temb = embed(feats)
        out = final_adaln_out(x, *params[:1], temb, *params[1:], idx)
        ((out.float() * cot).sum() + temb.square().sum()).backward()  # temb's graph runs (and is freed) here
    with pytest.raises(RuntimeError, match="temb's graph was freed before write"):
        acc.write()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cupy"])
def test_cuda_routes_give_the_same_bits_for_every_split(backend):
    """On CUDA, backend "torch" (the replay) and "cupy" (the kernels, exact_row_pass.cu): the states live on the GPU
    and the table's parameter gradients are formed on the CPU. One batch, its rows permuted, the temb rows permuted
    (indices remapped) and its splits into 2, 3 and 8 parts by sample and within samples, in reversed order, give
    the same bits, on the parameters' device; plain autograd over the same splits (the planted float32
    accumulation) changes them."""
    params, embed, batch = model()
    params = [torch.nn.Parameter(p.detach().cuda()) for p in params]
    embed = embed.cuda()
    batch = tuple(t.cuda() for t in batch)

    def cuda_step(parts, exact=True):
        for p in [*params, *embed.parameters()]:
            p.grad = None
        acc = ExactGradients()
        for x, feats, idx, cot in parts:
            with acc if exact else torch.enable_grad():
                out = final_adaln_out(x, *params[:1], embed(feats), *params[1:], idx, backend=backend)
                (out.float() * cot).sum().backward()
        if exact:
            acc.write()
        return [p.grad for p in params]

    one = cuda_step([batch])
    assert all(g.is_cuda and bool(torch.isfinite(g.float()).all()) for g in one)
    x, feats, idx, cot = batch
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(1)).cuda()
    assert same(cuda_step([(x[:, perm], feats, idx[perm], cot[:, perm])]), one)
    remap = torch.tensor([2, 0, 1], device="cuda")
    moved = torch.empty_like(feats)
    moved[remap] = feats
    assert same(cuda_step([(x, moved, remap[idx], cot)]), one)
    splits = [parts for n in (2, 3, 8) for parts in (by_sample(batch, n), within(batch, n))]
    for parts in splits:
        assert same(cuda_step(parts), one) and same(cuda_step(parts[::-1]), one), len(parts)
    plain = cuda_step([batch], exact=False)
    assert any(not same(cuda_step(parts, exact=False), plain) for parts in splits)


@pytest.mark.gpu
@pytest.mark.parametrize("no_wait", [0, 1])
def test_the_kernels_flags_raise_at_write_and_leave_the_gradients_unset(monkeypatch, no_wait):
    from adaln_lab.core import transfers

    monkeypatch.setattr(transfers, "NO_WAIT", no_wait)
    params, embed, batch = model()
    params = [torch.nn.Parameter(p.detach().cuda()) for p in params]
    x, feats, idx, cot = (t.cuda() for t in batch)
    acc = ExactGradients()
    with acc:
        out = final_adaln_out(x, *params[:1], embed.cuda()(feats), *params[1:], idx, backend="cupy")
        (out.float() * cot * torch.nan).sum().backward()
    with pytest.raises(ValueError, match="non-finite"):
        acc.write()
    assert all(p.grad is None for p in params) and all(p.grad is None for p in embed.parameters())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_patched_h3_model_gives_the_same_adaln_gradients_for_every_split_by_sample(device):
    """A patched tiny MiniMax-H3 model: its 11 AdaLN parameters' gradients the same bits for one batch of 4 samples,
    the timesteps' order permuted (indices remapped), 2 parts in both orders, 3 uneven parts and 4 parts of one
    sample shuffled; plain autograd over the same parts changes them all. (A split within a sample is no split of a
    model: attention mixes its rows.) On the CPU fp32, every AdaLN on the torch route; on CUDA the checkpoint's
    layout (bf16, its fp32 modules kept), every AdaLN on the kernels (no fallback warning names one). There the rest
    of the model is not batch-invariant (cuBLAS and SDPA: samples 0-1 of a batch of 4 and alone give other forward
    bits, seen on an H100), so a part runs as the whole batch with the other samples' cotangent zero: every row's
    gradient has the one batch's bits, the parts' terms sum to its, and the exact states must too (zero terms add
    nothing)."""
    pytest.importorskip("diffusers")
    import adaln_lab
    from adaln_lab.core.support import KernelFallbackWarning
    from adaln_lab.testing import checkpoint_layout, tiny_h3_model

    model, inputs = tiny_h3_model(batch=4)
    if device == "cuda":
        checkpoint_layout(model).cuda()
        inputs = {k: v.cuda() for k, v in inputs.items()}
    adaln_lab.patch(model)
    adaln = {n: p for n, p in model.named_parameters() if n.startswith("norm_out.") or (
        n.startswith("transformer_blocks.") and any(k in n for k in (".norm1.", ".norm2.", ".adaln_proj.")))}
    assert len(adaln) == 11
    per_sample = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
    cot = torch.randn(4, *model(**inputs).sample.shape[1:], generator=torch.Generator().manual_seed(5)).to(device)

    def run(parts, exact=True, given=inputs):
        model.zero_grad(set_to_none=True)
        acc = ExactGradients()
        for idx in parts:
            if device == "cuda":  # the whole batch, the part's samples' cotangent alone (see the docstring)
                part, part_cot = given, cot * (torch.arange(4, device=device) == torch.arange(4, device=device)[idx]
                                               .unsqueeze(1)).any(0).view(4, 1, 1)
            else:
                part, part_cot = {k: (v[idx] if k in per_sample else v) for k, v in given.items()}, cot[idx]
            with acc if exact else torch.enable_grad():
                (model(**part).sample * part_cot).sum().backward()
        if exact:
            acc.write()
        return {n: p.grad.clone() for n, p in adaln.items()}

    def same(a, b):
        return all(torch.equal(a[n], b[n]) for n in adaln)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one = run([slice(0, 4)])
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, KernelFallbackWarning)]
    assert not any(m.startswith(("final_adaln_out", "block_adaln_path")) for m in fallbacks), fallbacks
    assert all(g.is_cuda == (device == "cuda") and bool(torch.isfinite(g).all()) for g in one.values())
    remap = torch.tensor([2, 0, 1], device=device)  # timestep t -> remap[t]
    moved = dict(inputs, timestep_indices=remap[inputs["timestep_indices"]])
    moved["timestep"] = torch.empty_like(inputs["timestep"]).index_copy_(0, remap, inputs["timestep"])
    assert same(run([slice(0, 4)], given=moved), one)
    for parts in ([slice(0, 2), slice(2, 4)], [slice(2, 4), slice(0, 2)], [slice(1, 3), slice(3, 4), slice(0, 1)],
                  [slice(k, k + 1) for k in (3, 1, 0, 2)]):
        assert same(run(parts), one), parts
    plain = run([slice(0, 4)], exact=False)
    assert all(not same(run(parts, exact=False), plain)
               for parts in ([slice(0, 2), slice(2, 4)], [slice(k, k + 1) for k in (3, 1, 0, 2)]))


def own_timesteps(parts):
    """Each part with only the timesteps its rows use: (x, used rows of temb's table, indices remapped, cot, used)."""
    out = []
    for x, feats, idx, cot in parts:
        used = idx.unique()
        out.append((x, used, torch.searchsorted(used, idx), cot))
    return out


def test_parts_that_hold_only_their_own_timesteps_give_the_same_bits():
    """Within-sample parts passing only the temb rows their rows use (T differs from part to part; the rows are
    the same bits, sliced from one time embedding): the same bits as one batch with every timestep."""
    params, embed, batch = model()
    x, feats, idx, cot = batch

    def run(parts):
        for p in params:
            p.grad = None
        temb = embed(feats)
        acc = ExactGradients()
        for px, used, pidx, pcot in parts:
            with acc:
                (final_adaln_out(px, *params[:1], temb[used], *params[1:], pidx).float() * pcot).sum().backward()
        acc.write()
        return [p.grad for p in params]

    one = run(own_timesteps([batch]))
    assert any(len(used) < T for _, used, _, _ in own_timesteps(within(batch, 8)))  # some part holds fewer
    for n in (2, 3, 8):
        assert same(run(own_timesteps(within(batch, n))), one), n


def test_a_parameter_in_two_adalns_and_a_bypassed_adaln_are_refused():
    """Two norm_outs sharing their projection but not their norm weight would write the projection's .grad twice:
    refused; an AdaLNOut that would run diffusers' ops instead of the recording op (a bf16 temb with the torch
    route) raises instead of leaving its gradients unrecorded."""
    params, embed, (x, feats, idx, cot) = model()
    other = torch.nn.Parameter(params[0].detach().clone())
    with ExactGradients(), pytest.raises(ValueError, match="in two AdaLN"):
        final_adaln_out(x, params[0], embed(feats), *params[1:], idx)
        final_adaln_out(x, other, embed(feats), *params[1:], idx)
    pytest.importorskip("diffusers")
    from adaln_lab.nn import AdaLNOut

    module = AdaLNOut(H, D, eps=1e-5, backend="torch").bfloat16()
    with ExactGradients(), pytest.raises(NotImplementedError, match="bfloat16 on the torch route.*not recorded"):
        module(x, embed(feats).bfloat16(), idx)


def test_merged_accumulators_and_tembs_gradient_are_the_same_bits():
    """Two accumulators over the two halves of the parts, merged either way, write one batch's bits; temb's own
    gradient (a leaf here: the exact d_temb, summed in float64 and rounded once) is the same bits too."""
    params, embed, batch = model()
    temb = embed(batch[1]).detach().requires_grad_(True)

    def run(parts, merge_order=None):
        for p in [*params, temb]:
            p.grad = None
        accs = [ExactGradients(), ExactGradients()]
        for k, (x, _, idx, cot) in enumerate(parts):
            with accs[k % 2] if merge_order else accs[0]:
                (final_adaln_out(x, *params[:1], temb, *params[1:], idx).float() * cot).sum().backward()
        acc = accs[merge_order[0]].merge(accs[merge_order[1]]) if merge_order else accs[0]
        acc.write()
        return [p.grad for p in params] + [temb.grad]

    one = run([batch])
    for order in ((0, 1), (1, 0)):
        got = run(by_sample(batch, 4), order)
        assert same(got, one) and torch.equal(got[3], one[3]), order


@pytest.mark.gpu
def test_autocast_with_a_bf16_temb_records_on_the_kernels():
    """fp32 master parameters under autocast, temb in bf16 (what a time embedding under autocast gives): AdaLNOut
    records on the kernels (temb widened exactly), every split gives the same bits for its three parameters and for
    temb's gradient (bf16, sent to the part that first held each row, the caller's tensor: rounded once), and they
    match the float32 temb's gradients of the same values (temb's gradient within half an ulp of each rounding)."""
    pytest.importorskip("diffusers")
    from adaln_lab.nn import AdaLNOut

    _, embed, batch = model()
    module = AdaLNOut(H, D, eps=1e-5, backend="cupy").cuda()
    x, feats, idx, cot = (t.cuda() for t in batch)
    values = embed.cuda()(feats).detach().bfloat16()

    def run(parts, dtype=torch.bfloat16):
        module.zero_grad(set_to_none=True)
        acc, tembs = ExactGradients(), []
        for x_, idx_, cot_ in parts:
            tembs.append(values.to(dtype, copy=True).requires_grad_(True))  # a leaf a part
            with acc, torch.autocast("cuda", torch.bfloat16):
                (module(x_, tembs[-1], idx_).float() * cot_).sum().backward()
        acc.write()
        return [p.grad for p in (module.norm.weight, module.linear.weight, module.linear.bias)] + [tembs[0].grad]

    one = run([(x, idx, cot)])
    assert all(g.dtype == torch.float32 for g in one[:3]) and one[3].dtype == torch.bfloat16
    for n in (2, 3):
        got = run([(x_, idx_, cot_) for x_, _, idx_, cot_ in by_sample((x, feats, idx, cot), n)])
        assert same(got, one) and torch.equal(got[3], one[3]), n
    wide = run([(x, idx, cot)], torch.float32)
    # temb's gradient: the same float64 value rounded once, to bf16 here and to float32 there (half an ulp each)
    assert same(wide, one) and bool(((one[3].float() - wide[3]).abs() <= wide[3].abs() * (2 ** -8 + 2 ** -24)).all())


def test_a_bf16_temb_that_norm_out_widened_gets_its_rows_gradient():
    """write's temb gradients (`_temb_grads`): a kept bf16 temb holds the float32 rows it widens to (norm_out keeps
    the caller's bf16 temb and records the widened rows), and a float32 temb never matches bf16 rows by narrowing."""
    from adaln_lab.core.transfers import HostCopies
    from adaln_lab.nn.exact import _temb_grads

    narrow = torch.randn(3, D).bfloat16().requires_grad_(True)
    d_temb = torch.randn(3, D, dtype=torch.float64)
    into = {}
    _temb_grads([narrow], {id(narrow): HostCopies([narrow])}, narrow.detach().float()[[2, 0, 1]], d_temb, into)
    assert torch.equal(into[id(narrow)][1], d_temb[[1, 2, 0]])
    wide = narrow.detach().float().requires_grad_(True)
    into = {}
    _temb_grads([wide], {id(wide): HostCopies([wide])}, narrow.detach(), d_temb, into)  # float32 rows never narrowed
    assert not into[id(wide)][1].any()
