"""`adaln_lab.modulated_rms_norm`: diffusers' `norm(x) * (1 + scale[i]) + shift[i]` bit for bit on the CPU, its
launch ops (`launch.forward` / `launch.backward`: opcheck, the columns the backward writes), an exact backward
(rows independent, parameter sums repeatable, at least as accurate as diffusers' against float64), torch.compile
and compiled autograd, `backend=`; GPU: norm_out's kernels on the table rows, fallbacks (warned), the same
gradient checks."""

import math

import pytest
import torch

from adaln_lab import modulated_rms_norm, modulation_table, row_order
from adaln_lab.ops import KernelFallbackWarning
from adaln_lab.ops.modulated_rms_norm import launch, modulated_rms_norm_and_residual
from adaln_lab.reference import block as br
from adaln_lab.reference.backward import compute_dtype

from .contract import assert_eager_bits_under_compiled_autograd_and_checkpointing, rel_l2

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


def _launch_forward(x, norm_weight, shift, scale, row_index, table_dtype, route="torch"):
    """(out, rstd) written by the forward launch op into outputs allocated as the op's Function allocates them."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, table_dtype), device=x.device)
    rstd = torch.empty(x.numel() // x.shape[-1], dtype=compute_dtype(x), device=x.device)
    launch.forward(x, norm_weight, shift, scale, row_index, EPS, table_dtype, route, None, 0, out, rstd)
    return out, rstd


def _saved_rstd(out, rows):
    """The rstd the op's autograd node saved for its backward (the one floating (rows,) tensor it saved)."""
    saved = [t for t in out.grad_fn.saved_tensors
             if t is not None and t.is_floating_point() and t.shape == (rows,)]
    assert len(saved) == 1
    return saved[0]


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
    launched, rstd = _launch_forward(x, norm_weight, shift, scale, row_index, table_dtype)
    assert torch.equal(launched, want)
    expected_rstd = torch.rsqrt(x.to(rstd.dtype).pow(2).mean(-1) + EPS).reshape(-1)
    assert torch.equal(rstd, expected_rstd)
    saved = _saved_rstd(_call(x.detach().requires_grad_(True), norm_weight, shift, scale, row_index, table_dtype),
                        x.numel() // H)  # what the op's node allocates, the launch op writes and the backward reads
    assert saved.dtype == torch.promote_types(dtype, torch.float32) and torch.equal(saved, expected_rstd)


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
        err = rel_l2(got, gold)
        assert err <= rel_l2(theirs_, gold), name
        floor = rel_l2(gold.to(got.dtype), gold)
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


@pytest.mark.parametrize("column", [0, 2])
def test_backward_op_formulas_by_hand(column):
    """One row per table row, H = 4: dx, d_norm_weight, d_shift, d_scale of the backward launch op against the
    formulas of the docstring; d_shift | d_scale land in the columns [column, column + 2H) of a (R, 6H) table
    gradient (a block's chunks, in chunk `column` on), every other column untouched."""
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.25, 0.0, -1.0, 2.0]])
    norm_weight = torch.tensor([1.0, 0.5, 2.0, 1.5])
    shift = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, -0.5, 0.5, 1.0]])
    scale = torch.tensor([[0.5, -0.25, 0.0, 1.0], [2.0, 0.0, -0.5, 0.25]])
    row_index = torch.tensor([1, 0])
    dy = torch.tensor([[1.0, 2.0, -1.0, 0.5], [-0.5, 1.0, 1.0, 2.0]])
    _, rstd = _launch_forward(x, norm_weight, shift, scale, row_index, torch.float32)
    h = x.shape[-1]
    dx, d_nw = torch.empty_like(x), torch.empty_like(norm_weight)
    d_table = torch.full((2, 6 * h), float("nan"))
    launch.backward(dy, x, norm_weight, shift, scale, row_index, rstd, None, None, "torch", dx, d_nw, d_table,
                    column * h, None)
    d_shift, d_scale = d_table[:, column * h:(column + 1) * h], d_table[:, (column + 1) * h:(column + 2) * h]
    untouched = torch.cat([d_table[:, :column * h], d_table[:, (column + 2) * h:]], dim=1)
    assert untouched.isnan().all()
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


def _opcheck_launch_ops(x, norm_weight, shift, scale, row_index, dy, table_dtype, route):
    """torch.library.opcheck on the two launch ops (each writing outputs allocated as the op's node does), the
    backward with and without the residual's gradient and the row order."""
    _, rstd = _launch_forward(x, norm_weight, shift, scale, row_index, table_dtype, route)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, table_dtype), device=x.device)
    torch.library.opcheck(launch.forward.op, (x, norm_weight, shift, scale, row_index, EPS, table_dtype, route, None,
                                              0, out, torch.empty_like(rstd)))
    R, h = shift.shape
    dx, d_norm_weight = torch.empty_like(x), torch.empty_like(norm_weight)
    d_table = torch.empty(R, 6 * h, dtype=torch.float32, device=x.device)
    dy = dy.to(out.dtype)
    for d_residual, order in ((None, None), (torch.ones_like(x), row_order(row_index, R, h))):
        torch.library.opcheck(launch.backward.op, (dy, x, norm_weight, shift, scale, row_index, rstd, d_residual,
                                                   order, route, dx, d_norm_weight, d_table, 2 * h, None))


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case):
    kwargs = OPCHECK_CASES[case]
    x, norm_weight, shift, scale, row_index, dy = _case(**kwargs)
    _opcheck_launch_ops(x, norm_weight, shift, scale, row_index, dy, kwargs.get("table_dtype", torch.bfloat16),
                        "torch")


