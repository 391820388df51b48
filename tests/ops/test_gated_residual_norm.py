"""The residual-stream fusions of an H3 block, each bitwise equal to the unfused ops with autograd adding the
residual's two gradients: `adaln_lab.gated_residual_norm` (the first gated residual and the second modulated
norm as one op; its launch ops, their routes and the columns their backward writes) and
`modulated_rms_norm_and_residual` (norm1 handing x on, its gradients summed in the norm's backward); CPU: their
torch code, GPU: gated_residual_norm.cu and norm_modulate_bwd_residual_sorted_bf16, including the torch add where a
row is too wide for three staged inputs."""

import warnings

import pytest
import torch

from adaln_lab import gated_residual, gated_residual_norm, modulated_rms_norm, modulation_table, row_order
from adaln_lab.ops import KernelFallbackWarning
from adaln_lab.ops.gated_residual_norm import launch
from adaln_lab.ops.gated_residual_norm.op import pair_route
from adaln_lab.ops.modulated_rms_norm import launch as norm_launch
from adaln_lab.ops.modulated_rms_norm import modulated_rms_norm_and_residual
from adaln_lab.reference import block as br
from adaln_lab.reference.backward import compute_dtype

from .test_modulated_rms_norm import DTYPES

H, D, T = 32, 16, 3
R = 3 * T
EPS = 1e-6


