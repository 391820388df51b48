"""norm_out's exact cross-row sums (ops/final_adaln_out/exact.py) on the CPU: the same bits for the rows in one
batch, permuted, with the timesteps' table rows permuted (indices remapped), and split into 2, 3 and 8 parts by
sample and within samples, the parts merged in reversed and shuffled orders; each value the correctly rounded
exact value of the same float32 terms (sums times the norm weight or 1 + scale[t], exactly), rounded once; a
planted float32 accumulation fails the same checks."""

import random
from fractions import Fraction

import pytest
import torch

from adaln_lab.core.exact import round_scaled
from adaln_lab.ops.final_adaln_out.exact import NormOutSums, column_factors, row_terms

T, H, S, B = 3, 16, 24, 4  # B samples of S rows each (x (B, S, H))


def case(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-6, 7, (B, S, 1), generator=g))).bfloat16()
    dy = (torch.randn(B, S, H, generator=g) * torch.exp2(torch.randint(-20, 4, (B, S, H), generator=g))).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    table_f32 = torch.randn(T, 2 * H, generator=g)
    idx = torch.randint(0, T, (S,), generator=g)
    return x, dy, norm_weight, table_f32, idx


def sums_of(parts, order=None):
    """NormOutSums of each part (x, dy, norm_weight, table_f32, idx), merged in `order` (default: as given)."""
    states = [NormOutSums(T, H).add(*p) for p in parts]
    total = NormOutSums(T, H)
    for k in order or range(len(states)):
        total.merge(states[k])
    return total.gradients()