def test_compile_fullgraph_matches_eager():
    x, norm_weight, shift, scale, row_index, dy = _case(S=33, lead=(2,))
    compiled = torch.compile(_call, fullgraph=True, backend="aot_eager")
    eager_out, eager = _grads(_call, (x, norm_weight, shift, scale), row_index, dy)
    out, traced = _grads(compiled, (x, norm_weight, shift, scale), row_index, dy)
    assert torch.equal(out, eager_out) and all(torch.equal(a, b) for a, b in zip(eager, traced))


def _norm_and_residual(x, norm_weight, shift, scale, row_index):
    out, x_again = modulated_rms_norm_and_residual(x, norm_weight, shift, scale, row_index, EPS)
    return out + x_again * 2  # x's second gradient reaches the node through the handed-on x


@pytest.mark.parametrize("fn", [_call, _norm_and_residual], ids=["norm", "norm_and_residual"])
def test_compiled_autograd_and_checkpointing_give_the_eager_bits(fn):
    """The op's one autograd node under compiled autograd (its backward traced, the launch op an opaque node) and
    under torch.utils.checkpoint (the forward run again in the backward, reentrant or not): eager's bits."""
    x, norm_weight, shift, scale, row_index, dy = _case(S=33, lead=(2,), seed=3)
    assert_eager_bits_under_compiled_autograd_and_checkpointing(fn, (x, norm_weight, shift, scale), row_index, dy,
                                                                _grads)


def test_backend_option():
    """backend "torch" is "auto"'s CPU route, bit for bit; "cupy" refuses CPU tensors naming why; anything else is
    refused naming the option. On the CPU "auto" runs the torch code without a warning."""
    import warnings

    x, norm_weight, shift, scale, row_index, dy = _case(S=21, seed=7)
    leaves = (x, norm_weight, shift, scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        auto = _grads(modulated_rms_norm, leaves, row_index, dy)
    torch_ = _grads(lambda *a: modulated_rms_norm(*a, backend="torch"), leaves, row_index, dy)
    assert torch.equal(auto[0], torch_[0]) and all(torch.equal(a, b) for a, b in zip(auto[1], torch_[1]))
    with pytest.raises(ValueError, match="the CUDA kernels need CUDA tensors, but x is on cpu"):
        modulated_rms_norm(x, norm_weight, shift, scale, row_index, backend="cupy")
    with pytest.raises(ValueError, match="the CUDA kernels need CUDA tensors, but x is on cpu"):
        modulated_rms_norm_and_residual(x, norm_weight, shift, scale, row_index, backend="cupy")
    with pytest.raises(ValueError, match="backend must be one of"):
        modulated_rms_norm(x, norm_weight, shift, scale, row_index, backend="cuda")


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
    """backend "auto" warns KernelFallbackWarning naming the reason and runs the torch code (the CPU's gradients);
    backend "cupy" refuses the same inputs."""
    x, norm_weight, shift, scale, row_index, dy = _case(dtype=dtype, table_dtype=table_dtype, device="cuda",
                                                        H_=GH, D_=GD)
    with pytest.warns(KernelFallbackWarning, match="modulated_rms_norm: the CUDA kernels cannot take these inputs "
                                                   r"\(the CUDA kernels need .* bfloat16"):
        out, grads = _grads(_call, (x, norm_weight, shift, scale), row_index, dy, table_dtype=table_dtype)
    with pytest.raises(TypeError, match="bfloat16"):
        modulated_rms_norm(x, norm_weight, shift, scale, row_index, EPS, table_dtype=table_dtype, backend="cupy")
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
        assert rel_l2(got, gold) <= rel_l2(theirs_, gold), name
    rows = torch.randperm(4097, device="cuda")[:1000]
    sub_out, sub = _grads(_call, (x[rows], norm_weight, shift, scale), row_index[rows], dy[rows])
    assert torch.equal(sub_out, out[rows]) and torch.equal(sub[0], ours[0][rows])


@pytest.mark.gpu
def test_cuda_opcheck():
    """The launch ops on the kernels' route: opcheck, and the backward writing the op's own bits into the columns
    [2H, 4H) of a (R, 6H) float32 table gradient (the reduce's row stride 6H), no other column touched."""
    x, norm_weight, shift, scale, row_index, dy = _case(S=100, lead=(2,), device="cuda", H_=GH, D_=GD)
    _opcheck_launch_ops(x, norm_weight, shift, scale, row_index, dy, torch.bfloat16, "cupy")
    out, grads = _grads(_call, (x, norm_weight, shift, scale), row_index, dy)
    launched, rstd = _launch_forward(x, norm_weight, shift, scale, row_index, torch.bfloat16, "cupy")
    assert torch.equal(launched, out)
    dx, d_norm_weight = torch.empty_like(x), torch.empty_like(norm_weight)
    d_table = torch.full((R, 6 * GH), float("nan"), device="cuda")
    launch.backward(dy, x, norm_weight, shift, scale, row_index, rstd, None, None, "cupy", dx, d_norm_weight,
                    d_table, 2 * GH, None)
    assert torch.equal(dx, grads[0]) and torch.equal(d_norm_weight, grads[1])
    assert torch.equal(d_table[:, 2 * GH:3 * GH], grads[2]) and torch.equal(d_table[:, 3 * GH:4 * GH], grads[3])
    assert d_table[:, :2 * GH].isnan().all() and d_table[:, 4 * GH:].isnan().all()