def _case(S=40, lead=(), dtype=torch.bfloat16, table_dtype=torch.bfloat16, seed=0, device="cpu", H_=H, D_=D):
    """x, y (*lead, S, H), norm_weight, gate, shift, scale (chunks of a real table), row_index, d_x_out, d_out."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, S, H_, generator=g) * 2).to(dtype)
    y = torch.randn(*lead, S, H_, generator=g).to(dtype)
    norm_weight = (0.5 + torch.rand(H_, generator=g)).to(dtype)
    temb = torch.randn(T, D_, generator=g)
    weight = (torch.randn(18 * H_, D_, generator=g) * D_ ** -0.5).to(table_dtype)
    bias = (torch.randn(18 * H_, generator=g) * 0.1).to(table_dtype)
    row_index = torch.randint(0, R, (S,), generator=g)
    out_dtype = torch.promote_types(dtype, table_dtype)
    d_x_out, d_out = (torch.randn(*lead, S, H_, generator=g).to(out_dtype) for _ in range(2))
    x, y, norm_weight, temb, weight, bias, row_index, d_x_out, d_out = (
        t.to(device) for t in (x, y, norm_weight, temb, weight, bias, row_index, d_x_out, d_out))
    chunks = br.table_chunks(modulation_table(temb, weight, bias), H_)
    gate, shift, scale = chunks[2], chunks[3], chunks[4]
    return (x, gate, y, norm_weight, shift, scale), row_index, d_x_out, d_out


def _fused(x, gate, y, norm_weight, shift, scale, row_index, table_dtype):
    return gated_residual_norm(x, gate, y, norm_weight, shift, scale, row_index, EPS, table_dtype=table_dtype)


def _separate(x, gate, y, norm_weight, shift, scale, row_index, table_dtype):
    x_out = gated_residual(x, gate, y, row_index, table_dtype=table_dtype)
    return x_out, modulated_rms_norm(x_out, norm_weight, shift, scale, row_index, EPS, table_dtype=table_dtype)


def _run(fn, leaves, row_index, d_x_out, d_out, table_dtype=torch.bfloat16):
    """(x_out, out, grads of x, gate, y, norm_weight, shift, scale) of one forward and backward."""
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    x_out, out = fn(*leaves, row_index, table_dtype)
    torch.autograd.backward((x_out, out), (d_x_out.to(x_out.dtype), d_out.to(out.dtype)))
    return [x_out.detach(), out.detach(), *[t.grad for t in leaves]]


def _assert_same_bits(got, want):
    names = ("x_out", "out", "dx", "d_gate", "d_y", "d_norm_weight", "d_shift", "d_scale")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype,table_dtype", DTYPES)
@pytest.mark.parametrize("lead", [(), (2,)])
def test_equals_the_two_ops_bit_for_bit(dtype, table_dtype, lead):
    leaves, row_index, d_x_out, d_out = _case(lead=lead, dtype=dtype, table_dtype=table_dtype)
    _assert_same_bits(_run(_fused, leaves, row_index, d_x_out, d_out, table_dtype),
                      _run(_separate, leaves, row_index, d_x_out, d_out, table_dtype))


def test_forward_is_diffusers_bit_for_bit():
    (x, gate, y, norm_weight, shift, scale), row_index, _, _ = _case(seed=1)
    x_out, out = _fused(x, gate, y, norm_weight, shift, scale, row_index, torch.bfloat16)
    want_x = x + gate.bfloat16().index_select(0, row_index) * y
    normed = torch.nn.functional.rms_norm(want_x, (H,), norm_weight, EPS)
    want = normed * (1 + scale.bfloat16().index_select(0, row_index)) + shift.bfloat16().index_select(0, row_index)
    assert torch.equal(x_out, want_x) and torch.equal(out, want)


def test_checks_its_arguments():
    (x, gate, y, norm_weight, shift, scale), row_index, _, _ = _case()
    with pytest.raises(ValueError, match="y of x's shape"):
        gated_residual_norm(x, gate, y[:-1], norm_weight, shift, scale, row_index)
    with pytest.raises(ValueError, match="norm_weight of shape"):
        gated_residual_norm(x, gate, y, norm_weight[:-1], shift, scale, row_index)
    with pytest.raises(ValueError, match="one shape"):
        gated_residual_norm(x, gate[:-1], y, norm_weight, shift, scale, row_index)
    with pytest.raises(ValueError, match="row_index"):
        gated_residual_norm(x, gate, y, norm_weight, shift, scale, row_index[:-1])


def _launch_forward(x, gate, y, row_index, norm_weight, shift, scale, table_dtype, route):
    """(x_out, out, rstd) written by the forward launch op into outputs allocated as the op's node allocates them."""
    x_dtype = torch.promote_types(x.dtype, torch.promote_types(table_dtype, y.dtype))
    x_out = torch.empty(x.shape, dtype=x_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(x_dtype, table_dtype), device=x.device)
    rstd = torch.empty(x.numel() // x.shape[-1], dtype=compute_dtype(x_out), device=x.device)
    launch.forward(x, gate, y, row_index, norm_weight, shift, scale, EPS, table_dtype, route, None, x_out, out, rstd)
    return x_out, out, rstd


def _launch_backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, table_dtype, route,
                     x_dtype, column=0, width=6):
    """(dx, d_y, d_norm_weight, d_table): the backward launch op writing d_gate | d_shift | d_scale into the columns
    [column, column + 3H) of a (R, width * H) float32 table gradient filled with NaN beforehand."""
    R, h = gate.shape
    dx = torch.empty(x_out.shape, dtype=x_dtype, device=x_out.device)
    d_y, d_norm_weight = torch.empty_like(y), torch.empty_like(norm_weight)
    d_table = torch.full((R, width * h), float("nan"), device=x_out.device)
    launch.backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, None, table_dtype,
                    route, dx, d_y, d_norm_weight, d_table, column, None)
    return dx, d_y, d_norm_weight, d_table