def splits(x, dy, norm_weight, table_f32, idx, n: int):
    """Two ways of n parts: by sample (rows of whole samples) and within samples (each sample's S positions cut into
    n runs, as a context-parallel rank holds them)."""
    by_sample = [(x[k::n], dy[k::n], norm_weight, table_f32, idx) for k in range(n) if x[k::n].shape[0]]
    cuts = [round(S * k / n) for k in range(n + 1)]
    within = [(x[:, a:b], dy[:, a:b], norm_weight, table_f32, idx[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]
    return by_sample, within


def equal(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("seed", range(3))
def test_same_bits_for_any_order_split_and_merge_order(seed):
    args = case(seed)
    x, dy, norm_weight, table_f32, idx = args
    one = sums_of([args])
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(seed))
    assert equal(sums_of([(x[:, perm], dy[:, perm], norm_weight, table_f32, idx[perm])]), one)
    remap = torch.randperm(T, generator=torch.Generator().manual_seed(seed + 1))  # table row t -> remap[t]
    moved = torch.empty_like(table_f32)
    moved[remap] = table_f32
    d_table, d_nw, d_bias = sums_of([(x, dy, norm_weight, moved, remap[idx])])
    assert torch.equal(d_table[remap], one[0]) and torch.equal(d_nw, one[1]) and torch.equal(d_bias, one[2])
    rng = random.Random(seed)
    for n in (2, 3, 8):
        for parts in splits(*args, n):
            shuffled = list(range(len(parts)))
            rng.shuffle(shuffled)
            for order in (None, list(reversed(range(len(parts)))), shuffled):
                assert equal(sums_of(parts, order), one), (n, order)


def test_each_value_is_the_exact_sum_of_the_terms_rounded_once():
    """d_shift[t] = B[t], d_scale[t] = w A[t], d_norm_weight = sum_t s1[t] A[t] and d_bias = sum_t (B | w A), with
    A and B the exact sums of a table row's terms (dy xhat and dy), w the norm weight and s1 = float32(1 + scale),
    each value computed in Python fractions and rounded once."""
    x, dy, norm_weight, table_f32, idx = case(7)
    d_table, d_nw, d_bias = sums_of([(x, dy, norm_weight, table_f32, idx)])
    terms, t = row_terms(x, dy, idx, 1e-5)
    sums = [[sum((Fraction(v) for v, tt in zip(terms[:, j].tolist(), t.tolist()) if tt == r), Fraction(0))
             for j in range(2 * H)] for r in range(T)]
    w = [Fraction(v) for v in norm_weight.float().tolist()]
    s1 = (1.0 + table_f32[:, H:]).tolist()
    exact_table = [row[:H] + [w[h] * row[H + h] for h in range(H)] for row in sums]
    exact_nw = [sum((Fraction(s1[r][h]) * sums[r][H + h] for r in range(T)), Fraction(0)) for h in range(H)]
    exact_bias = [sum((exact_table[r][j] for r in range(T)), Fraction(0)) for j in range(2 * H)]

    def rounded(v: Fraction, precision: int) -> float:  # v = n 2^-298 exactly (float32 products of such sums)
        n = v * 2 ** 298
        assert n.denominator == 1
        return round_scaled(int(n), -298, precision)

    assert d_table.tolist() == [[rounded(v, 24) for v in row] for row in exact_table]
    assert d_nw.float().tolist() == [rounded(v, 8) for v in exact_nw]
    assert d_bias.float().tolist() == [rounded(v, 8) for v in exact_bias]
    planted = (terms[:, H:] * (1.0 + table_f32[t, H:])).sum(0)  # a float32 sum of the rows' products: caught
    assert planted.tolist() != [rounded(v, 24) for v in exact_nw]


def test_a_planted_float32_accumulation_fails_the_same_split_check():
    """The check above on a float32 accumulation of the same terms (index_add_ per part, the parts' sums added, as
    a reduce would): some split changes its bits, so the check can fail."""
    args = case(11)
    table, t = row_terms(args[0], args[1], args[4], 1e-5)

    def fp32(parts):
        out = torch.zeros(T, 2 * H)
        for p in parts:
            terms, tt = row_terms(p[0], p[1], p[4], 1e-5)
            out += torch.zeros(T, 2 * H).index_add_(0, tt, terms)
        return out

    one = torch.zeros(T, 2 * H).index_add_(0, t, table)
    assert any(not torch.equal(fp32(parts), one) for n in (2, 3, 8) for parts in splits(*args, n))


def test_refuses_indices_outside_the_table_and_non_finite_rows():
    x, dy, norm_weight, table_f32, idx = case(3)
    bad = idx.clone()
    bad[0] = T
    with pytest.raises((ValueError, IndexError)):
        NormOutSums(T, H).add(x, dy, norm_weight, table_f32, bad)
    dy = dy.clone()
    dy[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        NormOutSums(T, H).add(x, dy, norm_weight, table_f32, idx)


def test_the_tables_parameter_gradients_are_the_same_for_any_split_of_the_timesteps():
    """TableSums (ops/modulation_table/exact.py): parts that hold the timesteps in other orders, a part without one
    of them, a part holding one timestep twice (two identical temb rows): d_weight, d_bias and d_temb of the
    distinct rows are the same bits as one batch's, and d_bias the exact total's rounding."""
    from adaln_lab.ops.modulation_table.exact import TableSums

    x, dy, norm_weight, table_f32, idx = case(5)
    g = torch.Generator().manual_seed(5)
    temb = torch.randn(T, 8, generator=g)
    weight = (0.1 * torch.randn(2 * H, 8, generator=g)).bfloat16()

    def table_sums(parts):  # (x, dy, temb, table_f32, idx) each
        total = TableSums()
        for px, pdy, ptemb, ptable, pidx in parts:
            sums = NormOutSums(ptemb.shape[0], H).add(px, pdy, norm_weight, ptable, pidx)
            total.merge(TableSums().add(ptemb, sums.table, sums.scale, column_factors(sums.norm_weight)))
        return total.gradients(weight, torch.bfloat16)

    one = table_sums([(x, dy, temb, table_f32, idx)])
    rev = torch.tensor([2, 1, 0])  # part 1: the timesteps reversed (indices remapped), samples 0 and 1
    twice = torch.tensor([0, 1, 2, 0])  # part 2: timestep 0 twice (rows 0 and 3 identical), samples 2 and 3
    idx2 = torch.where(torch.arange(S) % 2 == 0, idx, torch.where(idx == 0, torch.tensor(3), idx))
    parts = [(x[:2], dy[:2], temb[rev], table_f32[rev], rev[idx]),
             (x[2:], dy[2:], temb[twice], table_f32[twice], idx2)]
    for order in (parts, parts[::-1]):
        got = table_sums(order)
        assert all(torch.equal(a, b) for a, b in zip(got, one))
    assert one[0].shape == (T, 8)  # three distinct rows
    assert torch.equal(one[3], NormOutSums(T, H).add(x, dy, norm_weight, table_f32, idx).gradients()[2])


def kernel_case(B_, S_, H_, D_, T_, seed=0):
    """CUDA inputs of the kernels (bf16 x, dy, norm_weight, weight, bias; fp32 temb) and the forward's workspace."""
    from adaln_lab.core.plan import forward_bytes
    from adaln_lab.ops.final_adaln_out import launch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B_, S_, H_, generator=g) * torch.exp2(torch.randint(-6, 7, (B_, S_, 1), generator=g))).bfloat16()
    spread = torch.exp2(torch.randint(-20, 4, (B_, S_, H_), generator=g))
    dy = (torch.randn(B_, S_, H_, generator=g) * spread).bfloat16()
    nw = (1 + 0.1 * torch.randn(H_, generator=g)).bfloat16()
    temb = torch.randn(T_, D_, generator=g)
    weight = (0.1 * torch.randn(2 * H_, D_, generator=g)).bfloat16()
    bias = (0.1 * torch.randn(2 * H_, generator=g)).bfloat16()
    idx = torch.randint(0, T_, (S_,), generator=g)
    x, dy, nw, temb, weight, bias, idx = (t.cuda() for t in (x, dy, nw, temb, weight, bias, idx))
    workspace = x.new_empty(forward_bytes(T_, H_, B_ * S_, D_), dtype=torch.uint8)
    launch.forward(x, nw, temb, weight, bias, idx, 1e-5, "cupy", "cuda", torch.empty_like(x), workspace)
    return x, dy, nw, temb, idx, workspace


@pytest.fixture
def exact_cache(request):
    """TUNING's EXACT_CACHE set to the parameter (each form of exact_sums.cu), every plan and kernel forgotten before
    and after."""
    from adaln_lab.core.launchers import tuned

    with tuned(EXACT_CACHE=request.param):
        yield request.param


@pytest.mark.gpu
@pytest.mark.parametrize("exact_cache", [0, 1, 2], indirect=True)
@pytest.mark.parametrize("shape", [(2, 37, 64, 32, 3), (3, 50, 64, 32, 12), (1, 300, 5376, 2688, 2),
                                   (0, 5, 64, 32, 3)])
def test_the_kernels_states_are_the_exact_sums_of_their_terms(shape, exact_cache):
    """exact_sums.cu's carried integers equal ExactSum.add's of the same float32 terms formed by torch from the
    forward's saved rstd and table_f32 (module docstring), limb for limb; one limb moved is seen; with dx asked
    for, the row pass with exact sums (exact_row_pass.cu) writes the plain backward's dx and the same integers."""
    from adaln_lab.core.exact import ExactSum
    from adaln_lab.ops.final_adaln_out import launch
    from adaln_lab.ops.final_adaln_out.exact import kernel_sums

    B_, S_, H_, D_, T_ = shape
    x, dy, nw, temb, idx, workspace = kernel_case(*shape)
    got = kernel_sums(dy, x, nw, idx, workspace, T_, D_)
    got.check()
    assert got.scale is None and got.norm_weight is None  # formed at the first read, after the backward
    got.ready()
    _, table_f32, rstd = launch.saved_views(workspace, T_, H_, B_ * S_, D_)
    xf, g = x.reshape(-1, H_).float(), dy.reshape(-1, H_).float()
    p = g * (xf * rstd[:, None])
    t = idx.repeat(B_)
    table = ExactSum((T_, 2 * H_), x.device).add(torch.cat([g, p], dim=1), t)
    assert torch.equal(got.table.limbs, table.limbs)
    assert torch.equal(got.scale, 1.0 + table_f32[:, H_:]) and torch.equal(got.norm_weight, nw.float())
    w = torch.randn(2 * H_, D_, device="cuda").bfloat16()  # values the backward's row pass does not read
    grads = (torch.empty_like(x), torch.empty_like(nw), torch.empty_like(temb), w.clone(), w.new_empty(2 * H_))
    launch.backward(dy, x, nw, temb, w, idx, workspace, "cupy", *grads)
    dx = torch.empty_like(x)
    fused = kernel_sums(dy, x, nw, idx, workspace, T_, D_, dx=dx)
    fused.check()
    fused.ready()
    assert torch.equal(dx, grads[0])  # the exact route's dx: the plain backward's
    assert torch.equal(fused.table.limbs, table.limbs)  # the row pass's exact sums: the same integers


@pytest.mark.gpu
def test_the_kernels_flag_a_non_finite_term_and_an_index_out_of_range():
    from adaln_lab.ops.final_adaln_out.exact import kernel_sums

    x, dy, nw, temb, idx, workspace = kernel_case(2, 16, 64, 32, 3)
    bad = dy.clone()
    bad[1, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        kernel_sums(bad, x, nw, idx, workspace, 3, 32).check()
    out_of_range = idx.clone()
    out_of_range[4] = 3
    with pytest.raises(IndexError, match=r"outside \[0, T\)"):
        kernel_sums(dy, x, nw, out_of_range, workspace, 3, 32).check()
    kernel_sums(dy, x, nw, idx, workspace, 3, 32).check()  # the same call, clean: nothing raised


@pytest.mark.gpu
def test_the_kernels_sums_keep_a_copy_of_the_norm_weight_unless_told_it_is_theirs():
    """kernel_sums leaves the carries and the factors to `ready` (after the backward): with weight_copy (default) the
    norm weight is copied in the backward, so a weight changed or freed before the read (FSDP2's reshard) still gives
    the forward's factors; with weight_copy False the caller's tensor is read at `ready` (a planted change shows);
    the integers are the same either way, and `ready` twice changes nothing."""
    from adaln_lab.ops.final_adaln_out.exact import kernel_sums

    x, dy, nw, temb, idx, workspace = kernel_case(2, 16, 64, 32, 3)
    want = nw.float()
    copied, kept = (kernel_sums(dy, x, w, idx, workspace, 3, 32, weight_copy=c) for w, c in ((nw, True),
                                                                                            (nw.clone(), False)))
    kept.sources[1].mul_(2)  # the caller's tensor changed before the read
    nw.mul_(2)
    assert torch.equal(copied.ready().norm_weight, want) and torch.equal(kept.ready().norm_weight, 2 * want)
    limbs = copied.table.limbs.clone()
    assert torch.equal(copied.ready().table.limbs, limbs) and torch.equal(kept.table.limbs, limbs)
    assert bool((limbs[:-1] >= 0).all()) and bool((limbs[:-1] < 2 ** 32).all())  # carried


def test_the_kernel_routes_backward_leaves_the_carry_to_the_withs_end(monkeypatch):
    """Backend "cupy" with the GPU stood in (`bench.host_model.gpu_stood_in`): inside ExactGradients norm_out's
    backward launches its row pass with exact sums (and, with the float64 windows, its fixups) and nothing more of
    exact_state.cu; the state's one carry runs when the `with` ends (`NormOutSums.ready`, at the fold)."""
    from adaln_lab import final_adaln_out
    from adaln_lab.bench import host_model
    from adaln_lab.core import plan
    from adaln_lab.harness.inputs import make
    from adaln_lab.nn import ExactGradients

    b = make(1, 64, "cpu", H=64, D=32)
    leaves = [t.detach().clone().requires_grad_(True) for t in b.leaves]
    with host_model.gpu_stood_in():
        acc = ExactGradients()
        with acc:
            out = final_adaln_out(*leaves, b.timestep_indices, backend="cupy")
            host_model.LAUNCHES.clear()
            out.backward(torch.ones_like(out))
            backward = sorted(host_model.LAUNCHES)
            host_model.LAUNCHES.clear()
        folded = sorted(host_model.LAUNCHES)
    fixups = ["exact_fixup_rows_bf16"] if plan.TUNING["EXACT_ROW_DOUBLE"] else []
    assert backward == sorted(["norm_modulate_bwd_exact_bf16", *fixups])
    assert folded == ["exact_carry"]


def test_the_sorted_pass_runs_from_its_timestep_count_on(monkeypatch):
    """With TUNING's EXACT_SORTED_MIN_T at or below T (the GPU stood in), norm_out's exact backward sorts the positions
    by table row (row_order.cu, from the plan's own unit) and runs the sorted pass with exact sums and its fixups in
    place of the unsorted pass; one timestep more than T keeps the unsorted pass."""
    from adaln_lab import final_adaln_out
    from adaln_lab.bench import host_model
    from adaln_lab.core import launchers
    from adaln_lab.harness.inputs import make
    from adaln_lab.nn import ExactGradients

    b = make(3, 64, "cpu", H=64, D=32)
    launched = {}
    for min_t in (3, 4):
        with launchers.tuned(EXACT_ROW_DOUBLE=1, EXACT_SORTED_MIN_T=min_t), host_model.gpu_stood_in():
            leaves = [t.detach().clone().requires_grad_(True) for t in b.leaves]
            with ExactGradients():
                out = final_adaln_out(*leaves, b.timestep_indices, backend="cupy")
                host_model.LAUNCHES.clear()
                out.backward(torch.ones_like(out))
                launched[min_t] = sorted(host_model.LAUNCHES)
    assert launched[3] == ["exact_fixup_sorted_bf16", "norm_modulate_bwd_sorted_exact_bf16", "row_order"]
    assert launched[4] == ["exact_fixup_rows_bf16", "norm_modulate_bwd_exact_bf16"]
