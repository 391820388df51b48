"""The residual-stream fusions of an H3 block, each bitwise equal to the unfused ops with autograd adding the
residual's two gradients: `adaln_lab.gated_residual_norm` (the first gated residual and the second modulated
norm as one op) and `modulated_rms_norm_and_residual` (norm1 handing x on, its gradients summed in the norm's
backward); CPU: their torch code, GPU: gated_residual_norm.cu and norm_modulate_bwd_residual_sorted_bf16,
including the torch add where a row is too wide for three staged inputs."""

import pytest
import torch

from adaln_lab import gated_residual, gated_residual_norm, modulated_rms_norm, modulation_table
from adaln_lab.ops.modulated_rms_norm import modulated_rms_norm_and_residual
from adaln_lab.reference import block as br

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


@pytest.mark.parametrize("norm_dtype", [torch.bfloat16, torch.float32])
def test_custom_ops_pass_opcheck(norm_dtype):
    (x, gate, y, norm_weight, shift, scale), row_index, d_x_out, d_out = _case(S=12)
    norm_weight = norm_weight.to(norm_dtype)
    gate, shift, scale = (t.detach() for t in (gate, shift, scale))
    x, gate, y = (t.detach().requires_grad_(True) for t in (x, gate, y))
    fwd = torch.ops.adaln_lab.gated_residual_norm_fwd.default
    torch.library.opcheck(fwd, (x, gate, y, row_index, norm_weight, shift, scale, EPS, torch.bfloat16))
    x_out, _, rstd = fwd(x.detach(), gate.detach(), y.detach(), row_index, norm_weight, shift, scale, EPS,
                         torch.bfloat16)
    torch.library.opcheck(torch.ops.adaln_lab.gated_residual_norm_bwd.default,
                          (d_x_out, d_out, x_out, gate.detach(), y.detach(), row_index, norm_weight, shift, scale,
                           rstd, torch.bfloat16, torch.bfloat16))
    torch.library.opcheck(torch.ops.adaln_lab.modulated_rms_norm_bwd.default,
                          (d_out, x_out, norm_weight, shift, scale, row_index, rstd, d_x_out))


def test_backward_ops_refuse_gradients_of_another_shape():
    (x, gate, y, norm_weight, shift, scale), row_index, d_x_out, d_out = _case(S=12, lead=(2,))
    x_out, _, rstd = torch.ops.adaln_lab.gated_residual_norm_fwd(x, gate, y, row_index, norm_weight, shift, scale,
                                                                  EPS, torch.bfloat16)
    with pytest.raises(ValueError, match="d_x_out of x_out's shape"):
        torch.ops.adaln_lab.gated_residual_norm_bwd(d_x_out[0], d_out, x_out, gate, y, row_index, norm_weight, shift,
                                                    scale, rstd, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="d_residual of x's shape"):
        torch.ops.adaln_lab.modulated_rms_norm_bwd(d_out, x_out, norm_weight, shift, scale, row_index, rstd,
                                                   d_x_out[0])


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
def test_gpu_invalid_row_index_poisons_its_row_and_the_sums():
    leaves, row_index, d_x_out, d_out = _case(S=64, seed=9, device="cuda", H_=1024, D_=64)
    row_index = row_index.clone()
    row_index[5] = R
    x, gate, y, norm_weight, shift, scale = leaves
    x_out, out, rstd = torch.ops.adaln_lab.gated_residual_norm_fwd(x, gate, y, row_index, norm_weight, shift, scale,
                                                                  EPS, torch.bfloat16)
    assert x_out[5].isnan().all() and out[5].isnan().all()
    assert not x_out[torch.arange(64, device="cuda") != 5].isnan().any()
    d_x_out, d_out = d_x_out.to(x_out.dtype), d_out.to(out.dtype)
    dx, d_gate, d_y, d_norm_weight, d_shift, d_scale = torch.ops.adaln_lab.gated_residual_norm_bwd(
        d_x_out, d_out, x_out, gate, y, row_index, norm_weight, shift, scale, rstd, torch.bfloat16, torch.bfloat16)
    assert dx[5].isnan().all() and d_y[5].isnan().all()  # its row, and table row 0's sums (where it is counted)
    assert d_gate[0].isnan().all() and d_shift[0].isnan().all() and d_scale[0].isnan().all()


@pytest.mark.gpu
def test_gpu_norm_weight_of_another_dtype_keeps_the_gated_residual_kernel():
    """bf16 x, y and table with an fp32 norm_weight: the norm runs torch's code, the gated residual its kernel
    (fixed-order d_gate, repeatable), and the fused op gives the unfused ops' bits."""
    leaves, row_index, d_x_out, d_out = _case(S=300, seed=11, device="cuda", H_=1024, D_=64)
    leaves = [*leaves[:3], leaves[3].float(), *leaves[4:]]
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
