"""`AdaLNOut` is diffusers' `MiniMaxH3AdaLayerNormOut`: same keys, same forward, bit for bit on the CPU."""

import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaln_lab
from adaln_lab import AdaLNOut
from adaln_lab.nn.adaln_out import AdaLNOutFallbackWarning

diffusers = pytest.importorskip("diffusers", reason="the test extra brings diffusers 0.42")
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormOut  # noqa: E402

H, D, T = 64, 32, 3


def _diffusers_module(seed, dtype, eps=1e-5, device="cpu"):
    torch.manual_seed(seed)
    module = MiniMaxH3AdaLayerNormOut(hidden_size=H, time_embed_dim=D, eps=eps)
    with torch.no_grad():  # RMSNorm starts at ones: make its weight matter
        module.norm.weight.uniform_(0.5, 1.5)
    return module.to(device=device, dtype=dtype)


def _inputs(seed, x_dtype, temb_dtype, lead=(2,), S=37, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, S, H, generator=g) * 3).to(device=device, dtype=x_dtype).requires_grad_()
    temb = (torch.randn(T, D, generator=g) * 2).to(device=device, dtype=temb_dtype).requires_grad_()
    idx = torch.randint(0, T, (S,), generator=g).to(device)
    dy = torch.randn(*lead, S, H, generator=g).to(device=device, dtype=x_dtype)
    return x, temb, idx, dy


def _run(module, x, temb, idx, dy):
    module.zero_grad(set_to_none=True)
    x, temb = x.detach().clone().requires_grad_(), temb.detach().clone().requires_grad_()
    out = module(x, temb, idx)
    out.backward(dy)
    grads = {"x": x.grad, "temb": temb.grad, **{n: p.grad.clone() for n, p in module.named_parameters()}}
    return out.detach(), grads


@pytest.mark.integration  # a process of its own
def test_import_does_not_import_diffusers():
    code = "import sys, adaln_lab; adaln_lab.AdaLNOut(16, 8, 1e-5); assert 'diffusers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_same_constructor_state_dict_and_repr_as_diffusers():
    ours, theirs = AdaLNOut(H, D, 1e-6), MiniMaxH3AdaLayerNormOut(H, D, 1e-6)
    assert ours.norm.eps == theirs.norm.eps == 1e-6
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b) == ["norm.weight", "linear.weight", "linear.bias"]
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    ours.load_state_dict(_diffusers_module(1, torch.float32).state_dict())
    theirs.load_state_dict(ours.state_dict())
    assert "backend='auto'" in repr(ours) and "table_backend='cuda'" in repr(ours)
    assert "backend='torch'" in repr(AdaLNOut(H, D, 1e-5, backend="torch", table_backend="torch"))


def test_constructor_refuses_unknown_options():
    with pytest.raises(ValueError, match="backend"):
        AdaLNOut(H, D, 1e-5, backend="triton")
    with pytest.raises(ValueError, match="table_backend"):
        AdaLNOut(H, D, 1e-5, table_backend="cublas")
    with pytest.raises(ValueError, match="backend"):
        AdaLNOut.from_diffusers(_diffusers_module(0, torch.float32), backend="triton")


# (parameter and x dtype, temb dtype): float32 temb is the MiniMax-H3 checkpoint (fp32 time_embedder,
# bf16 block stack); temb in the parameters' dtype is a model cast wholesale; the last two mix dtypes.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float16, torch.float16), (torch.bfloat16, torch.float16), (torch.float16, torch.float32)]