def _opcheck_launch_ops(leaves, row_index, d_x_out, d_out, table_dtype, route):
    """torch.library.opcheck on the pair's two launch ops (outputs allocated as the op's node allocates them), the
    backward with and without the row order, and on the norm's backward launch op with the residual's gradient."""
    x, gate, y, norm_weight, shift, scale = leaves
    x_out, out, rstd = _launch_forward(x, gate, y, row_index, norm_weight, shift, scale, table_dtype, route)
    torch.library.opcheck(launch.forward.op, (x, gate, y, row_index, norm_weight, shift, scale, EPS, table_dtype,
                                              route, None, torch.empty_like(x_out), torch.empty_like(out),
                                              torch.empty_like(rstd)))
    R, h = gate.shape
    d_x_out, d_out = d_x_out.to(x_out.dtype), d_out.to(out.dtype)
    d_table = torch.empty(R, 6 * h, dtype=torch.float32, device=x.device)
    for order in (None, row_order(row_index, R, h)):
        torch.library.opcheck(launch.backward.op, (d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift,
                                                   scale, rstd, order, table_dtype, route, torch.empty_like(x),
                                                   torch.empty_like(y), torch.empty_like(norm_weight), d_table,
                                                   2 * h, None))
    norm_route = route if route == "cupy" else route.split("+")[1]
    torch.library.opcheck(norm_launch.backward.op, (d_out, x_out, norm_weight, shift, scale, row_index, rstd, d_x_out,
                                                    None, norm_route, torch.empty_like(x_out),
                                                    torch.empty_like(norm_weight), d_table, 3 * h, None))


@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
def test_launch_ops_pass_opcheck(norm_dtype):
    leaves, row_index, d_x_out, d_out = _case(S=12)
    leaves = [*leaves[:3], leaves[3].to(norm_dtype), *leaves[4:]]
    _opcheck_launch_ops(leaves, row_index, d_x_out, d_out, torch.bfloat16, "torch+torch")


@pytest.mark.parametrize("column", [0, 2])
def test_launch_ops_give_the_ops_bits_and_write_their_columns_only(column):
    """The launch ops called directly: x_out, out and every gradient the op's, d_gate | d_shift | d_scale in the
    columns [column, column + 3H) of a (R, 6H) table gradient (a block's chunks 2, 3, 4 where column is 2), every
    other column untouched."""
    leaves, row_index, d_x_out, d_out = _case(S=30, lead=(2,), seed=4)
    x, gate, y, norm_weight, shift, scale = leaves
    want = _run(_fused, leaves, row_index, d_x_out, d_out)
    x_out, out, rstd = _launch_forward(x, gate, y, row_index, norm_weight, shift, scale, torch.bfloat16,
                                       "torch+torch")
    assert torch.equal(x_out, want[0]) and torch.equal(out, want[1])
    dx, d_y, d_norm_weight, d_table = _launch_backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift,
                                                       scale, rstd, torch.bfloat16, "torch+torch", x.dtype, column * H)
    chunks = [d_table[:, (column + i) * H:(column + i + 1) * H] for i in range(3)]
    _assert_same_bits([x_out, out, dx, chunks[0], d_y, d_norm_weight, chunks[1], chunks[2]], want)
    assert torch.cat([d_table[:, :column * H], d_table[:, (column + 3) * H:]], dim=1).isnan().all()


def test_route_is_each_ops_own_off_the_kernels():
    """On the CPU the pair's route is "torch+torch" (each op's torch code) for backend "auto" (no warning there) and
    "torch"; backend "cupy" refuses naming why; anything else is refused naming the option."""
    leaves, row_index, d_x_out, d_out = _case(S=12)
    x, gate, y, norm_weight, shift, scale = leaves
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        for backend in ("auto", "torch"):
            assert pair_route(x, gate, y, row_index, norm_weight, shift, scale, torch.bfloat16, backend,
                              "gated_residual_norm") == "torch+torch"
        auto = _run(_fused, leaves, row_index, d_x_out, d_out)
    torch_ = _run(lambda *a: gated_residual_norm(*a[:7], EPS, table_dtype=a[7], backend="torch"), leaves, row_index,
                  d_x_out, d_out)
    _assert_same_bits(torch_, auto)
    with pytest.raises(ValueError, match="the CUDA kernels need CUDA tensors, but x is on cpu"):
        gated_residual_norm(x, gate, y, norm_weight, shift, scale, row_index, backend="cupy")
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_residual_norm(x, gate, y, norm_weight, shift, scale, row_index, backend="cuda")


