"""`adaln_lab.modulated_rms_norm`: diffusers' `norm(x) * (1 + scale[i]) + shift[i]` bit for bit on the CPU, its
custom ops, an exact backward (rows independent, parameter sums repeatable, at least as accurate as diffusers'
against float64); GPU: norm_out's kernels on the table rows, fallbacks, the same gradient checks."""

import math

import pytest
import torch

from adaln_lab import modulated_rms_norm, modulation_table
from adaln_lab.ops.modulated_rms_norm import modulated_rms_norm_bwd, modulated_rms_norm_fwd
from adaln_lab.reference import block as br

H, D, T = 32, 16, 3
R = 3 * T
EPS = 1e-5


def _case(S=40, lead=(), dtype=torch.bfloat16, table_dtype=torch.bfloat16, seed=0, device="cpu", H_=H, D_=D):
    """x (*lead, S, H), norm_weight, shift / scale: norm2's chunks of a real table (strided views), row_index, dy."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, S, H_, generator=g) * 2).to(dtype)
    norm_weight = (0.5 + torch.rand(H_, generator=g)).to(dtype)
    temb = torch.randn(T, D_, generator=g)
    weight = (torch.randn(18 * H_, D_, generator=g) * D_ ** -0.5).to(table_dtype)
    bias = (torch.randn(18 * H_, generator=g) * 0.1).to(table_dtype)
    row_index = torch.randint(0, R, (S,), generator=g)
    dy = torch.randn(*lead, S, H_, generator=g).to(torch.promote_types(dtype, table_dtype))
    x, norm_weight, temb, weight, bias, row_index, dy = (t.to(device) for t in (x, norm_weight, temb, weight, bias,
                                                                                row_index, dy))
    _, _, _, shift, scale, _ = br.table_chunks(modulation_table(temb, weight, bias), H_)
    return x, norm_weight, shift, scale, row_index, dy


def _call(x, norm_weight, shift, scale, row_index, table_dtype=torch.bfloat16):
    return modulated_rms_norm(x, norm_weight, shift, scale, row_index, EPS, table_dtype=table_dtype)


def _diffusers(x, norm_weight, shift, scale, row_index, table_dtype=torch.bfloat16):
    """diffusers' own lines (MiniMaxH3TransformerBlock.forward) on the table chunks in the projection's dtype."""
    norm = torch.nn.RMSNorm(x.shape[-1], eps=EPS).to(device=x.device, dtype=norm_weight.dtype)
    shift, scale = shift.to(table_dtype), scale.to(table_dtype)
    norm_hidden_states = torch.func.functional_call(norm, {"weight": norm_weight}, (x,))
    return norm_hidden_states * (1.0 + scale.index_select(0, row_index)) + shift.index_select(0, row_index)


def _golden(x, norm_weight, shift, scale, row_index, table_dtype=None):
    return br.golden_modulated_rms_norm(x, norm_weight, shift, scale, row_index, EPS)


def _grads(fn, leaves, row_index, dy, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves, row_index, **kw)
    out.backward(dy.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def _rel_l2(value, ref):
    ref = ref.double()
    return float((value.double() - ref).norm() / ref.norm())


# (x dtype, table dtype): bf16 blocks, fp32 model, bf16 stream over an fp32 projection and the other way round
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.float32), (torch.float16, torch.float16)]


@pytest.mark.parametrize("dtype,table_dtype", DTYPES)
@pytest.mark.parametrize("lead", [(), (2,)])
def test_forward_is_diffusers_bit_for_bit(dtype, table_dtype, lead):
    x, norm_weight, shift, scale, row_index, _ = _case(lead=lead, dtype=dtype, table_dtype=table_dtype)
    out = _call(x, norm_weight, shift, scale, row_index, table_dtype)
    want = _diffusers(x, norm_weight, shift, scale, row_index, table_dtype)
    assert out.dtype == want.dtype == torch.promote_types(dtype, table_dtype) and out.shape == x.shape
    assert torch.equal(out, want)
    out_, rstd = modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, EPS, table_dtype)
    assert rstd.shape == (x.numel() // H,) and rstd.dtype == torch.promote_types(dtype, torch.float32)
    assert torch.equal(rstd, torch.rsqrt(x.to(rstd.dtype).pow(2).mean(-1) + EPS).reshape(-1))


def test_table_dtype_defaults_to_x_dtype_and_a_plain_bf16_table_works():
    x, norm_weight, shift, scale, row_index, _ = _case()
    want = _call(x, norm_weight, shift, scale, row_index)
    assert torch.equal(modulated_rms_norm(x, norm_weight, shift, scale, row_index, EPS), want)
    assert torch.equal(modulated_rms_norm(x, norm_weight, shift.bfloat16(), scale.bfloat16(), row_index, EPS), want)


@pytest.mark.parametrize("S", [64, 1024])
def test_gradients_exact_and_at_least_as_accurate_as_diffusers(S):
    """Against the float64 derivative at the same inputs: dx and d_norm_weight one bf16 rounding away (up to
    ~1.1x the error of rounding the golden itself), d_shift / d_scale float32 accurate; diffusers (bf16 products
    and sums, rounded `1 + scale`) is worse on each, about 2x."""
    x, norm_weight, shift, scale, row_index, dy = _case(S=S, seed=S)
    leaves = (x, norm_weight, shift, scale)
    _, ours = _grads(_call, leaves, row_index, dy)
    _, theirs = _grads(_diffusers, leaves, row_index, dy)
    _, golden = _grads(_golden, [t.double() for t in leaves], row_index, dy.double())
    for name, got, theirs_, gold in zip(("dx", "d_norm_weight", "d_shift", "d_scale"), ours, theirs, golden):
        err = _rel_l2(got, gold)
        assert err <= _rel_l2(theirs_, gold), name
        floor = _rel_l2(gold.to(got.dtype), gold)
        assert err <= 1.1 * floor + 1e-6, (name, err, floor)
    assert [g.dtype for g in ours] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]


def test_dx_of_a_row_depends_on_that_row_only_and_parameter_gradients_repeat():
    x, norm_weight, shift, scale, row_index, dy = _case(S=300, seed=5)
    leaves = (x, norm_weight, shift, scale)
    out, grads = _grads(_call, leaves, row_index, dy)
    _, again = _grads(_call, leaves, row_index, dy)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    for rows in (torch.tensor([7]), torch.randperm(300, generator=torch.Generator().manual_seed(6))[:77]):
        sub_out, sub = _grads(_call, (x[rows], norm_weight, shift, scale), row_index[rows], dy[rows])
        assert torch.equal(sub_out, out[rows]) and torch.equal(sub[0], grads[0][rows])


def test_backward_op_formulas_by_hand():
    """One row per table row, H = 4: dx, d_norm_weight, d_shift, d_scale against the formulas of the docstring."""
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.25, 0.0, -1.0, 2.0]])
    norm_weight = torch.tensor([1.0, 0.5, 2.0, 1.5])
    shift = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, -0.5, 0.5, 1.0]])
    scale = torch.tensor([[0.5, -0.25, 0.0, 1.0], [2.0, 0.0, -0.5, 0.25]])
    row_index = torch.tensor([1, 0])
    dy = torch.tensor([[1.0, 2.0, -1.0, 0.5], [-0.5, 1.0, 1.0, 2.0]])
    _, rstd = modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, EPS, torch.float32)
    dx, d_nw, d_shift, d_scale = modulated_rms_norm_bwd(dy, x, norm_weight, shift, scale, row_index, rstd)
    x64 = x.double().requires_grad_(True)
    leaves = [t.double().requires_grad_(True) for t in (norm_weight, shift, scale)]
    br.golden_modulated_rms_norm(x64, *leaves, row_index, EPS).backward(dy.double())
    for got, want in zip((dx, d_nw, d_shift, d_scale), (x64.grad, *(t.grad for t in leaves))):
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(d_shift, dy[[1, 0]])  # each table row gets its one row's dy


def test_empty_batch_gives_empty_output_and_zero_parameter_gradients():
    x, norm_weight, shift, scale, row_index, dy = _case(S=0)
    out, grads = _grads(_call, (x, norm_weight, shift, scale), row_index, dy)
    assert out.shape == (0, H) and grads[0].shape == (0, H)
    assert all(not g.any() for g in grads[1:])


OPCHECK_CASES = {
    "bf16": dict(),
    "fp32": dict(dtype=torch.float32, table_dtype=torch.float32),
    "leading dims": dict(lead=(2,)),
    "one row": dict(S=1),
    "no rows": dict(S=0),
}


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    kwargs = OPCHECK_CASES[case]
    x, norm_weight, shift, scale, row_index, dy = _case(**kwargs)
    table_dtype = kwargs.get("table_dtype", torch.bfloat16)
    leaves = [t.detach().requires_grad_(True) for t in (x, norm_weight, shift, scale)]
    torch.library.opcheck(modulated_rms_norm_fwd, (*leaves, row_index, EPS, table_dtype))
    _, rstd = modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, EPS, table_dtype)
    torch.library.opcheck(modulated_rms_norm_bwd, (dy, x, norm_weight, shift, scale, row_index, rstd))


def test_compile_fullgraph_matches_eager():
    x, norm_weight, shift, scale, row_index, dy = _case(S=33, lead=(2,))
    compiled = torch.compile(_call, fullgraph=True, backend="aot_eager")
    eager_out, eager = _grads(_call, (x, norm_weight, shift, scale), row_index, dy)
    out, traced = _grads(compiled, (x, norm_weight, shift, scale), row_index, dy)
    assert torch.equal(out, eager_out) and all(torch.equal(a, b) for a, b in zip(eager, traced))


def test_bad_inputs_are_refused_naming_the_argument():
    x, norm_weight, shift, scale, row_index, _ = _case()
    with pytest.raises(ValueError, match="x of shape"):
        modulated_rms_norm(x[0], norm_weight, shift, scale, row_index[:1])
    with pytest.raises(ValueError, match="row_index"):
        modulated_rms_norm(x, norm_weight, shift, scale, row_index[:-1])
    with pytest.raises(TypeError, match="row_index"):
        modulated_rms_norm(x, norm_weight, shift, scale, row_index.int())
    with pytest.raises(ValueError, match="scale"):
        modulated_rms_norm(x, norm_weight, shift, scale[:-1], row_index)
    with pytest.raises(ValueError, match="shift"):
        modulated_rms_norm(x, norm_weight, shift[:, :-1], scale, row_index)
    with pytest.raises(ValueError, match="norm_weight"):
        modulated_rms_norm(x, norm_weight[:-1], shift, scale, row_index)
    with pytest.raises(TypeError, match="x"):
        modulated_rms_norm(x.long(), norm_weight, shift, scale, row_index)


# ---------------------------------------------------------------- GPU (H200) ----------------------------------

GH, GD = 1024, 256


def _bf16_ulp(value: float) -> float:
    return 2.0 ** (math.floor(math.log2(value)) - 7)


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(), (2,)])
def test_cuda_forward_against_diffusers(lead):
    """norm_out's row kernels (bitwise `final_adaln_out`'s): an element may move by a rounding of the normalised
    value, at most 2 bf16 ulps of the output's scale, and rarely (the bound of tests/nn/test_patch.py)."""
    x, norm_weight, shift, scale, row_index, _ = _case(S=2048, lead=lead, device="cuda", H_=GH, D_=GD)
    out = _call(x, norm_weight, shift, scale, row_index)
    want = _diffusers(x, norm_weight, shift, scale, row_index)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert (out == want).float().mean().item() >= 0.9999
    assert (out.float() - want.float()).abs().max().item() <= 2 * _bf16_ulp(want.abs().max().float().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,table_dtype", DTYPES[1:])
def test_cuda_falls_back_to_torch_for_other_dtypes(dtype, table_dtype):
    x, norm_weight, shift, scale, row_index, dy = _case(dtype=dtype, table_dtype=table_dtype, device="cuda",
                                                        H_=GH, D_=GD)
    out, grads = _grads(_call, (x, norm_weight, shift, scale), row_index, dy, table_dtype=table_dtype)
    assert torch.equal(out, _diffusers(x, norm_weight, shift, scale, row_index, table_dtype))
    cpu = _grads(_call, [t.cpu() for t in (x, norm_weight, shift, scale)], row_index.cpu(), dy.cpu(),
                 table_dtype=table_dtype)[1]
    for a, b in zip(grads, cpu):
        assert a.dtype == b.dtype and torch.allclose(a.cpu().double(), b.double(), rtol=1e-2, atol=1e-4)


@pytest.mark.gpu
def test_cuda_gradients_against_float64_repeatable_and_row_invariant():
    x, norm_weight, shift, scale, row_index, dy = _case(S=4097, device="cuda", H_=GH, D_=GD)
    leaves = (x, norm_weight, shift, scale)
    out, ours = _grads(_call, leaves, row_index, dy)
    _, again = _grads(_call, leaves, row_index, dy)
    assert all(torch.equal(a, b) for a, b in zip(ours, again))
    _, theirs = _grads(_diffusers, leaves, row_index, dy)
    _, golden = _grads(_golden, [t.double() for t in leaves], row_index, dy.double())
    for name, got, theirs_, gold in zip(("dx", "d_norm_weight", "d_shift", "d_scale"), ours, theirs, golden):
        assert _rel_l2(got, gold) <= _rel_l2(theirs_, gold), name
    rows = torch.randperm(4097, device="cuda")[:1000]
    sub_out, sub = _grads(_call, (x[rows], norm_weight, shift, scale), row_index[rows], dy[rows])
    assert torch.equal(sub_out, out[rows]) and torch.equal(sub[0], ours[0][rows])


@pytest.mark.gpu
def test_cuda_opcheck():
    x, norm_weight, shift, scale, row_index, dy = _case(S=100, lead=(2,), device="cuda", H_=GH, D_=GD)
    leaves = [t.detach().requires_grad_(True) for t in (x, norm_weight, shift, scale)]
    torch.library.opcheck(modulated_rms_norm_fwd, (*leaves, row_index, EPS, torch.bfloat16))
    _, rstd = modulated_rms_norm_fwd(x, norm_weight, shift, scale, row_index, EPS, torch.bfloat16)
    torch.library.opcheck(modulated_rms_norm_bwd, (dy, x, norm_weight, shift, scale, row_index, rstd))