@pytest.mark.parametrize("dtype,temb_dtype", DTYPES)
@pytest.mark.parametrize("lead", [(), (2,)])
def test_forward_and_backward_bitwise_equal_diffusers(dtype, temb_dtype, lead):
    theirs = _diffusers_module(2, dtype)
    ours = AdaLNOut.from_diffusers(theirs)
    x, temb, idx, dy = _inputs(3, dtype, temb_dtype, lead)
    out_a, grads_a = _run(ours, x, temb, idx, dy)
    out_b, grads_b = _run(theirs, x, temb, idx, dy)
    assert out_a.dtype == out_b.dtype == dtype
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert grads_a[name].dtype == grads_b[name].dtype, name
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_module_built_by_constructor_equals_diffusers_with_same_weights():
    theirs = _diffusers_module(4, torch.bfloat16)
    ours = AdaLNOut(H, D, 1e-5).to(torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    x, temb, idx, dy = _inputs(5, torch.bfloat16, torch.float32)
    assert torch.equal(ours(x, temb, idx), theirs(x, temb, idx))


def test_from_diffusers_shares_parameters():
    theirs = _diffusers_module(6, torch.bfloat16, eps=1e-6).eval()
    ours = AdaLNOut.from_diffusers(theirs, backend="torch", table_backend="torch")
    assert ours.norm is theirs.norm and ours.linear is theirs.linear
    for (name_a, a), (name_b, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert name_a == name_b and a is b and a.data_ptr() == b.data_ptr()
        assert a.dtype == torch.bfloat16 and a.device == b.device
    assert ours.norm.eps == 1e-6 and not ours.training
    assert (ours.backend, ours.table_backend) == ("torch", "torch")
    with torch.no_grad():
        theirs.linear.bias.add_(1)  # an in-place update is seen by both
    x, temb, idx, _ = _inputs(7, torch.bfloat16, torch.float32)
    assert torch.equal(ours(x, temb, idx), theirs(x, temb, idx))


def test_to_diffusers_round_trip_shares_parameters():
    ours = AdaLNOut(H, D, 1e-5)
    back = ours.to_diffusers()
    assert type(back) is MiniMaxH3AdaLayerNormOut
    assert back.norm is ours.norm and back.linear is ours.linear
    assert list(back.state_dict()) == list(ours.state_dict())


def test_a_wrapped_or_hooked_submodule_runs_diffusers_forward_with_a_warning_once():
    """A wrapper (what PEFT puts in place of the Linear) or a hook on a submodule the module reads would be
    skipped by the op: every call runs diffusers' own forward instead, the same bits and gradients, and warns
    once per reason."""
    from adaln_lab.nn import AdaLNFallbackWarning

    module = _diffusers_module(8, torch.float32)
    module.linear = nn.Sequential(module.linear)
    ours = AdaLNOut.from_diffusers(module)
    x, temb, idx, _ = _inputs(9, torch.float32, torch.float32)
    want = module(x, temb, idx)
    with pytest.warns(AdaLNFallbackWarning, match="linear is a Sequential"):
        got = ours(x, temb, idx)
    assert torch.equal(got, want)
    got.sum().backward()
    assert module.linear[0].weight.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason: the second call is quiet
        ours(x, temb, idx)
    calls = []
    plain = AdaLNOut.from_diffusers(_diffusers_module(8, torch.float32))
    plain.norm.register_forward_hook(lambda *args: calls.append(1))
    with pytest.warns(AdaLNFallbackWarning, match="norm has forward_hooks"):
        plain(x, temb, idx)
    assert calls == [1]
    module = _diffusers_module(8, torch.float32)
    module.norm = nn.LayerNorm(H)
    with pytest.raises(TypeError, match="norm"):
        AdaLNOut.from_diffusers(module)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_silu_is_float32_silu_rounded_once(dtype):
    """Why a bf16 (fp16) temb may be widened to float32 for the kernels: torch's SiLU at that precision
    is the float32 SiLU rounded once, for every finite input (exhaustive)."""
    bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    values = values[torch.isfinite(values)]
    assert torch.equal(F.silu(values), F.silu(values.float()).to(dtype))


def test_cupy_backend_gets_bf16_temb_widened(monkeypatch):
    seen = {}

    def fake(x, norm_weight, temb, weight, bias, timestep_indices, eps=1e-5, **kwargs):
        seen.update(temb=temb, kwargs=kwargs, eps=eps)
        return x

    monkeypatch.setattr(adaln_lab.nn.adaln_out, "final_adaln_out", fake)
    ours = AdaLNOut.from_diffusers(_diffusers_module(9, torch.bfloat16, eps=1e-6), backend="cupy",
                                   table_backend="torch")
    x, temb, idx, _ = _inputs(10, torch.bfloat16, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(x, temb, idx)
    assert seen["temb"].dtype == torch.float32 and torch.equal(seen["temb"], temb.float())
    assert seen["kwargs"] == {"backend": "cupy", "table_backend": "torch"} and seen["eps"] == 1e-6


def test_cupy_backend_falls_back_with_a_warning_for_a_third_temb_dtype(monkeypatch):
    monkeypatch.setattr(adaln_lab.nn.adaln_out, "final_adaln_out", None)  # must not be reached
    theirs = _diffusers_module(11, torch.bfloat16)
    ours = AdaLNOut.from_diffusers(theirs, backend="cupy")
    x, temb, idx, _ = _inputs(12, torch.bfloat16, torch.float16)
    with pytest.warns(AdaLNOutFallbackWarning, match="torch.float16"):
        out = ours(x, temb, idx)
    assert torch.equal(out, theirs(x, temb, idx))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_rmsnorm_without_eps_uses_the_compute_dtype_epsilon(dtype):
    theirs = _diffusers_module(13, dtype)
    theirs.norm.eps = None  # nn.RMSNorm's default; F.rms_norm then uses its compute dtype's epsilon
    ours = AdaLNOut.from_diffusers(theirs)
    x, temb, idx, _ = _inputs(14, dtype, torch.float32)
    x = (x * 1e-3).detach()  # small rows, where eps matters
    assert torch.equal(ours(x, temb, idx), theirs(x, temb, idx))


# ---------------------------------------------------------------- GPU (H200) ----------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_silu_is_float32_silu_rounded_once_cuda(dtype):
    bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).cuda()
    values = bits.view(dtype)
    values = values[torch.isfinite(values)]
    assert torch.equal(F.silu(values), F.silu(values.float()).to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("temb_dtype", [torch.float32, torch.bfloat16])
def test_module_cuda_matches_diffusers(temb_dtype):
    """table_backend="torch": the table is diffusers' own cuBLAS table, so only the row pass can move an
    element, by a rounding (README: 99.9998 % bitwise at the seed's sizes)."""
    theirs = _diffusers_module(15, torch.bfloat16, device="cuda")
    ours = AdaLNOut.from_diffusers(theirs, table_backend="torch")
    x, temb, idx, dy = _inputs(16, torch.bfloat16, temb_dtype, lead=(2,), S=4096, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out_a, grads_a = _run(ours, x, temb, idx, dy)
    out_b, _ = _run(theirs, x, temb, idx, dy)
    assert (out_a == out_b).float().mean().item() >= 0.9999
    ulp = 2.0 ** (torch.floor(torch.log2(out_b.abs().max().float())).item() - 7)
    assert (out_a.float() - out_b.float()).abs().max().item() <= 2 * ulp
    assert grads_a["temb"].dtype == temb_dtype
    assert all(torch.isfinite(g).all() for g in grads_a.values())