def test_rows_too_wide_for_three_staged_inputs_take_the_torch_add():
    from adaln_lab.core.plan import BWD_STAGE_BUDGET, plan

    assert plan(34816, 8, R).bwd_res_stages == 0 < plan(34816, 8, R).bwd_stages
    assert plan(5376, 8, R).bwd_res_stages == 4 and plan(5376, 8, R).bwd_res_smem <= BWD_STAGE_BUDGET


@pytest.mark.gpu
@pytest.mark.parametrize("H_,S,lead", [(5376, 1031, ()), (1024, 300, (2,)), (256, 0, ()), (10240, 40, ()),
                                       (16904, 9, ()), (34816, 5, ())])
def test_gpu_kernels_equal_the_two_ops_bit_for_bit(H_, S, lead):
    """H 5376 (the real block), leading dims, an empty batch, H 10240 and 16904 (3 and 1 stages of three
    inputs), and H 34816, whose three staged inputs do not fit (plan.bwd_res_stages == 0: the plain row pass
    and torch's add)."""
    leaves, row_index, d_x_out, d_out = _case(S=S, lead=lead, seed=H_, device="cuda", H_=H_, D_=64)
    got = _run(_fused, leaves, row_index, d_x_out, d_out)
    _assert_same_bits(got, _run(_separate, leaves, row_index, d_x_out, d_out))
    _assert_same_bits(_run(_fused, leaves, row_index, d_x_out, d_out), got)  # repeatable


@pytest.mark.gpu
def test_gpu_launch_ops_pass_opcheck_and_write_their_columns_only():
    """The launch ops on the kernels' route: opcheck, the op's bits, and the backward's d_gate | d_shift | d_scale in
    chunks 2, 3, 4 of a (R, 6H) float32 table gradient (the reduces' row stride 6H), no other column touched."""
    leaves, row_index, d_x_out, d_out = _case(S=300, lead=(2,), seed=10, device="cuda", H_=1024, D_=64)
    _opcheck_launch_ops(leaves, row_index, d_x_out, d_out, torch.bfloat16, "cupy")
    x, gate, y, norm_weight, shift, scale = leaves
    want = _run(_fused, leaves, row_index, d_x_out, d_out)
    x_out, out, rstd = _launch_forward(x, gate, y, row_index, norm_weight, shift, scale, torch.bfloat16, "cupy")
    dx, d_y, d_norm_weight, d_table = _launch_backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift,
                                                       scale, rstd, torch.bfloat16, "cupy", x.dtype, 2 * 1024)
    chunks = [d_table[:, (2 + i) * 1024:(3 + i) * 1024] for i in range(3)]
    _assert_same_bits([x_out, out, dx, chunks[0], d_y, d_norm_weight, chunks[1], chunks[2]], want)
    assert d_table[:, :2 * 1024].isnan().all() and d_table[:, 5 * 1024:].isnan().all()


@pytest.mark.gpu
def test_gpu_invalid_row_index_poisons_its_row_and_the_sums():
    leaves, row_index, d_x_out, d_out = _case(S=64, seed=9, device="cuda", H_=1024, D_=64)
    row_index = row_index.clone()
    row_index[5] = R
    x, gate, y, norm_weight, shift, scale = leaves
    x_out, out, rstd = _launch_forward(x, gate, y, row_index, norm_weight, shift, scale, torch.bfloat16, "cupy")
    assert x_out[5].isnan().all() and out[5].isnan().all()
    assert not x_out[torch.arange(64, device="cuda") != 5].isnan().any()
    d_x_out, d_out = d_x_out.to(x_out.dtype), d_out.to(out.dtype)
    dx, d_y, _, d_table = _launch_backward(d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd,
                                           torch.bfloat16, "cupy", x.dtype, width=3)
    d_gate, d_shift, d_scale = d_table.split(1024, dim=1)
    assert dx[5].isnan().all() and d_y[5].isnan().all()  # its row, and table row 0's sums (where it is counted)
    assert d_gate[0].isnan().all() and d_shift[0].isnan().all() and d_scale[0].isnan().all()


@pytest.mark.gpu
def test_gpu_norm_weight_of_another_dtype_keeps_the_gated_residual_kernel():
    """bf16 x, y and table with an fp32 norm_weight: the norm runs torch's code (warned, naming norm_weight), the
    gated residual its kernel (route "cupy+torch": fixed-order d_gate, repeatable), and the fused op gives the
    unfused ops' bits."""
    leaves, row_index, d_x_out, d_out = _case(S=300, seed=11, device="cuda", H_=1024, D_=64)
    leaves = [*leaves[:3], leaves[3].float(), *leaves[4:]]
    x, gate, y, norm_weight, shift, scale = leaves
    with pytest.warns(KernelFallbackWarning, match="gated_residual_norm: .*norm_weight in bfloat16"):
        assert pair_route(x, gate, y, row_index, norm_weight, shift, scale, torch.bfloat16, "auto",
                          "gated_residual_norm") == "cupy+torch"
    with pytest.warns(KernelFallbackWarning, match="gated_residual_norm: .*norm_weight in bfloat16"):
        got = _run(_fused, leaves, row_index, d_x_out, d_out)
    _assert_same_bits(got, _run(_separate, leaves, row_index, d_x_out, d_out))
    assert torch.equal(_run(_fused, leaves, row_index, d_x_out, d_out)[3], got[3])  # d_gate repeats


def _norm_and_x(fused):
    """fn(x, norm_weight, shift, scale, row_index, table_dtype) -> (out, x_next): norm1 and the residual stream
    after it (x * 2, so x's second gradient is not the first one's copy), with or without the fused sum."""
    def fn(x, norm_weight, shift, scale, row_index, table_dtype):
        if fused:
            out, x_again = modulated_rms_norm_and_residual(x, norm_weight, shift, scale, row_index, EPS,
                                                           table_dtype=table_dtype)
        else:
            out, x_again = modulated_rms_norm(x, norm_weight, shift, scale, row_index, EPS, table_dtype=table_dtype), x
        return out, x_again * 2
    return fn


def _run_norm(fused, device="cpu", dtype=torch.bfloat16, table_dtype=torch.bfloat16, **kw):
    (x, _, _, norm_weight, shift, scale), row_index, d_x_out, d_out = _case(device=device, dtype=dtype,
                                                                           table_dtype=table_dtype, **kw)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, norm_weight, shift, scale)]
    out, x_next = _norm_and_x(fused)(*leaves, row_index, table_dtype)
    torch.autograd.backward((out, x_next), (d_out.to(out.dtype), d_x_out.to(x_next.dtype)))
    return [out.detach(), x_next.detach(), *[t.grad for t in leaves]]


@pytest.mark.parametrize("dtype,table_dtype", DTYPES)
def test_norm_and_residual_equals_the_norm_with_x_reused(dtype, table_dtype):
    got, want = _run_norm(True, dtype=dtype, table_dtype=table_dtype), _run_norm(False, dtype=dtype,
                                                                                 table_dtype=table_dtype)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))


def test_norm_and_residual_returns_x_itself():
    (x, _, _, norm_weight, shift, scale), row_index, _, _ = _case()
    out, x_again = modulated_rms_norm_and_residual(x, norm_weight, shift, scale, row_index, EPS)
    assert x_again.data_ptr() == x.data_ptr() and torch.equal(x_again, x)
    assert torch.equal(out, modulated_rms_norm(x, norm_weight, shift, scale, row_index, EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("H_,S", [(5376, 1031), (256, 0), (34816, 5)])
def test_gpu_norm_and_residual_equals_the_norm_with_x_reused(H_, S):
    got = _run_norm(True, device="cuda", S=S, seed=H_, H_=H_, D_=64)
    want = _run_norm(False, device="cuda", S=S, seed=H_, H_=H_, D_=64)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
